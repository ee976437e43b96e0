"""Run every benchmark script in turn and print their tables: ``python -m benchmarks``.

Each benchmark is also runnable alone: ``python -m benchmarks.bench_trace`` etc.
"""

from __future__ import annotations

import importlib
import pkgutil
import subprocess
import sys

import benchmarks


def main() -> int:
    names = sorted(
        m.name for m in pkgutil.iter_modules(benchmarks.__path__) if m.name.startswith("bench_")
    )
    failed = []
    for name in names:
        print(f"\n=== benchmarks.{name} ===", flush=True)
        # A fresh process each: several benchmarks time tracing/compiling from a cold start.
        rc = subprocess.call([sys.executable, "-m", f"benchmarks.{name}"])
        if rc:
            failed.append(name)
    if failed:
        print(f"failed: {failed}")
    return 1 if failed else 0


if __name__ == "__main__":
    importlib.invalidate_caches()
    sys.exit(main())
