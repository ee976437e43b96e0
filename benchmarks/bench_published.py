"""Published runs against the planner's own model: one row per run, configuration fixed.

Every row is a published large-model training run (``benchmarks/reference/``, copied from
the project's shared reference with its README, which cites each source):

* Megatron-LM 2021 (Narayanan et al., SC'21) Table 1: ten GPT rows, PTD-P on DGX A100.
* Megatron-LM 2021 Table 2: 175B and 530B under DeepSpeed ZeRO-3 (no model parallelism)
  and under PTD-P, 384 to 2240 GPUs.
* BLOOM-176B (BigScience 2022): tensor 4 x pipeline 12 x data 8, ZeRO-1, on Jean Zay.

Each row is priced by the PLANNER's evaluation of the traced zoo GPT
(``benchmarks.models.gpt``, scanned layers unless the stages split them unevenly, as
BLOOM's 70 layers over 12 stages; abstract inputs; the row's vocabulary,
sequence, width, depth and heads) under the run's configuration, fixed: the mesh (pipe,
data, tensor), the schedule (interleaved 1F1B, as the papers ran, with the closed form's
v: :meth:`PublishedRun.schedule`), the microbatch size (the table's, else 1),
full activation recomputation, and the ZeRO stage (``autopar.baselines.zero`` for ZeRO-1
and ZeRO-3 with ``pad=True``: a weight no dim of which the data-parallel size divides, as
the 530B's on 1120 and 2240 GPUs, is split in padded partitions as DeepSpeed's flattened
buffers are, and every gather moves the padding; ``baselines.megatron`` otherwise). The path is the one ``bench_scale
--megatron`` uses for "the paper's configuration by the same model":
``autopar.search.outer.price_pipeline`` with the inner plan inside the stages, or one
stage of ``m`` accumulated microbatches (``autopar.search.stages.evaluate_pipeline``).

The step time is the evaluation's with overlap bounded by the compute there is to hide
behind (``Evaluation.overlap_step_time_s``: ``cost_models.overlap.bound_linear_overlap``
applied by ``autopar.search.stages.evaluate_pipeline``; the planner's linear step time,
its ILP objective, hides ``overlap_efficiency`` of every overlappable second however
little compute there is: the ``linear`` column), and, for the Megatron-LM and
Megatron-DeepSpeed runs, the evaluation's step of the same program with gradients reduced
once after the pipeline flush (``Evaluation.extra["after_flush_step_s"]``), as those
runs did, rather than in every microbatch as the planner's lowered program does
(:attr:`PublishedRun.reduces_after_flush`). No correction is made here.

Predicted TFLOP/s per GPU uses the papers' count (``96 B s l h^2 (1 + s/(6h) + V/(16 l
h))``, recomputation included: ``cost_models.memory.megatron_flops_per_iteration``), so
it compares with the published column. ``err`` = predicted / published - 1.

One constant set per software generation (docs/cost-model-validation.md lists each
constant and its source): the 2021 rows (Megatron-LM, DeepSpeed, Megatron-DeepSpeed) run
on :func:`cluster_2021` (the ``dgx-a100-80gb`` preset with ``owner_collectives``: ZeRO's
per-owner broadcasts), BLOOM on the same constants with Jean Zay's links
(:func:`jean_zay`). Nothing is tuned per row.

Usage:
    python -m benchmarks.bench_published                 # every row (minutes)
    python -m benchmarks.bench_published --rows t1-1.7b bloom-176b
    python -m benchmarks.bench_published --json rows.json

Timings are this machine's CPU planning time, not the cluster's speed.
"""

from __future__ import annotations

import argparse
import csv
import os
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

REFERENCE = Path(__file__).resolve().parent / "reference"
GPUS_PER_NODE = 8
MEMORY_LIMIT = 80e9  # A100 80GB
# Targets (issue 14): Table 1 within 15% (goal 10%), Table 2 within 20%, BLOOM within 15%.
TOLERANCE = {"megatron2021-t1": 0.15, "megatron2021-t2": 0.20, "bloom": 0.15}


@dataclass(frozen=True)
class PublishedRun:
    """One published run, its configuration as published.

    Attributes:
        name: row label (``t1-1.7b``, ``t2-zero3-175b-x384``, ``bloom-176b``).
        group: ``megatron2021-t1``, ``megatron2021-t2`` or ``bloom``.
        layers, hidden, heads, vocab, seq: the GPT's shape.
        tensor, pipeline, data: the mesh; ``gpus = tensor * pipeline * data``.
        microbatch: sequences per microbatch.
        global_batch: sequences per iteration.
        zero_stage: 0 (none), 1 or 3.
        published_tflops: the measured TFLOP/s per GPU (recomputation counted).
        cluster: ``selene`` or ``jean-zay``.
    """

    name: str
    group: str
    layers: int
    hidden: int
    heads: int
    vocab: int
    seq: int
    tensor: int
    pipeline: int
    data: int
    microbatch: int
    global_batch: int
    zero_stage: int
    published_tflops: float
    cluster: str = "selene"

    @property
    def gpus(self) -> int:
        """``tensor * pipeline * data``."""
        return self.tensor * self.pipeline * self.data

    @property
    def microbatches(self) -> int:
        """Microbatches per pipeline per iteration: ``global_batch / (data * microbatch)``."""
        return self.global_batch // (self.data * self.microbatch)

    @property
    def reduces_after_flush(self) -> bool:
        """Whether the run's software reduces data-parallel gradients once per iteration,
        after the last microbatch (Megatron-LM 2021; Megatron-DeepSpeed's pipeline engine
        with ZeRO-1), rather than bucketed during each backward pass (DeepSpeed ZeRO-3,
        whose one microbatch per iteration makes the two the same).

        Example:
            >>> [r.reduces_after_flush for r in published_runs(["t1-1.7b", "t2-zero3-175b-x384"])]
            [True, False]
        """
        return self.zero_stage != 3

    def schedule(self) -> tuple[str, int]:
        """``(schedule, chunks per device)``: the papers' interleaved 1F1B (the reference
        README: every Table 1 row; Table 2's PTD-P) with v = the smallest divisor >= 2 of
        the layers per stage (``cost_models.megatron.default_chunks``, the closed form's
        rule: the paper does not give v); 1F1B where that does not exist (no pipeline,
        layers not split evenly, microbatches not a multiple of the stages).

        Example:
            >>> [r.schedule() for r in published_runs(["t1-39.1b", "t1-529.6b"])]
            [('interleaved-1f1b', 2), ('interleaved-1f1b', 3)]
        """
        from cost_models.megatron import default_chunks

        v = default_chunks(self.layers, self.pipeline, self.microbatches)
        return ("interleaved-1f1b", v) if v > 1 else ("1f1b", 1)


def _t1_shape(params_b: float) -> tuple[int, int, int]:
    from benchmarks.bench_scale import preset_of
    from benchmarks.models.gpt import GPTConfig

    cfg = GPTConfig.preset(preset_of({"params_b": str(params_b)}))
    return cfg.layers, cfg.hidden, cfg.heads


# Table 2's two models: GPT-3 175B (96 x 12288, 96 heads)
# and the 530B row of Table 1 (105 x 20480, 128 heads), both with V = 51200, s = 2048.
_T2_SHAPES = {"174.6": (96, 12288, 96), "529.6": (105, 20480, 128)}


def published_runs(names: list[str] | None = None) -> list[PublishedRun]:
    """Every published run of ``benchmarks/reference`` (or those named), in table order.

    Example:
        >>> [r.name for r in published_runs(["t1-1.7b", "bloom-176b"])]
        ['t1-1.7b', 'bloom-176b']
        >>> published_runs(["t2-zero3-175b-x1536"])[0].microbatches
        1
    """
    runs: list[PublishedRun] = []
    with open(REFERENCE / "megatron2021_table1.csv", newline="") as f:
        for r in csv.DictReader(f):
            layers, hidden, heads = _t1_shape(float(r["params_b"]))
            t, p, gpus = int(r["tensor"]), int(r["pipeline"]), int(r["gpus"])
            label = "1t" if float(r["params_b"]) >= 1000 else f"{float(r['params_b']):g}b"
            runs.append(
                PublishedRun(
                    f"t1-{label}",
                    "megatron2021-t1",
                    layers,
                    hidden,
                    heads,
                    51200,
                    2048,
                    t,
                    p,
                    gpus // (t * p),
                    1,
                    int(r["global_batch"]),
                    0,
                    float(r["tflops_per_gpu"]),
                )  # fmt: skip
            )
    with open(REFERENCE / "megatron2021_table2.csv", newline="") as f:
        for r in csv.DictReader(f):
            layers, hidden, heads = _T2_SHAPES[r["params_b"]]
            t, p, gpus = int(r["tensor"]), int(r["pipeline"]), int(r["gpus"])
            size = "175b" if r["params_b"] == "174.6" else "530b"
            runs.append(
                PublishedRun(
                    f"t2-{r['scheme']}-{size}-x{gpus}",
                    "megatron2021-t2",
                    layers,
                    hidden,
                    heads,
                    51200,
                    2048,
                    t,
                    p,
                    gpus // (t * p),
                    int(r["microbatch"]),
                    int(r["global_batch"]),
                    3 if r["scheme"] == "zero3" else 0,
                    float(r["tflops_per_gpu"]),
                )  # fmt: skip
            )
    with open(REFERENCE / "other_runs.csv", newline="") as f:
        for r in csv.DictReader(f):
            runs.append(
                PublishedRun(
                    r["name"],
                    "bloom",
                    int(r["layers"]),
                    int(r["hidden"]),
                    int(r["heads"]),
                    int(r["vocab"]),
                    int(r["seq"]),
                    int(r["tensor"]),
                    int(r["pipeline"]),
                    int(r["data"]),
                    int(r["microbatch"]),
                    int(r["global_batch"]),
                    int(r["zero_stage"]),
                    float(r["tflops_per_gpu"]),
                    "jean-zay",
                )  # fmt: skip
            )
    if names is not None:
        known = {r.name for r in runs}
        unknown = [n for n in names if n not in known]
        if unknown:
            raise ValueError(f"unknown rows {unknown}; known: {sorted(known)}")
        runs = [r for r in runs if r.name in names]
    return runs


def cluster_2021(gpus: int) -> Any:
    """The 2021 software generation on Selene: the ``dgx-a100-80gb`` preset (NCCL 2.12
    collectives, the default efficiency curve) with 2021's ``overlap_efficiency``
    (``cost_models.cluster.OVERLAP_EFFICIENCY_2021``, fitted by
    :func:`fit_overlap_efficiency`) and ``owner_collectives``: DeepSpeed's 2021 ZeRO-3
    gathers parameters by per-owner broadcasts (cluster.py).

    Example:
        >>> c = cluster_2021(16)
        >>> c.num_nodes, c.owner_collectives, c.overlap_efficiency
        (2, True, 0.27)
    """
    from cost_models import Cluster
    from cost_models.cluster import OVERLAP_EFFICIENCY_2021

    base = Cluster.preset("dgx-a100-80gb", nodes=gpus // GPUS_PER_NODE)
    return replace(
        base,
        name="selene-2021",
        owner_collectives=True,
        overlap_efficiency=OVERLAP_EFFICIENCY_2021,
    )


def jean_zay(gpus: int) -> Any:
    """Jean Zay's A100 partition as BLOOM's paper describes it: 8 A100 80GB per node on
    NVLink, 4 x 100 Gb/s Omni-Path per node (6.25 GB/s per GPU), otherwise the 2021
    constants of :func:`cluster_2021`.

    Example:
        >>> jean_zay(384).inter.bandwidth
        6250000000.0
    """
    from cost_models.cluster import LinkLevel

    base = cluster_2021(gpus)
    opa = LinkLevel(
        "infiniband",
        4 * 100e9 / 8 / GPUS_PER_NODE,
        base.inter.latency,
        "BLOOM paper / reference README: 4 x 100 Gb/s Omni-Path per node = 6.25 GB/s per "
        "GPU; latency as InfiniBand (NCCL tuning.cc network hop)",
    )
    return replace(base, name="jean-zay", inter=opa)


def evaluate_run(run: PublishedRun, overlap_efficiency: float | None = None) -> dict[str, Any]:
    """The planner's evaluation of ``run``'s fixed configuration; the table's row as a dict
    (``error`` on failure). ``overlap_efficiency`` replaces the cluster's (for
    :func:`fit_overlap_efficiency`).

    Example:
        >>> r = evaluate_run(published_runs(["t1-1.7b"])[0])  # doctest: +SKIP
        >>> abs(r["err"]) < 0.5  # doctest: +SKIP
        True
    """
    import autopar
    from autopar.lower.split import plan_accumulation
    from autopar.search.outer import price_pipeline
    from autopar.search.stages import evaluate_pipeline
    from benchmarks.bench_scale import _one_stage
    from benchmarks.models.gpt import GPTConfig, make_train_step
    from cost_models.memory import megatron_flops_per_iteration

    out: dict[str, Any] = {
        "row": run.name,
        "group": run.group,
        "gpus": run.gpus,
        "published": run.published_tflops,
    }
    t0 = time.perf_counter()
    try:
        cfg = GPTConfig(
            vocab_size=run.vocab, seq_len=run.seq, hidden=run.hidden, layers=run.layers,
            heads=run.heads, scan_layers=run.layers % run.pipeline == 0,
        )  # fmt: skip
        step, args = make_train_step(cfg, run.global_batch)
        cluster = jean_zay(run.gpus) if run.cluster == "jean-zay" else cluster_2021(run.gpus)
        if overlap_efficiency is not None:
            cluster = replace(cluster, overlap_efficiency=overlap_efficiency)
        graph = autopar.trace(step, *args)
        m = run.microbatches
        schedule, v = run.schedule()
        inner_mesh = {"data": run.data, "tensor": run.tensor}
        if run.zero_stage == 3:
            inner_mesh = {"data": run.data}
            inner = autopar.baselines.zero(step, inner_mesh, 3, *args, pad=True)
        elif run.zero_stage == 1:
            inner = autopar.baselines.zero(
                step, inner_mesh, 1, *args, tensor_axis="tensor", pad=True
            )
        else:
            inner = autopar.baselines.megatron(step, inner_mesh, *args)
        acc = plan_accumulation(step, args, m, full=graph)
        if run.pipeline > 1:
            mesh = {"pipe": run.pipeline, **inner_mesh}
            _, ev = price_pipeline(
                step, args, graph, cluster, mesh, m, schedule, v, "full", inner, acc,
                MEMORY_LIMIT, reduce_after_flush=run.reduces_after_flush,
            )  # fmt: skip
        else:
            ev = evaluate_pipeline(
                graph, _one_stage(graph, inner, m), cluster, acc, memory_limit_bytes=MEMORY_LIMIT,
                reduce_after_flush=run.reduces_after_flush,
            )  # fmt: skip
        flops = megatron_flops_per_iteration(
            run.global_batch, run.seq, run.layers, run.hidden, run.vocab, recompute=True
        )
        # The evaluation's step with overlap bounded by compute, for the program the run
        # ran: Megatron-LM and Megatron-DeepSpeed reduce gradients once, after the flush
        # (``after_flush_step_s``); DeepSpeed's ZeRO-3 reduce-scatters them bucketed
        # during the backward pass, as the planner's program does in every microbatch.
        bounded = (
            float(ev.extra["after_flush_step_s"])
            if run.reduces_after_flush
            else float(ev.overlap_step_time_s)
        )
        pred = flops / bounded / run.gpus / 1e12
        out.update(
            config=_config_text(run),
            step_s=bounded,
            linear_step_s=ev.step_time_s,
            linear_predicted=flops / ev.step_time_s / run.gpus / 1e12,
            predicted=pred,
            err=pred / run.published_tflops - 1.0,
            memory_gib=ev.memory_bytes_per_device / 2**30,
            compute_s=ev.compute_s,
            exposed_comm_s=ev.exposed_communication_s,
            raw_compute_s=float(ev.extra.get("raw_compute_s", ev.compute_s)),
            hideable_s=float(ev.extra.get("dp_grad_per_device_s", 0.0))
            + float(ev.extra.get("fsdp_gather_per_device_s", 0.0)),
            stage_exposed_s=float(ev.extra.get("stage_exposed_collectives_s", 0.0)),
            comm_by_class=dict(ev.communication_by_class),
            bubble_s=float(ev.extra.get("bubble_s", 0.0)) if ev.extra else 0.0,
        )
    except Exception as e:  # one failing row should not end the table
        out["error"] = f"{type(e).__name__}: {e}"
    out["eval_s"] = time.perf_counter() - t0
    out["within"] = "error" not in out and abs(out["err"]) <= TOLERANCE[run.group]
    return out


def fit_overlap_efficiency(
    names: list[str] | None = None, lo: float = 0.0, hi: float = 0.6, steps: int = 16
) -> float:
    """The ``overlap_efficiency`` minimising the squared log error of the planner's
    evaluation over the runs ``names`` (default: Table 2's six ZeRO-3 rows, the only
    published runs whose step hides communication behind compute: a pure data-parallel
    step whose parameter gathers and gradient reduce-scatters run beside the layers).

    Golden-section search over ``[lo, hi]``, ``steps`` narrowings;
    ``cost_models.cluster.OVERLAP_EFFICIENCY_2021`` is this, rounded to two digits.
    Slow: six 175B / 530B evaluations per step.

    Example:
        >>> round(fit_overlap_efficiency(), 2)  # doctest: +SKIP
        0.27
    """
    import math

    from autopar.errors import AutoparError
    from cost_models.fit import golden_section

    runs = published_runs(names or [r.name for r in published_runs() if r.zero_stage == 3])

    def loss(eta: float) -> float:
        rows = [evaluate_run(r, overlap_efficiency=eta) for r in runs]
        bad = [r["row"] for r in rows if "error" in r]
        if bad:
            raise AutoparError(
                f"fit_overlap_efficiency: rows {bad} could not be evaluated at "
                f"overlap_efficiency={eta!r}: {[r['error'] for r in rows if 'error' in r]}"
            )
        return sum(math.log1p(r["err"]) ** 2 for r in rows)

    return golden_section(loss, lo, hi, steps)


def _config_text(run: PublishedRun) -> str:
    schedule, v = run.schedule()
    sched = "-" if run.pipeline == 1 else schedule + (f" v={v}" if v > 1 else "")
    zero = f" zero{run.zero_stage}" if run.zero_stage else ""
    return (
        f"t{run.tensor} p{run.pipeline} d{run.data} b{run.microbatch} m{run.microbatches} "
        f"{sched}{zero} remat full"
    )


COLUMNS = (
    "run", "GPUs", "configuration", "published", "predicted", "err", "target", "linear", "GiB",
)  # fmt: skip


def cells(r: dict[str, Any]) -> list[str]:
    """One row's cells in :data:`COLUMNS` order."""
    tol = TOLERANCE[r["group"]]
    if "error" in r:
        return [r["row"], str(r["gpus"]), r["error"][:120], f"{r['published']:g}"] + [""] * 5
    return [
        r["row"],
        str(r["gpus"]),
        r["config"],
        f"{r['published']:g}",
        f"{r['predicted']:.1f}",
        f"{r['err']:+.1%}",
        f"±{tol:.0%} {'ok' if r['within'] else 'MISS'}",
        f"{r['linear_predicted']:.1f}",
        f"{r['memory_gib']:.1f}",
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", nargs="+", metavar="NAME", help="rows by name")
    parser.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    a = parser.parse_args(argv)
    try:
        runs = published_runs(a.rows)
    except ValueError as e:
        parser.error(str(e))
    from benchmarks.bench_scale import _table, write_json

    results, rows = [], []
    for run in runs:
        r = evaluate_run(run)
        results.append(r)
        rows.append(cells(r))
        print("  " + " | ".join(rows[-1]) + f"  ({r['eval_s']:.0f} s)", flush=True)
    print(
        _table(
            "Published runs vs the planner's evaluation of the traced zoo GPT "
            "(configuration fixed; TFLOP/s per GPU, recomputation counted)",
            COLUMNS,
            rows,
        )
    )
    for r in results:
        if "error" not in r:
            comm = ", ".join(f"{k} {v:.2f}" for k, v in r["comm_by_class"].items() if v > 0)
            print(
                f"{r['row']}: step {r['step_s']:.2f} s (linear {r['linear_step_s']:.2f}); per "
                f"device: raw compute {r['raw_compute_s']:.2f}, the stages' overlappable "
                f"collectives {r['hideable_s']:.2f} and other collectives "
                f"{r['stage_exposed_s']:.2f}, bubble {r['bubble_s']:.2f} (the schedule's "
                f"comm by class: {comm or 'none'})"
            )
    if a.json:
        write_json(results, a.json)
    return 0 if all(r["within"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
