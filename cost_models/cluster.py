"""Clusters: devices x topology, and where each mesh axis lands on it.

A :class:`Cluster` is ``num_nodes`` nodes of ``devices_per_node`` devices. Devices inside a
node talk over the ``intra`` link level (NVLink / ICI / host memory), nodes over ``inter``
(InfiniBand / ICI / DCN). Every link bandwidth here is an *achievable bus bandwidth per
device, one direction*: what a large ring all-reduce measures as NCCL's ``busbw``, not the
datasheet's bidirectional total. Latencies are per ring step (α of the α-β model).

Mesh placement: mesh axes are ordered outer -> inner and devices are numbered row-major
(like ``jax.sharding.Mesh`` over ``jax.devices()``), so inner axes are packed into a node
first. A group of devices that shares all coordinates except some axes is a *collective
group*; :meth:`Cluster.group_layout` says how it sits on nodes (and on the torus for TPUs).

Example:
    >>> c = Cluster.preset("dgx-a100-80gb", nodes=4)
    >>> {a: tuple(l.name for l in ls) for a, ls in c.axis_levels({"data": 4, "tensor": 8}).items()}
    {'data': ('infiniband',), 'tensor': ('nvlink',)}
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

from cost_models.devices import DeviceSpec, device_for_jax_kind, get_device
from cost_models.errors import CostModelError, check_choice, check_int, check_positive

LinkName = Literal["nvlink", "infiniband", "ici", "dcn", "host", "ethernet"]
LINK_NAMES: tuple[str, ...] = ("nvlink", "infiniband", "ici", "dcn", "host", "ethernet")
Topology = Literal["switch", "torus"]
TOPOLOGIES: tuple[str, ...] = ("switch", "torus")

# How much communication one second of compute can hide (see overlap.py). Collectives
# running next to compute kernels take SMs and HBM bandwidth from them, so a compute second
# hides less than a full second of communication. Two software generations:
#
# * 2021 (Megatron-LM / DeepSpeed as Megatron-LM 2021 ran them: ZeRO-3's prefetches and
#   reduce-scatters on a side stream beside PyTorch's kernels): fitted on the six ZeRO-3
#   rows of Megatron-LM 2021 Table 2, the only published rows whose communication overlaps
#   compute, by the planner's own evaluation of the traced step
#   (``benchmarks.bench_published.fit_overlap_efficiency``: 0.270, squared log error flat
#   between 0.25 and 0.30), with those runs' gathers as ZeRO's per-owner broadcasts
#   (``owner_collectives``). ``cost_models.megatron.selene`` and
#   ``benchmarks.bench_published.cluster_2021`` use it.
# * Today's (the presets: XLA's async collectives under its latency-hiding scheduler, NCCL
#   over every NIC): no published run in ../shared/reference measures it. 0.6 is an
#   estimate, not a fit: the value the 2021 fit gave while the closed form priced three
#   gathers per layer (one collective each), kept rather than carrying 2021's slower
#   overlap into today's planner.
OVERLAP_EFFICIENCY_2021 = 0.27
DEFAULT_OVERLAP_EFFICIENCY = 0.6

# NCCL's own cost model (NVIDIA/nccl src/graph/tuning.cc, 2.9-2.12 era), ring / Simple
# protocol hardware latency per step: NVLink 3.4 us, network 9.6 us.
_NCCL_NVLINK_STEP_S = 3.4e-6
_NCCL_NET_STEP_S = 9.6e-6
_NCCL_SRC = "NCCL tuning.cc hwLat ring/Simple per-step latency"


@dataclass(frozen=True)
class LinkLevel:
    """One level of the interconnect.

    Attributes:
        name: ``"nvlink"``, ``"infiniband"``, ``"ici"``, ``"dcn"``, ``"host"`` or ``"ethernet"``.
        bandwidth: bytes/s per device, one direction, as a ring achieves it (bus bandwidth).
        latency: seconds per ring step (α): NCCL's Simple-protocol ring hop on GPUs (the
            other protocols' latencies scale with it, collectives.py).
        source: where the numbers come from.
        nvls_bandwidth: all-reduce bus bandwidth with NVLink SHARP (NVLS: the NVSwitch
            reduces), bytes/s per device; 0 where the switch has none.

    Example:
        >>> LinkLevel("nvlink", 230e9, 3.4e-6).bandwidth
        230000000000.0
    """

    name: LinkName
    bandwidth: float
    latency: float
    source: str = ""
    nvls_bandwidth: float = 0.0

    def __post_init__(self) -> None:
        check_choice("LinkLevel.name", self.name, LINK_NAMES)
        check_positive(f"LinkLevel {self.name!r} bandwidth", self.bandwidth)
        check_positive(f"LinkLevel {self.name!r} latency", self.latency, allow_zero=True)
        check_positive(
            f"LinkLevel {self.name!r} nvls_bandwidth", self.nvls_bandwidth, allow_zero=True
        )

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return {
            "name": self.name,
            "bandwidth": self.bandwidth,
            "latency": self.latency,
            "source": self.source,
            "nvls_bandwidth": self.nvls_bandwidth,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> LinkLevel:
        """Inverse of :meth:`to_json`."""
        return cls(
            name=data["name"],
            bandwidth=float(data["bandwidth"]),
            latency=float(data["latency"]),
            source=str(data.get("source", "")),
            nvls_bandwidth=float(data.get("nvls_bandwidth", 0.0)),
        )


@dataclass(frozen=True)
class GroupLayout:
    """Where one collective group sits on the cluster.

    Attributes:
        size: devices in the group (product of the group's axis sizes).
        per_node: most group members that share one node (k).
        nodes: distinct nodes the group touches.
        torus_extents: for torus clusters, the extent of the group along each torus
            dimension it varies in (empty for switch clusters or a single device).
    """

    size: int
    per_node: int
    nodes: int
    torus_extents: tuple[int, ...] = ()

    @property
    def spans_nodes(self) -> bool:
        """Whether the group touches more than one node."""
        return self.nodes > 1


@dataclass(frozen=True)
class Cluster:
    """Devices x topology.

    Attributes:
        name: preset name or a free label.
        device: the (single) device type.
        num_nodes: nodes (GPU servers, TPU hosts).
        devices_per_node: devices per node.
        intra: link level between devices of one node.
        inter: link level between nodes (for TPUs, ICI again: a slice is one ICI domain).
        topology: ``"switch"`` (NVSwitch + fat tree) or ``"torus"`` (TPU ICI).
        torus_shape: chips per torus dimension, product = num_devices (torus only).
        overlap_efficiency: communication seconds one compute second can hide (overlap.py).
        source: where the link numbers come from.
        owner_collectives: a software generation's way of sharding parameters: ``True``
            prices all-gathers and reduce-scatters that cross nodes as the ZeRO paper's
            per-owner broadcasts / reduces (Rajbhandari et al. SC'20 §7.2.2: the rank
            owning a partition broadcasts it), whose bandwidth is one GPU's own link
            (ZeRO-Infinity, SC'21 §6.1, replaced them by all-gathers for that reason): a
            ring at ``inter.bandwidth`` over the whole buffer. ``False`` (default): NCCL
            all-gather / reduce-scatter rings over all of the group's NICs.

    Example:
        >>> Cluster.preset("dgx-h100", nodes=2).num_devices
        16
    """

    name: str
    device: DeviceSpec
    num_nodes: int
    devices_per_node: int
    intra: LinkLevel
    inter: LinkLevel
    topology: Topology = "switch"
    torus_shape: tuple[int, ...] | None = None
    overlap_efficiency: float = DEFAULT_OVERLAP_EFFICIENCY
    source: str = ""
    owner_collectives: bool = False

    def __post_init__(self) -> None:
        check_int("Cluster.num_nodes", self.num_nodes)
        check_int("Cluster.devices_per_node", self.devices_per_node)
        check_choice("Cluster.topology", self.topology, TOPOLOGIES)
        check_positive("Cluster.overlap_efficiency", self.overlap_efficiency, allow_zero=True)
        if self.overlap_efficiency > 1.0:
            raise CostModelError(
                f"Cluster.overlap_efficiency must be in [0, 1]; got {self.overlap_efficiency!r}"
            )
        if self.topology == "torus":
            if not self.torus_shape:
                raise CostModelError("a torus Cluster needs torus_shape, e.g. (4, 4, 4)")
            shape = tuple(check_int("torus_shape entry", d) for d in self.torus_shape)
            if math.prod(shape) != self.num_devices:
                raise CostModelError(
                    f"torus_shape {shape} holds {math.prod(shape)} chips but the cluster has "
                    f"{self.num_devices} ({self.num_nodes} nodes x {self.devices_per_node})"
                )
            object.__setattr__(self, "torus_shape", shape)
        elif self.torus_shape is not None:
            raise CostModelError("torus_shape is only meaningful with topology='torus'")

    @property
    def num_devices(self) -> int:
        """Total devices."""
        return self.num_nodes * self.devices_per_node

    # ------------------------------------------------------------------ presets

    @classmethod
    def preset(
        cls,
        name: str,
        nodes: int = 1,
        *,
        chips: int | None = None,
        devices_per_node: int | None = None,
    ) -> Cluster:
        """A named cluster.

        GPU presets (``"dgx-a100-80gb"``, ``"dgx-a100-40gb"``, ``"dgx-h100"``,
        ``"hgx-h200"``): ``nodes`` servers of 8 GPUs. TPU presets (``"tpu-v4"``,
        ``"tpu-v5e"``, ``"tpu-v5p"``): ``nodes`` hosts of 4 chips (v5e: 8, per the Cloud TPU
        docs), or ``chips=`` the slice size; one ICI torus. ``"cpu-sim"``: one node of 8
        simulated devices (``devices_per_node=`` changes that).

        Example:
            >>> Cluster.preset("tpu-v5p", chips=64).torus_shape
            (4, 4, 4)
        """
        if name not in _PRESETS:
            raise CostModelError(f"unknown cluster preset {name!r}; known: {', '.join(_PRESETS)}")
        return _PRESETS[name](check_int("nodes", nodes), chips, devices_per_node)

    @classmethod
    def local(cls, devices: Sequence[Any] | None = None) -> Cluster:
        """The cluster made of the devices JAX sees (imports jax).

        The device kind is matched against the catalog (``cpu`` -> ``"cpu-sim"``); the
        nodes are JAX processes. If a calibration profile for this device kind exists
        (``cost_models/profiles``), its fitted efficiencies and measured link bandwidth
        replace the catalog defaults.

        Example:
            >>> c = Cluster.local()  # here: the 8 simulated CPU devices of the tests
            >>> c.name, c.num_devices, c.device.kind in ("cpu", "gpu", "tpu")
            ('local-cpu-sim', 8, True)
        """
        import jax  # lazily: cost_models works without jax

        devs = list(jax.devices() if devices is None else devices)
        if not devs:
            raise CostModelError("Cluster.local got no devices")
        first = devs[0]
        spec = device_for_jax_kind(first.device_kind, first.platform)
        if spec is None:
            from cost_models.devices import DEVICES

            raise CostModelError(
                f"device kind {first.device_kind!r} (platform {first.platform!r}) is not in the "
                f"catalog ({', '.join(DEVICES)}); build a DeviceSpec and Cluster by hand"
            )
        nodes = len({getattr(d, "process_index", 0) for d in devs})
        if len(devs) % nodes:
            raise CostModelError(f"{len(devs)} devices do not split evenly over {nodes} processes")
        per_node = len(devs) // nodes
        preset = _LOCAL_PRESET[spec.name]
        if spec.kind == "tpu":
            cluster = cls.preset(preset, chips=len(devs))
            cluster = replace(cluster, num_nodes=nodes, devices_per_node=per_node)
        else:
            cluster = cls.preset(preset, nodes=nodes, devices_per_node=per_node)
        cluster = replace(cluster, name=f"local-{cluster.name}")

        from cost_models.profile import apply_profile, load_profile

        profile = load_profile(first.device_kind)
        return cluster if profile is None else apply_profile(cluster, profile)

    def compiled_on(self, platform: str) -> Cluster:
        """This cluster with its programs built by XLA for ``platform`` (``"cpu"``,
        ``"gpu"``, ``"tpu"``): prices unchanged, the memory model following that
        compiler's buffers (``DeviceSpec.compiler``). For checking a plan made for these
        devices against a program compiled elsewhere, e.g. a DGX plan's predicted peak
        against ``memory_analysis()`` on simulated CPU devices.

        Example:
            >>> c = Cluster.preset("dgx-a100-80gb").compiled_on("cpu")
            >>> c.device.compiler, c.device.peak_flops == Cluster.preset(
            ...     "dgx-a100-80gb").device.peak_flops
            ('xla:cpu', True)
        """
        check_choice("platform", platform, ("cpu", "gpu", "tpu"))
        return replace(self, device=replace(self.device, compiler=f"xla:{platform}"))

    # ------------------------------------------------------------------ geometry

    def check_mesh(self, mesh: Mapping[str, int]) -> dict[str, int]:
        """Validate a mesh (axis -> size) against the cluster and return it as a dict."""
        if not isinstance(mesh, Mapping):
            raise CostModelError(f"mesh must be a mapping axis name -> size; got {mesh!r}")
        out = {str(a): check_int(f"mesh axis {a!r} size", s) for a, s in mesh.items()}
        total = math.prod(out.values())
        if total > self.num_devices:
            raise CostModelError(
                f"mesh {out} needs {total} devices but cluster {self.name!r} has {self.num_devices}"
            )
        return out

    def group_layout(self, mesh: Mapping[str, int], axes: Sequence[str]) -> GroupLayout:
        """How the collective group over ``axes`` (the one holding device 0) sits on nodes.

        Exact when node size and axis sizes are powers of two (every group then looks alike).

        Example:
            >>> Cluster.preset("dgx-a100-80gb", nodes=4).group_layout({"data": 16, "tensor": 2}, ["data"])
            GroupLayout(size=16, per_node=4, nodes=4, torus_extents=())
        """
        m = self.check_mesh(mesh)
        axes = tuple(axes)
        for a in axes:
            if a not in m:
                raise CostModelError(f"axis {a!r} is not in the mesh; mesh axes: {list(m)}")
        if len(set(axes)) != len(axes):
            raise CostModelError(f"axes repeat: {list(axes)}")
        members = group_members(m, axes)
        size = len(members)
        counts: dict[int, int] = {}
        for i in members:
            counts[i // self.devices_per_node] = counts.get(i // self.devices_per_node, 0) + 1
        extents: tuple[int, ...] = ()
        if self.topology == "torus" and self.torus_shape and size > 1:
            coords = [_unravel(i, self.torus_shape) for i in members]
            ext = []
            for d in range(len(self.torus_shape)):
                distinct = len({c[d] for c in coords})
                if distinct > 1:
                    ext.append(distinct)
            extents = tuple(ext)
        return GroupLayout(
            size=size, per_node=max(counts.values()), nodes=len(counts), torus_extents=extents
        )

    def axis_levels(self, mesh: Mapping[str, int]) -> dict[str, tuple[LinkLevel, ...]]:
        """The link levels each mesh axis's collectives cross.

        ``(intra,)`` when an axis's group stays in one node, ``(inter,)`` when it has one
        member per node, ``(intra, inter)`` when it spans both (a hierarchical collective).

        Example:
            >>> c = Cluster.preset("dgx-a100-80gb", nodes=4)
            >>> [l.name for l in c.axis_levels({"data": 16, "tensor": 2})["data"]]
            ['nvlink', 'infiniband']
        """
        out: dict[str, tuple[LinkLevel, ...]] = {}
        for axis in self.check_mesh(mesh):
            lay = self.group_layout(mesh, [axis])
            out[axis] = self.levels_for(lay)
        return out

    def levels_for(self, layout: GroupLayout) -> tuple[LinkLevel, ...]:
        """The link levels a group with this layout crosses (see :meth:`axis_levels`)."""
        if not layout.spans_nodes:
            return (self.intra,)
        if layout.per_node == 1:
            return (self.inter,)
        return (self.intra, self.inter)

    # ------------------------------------------------------------------ text and JSON

    def describe(self) -> str:
        """A few human-readable lines about the cluster.

        Example:
            >>> print(Cluster.preset("dgx-a100-80gb").describe().splitlines()[0])
            dgx-a100-80gb: 1 node x 8 a100-80gb = 8 devices (switch)
        """
        d = self.device
        topo = self.topology if self.topology == "switch" else f"torus {self.torus_shape}"
        node_word = "node" if self.num_nodes == 1 else "nodes"
        lines = [
            f"{self.name}: {self.num_nodes} {node_word} x {self.devices_per_node} {d.name} = "
            f"{self.num_devices} devices ({topo})",
            f"  device: {d.flops_for('bfloat16') / 1e12:.0f} TFLOP/s bf16, "
            f"{d.hbm_bytes / 1e9:.1f} GB at {d.hbm_bandwidth / 1e9:.0f} GB/s",
            f"  intra ({self.intra.name}): {self.intra.bandwidth / 1e9:.1f} GB/s per device, "
            f"{self.intra.latency * 1e6:.1f} us per step",
            f"  inter ({self.inter.name}): {self.inter.bandwidth / 1e9:.1f} GB/s per device, "
            f"{self.inter.latency * 1e6:.1f} us per step",
            f"  overlap efficiency: {self.overlap_efficiency:.2f}",
        ]
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (clusters are saved inside plans)."""
        return {
            "name": self.name,
            "device": self.device.to_json(),
            "num_nodes": self.num_nodes,
            "devices_per_node": self.devices_per_node,
            "intra": self.intra.to_json(),
            "inter": self.inter.to_json(),
            "topology": self.topology,
            "torus_shape": None if self.torus_shape is None else list(self.torus_shape),
            "overlap_efficiency": self.overlap_efficiency,
            "source": self.source,
            "owner_collectives": self.owner_collectives,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Cluster:
        """Inverse of :meth:`to_json`."""
        try:
            shape = data.get("torus_shape")
            return cls(
                name=str(data["name"]),
                device=DeviceSpec.from_json(data["device"]),
                num_nodes=int(data["num_nodes"]),
                devices_per_node=int(data["devices_per_node"]),
                intra=LinkLevel.from_json(data["intra"]),
                inter=LinkLevel.from_json(data["inter"]),
                topology=data.get("topology", "switch"),
                torus_shape=None if shape is None else tuple(int(s) for s in shape),
                overlap_efficiency=float(
                    data.get("overlap_efficiency", DEFAULT_OVERLAP_EFFICIENCY)
                ),
                source=str(data.get("source", "")),
                owner_collectives=bool(data.get("owner_collectives", False)),
            )
        except KeyError as e:
            raise CostModelError(f"Cluster JSON lacks the field {e.args[0]!r}") from None


def group_members(mesh: Mapping[str, int], axes: Sequence[str]) -> tuple[int, ...]:
    """The devices of the collective group over ``axes`` that holds device 0.

    Devices are numbered row-major over the mesh axes, the last axis varying fastest (as a
    ``jax.sharding.Mesh`` over ``devices.reshape(sizes)``): an axis's stride is the product
    of the sizes after it, so inner axes are packed into a node first. Members come in
    order, the last of ``axes`` varying fastest.

    Raises:
        CostModelError: an axis is not in the mesh.

    Example:
        >>> group_members({"data": 2, "tensor": 4}, ["tensor"])
        (0, 1, 2, 3)
        >>> group_members({"data": 2, "tensor": 4}, ["data"])
        (0, 4)
        >>> group_members({"pipe": 2, "data": 3, "tensor": 2}, ["pipe", "tensor"])
        (0, 1, 6, 7)
    """
    stride, strides = 1, {}
    for a in reversed(list(mesh)):
        strides[a] = stride
        stride *= mesh[a]
    members = [0]
    for a in axes:
        if a not in strides:
            raise CostModelError(f"axis {a!r} is not in the mesh; mesh axes: {list(mesh)}")
        members = [i + c * strides[a] for i in members for c in range(mesh[a])]
    return tuple(members)


def _unravel(index: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    out = []
    for d in reversed(shape):
        out.append(index % d)
        index //= d
    return tuple(reversed(out))


def torus_shape_for(chips: int, ndims: int) -> tuple[int, ...]:
    """A torus shape for ``chips`` (a power of two): double the smallest dimension until full.

    Gives the Cloud TPU slice shapes up to axis order (2x2x4, 4x4x4, 4x4x8, 16x16 ...).

    Example:
        >>> torus_shape_for(128, 3)
        (4, 4, 8)
    """
    chips = check_int("chips", chips)
    if chips & (chips - 1):
        raise CostModelError(f"TPU slices hold a power of two chips; got {chips}")
    shape = [1] * ndims
    while math.prod(shape) < chips:
        smallest = min(shape)
        j = max(i for i, s in enumerate(shape) if s == smallest)
        shape[j] *= 2
    return tuple(sorted(shape))


# ---------------------------------------------------------------------- presets

# DGX A100: 8 x 200 Gb/s HDR InfiniBand per node (one NIC per GPU) = 25 GB/s per GPU, line
# rate (reference README). NVLink: measured NCCL all-reduce bus bandwidth inside one node
# ~230 GB/s (reference README, maintainers in nccl-tests issues).
_NVLINK_A100 = LinkLevel(
    "nvlink",
    230e9,
    _NCCL_NVLINK_STEP_S,
    "NCCL all-reduce busbw inside a DGX A100 ~230 GB/s (reference README); " + _NCCL_SRC,
)
_IB_HDR = LinkLevel(
    "infiniband",
    25e9,
    _NCCL_NET_STEP_S,
    "8 x 200 Gb/s HDR per DGX A100 node = 25 GB/s per GPU, line rate (reference README); "
    + _NCCL_SRC,
)
# DGX H100: NVLink4; measured NCCL all-reduce busbw ~370 GB/s, ~480 GB/s with NVLink SHARP
# (NVLS, NCCL >= 2.17 on the third-generation NVSwitch; reference README). Network:
# 8 x 400 Gb/s NDR ConnectX-7 = 50 GB/s per GPU.
_NVLINK_H100 = LinkLevel(
    "nvlink",
    370e9,
    _NCCL_NVLINK_STEP_S,
    "NCCL all-reduce busbw inside a DGX H100 ~370 GB/s, ~480 GB/s with NVLS (reference "
    "README); " + _NCCL_SRC,
    nvls_bandwidth=480e9,
)
_IB_NDR = LinkLevel(
    "infiniband",
    50e9,
    _NCCL_NET_STEP_S,
    "8 x 400 Gb/s NDR per node = 50 GB/s per GPU, line rate (DGX H100 datasheet); " + _NCCL_SRC,
)


def _dgx(name: str, device: str, nvlink: LinkLevel, ib: LinkLevel, src: str):
    def build(nodes: int, chips: int | None, per_node: int | None) -> Cluster:
        if chips is not None:
            raise CostModelError(f"preset {name!r} takes nodes=, not chips=")
        return Cluster(
            name=name,
            device=get_device(device),
            num_nodes=nodes,
            devices_per_node=8 if per_node is None else check_int("devices_per_node", per_node),
            intra=nvlink,
            inter=ib,
            source=src,
        )

    return build


# TPU ICI: the LinkLevel bandwidth is the per-chip all-reduce bandwidth when a collective
# uses every torus dimension; collectives.py scales it by the dimensions a group uses.
_ICI_LATENCY_S = 1e-6  # not published; order of a hop on a direct chip-to-chip link (estimate)
_ICI = {
    # 1.1 PB/s all-reduce bandwidth per 4096-chip pod (Cloud TPU v4 docs) / 4096 chips.
    "tpu-v4": (
        "tpu-v4",
        3,
        4,
        1.1e15 / 4096,
        "Cloud TPU v4 docs: all-reduce bandwidth per pod 1.1 PB/s over 4096 chips",
    ),
    # 51.2 TB/s all-reduce bandwidth per 256-chip pod (Cloud TPU v5e docs); 8 chips per host.
    "tpu-v5e": (
        "tpu-v5e",
        2,
        8,
        51.2e12 / 256,
        "Cloud TPU v5e docs: all-reduce bandwidth per pod 51.2 TB/s over 256 chips",
    ),
    # v5p: 4800 Gbps ICI per chip (Cloud TPU v5p docs; "1200 GBps bidirectional"). On v5e
    # the per-chip all-reduce bandwidth equals the one-direction ICI total (1600 Gbps =
    # 200 GB/s), so we use the one-direction total for v5p too: 600 GB/s.
    "tpu-v5p": (
        "tpu-v5p",
        3,
        4,
        4800e9 / 8,
        "Cloud TPU v5p docs: 4800 Gbps ICI per chip, one direction (as v5e's all-reduce figure)",
    ),
}


def _tpu(name: str):
    device, ndims, per_host, bw, src = _ICI[name]

    def build(nodes: int, chips: int | None, per_node: int | None) -> Cluster:
        per = per_host if per_node is None else check_int("devices_per_node", per_node)
        total = nodes * per if chips is None else check_int("chips", chips)
        if chips is not None and nodes != 1 and nodes * per != chips:
            raise CostModelError(
                f"preset {name!r}: nodes={nodes} x {per} chips != chips={chips}; give one of them"
            )
        if total % per and total > per:
            raise CostModelError(f"{total} chips do not fill hosts of {per}")
        num_nodes, per_node_eff = (max(1, total // per), min(per, total))
        ici = LinkLevel("ici", bw, _ICI_LATENCY_S, src + "; latency: estimate")
        return Cluster(
            name=name,
            device=get_device(device),
            num_nodes=num_nodes,
            devices_per_node=per_node_eff,
            intra=ici,
            inter=ici,
            topology="torus",
            torus_shape=torus_shape_for(total, ndims),
            source=src,
        )

    return build


def _cpu_sim(nodes: int, chips: int | None, per_node: int | None) -> Cluster:
    if chips is not None:
        raise CostModelError("preset 'cpu-sim' takes nodes= and devices_per_node=, not chips=")
    # A DGX A100 slowed down 100x (see the cpu-sim device): bandwidths / 100, latencies x 100.
    return Cluster(
        name="cpu-sim",
        device=get_device("cpu-sim"),
        num_nodes=nodes,
        devices_per_node=8 if per_node is None else check_int("devices_per_node", per_node),
        intra=LinkLevel("host", 2.3e9, 340e-6, "fictitious: dgx-a100 nvlink / 100"),
        inter=LinkLevel("host", 0.25e9, 960e-6, "fictitious: dgx-a100 infiniband / 100"),
        source="fictitious: a DGX A100 slowed down 100x, so simulated-CPU plans rank as on A100s",
    )


_PRESETS = {
    "dgx-a100-80gb": _dgx(
        "dgx-a100-80gb", "a100-80gb", _NVLINK_A100, _IB_HDR, "DGX A100 80GB (Selene nodes)"
    ),
    "dgx-a100-40gb": _dgx("dgx-a100-40gb", "a100-40gb", _NVLINK_A100, _IB_HDR, "DGX A100 40GB"),
    "dgx-h100": _dgx("dgx-h100", "h100-sxm", _NVLINK_H100, _IB_NDR, "DGX H100"),
    # HGX H200: same NVLink4 / NVSwitch as H100 (no separate busbw measurement, so the H100
    # figure); network assumed 8 x 400 Gb/s NDR like DGX H100.
    "hgx-h200": _dgx("hgx-h200", "h200-sxm", _NVLINK_H100, _IB_NDR, "HGX H200 (links as DGX H100)"),
    "tpu-v4": _tpu("tpu-v4"),
    "tpu-v5e": _tpu("tpu-v5e"),
    "tpu-v5p": _tpu("tpu-v5p"),
    "cpu-sim": _cpu_sim,
}
PRESETS: tuple[str, ...] = tuple(_PRESETS)

_LOCAL_PRESET = {
    "a100-40gb": "dgx-a100-40gb",
    "a100-80gb": "dgx-a100-80gb",
    "h100-sxm": "dgx-h100",
    "h200-sxm": "hgx-h200",
    "tpu-v4": "tpu-v4",
    "tpu-v5e": "tpu-v5e",
    "tpu-v5p": "tpu-v5p",
    "cpu-sim": "cpu-sim",
}
