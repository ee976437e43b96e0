"""Predicted against measured step time on the local accelerator: the cost model on hardware.

For each zoo GPT row (mixed-precision AdamW step, concrete arguments on the first device),
``autopar.plan(step, *args, cluster=Cluster.local())`` plans it, ``lower_plan`` lowers it,
and the lowered step is timed against ``jax.jit`` of the same step, alternating
(``--rounds`` rounds of ``--steps`` steps each, after 2 warm-up steps; the median round
counts). Per row: the plan's mesh, the predicted and measured step times and their ratio,
model TFLOP/s both ways, and the first step's loss against ``jax.jit``'s (one device: the
plan is the step itself, so they must be equal).

Run it when a GPU or TPU is at hand (the CPU backend's timings say nothing about one;
there it runs the ``tiny`` row, to check that the script works). On one H200, JAX 0.11.2,
2026-12-04 (unrolled layers: 0.11's scan equations are not traced yet):
gpt2-small x16 1.50, gpt2-medium x8 1.44, gpt3-1.3b x4 1.46 (measured / predicted;
``docs/cost-model-validation.md``, "On hardware").

Usage::

    python -m benchmarks.bench_device                          # default rows for the backend
    python -m benchmarks.bench_device --rows gpt2-small:16 --unrolled --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

ACCELERATOR_ROWS = ("gpt2-small:16", "gpt2-medium:8", "gpt3-1.3b:4")
CPU_ROWS = ("tiny:8",)


def parse_row(text: str) -> tuple[str, int]:
    """``"preset:batch"`` -> ``(preset, batch)``.

    Example:
        >>> parse_row("gpt2-small:16")
        ('gpt2-small', 16)
    """
    preset, _, batch = text.partition(":")
    if not preset or not batch.isdigit() or int(batch) < 1:
        raise ValueError(f"row {text!r}: expected PRESET:BATCH, e.g. gpt2-small:16")
    return preset, int(batch)


def ratio(measured_s: float, predicted_s: float) -> float:
    """Measured over predicted step time (> 1: the model is optimistic).

    Example:
        >>> round(ratio(0.0596, 0.0398), 3)
        1.497
    """
    if predicted_s <= 0:
        raise ValueError(f"predicted_s={predicted_s} must be > 0")
    return measured_s / predicted_s


def _time_steps(fn: Any, state: Any, batch: Any, steps: int) -> float:
    import jax

    t0 = time.perf_counter()
    for _ in range(steps):
        state, loss = fn(state, batch)
    jax.block_until_ready((state, loss))
    return (time.perf_counter() - t0) / steps


def device_row(
    preset: str, batch: int, scan: bool, steps: int, rounds: int, **overrides: Any
) -> dict[str, Any]:
    """Plan, lower and time one row (``overrides``: of the preset's ``GPTConfig``); the
    table's row as a dict."""
    import jax

    import autopar
    from autopar.lower import lower_plan
    from benchmarks.models.gpt import GPTConfig, make_train_step
    from cost_models import Cluster

    cfg = GPTConfig.preset(preset, scan_layers=scan, **overrides)
    step, args = make_train_step(cfg, batch, abstract=False)
    state, data = args
    cluster = Cluster.local()
    t0 = time.perf_counter()
    plan = autopar.plan(step, *args, cluster=cluster)
    plan_s = time.perf_counter() - t0
    graph = autopar.trace(step, *args)
    lowered = lower_plan(step, plan, args, graph)
    ref = jax.jit(step)
    loss_ref = float(ref(state, data)[1])
    loss_got = float(lowered(state, data)[1])
    for fn in (ref, lowered):  # warm-up: compiled, then one step more
        s, _ = fn(state, data)
        jax.block_until_ready(fn(s, data))
    times: dict[str, list[float]] = {"autopar": [], "jit": []}
    for r in range(rounds):
        order = [("autopar", lowered), ("jit", ref)]
        for name, fn in order if r % 2 == 0 else order[::-1]:
            times[name].append(_time_steps(fn, state, data, steps))
    measured = statistics.median(times["autopar"])
    by = graph.flops_by_phase()
    flops = by["forward"] + by["backward"]
    pred = plan.predicted.step_time_s
    return {
        "row": f"{preset} x{batch}",
        "device": cluster.device.name,
        "mesh": dict(plan.mesh),
        "plan_s": plan_s,
        "predicted_s": pred,
        "measured_s": measured,
        "jit_s": statistics.median(times["jit"]),
        "ratio": ratio(measured, pred),
        "tflops_predicted": flops / pred / 1e12,
        "tflops_measured": flops / measured / 1e12,
        "memory_gib": plan.predicted.memory_bytes_per_device / 2**30,
        "loss_rel_err": abs(loss_got - loss_ref) / max(abs(loss_ref), 1e-30),
    }


def _table(rows: list[dict[str, Any]], backend: str) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"Predicted vs measured step time ({backend})")
    for col in ("row", "device", "mesh", "pred ms", "autopar ms", "jit ms",
                "meas/pred", "TFLOP/s p/m", "loss err"):  # fmt: skip
        t.add_column(col, justify="left" if col in ("row", "device", "mesh") else "right")
    for r in rows:
        if "error" in r:
            t.add_row(r["row"], "", r["error"][:80], *[""] * 6)
            continue
        t.add_row(
            r["row"], r["device"], ",".join(f"{a}{n}" for a, n in r["mesh"].items()),
            f"{r['predicted_s'] * 1e3:.1f}", f"{r['measured_s'] * 1e3:.1f}",
            f"{r['jit_s'] * 1e3:.1f}", f"{r['ratio']:.2f}",
            f"{r['tflops_predicted']:.0f} / {r['tflops_measured']:.0f}",
            f"{r['loss_rel_err']:.1e}",
        )  # fmt: skip
    Console().print(t)
    if backend == "cpu":
        print("CPU backend: these timings say nothing about an accelerator; run on a GPU/TPU.")


def main(argv: list[str] | None = None) -> int:
    import jax

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", nargs="*", help="PRESET:BATCH (default: by backend)")
    p.add_argument("--unrolled", action="store_true", help="scan_layers=False")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", help="write the rows here")
    a = p.parse_args(argv)
    backend = jax.default_backend()
    try:
        parsed = [
            parse_row(t) for t in a.rows or (CPU_ROWS if backend == "cpu" else ACCELERATOR_ROWS)
        ]
    except ValueError as e:
        p.error(str(e))  # a usage message and exit status 2, not a traceback
    rows = []
    for preset, batch in parsed:
        print(f"# {preset} x{batch} ...", flush=True)
        try:
            r = device_row(preset, batch, not a.unrolled, a.steps, a.rounds)
            # Each row as it ends: a run cut short by its time limit keeps what it measured.
            print(
                f"  predicted {r['predicted_s'] * 1e3:.1f} ms, measured {r['measured_s'] * 1e3:.1f}"
                f" ms (jax.jit {r['jit_s'] * 1e3:.1f}), ratio {r['ratio']:.2f}, loss rel. err "
                f"{r['loss_rel_err']:.1e}",
                flush=True,
            )
        except Exception as e:  # one failing row should not end the table
            r = {"row": f"{preset} x{batch}", "error": f"{type(e).__name__}: {e}"}
            print(f"  {r['error']}", flush=True)
        rows.append(r)
    _table(rows, backend)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
