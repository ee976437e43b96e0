"""Measure this machine and write a calibration profile: ``python -m cost_models.calibrate``.

Microbenchmarks on the current JAX backend (jax is imported inside the functions only):

* matmuls over a range of shapes (square and skinny) -> the matmul efficiency curve;
* a large elementwise update (read + write) -> achievable HBM bandwidth;
* all-reduce and all-gather over all local devices (``jax.shard_map`` with ``psum`` /
  ``all_gather``) -> bus bandwidth and an α-β fit of the local link.

The result goes to ``cost_models/profiles/<device kind>-<jax version>.json`` (or ``--out``),
written atomically. ``--quick`` uses small sizes and finishes in well under a minute on a
CPU. ``--host-devices N`` simulates N CPU devices (sets XLA_FLAGS before jax starts), so
the collective benchmarks have a group to run over.

Example:
    $ python -m cost_models.calibrate --quick --out /tmp/profiles
"""

from __future__ import annotations

import argparse
import datetime as _dt
import math
import os
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from cost_models.devices import DeviceSpec, device_for_jax_kind
from cost_models.errors import CostModelError
from cost_models.profile import (
    CollectiveSample,
    MatmulSample,
    Profile,
    fit_matmul_efficiency,
    load_profile,
    save_profile,
)

__all__ = ["Profile", "calibrate", "calibrate_to_file", "load_profile", "main"]

_QUICK_MATMULS = (
    (64, 64, 64),
    (128, 128, 128),
    (256, 256, 256),
    (512, 512, 512),
    (512, 512, 64),
    (1024, 256, 256),
)
_FULL_MATMULS = tuple((d, d, d) for d in (256, 512, 1024, 2048, 4096, 8192)) + (
    (8192, 8192, 128),
    (8192, 128, 8192),
    (4096, 4096, 512),
    (16384, 1024, 4096),
)


def _time(fn: Callable[[], Any], repeats: int) -> float:
    """Median seconds of ``fn()`` (blocking on its result), after one warm-up call."""
    import jax

    jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


# Products (or passes) timed per compiled call. One dispatched call from Python costs
# about 0.1-0.2 ms on a GPU host: on one H200 (2026-12-04), a call of one product timed
# 0.10-0.13 ms for every square size up to 2048^3 (launches, not matmuls), and the fit
# read a half-efficiency dimension of 4096 from them; 8 products a call still timed
# 0.025-0.03 ms each up to 1024^3 (half_dim 3444). In a step, the products run inside
# one program, so a call here holds at least _PER_CALL of them, and more for small ones:
# enough for _CALL_S seconds at the device's peak, at most _MAX_PER_CALL products and
# _CALL_BYTES of operands and results.
_PER_CALL = 8
_MAX_PER_CALL = 512
_CALL_S = 2e-3
_CALL_BYTES = 4 * 2**30


def products_per_call(m: int, n: int, k: int, itemsize: int, peak_flops: float, cap: int) -> int:
    """How many ``(m x k) @ (k x n)`` products one timed call runs: enough for
    :data:`_CALL_S` at ``peak_flops``, between :data:`_PER_CALL` and ``cap``, within
    :data:`_CALL_BYTES`.

    Example:
        >>> products_per_call(8192, 8192, 8192, 2, 989e12, 512)   # 1.1 TFLOP each
        8
        >>> products_per_call(1024, 1024, 1024, 2, 989e12, 512)   # 2.1 GFLOP, 6 MiB each
        512
        >>> products_per_call(8192, 8192, 128, 2, 989e12, 512)    # 132 MiB each
        31
    """
    by_time = math.ceil(_CALL_S * peak_flops / (2.0 * m * n * k))
    by_bytes = _CALL_BYTES // ((m * k + k * n + m * n) * itemsize)
    return int(max(1, min(cap, by_bytes, max(_PER_CALL, by_time))))


def bench_matmuls(
    shapes: Sequence[tuple[int, int, int]],
    dtype: str,
    repeats: int,
    peak_flops: float = 0.0,
    max_per_call: int = _PER_CALL,
) -> list[MatmulSample]:
    """Time ``(m x k) @ (k x n)`` for each shape: several products of distinct operands
    in one compiled call (nothing for the compiler to share or merge; how many:
    :func:`products_per_call`, at most ``max_per_call``), the call's median seconds over
    ``repeats`` divided by their number.

    Example:
        >>> [s.seconds > 0 for s in bench_matmuls([(64, 32, 16)], "float32", 2)]
        [True]
    """
    import jax
    import jax.numpy as jnp

    out = []
    f = jax.jit(lambda pairs: [a @ b for a, b in pairs])
    itemsize = jnp.dtype(dtype).itemsize
    for m, n, k in shapes:
        count = products_per_call(m, n, k, itemsize, peak_flops, max_per_call)
        # constant operands: the values do not change the time, and building them costs no
        # compilation (random.normal would compile once per shape); distinct buffers
        pairs = [
            (jnp.full((m, k), 0.5, dtype=dtype), jnp.full((k, n), 0.5, dtype=dtype))
            for _ in range(count)
        ]
        secs = _time(lambda pairs=pairs: f(pairs), repeats) / count
        out.append(MatmulSample(m, n, k, dtype, secs))
    return out


def bench_hbm(nbytes: int, repeats: int, per_call: int = _PER_CALL) -> float:
    """Bytes/s of ``x + 1`` over an ``nbytes`` float32 buffer (counts one read and one
    write), ``per_call`` dependent passes in one compiled loop (each behind an
    optimization barrier: passes fused into one would read and write once)."""
    import jax
    import jax.numpy as jnp

    def passes(x: Any) -> Any:
        return jax.lax.fori_loop(0, per_call, lambda _, y: jax.lax.optimization_barrier(y + 1.0), x)

    x = jnp.zeros((nbytes // 4,), jnp.float32)
    f = jax.jit(passes)
    secs = _time(lambda: f(x), repeats) / per_call
    return 2.0 * nbytes / secs


def bench_collectives(sizes: Sequence[int], repeats: int) -> list[CollectiveSample]:
    """Time all-reduce and all-gather over all local devices for per-device buffer sizes."""
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    devs = jax.devices()
    n = len(devs)
    if n < 2:
        return []
    mesh = Mesh(np.array(devs), ("x",))
    sharding = NamedSharding(mesh, P("x"))
    all_reduce = jax.jit(
        jax.shard_map(lambda x: jax.lax.psum(x, "x"), mesh=mesh, in_specs=P("x"), out_specs=P("x"))
    )
    all_gather = jax.jit(
        jax.shard_map(
            lambda x: jax.lax.all_gather(x, "x", tiled=True),
            mesh=mesh,
            in_specs=P("x"),
            out_specs=P("x"),
        )
    )
    out = []
    for nbytes in sizes:
        elems = max(1, nbytes // 4)
        x = jax.device_put(np.ones((n * elems,), np.float32), sharding)
        t = _time(lambda x=x: all_reduce(x), repeats)
        out.append(CollectiveSample("all-reduce", elems * 4.0, n, t))
        t = _time(lambda x=x: all_gather(x), repeats)
        out.append(CollectiveSample("all-gather", n * elems * 4.0, n, t))  # full output
    return out


def calibrate(quick: bool = False) -> Profile:
    """Run the microbenchmarks on the current backend and fit a :class:`Profile`.

    Example:
        >>> p = calibrate(quick=True)  # here: the 8 simulated CPU devices of the tests
        >>> p.platform, p.num_devices, p.catalog_device
        ('cpu', 8, 'cpu-sim')
    """
    import jax

    dev = jax.devices()[0]
    spec: DeviceSpec | None = device_for_jax_kind(dev.device_kind, dev.platform)
    if spec is None:
        raise CostModelError(
            f"device kind {dev.device_kind!r} is not in the catalog; add a DeviceSpec first"
        )
    dtype = "float32" if dev.platform == "cpu" else "bfloat16"
    repeats = 3 if quick else 10
    shapes = _QUICK_MATMULS if quick else _FULL_MATMULS
    cap = _PER_CALL if quick else _MAX_PER_CALL
    matmuls = bench_matmuls(shapes, dtype, repeats, spec.flops_for(dtype), cap)
    hbm = bench_hbm((32 if quick else 2048) * 2**20, repeats)
    sizes = (2**16, 2**20) if quick else (2**16, 2**20, 2**24, 2**27)
    collectives = bench_collectives(sizes, repeats)
    eff = fit_matmul_efficiency(
        matmuls,
        spec.flops_for(dtype),
        memory_fraction=hbm / spec.hbm_bandwidth,
        source=f"calibration of {dev.device_kind} relative to catalog {spec.name}",
    )
    return Profile(
        device_kind=dev.device_kind,
        platform=dev.platform,
        jax_version=jax.__version__,
        date=_dt.date.today().isoformat(),
        num_devices=len(jax.devices()),
        matmul=tuple(matmuls),
        hbm_bandwidth=hbm,
        collectives=tuple(collectives),
        efficiency=eff,
        catalog_device=spec.name,
    )


def calibrate_to_file(
    quick: bool = False, out: str | os.PathLike[str] | None = None, *, show: bool = True
) -> Path:
    """Run :func:`calibrate`, save the profile atomically, print a summary; return its path.

    Example:
        >>> path = calibrate_to_file(quick=True, out=tmp_dir, show=False)
        >>> path.parent == tmp_dir, path.name  # <platform>-<jax version>.json
        (True, 'cpu-0.10....json')
    """
    profile = calibrate(quick=quick)
    path = save_profile(profile, out)
    if show:
        _print_summary(profile, path)
    return path


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point (``python -m cost_models.calibrate``); returns the exit status 0."""
    parser = argparse.ArgumentParser(
        prog="python -m cost_models.calibrate", description=__doc__.split("\n")[0]
    )
    parser.add_argument(
        "--out", default=None, help="directory for the profile (default: cost_models/profiles)"
    )
    parser.add_argument("--quick", action="store_true", help="small sizes; < 60 s on a CPU")
    parser.add_argument(
        "--host-devices",
        type=int,
        default=None,
        help="simulate N CPU devices (XLA_FLAGS) for collectives",
    )
    args = parser.parse_args(argv)
    if args.host_devices:
        # Must happen before jax initialises its backends; calibrate() imports jax lazily.
        flags = os.environ.get("XLA_FLAGS", "")
        if "xla_force_host_platform_device_count" not in flags:
            os.environ["XLA_FLAGS"] = (
                f"{flags} --xla_force_host_platform_device_count={args.host_devices}".strip()
            )
    calibrate_to_file(quick=args.quick, out=args.out)
    return 0


def _print_summary(profile: Profile, path: Path) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    table = Table(title=f"{profile.device_kind} ({profile.platform}, jax {profile.jax_version})")
    table.add_column("benchmark")
    table.add_column("shape / bytes", justify="right")
    table.add_column("time", justify="right")
    table.add_column("rate", justify="right")
    for s in profile.matmul:
        table.add_row(
            f"matmul {s.dtype}",
            f"{s.m}x{s.n}x{s.k}",
            f"{s.seconds * 1e3:.3f} ms",
            f"{s.flops_per_s / 1e12:.3f} TFLOP/s",
        )
    table.add_row("hbm copy", "", "", f"{profile.hbm_bandwidth / 1e9:.1f} GB/s")
    for c in profile.collectives:
        table.add_row(
            f"{c.kind} x{c.num_devices}",
            f"{c.nbytes / 2**20:.2f} MiB",
            f"{c.seconds * 1e3:.3f} ms",
            f"{c.bus_bandwidth / 1e9:.2f} GB/s bus",
        )
    console.print(table)
    e = profile.efficiency
    console.print(
        f"fit vs {profile.catalog_device}: peak_fraction={e.peak_fraction:.4f} half_dim={e.half_dim:.1f} "
        f"memory_fraction={e.memory_fraction:.4f}"
    )
    console.print(f"wrote {path}")


if __name__ == "__main__":
    raise SystemExit(main())
