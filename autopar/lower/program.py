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
from autopar.lower.pipeline import buffer_slots, cut_stages, make_schedule, send_slots
from autopar.lower.split import AccumulateError, gradient_graph
from autopar.plan import Plan
from autopar.trace.graph import Graph


@dataclass(frozen=True)
class PipelineProgram:
    """What the lowered pipeline (:mod:`autopar.lower.pipeline`) runs, in bytes per
    device: its ticks, the buffers one tick sends, the buffers it carries from tick to
    tick (``name -> (slots, bytes of one slot)``), how many outputs of ``G`` it sums over
    ``pipe`` after the flush, and which outputs of ``G`` stay split over ``pipe``."""

    ticks: int
    sends: tuple[float, ...]
    forward_sends: tuple[float, ...]
    backward_sends: tuple[float, ...]
    buffers: dict[str, tuple[int, float]]
    psums: int
    stacked_outputs: frozenset[int]


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
    )


__all__ = ["PipelineProgram", "pipeline_program"]
