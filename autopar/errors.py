"""Errors raised by autopar.

Every error is a subclass of :class:`AutoparError` and its message says what was wrong and
what to do about it. Names follow ``<Verb><Object>Error`` where there is a verb to name.
"""

from __future__ import annotations

# The root class lives in cost_models (which never imports autopar), so that the cost
# models' own CostModelError is an AutoparError too.
from cost_models.errors import AutoparError as AutoparError
from cost_models.errors import CostModelError as CostModelError


class InvalidOptionError(AutoparError, ValueError):
    """An option or argument had a value outside the allowed set."""


class TraceFunctionError(AutoparError):
    """The function could not be traced into a graph (bad arguments, unsupported construct)."""


class InfeasiblePlanError(AutoparError):
    """No plan fits the constraints; the message says which bound failed and by how much.

    Attributes:
        smallest_bytes: the smallest per-device footprint the search found (if any).
        bound_bytes: the per-device bound it had to fit.
        closest: the plan that came closest, in words (its mesh and levers).

    Example:
        >>> e = InfeasiblePlanError("too big", smallest_bytes=9e10, bound_bytes=8e10)
        >>> e.smallest_bytes / e.bound_bytes
        1.125
    """

    def __init__(
        self,
        message: str,
        *,
        smallest_bytes: float | None = None,
        bound_bytes: float | None = None,
        closest: str | None = None,
    ) -> None:
        super().__init__(message)
        self.smallest_bytes = smallest_bytes
        self.bound_bytes = bound_bytes
        self.closest = closest

    def restated(self, message: str, bound_bytes: float | None = None) -> InfeasiblePlanError:
        """The same finding (smallest footprint, closest plan) under a message that says
        more: what was tried around it, and the bound that counts for the caller.

        Example:
            >>> e = InfeasiblePlanError("too big", smallest_bytes=9e10, bound_bytes=8e10)
            >>> e.restated(f"inside the stages: {e}", 2e10).bound_bytes
            20000000000.0
        """
        return InfeasiblePlanError(
            message,
            smallest_bytes=self.smallest_bytes,
            bound_bytes=self.bound_bytes if bound_bytes is None else bound_bytes,
            closest=self.closest,
        )


class BindArgumentsError(AutoparError, TypeError):
    """The arguments of a call do not fit the step: an unexpected or missing keyword, too
    few positional arguments, or an unhashable static argument (what ``jax.jit`` refuses
    too); the message names the argument and says how to pass it."""


class SolveShardingError(AutoparError):
    """The sharding solver failed for a reason other than infeasibility (e.g. time limit)."""


class LoadPlanError(AutoparError):
    """A saved plan could not be read, or does not match the function it is applied to."""


class MatchSignatureError(LoadPlanError):
    """A lowered step was called with arguments of another structure, shape or dtype than
    the ones it was planned and lowered for (``@autoparallel`` re-plans for them; a
    :class:`~autopar.lower.LoweredStep` has to be lowered again)."""


class LowerPlanError(AutoparError):
    """A plan could not be turned into a sharded JAX program."""


class AccumulateError(LowerPlanError):
    """A step cannot be split into microbatches without changing its result (batch
    statistics, a loss that is not a sum or mean over the batch, ...); the message names
    the equation."""


class UnknownPresetError(AutoparError, KeyError):
    """A named preset (cluster, device, model) does not exist."""

    def __str__(self) -> str:  # KeyError quotes its message; we want it plain.
        return str(self.args[0]) if self.args else ""


class AutoparWarning(UserWarning):
    """Base class of the warnings autopar issues: the step runs, but not as well as it could."""


class UnknownPrimitiveWarning(AutoparWarning):
    """The step uses primitives autopar has no sharding rule for: they run replicated
    (every device computes them on whole tensors) and count 0 FLOPs in the cost model."""


class ReplicatedControlFlowWarning(AutoparWarning):
    """The step branches or loops over arrays with ``lax.cond`` / ``lax.switch`` /
    ``lax.while_loop``: autopar has no sharding rule for them yet, so their array operands
    and results are whole on every device (gathered before, computed replicated)."""


class SolverTimeLimitWarning(AutoparWarning):
    """The sharding solver ran out of time (``SearchOptions.solver_time_limit_s``) before it
    proved its plan optimal; the best plan found so far is used."""
