"""Collective communication time as NCCL (GPUs) and XLA's ICI collectives (TPUs) run them.

``nbytes`` convention (per device, in bytes):

* ``all-reduce``: the buffer each device holds (input size = output size).
* ``all-gather``: the FULL gathered output each device ends with (n shards of nbytes/n).
* ``reduce-scatter``: the FULL input each device starts with (it keeps nbytes/n).
* ``all-to-all``: the buffer each device holds (it keeps 1/n, sends (n-1)/n away).
* ``p2p``: the bytes one device sends to one peer.

The group is the devices that differ only along ``axes``; n = prod(mesh[a] for a in axes),
spread over ``nodes`` nodes with k = n / nodes members per node. n == 1 (or no axes, or
nbytes == 0) costs 0.

GPU clusters (``topology="switch"``) follow NCCL's own tuning model (NVIDIA/nccl
``src/graph/tuning.cc``, v2.12, ``ncclTopoTuneModel`` and ``ncclTopoGetAlgoTime``):
every (algorithm, protocol) pair gets ``time = latency + nbytes / algbw`` and ``auto``
takes the fastest, as NCCL does.

* Bus bandwidth. Inside a node: ``intra.bandwidth`` (the measured NCCL busbw). Across
  nodes NCCL builds one ring / tree per channel and spreads the channels over all NICs
  near the group's GPUs (``nChannels * speedInter``): a group with k members per node
  uses k GPUs' NICs, ``min(intra.bandwidth, k * inter.bandwidth)`` (``inter.bandwidth`` is
  one GPU's share of its node's NICs; the node's other GPUs' groups use the rest). So an
  all-gather over 8 GPUs of each of 16 DGX A100 nodes runs at 8 x 25 = 200 GB/s, not at
  one NIC's 25 GB/s.
* Protocols (bandwidth fraction of busbw): Simple 1; LL128 0.92 (0.7 with one member per
  node; NVLink GPUs only, as NCCL enables it); LL 1/4 (1/3 for a single-node all-gather /
  reduce-scatter). Ring: algbw = busbw * n / nsteps, nsteps = 2(n-1) (all-reduce) or n-1.
  Tree (all-reduce only): algbw = 0.5 * min(0.9 busbw, 80 GB/s over > 2 nodes, 110 GB/s
  else; LL128 on A100 105 / 130), LL x 1/3.8, LL128 x 0.915 (7/9 on one node), times
  NCCL's per-size ``treeCorrectionFactor``.
* Latency: ``baseLat[algorithm][protocol]`` plus per-hop ``hwLat[link][algorithm][protocol]``
  (tables below). Ring: ``(nsteps - nInterSteps) * intraLat + nInterSteps * interLat``
  with nInterSteps = 2(nodes-1) or nodes-1; LL's intra hops x 1.8 across nodes; a
  multi-node Simple ring all-reduce of at least n/16 x 64 KiB x 1.9 (NCCL's "plateau").
  Tree: ``2 ((k-1) intraLat + log2(nodes) interLat)``. A preset's ``LinkLevel.latency``
  is the Simple ring hop; the table's other entries scale with it (1x on real presets).
* NVLS (NVLink SHARP, DGX H100's NVSwitch): all-reduce inside one node at
  ``intra.nvls_bandwidth`` (measured ~480 GB/s busbw, reference README) with NCCL 2.18's
  NVLS latency (25 us, ``hwLat`` NVLink NVLS Simple).
* Owner collectives (``Cluster.owner_collectives``, the ZeRO paper's design as DeepSpeed
  ran it in 2021): all-gathers / reduce-scatters across nodes as per-owner broadcasts /
  reduces, a Simple ring at one GPU's network link: ``(n-1)/n B / inter.bandwidth``.
* ``hierarchical`` (asked for explicitly; NCCL never picks it): reduce-scatter inside the
  node, the network phase on 1/k of the data at one NIC per GPU, all-gather inside the
  node. Hybrid sharding (HSDP, ZeRO++ hpZ) runs this shape.
* ``all-to-all``: pairwise exchange. In a node ``(n-1)/n B/bw``; across nodes the intra and
  network parts proceed in parallel: ``max((k-1)/n B/bw_intra, (n-k)/n B/bw_inter)``.
* ``p2p``: ``B/bw + α`` over the slowest level the axis crosses.

Clusters of CPU devices (``cpu-sim``, host links): no NCCL; the plain α-β ring
(``2(n-1)/n B/bw + 2(n-1) α`` for all-reduce, at the slower level's bandwidth across
nodes, the intra-node α per step except the nodes-1 network steps) and tree
(``2 B/bw + 2((k-1) α_intra + ceil(log2 nodes) α_inter)``), best of ring / tree /
hierarchical for all-reduce.

TPU clusters (``topology="torus"``): XLA's ICI collectives, an α-β model per torus axis.
The ICI LinkLevel bandwidth is the per-chip all-reduce bandwidth with every torus dimension
in use; a group that spans d of D dimensions gets ``bw * d / D``, and its ring has
sum(e_i - 1) steps of ``intra.latency``; a tree all-reduce ``2 B/bw + 2 ceil(log2 n) α``;
all-to-all is bisection-bound, ``max((n-1)/n, e d / 4) B / bw`` with e the longest extent;
p2p one link, one direction, ``bw / (2 * ndims)``.

Example:
    >>> from cost_models import Cluster
    >>> c = Cluster.preset("dgx-a100-80gb")
    >>> t = collective_time("all-reduce", 1e9, c, {"tensor": 8}, ["tensor"], "ring")
    >>> round(t * 1e3, 3)  # 2*7/8 * 1 GB / 230 GB/s + 8.4 us + 14 * 3.4 us (Simple)
    7.665
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
Algorithm = Literal["auto", "ring", "tree", "nvls", "hierarchical"]
ALGORITHMS: tuple[str, ...] = ("auto", "ring", "tree", "nvls", "hierarchical")
PROTOCOLS: tuple[str, ...] = ("LL", "LL128", "Simple")

# ---- NCCL's tuning model: NVIDIA/nccl src/graph/tuning.cc (v2.12, commit 01afd20a).
# Latencies in microseconds, per protocol (LL, LL128, Simple).
_NCCL_SRC = "NVIDIA/nccl src/graph/tuning.cc v2.12 (commit 01afd20a)"
_BASE_LAT_US = {"tree": (6.8, 14.0, 0.0), "ring": (6.6, 14.0, 8.4)}  # baseLat
_HW_LAT_US = {  # hwLat[hardware][algorithm][protocol]
    "nvlink": {"tree": (0.52, 1.2, 28.0), "ring": (0.47, 1.9, 3.4)},
    "pci": {"tree": (1.0, 1.9, 28.0), "ring": (1.0, 2.5, 5.7)},
    "net": {"tree": (5.0, 8.5, 50.0), "ring": (2.7, 4.0, 9.6)},
}
# NVLS (NVLink SHARP) all-reduce: hwLat NVLink NVLS Simple 25 us, baseLat 0 (tuning.cc of
# NCCL 2.18+, where NVLS appeared).
_NVLS_LAT_US = 25.0
# treeCorrectionFactor[protocol][log2(nbytes / 64)], sizes 64 B .. 128 MiB.
_TREE_CORRECTION = (
    (1.0, 1.0, 1.0, 1.0, .9, .8, .7, .7, .7, .7, .6, .5, .4, .4, .5, .6, .7, .8, .9, 1.0, 1.0, 1.0),
    (1.0, 1.0, 1.0, 1.0, 1.0, .9, .8, .8, .8, .7, .6, .6, .6, .5, .6, .6, .7, .7, .8, .9, .9, 1.0),
    (.9, .9, .9, .9, .9, .9, .9, .8, .7, .6, .6, .5, .5, .5, .5, .5, .5, .6, .6, .7, .8, .9),
)  # fmt: skip
# Tree bus-bandwidth caps (maxTreeBw, GB/s): > 2 nodes 80 (A100 LL128 105), else 110 (130).
_TREE_MAX_BW = {True: (80e9, 105e9), False: (110e9, 130e9)}
# Which hwLat row a link uses, and the Simple ring hop that row's latencies scale from.
_HW_CLASS = {
    "nvlink": "nvlink",
    "host": "pci",
    "infiniband": "net",
    "ethernet": "net",
    "dcn": "net",
}


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
    """Like :func:`collective_time`, also naming the algorithm ``auto`` chose: on GPUs
    ``"algorithm/protocol"`` (``"ring/Simple"``, ``"tree/LL"``, ``"nvls/Simple"``), on a
    torus ``"ring"`` or ``"tree"``; an explicit ``algorithm`` is returned as given.

    Example:
        >>> from cost_models import Cluster
        >>> c = Cluster.preset("dgx-a100-80gb", 8)
        >>> best_algorithm("all-reduce", 1e3, c, {"d": 64}, ["d"])[0]
        'tree/LL'
        >>> best_algorithm("all-reduce", 1e9, c, {"d": 64}, ["d"])[0]
        'ring/Simple'
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
    if algorithm in ("tree", "nvls") and kind != "all-reduce":
        raise CostModelError(
            f"algorithm {algorithm!r} is defined for all-reduce only; got {kind!r}"
        )
    if cluster.topology == "torus":
        options = {
            "ring": lambda: _ring_torus(kind, nbytes, cluster, layout),
            "tree": lambda: _tree_torus(nbytes, cluster, layout),
            "hierarchical": lambda: _ring_torus(kind, nbytes, cluster, layout),
        }
        if algorithm == "nvls":
            raise CostModelError("algorithm 'nvls' needs an NVLink-switch GPU cluster, not a torus")
        if algorithm != "auto":
            return (algorithm, options[algorithm]())
        if kind != "all-reduce":
            return ("ring", options["ring"]())
        times = {"ring": options["ring"](), "tree": options["tree"]()}
        name = min(times, key=lambda k: times[k])
        return (name, times[name])
    if algorithm == "hierarchical":
        return ("hierarchical", _hierarchical(kind, nbytes, cluster, layout))
    if cluster.device.kind != "gpu":
        return _alpha_beta(kind, nbytes, cluster, layout, algorithm)
    if cluster.owner_collectives and kind != "all-reduce" and layout.spans_nodes:
        # ZeRO (SC'20) per-owner broadcasts / reduces: one GPU's link on the whole buffer
        return ("owner", _owner_ring(kind, nbytes, cluster, layout))
    candidates = nccl_times(kind, nbytes, cluster, layout)
    if algorithm != "auto":
        candidates = {k: v for k, v in candidates.items() if k.split("/")[0] == algorithm}
        if not candidates:
            raise CostModelError(
                f"algorithm {algorithm!r} is not available for this group (nvls needs a "
                "preset with NVLink SHARP and a group inside one node)"
            )
        return (algorithm, min(candidates.values()))
    name = min(candidates, key=lambda k: candidates[k])
    return (name, candidates[name])


def nccl_times(
    kind: CollectiveKind, nbytes: float, cluster: Cluster, layout: GroupLayout
) -> dict[str, float]:
    """Seconds for every (algorithm, protocol) NCCL would consider, ``"ring/LL128"`` -> s.

    NCCL's tuning model (module docstring): ring for every collective, tree (and NVLS
    inside a node, where the preset has it) for all-reduce; protocols LL, LL128 (NVLink
    GPUs) and Simple. ``auto`` takes the minimum, as ``ncclTopoGetAlgoTime`` does.

    Example:
        >>> from cost_models import Cluster
        >>> c = Cluster.preset("dgx-a100-80gb", nodes=2)
        >>> lay = c.group_layout({"d": 16}, ["d"])
        >>> t = nccl_times("all-gather", 1e9, c, lay)
        >>> sorted(t)
        ['ring/LL', 'ring/LL128', 'ring/Simple']
        >>> round(t["ring/Simple"] * 1e3, 3)  # 15/16 GB / min(230, 8 x 25) GB/s + latency
        4.753
    """
    n, nodes = layout.size, layout.nodes
    multi = layout.spans_nodes
    ppn = n / nodes
    intra, inter = cluster.intra, cluster.inter
    bus = _bus_bandwidth(cluster, layout)
    ll128 = intra.name == "nvlink"  # NCCL enables LL128 on NVLink GPUs only
    intra_cls = _HW_CLASS.get(intra.name, "pci")
    intra_scale = intra.latency / (_HW_LAT_US[intra_cls]["ring"][2] * 1e-6)
    inter_scale = inter.latency / (_HW_LAT_US["net"]["ring"][2] * 1e-6)
    ar = kind == "all-reduce"
    nsteps = 2 * (n - 1) if ar else n - 1
    inter_steps = (2 * (nodes - 1) if ar else nodes - 1) if multi else 0
    out: dict[str, float] = {}
    for pi, proto in enumerate(PROTOCOLS):
        if proto == "LL128" and not ll128:
            continue
        # ring
        bw = bus
        if proto == "LL":
            bw *= 0.25 if (multi or ar) else 1.0 / 3.0
        elif proto == "LL128":
            bw *= 0.92 if ppn >= 2 else 0.7
        algbw = bw * n / nsteps
        intra_lat = _HW_LAT_US[intra_cls]["ring"][pi] * 1e-6 * intra_scale
        if multi and proto == "LL":
            intra_lat *= 1.8
        inter_lat = _HW_LAT_US["net"]["ring"][pi] * 1e-6 * inter_scale
        lat = _BASE_LAT_US["ring"][pi] * 1e-6 * intra_scale
        lat += (nsteps - inter_steps) * intra_lat + inter_steps * inter_lat
        if ar and proto == "Simple" and multi and nbytes >= n / 16.0 * 65536:
            lat *= 1.9  # NCCL: plateau effect of ring
        out[f"ring/{proto}"] = lat + nbytes / algbw
        if not ar:
            continue
        # tree (double binary tree across nodes, a chain inside each)
        tbw = 0.9 * bus
        if intra.name == "nvlink":
            tbw = min(tbw, _TREE_MAX_BW[nodes > 2][1 if proto == "LL128" else 0])
        if proto == "LL":
            tbw /= 3.8
        elif proto == "LL128":
            tbw *= 0.915 if multi else 7.0 / 9.0
        log_size = int(math.log2(max(nbytes, 64.0) / 64.0))
        if log_size < len(_TREE_CORRECTION[pi]):
            tbw *= _TREE_CORRECTION[pi][log_size]
        t_intra = _HW_LAT_US[intra_cls]["tree"][pi] * 1e-6 * intra_scale
        if multi and proto == "LL":
            t_intra *= 1.8
        t_inter = _HW_LAT_US["net"]["tree"][pi] * 1e-6 * inter_scale
        tlat = _BASE_LAT_US["tree"][pi] * 1e-6 * intra_scale
        tlat += 2.0 * ((ppn - 1) * t_intra + (math.log2(nodes) if multi else 0.0) * t_inter)
        out[f"tree/{proto}"] = tlat + nbytes / (0.5 * tbw)
    if ar and not multi and intra.nvls_bandwidth > 0:
        # NVLS: the switch reduces; each GPU sends and receives the buffer once.
        out["nvls/Simple"] = _NVLS_LAT_US * 1e-6 * intra_scale + 2 * (n - 1) / n * nbytes / (
            intra.nvls_bandwidth
        )
    return out


def _alpha_beta(
    kind: str, nbytes: float, cluster: Cluster, layout: GroupLayout, algorithm: str
) -> tuple[str, float]:
    """Switch clusters of CPU (host) devices: no NCCL, the plain α-β ring and tree, one
    Simple-style hop of ``latency`` per step; a ring across nodes at the slower level."""
    n = layout.size
    levels = cluster.levels_for(layout)
    bw = min(level.bandwidth for level in levels)
    inter_steps = layout.nodes - 1
    step_lat = (n - 1 - inter_steps) * cluster.intra.latency + inter_steps * cluster.inter.latency
    passes = 2.0 if kind == "all-reduce" else 1.0
    ring = passes * ((n - 1) / n * nbytes / bw + step_lat)
    if kind != "all-reduce" or algorithm == "ring":
        return ("ring", ring)
    if layout.spans_nodes:
        lat = (layout.per_node - 1) * cluster.intra.latency + math.ceil(
            math.log2(layout.nodes)
        ) * cluster.inter.latency
    else:
        lat = (n - 1) * cluster.intra.latency  # a chain inside the node
    tree = 2.0 * nbytes / bw + 2.0 * lat
    if algorithm == "tree":
        return ("tree", tree)
    times = {
        "ring": ring,
        "tree": tree,
        "hierarchical": _hierarchical(kind, nbytes, cluster, layout),
    }
    name = min(times, key=lambda k: times[k])
    return (name, times[name])


def _owner_ring(kind: str, nbytes: float, cluster: Cluster, layout: GroupLayout) -> float:
    """A Simple-protocol ring whose every hop runs at one GPU's network link."""
    n, nodes = layout.size, layout.nodes
    lat = _BASE_LAT_US["ring"][2] * 1e-6  # Simple ring baseLat
    lat += (n - nodes) * cluster.intra.latency + (nodes - 1) * cluster.inter.latency
    return (n - 1) / n * nbytes / cluster.inter.bandwidth + lat


def _bus_bandwidth(cluster: Cluster, layout: GroupLayout) -> float:
    """NCCL's busbw for the group: the NVLink busbw inside a node; across nodes one
    channel per NIC of the group's k GPUs per node, ``min(intra, k * inter)``."""
    if not layout.spans_nodes:
        return cluster.intra.bandwidth
    return min(cluster.intra.bandwidth, layout.per_node * cluster.inter.bandwidth)


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


def _ring_torus(kind: str, nbytes: float, cluster: Cluster, layout: GroupLayout) -> float:
    steps = sum(e - 1 for e in layout.torus_extents)
    n = layout.size
    passes = 2.0 if kind == "all-reduce" else 1.0
    bw = _torus_bw(cluster, layout)
    return passes * ((n - 1) / n * nbytes / bw + steps * cluster.intra.latency)


def _tree_torus(nbytes: float, cluster: Cluster, layout: GroupLayout) -> float:
    bw = _torus_bw(cluster, layout)
    return 2.0 * nbytes / bw + 2.0 * math.ceil(math.log2(layout.size)) * cluster.intra.latency


def _hierarchical(kind: str, nbytes: float, cluster: Cluster, layout: GroupLayout) -> float:
    if not layout.spans_nodes or layout.per_node == 1:
        # one level: nothing to split; a ring (NCCL's with the Simple protocol on GPUs)
        if cluster.device.kind != "gpu":
            return _alpha_beta(kind, nbytes, cluster, layout, "ring")[1]
        return nccl_times(kind, nbytes, cluster, layout)["ring/Simple"]
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
