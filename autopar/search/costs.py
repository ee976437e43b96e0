"""The search's view of the cost model: cached calls into ``cost_models`` for one mesh.

Every time the search prices something (a strategy's compute, a collective, a
resharding) it goes through a :class:`CostContext`, so identical questions (the same
matmul in 96 identical layers) are answered once.

Example:
    >>> ctx = CostContext(Cluster.preset("dgx-a100-80gb"), {"data": 2, "tensor": 4})
    >>> c = ctx.collective("all-reduce", 2**20, ("tensor",))
    >>> c.kind, c.axes, f"{c.time_s * 1e6:.1f} us"
    ('all-reduce', ('tensor',), '32.8 us')
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from autopar.errors import InvalidOptionError
from autopar.search.sharding import (
    Collective,
    MeshShape,
    Sharding,
    after_all_to_all,
    device_bytes,
    divides,
    reshard_moves,
    shards,
)
from autopar.trace.tensor import itemsize

ComputeKind = str  # "matmul" | "elementwise" | "reduction" | "other"


class CostContext:
    """Prices on one mesh of one cluster, memoised.

    Args:
        cluster: a ``cost_models.Cluster``.
        mesh: ordered axis -> size.
        padded: price uneven splits as padded partitions (``MeshShape.padded``: only
            for a plan that asks for them, ``sharding.uneven_plan``).
        dp_grad_weight: what one second of a gradient reduction weighs in the linear
            price the ILP minimises (``None``: ``1 - overlap_efficiency``, as every
            hideable class). A completion for a program that reduces the gradients of
            ``m`` microbatches once after them, exposed, weighs each microbatch's
            reduction ``1 / m`` (:func:`autopar.search.stages.evaluate_pipeline`'s
            ``reduce_after_flush``).
    """

    def __init__(
        self,
        cluster: Any,
        mesh: Mapping[str, int],
        padded: bool = False,
        dp_grad_weight: float | None = None,
    ) -> None:
        import cost_models

        self._cm = cost_models
        self.cluster = cluster
        if dp_grad_weight is not None and not 0.0 <= float(dp_grad_weight) <= 1.0:
            raise InvalidOptionError(
                f"dp_grad_weight must be in [0, 1] (a gradient reduction's share of its "
                f"seconds in the step); got {dp_grad_weight!r}"
            )
        self.dp_grad_weight = None if dp_grad_weight is None else float(dp_grad_weight)
        self.mesh = MeshShape.from_mapping(mesh, padded)
        self.mesh_dict = self.mesh.as_dict()
        self.device = cluster.device
        self._coll: dict[tuple, float] = {}
        self._comp: dict[tuple, float] = {}
        self._reshard: dict[tuple, tuple[float, tuple[Collective, ...]]] = {}
        self._routes: dict[tuple, tuple] = {}
        self._step_moves: dict[tuple, tuple] = {}
        self._divides: dict[tuple, bool] = {}
        # Axes of size 1: a collective over only these moves nothing (filtered out).
        self._unit_axes = frozenset(a for a, n in self.mesh_dict.items() if n == 1)

    # -- primitives -------------------------------------------------------------------
    def collective(self, kind: str, nbytes: float, axes: Sequence[str]) -> Collective:
        return self._collective(kind, nbytes, self.mesh.order(axes))

    def _collective(self, kind: str, nbytes: float, axes: tuple[str, ...]) -> Collective:
        """:meth:`collective` of ``axes`` already in the mesh's order."""
        key = (kind, float(nbytes), axes)
        t = self._coll.get(key)
        if t is None:
            if not axes or self.mesh.prod(axes) == 1 or nbytes <= 0:
                t = 0.0
            else:
                t = float(
                    self._cm.collective_time(
                        kind, float(nbytes), self.cluster, self.mesh_dict, axes
                    )
                )
            self._coll[key] = t
        return Collective(kind, axes, float(nbytes), t)

    def latency(self, kind: str, axes: Sequence[str]) -> float:
        """Seconds a collective takes however small its buffer (its latency terms): what
        combining several collectives into one saves per collective merged."""
        axes = self.mesh.order(axes)
        key = ("latency", kind, axes)
        t = self._coll.get(key)
        if t is None:
            t = self._coll[key] = self.collective(kind, 1.0, axes).time_s
        return t

    def compute(
        self, flops: float, nbytes: float, dtype: str = "bfloat16", kind: ComputeKind = "other"
    ) -> float:
        key = (float(flops), float(nbytes), dtype, kind)
        t = self._comp.get(key)
        if t is None:
            if flops <= 0 and nbytes <= 0:
                t = 0.0
            else:
                t = float(
                    self._cm.compute_time(
                        float(flops),
                        float(nbytes),
                        self.device,
                        dtype=_flop_dtype(dtype),
                        kind=kind,
                    )
                )
            self._comp[key] = t
        return t

    # -- resharding -------------------------------------------------------------------
    def reshard(
        self, shape: Sequence[int], dtype: str, src: Sharding, dst: Sharding
    ) -> tuple[float, tuple[Collective, ...]]:
        """Time and collectives to turn a tensor laid out as ``src`` into ``dst``.

        All-to-alls move axes between dims first (on the per-device buffer), axes that
        keep their dim behind other outer axes are sent to their new owners (one
        collective-permute of the buffer), then the axes that leave are all-gathered
        together (``nbytes`` = the gathered buffer); axes that newly appear are free local
        slices (:func:`~autopar.search.sharding.reshard_moves`).
        """
        if src == dst:
            return 0.0, ()
        key = (tuple(shape), dtype, src, dst)
        hit = self._reshard.get(key)
        if hit is not None:
            return hit
        steps = self._steps(shape, src, dst)
        if len(steps) > 1:
            # Priced as lowered: one primitive step after another (an axis that stays
            # behind while another leaves its dim is reordered in the first step even if
            # a later one gathers it).
            colls = []
            prev = src
            for step in steps:
                colls.extend(self._reshard_step(shape, dtype, prev, step))
                prev = step
        else:
            colls = self._reshard_step(shape, dtype, src, dst)
        # An axis of size 1 holds the whole tensor on every device: nothing moves over it.
        if self._unit_axes:
            colls = [c for c in colls if math.prod(self.mesh_dict.get(a, 1) for a in c.axes) > 1]
        out = (sum((c.time_s for c in colls), 0.0), tuple(colls))
        self._reshard[key] = out
        return out

    def _steps(self, shape: Sequence[int], src: Sharding, dst: Sharding) -> tuple[Sharding, ...]:
        """:func:`~autopar.search.sharding.reshard_steps`, from a route cached per layout
        pair: the intermediate layouts depend on the shape only through divisibility."""
        route = self._routes.get((src, dst))
        if route is None:
            route = self._routes[(src, dst)] = _route(src, dst, self.mesh)
        mid, after_mid, after_src = route
        cur = src
        steps: list[Sharding] = []
        if mid is not None and self._fits(shape, mid):
            steps.append(mid)
            cur = mid
        gathered = after_mid if cur is mid else after_src
        if gathered is not None and self._fits(shape, gathered):
            steps.append(gathered)
        steps.append(dst)
        return tuple(steps)

    def _fits(self, shape: Sequence[int], spec: Sharding) -> bool:
        key = (tuple(shape), spec)
        hit = self._divides.get(key)
        if hit is None:
            hit = self._divides[key] = divides(shape, spec, self.mesh)
        return hit

    def _reshard_step(
        self, shape: Sequence[int], dtype: str, src: Sharding, dst: Sharding
    ) -> list[Collective]:
        step = self._step_moves.get((src, dst))
        if step is None:
            a2a, gather, reorder = reshard_moves(shape, src, dst, self.mesh)
            swapped = _swapped_axes(src, dst)
            p2p_axes = self.mesh.order(set(reorder) | set(swapped)) if reorder or swapped else ()
            step = (
                self.mesh.order(a2a),
                self.mesh.order(gather),
                bool(reorder),
                p2p_axes,
                shards(src, self.mesh),
                shards(dst, self.mesh),
                self.mesh.prod(gather),
            )
            self._step_moves[(src, dst)] = step
        a2a, gather, reorder, p2p_axes, src_shards, dst_shards, gather_size = step
        total = math.prod(shape) * itemsize(dtype)
        per_device = total / src_shards
        if self.mesh.padded:  # padded partitions: the gather moves k * ceil(n / k)
            per_device = device_bytes(total, shape, src, self.mesh)
            total = per_device * src_shards
        colls: list[Collective] = []
        if a2a:
            colls.append(self._collective("all-to-all", per_device, a2a))
        if p2p_axes:
            # Axes that keep their dim behind other outer axes, or trade places, change
            # the device order of the tiles: XLA sends each block to its new owner with a
            # collective-permute (measured: d0,e1 -> e0,d1 is an all-to-all plus a
            # permute; e+d,- -> d,- is a permute of the buffer plus a gather of e).
            nbytes = per_device if reorder else total / dst_shards
            p2p = self._collective("p2p", nbytes, p2p_axes)
            colls.append(Collective("collective-permute", p2p.axes, p2p.nbytes, p2p.time_s))
        if gather:
            colls.append(self._collective("all-gather", per_device * gather_size, gather))
        return colls


def _route(
    src: Sharding, dst: Sharding, mesh: MeshShape
) -> tuple[Sharding | None, Sharding | None, Sharding | None]:
    """The shape-independent part of :func:`~autopar.search.sharding.reshard_steps`: the
    all-to-all step's layout (``None``: no all-to-all, or it would already be ``dst``),
    then the gather step's layout after that step and straight from ``src`` (``None``:
    no such step). A step whose layout does not divide the shape is skipped."""
    a2a, gather, _ = reshard_moves((), src, dst, mesh)
    mid = None
    if a2a:
        mid = after_all_to_all(src, dst, a2a)
        if mid == dst:
            mid = None

    def gathered(cur: Sharding | None) -> Sharding | None:
        if cur is None or not gather:
            return None
        left = set(gather)
        out = tuple(tuple(a for a in dim if a not in left) for dim in cur)
        return None if out == dst or out == cur else out

    return mid, gathered(mid), gathered(src)


def _swapped_axes(src: Sharding, dst: Sharding) -> tuple[str, ...]:
    """The axes sharding both layouts, if their order (tensor dims left to right, major to
    minor within a dim) differs between the two; else ``()``."""
    src_order = [a for dim in src for a in dim]
    dst_order = [a for dim in dst for a in dim]
    common = [a for a in src_order if a in dst_order]
    if len(common) < 2 or [a for a in dst_order if a in common] == common:
        return ()
    return tuple(common)


def _flop_dtype(dtype: str) -> str:
    # Integer and boolean ops run on the vector units; price them like float32.
    if dtype in ("bfloat16", "float16", "float32", "float64", "float8_e4m3fn", "float8_e5m2"):
        return dtype
    return "float32"
