"""Plan cache across processes: the second process with the same step skips the search.

Runs two fresh Python processes that each plan the same GPT step through
``@autoparallel`` with a shared cache directory, and prints their planning times.

    .venv/bin/python -m benchmarks.bench_cache [--preset gpt2-small] [--batch 16]

The plan must split something (it fails otherwise): timings of a replicated plan's cache
would say nothing about a real plan's.
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
preset, cache, batch = sys.argv[1], sys.argv[2], int(sys.argv[3])
step, args = gpt.make_train_step(gpt.GPTConfig.preset(preset, precision="fp32"), batch, abstract=True)
f = autopar.autoparallel(step, cluster="dgx-a100-80gb",
                         options=autopar.SearchOptions(mesh={"data": 2, "tensor": 4}), cache=cache)
t0 = time.perf_counter()
graph = f.graph_for(*args)
t = dict(f.last_timings)
plan = f.plan_for(*args)
from autopar.plan import spec_axes
splits = {r.path: list(spec_axes(r.spec)) for r in plan.inputs}
splits = {k: v for k, v in splits.items() if v}
print(json.dumps({"total_s": time.perf_counter() - t0, "splits": splits, "plan": plan.to_json(), **t}))
"""


def run_child(preset: str, cache: str, batch: int) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", CHILD, preset, cache, str(batch)],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="demo")
    p.add_argument("--batch", type=int, default=16)
    a = p.parse_args(argv)
    from rich.table import Table

    from autopar.report.text import render

    with tempfile.TemporaryDirectory() as cache:
        rows = [run_child(a.preset, cache, a.batch), run_child(a.preset, cache, a.batch)]
    # The cached plan is the searched one, and it shards (a replicated plan would make the
    # cache's timings say nothing about a real plan).
    if rows[0]["plan"] != rows[1]["plan"]:
        raise SystemExit("the second process read a different plan from the cache")
    if not rows[0]["splits"]:
        raise SystemExit("the benchmark's plan splits nothing: it would not exercise sharding")
    t = Table(
        title=f"Plan cache across processes (GPT {a.preset}, batch {a.batch}, mesh data=2,tensor=4)"
    )
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
    axes = sorted({a for v in rows[0]["splits"].values() for a in v})
    print(f"The plan splits {len(rows[0]['splits'])} argument leaves over {', '.join(axes)}.")
    return rows


if __name__ == "__main__":
    main()
