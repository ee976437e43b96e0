"""One sweep point: autopar's plan and each baseline's, all priced by the planner's model.

Every plan is scored by the cost model the planner itself uses: a plan without a pipeline
by :func:`autopar.search.evaluate_plan` (with its microbatches accumulated, as the
planner prices its own microbatched plans), a pipeline by
:func:`autopar.search.outer.price_pipeline` (the runtime's layout, the stages' layouts
pinned, :func:`autopar.search.stages.evaluate_pipeline` of the program it lowers to).

The baselines, each as its practitioners configure it:

* ``data_parallel``: the batch over every device, everything replicated; gradient
  accumulation with the fewest microbatches that fit (PyTorch DDP / ``jax.pmap`` practice).
* ``zero3``: ZeRO stage 3 / FSDP over every device (Rajbhandari et al. 2020), the fewest
  microbatches that fit.
* ``megatron_3d``: the Megatron-LM heuristic (Narayanan et al. 2021, section 3.3 "tensor
  parallelism up to the GPUs of a node, pipeline parallelism to fit the model, data
  parallelism over the rest"): tensor ``t`` = the node's devices (or all, if fewer),
  lowered to a divisor of the heads when it does not divide them (Megatron requires it);
  the fewest pipeline stages ``p`` (dividing the layers) whose state fits; data the rest;
  microbatch size 1 and full activation recomputation (the paper's Table 1 runs);
  interleaved 1F1B with 2 chunks per device when a stage's layers split in two, else 1F1B.
* ``fsdp_tensor``: FSDP + tensor as MaxText configures it (``ici_fsdp_parallelism`` the
  rest, ``ici_tensor_parallelism`` = the suite's ``fsdp_tensor.tensor``, default 4, capped
  by the devices and the heads; MaxText's logical rules put ``mlp`` and ``heads`` on
  ``tensor``, ``embed`` on ``fsdp``): parameters Megatron-split over ``tensor`` and
  ZeRO-3-sharded over the rest, the batch over the rest; the fewest microbatches that fit.

A baseline that cannot be formed (the batch does not split over its data axis, the
heads over its tensor axis) is a row with status ``cannot_form``; one whose best
configuration does not fit memory is a row with status ``does_not_fit``, its footprint
and the reason: never dropped.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from autopar.errors import AutoparError
from autopar.sweep.suite import Point, Suite

__all__ = ["PlanRow", "PointContext", "evaluate_baseline", "plan_autopar"]

_FIXED_MEMORY = ("params", "grads", "optimizer", "inputs")  # memory_breakdown's state parts
_STATE_SLACK = 0.9  # a stage count is tried first when its state is under this of the bound


@dataclass(frozen=True)
class PlanRow:
    """One plan at one point, as the sweep reports it.

    Attributes:
        plan: ``"autopar"`` or a baseline's name.
        status: ``"ok"`` (fits), ``"does_not_fit"``, ``"cannot_form"`` or ``"error"``.
        reason: why, when the status is not ``ok``.
        mesh: axis -> size.
        schedule: ``"-"`` (no microbatches), ``"accumulate"`` (microbatches, one stage)
            or the pipeline schedule (``"1f1b"``, ``"interleaved-1f1b v=2"``).
        microbatches: microbatches per step.
        remat: stage recomputation (``"none"`` or ``"full"``).
        step_time_s: predicted seconds per step.
        memory_bytes: predicted peak bytes per device.
        memory_breakdown: its parts (params, grads, optimizer, activations, ...).
        limit_bytes: the per-device bound.
        search_s: seconds to plan (autopar) or to form and price (a baseline).
        compiled: for compiled points, what ``verify`` measured.
    """

    plan: str
    status: str
    reason: str = ""
    mesh: Mapping[str, int] = field(default_factory=dict)
    schedule: str = "-"
    microbatches: int = 1
    remat: str = "none"
    step_time_s: float | None = None
    memory_bytes: float | None = None
    memory_breakdown: Mapping[str, float] = field(default_factory=dict)
    limit_bytes: float = 0.0
    search_s: float = 0.0
    compiled: Mapping[str, Any] = field(default_factory=dict)

    @property
    def fits(self) -> bool:
        return self.memory_bytes is not None and self.memory_bytes <= self.limit_bytes

    def to_json(self) -> dict[str, Any]:
        return {
            "plan": self.plan,
            "status": self.status,
            "reason": self.reason,
            "mesh": dict(self.mesh),
            "schedule": self.schedule,
            "microbatches": self.microbatches,
            "remat": self.remat,
            "step_time_s": self.step_time_s,
            "memory_bytes": self.memory_bytes,
            "memory_breakdown": dict(self.memory_breakdown),
            "limit_bytes": self.limit_bytes,
            "search_s": self.search_s,
            "compiled": dict(self.compiled),
        }


@dataclass
class PointContext:
    """What every plan at a point shares: the step, its trace, the cluster, the bound,
    and the accumulation analyses (one per microbatch count, traced once)."""

    suite: Suite
    point: Point
    step: Callable
    args: tuple
    graph: Any
    cluster: Any
    config: Any
    limit: float
    accs: dict[int, Any] = field(default_factory=dict)

    @classmethod
    def build(cls, suite: Suite, point: Point) -> PointContext:
        """Make the point's step (abstract arguments) and trace it."""
        import autopar
        from autopar.registry import load_model

        family = load_model(point.model)
        config = family.preset(point.preset, **point.config)
        step, args = family.make_train_step(config, point.batch, abstract=True)
        cluster = suite.cluster_for(point)
        limit = (
            point.memory_limit_gb * 1e9
            if point.memory_limit_gb is not None
            else float(cluster.device.hbm_bytes)
        )
        graph = autopar.trace(step, *args)
        return cls(suite, point, step, tuple(args), graph, cluster, config, limit)

    @property
    def layers(self) -> int:
        return len(self.graph.layers)

    @property
    def heads(self) -> int | None:
        return getattr(self.config, "heads", None)

    def accumulation(self, m: int) -> Any:
        from autopar.lower.split import plan_accumulation

        if m not in self.accs:
            self.accs[m] = plan_accumulation(self.step, self.args, m, full=self.graph)
        return self.accs[m]

    def state_bytes(self) -> float:
        """Parameters, their gradients and the optimizer state, whole (unsplit)."""
        total = 0.0
        for gi in self.graph.inputs:
            nbytes = gi.tensor.nbytes
            if gi.role == "param":
                total += 2 * nbytes  # the parameter and its gradient
            elif gi.role == "opt_state":
                total += nbytes
        return total


# ------------------------------------------------------------------------------- autopar


def _cells(plan: Any) -> dict[str, Any]:
    pp = plan.pipeline
    if pp is None:
        return {"schedule": "-", "microbatches": 1, "remat": "none"}
    sched = pp.schedule if pp.num_stages > 1 else "accumulate"
    if pp.chunks > 1:
        sched += f" v={pp.chunks}"
    remat = pp.stage_remat[0] if pp.stage_remat else "none"
    return {"schedule": sched, "microbatches": pp.microbatches, "remat": remat}


def plan_autopar(ctx: PointContext) -> tuple[PlanRow, Any]:
    """autopar's full search (``autopar.plan`` on the abstract step, nothing fixed but
    the bound); the row and the plan (``None`` when the search found none)."""
    import autopar
    from autopar.errors import InfeasiblePlanError

    t0 = time.perf_counter()
    options = autopar.SearchOptions(memory_limit_bytes=int(ctx.limit))
    try:
        plan = autopar.plan(ctx.step, *ctx.args, cluster=ctx.cluster, options=options)
    except InfeasiblePlanError as e:
        return PlanRow(
            "autopar", "does_not_fit", str(e), memory_bytes=e.smallest_bytes,
            limit_bytes=ctx.limit, search_s=time.perf_counter() - t0,
        ), None  # fmt: skip
    search_s = time.perf_counter() - t0
    pred = plan.predicted
    row = PlanRow(
        "autopar", "ok", mesh=dict(plan.mesh), **_cells(plan),
        step_time_s=pred.step_time_s, memory_bytes=pred.memory_bytes_per_device,
        memory_breakdown=dict(pred.memory_breakdown), limit_bytes=ctx.limit, search_s=search_s,
    )  # fmt: skip
    if not row.fits:
        row = replace(row, status="does_not_fit", reason="the plan's peak is over the bound")
    return row, plan


# ------------------------------------------------------------------------------- baselines


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def _priced(
    name: str, ctx: PointContext, plan: Any, ev: Any, m: int, schedule: str, remat: str, t0: float
) -> PlanRow:
    row = PlanRow(
        name, "ok", mesh=dict(plan.mesh), schedule=schedule, microbatches=m, remat=remat,
        step_time_s=ev.step_time_s, memory_bytes=ev.memory_bytes_per_device,
        memory_breakdown=dict(ev.memory_breakdown), limit_bytes=ctx.limit,
        search_s=time.perf_counter() - t0,
    )  # fmt: skip
    if not row.fits:
        over = row.memory_bytes / ctx.limit - 1
        row = replace(
            row,
            status="does_not_fit",
            reason=f"{row.memory_bytes / 2**30:.3g} GiB per device, {over:+.0%} over the "
            f"{ctx.limit / 2**30:.3g} GiB bound with {m} microbatch(es)",
        )
    return row


def _one_stage(ctx: PointContext, plan: Any, m: int, remat: str, schedule: str = "gpipe") -> Any:
    """``plan`` with its batch in ``m`` microbatches on one stage (gradient accumulation;
    the planner's own accumulated plans say ``"gpipe"``; one stage run as ``"1f1b"``
    holds one microbatch's activations at a time, as gradient accumulation does)."""
    from autopar.plan import PipelinePlan

    stage_remat = (remat,) if remat != "none" else ()
    return replace(
        plan, pipeline=PipelinePlan(((0, ctx.layers),), schedule, m, stage_remat=stage_remat)
    )


def _evaluate_accumulated(ctx: PointContext, plan: Any, m: int) -> tuple[Any, Any]:
    """``plan`` with ``m`` microbatches accumulated, priced as the planner prices its own
    microbatched plans; the plan (carrying its prediction) and the evaluation."""
    from autopar.search import evaluate_plan

    if m == 1:
        ev = evaluate_plan(ctx.graph, plan, ctx.cluster, memory_limit_bytes=ctx.limit)
    else:
        plan = _one_stage(ctx, plan, m, "none")
        ev = evaluate_plan(
            ctx.graph, plan, ctx.cluster, memory_limit_bytes=ctx.limit,
            accumulation=ctx.accumulation(m),
        )  # fmt: skip
    return replace(plan, predicted=ev.to_predicted()), ev


def _fewest_microbatches(
    name: str, ctx: PointContext, plan: Any, replicas: int, t0: float
) -> tuple[PlanRow, Any]:
    """Price ``plan`` with the fewest accumulated microbatches that fit (gradient
    accumulation: the per-replica batch split into ``m`` equal microbatches)."""
    per_replica = ctx.point.batch // replicas
    counts = _divisors(per_replica)
    tried: dict[int, tuple[Any, Any]] = {}

    def price(m: int) -> tuple[Any, Any]:
        if m not in tried:
            tried[m] = _evaluate_accumulated(ctx, plan, m)
        return tried[m]

    m = 1
    full, ev = price(m)
    if not ev.fits:
        bd = dict(ev.memory_breakdown)
        # What stays whatever the microbatch count: the state and the inputs; the rest
        # (activations and what scales with them, e.g. the allocator's overhead) shrinks.
        rest = sum(float(bd.get(k, 0.0)) for k in _FIXED_MEMORY)
        act = ev.memory_bytes_per_device - rest
        if rest >= ctx.limit or act <= 0:
            row = _priced(name, ctx, full, ev, m, "-", "none", t0)
            return replace(
                row,
                reason=f"the state alone ({rest / 2**30:.3g} GiB per device) is over the "
                f"{ctx.limit / 2**30:.3g} GiB bound: no microbatch count fits",
            ), full
        # Activations shrink about as 1/m: jump to the count that should fit, then step.
        want = act / max(ctx.limit - rest, 1.0)
        larger = [c for c in counts if c >= want] or [counts[-1]]
        i = counts.index(larger[0])
        while i < len(counts):
            m = counts[i]
            full, ev = price(m)
            if ev.fits:
                break
            i += 1
    sched = "accumulate" if m > 1 else "-"
    return _priced(name, ctx, full, ev, m, sched, "none", t0), full


def _tensor_size(ctx: PointContext, most: int) -> tuple[int, str]:
    """The largest tensor size up to ``most`` dividing ``most`` and the heads; and a note
    when it had to be lowered."""
    heads = ctx.heads
    for t in sorted(_divisors(most), reverse=True):
        if heads is None or heads % t == 0:
            note = (
                ""
                if t == most
                else f"tensor {t}, not {most}: {heads} heads do not split {most} ways"
            )
            return t, note
    return 1, ""


def _data_baseline(name: str, ctx: PointContext, t0: float) -> tuple[PlanRow, Any]:
    from autopar import baselines

    n = ctx.point.devices
    if ctx.point.batch % n:
        return PlanRow(
            name, "cannot_form", f"the batch of {ctx.point.batch} does not split over {n} devices",
            limit_bytes=ctx.limit, search_s=time.perf_counter() - t0,
        ), None  # fmt: skip
    mesh = {"data": n}
    if name == "data_parallel":
        plan = baselines.data_parallel(ctx.graph, mesh)
    else:
        plan = baselines.zero(ctx.graph, mesh, 3)
    return _fewest_microbatches(name, ctx, plan, n, t0)


def _fsdp_tensor(ctx: PointContext, t0: float) -> tuple[PlanRow, Any]:
    from autopar import baselines

    n = ctx.point.devices
    most = math.gcd(min(ctx.suite.fsdp_tensor, n, ctx.cluster.devices_per_node), n)
    t, note = _tensor_size(ctx, most)
    f = n // t
    if ctx.point.batch % f:
        return PlanRow(
            "fsdp_tensor", "cannot_form",
            f"the batch of {ctx.point.batch} does not split over fsdp={f}",
            limit_bytes=ctx.limit, search_s=time.perf_counter() - t0,
        ), None  # fmt: skip
    mesh = {"data": f, "tensor": t} if t > 1 else {"data": f}
    if t > 1:
        plan = baselines.zero(ctx.graph, mesh, 3, tensor_axis="tensor")
    else:
        plan = baselines.zero(ctx.graph, mesh, 3)
    row, full = _fewest_microbatches("fsdp_tensor", ctx, plan, f, t0)
    if note:
        row = replace(row, reason="; ".join(r for r in (row.reason, note) if r))
    return row, full


def megatron_3d_layout(
    devices: int, per_node: int, heads: int | None, layers: int, batch: int
) -> list[tuple[int, int, int]]:
    """The Megatron-LM heuristic's candidate ``(tensor, pipe, data)`` in the order tried:
    tensor the node's devices (lowered to divide the heads), then the pipeline stage
    counts dividing the layers, fewest first; data the rest (dividing the batch).

    Example:
        >>> megatron_3d_layout(64, 8, 64, 48, 1024)[:3]
        [(8, 1, 8), (8, 2, 4), (8, 4, 2)]
    """
    most = math.gcd(min(per_node, devices), devices)
    t = next(k for k in sorted(_divisors(most), reverse=True) if heads is None or heads % k == 0)
    out = []
    for p in _divisors(devices // t):
        d = devices // (t * p)
        if layers % p == 0 and batch % d == 0 and batch // d >= p:
            out.append((t, p, d))
    return out


def _smallest_microbatch(ctx: PointContext, d: int, p: int) -> tuple[int, Any, str]:
    """Megatron's microbatch size 1 per replica, or the smallest the step splits into
    (at one example some steps change their equations): ``(m, accumulation, note)``;
    ``(0, None, why)`` when no size works."""
    from autopar.errors import AccumulateError

    per_replica = ctx.point.batch // d
    why = ""
    for mbs in _divisors(per_replica):
        m = per_replica // mbs
        if m < p:
            break
        try:
            acc = ctx.accumulation(m)
        except AccumulateError as e:
            why = str(e)
            continue
        note = "" if mbs == 1 else f"microbatch size {mbs}: the step does not split to 1 example"
        return m, acc, note
    return 0, None, f"the step cannot be split into microbatches for {p} stages: {why}"


def _megatron_3d(ctx: PointContext, t0: float) -> tuple[PlanRow, Any]:
    from autopar import baselines
    from autopar.search.outer import price_pipeline
    from autopar.search.stages import evaluate_pipeline

    n, per_node = ctx.point.devices, ctx.cluster.devices_per_node
    layouts = megatron_3d_layout(n, per_node, ctx.heads, ctx.layers, ctx.point.batch)
    if not layouts:
        return PlanRow(
            "megatron_3d", "cannot_form",
            f"no pipeline stage count divides the {ctx.layers} layers with the batch of "
            f"{ctx.point.batch} split over the data replicas left",
            limit_bytes=ctx.limit, search_s=time.perf_counter() - t0,
        ), None  # fmt: skip
    _, tensor_note = _tensor_size(ctx, math.gcd(min(per_node, n), n))
    note = tensor_note
    state = ctx.state_bytes()
    # The fewest stages whose state share fits first; more if the price says otherwise.
    start = next(
        (i for i, (t_, p, _) in enumerate(layouts) if state / (t_ * p) <= _STATE_SLACK * ctx.limit),
        len(layouts) - 1,
    )
    row: PlanRow | None = None
    full = None
    for t, p, d in layouts[start:]:
        m, acc, mbs_note = _smallest_microbatch(ctx, d, p)
        if acc is None:
            row = PlanRow(
                "megatron_3d", "cannot_form", mbs_note, limit_bytes=ctx.limit,
                search_s=time.perf_counter() - t0,
            )  # fmt: skip
            continue
        note = "; ".join(x for x in (tensor_note, mbs_note) if x)
        if p == 1:
            inner = baselines.megatron(ctx.graph, {"data": d, "tensor": t})
            full = _one_stage(ctx, inner, m, "full", "1f1b")
            ev = evaluate_pipeline(ctx.graph, full, ctx.cluster, acc, memory_limit_bytes=ctx.limit)
            sched = "accumulate"
        else:
            per_stage = ctx.layers // p
            v = 2 if per_stage % 2 == 0 and m % p == 0 else 1
            schedule = "interleaved-1f1b" if v == 2 else "1f1b"
            inner = baselines.megatron(ctx.step, {"data": d, "tensor": t}, *ctx.args)
            full, ev = price_pipeline(
                ctx.step, ctx.args, ctx.graph, ctx.cluster, {"pipe": p, "data": d, "tensor": t},
                m, schedule, v, "full", inner, acc, ctx.limit,
            )  # fmt: skip
            sched = schedule + (f" v={v}" if v > 1 else "")
        full = replace(full, predicted=ev.to_predicted())
        row = _priced("megatron_3d", ctx, full, ev, m, sched, "full", t0)
        if row.fits:
            break
    assert row is not None
    if note:
        row = replace(row, reason="; ".join(r for r in (row.reason, note) if r))
    return row, full


def evaluate_baseline(name: str, ctx: PointContext) -> tuple[PlanRow, Any]:
    """Form and price one baseline at the point; the row and the plan (``None`` when it
    cannot be formed). An error the library raises becomes a row with status ``error``.

    Example:
        >>> row, plan = evaluate_baseline("data_parallel", ctx)  # doctest: +SKIP
        >>> row.mesh  # doctest: +SKIP
        {'data': 8}
    """
    t0 = time.perf_counter()
    try:
        if name in ("data_parallel", "zero3"):
            return _data_baseline(name, ctx, t0)
        if name == "fsdp_tensor":
            return _fsdp_tensor(ctx, t0)
        if name == "megatron_3d":
            return _megatron_3d(ctx, t0)
    except AutoparError as e:
        return PlanRow(
            name, "error", f"{type(e).__name__}: {e}", limit_bytes=ctx.limit,
            search_s=time.perf_counter() - t0,
        ), None  # fmt: skip
    raise ValueError(f"unknown baseline {name!r}")
