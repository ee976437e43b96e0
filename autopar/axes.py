"""The mesh-axes table: what each mesh axis autopar knows means.

One row per axis, outer -> inner (inner axes land on the fastest links: NVLink, ICI).
Options validate against it, the planner enumerates and names axes with it, the pricing
classifies collectives with it, the lowering knows which axes split the batch, and the
reports describe plans with it. Communication classes are ``cost_models``' vocabulary
(``cost_models.COMM_CLASSES``); this table only says which class an axis's traffic is.

Columns:

* ``splits``: what the axis divides: ``"stages"`` (pipeline), ``"batch"`` (data
  parallel), ``"batch+state"`` (FSDP / ZeRO-3: the batch, and parameters and optimizer
  state between uses), ``"experts"``, ``"sequence"`` (context parallel), ``"model"``
  (tensor / Megatron).
* ``comm_class``: the ``cost_models`` class of the traffic the axis exists for.
* ``exposed_rank``: for collectives named by the axes they run over (not gradient
  reductions, not parameter gathers), which axis names the class first (lower first);
  ``None``: the axis never names a class.
* ``zero``: ZeRO stages 1-3 shard optimizer state (and more) over it.
* ``batch``: the axis divides the global batch (the lowering shards batch inputs over
  it; gradients are reduced over it).
* ``auto``: the search may pick it when ``SearchOptions.axes`` is not given.
* ``words``: how a report says it.

Example:
    >>> AXES["tensor"].comm_class, AXES["fsdp"].zero
    ('tensor', True)
    >>> exposed_class(["data", "seq"])
    'seq'
    >>> batch_axes({"data": 2, "tensor": 4})
    ('data',)
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Literal

from cost_models import COMM_CLASSES

Splits = Literal["stages", "batch", "batch+state", "experts", "sequence", "model"]


@dataclass(frozen=True)
class MeshAxis:
    """One mesh axis autopar knows (columns: see the module docstring)."""

    name: str
    splits: Splits
    comm_class: str
    exposed_rank: int | None
    zero: bool
    batch: bool
    auto: bool
    words: str

    def __post_init__(self) -> None:
        if self.comm_class not in COMM_CLASSES:
            raise ValueError(
                f"axis {self.name!r}: comm_class {self.comm_class!r} is not one of {COMM_CLASSES}"
            )


AXES_TABLE: tuple[MeshAxis, ...] = (
    MeshAxis("pipe", "stages", "pipeline_p2p", None, False, False, False, "pipeline parallel"),
    MeshAxis("data", "batch", "dp_grad", None, True, True, True, "data parallel"),
    MeshAxis("fsdp", "batch+state", "fsdp_gather", None, True, True, True, "FSDP / ZeRO-3"),
    MeshAxis("expert", "experts", "expert", 1, False, False, True, "expert parallel"),
    MeshAxis("seq", "sequence", "seq", 0, False, False, True, "sequence / context parallel"),
    MeshAxis("tensor", "model", "tensor", 2, False, False, True, "tensor parallel"),
)

AXES: Mapping[str, MeshAxis] = {a.name: a for a in AXES_TABLE}

AXIS_NAMES: tuple[str, ...] = tuple(a.name for a in AXES_TABLE)
"""Mesh axes autopar knows, outer -> inner."""

AUTO_AXES: tuple[str, ...] = tuple(a.name for a in AXES_TABLE if a.auto)
"""The axes the search picks from when ``SearchOptions.axes`` is ``None``."""

BATCH_AXES: tuple[str, ...] = tuple(a.name for a in AXES_TABLE if a.batch)
"""Axes that divide the global batch (``data`` then ``fsdp``)."""

MODEL_AXES: frozenset[str] = frozenset(a.name for a in AXES_TABLE if not a.batch)
"""Axes that never divide the batch: a batch input is replicated over them."""


def axis_order(names: Iterable[str]) -> tuple[str, ...]:
    """``names`` sorted outer -> inner (unknown names last, in their given order).

    Example:
        >>> axis_order(["tensor", "data"])
        ('data', 'tensor')
    """
    names = list(names)
    known = [n for n in names if n in AXES]
    return tuple(sorted(known, key=AXIS_NAMES.index)) + tuple(n for n in names if n not in AXES)


def exposed_class(axes: Iterable[str]) -> str | None:
    """The class of an exposed collective named by the axes it runs over: the axis of
    lowest ``exposed_rank`` among them (``seq``, then ``expert``, then ``tensor``), or
    ``None`` when none names one."""
    ranked = [AXES[a] for a in axes if a in AXES and AXES[a].exposed_rank is not None]
    if not ranked:
        return None
    return min(ranked, key=lambda a: a.exposed_rank).comm_class


def axes_splitting(*splits: Splits) -> tuple[str, ...]:
    """The known axes that split any of ``splits``, outer -> inner.

    Example:
        >>> axes_splitting("model", "experts")
        ('expert', 'tensor')
    """
    return tuple(a.name for a in AXES_TABLE if a.splits in splits)


def batch_axes(mesh: Iterable[str]) -> tuple[str, ...]:
    """The axes of ``mesh`` that divide the batch (unknown axis names count as batch
    axes: a user's own ``"replica"`` axis is data parallel), in mesh order."""
    return tuple(a for a in mesh if a not in MODEL_AXES)


__all__ = [
    "AUTO_AXES",
    "AXES",
    "AXES_TABLE",
    "AXIS_NAMES",
    "BATCH_AXES",
    "MODEL_AXES",
    "MeshAxis",
    "Splits",
    "axes_splitting",
    "axis_order",
    "batch_axes",
    "exposed_class",
]
