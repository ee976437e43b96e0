"""autopar: an auto-parallelizing compiler for JAX training steps.

Trace a single-device step into a graph, search a parallel plan with a cost model, and
lower it to stock JAX (``jax.jit`` with ``NamedSharding``).

The public names load on first use (PEP 562), so ``import autopar`` and reading a saved
plan (``autopar.Plan.load``, ``autopar show``) do not import JAX; ``autopar.plan``,
``autopar.trace`` or ``autopar.autoparallel`` import it when first touched.

Example:
    >>> import autopar
    >>> @autopar.autoparallel(cache=False)
    ... def train_step(state, batch):
    ...     return step(state, batch)                  # the single-device step
    >>> new_state, loss = train_step(state, batch)     # traces, plans, compiles, runs
    >>> train_step.plan_for(state, batch).num_devices
    8
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# Each public name -> the module that defines it. A name equal to the module's last part
# ("report", "sweep") is the module itself; ``autopar.trace`` is a callable package.
_WHERE: dict[str, str] = {
    **dict.fromkeys(("baselines", "checkpoint", "export", "report", "sweep", "trace"), ""),
    **dict.fromkeys(
        ("AutoParallel", "autoparallel", "complete", "evaluate", "plan", "verify"), "autopar.api"
    ),
    **dict.fromkeys(("RestoreCheckpointError", "SaveCheckpointError"), "autopar.checkpoint"),
    **dict.fromkeys(
        (
            "AccumulateError",
            "AutoparError",
            "AutoparWarning",
            "BindArgumentsError",
            "InfeasiblePlanError",
            "InvalidOptionError",
            "LoadPlanError",
            "LowerPlanError",
            "MatchSignatureError",
            "ReplicatedControlFlowWarning",
            "SolverTimeLimitWarning",
            "SolveShardingError",
            "TraceFunctionError",
            "UnknownPresetError",
            "UnknownPrimitiveWarning",
        ),
        "autopar.errors",
    ),
    **dict.fromkeys(("ExplainPathError", "explain"), "autopar.explain"),
    "ImportSpecsError": "autopar.export",
    **dict.fromkeys(("LoweringOptions", "SearchOptions"), "autopar.options"),
    **dict.fromkeys(
        (
            "ActivationConstraint",
            "Candidate",
            "PipelinePlan",
            "Plan",
            "Predicted",
            "PredictedCollective",
            "TensorSharding",
        ),
        "autopar.plan",
    ),
    "LoadSuiteError": "autopar.sweep",
    "Graph": "autopar.trace",
    "Cluster": "cost_models",
}

_FUNCTIONS_OVER_SUBMODULES = frozenset({"plan", "explain", "verify"})
"""Public functions named like a submodule of this package (``autopar/plan.py``,
``autopar/explain.py``, ``autopar/verify/``): ``autopar.plan`` stays the function even after
``import autopar.plan`` (see :class:`_Package`)."""


def __getattr__(name: str) -> Any:
    """Import a public name, or a submodule (``autopar.lower``), on first use (PEP 562)."""
    where = _WHERE.get(name)
    if where is None:
        if name.startswith("_"):
            raise AttributeError(f"module 'autopar' has no attribute {name!r}")
        try:  # a submodule not in __all__, e.g. autopar.lower, autopar.search
            return importlib.import_module(f"autopar.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"autopar.{name}":
                raise
            raise AttributeError(f"module 'autopar' has no attribute {name!r}") from None
    if where:
        value = getattr(importlib.import_module(where), name)
    else:
        value = importlib.import_module(f"autopar.{name}")
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


class _Package(types.ModuleType):
    """This package's module type: when a submodule is first imported, Python binds it as
    an attribute of its package (``autopar.plan = <module autopar.plan>``), which would hide
    the public function of that name. Those bindings are dropped, so the name resolves
    through :func:`__getattr__` to the function; the submodule stays in ``sys.modules``."""

    def __setattr__(self, name: str, value: Any) -> None:
        if (
            name in _FUNCTIONS_OVER_SUBMODULES
            and isinstance(value, types.ModuleType)
            and value.__name__ == f"{self.__name__}.{name}"
        ):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package

if TYPE_CHECKING:  # what the names are, for type checkers and editors
    from autopar import baselines, checkpoint, export, report, sweep, trace
    from autopar.api import AutoParallel, autoparallel, complete, evaluate, plan, verify
    from autopar.checkpoint import RestoreCheckpointError, SaveCheckpointError
    from autopar.errors import (
        AccumulateError,
        AutoparError,
        AutoparWarning,
        BindArgumentsError,
        InfeasiblePlanError,
        InvalidOptionError,
        LoadPlanError,
        LowerPlanError,
        MatchSignatureError,
        ReplicatedControlFlowWarning,
        SolverTimeLimitWarning,
        SolveShardingError,
        TraceFunctionError,
        UnknownPresetError,
        UnknownPrimitiveWarning,
    )
    from autopar.explain import ExplainPathError, explain
    from autopar.export import ImportSpecsError
    from autopar.options import LoweringOptions, SearchOptions
    from autopar.plan import (
        ActivationConstraint,
        Candidate,
        PipelinePlan,
        Plan,
        Predicted,
        PredictedCollective,
        TensorSharding,
    )
    from autopar.sweep import LoadSuiteError
    from autopar.trace import Graph
    from cost_models import Cluster

__all__ = [
    "ActivationConstraint",
    "AutoParallel",
    "AccumulateError",
    "AutoparError",
    "AutoparWarning",
    "BindArgumentsError",
    "Candidate",
    "Cluster",
    "ExplainPathError",
    "Graph",
    "ImportSpecsError",
    "InfeasiblePlanError",
    "InvalidOptionError",
    "LoadPlanError",
    "LoadSuiteError",
    "LowerPlanError",
    "LoweringOptions",
    "MatchSignatureError",
    "PipelinePlan",
    "Plan",
    "Predicted",
    "PredictedCollective",
    "ReplicatedControlFlowWarning",
    "RestoreCheckpointError",
    "SaveCheckpointError",
    "SearchOptions",
    "SolveShardingError",
    "SolverTimeLimitWarning",
    "TensorSharding",
    "TraceFunctionError",
    "UnknownPresetError",
    "UnknownPrimitiveWarning",
    "__version__",
    "report",
    "autoparallel",
    "complete",
    "baselines",
    "checkpoint",
    "evaluate",
    "explain",
    "export",
    "plan",
    "sweep",
    "trace",
    "verify",
]
