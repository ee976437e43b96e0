"""Benchmark the sharding search: problem size before/after coarsening and solve time.

Runs, on one 8-GPU DGX A100 node with the mesh {"data": 2, "tensor": 4}:

1. GPT-2 small's AdamW step (batch 8), with ``nn.scan`` over the layers (the zoo's
   default) and unrolled: ops and strategies before coarsening, groups and ILP variables
   after, build and solve time, and the predicted step time.
2. The same step at 12 and 96 layers, to show that repeated layers cost (almost) nothing:
   the scan body is solved once; unrolled identical layers are tied to one representative.

Usage:
    python benchmarks/bench_search.py            # everything (a few minutes on 2 cores)
    python benchmarks/bench_search.py --quick    # scan models only

CPU wall times on simulated devices say nothing about the plans' speed; they measure how
long the search itself takes.
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")


def _uncoarsened(bp) -> tuple[int, int]:
    """Ops and the strategies they would have if every op chose on its own."""
    from autopar.search.strategies import enumerate_strategies

    cache: dict = {}
    total = 0
    ops = 0
    for op in bp.ops:
        if op.kind != "node":
            continue
        ops += 1
        key = bp_key(op)
        if key not in cache:
            cache[key] = len(enumerate_strategies(op.node, bp.ctx))
        total += cache[key]
    return ops, total


def bp_key(op) -> tuple:
    from autopar.search.ilp import _struct_key

    return _struct_key(op.node)


def run(layers: int, scan: bool, mesh: dict[str, int], batch: int = 8) -> dict:
    from autopar.options import SearchOptions
    from autopar.search.evaluate import decode
    from autopar.search.planner import build_problem, solve_within_memory
    from autopar.search.solver import _reduce
    from autopar.trace import trace
    from benchmarks.models.gpt import GPTConfig, make_train_step
    from cost_models import Cluster

    cfg = GPTConfig.preset("gpt2-small", layers=layers, scan_layers=scan)
    step, args = make_train_step(cfg, batch)
    t0 = time.perf_counter()
    graph = trace(step, *args)
    t_trace = time.perf_counter() - t0
    cluster = Cluster.preset("dgx-a100-80gb")
    options = SearchOptions(mesh=mesh)
    limit = float(cluster.device.hbm_bytes)
    t0 = time.perf_counter()
    bp = build_problem(graph, cluster, mesh, options, limit)
    t_build = time.perf_counter() - t0
    t0 = time.perf_counter()
    bp, sol = solve_within_memory(bp, limit, options.solver_time_limit_s)
    t_solve = time.perf_counter() - t0
    ev = decode(bp, sol.choice, status=sol.status)
    red = _reduce(bp.problem)
    ops, strategies = _uncoarsened(bp)
    return {
        "layers": layers,
        "scan": scan,
        "graph_nodes": bp.coarse_stats["graph_nodes"],
        "ops": ops,
        "strategies_before": strategies,
        "groups": len(bp.groups),
        "strategies_after": bp.problem.size["strategies"],
        "ilp_choices": len(red.reps),
        "ilp_edges": len(red.edges),
        "ilp_edge_pairs": sum(len(m) * len(m[0]) for *_, m in red.edges),
        "trace_s": t_trace,
        "build_s": t_build,
        "solve_s": t_solve,
        "status": sol.status,
        "step_ms": ev.step_time_s * 1e3,
        "objective_ms": ev.objective_s * 1e3,
    }


def _print(rows: list[dict]) -> None:
    cols = [
        ("layers", "layers", "{}"),
        ("scan", "scan", "{}"),
        ("graph_nodes", "eqns", "{}"),
        ("strategies_before", "strat before", "{}"),
        ("groups", "groups", "{}"),
        ("ilp_choices", "ILP choices", "{}"),
        ("ilp_edges", "ILP edges", "{}"),
        ("ilp_edge_pairs", "edge pairs", "{}"),
        ("trace_s", "trace s", "{:.2f}"),
        ("build_s", "build s", "{:.2f}"),
        ("solve_s", "solve s", "{:.2f}"),
        ("status", "status", "{}"),
        ("step_ms", "step ms", "{:.2f}"),
    ]
    print(" | ".join(h for _, h, _ in cols))
    for r in rows:
        print(" | ".join(f.format(r[k]) for k, _, f in cols))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="scan models only")
    args = parser.parse_args()
    mesh = {"data": 2, "tensor": 4}
    rows = [run(12, True, mesh)]
    if not args.quick:
        rows.append(run(12, False, mesh))
    rows.append(run(96, True, mesh))
    if not args.quick:
        rows.append(run(96, False, mesh))
    print(f"GPT-2 small AdamW step, batch 8, mesh {mesh}, DGX A100 (8 GPUs)")
    _print(rows)
    by = {(r["layers"], r["scan"]): r for r in rows}
    for scan in (True, False):
        if (12, scan) in by and (96, scan) in by:
            a, b = by[(12, scan)], by[(96, scan)]
            search_a = a["build_s"] + a["solve_s"]
            search_b = b["build_s"] + b["solve_s"]
            print(
                f"{'scan' if scan else 'unrolled'}: 96 layers search {search_b:.2f} s = "
                f"{search_b / search_a:.2f}x the 12-layer {search_a:.2f} s"
            )


if __name__ == "__main__":
    main()
