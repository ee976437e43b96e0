"""The Plan: what the search chose, in user terms, JSON round-trippable.

A plan names mesh axes and sizes, a ``PartitionSpec`` per input leaf (parameters, optimizer
state, batch), activation constraints, pipeline stages, remat policy and ZeRO stage, and the
cost model's prediction. It never holds solver indices or ``jax._src`` types.

Specs are stored as tuples with one entry per tensor dimension: ``None`` (replicated),
an axis name, or a tuple of axis names (the dimension split over several axes, outer first).

Example:
    >>> p = Plan(mesh={"data": 8}, inputs=(TensorSharding("batch/x", (64, 16), "float32",
    ...          ("data", None), "batch"),))
    >>> Plan.from_json(p.to_json()) == p
    True
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any, Literal

from autopar.atomic import atomic_write
from autopar.errors import LoadPlanError

SCHEMA_VERSION = 1

SpecEntry = str | tuple[str, ...] | None
Spec = tuple[SpecEntry, ...]


def _spec_from_json(raw: Sequence[Any]) -> Spec:
    out: list[SpecEntry] = []
    for e in raw:
        if e is None or isinstance(e, str):
            out.append(e)
        else:
            out.append(tuple(e))
    return tuple(out)


def _spec_to_json(spec: Spec) -> list:
    return [list(e) if isinstance(e, tuple) else e for e in spec]


def spec_axes(spec: Spec) -> tuple[str, ...]:
    """All mesh axes a spec uses, in order.

    Example:
        >>> spec_axes((("data", "fsdp"), None, "tensor"))
        ('data', 'fsdp', 'tensor')
    """
    out: list[str] = []
    for e in spec:
        if e is None:
            continue
        out.extend((e,) if isinstance(e, str) else e)
    return tuple(out)


def per_device_shape(shape: Sequence[int], spec: Spec, mesh: Mapping[str, int]) -> tuple[int, ...]:
    """The block of a ``shape`` array one device holds under ``spec`` on ``mesh``.

    Example:
        >>> per_device_shape((64, 256), ("data", ("tensor", "seq")), {"data": 2, "tensor": 4,
        ...                  "seq": 2})
        (32, 32)
    """
    out = []
    for d, n in enumerate(shape):
        e = spec[d] if d < len(spec) else None
        axes = () if e is None else (e,) if isinstance(e, str) else e
        out.append(-(-n // math.prod(mesh.get(a, 1) for a in axes)))
    return tuple(out)


def idle_axes(plan: Plan) -> tuple[str, ...]:
    """Mesh axes (of size > 1) that split nothing: no input, output or activation layout
    uses them and no collective runs over them. Their devices repeat the same work: the
    plan is the plan on the smaller mesh, run several times over.

    Example:
        >>> p = Plan(mesh={"data": 4, "tensor": 2}, inputs=(
        ...     TensorSharding("x", (8, 4), "float32", ("data", None), "batch"),))
        >>> idle_axes(p)
        ('tensor',)
    """
    used: set[str] = set()
    for rec in (*plan.inputs, *plan.outputs):
        used.update(spec_axes(rec.spec))
    for c in plan.activations:
        used.update(spec_axes(c.spec))
    for coll in plan.predicted.collectives:
        used.update(coll.axes)
    return tuple(a for a, n in plan.mesh.items() if n > 1 and a not in used)


def batch_only_axes(plan: Plan) -> tuple[str, ...]:
    """The mesh axes (of size > 1) that split the batch and nothing else: they split the
    leading dimension of a batch input and no other dimension of any input or output
    (no weight, no sequence), and no collective over them is a tensor, sequence or expert
    one. However they are named, they are data parallelism. (An op on a value without a
    batch dimension may still run split over them -- a position embedding's slice -- as
    in any data-parallel plan.)

    Of two such axes only one can be named ``data``; the search's
    :func:`autopar.search.to_plan.role_names` names the other ``fsdp`` when that is on
    offer, and a mesh the user fixed keeps its names, so the plan's summary says which
    axes split only the batch (:func:`autopar.report.text.summary`).

    Example:
        >>> p = Plan(mesh={"data": 2, "tensor": 4}, inputs=(
        ...     TensorSharding("x", (64, 8), "float32", (("data", "tensor"), None), "batch"),
        ...     TensorSharding("w", (8, 8), "float32", (None, None), "param")))
        >>> batch_only_axes(p)
        ('data', 'tensor')
    """
    batch: set[str] = set()
    other: set[str] = set()
    for rec in (*plan.inputs, *plan.outputs):
        for d, e in enumerate(rec.spec):
            axes = () if e is None else ((e,) if isinstance(e, str) else tuple(e))
            (batch if rec.role == "batch" and d == 0 else other).update(axes)
    for c in plan.predicted.collectives:
        if c.where in ("tensor", "seq", "expert"):
            other.update(c.axes)
    return tuple(a for a, n in plan.mesh.items() if n > 1 and a in batch and a not in other)


def to_partition_spec(spec: Spec):
    """Convert a stored spec to ``jax.sharding.PartitionSpec`` (trailing ``None``s dropped)."""
    from jax.sharding import PartitionSpec

    entries = list(spec)
    while entries and entries[-1] is None:
        entries.pop()
    return PartitionSpec(*entries)


@dataclass(frozen=True)
class TensorSharding:
    """How one flat input or output leaf is laid out on the mesh."""

    path: str
    shape: tuple[int, ...]
    dtype: str
    spec: Spec
    role: str = "other"

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(self.shape))
        object.__setattr__(self, "spec", _spec_from_json(self.spec))

    def to_json(self) -> dict:
        return {
            "path": self.path,
            "shape": list(self.shape),
            "dtype": self.dtype,
            "spec": _spec_to_json(self.spec),
            "role": self.role,
        }

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> TensorSharding:
        return cls(d["path"], tuple(d["shape"]), d["dtype"], _spec_from_json(d["spec"]), d["role"])


@dataclass(frozen=True)
class ActivationConstraint:
    """A ``with_sharding_constraint`` on one intermediate value.

    ``node`` indexes the equations of the traced (inlined) jaxpr, ``output`` the equation's
    results; ``scope`` walks into bodies: ``(scan_node_id, body_index)`` pairs, outermost
    first, empty for top-level values. ``name`` is the name stack, for humans.

    With ``operand`` set, the constraint is on the equation's input ``operand`` as this
    equation alone reads it (``output`` is then unused, 0): the layout the plan reshards
    a value to for one consumer, so XLA moves it the planned way rather than choosing its
    own (a dot contracting a dimension both operands split, say, which it would reduce
    with an all-reduce where the plan gathers one operand once for forward and backward).
    Several constraints on one operand are applied in the plan's order: the steps of a
    reshard (an all-to-all, then a gather, then a slice), each one XLA does as planned.
    """

    node: int
    output: int
    spec: Spec
    scope: tuple[tuple[int, int], ...] = ()
    name: str = ""
    operand: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "spec", _spec_from_json(self.spec))
        object.__setattr__(self, "scope", tuple(tuple(s) for s in self.scope))

    def to_json(self) -> dict:
        return {
            "node": self.node,
            "output": self.output,
            "spec": _spec_to_json(self.spec),
            "scope": [list(s) for s in self.scope],
            "name": self.name,
            "operand": self.operand,
        }

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> ActivationConstraint:
        return cls(
            d["node"],
            d["output"],
            d["spec"],
            tuple(map(tuple, d["scope"])),
            d["name"],
            d.get("operand"),
        )


@dataclass(frozen=True)
class PipelinePlan:
    """How the step's batch is split and, when pipelined, staged.

    Attributes:
        stages: layer ranges ``[start, stop)`` of ``graph.layers``, one per stage, or per
            chunk when interleaved (``chunks`` per device; device ``d`` runs ranges ``d,
            p + d, ...``); one range covering every layer: no pipelining, plain gradient
            accumulation.
        schedule: the pipeline schedule.
        microbatches: how many microbatches each step's batch is split into.
        chunks: stage chunks per device (interleaved 1F1B's virtual stages).
        microbatch_size: examples per data-parallel replica per microbatch, when known.
        stage_remat: the remat policy of each stage range, ``"none"`` or ``"full"`` (the
            stage keeps its input and re-runs its forward in its backward:
            :mod:`autopar.lower.stage_remat`); empty: ``"none"`` everywhere.
    """

    stages: tuple[tuple[int, int], ...]
    schedule: Literal["gpipe", "1f1b", "interleaved-1f1b", "zero-bubble"] = "1f1b"
    microbatches: int = 1
    chunks: int = 1
    microbatch_size: int | None = None
    stage_remat: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "stages", tuple(tuple(s) for s in self.stages))
        object.__setattr__(self, "stage_remat", tuple(self.stage_remat))
        if not isinstance(self.microbatches, int) or self.microbatches < 1:
            raise LoadPlanError(f"pipeline microbatches={self.microbatches!r} must be >= 1")
        if self.stage_remat and (
            len(self.stage_remat) != len(self.stages)
            or any(r not in ("none", "full") for r in self.stage_remat)
        ):
            raise LoadPlanError(
                f"pipeline stage_remat={list(self.stage_remat)!r} must give 'none' or 'full' "
                f"for each of the {len(self.stages)} stage ranges (or be empty: 'none')."
            )
        if not isinstance(self.chunks, int) or self.chunks < 1 or len(self.stages) % self.chunks:
            raise LoadPlanError(
                f"pipeline chunks={self.chunks!r} must be >= 1 and divide the {len(self.stages)} "
                "stage ranges (device d runs ranges d, p + d, 2p + d, ...)."
            )

    @property
    def num_stages(self) -> int:
        """Pipeline stages, one per ``pipe`` device (``stages`` holds ``num_stages *
        chunks`` chunk ranges when interleaved)."""
        return len(self.stages) // max(self.chunks, 1)

    @property
    def virtual_stages(self) -> int:
        """Stage chunks per device (``chunks``)."""
        return self.chunks

    def to_json(self) -> dict:
        return {
            "stages": [list(s) for s in self.stages],
            "schedule": self.schedule,
            "microbatches": self.microbatches,
            "chunks": self.chunks,
            "microbatch_size": self.microbatch_size,
            "stage_remat": list(self.stage_remat),
        }

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> PipelinePlan:
        return cls(
            tuple(map(tuple, d["stages"])),
            d["schedule"],
            d["microbatches"],
            d["chunks"],
            d.get("microbatch_size"),
            tuple(d.get("stage_remat", ())),
        )


@dataclass(frozen=True)
class PredictedCollective:
    """One kind of collective the plan implies: where, how big, how often, how long.

    ``bytes`` and ``time_s`` are totals per step (all ``count`` executions together), per
    device, with the cost model's convention: all-reduce = the buffer, all-gather = the full
    gathered output, reduce-scatter = the full input, all-to-all = the buffer.
    """

    kind: str
    axes: tuple[str, ...]
    bytes: float
    count: int
    time_s: float
    where: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "axes", tuple(self.axes))

    def to_json(self) -> dict:
        return {
            "kind": self.kind,
            "axes": list(self.axes),
            "bytes": self.bytes,
            "count": self.count,
            "time_s": self.time_s,
            "where": self.where,
        }

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> PredictedCollective:
        return cls(d["kind"], tuple(d["axes"]), d["bytes"], d["count"], d["time_s"], d["where"])


@dataclass(frozen=True)
class Predicted:
    """The cost model's prediction for one training step, per device.

    Attributes:
        step_time_s: predicted wall time of one step.
        compute_s: compute time (roofline) on the critical path.
        communication_s: total collective time (hidden or not).
        exposed_communication_s: the part of it not hidden behind compute.
        bubble_s: pipeline bubble time.
        memory_bytes_per_device: predicted peak bytes per device.
        memory_breakdown: parameters / gradients / optimizer / activations / temporaries.
        flops_per_device: FLOPs each device executes per step.
        collectives: per kind and axes.
        objective: the ILP objective of the intra-op solve (seconds), when one ran:
            for a planner's plan, equal to ``step_time_s`` (the number the search
            minimised is the number the plan reports).
        overlap_step_time_s: the overlap refinement of ``step_time_s``
            (``cost_models.compose_step_time``: hiding bounded by the compute available
            instead of weighted), when known.
        merged_reshard_s: seconds in ``step_time_s`` for reshards that XLA's CSE merges
            (the ILP charges each reader; ``collectives`` lists them once).
    """

    step_time_s: float
    compute_s: float = 0.0
    communication_s: float = 0.0
    exposed_communication_s: float = 0.0
    bubble_s: float = 0.0
    memory_bytes_per_device: float = 0.0
    memory_breakdown: Mapping[str, float] = field(default_factory=dict)
    flops_per_device: float = 0.0
    collectives: tuple[PredictedCollective, ...] = ()
    objective: float | None = None
    overlap_step_time_s: float | None = None
    merged_reshard_s: float = 0.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "memory_breakdown", dict(self.memory_breakdown))
        object.__setattr__(self, "collectives", tuple(self.collectives))

    def to_json(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["memory_breakdown"] = dict(self.memory_breakdown)
        d["collectives"] = [c.to_json() for c in self.collectives]
        return d

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> Predicted:
        d = dict(d)
        d["collectives"] = tuple(PredictedCollective.from_json(c) for c in d["collectives"])
        return cls(**d)


@dataclass(frozen=True)
class Candidate:
    """One plan the search priced, kept in :attr:`Plan.shortlist` beside the winner.

    Attributes:
        label: what it is, in words (``"data 4 x tensor 2"``, ``"pipeline-1f1b+autopar"``).
        mesh: its mesh.
        step_time_s: its predicted step time (the number the search compared); ``None``
            when it was not solved.
        memory_bytes_per_device: its predicted peak per device (``None``: not solved).
        compute_s: its compute seconds.
        bubble_s: its pipeline bubble seconds.
        communication_by_class: seconds per collective class
            (``cost_models.COMM_CLASSES``).
        verdict: ``"chosen"``, or why it lost (slower, and by what; over the memory bound,
            and by how much; not solved, and why).

    Example:
        >>> c = Candidate("data 8", {"data": 8}, 1e-3, 2e9, 8e-4, 0.0, {"dp_grad": 2e-4}, "chosen")
        >>> Candidate.from_json(c.to_json()) == c
        True
    """

    label: str
    mesh: Mapping[str, int]
    step_time_s: float | None
    memory_bytes_per_device: float | None
    compute_s: float = 0.0
    bubble_s: float = 0.0
    communication_by_class: Mapping[str, float] = field(default_factory=dict)
    verdict: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "mesh", dict(self.mesh))
        object.__setattr__(self, "communication_by_class", dict(self.communication_by_class))

    def to_json(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)} | {
            "mesh": dict(self.mesh),
            "communication_by_class": dict(self.communication_by_class),
        }

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> Candidate:
        return cls(**dict(d))


@dataclass(frozen=True)
class LayerStrategy:
    """A human-readable description of what the plan does in one layer (for reports)."""

    layer: str
    ops: tuple[tuple[str, str], ...]  # (op name, strategy description)

    def to_json(self) -> dict:
        return {"layer": self.layer, "ops": [list(o) for o in self.ops]}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> LayerStrategy:
        return cls(d["layer"], tuple(tuple(o) for o in d["ops"]))


@dataclass(frozen=True)
class Plan:
    """A parallel plan for one training step on one cluster.

    ``inputs``/``outputs`` hold one :class:`TensorSharding` per flat leaf, in
    ``jax.tree.leaves`` order; :attr:`in_specs` and :attr:`out_specs` give them back as
    pytrees of ``PartitionSpec`` matching the function's arguments and results.
    """

    mesh: Mapping[str, int]
    inputs: tuple[TensorSharding, ...] = ()
    outputs: tuple[TensorSharding, ...] = ()
    activations: tuple[ActivationConstraint, ...] = ()
    pipeline: PipelinePlan | None = None
    remat: Literal["none", "selective", "full"] = "none"
    zero_stage: int = 0
    layers: tuple[LayerStrategy, ...] = ()
    predicted: Predicted = field(default_factory=lambda: Predicted(step_time_s=0.0))
    cluster: Mapping[str, Any] = field(default_factory=dict)
    fingerprint: str = ""
    name: str = "autopar"
    cost_model_version: str = ""
    shortlist: tuple[Candidate, ...] = ()
    schema_version: int = SCHEMA_VERSION
    # Pytree structure of the args/results; not serialised, re-attached by ``bind``.
    in_tree: Any = field(default=None, compare=False, repr=False)
    out_tree: Any = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "mesh", dict(self.mesh))
        object.__setattr__(self, "cluster", dict(self.cluster))
        for name in ("inputs", "outputs", "activations", "layers", "shortlist"):
            object.__setattr__(self, name, tuple(getattr(self, name)))

    # -- views ------------------------------------------------------------------------
    @property
    def num_devices(self) -> int:
        n = 1
        for s in self.mesh.values():
            n *= s
        return n

    def _specs(self, records: tuple[TensorSharding, ...], tree: Any):
        specs = [to_partition_spec(r.spec) for r in records]
        if tree is None:
            return {r.path: s for r, s in zip(records, specs, strict=True)}
        import jax

        return jax.tree_util.tree_unflatten(tree, specs)

    @property
    def in_specs(self):
        """Pytree of ``PartitionSpec`` matching the arguments (a dict by path if unbound)."""
        return self._specs(self.inputs, self.in_tree)

    @property
    def out_specs(self):
        """Pytree of ``PartitionSpec`` matching the results (a dict by path if unbound)."""
        return self._specs(self.outputs, self.out_tree)

    def input(self, path: str) -> TensorSharding:
        """The record of the input whose path is ``path`` (or ends with ``/path``)."""
        for r in self.inputs:
            if r.path == path or r.path.endswith("/" + path):
                return r
        raise KeyError(f"no input with path {path!r}; paths look like {self.inputs[0].path!r}")

    def bind(self, in_tree: Any, out_tree: Any) -> Plan:
        return replace(self, in_tree=in_tree, out_tree=out_tree)

    # -- JSON -------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return {
            "schema_version": self.schema_version,
            "name": self.name,
            "mesh": dict(self.mesh),
            "remat": self.remat,
            "zero_stage": self.zero_stage,
            "pipeline": self.pipeline.to_json() if self.pipeline else None,
            "inputs": [r.to_json() for r in self.inputs],
            "outputs": [r.to_json() for r in self.outputs],
            "activations": [a.to_json() for a in self.activations],
            "layers": [s.to_json() for s in self.layers],
            "predicted": self.predicted.to_json(),
            "cluster": dict(self.cluster),
            "fingerprint": self.fingerprint,
            "cost_model_version": self.cost_model_version,
            "shortlist": [c.to_json() for c in self.shortlist],
        }

    def to_json(self, indent: int | None = 1) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Plan:
        if not isinstance(d, Mapping):
            raise LoadPlanError(
                f"plan JSON must be an object with a 'schema_version', 'mesh', 'inputs', ... "
                f"(what Plan.save writes), got a {type(d).__name__}; re-plan or fix the file."
            )
        version = d.get("schema_version")
        if version != SCHEMA_VERSION:
            raise LoadPlanError(
                f"plan schema version {version!r} is not supported (this autopar reads "
                f"version {SCHEMA_VERSION}); re-plan with autopar.plan(...)."
            )
        mesh = d.get("mesh")
        if (
            not isinstance(mesh, Mapping)
            or not mesh
            or not all(isinstance(a, str) for a in mesh)
            or not all(
                isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in mesh.values()
            )
        ):
            raise LoadPlanError(
                f"plan JSON is malformed: its mesh is {mesh!r}; a mesh maps axis names to "
                "integer sizes >= 1, "
                'e.g. {"data": 2, "tensor": 4}: fix the file or re-plan.'
            )
        try:
            return cls(
                mesh=dict(mesh),
                inputs=tuple(TensorSharding.from_json(r) for r in d["inputs"]),
                outputs=tuple(TensorSharding.from_json(r) for r in d["outputs"]),
                activations=tuple(ActivationConstraint.from_json(a) for a in d["activations"]),
                pipeline=PipelinePlan.from_json(d["pipeline"]) if d["pipeline"] else None,
                remat=d["remat"],
                zero_stage=d["zero_stage"],
                layers=tuple(LayerStrategy.from_json(s) for s in d["layers"]),
                predicted=Predicted.from_json(d["predicted"]),
                cluster=d["cluster"],
                fingerprint=d["fingerprint"],
                name=d["name"],
                cost_model_version=d["cost_model_version"],
                shortlist=tuple(Candidate.from_json(c) for c in d.get("shortlist", ())),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise LoadPlanError(
                f"plan JSON is malformed ({type(e).__name__}: {e}); re-plan with "
                "autopar.plan(...) or fix the file (Plan.save writes the expected layout)."
            ) from e

    @classmethod
    def from_json(cls, text: str) -> Plan:
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise LoadPlanError(f"plan is not valid JSON: {e}") from e
        return cls.from_dict(d)

    def save(self, path: str | os.PathLike) -> None:
        """Write the plan as JSON atomically (a crash never leaves a partial file)."""
        atomic_write(path, self.to_json())

    @classmethod
    def load(cls, path: str | os.PathLike) -> Plan:
        try:
            with open(path) as f:
                return cls.from_json(f.read())
        except FileNotFoundError as e:
            raise LoadPlanError(f"no plan file at {os.fspath(path)!r}.") from e
