"""Searched plans, end to end: numerics vs single device and predicted vs compiled.

For every zoo model (tiny, float32; the MLP "small", as tiny is replicated) and mesh shape of the lowering issue's acceptance,
the step is planned by the search for a DGX A100 node with the mesh fixed (nothing
hand-made; memory by the rules of the compiler that builds the program here, XLA:CPU:
``Cluster.compiled_on``), lowered for 8 simulated CPU devices with the state donated (what the memory
model assumes), run for a few steps against single-device ``jax.jit``, and checked by
:func:`autopar.verify.verify`: every predicted collective kind emitted, bytes per kind
within 10%, nothing unplanned above 1% of the step's collective bytes, peak memory within
10% of ``memory_analysis()`` (``MEMORY_BOUND``, issue 14).

Columns: ``work/dev`` the share of the step's FLOPs each device does (1/8: all split 8
ways; 1/1.0: the search replicated the step); ``loss err`` is the largest relative loss difference over the steps (bound 1e-5);
``bytes err`` the worst per-kind byte error; ``unplanned`` the share of HLO collective bytes
no prediction covers; ``mem err`` predicted vs compiled peak.

Usage::

    python -m benchmarks.bench_fidelity                       # every case (~10 min)
    python -m benchmarks.bench_fidelity gpt_scan:2x4 moe:8    # chosen cases
    python -m benchmarks.bench_fidelity --full                # each case's verify report
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

MODELS = ("mlp", "gpt_scan", "gpt_unrolled", "moe", "wide_resnet")
SHAPES = ((8,), (2, 4), (4, 2), (2, 2, 2))
STEPS = 3
BATCH = 64  # large enough that the search splits the work (at 8 it replicates tiny models)
LOSS_RTOL = 1e-5
MEMORY_BOUND = 0.10  # issue 14's acceptance: peak memory within 10% of memory_analysis()


def mesh_for(model: str, shape: tuple[int, ...]) -> dict[str, int]:
    """Axis names for a fixed mesh: labels only (the search may use any axis for any
    role); MoE gets an ``expert`` axis so its plan reads naturally."""
    names = {1: ("data",), 2: ("data", "tensor"), 3: ("data", "fsdp", "tensor")}[len(shape)]
    if model == "moe" and len(shape) > 1:
        names = names[:-1] + ("expert",)
    return dict(zip(names, shape, strict=True))


def zoo_step(model: str) -> tuple[Any, tuple]:
    if model == "mlp":
        from benchmarks.models.mlp import MLPConfig, make_train_step

        return make_train_step(MLPConfig.preset("small"), BATCH, abstract=False)
    if model in ("gpt_scan", "gpt_unrolled"):
        from benchmarks.models.gpt import GPTConfig, make_train_step

        cfg = GPTConfig.preset("tiny", precision="fp32", scan_layers=model == "gpt_scan")
        return make_train_step(cfg, BATCH, abstract=False)
    if model == "moe":
        from benchmarks.models.moe import MoEConfig, make_train_step

        return make_train_step(MoEConfig.preset("tiny", precision="fp32"), BATCH, abstract=False)
    if model == "wide_resnet":
        from benchmarks.models.wide_resnet import WideResNetConfig, make_train_step

        cfg = WideResNetConfig.preset("tiny", precision="fp32")
        return make_train_step(cfg, BATCH, abstract=False)
    raise ValueError(model)


def run_case(model: str, shape: tuple[int, ...], full: bool = False) -> dict[str, Any]:
    import jax
    import numpy as np

    import autopar
    from autopar.lower import lower_plan
    from autopar.options import LoweringOptions
    from cost_models import Cluster

    step, (state, batch) = zoo_step(model)
    # Priced as a DGX A100 node, with the memory rules of the compiler that builds the
    # program checked here (XLA:CPU copies convolution operands: Cluster.compiled_on).
    cluster = Cluster.preset("dgx-a100-80gb").compiled_on(jax.default_backend())
    row: dict[str, Any] = {"case": f"{model}:{'x'.join(map(str, shape))}"}
    t0 = time.perf_counter()
    graph = autopar.trace(step, state, batch)
    try:
        plan = autopar.plan(
            graph,
            cluster=cluster,
            options=autopar.SearchOptions(mesh=mesh_for(model, shape)),
        )
    except autopar.AutoparError as e:
        row.update(status=f"no plan: {type(e).__name__}", search_s=time.perf_counter() - t0)
        return row
    row["search_s"] = time.perf_counter() - t0
    lowered = lower_plan(
        step, plan, (state, batch), graph=graph, options=LoweringOptions(donate_argnums=(0,))
    )
    report = autopar.verify(plan, lowered, state, batch)
    if full:
        print(report.to_text())
    ref_state, ref_losses = state, []
    single = jax.jit(step)
    for _ in range(STEPS):
        ref_state, loss = single(ref_state, batch)
        ref_losses.append(float(loss))
    got_state = jax.tree.map(np.array, state)
    losses = []
    for _ in range(STEPS):
        got_state, loss = lowered(got_state, batch)
        losses.append(float(loss))
    row["loss_err"] = max(
        abs(a - b) / max(abs(b), 1e-30) for a, b in zip(losses, ref_losses, strict=True)
    )
    errs = [abs(r.bytes_error) for r in report.rows if r.bytes_error is not None]
    row["bytes_err"] = max(errs, default=0.0)
    row["unplanned"] = sum(r.share for r in report.rows if r.predicted_bytes is None)
    m = report.memory
    row["mem_pred"] = None if m is None else m.predicted_bytes
    row["mem_xla"] = None if m is None else m.compiled_bytes
    row["mem_err"] = None if m is None else m.error
    problems = sorted({r.status for r in report.rows if not r.ok})
    if m is not None and (not m.ok or (m.error is not None and abs(m.error) > MEMORY_BOUND)):
        problems.append("memory")
    if row["loss_err"] > LOSS_RTOL:
        problems.append("loss")
    row["status"] = ",".join(problems) or "ok"
    row["mesh"] = dict(plan.mesh)
    # How much of the step's work each device does: 1/8 when it is all split 8 ways.
    per_device = plan.predicted.flops_per_device
    row["work_split"] = graph.total_flops / per_device if per_device > 0 else None
    return row


def main(argv: list[str]) -> int:
    from rich.console import Console
    from rich.table import Table

    full = "--full" in argv
    names = [a for a in argv if not a.startswith("--")]
    cases = [(m, s) for m in MODELS for s in SHAPES]
    if names:
        wanted = set(names)
        cases = [
            (m, s) for m, s in cases if f"{m}:{'x'.join(map(str, s))}" in wanted or m in wanted
        ]
    table = Table(title="searched plans: numerics and predicted vs compiled (8 CPU devices)")
    cols = (
        "case",
        "work/dev",
        "search s",
        "loss err",
        "bytes err",
        "unplanned",
        "mem pred",
        "mem XLA",
        "mem err",
        "status",
    )
    for c in cols:
        table.add_column(c, justify="left" if c in ("case", "status") else "right")

    def fmt(v: Any, spec: str) -> str:
        return "-" if v is None else format(v, spec)

    failed = []
    rows = []
    for model, shape in cases:
        r = run_case(model, shape, full)
        rows.append(r)
        if r["status"] != "ok":
            failed.append(r["case"])
        table.add_row(
            r["case"],
            "-" if r.get("work_split") is None else f"1/{r['work_split']:.1f}",
            fmt(r.get("search_s"), ".1f"),
            fmt(r.get("loss_err"), ".1e"),
            fmt(r.get("bytes_err"), ".0%"),
            fmt(r.get("unplanned"), ".1%"),
            "-" if r.get("mem_pred") is None else f"{r['mem_pred'] / 2**20:.2f} MiB",
            "-" if r.get("mem_xla") is None else f"{r['mem_xla'] / 2**20:.2f} MiB",
            fmt(r.get("mem_err"), "+.1%"),
            r["status"],
        )
        print(r, flush=True)
    Console(width=150).print(table)
    replicated = [r["case"] for r in rows if (r.get("work_split") or 0) and r["work_split"] < 1.1]
    if replicated:
        print(
            f"work/dev 1/1.0 ({', '.join(replicated)}): the search replicated the step's work "
            "(every device does all of it), predicted faster on this cluster than any split "
            "(Wide-ResNet: exact BatchNorm needs an all-reduce of batch statistics per "
            "layer, more latency than this tiny step's compute). Sharded layouts of those "
            "models are checked with hand-written plans: "
            "pytest -m slow tests/lower/test_numerics.py."
        )
    if failed:
        print(f"{len(failed)} of {len(cases)} cases outside the acceptance bounds: {failed}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
