"""Lowering: a :class:`~autopar.plan.Plan` -> a sharded ``jax.jit`` program.

Example:
    >>> lowered = autopar.lower.lower_plan(step, plan, (state, batch))   # doctest: +SKIP
    >>> state, loss = lowered(state, batch)                               # doctest: +SKIP
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

__all__ = [
    "CPU_MEMORY_COMPILER_OPTIONS",
    "LoweredStep",
    "arg_names",
    "check_leaves",
    "data_parallel_axes",
    "leaf_paths",
    "lower_plan",
    "make_mesh",
    "remat_policy",
]
