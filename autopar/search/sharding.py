"""Shardings of one tensor on a named mesh, and what it costs to move between them.

A sharding is a :data:`Sharding`: one tuple of mesh axes per tensor dimension (outer axis
first, ``()`` for a replicated dimension). Every axis is used at most once. Partial sums
never leave a strategy (a strategy resolves them with an all-reduce or a reduce-scatter),
so edges between operations only ever carry plain shardings.

Example:
    >>> mesh = MeshShape(("data", "tensor"), (2, 4))
    >>> shards(((("data",), ("tensor",))), mesh)
    8
    >>> to_plan_spec(((), ("data", "tensor")))
    (None, ('data', 'tensor'))
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from autopar.plan import Spec

DimSharding = tuple[str, ...]
Sharding = tuple[DimSharding, ...]


@dataclass(frozen=True)
class MeshShape:
    """Named mesh axes and their sizes, outer -> inner.

    Example:
        >>> MeshShape.from_mapping({"data": 2, "tensor": 4}).active
        ('data', 'tensor')
    """

    names: tuple[str, ...]
    sizes: tuple[int, ...]
    # Uneven splits as padded partitions (a dim of n over k devices: ceil(n / k) each,
    # k * ceil(n / k) moved by a gather): only to PRICE a plan that asks for them
    # (:func:`uneven_plan`, e.g. ZeRO-3's flattened and padded partitions); the search
    # never proposes them and the lowering refuses them.
    padded: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "_size", dict(zip(self.names, self.sizes, strict=True)))
        object.__setattr__(self, "_rank", {n: i for i, n in enumerate(self.names)})

    @classmethod
    def from_mapping(cls, mesh: Mapping[str, int], padded: bool = False) -> MeshShape:
        return cls(tuple(mesh), tuple(int(s) for s in mesh.values()), padded)

    def as_dict(self) -> dict[str, int]:
        return dict(zip(self.names, self.sizes, strict=True))

    def size(self, axis: str) -> int:
        return self._size[axis]

    @property
    def active(self) -> tuple[str, ...]:
        """Axes of size > 1 (an axis of size 1 never changes a layout)."""
        return tuple(n for n, s in zip(self.names, self.sizes, strict=True) if s > 1)

    @property
    def num_devices(self) -> int:
        return math.prod(self.sizes)

    def order(self, axes: Iterable[str]) -> tuple[str, ...]:
        """``axes`` sorted outer -> inner (the canonical order within one dimension)."""
        return tuple(sorted(axes, key=self._rank.__getitem__))

    def prod(self, axes: Iterable[str]) -> int:
        return math.prod(self.size(a) for a in axes)


def replicated(rank: int) -> Sharding:
    return ((),) * rank


def shards(spec: Sharding, mesh: MeshShape) -> int:
    """How many pieces a sharding cuts a tensor into (devices holding distinct data)."""
    return math.prod(mesh.size(a) for dim in spec for a in dim)


def used_axes(spec: Sharding) -> tuple[str, ...]:
    return tuple(a for dim in spec for a in dim)


def splits(n: int, k: int, mesh: MeshShape) -> bool:
    """Whether a dim of ``n`` may be cut ``k`` ways: ``k`` divides it, or, on a padded
    mesh, every device can hold a part of ``ceil(n / k)`` (``n >= k``).

    Example:
        >>> splits(20480, 1120, MeshShape(("data",), (1120,)))
        False
        >>> splits(20480, 1120, MeshShape(("data",), (1120,), padded=True))
        True
    """
    return n % k == 0 or (mesh.padded and n >= k)


def divides(shape: Sequence[int], spec: Sharding, mesh: MeshShape) -> bool:
    """Whether every sharded dim of ``shape`` splits over its axes (:func:`splits`)."""
    return all(splits(n, mesh.prod(dim), mesh) for n, dim in zip(shape, spec, strict=True))


def padded_elements(shape: Sequence[int], spec: Sharding, mesh: MeshShape) -> int:
    """Elements of the tensor as its padded partitions hold it: ``k * ceil(n / k)`` per
    dim of ``n`` split ``k`` ways (``n`` when ``k`` divides it).

    Example:
        >>> m = MeshShape(("data",), (2240,), padded=True)
        >>> padded_elements((20480,), (("data",),), m)  # 2240 x 10
        22400
    """
    out = 1
    for n, dim in zip(shape, spec, strict=True):
        k = mesh.prod(dim)
        out *= -(-n // k) * k
    return out


def device_bytes(nbytes: float, shape: Sequence[int], spec: Sharding, mesh: MeshShape) -> float:
    """Bytes one device holds of a tensor of ``nbytes`` laid out as ``spec``: its
    ``1 / shards`` share, of the padded partitions on a padded mesh.

    Example:
        >>> m = MeshShape(("data",), (2240,), padded=True)
        >>> device_bytes(2 * 20480, (20480,), (("data",),), m)  # ceil(20480 / 2240) = 10
        20.0
    """
    n = shards(spec, mesh)
    if not mesh.padded or n == 1:
        return nbytes / n
    total = math.prod(shape)
    return nbytes / total * padded_elements(shape, spec, mesh) / n if total else 0.0


def uneven_plan(plan: Any) -> bool:
    """Whether a plan splits some input or output dim over axes that do not divide it
    (ZeRO-3's padded partitions): it is priced on a padded mesh (:class:`MeshShape`).

    Example:
        >>> from autopar.plan import Plan, TensorSharding
        >>> w = TensorSharding("w", (20480,), "float32", ("data",), "param")
        >>> uneven_plan(Plan(mesh={"data": 1120}, inputs=(w,), outputs=()))
        True
    """
    mesh = MeshShape.from_mapping(plan.mesh)
    for rec in (*plan.inputs, *plan.outputs):
        try:
            spec = from_plan_spec(rec.spec, len(rec.shape))
        except ValueError:
            return False  # a malformed spec: the plan's own validation reports it
        if any(a not in mesh.names for d in spec for a in d):
            return False
        if not divides(rec.shape, spec, mesh):
            return True
    return False


def to_plan_spec(spec: Sharding) -> Spec:
    """Internal sharding -> the plan's spec (``None`` / axis / tuple of axes per dim)."""
    out: list[Any] = []
    for dim in spec:
        out.append(None if not dim else dim[0] if len(dim) == 1 else tuple(dim))
    return tuple(out)


def from_plan_spec(spec: Spec, rank: int) -> Sharding:
    """The plan's spec -> internal sharding (short specs are padded with replicated dims)."""
    out: list[DimSharding] = []
    for e in spec:
        out.append(() if e is None else (e,) if isinstance(e, str) else tuple(e))
    if len(out) > rank:
        raise ValueError(f"spec {spec} has more entries than the tensor's rank {rank}")
    return tuple(out) + ((),) * (rank - len(out))


def format_sharding(spec: Sharding) -> str:
    """Short text: ``S(data)xRxS(tensor)``; ``R`` for a scalar."""
    if not spec:
        return "R"
    return "x".join("R" if not d else f"S({','.join(d)})" for d in spec)


def enumerate_shardings(
    shape: Sequence[int],
    mesh: MeshShape,
    axes: Sequence[str] | None = None,
    dims: Sequence[int] | None = None,
) -> list[Sharding]:
    """Every legal sharding of a tensor: each axis on one dimension (or none), divisible.

    Several axes on one dimension are kept in mesh order (outer first), so each layout
    appears once.

    Args:
        shape: the tensor's shape.
        mesh: the mesh.
        axes: the axes that may be used (default: all active axes).
        dims: the dimensions that may be sharded (default: all).

    Example:
        >>> m = MeshShape(("data",), (2,))
        >>> enumerate_shardings((4, 3), m)
        [((), ()), (('data',), ())]
    """
    axes = mesh.active if axes is None else tuple(a for a in axes if mesh.size(a) > 1)
    dims = tuple(range(len(shape))) if dims is None else tuple(dims)
    return list(_enumerate(tuple(shape), mesh, axes, dims))


@functools.lru_cache(maxsize=4096)
def _enumerate(
    shape: tuple[int, ...], mesh: MeshShape, axes: tuple[str, ...], dims: tuple[int, ...]
) -> tuple[Sharding, ...]:
    rank = len(shape)
    out: list[Sharding] = []
    seen: set[Sharding] = set()
    for choice in itertools.product((None, *dims), repeat=len(axes)):
        per_dim: list[list[str]] = [[] for _ in range(rank)]
        for axis, d in zip(axes, choice, strict=True):
            if d is not None:
                per_dim[d].append(axis)
        spec = tuple(mesh.order(p) for p in per_dim)
        if spec in seen or not divides(shape, spec, mesh):
            continue
        seen.add(spec)
        out.append(spec)
    return tuple(out)


# ----------------------------------------------------------------------------- reshape


def _reshape_groups(
    a: Sequence[int], b: Sequence[int]
) -> list[tuple[tuple[int, ...], tuple[int, ...]]] | None:
    """Split two shapes of equal size into minimal groups of consecutive dims with equal
    products (size-1 dims ride along with their neighbours)."""
    groups: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    i = j = 0
    while i < len(a) or j < len(b):
        ga, gb = [], []
        pa = pb = 1
        if i < len(a):
            ga.append(i)
            pa *= a[i]
            i += 1
        if j < len(b):
            gb.append(j)
            pb *= b[j]
            j += 1
        while pa != pb:
            if pa < pb and i < len(a):
                ga.append(i)
                pa *= a[i]
                i += 1
            elif pb < pa and j < len(b):
                gb.append(j)
                pb *= b[j]
                j += 1
            else:
                return None
        groups.append((tuple(ga), tuple(gb)))
    return groups


def reshape_sharding(
    in_shape: Sequence[int], out_shape: Sequence[int], spec: Sharding, mesh: MeshShape
) -> tuple[Sharding, Sharding]:
    """Carry a sharding through a reshape.

    Within each group of dims that merge or split, the axes survive as long as they cut
    the flattened group into contiguous blocks (every dim before the last sharded one is
    split completely) and the new dims take them in order (each new dim divisible by the
    axes it receives). Axes that cannot survive are dropped.

    Returns:
        ``(kept_in, out)``: the input sharding the reshape can consume without moving data
        (``spec`` minus dropped axes) and the sharding of its output.

    Example:
        >>> m = MeshShape(("tensor",), (4,))
        >>> reshape_sharding((8, 12, 64), (8, 768), ((), ("tensor",), ()), m)[1]
        ((), ('tensor',))
    """
    groups = _reshape_groups(tuple(in_shape), tuple(out_shape))
    if groups is None:
        return replicated(len(in_shape)), replicated(len(out_shape))
    kept = [list(d) for d in spec]
    out: list[list[str]] = [[] for _ in out_shape]
    for gin, gout in groups:
        # The flattened group's axes, outer first, valid while earlier dims are fully split.
        seq: list[str] = []
        for pos, d in enumerate(gin):
            seq.extend(spec[d])
            local = in_shape[d] // mesh.prod(spec[d]) if spec[d] else in_shape[d]
            if local != 1 and any(spec[e] for e in gin[pos + 1 :]):
                # Later dims sharded too: their blocks interleave, only this prefix survives.
                break
        # Assign the sequence to the output dims, outer first.
        assigned: list[str] = []
        k = 0
        remaining = out_shape[gout[0]] if gout else 1
        for axis in seq:
            n = mesh.size(axis)
            # Move on to the next output dim only once the current one is split completely.
            while remaining == 1 and k + 1 < len(gout):
                k += 1
                remaining = out_shape[gout[k]]
            if not gout or remaining % n != 0:
                break
            out[gout[k]].append(axis)
            remaining //= n
            assigned.append(axis)
        keep = set(assigned)
        for d in gin:
            kept[d] = [a for a in kept[d] if a in keep]
    return tuple(tuple(d) for d in kept), tuple(tuple(d) for d in out)


# ----------------------------------------------------------------------------- resharding


@dataclass(frozen=True)
class Collective:
    """One collective a strategy or a resharding implies.

    ``nbytes`` follows ``cost_models.collective_time``: the per-device buffer for
    all-reduce and all-to-all, the full gathered output for all-gather and the full input
    for reduce-scatter.
    """

    kind: str
    axes: tuple[str, ...]
    nbytes: float
    time_s: float


def reshard_steps(
    shape: Sequence[int], src: Sharding, dst: Sharding, mesh: MeshShape
) -> tuple[Sharding, ...]:
    """The layouts a reshard ``src`` -> ``dst`` passes through, in the order the cost
    model prices it (:func:`reshard_plan`): the axes that move to another dim by
    all-to-all first, then the axes that leave gathered, then new axes sliced. Each
    step is one primitive collective (or a free slice), which is how XLA realises it
    when told step by step; left to choose, it sometimes replicates the whole tensor
    ("involuntary full rematerialization") or slices first. The last layout is ``dst``;
    intermediate layouts that would not divide a dim are skipped.

    Example:
        >>> m = MeshShape.from_mapping({"d": 2, "f": 2, "e": 2})
        >>> reshard_steps((8, 8), ((), ("d",)), (("d", "f"), ("e",)), m)
        ((('d',), ()), (('d', 'f'), ('e',)))
    """
    a2a, gather = reshard_plan(shape, src, dst, mesh)
    steps: list[Sharding] = []

    def fits(spec: Sharding) -> bool:
        return divides(shape, spec, mesh)

    cur = src
    if a2a:
        mid = after_all_to_all(src, dst, a2a)
        if fits(mid) and mid != dst:
            steps.append(mid)
            cur = mid
    if gather:
        left = set(gather)
        mid = tuple(tuple(a for a in dim if a not in left) for dim in cur)
        if fits(mid) and mid != dst and mid != cur:
            steps.append(mid)
    steps.append(dst)
    return tuple(steps)


def after_all_to_all(src: Sharding, dst: Sharding, moved_axes: Sequence[str]) -> Sharding:
    """The layout after the all-to-all that moves ``moved_axes`` from where ``src`` has
    them to where ``dst`` has them (the first step of :func:`reshard_steps`).

    Example:
        >>> after_all_to_all((("d",), ()), ((), ("d",)), ("d",))
        ((), ('d',))
    """
    moved = set(moved_axes)
    return tuple(
        tuple(a for a in s if a not in moved) + tuple(a for a in d if a in moved)
        for s, d in zip(src, dst, strict=True)
    )


def reshard_plan(
    shape: Sequence[int], src: Sharding, dst: Sharding, mesh: MeshShape
) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Which axes move by all-to-all and which are gathered going ``src`` -> ``dst``
    (:func:`reshard_moves` without the reordered axes)."""
    a2a, gather, _ = reshard_moves(shape, src, dst, mesh)
    return a2a, gather


def reshard_moves(
    shape: Sequence[int], src: Sharding, dst: Sharding, mesh: MeshShape
) -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
    """Axes that move by all-to-all, axes gathered, and axes reordered going ``src`` ->
    ``dst``.

    An axis that stays on the same dimension behind the same outer axes is free; one that
    newly appears is a local slice (free); one that leaves is all-gathered; one that moves
    to another dimension is an all-to-all; one that stays on its dimension behind other
    outer axes is reordered (XLA sends each block to its new owner with a
    collective-permute; measured: ``(e+d, -) -> (d, -)`` is a permute of the per-device
    buffer and a gather of ``e``).

    Example:
        >>> m = MeshShape.from_mapping({"d": 2, "f": 2, "e": 2})
        >>> reshard_moves((8, 8), (("e", "d", "f"), ()), (("d", "f"), ()), m)
        ((), ('e',), ('d', 'f'))
    """
    where_src = {a: (d, dim[: dim.index(a)]) for d, dim in enumerate(src) for a in dim}
    where_dst = {a: (d, dim[: dim.index(a)]) for d, dim in enumerate(dst) for a in dim}
    a2a: list[str] = []
    gather: list[str] = []
    reorder: list[str] = []
    for axis, (d, prefix) in where_src.items():
        if axis not in where_dst:
            gather.append(axis)
            continue
        d2, prefix2 = where_dst[axis]
        if d2 == d:
            if prefix != prefix2:
                reorder.append(axis)
        else:
            a2a.append(axis)
    return mesh.order(a2a), mesh.order(gather), mesh.order(reorder)
