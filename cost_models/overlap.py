"""The one overlap model: which communication hides behind compute, and how much.

Communication comes in classes (seconds per step, as collectives.py computes them):

* ``dp_grad``: data-parallel gradient all-reduce / reduce-scatter. Gradients appear
  during the backward pass, so it hides behind *backward* compute only.
* ``fsdp_gather``: parameter all-gathers of ZeRO-3 / FSDP, prefetched one layer ahead, so
  it hides behind any compute (forward or backward).
* ``pipeline_p2p``: activations sent between pipeline stages, asynchronous, hides behind
  any compute.
* ``tensor``, ``seq``, ``expert``, ``reshard``, ``batch_reduce``: collectives whose result
  the very next op needs (tensor-parallel all-reduces, sequence/context exchanges, MoE
  all-to-alls, resharding, and reductions over the data-parallel axes of values that are
  not gradients: the loss, metrics, batch statistics). They sit on the critical path:
  always exposed.

A compute second hides at most ``overlap_efficiency`` communication seconds (collective
kernels take SMs and HBM bandwidth from the compute they run beside), and each compute
second hides only once. ``dp_grad`` takes its share of the backward budget first, then
``fsdp_gather`` and ``pipeline_p2p`` share what is left of the whole budget:

    hidden_dp   = min(dp_grad, eta * backward_compute_s)
    budget      = eta * compute_s - hidden_dp
    hidden_fsdp = min(fsdp_gather, budget); budget -= hidden_fsdp
    hidden_p2p  = min(pipeline_p2p, budget)
    total_s     = compute_s + sum(comm - hidden) + bubble_s

Example:
    >>> st = compose_step_time(10.0, {"dp_grad": 3.0, "tensor": 1.0}, 6.0, 0.8)
    >>> st.total_s, st.hidden_comm_s, st.exposed_comm_s
    (11.0, 3.0, 1.0)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from cost_models.errors import CostModelError, check_positive

COMM_CLASSES: tuple[str, ...] = (
    "dp_grad",
    "fsdp_gather",
    "pipeline_p2p",
    "tensor",
    "seq",
    "expert",
    "reshard",
    "batch_reduce",
)
HIDEABLE_CLASSES: tuple[str, ...] = ("dp_grad", "fsdp_gather", "pipeline_p2p")
EXPOSED_CLASSES: tuple[str, ...] = ("tensor", "seq", "expert", "reshard", "batch_reduce")


@dataclass(frozen=True)
class StepTime:
    """One training step's time, split up.

    Attributes:
        total_s: compute + exposed communication + bubble.
        compute_s: compute seconds.
        exposed_comm_s: communication seconds on the critical path.
        hidden_comm_s: communication seconds hidden behind compute.
        bubble_s: pipeline idle seconds.
        breakdown: ``"compute"``, ``"bubble"`` and each communication class's *exposed*
            seconds.
        hidden: each communication class's hidden seconds.
    """

    total_s: float
    compute_s: float
    exposed_comm_s: float
    hidden_comm_s: float
    bubble_s: float
    breakdown: Mapping[str, float]
    hidden: Mapping[str, float] = field(default_factory=dict)


def compose_step_time(
    compute_s: float,
    comm: Mapping[str, float],
    backward_compute_s: float,
    overlap_efficiency: float,
    bubble_s: float = 0.0,
) -> StepTime:
    """Combine compute, communication and bubble into a step time (see the module docstring).

    Args:
        compute_s: compute seconds of the step (forward + backward + optimizer).
        comm: communication class -> seconds (classes in ``COMM_CLASSES``).
        backward_compute_s: the part of ``compute_s`` that is backward compute.
        overlap_efficiency: communication seconds one compute second can hide, in [0, 1]
            (``Cluster.overlap_efficiency``).
        bubble_s: pipeline bubble seconds, added as is.

    Example:
        >>> compose_step_time(10.0, {"dp_grad": 8.0}, 6.0, 0.5).exposed_comm_s
        5.0
    """
    check_positive("compute_s", compute_s, allow_zero=True)
    check_positive("backward_compute_s", backward_compute_s, allow_zero=True)
    check_positive("bubble_s", bubble_s, allow_zero=True)
    check_positive("overlap_efficiency", overlap_efficiency, allow_zero=True)
    if overlap_efficiency > 1:
        raise CostModelError(f"overlap_efficiency must be in [0, 1]; got {overlap_efficiency!r}")
    if backward_compute_s > compute_s * (1 + 1e-12):
        raise CostModelError(
            f"backward_compute_s ({backward_compute_s}) cannot exceed compute_s ({compute_s})"
        )
    for name, secs in comm.items():
        if name not in COMM_CLASSES:
            raise CostModelError(
                f"unknown communication class {name!r}; allowed: {', '.join(COMM_CLASSES)}"
            )
        check_positive(f"comm[{name!r}]", secs, allow_zero=True)

    hidden: dict[str, float] = {}
    dp = comm.get("dp_grad", 0.0)
    hidden["dp_grad"] = min(dp, overlap_efficiency * backward_compute_s)
    budget = overlap_efficiency * compute_s - hidden["dp_grad"]
    for name in ("fsdp_gather", "pipeline_p2p"):
        hidden[name] = min(comm.get(name, 0.0), max(budget, 0.0))
        budget -= hidden[name]
    hidden = {k: v for k, v in hidden.items() if k in comm}

    exposed = {name: secs - hidden.get(name, 0.0) for name, secs in comm.items()}
    exposed_s = sum(exposed.values())
    hidden_s = sum(hidden.values())
    breakdown = {"compute": compute_s, "bubble": bubble_s, **exposed}
    return StepTime(
        total_s=compute_s + exposed_s + bubble_s,
        compute_s=compute_s,
        exposed_comm_s=exposed_s,
        hidden_comm_s=hidden_s,
        bubble_s=bubble_s,
        breakdown=breakdown,
        hidden=hidden,
    )


def bound_linear_overlap(
    linear_step_s: float,
    work_s: float,
    hideable: Mapping[str, float],
    exposed_s: float,
    overlap_efficiency: float,
) -> float:
    """A linearly priced step with its hiding bounded by the compute there is.

    The planner's linear pricing (its ILP objective, and a pipeline's stage work) charges
    each overlappable second at ``1 - eta`` however little compute there is to hide it
    behind. This takes those seconds out again and hides at most ``eta`` times the raw
    compute (the rule of :func:`compose_step_time`: a compute second hides
    ``overlap_efficiency`` communication seconds, once), parameter gathers first (the
    next layer waits for them), then gradient reductions.

    Args:
        linear_step_s: the step as priced linearly (per device).
        work_s: the compute seconds that step counts, with the linear charges in it:
            ``raw + exposed_s + (1 - eta) * sum(hideable)``.
        hideable: ``"dp_grad"`` / ``"fsdp_gather"`` seconds per device inside
            ``work_s``.
        exposed_s: the other collectives' seconds per device inside ``work_s`` (charged
            in full: tensor-parallel, resharding, the loss's reduction).
        overlap_efficiency: ``eta``, ``Cluster.overlap_efficiency``.

    Returns:
        The step's seconds.

    Example:
        >>> # raw compute 30 - 0.4 x 50 = 10; hides min(50, 0.6 x 10) = 6 s of gathers
        >>> bound_linear_overlap(30.0, 30.0, {"fsdp_gather": 50.0}, 0.0, 0.6)  # 30 + 30 - 6
        54.0
    """
    check_positive("overlap_efficiency", overlap_efficiency, allow_zero=True)
    if overlap_efficiency > 1:
        raise CostModelError(f"overlap_efficiency must be in [0, 1]; got {overlap_efficiency!r}")
    for name in hideable:
        if name not in ("dp_grad", "fsdp_gather"):
            raise CostModelError(
                f"hideable class {name!r}: only 'dp_grad' and 'fsdp_gather' hide inside a "
                "step's work (pipeline sends are the schedule's)"
            )
    eta = float(overlap_efficiency)
    hide = {
        "fsdp_gather": hideable.get("fsdp_gather", 0.0),
        "dp_grad": hideable.get("dp_grad", 0.0),
    }
    charged = exposed_s + (1.0 - eta) * sum(hide.values())
    budget = eta * max(work_s - charged, 0.0)
    step = linear_step_s + eta * sum(hide.values())  # every hideable second in full
    hidden = 0.0
    for cls in ("fsdp_gather", "dp_grad"):
        h = min(hide[cls], budget)
        hidden += h
        budget -= h
    return step - hidden
