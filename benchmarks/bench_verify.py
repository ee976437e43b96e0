"""Predicted vs compiled: collectives and memory of baseline plans on 8 simulated devices.

For each case: trace the zoo step (abstract arguments), build a hand-written baseline plan,
score it with the cost model (``autopar.search.evaluate_plan`` on a DGX A100 node, when the
search package provides it; prediction columns stay empty otherwise), lower it, dump the
HLO right after SPMD partitioning and compare (:func:`autopar.verify.verify`).

Bytes are per device and per step, in the convention of :mod:`autopar.verify.hlo`
(all-gather: gathered output; reduce-scatter: full input; all-reduce / all-to-all /
collective-permute: the buffer). CPU wall time is meaningless for speed here; this checks
the cost model's *accounting*, not its timing.

Usage::

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python benchmarks/bench_verify.py
    python benchmarks/bench_verify.py gpt-megatron-2x4 mlp-dp-8   # chosen cases
    python benchmarks/bench_verify.py --full                       # each case's full report
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from typing import Any

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")


MEMORY_BOUND = 0.10
"""Issue 14's acceptance: predicted peak memory per device within 10% of
``memory_analysis()`` (the state donated, CPU scratch counted)."""


def _mlp() -> tuple[Callable, tuple]:
    from benchmarks.models.mlp import MLPConfig, make_train_step

    return make_train_step(MLPConfig.preset("tiny"), 8)


def _gpt(scan: bool = True) -> Callable[[], tuple[Callable, tuple]]:
    def make():
        from benchmarks.models.gpt import GPTConfig, make_train_step

        return make_train_step(GPTConfig.preset("tiny", precision="fp32", scan_layers=scan), 8)

    return make


def _moe() -> tuple[Callable, tuple]:
    from benchmarks.models.moe import MoEConfig, make_train_step

    return make_train_step(MoEConfig.preset("tiny", precision="fp32"), 8)


def _hf_like(which: str) -> Callable[[], tuple[Callable, tuple]]:
    """Models beyond the zoo, written as a new user would (``tests/lower/_hf_like.py``),
    at hidden 512 (issue 14 item 4)."""

    def make():
        from tests.lower._hf_like import LikeConfig, llama_step, neo_step

        cfg = LikeConfig(vocab=512, seq=128, hidden=512, layers=2, heads=8, window=32)
        return (llama_step if which == "llama" else neo_step)(cfg, 8)

    return make


def _plan(kind: str, graph: Any, mesh: dict[str, int]) -> Any:
    from autopar import baselines

    if kind == "dp":
        return baselines.data_parallel(graph, mesh)
    if kind == "zero1":
        return baselines.zero(graph, mesh, 1)
    if kind == "zero3":
        return baselines.zero(graph, mesh, 3)
    if kind == "megatron":
        return baselines.megatron(graph, mesh)
    if kind == "data_tensor":
        return baselines.data_tensor(graph, mesh)
    if kind == "ep":
        return baselines.expert_parallel(graph, mesh)
    raise ValueError(kind)


# name -> (model factory, plan kind, mesh)
CASES: dict[str, tuple[Callable[[], tuple[Callable, tuple]], str, dict[str, int]]] = {
    "mlp-dp-8": (_mlp, "dp", {"data": 8}),
    "mlp-zero3-8": (_mlp, "zero3", {"data": 8}),
    "gpt-dp-8": (_gpt(), "dp", {"data": 8}),
    "gpt-zero1-8": (_gpt(), "zero1", {"data": 8}),
    "gpt-zero3-8": (_gpt(), "zero3", {"data": 8}),
    "gpt-megatron-2x4": (_gpt(), "megatron", {"data": 2, "tensor": 4}),
    "gpt-data_tensor-4x2": (_gpt(False), "data_tensor", {"data": 4, "tensor": 2}),
    "moe-ep-2x4": (_moe, "ep", {"data": 2, "expert": 4}),
    "llama_like-data_tensor-4x2": (_hf_like("llama"), "data_tensor", {"data": 4, "tensor": 2}),
    "neo_like-data_tensor-4x2": (_hf_like("neo"), "data_tensor", {"data": 4, "tensor": 2}),
}


def _evaluator() -> Callable[[Any, Any], Any] | None:
    try:
        from autopar.search import complete_plan
        from cost_models import Cluster
    except ImportError as e:
        print(f"(no cost-model predictions: {e})", file=sys.stderr)
        return None
    cluster = Cluster.preset("dgx-a100-80gb")
    return lambda graph, plan: complete_plan(graph, plan, cluster)


def run_case(name: str, evaluate: Callable | None) -> tuple[Any, dict[str, float]]:

    from autopar.lower import lower_plan
    from autopar.options import LoweringOptions
    from autopar.trace import trace
    from autopar.verify import verify

    make, kind, mesh = CASES[name]
    step, args = make()
    t = {}
    t0 = time.perf_counter()
    graph = trace(step, *args)
    plan = _plan(kind, graph, mesh)
    t["trace+plan_s"] = time.perf_counter() - t0
    if evaluate is not None:
        t0 = time.perf_counter()
        plan = evaluate(graph, plan)
        t["evaluate_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    # The state donated, as the memory model assumes (updated in place): an undonated
    # program's output buffers double as scratch before the optimizer writes them, which
    # no per-device sum of live values describes.
    lowered = lower_plan(
        step, plan, args, graph=graph, options=LoweringOptions(donate_argnums=(0,))
    )
    report = verify(plan, lowered)
    t["lower+verify_s"] = time.perf_counter() - t0
    return report, t


def main(argv: list[str]) -> int:
    from rich.console import Console
    from rich.table import Table

    full = "--full" in argv
    names = [a for a in argv if not a.startswith("--")] or list(CASES)
    unknown = [n for n in names if n not in CASES]
    if unknown:
        print(f"unknown cases {unknown}; known: {list(CASES)}", file=sys.stderr)
        return 2
    evaluate = _evaluator()
    table = Table(title="predicted vs HLO (per device, per step)")
    for col in ("case", "kind", "count p/H", "bytes pred", "bytes HLO", "err", "status"):
        table.add_column(col, justify="left" if col in ("case", "kind", "status") else "right")
    from autopar.report import format_bytes

    off_memory: list[str] = []

    for name in names:
        report, timing = run_case(name, evaluate)
        if full:
            print(report.to_text())
            print(", ".join(f"{k} {v:.1f}" for k, v in timing.items()))
        for r in report.rows:
            err = r.bytes_error
            table.add_row(
                name,
                r.kind,
                f"{'-' if r.predicted_count is None else r.predicted_count}/{r.hlo_count}",
                "-" if r.predicted_bytes is None else format_bytes(r.predicted_bytes),
                format_bytes(r.hlo_bytes),
                "-" if err is None else f"{err:+.0%}",
                r.status,
            )
        m = report.memory
        if m is not None:
            table.add_row(
                name,
                "peak memory",
                "",
                format_bytes(m.predicted_bytes) if m.checked else "-",
                format_bytes(m.compiled_bytes),
                "-" if m.error is None else f"{m.error:+.1%}",
                ("ok" if abs(m.error or 0.0) <= MEMORY_BOUND else "memory") if m.checked else "-",
            )
            if m.error is not None and abs(m.error) > MEMORY_BOUND:
                off_memory.append(f"{name} {m.error:+.1%}")
        table.add_section()
    Console(width=120).print(table)
    if off_memory:
        print(f"peak memory outside +-{MEMORY_BOUND:.0%} of memory_analysis: {off_memory}")
    if evaluate is None:
        print("(autopar.search.evaluate_plan not available: prediction columns empty)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
