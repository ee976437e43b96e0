"""Plan vs compiled program: collectives and memory, side by side.

:func:`verify` compiles the lowered step once more with a dump of the HLO right after SPMD
partitioning, parses its collectives (:mod:`autopar.verify.hlo`) and compares, per kind,
what ``plan.predicted.collectives`` said with what XLA emitted:

* bytes per step, per device, in the convention of :mod:`autopar.verify.hlo`, must agree
  within :data:`BYTES_TOLERANCE`. ``PredictedCollective.bytes`` is read as the *total* of
  its ``count`` executions in one step (what ``autopar.search.evaluate_plan`` writes:
  ``sum(weight * nbytes)`` per kind, axes and class); the HLO side is
  ``sum(HloCollective.bytes * count)``;
* kinds the plan did not predict are *unplanned*; one moving more than
  :data:`UNPLANNED_SHARE` of the step's collective bytes fails the check;
* peak memory per device: ``plan.predicted.memory_bytes_per_device`` against
  ``memory_analysis()`` (argument + output + temp - alias, compiled with CPU scratch
  counted) within :data:`MEMORY_TOLERANCE`.

Counts are shown but not checked: XLA emits one collective per tensor where a cost model
may price a fused bucket.

Pipeline plans (``plan.pipeline`` over a ``pipe`` axis): the stage-to-stage
``collective-permute`` s sit in the tick loop and count once per tick (what
``autopar.evaluate`` predicts, exactly); collectives inside a stage's forward or backward
piece count once per microbatch, not per tick (:func:`_pipeline_pieces`).

Example:
    >>> lowered = autopar.lower.lower_plan(step, plan, (state, batch), graph=graph)
    >>> report = verify(plan, lowered, state, batch)
    >>> print(report)
    verify: plan 'autopar'
    ...
    │ all-reduce  │ 1/1 │ 64.0 KiB │ 64.0 KiB │ +0.0% │ 100.0% │ tensor/tensor │ ok │
    │ peak memory │     │ 3.7 MiB │ 3.1 MiB │ ...   │        │               │ ok │
    ...
    ok: True
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import jax

from autopar.lower.remat import GUARD_SCOPE
from autopar.plan import Plan
from autopar.trace.tensor import itemsize
from autopar.verify.hlo import (
    KINDS,
    HloCollective,
    _as_lowered,
    dump_spmd_hlo,
    group_axes,
    parse_collectives,
)

BYTES_TOLERANCE = 0.10
"""Relative tolerance on collective bytes per step, per kind."""
MEMORY_TOLERANCE = 0.20
"""Relative tolerance on peak memory per device."""
UNPLANNED_SHARE = 0.01
"""An unpredicted kind moving more than this share of the step's collective bytes fails."""

_CPU_MEMORY_OPTIONS = {"xla_cpu_experimental_ynn_fusion_type": ""}
_PREDICTED_ALIASES = {"p2p": "collective-permute", "send-recv": "collective-permute"}


@dataclass(frozen=True)
class VerifyRow:
    """One collective kind: predicted vs compiled.

    Attributes:
        kind: collective kind.
        predicted_count / predicted_bytes: executions and bytes per step (``None`` if the
            plan predicted none of this kind).
        hlo_count / hlo_bytes: the same in the partitioned HLO.
        predicted_axes / hlo_axes: mesh axes involved.
        status: ``"ok"``, ``"bytes"`` (outside the tolerance), ``"missing"`` (predicted but
            not emitted), ``"unplanned"`` (emitted, not predicted, above the share) or
            ``"minor"`` (unplanned but below the share).
        share: this kind's share of the step's HLO collective bytes.
    """

    kind: str
    predicted_count: int | None
    predicted_bytes: float | None
    hlo_count: int
    hlo_bytes: float
    predicted_axes: tuple[str, ...] = ()
    hlo_axes: tuple[str, ...] = ()
    status: str = "ok"
    share: float = 0.0

    @property
    def ok(self) -> bool:
        return self.status in ("ok", "minor")

    @property
    def bytes_error(self) -> float | None:
        """Relative error of the predicted bytes against the HLO's (``None``: nothing to
        compare, i.e. unpredicted or absent from the HLO)."""
        if self.predicted_bytes is None:
            return None
        if self.hlo_bytes == 0:  # nothing emitted: "missing" says it, no ratio to show
            return 0.0 if self.predicted_bytes == 0 else None
        return (self.predicted_bytes - self.hlo_bytes) / self.hlo_bytes


@dataclass(frozen=True)
class MemoryRow:
    """Peak bytes per device: predicted vs ``memory_analysis()``.

    The plan's memory model assumes the state is updated in place (donated). A program
    compiled without donation also holds the new state beside the old: ``undonated_bytes``
    (the updated state's bytes per device that the program did not alias) is added to
    the prediction so both sides describe the same program.
    """

    predicted_bytes: float
    compiled_bytes: float
    argument_bytes: float
    output_bytes: float
    temp_bytes: float
    alias_bytes: float
    undonated_bytes: float = 0.0

    @property
    def checked(self) -> bool:
        return self.predicted_bytes > 0

    @property
    def error(self) -> float | None:
        if not self.checked or self.compiled_bytes <= 0:
            return None
        return (self.predicted_bytes - self.compiled_bytes) / self.compiled_bytes

    @property
    def ok(self) -> bool:
        err = self.error
        return err is None or abs(err) <= MEMORY_TOLERANCE


@dataclass(frozen=True)
class VerifyReport:
    """What :func:`verify` found. ``str(report)`` is a table.

    Attributes:
        plan_name: the plan's name.
        rows: one :class:`VerifyRow` per collective kind seen or predicted.
        memory: the memory comparison (``None`` if it could not be measured).
        collectives: every collective parsed from the HLO.
        predicted: whether the plan carried a collective prediction at all.
        notes: caveats (unknown trip counts, final instead of partitioned HLO, ...).
    """

    plan_name: str
    rows: tuple[VerifyRow, ...]
    memory: MemoryRow | None
    collectives: tuple[HloCollective, ...] = ()
    predicted: bool = True
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def ok(self) -> bool:
        """Every kind within tolerance, nothing big unplanned, memory within tolerance."""
        return (
            self.predicted
            and all(r.ok for r in self.rows)
            and (self.memory is None or self.memory.ok)
        )

    def row(self, kind: str) -> VerifyRow | None:
        for r in self.rows:
            if r.kind == kind:
                return r
        return None

    def hlo_bytes(self, kind: str | None = None) -> float:
        """HLO collective bytes per step (of one kind, or all)."""
        return sum(c.total_bytes for c in self.collectives if kind is None or c.kind == kind)

    def to_text(self, width: int = 120) -> str:
        """The report as a fixed-width table (rich), one row per kind plus peak memory."""
        from rich.console import Console
        from rich.table import Table

        table = Table(title=f"verify: plan {self.plan_name!r}")
        table.add_column("collective", no_wrap=True)
        for col in ("count pred/HLO", "bytes pred", "bytes HLO", "error", "share"):
            table.add_column(col, justify="right", no_wrap=True)
        table.add_column("axes pred/HLO", no_wrap=True)
        table.add_column("status", no_wrap=True)
        for r in self.rows:
            err = r.bytes_error
            table.add_row(
                r.kind,
                f"{'-' if r.predicted_count is None else r.predicted_count}/{r.hlo_count}",
                "-" if r.predicted_bytes is None else _fmt_bytes(r.predicted_bytes),
                _fmt_bytes(r.hlo_bytes),
                "-" if err is None else f"{err:+.1%}",
                f"{r.share:.1%}",
                f"{','.join(r.predicted_axes) or '-'}/{','.join(r.hlo_axes) or '-'}",
                r.status,
            )
        m = self.memory
        if m is not None:
            err = m.error
            table.add_row(
                "peak memory",
                "",
                _fmt_bytes(m.predicted_bytes) if m.checked else "-",
                _fmt_bytes(m.compiled_bytes),
                "-" if err is None else f"{err:+.1%}",
                "",
                "",
                ("ok" if m.ok else "memory") if m.checked else "unpredicted",
            )
        console = Console(width=width, record=True, file=_Null())
        console.print(table)
        lines = [console.export_text().rstrip()]
        if m is not None:
            lines.append(
                f"memory_analysis: argument {_fmt_bytes(m.argument_bytes)} + output "
                f"{_fmt_bytes(m.output_bytes)} + temp {_fmt_bytes(m.temp_bytes)} - alias "
                f"{_fmt_bytes(m.alias_bytes)}"
            )
            if m.undonated_bytes:
                lines.append(
                    f"prediction includes {_fmt_bytes(m.undonated_bytes)} of new state beside "
                    "the old: the state was not donated (pass donate_argnums to update it in "
                    "place)"
                )
        lines.extend(f"note: {n}" for n in self.notes)
        lines.append(f"ok: {self.ok}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.to_text()


class _Null:
    def write(self, _s: str) -> int:
        return 0

    def flush(self) -> None:
        pass


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.2f}"


def state_bytes_per_device(plan: Plan) -> float:
    """Bytes per device of the inputs a step replaces (parameters, optimizer and model
    state), laid out as the plan stores them: what donation lets the program alias."""
    total = 0.0
    for rec in plan.inputs:
        if rec.role not in ("param", "opt_state", "model_state"):
            continue
        size = math.prod(rec.shape) * itemsize(rec.dtype)
        split = 1
        for entry in rec.spec:
            for axis in (entry,) if isinstance(entry, str) else (entry or ()):
                split *= plan.mesh[axis]
        total += size / split
    return total


def _memory(obj: Any, args: Sequence[Any], plan: Plan) -> MemoryRow | None:
    stats = None
    if hasattr(obj, "memory_analysis") and hasattr(obj, "abstract_args"):
        stats = obj.memory_analysis(*args)  # LoweredStep: compiled with scratch counted
    elif hasattr(obj, "memory_analysis") and not hasattr(obj, "compiler_ir"):
        stats = obj.memory_analysis()  # Compiled
    else:
        lowered = _as_lowered(obj, args)
        opts = _CPU_MEMORY_OPTIONS if jax.default_backend() == "cpu" else {}
        stats = lowered.compile(compiler_options=opts).memory_analysis()
    if stats is None:
        return None
    return memory_row(stats, plan)


def compiled_peak_bytes(stats: Any) -> float:
    """The peak bytes per device of a compiled program, from its ``memory_analysis()``:
    arguments + outputs + temporaries - the outputs aliased onto (donated) arguments.

    Example:
        >>> from types import SimpleNamespace
        >>> compiled_peak_bytes(SimpleNamespace(argument_size_in_bytes=100,
        ...     output_size_in_bytes=40, temp_size_in_bytes=60, alias_size_in_bytes=40))
        160.0
    """
    return float(
        stats.argument_size_in_bytes
        + stats.output_size_in_bytes
        + stats.temp_size_in_bytes
        - stats.alias_size_in_bytes
    )


def memory_row(stats: Any, plan: Plan, predicted_bytes: float | None = None) -> MemoryRow:
    """Compiled peak bytes per device (``memory_analysis()`` ``stats``: arguments +
    outputs + temporaries - aliases) against the prediction (``predicted_bytes``, default
    the plan's), plus the new state a program compiled without donation holds beside the
    old (:func:`state_bytes_per_device` not aliased): what :func:`verify` compares.

    Example:
        >>> row = memory_row(lowered.memory_analysis(*args), plan)  # doctest: +SKIP
        >>> row.ok  # doctest: +SKIP
        True
    """
    arg, out = float(stats.argument_size_in_bytes), float(stats.output_size_in_bytes)
    temp, alias = float(stats.temp_size_in_bytes), float(stats.alias_size_in_bytes)
    if predicted_bytes is None:
        predicted_bytes = plan.predicted.memory_bytes_per_device
    predicted = float(predicted_bytes)
    undonated = max(0.0, state_bytes_per_device(plan) - alias) if predicted > 0 else 0.0
    return MemoryRow(
        predicted + undonated, compiled_peak_bytes(stats), arg, out, temp, alias, undonated
    )


def _pipeline_pieces(
    plan: Plan, colls: list[HloCollective]
) -> tuple[list[HloCollective], str | None]:
    """A pipeline's collectives inside one stage's forward or backward piece, counted as
    often as that piece runs: ``M`` times per step, not every tick.

    The pipeline (:mod:`autopar.lower.pipeline`) runs a ``lax.switch`` every tick over
    ``1 + 2 n`` branches (idle, then the ``n`` stages' (chunks') forward and backward
    pieces); the HLO parser counts every branch of a conditional each time it runs. A
    piece runs once per microbatch on its stage's devices, so its collectives count ``M``
    per step and a row adds the stages up (what the cost model's per-microbatch work,
    over all stages, times ``M`` predicts)."""
    pp = plan.pipeline
    if pp is None or pp.num_stages < 2:
        return colls, None
    from autopar.errors import LowerPlanError
    from autopar.lower.pipeline import make_schedule

    try:
        p_dev = plan.mesh.get("pipe", pp.num_stages)
        sched = make_schedule(pp.schedule, p_dev, pp.microbatches, pp.virtual_stages)
    except LowerPlanError:
        return colls, None
    ticks, m, n = len(sched.ticks), pp.microbatches, 2 * len(pp.stages) + 1
    out, moved = [], 0
    for c in colls:
        piece = next((b for b in c.branches if b[2] == n and b[1] > 0), None)
        if piece is not None and c.count % ticks == 0:
            c = dataclasses.replace(c, count=c.count // ticks * m)
            moved += 1
        out.append(c)
    if not moved:
        return out, None
    return out, (
        f"{moved} collective(s) inside a stage's piece count {m} runs per step (one per "
        f"microbatch; the pipeline's switch runs one piece per tick of {ticks}); rows add "
        "the stages up"
    )


def verify(
    plan: Plan,
    lowered: Any,
    *args: Any,
    hlo_text: str | None = None,
    check_memory: bool = True,
) -> VerifyReport:
    """Compare the plan's predicted collectives and memory with what XLA compiled.

    Args:
        plan: the plan, with ``predicted`` filled (``autopar.evaluate`` for baselines).
        lowered: an :class:`autopar.lower.LoweredStep`, a ``jax.stages.Lowered``, a
            ``jax.jit`` function (then ``args`` are needed) or a ``jax.stages.Compiled``
            (then only its final HLO is available: reduce-scatters show as
            all-reduce + dynamic-slice only if XLA kept them apart).
        *args: the step's arguments (arrays or ``jax.ShapeDtypeStruct``), if needed to lower.
        hlo_text: HLO to parse instead of dumping (e.g. a saved dump).
        check_memory: also compile for ``memory_analysis()``.

    Returns:
        A :class:`VerifyReport`; ``report.ok`` says whether everything matched.

    Example:
        >>> lowered = autopar.lower.lower_plan(step, plan, (state, batch), graph=graph)
        >>> report = verify(plan, lowered, check_memory=False)  # collectives only
        >>> report.ok, [(r.kind, r.status) for r in report.rows]
        (True, [('all-reduce', 'ok')])
    """
    notes: list[str] = []
    is_compiled = hasattr(lowered, "as_text") and not hasattr(lowered, "compiler_ir")
    is_compiled = (
        is_compiled
        and not hasattr(lowered, "abstract_args")
        and hasattr(lowered, "memory_analysis")
    )
    if hlo_text is None:
        if is_compiled:
            hlo_text = lowered.as_text()
            notes.append("parsed the final compiled HLO, not the partitioned one")
        else:
            hlo_text = dump_spmd_hlo(lowered, *args)
    colls = parse_collectives(hlo_text, plan.num_devices)
    guards = [c for c in colls if GUARD_SCOPE in c.op_name]
    if guards:
        colls = [c for c in colls if GUARD_SCOPE not in c.op_name]
        notes.append(
            f"left out {len(guards)} scalar collective(s) ({sum(c.total_bytes for c in guards):g} "
            "B) of the lowering's ordering guard (XLA:CPU only, autopar.lower.remat.default_guard)"
        )
    if any(not c.trip_count_known for c in colls):
        notes.append("a loop trip count could not be read; its collectives count once")
    colls, note = _pipeline_pieces(plan, colls)
    if note:
        notes.append(note)

    mesh = dict(plan.mesh)
    total = sum(c.total_bytes for c in colls)
    predicted_colls = list(plan.predicted.collectives)
    rows: list[VerifyRow] = []
    pred_kinds = {_PREDICTED_ALIASES.get(p.kind, p.kind) for p in predicted_colls}
    seen = {c.kind for c in colls}
    for kind in [k for k in KINDS if k in pred_kinds | seen] + sorted(pred_kinds - set(KINDS)):
        mine = [c for c in colls if c.kind == kind]
        theirs = [p for p in predicted_colls if _PREDICTED_ALIASES.get(p.kind, p.kind) == kind]
        hlo_b = sum(c.total_bytes for c in mine)
        hlo_n = sum(c.count for c in mine)
        axes: set[str] = set()
        for c in mine:
            axes.update(group_axes(c.replica_groups, mesh) if c.replica_groups else ())
        hlo_axes = tuple(a for a in mesh if a in axes)
        share = hlo_b / total if total else 0.0
        if theirs:
            pb = float(sum(p.bytes for p in theirs))  # totals per step
            pn = int(sum(p.count for p in theirs))
            paxes_set = {a for p in theirs for a in p.axes}
            paxes = tuple(a for a in mesh if a in paxes_set)
            if not mine:
                status = "ok" if pb == 0 else "missing"
            else:
                status = "ok" if abs(pb - hlo_b) <= BYTES_TOLERANCE * hlo_b else "bytes"
            rows.append(VerifyRow(kind, pn, pb, hlo_n, hlo_b, paxes, hlo_axes, status, share))
        else:
            status = "unplanned" if share > UNPLANNED_SHARE else "minor"
            rows.append(VerifyRow(kind, None, None, hlo_n, hlo_b, (), hlo_axes, status, share))

    predicted = bool(predicted_colls) or plan.predicted.step_time_s > 0
    if not predicted:
        notes.append("the plan carries no prediction: score it with autopar.evaluate first")
    memory = None
    if check_memory:
        memory = _memory(lowered, args, plan)
    return VerifyReport(
        plan_name=plan.name,
        rows=tuple(rows),
        memory=memory,
        collectives=tuple(colls),
        predicted=predicted,
        notes=tuple(notes),
    )
