"""Trace-time benchmark: how long ``autopar.trace`` takes and how much memory it needs.

Each case runs in a fresh Python process (JAX caches traces, so a second trace in the same
process is not a measurement), with abstract arguments (nothing allocated). The time is the
first ``trace()`` call only (imports and argument building excluded), as wall time and as
the process's CPU time (the latter is what to compare on a shared, loaded machine); RSS is
the child's peak resident set size, imports included.

Usage::

    python benchmarks/bench_trace.py                 # all cases, prints a table
    python benchmarks/bench_trace.py gpt3-175b-scan  # chosen cases
    python benchmarks/bench_trace.py --one gpt2-small-scan   # one case, JSON (used by tests)
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def _gpt(preset: str, scan: bool, batch: int) -> Callable[[], tuple[Any, Any]]:
    def make():
        from benchmarks.models.gpt import GPTConfig, make_train_step

        return make_train_step(GPTConfig.preset(preset, scan_layers=scan), batch)

    return make


def _moe(preset: str, scan: bool, batch: int) -> Callable[[], tuple[Any, Any]]:
    def make():
        from benchmarks.models.moe import MoEConfig, make_train_step

        return make_train_step(MoEConfig.preset(preset, scan_layers=scan), batch)

    return make


def _wrn(preset: str, batch: int) -> Callable[[], tuple[Any, Any]]:
    def make():
        from benchmarks.models.wide_resnet import WideResNetConfig, make_train_step

        return make_train_step(WideResNetConfig.preset(preset), batch)

    return make


def _mlp(preset: str, batch: int) -> Callable[[], tuple[Any, Any]]:
    def make():
        from benchmarks.models.mlp import MLPConfig, make_train_step

        return make_train_step(MLPConfig.preset(preset), batch)

    return make


# name -> (model, scan, builder)
CASES: dict[str, tuple[str, str, Callable[[], tuple[Any, Any]]]] = {
    "gpt2-small-scan": ("gpt2-small b8", "yes", _gpt("gpt2-small", True, 8)),
    "gpt2-small": ("gpt2-small b8", "no", _gpt("gpt2-small", False, 8)),
    "gpt3-175b-scan": ("gpt3-175b b1536", "yes", _gpt("gpt3-175b", True, 1536)),
    "moe-tiny": ("moe tiny b8", "no", _moe("tiny", False, 8)),
    "wrn-50-2": ("wrn-50-2 b32", "no", _wrn("wrn-50-2", 32)),
    "mlp-1b": ("mlp-1b b64", "no", _mlp("mlp-1b", 64)),
}


def run_one(name: str) -> dict[str, Any]:
    """Trace one case in this process; returns the measurements."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    from autopar.trace import trace

    step, args = CASES[name][2]()
    t0, c0 = time.perf_counter(), time.process_time()
    graph = trace(step, *args)
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {
        "case": name,
        "nodes": len(graph),
        "layers": len(graph.layers),
        "flops": graph.total_flops,
        "params": graph.parameter_count,
        "seconds": seconds,
        "cpu_seconds": cpu,
        "rss_mb": rss_mb,
    }


def run_in_subprocess(name: str, timeout: float = 600) -> dict[str, Any]:
    """Run :func:`run_one` in a fresh interpreter; returns its JSON."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    out = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), "--one", name],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=str(ROOT),
        check=False,
    )
    if out.returncode != 0:
        raise RuntimeError(f"{name} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str]) -> None:
    if argv[:1] == ["--one"]:
        print(json.dumps(run_one(argv[1])))
        return
    names = argv or list(CASES)
    unknown = [n for n in names if n not in CASES]
    if unknown:
        raise SystemExit(f"unknown cases {unknown}; known: {list(CASES)}")
    header = f"{'model':<18} {'scan':<5} {'nodes':>7} {'layers':>6} {'total FLOPs':>12} {'trace s':>8} {'cpu s':>6} {'RSS MB':>8}"
    print(header)
    print("-" * len(header))
    for name in names:
        r = run_in_subprocess(name)
        model, scan, _ = CASES[name]
        print(
            f"{model:<18} {scan:<5} {r['nodes']:>7} {r['layers']:>6} {r['flops']:>12.4g} "
            f"{r['seconds']:>8.2f} {r['cpu_seconds']:>6.2f} {r['rss_mb']:>8.0f}",
            flush=True,
        )


if __name__ == "__main__":
    main(sys.argv[1:])
