"""Lowering: a :class:`~autopar.plan.Plan` -> a sharded ``jax.jit`` program.

Example:
    >>> lowered = autopar.lower.lower_plan(step, plan, (state, batch), graph=graph)
    >>> state, loss = lowered(state, batch)  # compiles, ~1 s  # doctest: +SKIP

Microbatches and pipelines: :mod:`autopar.lower.split` (the step split at its gradients,
gradient accumulation), :mod:`autopar.lower.stages` / :mod:`autopar.lower.pipeline` (the
cut and the ``pipe``-axis runtime), :mod:`autopar.lower.program` (what it runs, for the
cost model).

Remat from outside the model (``plan.remat`` = ``"selective"`` / ``"full"``) rewrites the
traced step's evaluation: see :mod:`autopar.lower.remat`.
"""

from autopar.lower.lowering import (
    CPU_MEMORY_COMPILER_OPTIONS,
    LoweredStep,
    arg_names,
    check_leaves,
    data_parallel_axes,
    leaf_paths,
    lower_plan,
    remat_policy,
)
from autopar.lower.mesh import make_mesh
from autopar.lower.order import LateGathers, late_gathers
from autopar.lower.pipeline import (
    Schedule,
    StageCut,
    cut_stages,
    make_schedule,
    pipelined_gradients,
    stack_relayout,
)
from autopar.lower.program import PipelineProgram, pipeline_program
from autopar.lower.remat import (
    GUARD_SCOPE,
    RecomputeBlock,
    RematRewrite,
    evaluate_remat,
    plan_remat,
)
from autopar.lower.split import (
    Accumulation,
    accumulated_function,
    gradient_graph,
    pipelined_function,
    plan_accumulation,
)
from autopar.lower.stage_remat import remat_stages

__all__ = [
    "Accumulation",
    "CPU_MEMORY_COMPILER_OPTIONS",
    "GUARD_SCOPE",
    "LateGathers",
    "LoweredStep",
    "PipelineProgram",
    "RecomputeBlock",
    "RematRewrite",
    "Schedule",
    "StageCut",
    "accumulated_function",
    "arg_names",
    "check_leaves",
    "cut_stages",
    "data_parallel_axes",
    "evaluate_remat",
    "gradient_graph",
    "late_gathers",
    "leaf_paths",
    "lower_plan",
    "make_mesh",
    "make_schedule",
    "pipeline_program",
    "pipelined_function",
    "pipelined_gradients",
    "plan_accumulation",
    "plan_remat",
    "remat_policy",
    "remat_stages",
    "stack_relayout",
]
