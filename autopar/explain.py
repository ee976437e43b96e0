"""``autopar explain``: why one parameter or op is laid out the way the plan says.

For an input leaf (a parameter, optimizer state, a batch input: by path or path suffix,
e.g. ``params/h/attn/q/kernel``) or an op of ``plan.layers`` (``h/attn/q`` or
``GPT/h/attn/q``), :func:`explain` prints:

* its sharding: the spec, which mesh axes split which dimension, the block one device
  holds and how many devices hold each block;
* the collectives it causes: the plan records collectives per kind, axes and class
  (``fsdp_gather``, ``dp_grad``, ``tensor``, ``reshard``, ...), not per tensor, so the
  classes this layout implies are listed with the plan's totals and this tensor's
  estimated share (its bytes under the cost model's conventions), marked as an estimate;
* what the next-best choice would have cost: with the step function (``step=``,
  ``args=``) the alternatives for this leaf (replicated, or its split moved to another
  dimension or axis) are priced with the planner's objective and the cheapest one is
  compared with the plan; without it, the plan's shortlist (the runner-up plan and its
  step time difference), or a plain statement that the plan records no alternative.

Example:
    >>> text = explain(plan, "layer_0/w")
    >>> "state/params/layer_0/w" in text and "per device" in text
    True
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from autopar.errors import AutoparError
from autopar.plan import LayerStrategy, Plan, Spec, TensorSharding, per_device_shape, spec_axes
from autopar.report.text import format_bytes, format_seconds, format_spec

__all__ = ["ExplainPathError", "Alternative", "explain", "price_alternatives"]


class ExplainPathError(AutoparError, LookupError):
    """The path names no input, output or op of the plan; the message lists close matches."""


_ITEMSIZE = {"float64": 8, "int64": 8, "uint64": 8, "complex64": 8, "float32": 4}
_ITEMSIZE |= {"int32": 4, "uint32": 4, "bfloat16": 2, "float16": 2, "int16": 2}
_ITEMSIZE |= {"int8": 1, "uint8": 1, "bool": 1}


def _nbytes(shape: Sequence[int], dtype: str) -> float:
    return float(math.prod(shape)) * _ITEMSIZE.get(dtype, 4)


def _axes_of(entry: Any) -> tuple[str, ...]:
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def _mesh_text(plan: Plan) -> str:
    return " x ".join(f"{a}={n}" for a, n in plan.mesh.items()) or "(single device)"


# ------------------------------------------------------------------------------- lookup


def _tensor_matches(plan: Plan, path: str) -> list[TensorSharding]:
    records = (*plan.inputs, *plan.outputs)
    exact = [r for r in records if r.path == path]
    if exact:
        return exact
    return [r for r in records if r.path.endswith("/" + path)]


def _pick(plan: Plan, path: str) -> TensorSharding | None:
    """The leaf ``path`` names: an exact path, else the one leaf ending with it (parameters
    first, then inputs); ``None`` if none does."""
    tensors = _tensor_matches(plan, path)
    if not tensors:
        return None
    inputs = [r for r in tensors if r in plan.inputs]
    params = [r for r in inputs if r.role == "param"]
    pool = params or inputs or tensors
    if len(pool) > 1:
        names = ", ".join(r.path for r in pool[:5])
        raise ExplainPathError(f"{path!r} matches several leaves ({names}); give more of it.")
    return pool[0]


def _op_matches(plan: Plan, path: str) -> list[tuple[LayerStrategy, str, str]]:
    out = []
    for ls in plan.layers:
        for op, strat in ls.ops:
            full = f"{ls.layer}/{op}"
            if path in (op, full) or full.endswith("/" + path):
                out.append((ls, op, strat))
    return out


def _candidates(plan: Plan) -> list[str]:
    names = [r.path for r in (*plan.inputs, *plan.outputs)]
    for r in plan.inputs:  # the short forms people type: params/..., opt_state/...
        parts = r.path.split("/")
        names.append("/".join(parts[1:]))
    names += [f"{ls.layer}/{op}" for ls in plan.layers for op, _ in ls.ops]
    names += [op for ls in plan.layers for op, _ in ls.ops]
    return list(dict.fromkeys(n for n in names if n))


def _unknown(plan: Plan, path: str) -> ExplainPathError:
    close = difflib.get_close_matches(path, _candidates(plan), n=5, cutoff=0.5)
    hint = (
        "close matches: " + ", ".join(close)
        if close
        else f"paths look like {plan.inputs[0].path!r}"
        if plan.inputs
        else "the plan has no inputs"
    )
    return ExplainPathError(
        f"{path!r} names no input, output or op of the plan ({hint}); `autopar show` lists them."
    )


# ------------------------------------------------------------------------------- tensors


def _batch_axes(plan: Plan) -> tuple[str, ...]:
    """Mesh axes that split dim 0 of some batch input."""
    out: list[str] = []
    for r in plan.inputs:
        if r.role == "batch" and r.spec:
            out.extend(_axes_of(r.spec[0]))
    return tuple(dict.fromkeys(out))


def _sharding_lines(plan: Plan, r: TensorSharding) -> list[str]:
    lines = [f"  sharding: {format_spec(r.spec)} on mesh {_mesh_text(plan)}"]
    for d, n in enumerate(r.shape):
        axes = _axes_of(r.spec[d] if d < len(r.spec) else None)
        if axes:
            ways = math.prod(plan.mesh.get(a, 1) for a in axes)
            lines.append(
                f"    dim {d} ({n}): split over {'x'.join(axes)} ({ways} ways) -> {n // ways} "
                "per device"
            )
        else:
            lines.append(f"    dim {d} ({n}): whole on every device")
    used = set(spec_axes(r.spec))
    local = per_device_shape(r.shape, r.spec, plan.mesh)
    full, mine = _nbytes(r.shape, r.dtype), _nbytes(local, r.dtype)
    copies = [a for a, n in plan.mesh.items() if n > 1 and a not in used]
    held = math.prod(plan.mesh[a] for a in copies)
    lines.append(
        f"  per device: {tuple(local)} {r.dtype} = {format_bytes(mine)} of {format_bytes(full)}"
        + (f" (1/{round(full / mine)})" if mine and full != mine else "")
        + (
            f"; each block held by {held} devices (replicated over {', '.join(copies)})"
            if held > 1
            else "; every device holds a different block"
        )
    )
    return lines


def _followers(plan: Plan, r: TensorSharding) -> list[TensorSharding]:
    """Optimizer-state leaves and outputs that are this parameter's (same suffix, shape)."""
    if r.role != "param" or "params" not in r.path.split("/"):
        return []
    parts = r.path.split("/")
    key = "/".join(parts[parts.index("params") + 1 :])
    return [
        o
        for o in (*plan.inputs, *plan.outputs)
        if o is not r
        and tuple(o.shape) == tuple(r.shape)
        and (o.path.endswith("/" + key))
        and o.path != r.path
    ]


def _collective_lines(plan: Plan, r: TensorSharding) -> list[str]:
    used = set(spec_axes(r.spec))
    batch = set(_batch_axes(plan))
    local = per_device_shape(r.shape, r.spec, plan.mesh)
    full, mine = _nbytes(r.shape, r.dtype), _nbytes(local, r.dtype)
    lines = [
        "  collectives it causes (the plan records them per kind, axes and class, not per "
        "tensor: the classes this layout implies, with the plan's totals and this tensor's "
        "estimated share):"
    ]
    found = False
    for c in plan.predicted.collectives:
        axes = set(c.axes)
        share = None
        why = ""
        if r.role in ("param", "opt_state") and c.where == "fsdp_gather" and axes <= used:
            share = full
            why = (
                f"split over {','.join(c.axes)}, it is gathered whole before use "
                "(all-gather output = its full size)"
            )
        elif r.role == "param" and c.where == "dp_grad" and axes and not axes & used:
            share = mine
            why = (
                f"replicated over {','.join(c.axes)}, which splits the batch: its gradient "
                "is reduced over it"
            )
        elif r.role == "batch" and c.where in ("reshard",) and axes & used:
            why = "a reshard over an axis this input uses (may read it; not attributable)"
        if share is None and not why:
            continue
        found = True
        total = f"{c.kind} over {','.join(c.axes)} [{c.where}]: x{c.count}, "
        total += f"{format_bytes(c.bytes)}, {format_seconds(c.time_s)} in the plan"
        lines.append(f"    - {total}")
        if share is not None:
            frac = min(1.0, share / c.bytes) if c.bytes else 0.0
            lines.append(
                f"      this {r.role}: ~{format_bytes(share)} of the step's "
                f"{format_bytes(c.bytes)} (estimate: once per step, ~{frac:.0%}, "
                f"~{format_seconds(frac * c.time_s)}): {why}"
            )
        else:
            lines.append(f"      {why}")
    if not found:
        if r.role == "param" and batch and not (batch & used):
            lines.append(
                f"    - none recorded for it: its gradient would be reduced over "
                f"{','.join(sorted(batch))}, but the plan lists no dp_grad collective over it"
            )
        else:
            lines.append("    - none attributable to this tensor in the plan's collectives")
    return lines


# -------------------------------------------------------------------------- alternatives


@dataclass(frozen=True)
class Alternative:
    """One other layout for a leaf, priced with the planner's objective.

    Attributes:
        spec: the leaf's spec in this alternative.
        step_time_s: predicted step time with it (``None``: could not be priced).
        memory_bytes_per_device: predicted peak per device.
        note: why it could not be priced, if it could not.
    """

    spec: Spec
    step_time_s: float | None
    memory_bytes_per_device: float | None = None
    note: str = ""


def _alternative_specs(plan: Plan, r: TensorSharding, limit: int) -> list[Spec]:
    """Replicated, and each one-axis split on each dim (the axes' sizes dividing it)."""
    out: list[Spec] = []
    none: Spec = (None,) * len(r.shape)
    if tuple(r.spec) != none:
        out.append(none)
    for a, n in plan.mesh.items():
        if n <= 1:
            continue
        for d, size in enumerate(r.shape):
            if size % n:
                continue
            spec = list(none)
            spec[d] = a
            if tuple(spec) != tuple(r.spec):
                out.append(tuple(spec))
    return out[:limit]


def price_alternatives(
    plan: Plan,
    path: str,
    step: Callable,
    args: Sequence[Any],
    *,
    cluster: Any = None,
    limit: int = 6,
) -> tuple[float, list[Alternative]]:
    """Price other layouts of one input leaf (its optimizer state and update follow it).

    Each alternative is the plan's input and output layouts with this leaf's changed,
    completed with the planner's objective (:func:`autopar.export.plan_from_specs`), so
    it is compared with the plan re-completed the same way (the first number returned).

    Returns:
        ``(the plan's step time, alternatives cheapest first)``.

    Example:
        >>> base, alts = price_alternatives(plan, "layer_0/w", step, (state, batch), limit=2)
        >>> base > 0 and all(a.step_time_s is None or a.step_time_s > 0 for a in alts)
        True
    """
    from autopar.export import _complete_as_planned
    from autopar.trace import trace
    from cost_models import Cluster

    r = _pick(plan, path)
    if r is None:
        raise _unknown(plan, path)
    if cluster is None:
        cluster = Cluster.from_json(plan.cluster) if plan.cluster else None
    graph = trace(step, *args)
    followers = {o.path for o in _followers(plan, r) if tuple(o.spec) == tuple(r.spec)}

    def with_spec(spec: Spec) -> Plan:
        def swap(rec: TensorSharding) -> TensorSharding:
            if rec.path == r.path or rec.path in followers:
                return replace(rec, spec=spec)
            return rec

        return replace(
            plan,
            inputs=tuple(swap(x) for x in plan.inputs),
            outputs=tuple(swap(x) for x in plan.outputs),
            activations=(),
            pipeline=None,
        ).bind(graph.in_tree, graph.out_tree)

    base = _complete_as_planned(graph, with_spec(tuple(r.spec)), cluster).predicted.step_time_s
    alts: list[Alternative] = []
    for spec in _alternative_specs(plan, r, limit):
        try:
            p = _complete_as_planned(graph, with_spec(spec), cluster)
            alts.append(
                Alternative(spec, p.predicted.step_time_s, p.predicted.memory_bytes_per_device)
            )
        except AutoparError as e:
            alts.append(Alternative(spec, None, None, str(e)))
    alts.sort(key=lambda a: (a.step_time_s is None, a.step_time_s or 0.0))
    return base, alts


def _shortlist_lines(plan: Plan) -> list[str]:
    chosen = next((c for c in plan.shortlist if c.verdict == "chosen"), None)
    others = [c for c in plan.shortlist if c is not chosen and c.step_time_s is not None]
    if not others:
        return [
            "  next-best choice: the plan records no alternative (its shortlist holds only the "
            "chosen plan; per-op choices are compared inside one solve and not kept). Price "
            "this leaf's alternatives from the step: autopar.explain(plan, path, step=fn, "
            "args=args), or `autopar explain plan.json PATH --model NAME`."
        ]
    best = min(others, key=lambda c: c.step_time_s)
    mine = chosen.step_time_s if chosen and chosen.step_time_s else plan.predicted.step_time_s
    delta = best.step_time_s - mine
    return [
        "  next-best choice (whole plans; the plan JSON keeps no per-op alternatives): "
        f"runner-up {best.label!r} at {format_seconds(best.step_time_s)} per step, "
        f"{'+' if delta >= 0 else '-'}{format_seconds(abs(delta))} "
        f"({delta / mine:+.1%}) against this plan's {format_seconds(mine)}"
        + (f"; {best.verdict}" if best.verdict else "")
    ]


def _alternative_lines(plan: Plan, base: float, alts: list[Alternative]) -> list[str]:
    priced = [a for a in alts if a.step_time_s is not None]
    lines = [
        f"  alternatives for this leaf (priced with the planner's objective; the plan's "
        f"layout re-completed the same way: {format_seconds(base)}):"
    ]
    for a in alts:
        if a.step_time_s is None:
            lines.append(f"    {format_spec(a.spec):<28} not priced: {a.note}")
            continue
        d = a.step_time_s - base
        lines.append(
            f"    {format_spec(a.spec):<28} {format_seconds(a.step_time_s):>10} "
            f"({'+' if d >= 0 else '-'}{format_seconds(abs(d))}, {d / base:+.1%}), "
            f"{format_bytes(a.memory_bytes_per_device or 0)} per device"
        )
    if priced:
        best = priced[0]
        d = best.step_time_s - base
        verdict = "costs" if d >= 0 else "would save"
        lines.append(
            f"  next-best choice: {format_spec(best.spec)}, which {verdict} "
            f"{format_seconds(abs(d))} per step ({d / base:+.1%})"
        )
    return lines


# ----------------------------------------------------------------------------- explain


def _explain_tensor(
    plan: Plan, r: TensorSharding, priced: tuple[float, list[Alternative]] | None
) -> str:
    lines = [f"{r.path}  ({r.role}, {r.dtype}, shape {tuple(r.shape)})"]
    lines += _sharding_lines(plan, r)
    followers = _followers(plan, r)
    same = [o.path for o in followers if tuple(o.spec) == tuple(r.spec)]
    other = [o for o in followers if tuple(o.spec) != tuple(r.spec)]
    if same:
        lines.append(f"  laid out the same: {len(same)} leaves ({', '.join(same[:3])}" + (
            ", ...)" if len(same) > 3 else ")"
        ))  # fmt: skip
    for o in other:
        lines.append(f"  laid out differently: {o.path} {format_spec(o.spec)}")
    lines += _collective_lines(plan, r)
    if priced is not None:
        lines += _alternative_lines(plan, *priced)
    else:
        lines += _shortlist_lines(plan)
    return "\n".join(lines)


def _explain_op(plan: Plan, matches: list[tuple[LayerStrategy, str, str]]) -> str:
    ls, op, strat = matches[0]
    lines = [f"{ls.layer}/{op}  (op in layer {ls.layer!r})", f"  strategy: {strat}"]
    if len(matches) > 1:
        lines.append("  also: " + ", ".join(f"{m[0].layer}/{m[1]} = {m[2]}" for m in matches[1:4]))
    axes = {a for a in plan.mesh if f"({a}" in strat or f",{a}" in strat}
    lines.append(
        "  collectives over the axes it splits on (the plan records them per kind, axes and "
        "class, not per op: these are all ops' together):"
    )
    kinds = [k for k in ("all-reduce", "reduce-scatter") if f"+{k}" in strat]
    hits = [
        c
        for c in plan.predicted.collectives
        if set(c.axes) & axes and c.where in ("tensor", "reshard", "fsdp_gather", "dp_grad")
    ]
    if kinds:
        lines.append(f"    - its strategy ends in {', '.join(kinds)} of its partial sums")
    for c in hits:
        lines.append(
            f"    - {c.kind} over {','.join(c.axes)} [{c.where}]: x{c.count}, "
            f"{format_bytes(c.bytes)}, {format_seconds(c.time_s)} in the plan"
        )
    if not hits and not kinds:
        lines.append("    - none: it runs on local data")
    lines += _shortlist_lines(plan)
    return "\n".join(lines)


def explain(
    plan: Plan,
    path: str,
    *,
    step: Callable | None = None,
    args: Sequence[Any] = (),
    cluster: Any = None,
) -> str:
    """Explain one input/output leaf or op of ``plan``.

    Args:
        plan: a plan (searched, loaded or hand-written).
        path: a leaf's path or path suffix (``params/h/attn/q/kernel``), or an op of
            ``plan.layers`` (``h/attn/q``, ``GPT/h/attn/q``).
        step: the step function; given (with ``args``), the leaf's alternative layouts
            are priced (:func:`price_alternatives`) instead of quoting the shortlist.
        args: the step's arguments (arrays or ``ShapeDtypeStruct``s).
        cluster: the hardware to price on (default: the plan's).

    Returns:
        The explanation as text.

    Raises:
        ExplainPathError: nothing in the plan has that path; the message lists close
            matches.

    Example:
        >>> print(explain(plan, "params/layer_1/w").splitlines()[0])
        state/params/layer_1/w  (param, float32, shape (1024, 256))
    """
    pick = _pick(plan, path)
    if pick is not None:
        priced = None
        if step is not None and pick in plan.inputs:
            priced = price_alternatives(plan, pick.path, step, args, cluster=cluster)
        return _explain_tensor(plan, pick, priced)
    ops = _op_matches(plan, path)
    if ops:
        return _explain_op(plan, ops)
    raise _unknown(plan, path)
