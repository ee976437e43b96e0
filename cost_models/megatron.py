"""An analytic Megatron-LM GPT iteration, built from this package's pieces, vs the paper.

``estimate_iteration`` predicts one training iteration of a GPT under Megatron-LM's PTD-P
(tensor x pipeline x data parallelism, Narayanan et al. SC'21) or DeepSpeed ZeRO-3 on a
cluster, from first principles: the roofline (compute.py) for every GEMM, attention batched
matmul and fused elementwise kernel of a transformer layer; ring/hierarchical collectives
(collectives.py) for tensor-parallel all-reduces, pipeline sends, data-parallel gradient
all-reduces and ZeRO-3 gathers; the event-driven pipeline simulator (pipeline.py) for the
schedule; and the overlap model (overlap.py). It is a check of the cost model against
published measurements (Tables 1 and 2, ../shared/reference), not part of the planner.

ONE set of constants serves every row; nothing is tuned per row:

* the ``dgx-a100-80gb`` cluster preset as it is (NVLink 230 GB/s and InfiniBand 25 GB/s
  per GPU bus bandwidth, NCCL per-step latencies), wrapped by
  :func:`selene`;
* the default matmul efficiency curve (``half_dim`` 64, HBM fraction 0.88) with its
  ``peak_fraction`` set to 0.69: fitted once, by least squares on log throughput over all
  ten Table 1 rows (:func:`fit_peak_fraction`). It stands for what Megatron-LM's 2021
  kernels (PyTorch + cuBLAS on A100) reached on large GEMMs, 84% of the default curve's
  H200-measured 0.82. The 2021 ``overlap_efficiency`` (``OVERLAP_EFFICIENCY_2021``,
  cluster.py, 0.27) is the only other fitted number, fitted by the planner's evaluation
  on Table 2's six ZeRO-3 rows (PTD-P rows do not overlap communication) and used here as
  it is;
* the workload constants of :class:`Assumptions`: the fused-kernel traffic of a Megatron
  layer (listed in ``_layer_times``), fp16 activations and gradients, full activation
  recomputation, scatter/gather pipeline sends, gradients all-reduced after the pipeline
  flush (no overlap, as Megatron-LM 2021);
* microbatch b = 1 unless the table gives it (the repo's 175B script uses 1), and v = the
  smallest divisor >= 2 of the layers per stage when p > 1 (the paper does not give v);
* DeepSpeed ZeRO-3: per microbatch, every layer's parameters are all-gathered twice, one
  collective per module (forward; recomputed forward, kept for the backward that follows)
  and its gradients reduce-scattered once, over
  the whole data-parallel group; :func:`selene` sets ``owner_collectives`` (the ZeRO
  paper's per-owner broadcasts / reduces, one GPU's NIC on the whole buffer: 2021's
  software generation), since NCCL's own all-gather over all NICs would put ZeRO-3 at
  ~190 TFLOP/s on 1536 GPUs, far above the published 44.

This closed form is a cross-check kept beside the tests (``tests/cost_models/test_megatron.py``,
the docs' published-runs page), not the validated model: ``benchmarks/bench_published.py``
prices the same runs by the planner's own evaluation of the traced GPT.

Run ``python -m cost_models.megatron`` for the comparison table.

Example:
    >>> est = estimate_iteration(GPT(l=96, h=12288, a=96), Parallel(t=8, p=12, d=4, B=1536))
    >>> 130 < est.tflops_per_gpu < 175
    True
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Literal

from cost_models.cluster import OVERLAP_EFFICIENCY_2021, Cluster
from cost_models.collectives import collective_time
from cost_models.compute import compute_time
from cost_models.efficiency import Efficiency
from cost_models.errors import CostModelError, check_choice, check_int
from cost_models.fit import golden_section
from cost_models.memory import gpt_num_params, megatron_flops_per_iteration
from cost_models.overlap import compose_step_time
from cost_models.pipeline import simulate_schedule

Scheme = Literal["ptdp", "zero3"]


@dataclass(frozen=True)
class GPT:
    """A GPT's shape: layers l, hidden h, heads a, vocabulary V, sequence s."""

    l: int  # noqa: E741 (the paper's name)
    h: int
    a: int
    V: int = 51200
    s: int = 2048

    def __post_init__(self) -> None:
        for name in ("l", "h", "a", "V", "s"):
            check_int(f"GPT.{name}", getattr(self, name))
        if self.h % self.a:
            raise CostModelError(f"hidden {self.h} is not divisible by heads {self.a}")

    @property
    def num_params(self) -> float:
        """Megatron's P = 12 l h^2 (1 + 13/(12h) + (V+s)/(12 l h))."""
        return gpt_num_params(self.l, self.h, self.V, self.s)


@dataclass(frozen=True)
class Parallel:
    """How the GPT is split: t tensor, p pipeline, d data parallel, global batch B,
    microbatch b, v chunks per pipeline stage (None: the default rule), and the scheme."""

    t: int = 1
    p: int = 1
    d: int = 1
    B: int = 512
    b: int = 1
    v: int | None = None
    scheme: Scheme = "ptdp"

    def __post_init__(self) -> None:
        for name in ("t", "p", "d", "B", "b"):
            check_int(f"Parallel.{name}", getattr(self, name))
        if self.v is not None:
            check_int("Parallel.v", self.v)
        check_choice("Parallel.scheme", self.scheme, ("ptdp", "zero3"))
        if self.scheme == "zero3" and (self.t, self.p) != (1, 1):
            raise CostModelError("scheme 'zero3' is pure data parallel: t and p must be 1")
        if self.B % (self.d * self.b):
            raise CostModelError(
                f"global batch {self.B} does not split into d={self.d} x b={self.b} microbatches"
            )

    @property
    def gpus(self) -> int:
        """t * p * d."""
        return self.t * self.p * self.d

    @property
    def microbatches(self) -> int:
        """m = B / (d b), microbatches per pipeline per iteration."""
        return self.B // (self.d * self.b)


@dataclass(frozen=True)
class Assumptions:
    """The workload constants of the Megatron estimate (one set for every row).

    The hardware constants (matmul efficiency, links, overlap) live in the cluster; see
    :func:`selene`.
    """

    act_bytes: int = 2  # fp16 activations (the paper trains in fp16 mixed precision)
    grad_bytes: int = 2  # fp16 gradients in the data-parallel all-reduce / reduce-scatter
    # Mixed-precision Adam step, HBM bytes per parameter: fp16 grad -> fp32 copy (2 + 4),
    # unscale + inf check (4 + 4), grad norm (4), fused Adam (read grad, param, m, v; write
    # param, m, v: 28), fp32 -> fp16 param copy (4 + 2).
    optimizer_bytes_per_param: int = 52
    # Backward elementwise kernels read a saved input and the incoming gradient and write
    # one gradient: 3 tensors where the forward kernel touched 2.
    backward_elementwise_factor: float = 1.5
    scatter_gather: bool = True
    # Megatron-LM 2021 all-reduces gradients after the pipeline flush, not during backward.
    overlap_dp_grad: bool = False
    source: str = ""


MEGATRON_2021 = Assumptions(
    source="Narayanan et al. SC'21 setup: fp16, full recompute, scatter/gather, Selene DGX A100",
)
# Fitted once: the value of ``fit_peak_fraction()`` over all ten Table 1 rows, rounded.
MEGATRON_2021_PEAK_FRACTION = 0.69
MEGATRON_2021_EFFICIENCY = Efficiency(
    peak_fraction=MEGATRON_2021_PEAK_FRACTION,
    source="matmul peak_fraction fitted once to Megatron-LM 2021 Table 1 (all ten rows, "
    "log least squares); half_dim 64 and HBM fraction 0.88 as the default curve",
)


@dataclass(frozen=True)
class IterationEstimate:
    """A predicted iteration.

    Attributes:
        time_s: seconds per iteration.
        tflops_per_gpu: the paper's accounting: F(B, s, l, h, V) / (time * gpus).
        breakdown: seconds by part, summing to ``time_s``: ``compute`` (the busiest
            device's compute, optimizer step included), ``bubble`` and the *exposed*
            seconds of each communication class (``tensor``, ``dp_grad``,
            ``fsdp_gather``); ``optimizer`` repeats the optimizer step's share of compute.
        chunks: v used.
        microbatches: m used.
    """

    time_s: float
    tflops_per_gpu: float
    breakdown: Mapping[str, float] = field(default_factory=dict)
    chunks: int = 1
    microbatches: int = 1


def default_chunks(layers: int, p: int, m: int) -> int:
    """v: 1 without a pipeline; else the smallest divisor >= 2 of layers per stage.

    Falls back to 1 when no divisor exists or m is not a multiple of p (the interleaved
    schedule needs both).

    Example:
        >>> default_chunks(105, 35, 280), default_chunks(60, 4, 56), default_chunks(24, 1, 16)
        (3, 3, 1)
    """
    if p == 1 or m % p or layers % p:
        return 1
    per_stage = layers // p
    for v in range(2, per_stage + 1):
        if per_stage % v == 0:
            return v
    return 1


def selene(gpus: int, efficiency: Efficiency = MEGATRON_2021_EFFICIENCY) -> Cluster:
    """The paper's cluster (Selene: DGX A100 80GB nodes) with ``gpus`` GPUs, 8 per node.

    The ``dgx-a100-80gb`` preset as it is, except that the A100's matmul efficiency is
    :data:`MEGATRON_2021_EFFICIENCY` (what Megatron-LM's 2021 kernels reached) and that
    all-gathers / reduce-scatters across nodes are ZeRO's per-owner collectives
    (``owner_collectives``, DeepSpeed's 2021 ZeRO-3) and the overlap efficiency is 2021's
    (``OVERLAP_EFFICIENCY_2021``). Use this cluster to score Megatron
    configurations with the rest of the cost model too.

    Example:
        >>> selene(16).device.efficiency.peak_fraction
        0.69
    """
    if gpus % 8:
        raise CostModelError(f"Selene nodes hold 8 GPUs; {gpus} GPUs do not fill nodes")
    base = Cluster.preset("dgx-a100-80gb", nodes=gpus // 8)
    device = replace(base.device, efficiency=efficiency)
    return replace(
        base,
        name="selene",
        device=device,
        owner_collectives=True,
        overlap_efficiency=OVERLAP_EFFICIENCY_2021,
    )


@dataclass(frozen=True)
class _LayerTimes:
    fwd_compute: float  # one layer, one microbatch, one GPU
    bwd_compute: float  # backward only (no recompute)
    tp_allreduce: float  # one all-reduce of b s h activations over the tensor axis


def _layer_times(
    model: GPT, par: Parallel, cluster: Cluster, mesh: Mapping[str, int], asm: Assumptions
) -> _LayerTimes:
    """Per-kernel roofline of one transformer layer (Megatron-LM 2021 kernels, t-way TP)."""
    dev, eff, by = cluster.device, cluster.device.efficiency, asm.act_bytes
    s, b, h, a, t = model.s, par.b, model.h, model.a, par.t
    tokens = b * s
    dh = h // a
    heads = a / t

    def gemm(m: float, n: float, k: float) -> float:
        return compute_time(
            2.0 * m * n * k, (m * k + k * n + m * n) * by, dev, "float16", "matmul", (m, n, k), eff
        )

    gemm_fwd = (
        gemm(tokens, 3 * h / t, h)  # QKV
        + gemm(tokens, h, h / t)  # attention output projection
        + gemm(tokens, 4 * h / t, h)  # MLP up
        + gemm(tokens, h, 4 * h / t)  # MLP down
    )
    # Attention core as batched matmuls: scores = Q K^T and context = P V, b*a/t batches.
    bmm_flops = 2.0 * b * heads * s * s * dh
    qk = compute_time(
        bmm_flops,
        (2 * b * heads * s * dh + b * heads * s * s) * by,
        dev,
        "float16",
        "matmul",
        (b * heads * s, s, dh),
        eff,
    )
    pv = compute_time(
        bmm_flops,
        (b * heads * s * s + 2 * b * heads * s * dh) * by,
        dev,
        "float16",
        "matmul",
        (b * heads * s, dh, s),
        eff,
    )
    # Fused elementwise kernels, bytes read + written per layer (no sequence parallelism):
    # 2 LayerNorms 2 x 4 sbh; scale-mask-softmax 4 a s^2 b / t; attention dropout
    # 5 a s^2 b / t (1-byte mask); 2 bias-dropout-add 2 x 7 sbh; bias-GeLU 16 sbh / t.
    sbh = float(s) * b * h
    ew_bytes = 22.0 * sbh * by / 2 + 16.0 * sbh / t * by / 2 + 9.0 * a * s * s * b / t * by / 2
    ew = compute_time(0.0, ew_bytes, dev, "float16", "elementwise", None, eff)
    fwd = gemm_fwd + qk + pv + ew
    bwd = 2.0 * (gemm_fwd + qk + pv) + asm.backward_elementwise_factor * ew
    ar = collective_time("all-reduce", sbh * by, cluster, mesh, ["tensor"]) if t > 1 else 0.0
    return _LayerTimes(fwd, bwd, ar)


def estimate_iteration(
    model: GPT,
    par: Parallel,
    cluster: Cluster | None = None,
    assumptions: Assumptions = MEGATRON_2021,
) -> IterationEstimate:
    """Predict one training iteration (see the module docstring for what is modelled).

    Args:
        model: the GPT.
        par: the parallel configuration (``scheme="ptdp"`` or ``"zero3"``).
        cluster: defaults to :func:`selene` with ``par.gpus`` GPUs.
        assumptions: the constants; :data:`MEGATRON_2021` by default.

    Example:
        >>> z = estimate_iteration(GPT(96, 12288, 96), Parallel(d=1536, B=1536, scheme="zero3"))
        >>> z.tflops_per_gpu < 80
        True
    """
    cluster = selene(par.gpus) if cluster is None else cluster
    if cluster.num_devices < par.gpus:
        raise CostModelError(
            f"{par.gpus} GPUs needed, cluster {cluster.name!r} has {cluster.num_devices}"
        )
    if model.l % par.p:
        raise CostModelError(f"{model.l} layers do not split over p={par.p} stages")
    mesh = {"pipe": par.p, "data": par.d, "tensor": par.t}  # Megatron's rank order
    asm = assumptions
    lt = _layer_times(model, par, cluster, mesh, asm)
    if par.scheme == "zero3":
        return _zero3(model, par, cluster, mesh, asm, lt)
    return _ptdp(model, par, cluster, mesh, asm, lt)


def _head_and_embedding(
    model: GPT, par: Parallel, cluster: Cluster, asm: Assumptions
) -> tuple[float, float]:
    """(forward, backward) seconds of the vocabulary-parallel output layer + cross-entropy."""
    dev, eff, by = cluster.device, cluster.device.efficiency, asm.act_bytes
    tokens = par.b * model.s
    vt = model.V / par.t
    m, n, k = tokens, vt, model.h
    logits = compute_time(
        2.0 * m * n * k, (m * k + k * n + m * n) * by, dev, "float16", "matmul", (m, n, k), eff
    )
    # fp32 softmax cross-entropy over the logits: ~12 bytes per logit each way
    ce = compute_time(0.0, 12.0 * tokens * vt, dev, "float16", "elementwise", None, eff)
    return logits + ce, 2.0 * logits + ce


def _ptdp(
    model: GPT,
    par: Parallel,
    cluster: Cluster,
    mesh: Mapping[str, int],
    asm: Assumptions,
    lt: _LayerTimes,
) -> IterationEstimate:
    p, t, m = par.p, par.t, par.microbatches
    v = par.v if par.v is not None else default_chunks(model.l, p, m)
    per_stage = model.l // p
    head_f, head_b = _head_and_embedding(model, par, cluster, asm)
    sbh_bytes = float(model.s) * par.b * model.h * asm.act_bytes
    ar = lt.tp_allreduce
    # per stage, one microbatch: compute and tensor-parallel all-reduces (2 fwd, 2 recompute,
    # 2 bwd per layer; the embedding's fwd all-reduce on stage 0, the output layer's input
    # gradient all-reduce on the last stage)
    fwd_c = [per_stage * lt.fwd_compute for _ in range(p)]
    bwd_c = [per_stage * (lt.fwd_compute + lt.bwd_compute) for _ in range(p)]
    fwd_tp = [per_stage * 2 * ar for _ in range(p)]
    bwd_tp = [per_stage * 4 * ar for _ in range(p)]
    fwd_c[-1] += head_f
    bwd_c[-1] += head_b
    fwd_tp[0] += ar
    bwd_tp[-1] += ar
    fwd = [c + x for c, x in zip(fwd_c, fwd_tp, strict=True)]
    bwd = [c + x for c, x in zip(bwd_c, bwd_tp, strict=True)]
    if p > 1:
        send = collective_time(
            "p2p", sbh_bytes / (t if asm.scatter_gather else 1), cluster, mesh, ["pipe"]
        )
        gather = (
            collective_time("all-gather", sbh_bytes, cluster, mesh, ["tensor"])
            if asm.scatter_gather
            else 0.0
        )
        sched = simulate_schedule(
            "interleaved-1f1b" if v > 1 else "1f1b", fwd, bwd, m, p2p=send + gather, chunks=v
        )
        makespan = sched.makespan
        busiest = max(range(p), key=lambda i: sched.busy[i])
    else:
        makespan = m * (fwd[0] + bwd[0])
        busiest = 0
    compute_s = m * (fwd_c[busiest] + bwd_c[busiest])
    tensor_s = m * (fwd_tp[busiest] + bwd_tp[busiest])
    bubble_s = makespan - compute_s - tensor_s

    # data-parallel gradient all-reduce: the stage holding the most parameters decides
    layer_params = 12.0 * model.h**2 + 13.0 * model.h
    stage_params = per_stage * layer_params / t
    embed = model.V * model.h / t
    first = stage_params + embed + model.s * model.h
    last = stage_params + (embed if p > 1 else 0.0) + 2 * model.h
    params_gpu = max(first, last) if p > 1 else first + 2 * model.h
    dp = collective_time("all-reduce", params_gpu * asm.grad_bytes, cluster, mesh, ["data"])
    if p > 1:  # tied word embeddings: first and last stage all-reduce their gradient
        emb_mesh = {"pipe": 2, "rest": par.d * t}
        dp += collective_time("all-reduce", embed * asm.grad_bytes, cluster, emb_mesh, ["pipe"])
    opt = compute_time(
        0.0, params_gpu * asm.optimizer_bytes_per_param, cluster.device, kind="elementwise"
    )
    bwd_for_overlap = m * bwd_c[busiest] if asm.overlap_dp_grad else 0.0
    step = compose_step_time(
        compute_s + opt,
        {"tensor": tensor_s, "dp_grad": dp},
        bwd_for_overlap,
        cluster.overlap_efficiency,
        bubble_s=max(bubble_s, 0.0),
    )
    return _result(model, par, step.total_s, {**step.breakdown, "optimizer": opt}, v, m)


def _zero3(
    model: GPT,
    par: Parallel,
    cluster: Cluster,
    mesh: Mapping[str, int],
    asm: Assumptions,
    lt: _LayerTimes,
) -> IterationEstimate:
    m = par.microbatches
    head_f, head_b = _head_and_embedding(model, par, cluster, asm)
    fwd = model.l * lt.fwd_compute + head_f
    bwd = model.l * (lt.fwd_compute + lt.bwd_compute) + head_b
    h = model.h
    layer_bytes = (12.0 * h**2 + 13.0 * h) * asm.grad_bytes
    # A layer's modules, whose parameters DeepSpeed fetches together (each module's
    # pre-forward / pre-backward hook): two layer norms, QKV, the projection, two MLP
    # linears; 12 h^2 + 13 h parameters in all.
    modules = [2 * h, 3 * h * h + 3 * h, h * h + h, 2 * h, 4 * h * h + 4 * h, 4 * h * h + h]
    embed_bytes = (model.V + model.s) * model.h * asm.grad_bytes

    def ag(nbytes: float) -> float:
        return collective_time("all-gather", nbytes, cluster, mesh, ["data"])

    def rs(nbytes: float) -> float:
        return collective_time("reduce-scatter", nbytes, cluster, mesh, ["data"])

    # Per microbatch, each module's parameters are gathered for the forward and for the
    # recomputed forward, whose gathered parameters its backward, which follows at once,
    # reuses (DeepSpeed keeps a parameter due again within ``stage3_max_reuse_distance``);
    # each layer's gradient is reduce-scattered once. Embeddings: gathered for forward and
    # backward, reduce-scattered once.
    gather = m * (2 * model.l * sum(ag(k * asm.grad_bytes) for k in modules) + 2 * ag(embed_bytes))
    scatter = m * (model.l * rs(layer_bytes) + rs(embed_bytes))
    params_gpu = model.num_params / par.d
    opt = compute_time(
        0.0, params_gpu * asm.optimizer_bytes_per_param, cluster.device, kind="elementwise"
    )
    compute_s = m * (fwd + bwd)
    step = compose_step_time(
        compute_s + opt,
        {"fsdp_gather": gather, "dp_grad": scatter},
        m * bwd,
        cluster.overlap_efficiency,
    )
    return _result(model, par, step.total_s, {**step.breakdown, "optimizer": opt}, 1, m)


def _result(
    model: GPT, par: Parallel, time_s: float, breakdown: Mapping[str, float], v: int, m: int
) -> IterationEstimate:
    flops = megatron_flops_per_iteration(par.B, model.s, model.l, model.h, model.V)
    return IterationEstimate(
        time_s=time_s,
        tflops_per_gpu=flops / (time_s * par.gpus) / 1e12,
        breakdown=dict(breakdown),
        chunks=v,
        microbatches=m,
    )


# ---------------------------------------------------------------------- published rows

# Narayanan et al. SC'21, Table 1 (../shared/reference/megatron2021_table1.csv):
# (params_b, heads, hidden, layers, tensor, pipeline, gpus, global_batch, tflops_per_gpu)
TABLE1: tuple[tuple[float, int, int, int, int, int, int, int, float], ...] = (
    (1.7, 24, 2304, 24, 1, 1, 32, 512, 137),
    (3.6, 32, 3072, 30, 2, 1, 64, 512, 138),
    (7.5, 32, 4096, 36, 4, 1, 128, 512, 142),
    (18.4, 48, 6144, 40, 8, 1, 256, 1024, 135),
    (39.1, 64, 8192, 48, 8, 2, 512, 1536, 138),
    (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140),
    (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148),
    (310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155),
    (529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163),
    (1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163),
)
# Table 2 (../shared/reference/megatron2021_table2.csv):
# (scheme, params_b, tensor, pipeline, global_batch, gpus, microbatch, tflops_per_gpu)
TABLE2: tuple[tuple[str, float, int, int, int, int, int, float], ...] = (
    ("zero3", 174.6, 1, 1, 1536, 384, 4, 144),
    ("zero3", 174.6, 1, 1, 1536, 768, 2, 88),
    ("zero3", 174.6, 1, 1, 1536, 1536, 1, 44),
    ("zero3", 529.6, 1, 1, 2560, 640, 4, 138),
    ("zero3", 529.6, 1, 1, 2240, 1120, 2, 98),
    ("zero3", 529.6, 1, 1, 2240, 2240, 1, 48),
    ("ptdp", 174.6, 8, 12, 1536, 384, 1, 153),
    ("ptdp", 174.6, 8, 12, 1536, 768, 1, 149),
    ("ptdp", 174.6, 8, 12, 1536, 1536, 1, 141),
    ("ptdp", 529.6, 8, 35, 2240, 560, 1, 171),
    ("ptdp", 529.6, 8, 35, 2240, 1120, 1, 167),
    ("ptdp", 529.6, 8, 35, 2240, 2240, 1, 159),
)
# The two Table 2 models (the paper's GPT-3 175B and 530B shapes).
TABLE2_MODELS = {174.6: GPT(l=96, h=12288, a=96), 529.6: GPT(l=105, h=20480, a=128)}


@dataclass(frozen=True)
class Row:
    """One published row and our prediction for it."""

    table: int
    label: str
    model: GPT
    par: Parallel
    published: float
    estimate: IterationEstimate

    @property
    def error(self) -> float:
        """(predicted - published) / published."""
        return self.estimate.tflops_per_gpu / self.published - 1.0


def table1(
    efficiency: Efficiency = MEGATRON_2021_EFFICIENCY, labels: Sequence[str] | None = None
) -> list[Row]:
    """Our predictions for Table 1's rows (all, or those whose label is in ``labels``).

    b = 1, v by :func:`default_chunks`, on :func:`selene` with ``efficiency``.

    Example:
        >>> [round(r.error, 2) for r in table1(labels=["1.7B"])]
        [0.01]
    """
    rows = []
    for params_b, a, h, l, t, p, gpus, B, tf in TABLE1:  # noqa: E741
        label = f"{params_b}B"
        if labels is not None and label not in labels:
            continue
        model = GPT(l=l, h=h, a=a)
        par = Parallel(t=t, p=p, d=gpus // (t * p), B=B, b=1)
        est = estimate_iteration(model, par, selene(gpus, efficiency))
        rows.append(Row(1, label, model, par, tf, est))
    return rows


def table2(
    efficiency: Efficiency = MEGATRON_2021_EFFICIENCY, labels: Sequence[str] | None = None
) -> list[Row]:
    """Our predictions for Table 2's rows (labels like ``"zero3 174.6B x384"``)."""
    rows = []
    for scheme, params_b, t, p, B, gpus, b, tf in TABLE2:
        label = f"{scheme} {params_b}B x{gpus}"
        if labels is not None and label not in labels:
            continue
        model = TABLE2_MODELS[params_b]
        par = Parallel(t=t, p=p, d=gpus // (t * p), B=B, b=b, scheme=scheme)  # type: ignore[arg-type]
        est = estimate_iteration(model, par, selene(gpus, efficiency))
        rows.append(Row(2, label, model, par, tf, est))
    return rows


def fit_peak_fraction(
    rows_fn: Callable[..., list[Row]] = table1, lo: float = 0.3, hi: float = 1.0
) -> float:
    """The matmul ``peak_fraction`` minimising the squared log error over ``rows_fn``'s rows.

    Golden-section search; :data:`MEGATRON_2021_PEAK_FRACTION` is this over Table 1,
    rounded to two digits.
    """

    def loss(pf: float) -> float:
        rows = rows_fn(Efficiency(peak_fraction=pf))
        return sum(math.log(r.estimate.tflops_per_gpu / r.published) ** 2 for r in rows)

    return golden_section(loss, lo, hi)


def _print_tables() -> None:  # pragma: no cover - CLI output
    from rich.console import Console
    from rich.table import Table

    console = Console(width=200)
    for title, rows in (
        ("Megatron-LM 2021 Table 1 (PTD-P, weak scaling)", table1()),
        ("Megatron-LM 2021 Table 2 (PTD-P vs ZeRO-3)", table2()),
    ):
        tab = Table(title=title)
        for col in (
            "model",
            "t",
            "p",
            "d",
            "b",
            "v",
            "m",
            "published",
            "predicted",
            "error",
            "compute",
            "tensor",
            "bubble",
            "dp/rs",
            "gather",
            "iter s",
        ):
            tab.add_column(col, justify="right")
        for r in rows:
            e, bd = r.estimate, r.estimate.breakdown
            tab.add_row(
                r.label,
                str(r.par.t),
                str(r.par.p),
                str(r.par.d),
                str(r.par.b),
                str(e.chunks),
                str(e.microbatches),
                f"{r.published:.0f}",
                f"{e.tflops_per_gpu:.1f}",
                f"{100 * r.error:+.1f}%",
                f"{bd.get('compute', 0):.2f}",
                f"{bd.get('tensor', 0):.2f}",
                f"{bd.get('bubble', 0):.2f}",
                f"{bd.get('dp_grad', 0):.2f}",
                f"{bd.get('fsdp_gather', 0):.2f}",
                f"{e.time_s:.2f}",
            )
        console.print(tab)
    c = selene(8)
    e = c.device.efficiency
    console.print(
        f"constants: matmul peak_fraction={e.peak_fraction} half_dim={e.half_dim} "
        f"memory_fraction={e.memory_fraction}; links nvlink {c.intra.bandwidth / 1e9:.0f} GB/s, "
        f"IB {c.inter.bandwidth / 1e9:.0f} GB/s per GPU; overlap_efficiency {c.overlap_efficiency}"
    )


if __name__ == "__main__":  # pragma: no cover
    _print_tables()
