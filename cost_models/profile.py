"""Calibration profiles: measured timings of one device kind, and what we fit from them.

A profile is a JSON file ``cost_models/profiles/<device kind>-<jax version>.json`` written
by ``python -m cost_models.calibrate``. It holds the raw measurements (matmuls, a streaming
copy, collectives over the local devices) and the fitted :class:`Efficiency`: the matmul
curve's ``peak_fraction`` and ``half_dim`` (least squares on log efficiency) and the HBM
``memory_fraction``. :meth:`Cluster.local` applies a matching profile; this module has no
jax dependency.

Example:
    >>> samples = [MatmulSample(d, d, d, "bfloat16", 2 * d**3 / (0.5 * 1e12 * d / (d + 100)))
    ...            for d in (128, 512, 2048, 8192)]
    >>> eff = fit_matmul_efficiency(samples, peak_flops=1e12)
    >>> round(eff.matmul(1000, 1000, 1000) * (1 + 100 / 1000), 2)  # recovers d/(d+100) shape
    0.5
"""

from __future__ import annotations

import json
import math
import os
import re
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from cost_models.efficiency import DEFAULT_EFFICIENCY, Efficiency
from cost_models.errors import CostModelError

PROFILE_DIR = Path(__file__).parent / "profiles"
PROFILE_SCHEMA = 1


@dataclass(frozen=True)
class MatmulSample:
    """One timed matmul: (m x k) @ (k x n) in ``dtype`` took ``seconds``."""

    m: int
    n: int
    k: int
    dtype: str
    seconds: float

    @property
    def flops_per_s(self) -> float:
        """2 m n k / seconds."""
        return 2.0 * self.m * self.n * self.k / self.seconds


@dataclass(frozen=True)
class CollectiveSample:
    """One timed collective over ``num_devices`` local devices (nbytes: collectives.py convention)."""

    kind: str
    nbytes: float
    num_devices: int
    seconds: float

    @property
    def bus_bandwidth(self) -> float:
        """NCCL-style bus bandwidth: bytes a ring moves per device per second."""
        n = self.num_devices
        factor = 2.0 * (n - 1) / n if self.kind == "all-reduce" else (n - 1) / n
        return factor * self.nbytes / self.seconds


@dataclass(frozen=True)
class Profile:
    """Measurements of one device kind under one JAX version, and the fitted efficiency.

    Attributes:
        device_kind: ``jax.Device.device_kind`` (e.g. ``"NVIDIA H200"``, ``"cpu"``).
        platform: ``"gpu"``, ``"tpu"`` or ``"cpu"``.
        jax_version: the JAX version measured under.
        date: ISO date of the measurement.
        num_devices: local devices seen (collectives ran over all of them).
        matmul: timed matmuls.
        hbm_bandwidth: measured streaming bandwidth, bytes/s.
        collectives: timed collectives.
        efficiency: the fit (matmul curve, memory fraction) relative to ``catalog_device``.
        catalog_device: the catalog entry the fit is relative to.
    """

    device_kind: str
    platform: str
    jax_version: str
    date: str
    num_devices: int
    matmul: tuple[MatmulSample, ...]
    hbm_bandwidth: float
    collectives: tuple[CollectiveSample, ...] = ()
    efficiency: Efficiency = DEFAULT_EFFICIENCY
    catalog_device: str = ""

    def to_json(self) -> dict[str, Any]:
        """The profile file's content."""
        return {
            "schema": PROFILE_SCHEMA,
            "device_kind": self.device_kind,
            "platform": self.platform,
            "jax_version": self.jax_version,
            "date": self.date,
            "num_devices": self.num_devices,
            "catalog_device": self.catalog_device,
            "matmul": [
                {
                    "m": s.m,
                    "n": s.n,
                    "k": s.k,
                    "dtype": s.dtype,
                    "seconds": s.seconds,
                    "flops_per_s": s.flops_per_s,
                }
                for s in self.matmul
            ],
            "hbm_bandwidth": self.hbm_bandwidth,
            "collectives": [
                {
                    "kind": c.kind,
                    "nbytes": c.nbytes,
                    "num_devices": c.num_devices,
                    "seconds": c.seconds,
                    "bus_bandwidth": c.bus_bandwidth,
                }
                for c in self.collectives
            ],
            "fit": self.efficiency.to_json(),
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Profile:
        """Inverse of :meth:`to_json`."""
        try:
            return cls(
                device_kind=str(data["device_kind"]),
                platform=str(data["platform"]),
                jax_version=str(data["jax_version"]),
                date=str(data["date"]),
                num_devices=int(data["num_devices"]),
                matmul=tuple(
                    MatmulSample(
                        int(s["m"]), int(s["n"]), int(s["k"]), str(s["dtype"]), float(s["seconds"])
                    )
                    for s in data["matmul"]
                ),
                hbm_bandwidth=float(data["hbm_bandwidth"]),
                collectives=tuple(
                    CollectiveSample(
                        str(c["kind"]),
                        float(c["nbytes"]),
                        int(c["num_devices"]),
                        float(c["seconds"]),
                    )
                    for c in data.get("collectives", ())
                ),
                efficiency=Efficiency.from_json(data["fit"])
                if "fit" in data
                else DEFAULT_EFFICIENCY,
                catalog_device=str(data.get("catalog_device", "")),
            )
        except (KeyError, TypeError) as e:
            raise CostModelError(f"malformed calibration profile: {e!r}") from None


def profile_filename(device_kind: str, jax_version: str) -> str:
    """``<device kind, lowercase, [a-z0-9.] kept>-<jax version>.json``.

    Example:
        >>> profile_filename("NVIDIA H200", "0.10.2")
        'nvidia-h200-0.10.2.json'
    """
    return f"{_slug(device_kind)}-{jax_version}.json"


def _slug(device_kind: str) -> str:
    return re.sub(r"[^a-z0-9.]+", "-", device_kind.lower()).strip("-") or "unknown"


def save_profile(profile: Profile, directory: str | os.PathLike[str] | None = None) -> Path:
    """Write ``profile`` atomically (temporary file + ``os.replace``); return its path.

    Example:
        >>> import tempfile
        >>> p = Profile("cpu", "cpu", "0.10.2", "2025-01-01", 1, (), 1e10)
        >>> save_profile(p, tempfile.mkdtemp()).name
        'cpu-0.10.2.json'
    """
    out_dir = Path(PROFILE_DIR if directory is None else directory)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / profile_filename(profile.device_kind, profile.jax_version)
    fd, tmp = tempfile.mkstemp(prefix=".profile-", suffix=".json", dir=out_dir)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(profile.to_json(), f, indent=1, sort_keys=True)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


def load_profile(
    device_kind: str,
    jax_version: str | None = None,
    directory: str | os.PathLike[str] | None = None,
) -> Profile | None:
    """The profile for ``device_kind`` (exact JAX version if given, else the newest), or None.

    Example:
        >>> load_profile("a device nobody calibrated") is None
        True
    """
    d = Path(PROFILE_DIR if directory is None else directory)
    if not d.is_dir():
        return None
    prefix = _slug(device_kind) + "-"
    found: list[tuple[tuple[int, ...], Path]] = []
    for path in d.glob(prefix + "*.json"):
        version = path.name[len(prefix) : -len(".json")]
        if not re.fullmatch(r"[0-9][0-9.]*[0-9a-z.]*", version):
            continue  # another kind whose slug starts with ours ("tpu-v5" vs "tpu-v5-lite")
        if jax_version is not None and version != jax_version:
            continue
        found.append((_version_key(version), path))
    if not found:
        return None
    _, path = max(found)
    with open(path) as f:
        return Profile.from_json(json.load(f))


def _version_key(version: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", version))


def fit_matmul_efficiency(
    samples: Sequence[MatmulSample],
    peak_flops: float,
    *,
    memory_fraction: float = DEFAULT_EFFICIENCY.memory_fraction,
    source: str = "calibration fit",
) -> Efficiency:
    """Fit the matmul curve ``pf * prod d/(d + d0)`` to measured matmuls (log least squares).

    For each candidate ``d0`` on a log grid (0 and 1 .. 4096) the best ``pf`` is closed-form
    (mean of log residuals); the ``d0`` with the smallest squared log error wins. ``pf``
    is capped at 1.

    Args:
        samples: timed matmuls (at least one).
        peak_flops: the device's peak for the samples' dtype.
        memory_fraction: carried into the returned :class:`Efficiency`.
        source: text for the returned efficiency's ``source``.

    Example:
        >>> s = [MatmulSample(64, 64, 64, "float32", 2 * 64**3 / 1e9)]
        >>> round(fit_matmul_efficiency(s, 2e9).peak_fraction, 3)  # one point: d0 = 0 fits
        0.5
    """
    if not samples:
        raise CostModelError("fit_matmul_efficiency needs at least one matmul sample")
    if peak_flops <= 0:
        raise CostModelError(f"peak_flops must be > 0; got {peak_flops!r}")
    grid = [0.0] + [2.0 ** (i / 4.0) for i in range(0, 49)]  # 1 .. 4096
    logs = [math.log(s.flops_per_s / peak_flops) for s in samples]
    best: tuple[float, float, float] | None = None
    for d0 in grid:
        shape = [
            math.log((s.m / (s.m + d0)) * (s.n / (s.n + d0)) * (s.k / (s.k + d0))) for s in samples
        ]
        log_pf = sum(y - x for y, x in zip(logs, shape, strict=True)) / len(samples)
        err = sum((y - x - log_pf) ** 2 for y, x in zip(logs, shape, strict=True))
        if best is None or err < best[0] - 1e-12:
            best = (err, d0, log_pf)
    assert best is not None
    _, d0, log_pf = best
    return Efficiency(
        peak_fraction=min(1.0, math.exp(log_pf)),
        half_dim=d0,
        memory_fraction=min(1.0, max(memory_fraction, 1e-6)),
        source=source,
    )


def fit_alpha_beta(samples: Sequence[CollectiveSample]) -> tuple[float, float] | None:
    """Fit ring all-reduce samples to ``2(n-1)/n B/bw + 2(n-1) alpha``: return (bw, alpha).

    Ordinary least squares of seconds on nbytes; None without two distinct sizes.

    Example:
        >>> # n = 2: t = B/bw + 2 alpha, so 1 GB/s and 2 us of intercept -> alpha = 1 us
        >>> s = [CollectiveSample("all-reduce", b, 2, b / 1e9 + 2e-6) for b in (1e6, 1e7)]
        >>> bw, alpha = fit_alpha_beta(s)
        >>> round(bw / 1e9, 3), round(alpha * 1e6, 3)
        (1.0, 1.0)
    """
    ar = [s for s in samples if s.kind == "all-reduce" and s.num_devices > 1]
    if len({s.nbytes for s in ar}) < 2:
        return None
    n = ar[0].num_devices
    xs = [s.nbytes for s in ar]
    ys = [s.seconds for s in ar]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx
    intercept = my - slope * mx
    if slope <= 0:
        return None
    bw = 2.0 * (n - 1) / n / slope
    alpha = max(intercept, 0.0) / (2.0 * (n - 1))
    return bw, alpha


def apply_profile(cluster: Any, profile: Profile) -> Any:
    """A copy of ``cluster`` using the profile's fitted efficiency and measured local links.

    The device's :class:`Efficiency` becomes the profile's fit; when the profile timed
    all-reduces over several devices, the intra-node link's bandwidth and latency become the
    α-β fit. ``cpu-sim`` clusters are returned unchanged: that device is fictitious on
    purpose (simulated CPU devices share the host's cores, so their timings say nothing
    about plans), and a CPU profile is kept for the record only.

    Example:
        >>> from cost_models import Cluster
        >>> c = Cluster.preset("cpu-sim")
        >>> apply_profile(c, Profile("cpu", "cpu", "0", "", 1, (), 1.0)) is c
        True
    """
    if cluster.device.kind == "cpu":
        return cluster
    device = replace(cluster.device, efficiency=profile.efficiency)
    new = replace(cluster, device=device)
    fit = fit_alpha_beta(profile.collectives)
    if fit is not None:
        bw, alpha = fit
        intra = replace(
            cluster.intra,
            bandwidth=bw,
            latency=alpha,
            source=f"calibration {profile.date} ({profile.jax_version}): all-reduce α-β fit",
        )
        inter = intra if cluster.inter == cluster.intra else cluster.inter
        new = replace(new, intra=intra, inter=inter)
    return new
