"""Lowering: a :class:`~autopar.plan.Plan` -> a sharded ``jax.jit`` program.

Example:
    >>> lowered = autopar.lower.lower_plan(step, plan, (state, batch), graph=graph)
    >>> state, loss = lowered(state, batch)  # compiles, ~1 s  # doctest: +SKIP

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
from autopar.lower.remat import (
    GUARD_SCOPE,
    RecomputeBlock,
    RematRewrite,
    evaluate_remat,
    plan_remat,
)

__all__ = [
    "CPU_MEMORY_COMPILER_OPTIONS",
    "GUARD_SCOPE",
    "LateGathers",
    "LoweredStep",
    "RecomputeBlock",
    "RematRewrite",
    "arg_names",
    "check_leaves",
    "data_parallel_axes",
    "evaluate_remat",
    "late_gathers",
    "leaf_paths",
    "lower_plan",
    "make_mesh",
    "plan_remat",
    "remat_policy",
]
