"""Run a sweep: every point of a suite, autopar's plan and each baseline, resumable.

Example:
    >>> store = run_sweep("benchmarks/suites/smoke.toml", "sweep-smoke")  # doctest: +SKIP
    >>> sorted({r["plan"] for r in store.records()[0]["rows"]})[:2]  # doctest: +SKIP
    ['autopar', 'data_parallel']
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from autopar.errors import AutoparError
from autopar.sweep.plans import PlanRow, PointContext, evaluate_baseline, plan_autopar
from autopar.sweep.results import ResultStore, plot, write_csv
from autopar.sweep.suite import LoadSuiteError, Point, Suite, load_suite

__all__ = ["compile_plan", "run_point", "run_sweep"]


def compile_plan(ctx: PointContext, plan: Any) -> dict[str, Any]:
    """Lower ``plan`` on the point's step, compile it on the simulated CPU devices and
    compare with its prediction (:func:`autopar.verify`): collective bytes per step and
    peak memory per device, both sides."""
    import jax

    import autopar
    from autopar.lower import lower_plan, make_mesh

    n = ctx.point.devices
    if n > jax.device_count():
        return {"error": f"compile: {n} devices asked, {jax.device_count()} here"}
    try:
        if not plan.activations and plan.pipeline is None:
            plan = autopar.complete(ctx.graph, plan, ctx.cluster)  # pin what was priced
        mesh = make_mesh(plan.mesh, jax.devices()[:n])
        lowered = lower_plan(ctx.step, plan, ctx.args, graph=ctx.graph, mesh=mesh)
        rep = autopar.verify(plan, lowered)
    except AutoparError as e:
        return {"error": f"compile: {type(e).__name__}: {e}"}
    out: dict[str, Any] = {
        "hlo_collective_bytes": rep.hlo_bytes(),
        "predicted_collective_bytes": sum(c.bytes for c in plan.predicted.collectives),
        "verify_ok": rep.ok,
    }
    if rep.memory is not None:
        out["compiled_memory_bytes"] = rep.memory.compiled_bytes
        out["predicted_memory_bytes"] = rep.memory.predicted_bytes
    return out


def run_point(
    suite: Suite, point: Point, *, compile: bool = True, advance: Any = None
) -> dict[str, Any]:
    """autopar's plan and every baseline of ``suite`` at ``point``: the point's record
    (its spec, model FLOPs, parameters, the device's peak and one row per plan)."""
    from dataclasses import replace

    import jax

    ctx = PointContext.build(suite, point)
    advance = advance or (lambda _: None)
    results: list[tuple[PlanRow, Any]] = [plan_autopar(ctx)]
    advance(f"{point.name}: autopar")
    for name in suite.baselines:
        results.append(evaluate_baseline(name, ctx))
        advance(f"{point.name}: {name}")
    rows = []
    for row, plan in results:
        if compile and row.plan in point.compile and plan is not None and row.status == "ok":
            row = replace(row, compiled=compile_plan(ctx, plan))
        rows.append(row.to_json())
    by = ctx.graph.flops_by_phase()
    params = sum(
        math.prod(x.shape) for x in jax.tree.leaves(ctx.args[0].get("params", ctx.args[0]))
    )
    return {
        "point": {
            "name": point.name,
            "model": point.model,
            "preset": point.preset,
            "config": dict(point.config),
            "batch": point.batch,
            "devices": point.devices,
            "compile": list(point.compile),
        },
        "cluster": suite.cluster,
        "nodes": ctx.cluster.num_nodes,
        "params": params,
        "model_flops": by["forward"] + by["backward"],
        "peak_flops": float(ctx.cluster.device.peak_flops["bfloat16"]),
        "rows": rows,
    }


def run_sweep(
    suite: Suite | str | Path,
    out_dir: str | Path | None = None,
    *,
    only: Sequence[str] | None = None,
    compile: bool = True,
) -> ResultStore:
    """Run ``suite`` (a :class:`Suite` or its file), writing ``results.json``,
    ``results.csv`` and ``throughput.png`` under ``out_dir`` (default
    ``sweep-<suite name>``). Points already in ``results.json`` are skipped; the store is
    rewritten after each point, so an interrupted sweep resumes.

    Args:
        only: run just these point names.
        compile: ``False`` skips the compiled checks of ``compile = true`` points.

    Raises:
        LoadSuiteError: the suite file is bad, or ``only`` names no point of it.
    """
    from autopar.progress import SearchProgress

    if not isinstance(suite, Suite):
        suite = load_suite(suite)
    out = Path(out_dir) if out_dir is not None else Path(f"sweep-{suite.name}")
    store = ResultStore(out / "results.json", suite)
    points = list(suite.points)
    if only:
        unknown = sorted(set(only) - {p.name for p in points})
        if unknown:
            raise LoadSuiteError(
                f"suite {suite.path!r}: no point named {unknown[0]!r}; points: "
                f"{[p.name for p in points]}."
            )
        points = [p for p in points if p.name in set(only)]
    todo = [p for p in points if not store.done(p.key())]
    steps = len(todo) * (1 + len(suite.baselines))
    with SearchProgress(steps, f"sweep {suite.name}", show_after_s=0.0) as bar:
        for point in todo:
            record = run_point(suite, point, compile=compile, advance=bar.advance)
            store.put(point.key(), record)
            write_csv(store, out / "results.csv")
    write_csv(store, out / "results.csv")
    if store.records():
        plot(store, out / "throughput.png")
    return store
