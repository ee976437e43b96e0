"""What a pipeline plan runs, in bytes per device: ticks, sends, carried buffers.

The cost model prices a pipeline by what its program does (``autopar.search.stages``);
this module reads that off the runtime's own schedule, cut and padded layouts
(:func:`autopar.lower.pipeline.send_slots`, :func:`~autopar.lower.pipeline.buffer_slots`)
and hands it over as plain numbers, so the search never imports the lowering
(``autopar.api`` composes the two).

Example:
    >>> from benchmarks.models.gpt import GPTConfig, make_train_step
    >>> from autopar.lower.split import plan_accumulation
    >>> gstep, gargs = make_train_step(GPTConfig.preset("tiny"), 8)
    >>> plan = autopar.baselines.pipeline(gstep, {"pipe": 2, "data": 4}, *gargs, microbatches=2)
    >>> prog = pipeline_program(autopar.trace(gstep, *gargs), plan, plan_accumulation(gstep, gargs, 2))
    >>> prog.ticks, len(prog.sends) > 0
    (6, True)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import jax
from jax.extend.core import Var

from autopar.errors import LowerPlanError
from autopar.lower.pipeline import (
    buffer_slots,
    cut_stages,
    make_schedule,
    slot_key,
    slot_values,
    stack_relayout,
)
from autopar.lower.split import AccumulateError, gradient_graph
from autopar.lower.stage_remat import remat_stages
from autopar.plan import Plan
from autopar.trace.graph import Graph
from autopar.trace.tensor import itemsize


@dataclass(frozen=True)
class PipelineProgram:
    """What the lowered pipeline (:mod:`autopar.lower.pipeline`) runs, in bytes per
    device.

    Attributes:
        ticks: ticks of the schedule. Each tick every device runs at most one piece: the
            forward or backward of one microbatch through one stage, or, interleaved
            (``virtual_stages = v > 1``), through one chunk (``1/v`` of a device's
            layers), so an interleaved step has about ``v`` times as many, shorter ticks.
        sends: bytes of each buffer one tick sends (one ``ppermute`` each, every tick;
            forward slots then backward slots).
        forward_sends / backward_sends: the forward and the backward slots alone.
        buffers: what the program carries from tick to tick,
            ``name -> (slots, bytes of one slot)`` (``"forward"``, ``"backward"``,
            ``"stash"``; interleaved: slots keyed by chunk and microbatch).
        psums: outputs of ``G`` summed over ``pipe`` after the flush.
        stacked_outputs: outputs of ``G`` that stay split over ``pipe`` (a scanned stack's
            gradients).
        virtual_stages: ``v``, chunks per device.
        relayout_sends: interleaved with a scanned stack: bytes of each ``ppermute`` that
            moves the stack's chunks from the caller's layout (contiguous blocks of ``v``
            chunks per device) to the chunks each device runs (``d, p + d, ...``) and the
            stack's gradients back, once per step (outside the ticks);
            :func:`autopar.lower.pipeline.stack_relayout` groups the moves into rounds of
            one chunk per device. Empty otherwise.
        relayout_bytes: their sum: what the busiest device sends per step for the
            relayout (every device sends at most this).
        relayout_copy_bytes: the stack in chunk order, held beside the stack as given
            while the ticks run (per device: ``v`` chunks of every stacked input); with
            a stack split unevenly over the stages, also the slots each device takes
            from it (``v`` chunks of the largest stage's count, padding included).
        recomputed_bytes: with stages rematerialised (``plan.pipeline.stage_remat``), the
            most any of them re-creates in one backward tick: what its stash held
            without remat (per device), a layer scan's residuals one layer's worth (the
            stage recomputes them layer by layer: ``StageCut.layer_recomputed``).
        relayout_kind: the collective that moves it (``"collective-permute"`` over
            ``pipe``; priced as point-to-point sends).
    """

    ticks: int
    sends: tuple[float, ...]
    forward_sends: tuple[float, ...]
    backward_sends: tuple[float, ...]
    buffers: dict[str, tuple[int, float]]
    psums: int
    stacked_outputs: frozenset[int]
    virtual_stages: int = 1
    relayout_sends: tuple[float, ...] = ()
    relayout_bytes: float = 0.0
    relayout_kind: str = "collective-permute"
    relayout_copy_bytes: float = 0.0
    recomputed_bytes: float = 0.0


def pipeline_program(
    graph: Graph, plan: Plan, accumulation: Any, pipe_axis: str = "pipe"
) -> PipelineProgram | None:
    """The runtime's own schedule, cut and padded layouts for this plan
    (:func:`autopar.lower.pipeline.send_slots`, :func:`~autopar.lower.pipeline.buffer_slots`),
    or ``None`` if the runtime cannot run it (then the caller estimates).

    An array whose leading dimension (or, for a scanned stack's residual, the one after
    the layer axis) is the microbatch is split over the mesh axes the plan splits the
    batch over (the partitioner keeps the batch split through the stages; XLA pads an
    uneven split); other arrays are whole on every device."""
    pp = plan.pipeline
    if graph.in_tree is None:
        return None
    try:
        schedule = make_schedule(
            pp.schedule, plan.mesh[pipe_axis], pp.microbatches, pp.virtual_stages
        )
        # The traced avals themselves (a typed PRNG key's dtype has no name numpy reads).
        leaves = [
            jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=a.weak_type)
            for a in graph.jaxpr.in_avals
        ]
        args = jax.tree_util.tree_unflatten(graph.in_tree, leaves)[0]
        hook, into_bodies = _pins(plan, accumulation)
        cut = cut_stages(
            gradient_graph(accumulation, args, hook, into_bodies),
            pp.stages,
            batch_inputs=accumulation.batch_inputs,
        )
    except (AccumulateError, LowerPlanError):
        return None
    full = cut
    if any(r != "none" for r in pp.stage_remat):
        cut = remat_stages(cut, pp.stage_remat)
    split, rows = 1, None
    for i in accumulation.batch_inputs:
        gi, rec = graph.inputs[i], plan.inputs[i]
        if gi.tensor.shape and rec.spec:
            rows = gi.tensor.shape[0] // pp.microbatches
            entry = rec.spec[0]
            axes = () if entry is None else ((entry,) if isinstance(entry, str) else entry)
            split = math.prod(plan.mesh[a] for a in axes if a != pipe_axis)
            break

    def per_device(shape: tuple[int, ...], dtype: Any) -> float:
        nbytes = math.prod(shape) * itemsize(dtype)
        for d in range(min(2, len(shape))):
            if split > 1 and shape[d] == rows:
                return float(nbytes // shape[d] * math.ceil(shape[d] / split))
        return float(nbytes)

    specs = value_specs(cut)
    sizes = {a: n for a, n in plan.mesh.items() if a != pipe_axis}
    if split == 1 and rows:
        # Batch inputs left whole, activations pinned split over the batch (a searched
        # stage layout): the pinned sends and stash say how the batch is split.
        split = max(
            (
                math.prod(sizes.get(a, 1) for a in _axes(spec[d]))
                for v, spec in specs.items()
                for d in range(min(2, len(spec)))
                if len(cut.aval(v).shape) > d and cut.aval(v).shape[d] == rows
            ),
            default=1,
        )

    def value_bytes(v: Any) -> float:
        """A value's bytes per device: as its pinned layout splits it, else as above."""
        aval = cut.aval(v)
        spec = specs.get(v)
        if spec is None:
            return per_device(tuple(aval.shape), aval.dtype)
        return float(_split_bytes(tuple(aval.shape), aval.dtype, spec, sizes))

    def slot_bytes(key: tuple, values: tuple) -> float:
        """One slot of a padded layout: the largest share of the values it holds."""
        if not any(v in specs for v in values):
            return per_device(*key)
        return max(value_bytes(v) for v in values)

    slots = buffer_slots(cut, schedule)
    held = slot_values(cut)
    sized = {
        name: tuple(slot_bytes(key, vs) for key, vs in zip(layout, held[name], strict=True))
        for name, (_, layout) in slots.items()
    }
    relayout = _relayout_sends(cut, plan, schedule, pipe_axis)
    per_layer = dict(cut.layer_recomputed or {})
    return PipelineProgram(
        ticks=len(schedule.ticks),
        sends=sized["forward"] + sized["backward"],
        forward_sends=sized["forward"],
        backward_sends=sized["backward"],
        buffers={name: (n, sum(sized[name])) for name, (n, _) in slots.items()},
        psums=len(cut.jaxpr.jaxpr.outvars) - len(cut.stacked_outputs),
        stacked_outputs=frozenset(cut.stacked_outputs),
        virtual_stages=schedule.virtual_stages,
        relayout_sends=relayout,
        relayout_bytes=float(sum(relayout)),
        relayout_copy_bytes=(_relayout_copy(cut, plan, schedule, pipe_axis) if relayout else 0.0)
        + _uneven_copy(cut, plan, schedule, pipe_axis),
        recomputed_bytes=max(
            (
                # a layer scan's residuals are re-created one layer at a time
                sum(value_bytes(v) / per_layer.get(v, 1) for v in full.forward(s).stash)
                for s, r in enumerate(pp.stage_remat)
                if r == "full"
            ),
            default=0.0,
        ),
    )


def _pins(plan: Plan, accumulation: Any) -> tuple[Any, Any]:
    """The hook applying a pipeline plan's activation pins to G, as the lowering does
    (:func:`autopar.lower.lowering._pipelined`), on an abstract mesh of the plan's axes
    (nothing is placed: the pricing needs no devices); ``(None, False)`` without pins."""
    if not plan.activations:
        return None, False
    from jax.sharding import AbstractMesh, AxisType

    from autopar.lower.lowering import _check_constraints, _constraint_hook

    _check_constraints(accumulation.micro, plan.activations)
    names = tuple(plan.mesh)
    mesh = AbstractMesh(
        tuple(plan.mesh[a] for a in names), names, axis_types=(AxisType.Auto,) * len(names)
    )
    return _constraint_hook(plan.activations, mesh)  # type: ignore[arg-type]


def value_specs(cut: Any) -> dict[Any, tuple]:
    """The layout of every value of the cut that a ``sharding_constraint`` fixes: its
    result, a same-shape elementwise result of it (a follower takes its leader's layout,
    as in the search's groups), and a loop's result whose body result is fixed (a scan's
    stacked results gain a whole leading layer axis). Specs as tuples of axis names (or
    tuples of them, or ``None``) per dimension; values missing are left to the caller.

    Example:
        >>> from autopar.lower.pipeline import cut_stages
        >>> rows = jax.NamedSharding(autopar.lower.make_mesh({"data": 8}), jax.P("data"))
        >>> def loss(ws, x):
        ...     for w in ws:
        ...         x = jnp.tanh(jax.lax.with_sharding_constraint(x @ w, rows))
        ...     return jnp.mean(x ** 2)
        >>> g = autopar.trace(jax.value_and_grad(loss), [jnp.eye(4)] * 4, jnp.ones((8, 4)))
        >>> cut = cut_stages(g, [(0, 2), (2, 4)], batch_inputs=[4])
        >>> sorted(set(value_specs(cut).values()))  # sends and stash: rows split
        [('data', None)]
    """
    producers: dict[Any, Any] = {}
    for eqn in cut.jaxpr.jaxpr.eqns:
        for v in eqn.outvars:
            producers[v] = eqn
    for pc in cut.pieces:  # split scans are rewritten per piece
        for eqn in pc.eqns:
            for v in eqn.outvars:
                producers.setdefault(v, eqn)
    out: dict[Any, tuple] = {}
    memo: dict[Any, Any] = {}
    for pc in cut.pieces:
        for v in (*pc.send, *pc.stash):
            spec = _spec_of(v, producers, memo, 0)
            if spec is not None:
                out[v] = spec
    return out


_NOT_ELEMENTWISE = frozenset(
    {"transpose", "dot_general", "reshape", "rev", "cumsum", "cumprod", "cummax", "sort"}
)


def _spec_of(v: Any, producers: dict[Any, Any], memo: dict[Any, Any], depth: int) -> Any:
    if v in memo:
        return memo[v]
    memo[v] = None
    eqn = producers.get(v)
    if eqn is None or depth > 64:
        return None
    spec = None
    name = eqn.primitive.name
    ndim = len(getattr(v.aval, "shape", ()))
    if name == "sharding_constraint":
        spec = tuple(eqn.params["sharding"].spec)
    elif name == "scan":
        body = eqn.params["jaxpr"].jaxpr
        i = list(eqn.outvars).index(v)
        inner = {w: e for e in body.eqns for w in e.outvars}
        out = body.outvars[i]
        nc, nk = eqn.params["num_consts"], eqn.params["num_carry"]
        if out in body.invars[nc : nc + nk]:
            # a carry returned as a stacked result (a layer's input, kept for its
            # recomputation): laid out as the carry, which the body's result fixes
            out = body.outvars[body.invars.index(out) - nc]
        got = _spec_of(out, inner, {}, depth + 1)
        if got is not None:
            spec = got if i < eqn.params["num_carry"] else (None, *got)
    elif name not in _NOT_ELEMENTWISE and len(eqn.outvars) == 1 and ndim:
        shape = tuple(v.aval.shape)
        for a in eqn.invars:
            if isinstance(a, Var) and tuple(getattr(a.aval, "shape", ())) == shape:
                spec = _spec_of(a, producers, memo, depth + 1)
                if spec is not None:
                    break
    if spec is not None:
        spec = tuple(spec) + (None,) * (ndim - len(spec))
    memo[v] = spec
    return spec


def _axes(entry: Any) -> tuple[str, ...]:
    return () if entry is None else ((entry,) if isinstance(entry, str) else tuple(entry))


def _split_bytes(shape: tuple[int, ...], dtype: Any, spec: tuple, sizes: dict[str, int]) -> int:
    """Bytes of the largest shard of a ``shape`` array laid out as ``spec`` (axes not in
    ``sizes``, such as ``pipe``, do not split it)."""
    n = itemsize(dtype)
    for d, size in enumerate(shape):
        e = spec[d] if d < len(spec) else None
        axes = () if e is None else ((e,) if isinstance(e, str) else tuple(e))
        n *= math.ceil(size / math.prod(sizes.get(a, 1) for a in axes))
    return n


def _relayout_sends(cut: Any, plan: Plan, schedule: Any, pipe_axis: str) -> tuple[float, ...]:
    """Bytes per device of each ``ppermute`` moving an interleaved scanned stack: per
    round of :func:`~autopar.lower.pipeline.stack_relayout`, one chunk of every stacked
    input (in) and of every stacked output (back). A stacked input also split over other
    mesh axes (its plan spec) sends that share; a stacked output (a gradient, laid out by
    the partitioner) is taken to be split like the stacked input of its shape and dtype."""
    v = schedule.virtual_stages
    if v == 1 or not (cut.stacked_inputs or cut.stacked_outputs):
        return ()
    rounds = len(stack_relayout(schedule.num_stages, v).rounds)
    invars, outvars = cut.jaxpr.jaxpr.invars, cut.jaxpr.jaxpr.outvars

    def share(i: int) -> int:
        spec = plan.inputs[i].spec if i < len(plan.inputs) else ()
        axes = [a for e in spec if e is not None for a in ((e,) if isinstance(e, str) else e)]
        return math.prod(plan.mesh.get(a, 1) for a in axes if a != pipe_axis)

    split_of = {}
    for i in cut.stacked_inputs:
        split_of.setdefault(slot_key(invars[i].aval), share(i))
    chunks = [
        _nbytes(cut.aval(invars[i])) / share(i) for i in cut.stacked_inputs
    ] + [_nbytes(cut.aval(outvars[i])) / split_of.get(slot_key(outvars[i].aval), 1)
         for i in cut.stacked_outputs]  # fmt: skip
    return tuple(float(b) for _ in range(rounds) for b in chunks)


def _relayout_copy(cut: Any, plan: Plan, schedule: Any, pipe_axis: str) -> float:
    """Bytes per device of the stacked inputs in chunk order (``v`` chunks each)."""
    invars = cut.jaxpr.jaxpr.invars
    total = 0.0
    for i in cut.stacked_inputs:
        spec = plan.inputs[i].spec if i < len(plan.inputs) else ()
        axes = [a for e in spec if e is not None for a in ((e,) if isinstance(e, str) else e)]
        split = math.prod(plan.mesh.get(a, 1) for a in axes if a != pipe_axis)
        total += schedule.virtual_stages * _nbytes(cut.aval(invars[i])) / split
    return float(total)


def _uneven_copy(cut: Any, plan: Plan, schedule: Any, pipe_axis: str) -> float:
    """Bytes per device of the slots a device takes from each unevenly split stack
    (:attr:`autopar.lower.stages.StageCut.uneven_stacks`: ``v`` chunks of ``n`` slots,
    the largest stage's count, padding included), held beside the whole stack while the
    ticks run; split over the other mesh axes as the plan splits the stack.

    Example: 5 layers of 1 KiB on 2 stages as (3, 2): 3 slots, 3 KiB per device.
    """
    invars = cut.jaxpr.jaxpr.invars
    total = 0.0
    for kind, i in cut.uneven_stacks:
        if kind != "in":
            continue
        spec = plan.inputs[i].spec if i < len(plan.inputs) else ()
        axes = [a for e in spec if e is not None for a in ((e,) if isinstance(e, str) else e)]
        split = math.prod(plan.mesh.get(a, 1) for a in axes if a != pipe_axis)
        total += schedule.virtual_stages * _nbytes(cut.aval(invars[i])) / split
    return float(total)


def _nbytes(aval: Any) -> int:
    shape, dtype = slot_key(aval)
    return math.prod(shape) * dtype.itemsize


__all__ = ["PipelineProgram", "pipeline_program", "value_specs"]
