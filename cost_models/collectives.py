"""Collective communication time: the α-β model per link level (ring, tree, hierarchical).

``nbytes`` convention (per device, in bytes):

* ``all-reduce``: the buffer each device holds (input size = output size).
* ``all-gather``: the FULL gathered output each device ends with (n shards of nbytes/n).
* ``reduce-scatter``: the FULL input each device starts with (it keeps nbytes/n).
* ``all-to-all``: the buffer each device holds (it keeps 1/n, sends (n-1)/n away).
* ``p2p``: the bytes one device sends to one peer.

The group is the devices that differ only along ``axes``; n = prod(mesh[a] for a in axes).
n == 1 (or no axes, or nbytes == 0) costs 0.

Algorithms (B = nbytes, bw/α = bandwidth and per-step latency of the link level):

* ``ring``: all-reduce ``2(n-1)/n B/bw + 2 s α``; all-gather / reduce-scatter
  ``(n-1)/n B/bw + s α`` with s = n-1 ring steps. A ring that leaves the node runs at the
  per-device inter-node bandwidth; its steps cost the intra-node α except the
  (nodes-1) steps that cross the network, which cost the network α (NCCL's own latency
  model, ``src/graph/tuning.cc``).
* ``tree`` (all-reduce only): double binary tree, ``2 B/bw + 2((k-1) α_intra +
  ceil(log2 nodes) α_inter)``; wins for small, latency-bound buffers.
* ``hierarchical`` (NCCL-like two levels when the group spans nodes with k > 1 members per
  node): reduce-scatter inside the node, all-reduce across nodes on 1/k of the data, then
  all-gather inside the node. Every GPU drives its own NIC, so the node's k NICs carry the
  inter-node phase in parallel (DGX A100: 8 x 200 Gb/s HDR = 25 GB/s per GPU). All-gather
  is the inter-node gather of 1/k-sized pieces then the intra-node gather; reduce-scatter
  the mirror image. With one level (group inside a node, or a torus) it equals ``ring``.
* ``auto``: what NCCL would pick. All-reduce: the fastest of ring, tree, hierarchical.
  All-gather and reduce-scatter: ring, because NCCL implements those two only as rings
  (tuning.cc skips every other algorithm for them). A ring over many nodes therefore
  pays the per-device network bandwidth on the full buffer; this is what makes ZeRO-3 /
  FSDP over a whole data-parallel group of DGX nodes slow, and it reproduces Megatron-LM
  2021 Table 2 (ZeRO-3 175B: 144 -> 44 TFLOP/s/GPU from 384 to 1536 GPUs); credited with
  NIC striping (8 x 25 GB/s per ring) it would predict ~190 at 1536, above PTD-P. Ask
  for ``hierarchical`` explicitly for gathers that are two-level (hybrid sharding,
  ZeRO++ hpZ).
* ``all-to-all``: pairwise exchange. In a node ``(n-1)/n B/bw``; across nodes the intra and
  network parts proceed in parallel: ``max((k-1)/n B/bw_intra, (n-k)/n B/bw_inter)``. On a
  torus the bisection limits it: ``max((n-1)/n, e d / 4) B / bw`` with e the longest
  extent and d the torus dimensions the group spans (a 1-D ring of n chips: n/4).
* ``p2p``: ``B/bw + α`` over the slowest level the axis crosses (a torus: one link, one
  direction, ``bw / (2 * ndims)``).

Torus (TPU) groups: the ICI LinkLevel bandwidth is the per-chip all-reduce bandwidth with
every torus dimension in use; a group that spans d of D dimensions gets ``bw * d / D``, and
its ring has sum(e_i - 1) steps.

Example:
    >>> from cost_models import Cluster
    >>> c = Cluster.preset("dgx-a100-80gb")
    >>> t = collective_time("all-reduce", 1e9, c, {"tensor": 8}, ["tensor"], "ring")
    >>> round(t * 1e3, 3)  # 2*7/8 * 1 GB / 230 GB/s + 14 * 3.4 us
    7.656
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from cost_models.cluster import Cluster, GroupLayout
from cost_models.errors import CostModelError, check_choice, check_int, check_positive

CollectiveKind = Literal["all-reduce", "all-gather", "reduce-scatter", "all-to-all", "p2p"]
COLLECTIVE_KINDS: tuple[str, ...] = (
    "all-reduce",
    "all-gather",
    "reduce-scatter",
    "all-to-all",
    "p2p",
)
Algorithm = Literal["auto", "ring", "tree", "hierarchical"]
ALGORITHMS: tuple[str, ...] = ("auto", "ring", "tree", "hierarchical")


@dataclass(frozen=True)
class CollectiveCost:
    """One collective (repeated ``count`` times) and its time.

    Attributes:
        kind: the collective.
        nbytes: bytes per device, in the module's convention.
        axes: mesh axes of the group.
        time_s: seconds for one occurrence.
        count: occurrences (e.g. once per layer per microbatch).

    Example:
        >>> CollectiveCost("all-reduce", 1e6, ("data",), 1e-3, count=4).total_s
        0.004
    """

    kind: CollectiveKind
    nbytes: float
    axes: tuple[str, ...]
    time_s: float
    count: int = 1

    def __post_init__(self) -> None:
        check_choice("CollectiveCost.kind", self.kind, COLLECTIVE_KINDS)
        check_positive("CollectiveCost.nbytes", self.nbytes, allow_zero=True)
        check_positive("CollectiveCost.time_s", self.time_s, allow_zero=True)
        check_int("CollectiveCost.count", self.count, minimum=0)
        object.__setattr__(self, "axes", tuple(self.axes))

    @property
    def total_s(self) -> float:
        """``time_s * count``."""
        return self.time_s * self.count


def collective_time(
    kind: CollectiveKind,
    nbytes: float,
    cluster: Cluster,
    mesh: Mapping[str, int],
    axes: Sequence[str],
    algorithm: Algorithm = "auto",
) -> float:
    """Seconds one collective takes (see the module docstring for formulas and conventions).

    Args:
        kind: ``"all-reduce"``, ``"all-gather"``, ``"reduce-scatter"``, ``"all-to-all"`` or
            ``"p2p"``.
        nbytes: bytes per device (all-gather: full output; reduce-scatter: full input).
        cluster: where it runs.
        mesh: axis name -> size, outer to inner.
        axes: the mesh axes the collective runs over.
        algorithm: ``"auto"``, ``"ring"``, ``"tree"`` (all-reduce only) or ``"hierarchical"``.

    Example:
        >>> from cost_models import Cluster
        >>> c = Cluster.preset("dgx-a100-80gb", nodes=8)
        >>> inside = collective_time("all-reduce", 1e9, c, {"d": 8, "t": 8}, ["t"])
        >>> across = collective_time("all-reduce", 1e9, c, {"d": 8, "t": 8}, ["d"])
        >>> inside < across
        True
    """
    return best_algorithm(kind, nbytes, cluster, mesh, axes, algorithm)[1]


def best_algorithm(
    kind: CollectiveKind,
    nbytes: float,
    cluster: Cluster,
    mesh: Mapping[str, int],
    axes: Sequence[str],
    algorithm: Algorithm = "auto",
) -> tuple[str, float]:
    """Like :func:`collective_time`, also naming the algorithm ``auto`` chose.

    Example:
        >>> from cost_models import Cluster
        >>> best_algorithm("all-reduce", 1e3, Cluster.preset("dgx-a100-80gb", 8), {"d": 64}, ["d"])[0]
        'tree'
    """
    check_choice("collective kind", kind, COLLECTIVE_KINDS)
    check_choice("algorithm", algorithm, ALGORITHMS)
    check_positive("nbytes", nbytes, allow_zero=True)
    if not isinstance(axes, Sequence) or isinstance(axes, str):
        raise CostModelError(f"axes must be a sequence of mesh axis names; got {axes!r}")
    layout = cluster.group_layout(mesh, axes)
    if layout.size == 1 or nbytes == 0:
        return ("none", 0.0)
    if kind in ("all-to-all", "p2p"):
        if algorithm not in ("auto", "ring"):
            raise CostModelError(
                f"{kind} has one algorithm (pairwise); use algorithm='auto'; got {algorithm!r}"
            )
        fn = _all_to_all if kind == "all-to-all" else _p2p
        return ("pairwise", fn(nbytes, cluster, layout))
    if algorithm == "tree" and kind != "all-reduce":
        raise CostModelError(f"algorithm 'tree' is defined for all-reduce only; got {kind!r}")
    options = {
        "ring": lambda: _ring(kind, nbytes, cluster, layout),
        "tree": lambda: _tree(nbytes, cluster, layout),
        "hierarchical": lambda: _hierarchical(kind, nbytes, cluster, layout),
    }
    if algorithm != "auto":
        return (algorithm, options[algorithm]())
    if kind != "all-reduce":
        return ("ring", options["ring"]())  # NCCL: all-gather / reduce-scatter are ring-only
    times = {name: fn() for name, fn in options.items()}
    name = min(times, key=lambda k: times[k])
    return (name, times[name])


def collective_cost(
    kind: CollectiveKind,
    nbytes: float,
    cluster: Cluster,
    mesh: Mapping[str, int],
    axes: Sequence[str],
    *,
    count: int = 1,
    algorithm: Algorithm = "auto",
) -> CollectiveCost:
    """A :class:`CollectiveCost` record for one collective repeated ``count`` times.

    Example:
        >>> from cost_models import Cluster
        >>> c = collective_cost("p2p", 0, Cluster.preset("cpu-sim"), {"pipe": 8}, ["pipe"])
        >>> c.time_s
        0.0
    """
    t = collective_time(kind, nbytes, cluster, mesh, axes, algorithm)
    return CollectiveCost(kind, float(nbytes), tuple(axes), t, count)


def bytes_on_wire(kind: CollectiveKind, nbytes: float, n: int) -> float:
    """Bytes each device sends in a bandwidth-optimal (ring / pairwise) collective.

    all-reduce ``2(n-1)/n B``; all-gather, reduce-scatter and all-to-all ``(n-1)/n B``;
    p2p ``B``.

    Example:
        >>> bytes_on_wire("all-reduce", 8.0, 4)
        12.0
    """
    check_choice("collective kind", kind, COLLECTIVE_KINDS)
    n = check_int("group size n", n)
    if n == 1:
        return 0.0
    if kind == "p2p":
        return float(nbytes)
    factor = 2.0 if kind == "all-reduce" else 1.0
    return factor * (n - 1) / n * nbytes


# ---------------------------------------------------------------------- internals


def _torus_bw(cluster: Cluster, layout: GroupLayout) -> float:
    ndims = len(cluster.torus_shape or ())
    return cluster.intra.bandwidth * len(layout.torus_extents) / ndims


def _ring_bw_and_step_latency(cluster: Cluster, layout: GroupLayout) -> tuple[float, float]:
    """Bandwidth of the ring's bottleneck and the latency of one full pass (n-1 steps)."""
    n = layout.size
    if cluster.topology == "torus":
        steps = sum(e - 1 for e in layout.torus_extents)
        return _torus_bw(cluster, layout), steps * cluster.intra.latency
    if not layout.spans_nodes:
        return cluster.intra.bandwidth, (n - 1) * cluster.intra.latency
    levels = cluster.levels_for(layout)
    bw = min(level.bandwidth for level in levels)
    inter_steps = layout.nodes - 1
    intra_steps = (n - 1) - inter_steps
    return bw, intra_steps * cluster.intra.latency + inter_steps * cluster.inter.latency


def _ring(kind: str, nbytes: float, cluster: Cluster, layout: GroupLayout) -> float:
    n = layout.size
    bw, lat = _ring_bw_and_step_latency(cluster, layout)
    passes = 2.0 if kind == "all-reduce" else 1.0
    return passes * ((n - 1) / n * nbytes / bw + lat)


def _tree(nbytes: float, cluster: Cluster, layout: GroupLayout) -> float:
    if cluster.topology == "torus":
        bw = _torus_bw(cluster, layout)
        return 2.0 * nbytes / bw + 2.0 * math.ceil(math.log2(layout.size)) * cluster.intra.latency
    levels = cluster.levels_for(layout)
    bw = min(level.bandwidth for level in levels)
    if layout.spans_nodes:
        k = layout.per_node
        lat = (k - 1) * cluster.intra.latency + math.ceil(
            math.log2(layout.nodes)
        ) * cluster.inter.latency
    else:
        lat = (layout.size - 1) * cluster.intra.latency  # a chain inside the node
    return 2.0 * nbytes / bw + 2.0 * lat


def _hierarchical(kind: str, nbytes: float, cluster: Cluster, layout: GroupLayout) -> float:
    if cluster.topology == "torus" or not layout.spans_nodes or layout.per_node == 1:
        return _ring(kind, nbytes, cluster, layout)  # one level: nothing to split
    k = layout.per_node
    nn = math.ceil(layout.size / k)
    intra, inter = cluster.intra, cluster.inter
    # one intra-node ring phase over the full buffer, one network phase over 1/k of it
    intra_phase = (k - 1) / k * nbytes / intra.bandwidth + (k - 1) * intra.latency
    inter_phase = (nn - 1) / nn * (nbytes / k) / inter.bandwidth + (nn - 1) * inter.latency
    if kind == "all-reduce":
        return 2.0 * intra_phase + 2.0 * inter_phase
    return intra_phase + inter_phase


def _all_to_all(nbytes: float, cluster: Cluster, layout: GroupLayout) -> float:
    n = layout.size
    if cluster.topology == "torus":
        ext = layout.torus_extents
        bw = _torus_bw(cluster, layout)
        factor = max((n - 1) / n, max(ext) * len(ext) / 4.0)
        return factor * nbytes / bw + sum(e - 1 for e in ext) * cluster.intra.latency
    if not layout.spans_nodes:
        return (n - 1) / n * nbytes / cluster.intra.bandwidth + (n - 1) * cluster.intra.latency
    k = layout.per_node
    intra_t = (k - 1) / n * nbytes / cluster.intra.bandwidth
    inter_t = (n - k) / n * nbytes / cluster.inter.bandwidth
    lat = (k - 1) * cluster.intra.latency + (n - k) * cluster.inter.latency
    return max(intra_t, inter_t) + lat


def _p2p(nbytes: float, cluster: Cluster, layout: GroupLayout) -> float:
    if cluster.topology == "torus":
        link_bw = cluster.intra.bandwidth / (2 * len(cluster.torus_shape or (1,)))
        return nbytes / link_bw + cluster.intra.latency
    level = cluster.inter if layout.spans_nodes else cluster.intra
    return nbytes / level.bandwidth + level.latency
