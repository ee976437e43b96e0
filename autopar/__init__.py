"""autopar: an auto-parallelizing compiler for JAX training steps.

Trace a single-device step into a graph, search a parallel plan with a cost model, and
lower it to stock JAX (``jax.jit`` with ``NamedSharding``).

Example:
    >>> import autopar
    >>> @autopar.autoparallel(cache=False)
    ... def train_step(state, batch):
    ...     return step(state, batch)                  # the single-device step
    >>> new_state, loss = train_step(state, batch)     # traces, plans, compiles, runs
    >>> train_step.plan_for(state, batch).num_devices
    8
"""

__version__ = "0.1.0"

from autopar import (  # noqa: E402  (autopar.trace is callable: trace(fn, *args))
    baselines,  # noqa: E402
    checkpoint,
    export,
    report,
    trace,
)
from autopar.api import (  # noqa: E402
    AutoParallel,
    autoparallel,
    complete,
    evaluate,
    plan,
    verify,
)
from autopar.checkpoint import RestoreCheckpointError, SaveCheckpointError  # noqa: E402
from autopar.errors import (  # noqa: E402
    AccumulateError,
    AutoparError,
    AutoparWarning,
    BindArgumentsError,
    InfeasiblePlanError,
    InvalidOptionError,
    LoadPlanError,
    LowerPlanError,
    MatchSignatureError,
    SolverTimeLimitWarning,
    SolveShardingError,
    TraceFunctionError,
    UnknownPresetError,
    UnknownPrimitiveWarning,
)
from autopar.explain import ExplainPathError, explain  # noqa: E402  (the function)
from autopar.export import ImportSpecsError  # noqa: E402
from autopar.options import LoweringOptions, SearchOptions  # noqa: E402
from autopar.plan import (  # noqa: E402
    ActivationConstraint,
    Candidate,
    PipelinePlan,
    Plan,
    Predicted,
    PredictedCollective,
    TensorSharding,
)
from autopar.sweep import LoadSuiteError  # noqa: E402  (autopar.sweep: the sweep package)
from autopar.trace import Graph  # noqa: E402
from cost_models import Cluster  # noqa: E402

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
