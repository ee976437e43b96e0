"""Compute time: a roofline with a matmul efficiency curve.

    time = max(flops / (peak(dtype) * eff), bytes / (hbm_bandwidth * memory_fraction))

For matmuls ``peak`` is the tensor-core / MXU peak of the dtype and ``eff`` the device's
matmul efficiency curve at ``shape_hint = (m, n, k)`` (see efficiency.py; without a hint
the matmul is assumed large and gets the curve's limit). Other kinds (elementwise,
reduction, other) run on the vector units at ``device.vector_flops`` and are nearly always
memory-bound. A calibration profile, or any :class:`Efficiency`, passed as ``profile``
replaces the device's curve.

Example:
    >>> from cost_models import get_device
    >>> h200 = get_device("h200-sxm")
    >>> f = 2 * 8192**3
    >>> round(f / compute_time(f, 3 * 8192**2 * 2, h200, shape_hint=(8192, 8192, 8192)) / 1e12)
    790
"""

from __future__ import annotations

from typing import Literal

from cost_models.devices import DeviceSpec, canonical_dtype
from cost_models.efficiency import Efficiency
from cost_models.errors import CostModelError, check_choice, check_positive

OpKind = Literal["matmul", "elementwise", "reduction", "other"]
OP_KINDS: tuple[str, ...] = ("matmul", "elementwise", "reduction", "other")

_DTYPE_BYTES = {
    "bfloat16": 2,
    "float16": 2,
    "float32": 4,
    "tf32": 4,
    "float64": 8,
    "int8": 1,
    "float8": 1,
}


def dtype_bytes(dtype: object) -> int:
    """Bytes per element of ``dtype``.

    Example:
        >>> dtype_bytes("bf16")
        2
    """
    return _DTYPE_BYTES[canonical_dtype(dtype)]


def efficiency_of(device: DeviceSpec, profile: object = None) -> Efficiency:
    """The efficiency to use: ``profile``'s if given (a Profile or an Efficiency), else the device's."""
    if profile is None:
        return device.efficiency
    if isinstance(profile, Efficiency):
        return profile
    eff = getattr(profile, "efficiency", None)
    if isinstance(eff, Efficiency):
        return eff
    raise CostModelError(
        f"profile must be None, an Efficiency or a calibration Profile; got {type(profile).__name__}"
    )


def compute_time(
    flops: float,
    bytes_accessed: float,
    device: DeviceSpec,
    dtype: str = "bfloat16",
    kind: OpKind = "matmul",
    shape_hint: tuple[int, int, int] | None = None,
    profile: object = None,
) -> float:
    """Seconds an op takes on one device, by the roofline above.

    Args:
        flops: floating-point operations (a multiply-add is 2).
        bytes_accessed: HBM bytes read + written.
        device: the device.
        dtype: operand dtype (selects the peak; see :meth:`DeviceSpec.flops_for`).
        kind: ``"matmul"``, ``"elementwise"``, ``"reduction"`` or ``"other"``.
        shape_hint: ``(m, n, k)`` of a matmul (batch dims folded into m), for the curve.
        profile: a calibration ``Profile`` or an ``Efficiency`` replacing the device's.

    Example:
        >>> from cost_models import get_device
        >>> a100 = get_device("a100-80gb")
        >>> t = compute_time(0, 2e9, a100, kind="elementwise")  # a 1 GB copy: read + write
        >>> round(t * 1e3, 3)
        1.115
    """
    check_positive("flops", flops, allow_zero=True)
    check_positive("bytes_accessed", bytes_accessed, allow_zero=True)
    check_choice("op kind", kind, OP_KINDS)
    eff = efficiency_of(device, profile)
    if kind == "matmul":
        peak = device.flops_for(dtype)
        if shape_hint is None:
            frac = eff.peak_fraction
        else:
            if len(shape_hint) != 3:
                raise CostModelError(f"shape_hint must be (m, n, k); got {shape_hint!r}")
            frac = eff.matmul(*shape_hint)
        compute_s = flops / (peak * frac)
    else:
        canonical_dtype(dtype)  # validate the name even though vector_flops ignores it
        compute_s = flops / device.vector_flops
    memory_s = bytes_accessed / (device.hbm_bandwidth * eff.memory_fraction)
    return max(compute_s, memory_s)


def matmul_time(
    m: int,
    n: int,
    k: int,
    device: DeviceSpec,
    dtype: str = "bfloat16",
    *,
    batch: int = 1,
    profile: object = None,
) -> float:
    """Seconds for ``batch`` matmuls of (m x k) @ (k x n), operands and result in ``dtype``.

    Example:
        >>> from cost_models import get_device
        >>> t = matmul_time(8192, 8192, 8192, get_device("h200-sxm"))
        >>> round(2 * 8192**3 / t / 1e12)
        790
    """
    flops = 2.0 * batch * m * n * k
    nbytes = float(batch * (m * k + k * n + m * n) * dtype_bytes(dtype))
    return compute_time(flops, nbytes, device, dtype, "matmul", (batch * m, n, k), profile)
