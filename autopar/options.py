"""User-facing options of the search and the lowering: typed, frozen, validated at construction.

Every knob the search would otherwise choose can be fixed here; ``None`` means "search it".

Example:
    >>> opts = SearchOptions(mesh={"data": 2, "tensor": 4})
    >>> opts.mesh_axes
    ('data', 'tensor')
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Literal

from autopar.axes import AXIS_NAMES
from autopar.errors import InvalidOptionError

Schedule = Literal["gpipe", "1f1b", "interleaved-1f1b", "zero-bubble"]
Remat = Literal["none", "selective", "full"]
SCHEDULES: tuple[str, ...] = ("gpipe", "1f1b", "interleaved-1f1b", "zero-bubble")
REMATS: tuple[str, ...] = ("none", "selective", "full")


def _check_choice(name: str, value: object, allowed: tuple) -> None:
    if value is not None and value not in allowed:
        raise InvalidOptionError(f"{name}={value!r} is not allowed; choose one of {allowed}.")


def _check_positive(name: str, value: float | None) -> None:
    if value is not None and not value > 0:
        raise InvalidOptionError(f"{name}={value!r} must be a positive number.")


@dataclass(frozen=True)
class SearchOptions:
    """What the planner may choose and what it must respect.

    Attributes:
        mesh: fix the mesh, an ordered mapping axis -> size, e.g. ``{"data": 2, "tensor": 4}``
            (axis order is outer -> inner). ``None``: try the factorisations of the device
            count over ``axes``.
        axes: the axes the search may use when ``mesh`` is not given; ``None`` lets the
            search choose from ``AUTO_AXES`` by what the graph can use (``expert`` only with
            an expert dimension, ``seq`` only for long sequences or small batches).
        memory_limit_bytes: per-device memory bound; default is the device's capacity.
        pipeline_stages: fix the number of pipeline stages (``1`` disables pipelining).
        microbatches: fix the number of microbatches a step's batch is split into
            (gradients accumulated over them; the pipeline's microbatches when pipelining).
        microbatch_size: fix the per-replica microbatch size instead (Megatron's
            ``micro_batch_size``: examples per data-parallel replica per microbatch).
            Giving both is an error unless they agree with the batch.
        schedule: fix the pipeline schedule.
        virtual_stages: fix the stage chunks per device (interleaved 1F1B).
        remat: fix the rematerialisation policy.
        zero_stage: fix the ZeRO stage (0-3) for the data axes: 0 keeps parameters and
            optimizer state off them; 1 and 2 split the optimizer state over them (one
            layout: the partitioner reduce-scatters the gradients such a state reads,
            and plans report it as stage 1); 3 splits the parameters too. From stage 1
            the batch is split over them; a tensor no split divides stays whole.
        solver_time_limit_s: CP-SAT time limit per solve.
        max_meshes: how many mesh factorisations the outer loop solves in full.
        coarsen: merge elementwise chains and tile repeated layers (turn off only to debug).
    """

    mesh: Mapping[str, int] | None = None
    axes: tuple[str, ...] | None = None
    memory_limit_bytes: int | None = None
    pipeline_stages: int | None = None
    microbatches: int | None = None
    schedule: Schedule | None = None
    microbatch_size: int | None = None
    virtual_stages: int | None = None
    remat: Remat | None = None
    zero_stage: Literal[0, 1, 2, 3] | None = None
    solver_time_limit_s: float = 30.0
    max_meshes: int = 8
    coarsen: bool = True

    def __post_init__(self) -> None:
        if self.mesh is not None:
            if not isinstance(self.mesh, Mapping) or not self.mesh:
                raise InvalidOptionError(
                    f"mesh={self.mesh!r} must be a non-empty mapping axis name -> size, "
                    'e.g. {"data": 2, "tensor": 4}.'
                )
            for name, size in self.mesh.items():
                if name not in AXIS_NAMES:
                    raise InvalidOptionError(
                        f"mesh axis {name!r} is unknown; use names from {AXIS_NAMES}."
                    )
                if not isinstance(size, int) or size < 1:
                    raise InvalidOptionError(
                        f"mesh axis {name!r} has size {size!r}; sizes must be integers >= 1."
                    )
            object.__setattr__(self, "mesh", dict(self.mesh))
        if self.axes is not None:
            bad = [a for a in self.axes if a not in AXIS_NAMES]
            if bad or not self.axes:
                raise InvalidOptionError(
                    f"axes={self.axes!r}: give a non-empty tuple of names from {AXIS_NAMES}."
                )
            object.__setattr__(self, "axes", tuple(self.axes))
        _check_choice("schedule", self.schedule, SCHEDULES)
        _check_choice("remat", self.remat, REMATS)
        _check_choice("zero_stage", self.zero_stage, (0, 1, 2, 3))
        _check_positive("memory_limit_bytes", self.memory_limit_bytes)
        _check_positive("solver_time_limit_s", self.solver_time_limit_s)
        for name in (
            "pipeline_stages",
            "microbatches",
            "microbatch_size",
            "virtual_stages",
            "max_meshes",
        ):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise InvalidOptionError(f"{name}={value!r} must be an integer >= 1.")

    @property
    def mesh_axes(self) -> tuple[str, ...]:
        return tuple(self.mesh) if self.mesh is not None else ()

    def to_dict(self) -> dict:
        d = asdict(self) if self.mesh is None else {**asdict(self), "mesh": dict(self.mesh)}
        d["axes"] = list(self.axes) if self.axes is not None else None
        return d

    def cache_key(self) -> str:
        """A stable string of every option that changes the search's output."""
        return json.dumps(self.to_dict(), sort_keys=True)


@dataclass(frozen=True)
class LoweringOptions:
    """How a plan becomes a program.

    Attributes:
        donate_argnums: arguments whose buffers the compiled step may reuse. Only what the
            user names here is donated: the user's arrays stay valid otherwise.
        static_argnums: arguments that are Python values baked into the program.
        activation_constraints: insert the plan's ``with_sharding_constraint`` points.
        cache_dir: where plans are cached on disk (``None``: ``~/.cache/autopar``; set the
            option ``use_cache=False`` to disable).
        use_cache: read and write the on-disk plan cache.
        late_gathers: tie each gather of an input (a ZeRO-3/FSDP weight, optimizer state
            read whole) to the computed operand it meets, so XLA issues it right before
            its use instead of at the step's start (:mod:`autopar.lower.order`); ``False``
            leaves the order to XLA's scheduler.
    """

    donate_argnums: tuple[int, ...] = ()
    static_argnums: tuple[int, ...] = ()
    activation_constraints: bool = True
    cache_dir: str | None = None
    use_cache: bool = True
    late_gathers: bool = True
    extra: Mapping[str, object] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("donate_argnums", "static_argnums"):
            value = getattr(self, name)
            if isinstance(value, int):
                value = (value,)
            if not all(isinstance(v, int) and v >= 0 for v in value):
                raise InvalidOptionError(f"{name}={value!r} must be non-negative integers.")
            object.__setattr__(self, name, tuple(value))
        overlap = set(self.donate_argnums) & set(self.static_argnums)
        if overlap:
            raise InvalidOptionError(
                f"argument(s) {sorted(overlap)} are both donated and static; pick one."
            )
