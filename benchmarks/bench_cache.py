"""Plan cache across processes: the second process with the same step skips the search.

Runs two fresh Python processes that each plan the same GPT step through
``@autoparallel`` with a shared cache directory, and prints their planning times.

    .venv/bin/python -m benchmarks.bench_cache [--preset gpt2-small]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile

CHILD = r"""
import json, os, sys, time
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
import autopar
from benchmarks.models import gpt
preset, cache = sys.argv[1], sys.argv[2]
step, args = gpt.make_train_step(gpt.GPTConfig.preset(preset, precision="fp32"), 8, abstract=True)
f = autopar.autoparallel(step, cluster="dgx-a100-80gb",
                         options=autopar.SearchOptions(mesh={"data": 2, "tensor": 4}), cache=cache)
t0 = time.perf_counter()
graph = f.graph_for(*args)
t = dict(f.last_timings)
print(json.dumps({"total_s": time.perf_counter() - t0, **t}))
"""


def run_child(preset: str, cache: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", CHILD, preset, cache], capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="tiny")
    a = p.parse_args(argv)
    from rich.table import Table

    from autopar.report.text import render

    with tempfile.TemporaryDirectory() as cache:
        rows = [run_child(a.preset, cache), run_child(a.preset, cache)]
    t = Table(title=f"Plan cache across processes (GPT {a.preset}, mesh data=2,tensor=4)")
    for c in ("process", "cache hit", "trace s", "plan s (search or cache read)", "lower s"):
        t.add_column(c, justify="right")
    for i, r in enumerate(rows):
        t.add_row(
            str(i + 1),
            str(bool(r.get("cache_hit"))),
            f"{r['trace_s']:.3f}",
            f"{r['plan_s']:.3f}",
            f"{r['lower_s']:.3f}",
        )
    print(render(t))
    return rows


if __name__ == "__main__":
    main()
