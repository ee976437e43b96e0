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
import numpy as np

from autopar.errors import LowerPlanError
from autopar.lower.pipeline import (
    buffer_slots,
    cut_stages,
    make_schedule,
    send_slots,
    stack_relayout,
)
from autopar.lower.split import AccumulateError, gradient_graph
from autopar.lower.stage_remat import remat_stages
from autopar.plan import Plan
from autopar.trace.graph import Graph


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
            while the ticks run (per device: ``v`` chunks of every stacked input).
        recomputed_bytes: with stages rematerialised (``plan.pipeline.stage_remat``), the
            most any of them re-creates in one backward tick: what its stash held
            without remat (per device).
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
        leaves = [jax.ShapeDtypeStruct(gi.tensor.shape, gi.tensor.dtype) for gi in graph.inputs]
        args = jax.tree_util.tree_unflatten(graph.in_tree, leaves)[0]
        cut = cut_stages(
            gradient_graph(accumulation, args), pp.stages, batch_inputs=accumulation.batch_inputs
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
        nbytes = math.prod(shape) * np.dtype(dtype).itemsize
        for d in range(min(2, len(shape))):
            if split > 1 and shape[d] == rows:
                return float(nbytes // shape[d] * math.ceil(shape[d] / split))
        return float(nbytes)

    slots = buffer_slots(cut, schedule)
    relayout = _relayout_sends(cut, plan, schedule, pipe_axis)
    return PipelineProgram(
        ticks=len(schedule.ticks),
        sends=tuple(per_device(*key) for key in send_slots(cut)),
        forward_sends=tuple(per_device(*key) for key in slots["forward"][1]),
        backward_sends=tuple(per_device(*key) for key in slots["backward"][1]),
        buffers={
            name: (n, sum(per_device(*key) for key in layout))
            for name, (n, layout) in slots.items()
        },
        psums=len(cut.jaxpr.jaxpr.outvars) - len(cut.stacked_outputs),
        stacked_outputs=frozenset(cut.stacked_outputs),
        virtual_stages=schedule.virtual_stages,
        relayout_sends=relayout,
        relayout_bytes=float(sum(relayout)),
        relayout_copy_bytes=_relayout_copy(cut, plan, schedule, pipe_axis) if relayout else 0.0,
        recomputed_bytes=max(
            (
                sum(
                    per_device(full.aval(v).shape, full.aval(v).dtype)
                    for v in full.forward(s).stash
                )
                for s, r in enumerate(pp.stage_remat)
                if r == "full"
            ),
            default=0.0,
        ),
    )


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
        split_of.setdefault(_key(invars[i].aval), share(i))
    chunks = [
        _nbytes(cut.aval(invars[i])) / share(i) for i in cut.stacked_inputs
    ] + [_nbytes(cut.aval(outvars[i])) / split_of.get(_key(outvars[i].aval), 1)
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


def _key(aval: Any) -> tuple:
    return (tuple(aval.shape), np.dtype(aval.dtype))


def _nbytes(aval: Any) -> int:
    return math.prod(aval.shape) * np.dtype(aval.dtype).itemsize


__all__ = ["PipelineProgram", "pipeline_program"]
