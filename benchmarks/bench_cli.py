"""``autopar show`` on a GPT-3 175B plan for 1024 GPUs: under 2 s, process included (issue 15).

Plans GPT-3 175B (the zoo's ``gpt3-175b`` preset, ``scan_layers``, global batch 1536) for
128 DGX A100 nodes once, on abstract arguments, saves the plan, then times

* *render*: ``summary(Plan.load(path))`` in this process (what ``autopar show`` does once
  Python and its imports are up), the median of ``--repeats`` runs;
* *process*: ``autopar show PATH`` as a fresh process, start to exit (Python start-up and
  imports included), the median of ``--repeats`` runs, beside a bare ``python -c pass``;
* whether that process imported JAX (``import autopar`` is lazy, and reading a saved plan
  needs no JAX: before that, importing JAX took ~2 s of a 2.45 s process);

and prints a table. It exits 1 if the render or the whole process takes 2 s or more, or
the process imported JAX.

    .venv/bin/python -m benchmarks.bench_cli [--plan PATH] [--repeats 5]

``--plan`` reuses a saved plan (it is written there when missing). Wall times on a loaded
machine are inflated; the table prints the load average beside them.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

PRESET = "gpt3-175b"
BATCH = 1536
"""GPT-3's global batch (Brown et al. 2020, table 2.1: 3.2M tokens of 2048)."""
NODES = 128
LIMIT_S = 2.0
"""The acceptance bound of issue 15 on rendering the plan, and on the whole process."""


def make_plan(path: Path) -> float:
    """Plan the 175B step for :data:`NODES` DGX A100 nodes and save it; returns the
    seconds the trace and search took."""
    import autopar
    from autopar.registry import model_step
    from cost_models import Cluster

    model = model_step("gpt", PRESET, BATCH, abstract=True)
    assert model.config.scan_layers, "the 175B preset scans its layers"
    t0 = time.perf_counter()
    plan = autopar.plan(
        model.step_fn, *model.args, cluster=Cluster.preset("dgx-a100-80gb", nodes=NODES)
    )
    seconds = time.perf_counter() - t0
    plan.save(path)
    return seconds


def time_render(path: Path, repeats: int) -> tuple[float, int]:
    """Median seconds of ``summary(Plan.load(path))``, and the text's length."""
    from autopar.plan import Plan
    from autopar.report import summary

    times, text = [], ""
    for _ in range(repeats):
        t0 = time.perf_counter()
        text = summary(Plan.load(path))
        times.append(time.perf_counter() - t0)
    return statistics.median(times), len(text)


def _show_cmd(path: Path) -> list[str]:
    exe = Path(sys.executable).with_name("autopar")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "autopar.cli"]
    return [*cmd, "show", str(path)]


def time_process(cmd: Sequence[str], repeats: int) -> float:
    """Median seconds of ``cmd`` as a fresh process, start to exit."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        subprocess.run(list(cmd), check=True, capture_output=True)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


_IMPORTS_OF_SHOW = """
import contextlib, io, sys
from autopar.cli import main
with contextlib.redirect_stdout(io.StringIO()):
    assert main(["show", sys.argv[1]]) == 0
print(" ".join(m for m in ("jax", "jaxlib", "flax", "optax") if m in sys.modules))
"""


def heavy_imports_of_show(path: Path) -> str:
    """The heavy modules (JAX and friends) ``autopar show PATH`` imports, by name."""
    out = subprocess.run(
        [sys.executable, "-c", _IMPORTS_OF_SHOW, str(path)],
        check=True,
        capture_output=True,
        text=True,
    )
    return out.stdout.strip()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--plan", help="where the 175B plan is (written if missing)")
    parser.add_argument("--repeats", type=int, default=5)
    a = parser.parse_args(argv)
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

    path = Path(a.plan) if a.plan else Path(tempfile.mkdtemp()) / "gpt3-175b-1024.json"
    plan_s = make_plan(path) if not path.exists() else float("nan")
    from autopar.plan import Plan

    plan = Plan.load(path)
    render_s, chars = time_render(path, a.repeats)
    process_s = time_process(_show_cmd(path), a.repeats)
    python_s = time_process([sys.executable, "-c", "pass"], a.repeats)
    heavy = heavy_imports_of_show(path)
    load = os.getloadavg()[0]

    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"autopar show: {PRESET}, batch {BATCH}, {NODES} x DGX A100")
    for col in ("what", "value"):
        table.add_column(col, justify="right" if col == "value" else "left")
    mesh = " x ".join(f"{k}={v}" for k, v in plan.mesh.items())
    table.add_row("plan", f"{path} ({path.stat().st_size / 2**20:.2f} MiB JSON)")
    table.add_row("mesh", f"{mesh} ({plan.num_devices} devices)")
    table.add_row("input leaves", str(len(plan.inputs)))
    table.add_row("trace + search", "reused" if plan_s != plan_s else f"{plan_s:.1f} s")
    table.add_row("render (load + summary), median", f"{render_s:.3f} s ({chars} chars)")
    table.add_row("autopar show as a process, median", f"{process_s:.2f} s")
    table.add_row("of which bare Python start-up, median", f"{python_s:.2f} s")
    table.add_row("JAX & co. imported by show", heavy or "none")
    table.add_row("load average (1 min)", f"{load:.1f}")
    Console(width=110).print(table)
    ok = render_s < LIMIT_S and plan.num_devices == NODES * 8
    print(f"render under {LIMIT_S:g} s on {plan.num_devices} devices: {'yes' if ok else 'NO'}")
    fast = process_s < LIMIT_S and not heavy
    print(f"whole process under {LIMIT_S:g} s without JAX: {'yes' if fast else 'NO'}")
    ok = ok and fast
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
