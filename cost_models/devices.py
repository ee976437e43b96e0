"""The device catalog: peak FLOP/s per dtype, HBM size and bandwidth, each with its source.

Peak FLOP/s are *dense* (no 2:4 sparsity) tensor-core / MXU figures from vendor datasheets.
Memory sizes are as the vendor writes them ("80 GB" -> 80e9 bytes, "32 GiB" -> 32 * 2**30):
the decimal reading is slightly below the physical capacity, which leaves room for the
runtime's own reservations.

Example:
    >>> from cost_models import get_device
    >>> get_device("a100-80gb").flops_for("bfloat16")
    312000000000000.0
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from cost_models.efficiency import DEFAULT_EFFICIENCY, Efficiency
from cost_models.errors import CostModelError, check_choice, check_positive

DeviceKind = Literal["gpu", "tpu", "cpu"]
DEVICE_KINDS: tuple[str, ...] = ("gpu", "tpu", "cpu")
COMPILERS: tuple[str, ...] = ("xla:gpu", "xla:tpu", "xla:cpu")
"""Compilers whose buffers the memory model knows (``DeviceSpec.compiler``)."""

# Canonical dtype names and the spellings we accept for them (numpy/jax names, short forms).
_DTYPE_ALIASES: dict[str, str] = {
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
    "f16": "float16",
    "half": "float16",
    "float32": "float32",
    "fp32": "float32",
    "f32": "float32",
    "float": "float32",
    "tf32": "tf32",
    "float64": "float64",
    "fp64": "float64",
    "f64": "float64",
    "double": "float64",
    "int8": "int8",
    "uint8": "int8",
    "s8": "int8",
    "u8": "int8",
    "fp8": "float8",
    "float8": "float8",
    "float8_e4m3fn": "float8",
    "float8_e5m2": "float8",
    "f8e4m3fn": "float8",
    "f8e5m2": "float8",
}
DTYPES: tuple[str, ...] = tuple(sorted(set(_DTYPE_ALIASES.values())))


def canonical_dtype(dtype: object) -> str:
    """Map a dtype (a name, a numpy/jax dtype) to its canonical name, e.g. ``"bf16"`` -> ``"bfloat16"``.

    Example:
        >>> canonical_dtype("bf16")
        'bfloat16'
    """
    name = str(getattr(dtype, "name", dtype)).lower()
    if name not in _DTYPE_ALIASES:
        known = ", ".join(sorted(_DTYPE_ALIASES))
        raise CostModelError(f"unknown dtype {dtype!r}; known spellings: {known}")
    return _DTYPE_ALIASES[name]


class FrozenMapping(Mapping[str, float]):
    """A read-only, hashable ``str -> float`` mapping (dataclass fields stay hashable)."""

    __slots__ = ("_data",)

    def __init__(self, data: Mapping[str, float]) -> None:
        self._data = {str(k): float(v) for k, v in data.items()}

    def __getitem__(self, key: str) -> float:
        return self._data[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def __hash__(self) -> int:
        return hash(tuple(sorted(self._data.items())))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Mapping) and dict(self.items()) == dict(other.items())

    def __repr__(self) -> str:
        return repr(self._data)


@dataclass(frozen=True)
class DeviceSpec:
    """One accelerator's capabilities.

    Attributes:
        name: catalog name (``"a100-80gb"``).
        kind: ``"gpu"``, ``"tpu"`` or ``"cpu"``.
        peak_flops: dtype name -> dense matmul FLOP/s (tensor cores / MXU).
        hbm_bytes: device memory in bytes.
        hbm_bandwidth: device memory bandwidth in bytes/s (datasheet).
        source: where the numbers come from.
        vector_flops: FLOP/s of non-matmul (vector / CUDA-core fp32) arithmetic, used for
            elementwise and reduction ops.
        efficiency: achievable fractions of peak (matmul curve, HBM); calibration replaces it.
        jax_device_kinds: lowercase substrings of ``jax.Device.device_kind`` that identify
            this device (``Cluster.local`` uses them).
        compiler: the compiler that builds its programs (``"xla:gpu"``, ``"xla:tpu"``,
            ``"xla:cpu"``; default ``"xla:"`` + ``kind``). The memory model follows its
            buffers where they differ (:mod:`autopar.search.build.memory`): XLA:CPU copies
            the operands of a convolution that is not in ``NHWC/HWIO/NHWC`` form
            (``xla/service/cpu/conv_canonicalization.cc``) and expands a max-pool's
            gradient (``select_and_scatter``) into window indices and a padded result;
            XLA:GPU hands backward convolutions to cuDNN as they are where its layout
            assignment keeps NHWC (Hopper and later; 16-bit types from Volta on) and
            emits ``select_and_scatter`` as one kernel. ``Cluster.compiled_on`` sets it.

    Example:
        >>> DeviceSpec("toy", "gpu", {"bfloat16": 1e12}, 2**30, 1e11, "made up").flops_for("bf16")
        1000000000000.0
    """

    name: str
    kind: DeviceKind
    peak_flops: Mapping[str, float]
    hbm_bytes: int
    hbm_bandwidth: float
    source: str
    vector_flops: float = 0.0
    efficiency: Efficiency = DEFAULT_EFFICIENCY
    jax_device_kinds: tuple[str, ...] = ()
    compiler: str = ""

    def __post_init__(self) -> None:
        check_choice("DeviceSpec.kind", self.kind, DEVICE_KINDS)
        if not self.peak_flops:
            raise CostModelError(
                f"DeviceSpec {self.name!r}: peak_flops must name at least one dtype"
            )
        flops = {canonical_dtype(k): float(v) for k, v in self.peak_flops.items()}
        for k, v in flops.items():
            check_positive(f"DeviceSpec {self.name!r} peak_flops[{k!r}]", v)
        object.__setattr__(self, "peak_flops", FrozenMapping(flops))
        check_positive(f"DeviceSpec {self.name!r} hbm_bytes", self.hbm_bytes)
        object.__setattr__(self, "hbm_bytes", int(self.hbm_bytes))
        check_positive(f"DeviceSpec {self.name!r} hbm_bandwidth", self.hbm_bandwidth)
        check_positive(f"DeviceSpec {self.name!r} vector_flops", self.vector_flops, allow_zero=True)
        if self.vector_flops == 0.0:
            # Unknown vector rate: an order-of-magnitude stand-in (elementwise ops are
            # HBM-bound on every catalog device, so this rarely decides anything).
            object.__setattr__(self, "vector_flops", max(flops.values()) / 16.0)
        object.__setattr__(
            self, "jax_device_kinds", tuple(s.lower() for s in self.jax_device_kinds)
        )
        object.__setattr__(self, "compiler", self.compiler or f"xla:{self.kind}")
        check_choice(f"DeviceSpec {self.name!r} compiler", self.compiler, COMPILERS)

    def flops_for(self, dtype: object) -> float:
        """Dense matmul peak FLOP/s for ``dtype``, with documented fallbacks.

        Fallbacks, in order:
        * ``float32`` on a GPU with a ``tf32`` entry -> the TF32 peak, because XLA:GPU's
          default matmul precision lets f32 dots use TF32 on Ampere and later.
        * ``float32`` on a TPU -> the bf16 peak, because XLA:TPU's default precision runs
          f32 dots as one bf16 MXU pass.
        * ``float8`` / ``int8`` on a device without them -> the 16-bit peak (what the dot
          would run as after up-casting).
        * ``float64`` without an entry -> half of ``vector_flops``.
        * ``tf32`` without an entry -> the ``float32`` entry if any.
        * otherwise the ``bfloat16`` / ``float16`` entry, whichever exists.

        Example:
            >>> get_device("h100-sxm").flops_for("float32") == get_device("h100-sxm").flops_for("tf32")
            True
        """
        name = canonical_dtype(dtype)
        pf = self.peak_flops
        if name in pf:
            return pf[name]
        if name == "float32":
            if self.kind == "gpu" and "tf32" in pf:
                return pf["tf32"]
            if self.kind == "tpu":
                return self._sixteen_bit()
        if name == "tf32" and "float32" in pf:
            return pf["float32"]
        if name == "float64":
            return self.vector_flops / 2.0
        return self._sixteen_bit()

    def _sixteen_bit(self) -> float:
        pf = self.peak_flops
        for key in ("bfloat16", "float16", "float32"):
            if key in pf:
                return pf[key]
        return max(pf.values())

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (clusters, and so devices, are saved inside plans)."""
        return {
            "name": self.name,
            "kind": self.kind,
            "peak_flops": dict(self.peak_flops),
            "hbm_bytes": self.hbm_bytes,
            "hbm_bandwidth": self.hbm_bandwidth,
            "source": self.source,
            "vector_flops": self.vector_flops,
            "efficiency": self.efficiency.to_json(),
            "jax_device_kinds": list(self.jax_device_kinds),
            "compiler": self.compiler,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> DeviceSpec:
        """Inverse of :meth:`to_json`."""
        try:
            return cls(
                name=str(data["name"]),
                kind=data["kind"],
                peak_flops=dict(data["peak_flops"]),
                hbm_bytes=int(data["hbm_bytes"]),
                hbm_bandwidth=float(data["hbm_bandwidth"]),
                source=str(data.get("source", "")),
                vector_flops=float(data.get("vector_flops", 0.0)),
                efficiency=Efficiency.from_json(data["efficiency"])
                if "efficiency" in data
                else DEFAULT_EFFICIENCY,
                jax_device_kinds=tuple(data.get("jax_device_kinds", ())),
                compiler=str(data.get("compiler", "")),
            )
        except KeyError as e:
            raise CostModelError(f"DeviceSpec JSON lacks the field {e.args[0]!r}") from None


_A100_SRC = (
    "NVIDIA A100 Tensor Core GPU datasheet (SXM): dense BF16/FP16 312, TF32 156, FP32 19.5, "
    "INT8 624 TFLOP/s/TOPS; "
)
_H100_SRC = (
    "NVIDIA H100 datasheet (SXM5): dense BF16/FP16 989.5, TF32 494.5, FP8/INT8 1979, "
    "FP32 67 TFLOP/s; "
)

# H100 SXM and H200 SXM share the Hopper tensor cores (dense, no sparsity): datasheets.
_HOPPER_PEAK_FLOPS: dict[str, float] = {
    "bfloat16": 989e12,
    "float16": 989e12,
    "tf32": 494.5e12,
    "float8": 1979e12,
    "int8": 1979e12,
}

_CATALOG: tuple[DeviceSpec, ...] = (
    DeviceSpec(
        name="a100-40gb",
        kind="gpu",
        peak_flops={"bfloat16": 312e12, "float16": 312e12, "tf32": 156e12, "int8": 624e12},
        hbm_bytes=40 * 10**9,
        hbm_bandwidth=1555e9,
        vector_flops=19.5e12,
        source=_A100_SRC + "40 GB HBM2 at 1555 GB/s",
        jax_device_kinds=("a100-sxm4-40gb", "a100-pcie-40gb", "a100 40gb"),
    ),
    DeviceSpec(
        name="a100-80gb",
        kind="gpu",
        peak_flops={"bfloat16": 312e12, "float16": 312e12, "tf32": 156e12, "int8": 624e12},
        hbm_bytes=80 * 10**9,
        hbm_bandwidth=2039e9,
        vector_flops=19.5e12,
        source=_A100_SRC + "80 GB HBM2e at 2039 GB/s (reference README)",
        jax_device_kinds=("a100-sxm4-80gb", "a100 80gb", "a100-sxm-80gb", "a100"),
    ),
    DeviceSpec(
        name="h100-sxm",
        kind="gpu",
        peak_flops=_HOPPER_PEAK_FLOPS,
        hbm_bytes=80 * 10**9,
        hbm_bandwidth=3350e9,
        vector_flops=67e12,
        source=_H100_SRC + "80 GB HBM3 at 3.35 TB/s (reference README)",
        jax_device_kinds=("h100",),
    ),
    DeviceSpec(
        name="h200-sxm",
        kind="gpu",
        peak_flops=_HOPPER_PEAK_FLOPS,
        hbm_bytes=141 * 10**9,
        hbm_bandwidth=4800e9,
        vector_flops=67e12,
        source="NVIDIA H200 datasheet (SXM): same tensor cores as H100 SXM; "
        "141 GB HBM3e at 4.8 TB/s (reference README)",
        jax_device_kinds=("h200",),
    ),
    DeviceSpec(
        name="tpu-v4",
        kind="tpu",
        peak_flops={"bfloat16": 275e12, "int8": 275e12},
        hbm_bytes=32 * 2**30,
        hbm_bandwidth=1200e9,
        source="Cloud TPU v4 docs (cloud.google.com/tpu/docs/v4): 275 TFLOP/s bf16 or int8 "
        "per chip, 32 GiB HBM2 at 1200 GBps; vector rate not published (MXU peak / 16)",
        jax_device_kinds=("tpu v4",),
    ),
    DeviceSpec(
        name="tpu-v5e",
        kind="tpu",
        peak_flops={"bfloat16": 197e12, "int8": 393e12},
        hbm_bytes=16 * 10**9,
        hbm_bandwidth=819e9,
        source="Cloud TPU v5e docs (cloud.google.com/tpu/docs/v5e): 197 TFLOP/s bf16, "
        "393 TOPS int8 per chip, 16 GB HBM2 at 819 GBps; vector rate not published",
        jax_device_kinds=("tpu v5 lite", "tpu v5e", "tpu v5litepod"),
    ),
    DeviceSpec(
        name="tpu-v5p",
        kind="tpu",
        peak_flops={"bfloat16": 459e12, "float8": 459e12},
        hbm_bytes=95 * 2**30,
        hbm_bandwidth=2765e9,
        source="Cloud TPU v5p docs (cloud.google.com/tpu/docs/v5p): 459 TFLOP/s bf16 and fp8 "
        "per chip, 95 GiB HBM2e at 2765 GBps; vector rate not published",
        jax_device_kinds=("tpu v5p", "tpu v5"),
    ),
    DeviceSpec(
        name="cpu-sim",
        kind="cpu",
        # A fictitious device: a DGX-A100-like balance slowed down 100x, so that plans made
        # on simulated CPU devices rank the way they would on A100s (compute : HBM : link
        # ratios match the a100-80gb / dgx-a100-80gb entries), with a small memory so that
        # memory limits bind for the toy models tests use.
        peak_flops={"bfloat16": 3.12e12, "float16": 3.12e12, "float32": 3.12e12},
        hbm_bytes=2 * 2**30,
        hbm_bandwidth=20.39e9,
        vector_flops=0.195e12,
        source="fictitious: a100-80gb speeds / 100 (same compute:memory:link balance), "
        "2 GiB memory so limits bind for toy models; not a real machine",
        jax_device_kinds=("cpu",),
    ),
)

DEVICES: Mapping[str, DeviceSpec] = {d.name: d for d in _CATALOG}


def get_device(name: str) -> DeviceSpec:
    """Look up a catalog device by name.

    Example:
        >>> get_device("tpu-v5p").hbm_bandwidth
        2765000000000.0
    """
    if name not in DEVICES:
        raise CostModelError(f"unknown device {name!r}; known devices: {', '.join(DEVICES)}")
    return DEVICES[name]


def device_for_jax_kind(device_kind: str, platform: str = "") -> DeviceSpec | None:
    """The catalog device whose ``jax_device_kinds`` match a ``jax.Device.device_kind``.

    Longer (more specific) patterns win, so "A100-SXM4-40GB" maps to a100-40gb rather than
    the generic "a100" pattern of a100-80gb. Returns ``None`` when nothing matches.

    Example:
        >>> device_for_jax_kind("NVIDIA A100-SXM4-40GB").name
        'a100-40gb'
    """
    kind = device_kind.lower()
    best: tuple[int, DeviceSpec] | None = None
    for dev in _CATALOG:
        for pattern in dev.jax_device_kinds:
            if pattern in kind and (best is None or len(pattern) > best[0]):
                best = (len(pattern), dev)
    if best is None and platform.lower() == "cpu":
        return DEVICES["cpu-sim"]
    return None if best is None else best[1]
