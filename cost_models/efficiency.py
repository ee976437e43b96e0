"""How much of a device's peak a kernel reaches: the matmul efficiency curve and HBM efficiency.

One default curve serves every device (calibration profiles replace it per device):

    eff(m, n, k) = peak_fraction * m/(m + d0) * n/(n + d0) * k/(k + d0)

Each factor ``d/(d + d0)`` says that a dimension much smaller than ``d0`` leaves the tensor
cores underfed (tile and wave quantisation, too little reuse per loaded tile); a large
dimension costs nothing. ``d0 = 64`` is the size where a dimension halves throughput, a
typical tensor-core tile edge. ``peak_fraction`` is set so that an 8192^3 bf16 matmul on an
H200 reaches the measured 790 TFLOP/s of 989 (reference README), i.e. eff(8192^3) = 0.799.

The memory-bound side of the roofline divides bytes by ``hbm_bandwidth * memory_fraction``:
streaming kernels reach about 88% of the datasheet HBM bandwidth (A100 80GB: 1.80 of 2.04
TB/s measured with a read kernel and confirmed by Nsight Compute; the same thread cites an
NVIDIA GTC talk where the best kernel reached ~90%:
https://forums.developer.nvidia.com/t/trouble-to-reach-peak-bandwidth-of-a100/339083).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from cost_models.errors import CostModelError, check_positive

# Source: reference README, "Measured H200 bf16 8192^3 matmul: ~790 TFLOP/s" of 989 peak.
_H200_MEASURED_FRACTION = 790.0 / 989.0
DEFAULT_HALF_DIM = 64.0  # a tensor-core tile edge (see module docstring)
# Solve peak_fraction * (8192 / (8192 + 64))**3 = 790 / 989.
DEFAULT_PEAK_FRACTION = _H200_MEASURED_FRACTION / (8192.0 / (8192.0 + DEFAULT_HALF_DIM)) ** 3
# Source: NVIDIA developer forum thread in the module docstring (1.80 / 2.04 TB/s on A100).
DEFAULT_MEMORY_FRACTION = 0.88


@dataclass(frozen=True)
class Efficiency:
    """Achievable fractions of peak: a matmul curve and a streaming-memory fraction.

    Attributes:
        peak_fraction: matmul efficiency reached by a very large matmul (the curve's limit).
        half_dim: the dimension size at which one dimension halves matmul efficiency.
        memory_fraction: fraction of datasheet HBM bandwidth a streaming kernel reaches.
        source: where the numbers come from.

    Example:
        >>> eff = Efficiency()
        >>> round(eff.matmul(8192, 8192, 8192), 3)
        0.799
    """

    peak_fraction: float = DEFAULT_PEAK_FRACTION
    half_dim: float = DEFAULT_HALF_DIM
    memory_fraction: float = DEFAULT_MEMORY_FRACTION
    source: str = (
        "default curve: H200 bf16 8192^3 matmul 790/989 TFLOP/s (reference README), "
        "half-efficiency dimension 64; HBM 88% of datasheet (A100 1.80/2.04 TB/s, NVIDIA forum)"
    )

    def __post_init__(self) -> None:
        check_positive("Efficiency.peak_fraction", self.peak_fraction)
        check_positive("Efficiency.half_dim", self.half_dim, allow_zero=True)
        check_positive("Efficiency.memory_fraction", self.memory_fraction)
        if self.peak_fraction > 1.0 or self.memory_fraction > 1.0:
            raise CostModelError(
                "Efficiency fractions must be <= 1; got "
                f"peak_fraction={self.peak_fraction!r}, memory_fraction={self.memory_fraction!r}"
            )

    def matmul(self, m: float, n: float, k: float) -> float:
        """Fraction of peak FLOP/s a (m x k) @ (k x n) matmul reaches.

        Example:
            >>> Efficiency(peak_fraction=0.5, half_dim=0.0).matmul(16, 16, 16)
            0.5
        """
        for name, d in (("m", m), ("n", n), ("k", k)):
            check_positive(f"matmul dimension {name}", d)
        d0 = self.half_dim
        return self.peak_fraction * (m / (m + d0)) * (n / (n + d0)) * (k / (k + d0))

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (see :meth:`from_json`)."""
        return {
            "peak_fraction": self.peak_fraction,
            "half_dim": self.half_dim,
            "memory_fraction": self.memory_fraction,
            "source": self.source,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Efficiency:
        """Inverse of :meth:`to_json`."""
        try:
            return cls(
                peak_fraction=float(data["peak_fraction"]),
                half_dim=float(data["half_dim"]),
                memory_fraction=float(data["memory_fraction"]),
                source=str(data.get("source", "")),
            )
        except KeyError as e:
            raise CostModelError(f"Efficiency JSON lacks the field {e.args[0]!r}") from None


DEFAULT_EFFICIENCY = Efficiency()
