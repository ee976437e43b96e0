"""The 4D outer loop: pipeline stages x intra-op sub-mesh x microbatches, schedule, remat.

:func:`plan_outer` chooses the whole plan when the mesh is left open: how many pipeline
stages (``pipe``), which model-parallel group inside a node (``tensor``, ``seq``,
``expert``), how many data-parallel replicas, how many microbatches, which schedule
(1F1B or interleaved 1F1B and its ``virtual_stages``) and whether stages rematerialise.
It runs in three steps, each priced by the planner's own model:

1. **Profiles.** For every model-parallel group that fits in a node (the factorisations
   of ``1 .. devices_per_node`` over the model axes the graph offers), the step on one
   microbatch of one example per replica is solved by the intra-op search on that group
   and priced as a one-stage pipeline (:func:`autopar.search.stages.evaluate_pipeline`):
   a microbatch's forward and backward seconds, the update's, the state and activation
   bytes, and a layer boundary's bytes. Repeated layers are solved once (the search ties
   identical layers and a scanned stack to one body), so a profile of GPT-3 175B costs a
   few seconds whatever the cluster.
2. **Screen.** Every configuration (``pipe`` dividing the devices and at most the layer
   count, dividing it or not; data replicas the rest; microbatch sizes dividing the
   per-replica batch; 1F1B, interleaved 1F1B with 2 chunks when there are layers for them; stage
   remat none or full) is estimated from its group's profile in closed form
   (:func:`screen`): stages of ``1/p`` of the work (an unrolled stack, not
   interleaved: the inter-op split of :mod:`autopar.search.interop` from the profile's
   per-layer seconds, Alpa's ``sum t_s + (m - 1) max t_s``, and the finalist is priced
   with those layer ranges), 1F1B's ``(m + (p - 1)/v)``
   microbatch slots (an even split paced by its busiest device from the per-layer
   seconds: the head's and embedding's stages, :func:`_busiest_device`) and
   ``2 (p - 1)`` boundary sends, the data-parallel gradient
   reduce-scatter per microbatch (as the runtime runs it) and one all-gather per step,
   the update's share; memory, the stage's share of the state plus the in-flight
   activations (only the stage inputs under remat). A stage's share of the state is
   ``1/p`` of a scanned stack's and all the rest (``Profile.pipe_share``: unrolled
   layers and embeddings are whole on every stage), whose gradients pay an all-reduce
   over ``pipe`` after the flush. A microbatch of ``b`` examples costs
   ``b`` times one example's seconds and bytes here; the finalists are priced at their
   own size.
3. **Finalists.** The best screened configurations that fit (at least three, up to
   :data:`FINALISTS` while none fits or while the next one's screened time, corrected by
   the mean priced/screened ratio of those priced so far, beats the best that fits;
   none more, once three plans are priced (the whole cluster's meshes count), when the
   next one's screened time times the least priced/screened ratio known for it
   (:func:`_screen_floor`) does not beat the best that fits (:func:`_cannot_win`); at
   most two per stage count and group; picked one at a time: a group whose finalist
   priced over its screened memory has the rest of its screen scaled by that excess, a
   group not priced yet by the largest excess seen; when none of them fits, two more
   with the smallest screened footprints) are planned and priced in full:
   the intra-op search on their own sub-mesh at their own microbatch size, the stages'
   layouts pinned, the runtime's program priced by ``evaluate_pipeline``. That price is
   what the plan reports and what the finalists are compared by.

The un-pipelined plan (the intra-op search over the whole cluster's meshes) competes
with the finalists; every finalist priced is in the plan's shortlist, with why it lost,
and the next screened configurations fill it to at least :data:`FINALISTS` (marked as
screened only, with their estimates).

Example: the 2-layer MLP on four nodes, asked for two stages (the rest is searched).

    >>> p = autopar.plan(step, state, batch, cluster=Cluster.preset("dgx-a100-80gb", nodes=4),
    ...                  options=SearchOptions(pipeline_stages=2))
    >>> p.mesh["pipe"], p.pipeline.num_stages, len(p.shortlist) >= FINALISTS
    (2, 2, True)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import cost_models
from autopar.axes import AXES
from autopar.errors import (
    AccumulateError,
    AutoparError,
    InfeasiblePlanError,
    InvalidOptionError,
    SolveShardingError,
)
from autopar.options import SearchOptions
from autopar.plan import PipelinePlan, Plan
from autopar.search.costs import CostContext
from autopar.search.interop import layer_bytes, pipe_share, split_stages, stage_memory
from autopar.search.meshes import candidate_meshes, offered_axes
from autopar.trace.graph import Graph

FINALISTS = 5  # configurations priced in full (the shortlist needs at least five)
_FEWEST = 3  # finalists priced in full before the screen may stop the pricing
_RESCUES = 2  # more, smallest screened footprint first, when no finalist fits
_PER_SHAPE = 2  # at most this many finalists share a stage count and model group
_TIGHTEN = 2  # inner solves per finalist, the second under a bound tightened by the excess
_TIGHTER = 0.85  # ... to this fraction of what would just fit
_LEVER_FAILURES = 3  # screened ZeRO-1 variants not laid out before the lever is dropped
_FLOOR_SLACK = 1e-3  # a bound under the smallest footprint retries just over it
_SCREEN_SLACK = 1.10  # a screened footprint up to this over the bound may still fit
_UNTRACED = 0.02  # screened-time handicap of a microbatch count not traced yet (its trace
# costs seconds to tens of seconds at scale; the screen is 10-30% off its full price)
_MODEL_SPLITS = ("model", "sequence", "experts")
_GROUP_AXES = 2  # model axes in a stage's group (with data and pipe: four mesh axes)

__all__ = [
    "FINALISTS",
    "PipelineConfig",
    "Profile",
    "Screened",
    "configurations",
    "plain_options",
    "with_levers",
    "plan_outer",
    "price_pipeline",
    "screen",
]


@dataclass(frozen=True)
class PipelineConfig:
    """One plan shape the outer loop considers.

    Attributes:
        pipe: pipeline stages (1: no pipeline; the step is microbatched when
            ``microbatches > 1``).
        model: the model-parallel group inside a stage, axis -> size (``{}``: none).
        data: data-parallel replicas.
        microbatches: microbatches per step.
        microbatch_size: examples per replica per microbatch.
        schedule: ``"1f1b"`` or ``"interleaved-1f1b"`` (``"gpipe"`` when given).
        virtual_stages: chunks per device (interleaved only).
        remat: stage rematerialisation, ``"none"`` or ``"full"``.
        zero_stage: the ZeRO stage of the data replicas (1 or 2 split the optimizer
            state over ``data``, 3 the parameters too), inside the stages of a pipeline as
            without; ``None``: searched (:func:`screen` gives a pipeline ZeRO-1 when its
            stage fits with it and not without).

    Example:
        >>> c = PipelineConfig(4, {"tensor": 8}, 2, 16, 1, "1f1b", 1, "full")
        >>> c.mesh
        {'pipe': 4, 'data': 2, 'tensor': 8}
        >>> c.label
        'pipe 4 x data 2 x tensor 8, 1f1b, 16 microbatches of 1, remat full'
    """

    pipe: int
    model: Mapping[str, int]
    data: int
    microbatches: int
    microbatch_size: int
    schedule: str = "1f1b"
    virtual_stages: int = 1
    remat: str = "none"
    zero_stage: int | None = None

    @property
    def mesh(self) -> dict[str, int]:
        out = {"pipe": self.pipe} if self.pipe > 1 else {}
        if self.data > 1 or not self.model:
            out["data"] = self.data
        return {**out, **dict(self.model)}

    @property
    def sub_mesh(self) -> dict[str, int]:
        """The mesh inside a stage."""
        return {a: n for a, n in self.mesh.items() if a != "pipe"}

    @property
    def label(self) -> str:
        mesh = " x ".join(f"{a} {n}" for a, n in self.mesh.items())
        micro = f"{self.microbatches} microbatches of {self.microbatch_size}"
        zero = f", ZeRO-{self.zero_stage}" if self.zero_stage else ""
        if self.pipe == 1:
            return (f"{mesh}, {micro}" if self.microbatches > 1 else mesh) + zero
        sched = self.schedule + (f" v={self.virtual_stages}" if self.virtual_stages > 1 else "")
        return f"{mesh}, {sched}, {micro}, remat {self.remat}{zero}"


@dataclass(frozen=True)
class Profile:
    """One microbatch of ``microbatch_size`` examples on one model-parallel group, as the
    planner prices it (whole model, per device of the group).

    Attributes:
        model: the group (axis -> size; ``{}``: one device).
        microbatch_size: examples in the profiled microbatch.
        forward_s: a microbatch's forward seconds.
        backward_s: its backward seconds.
        update_s: the optimizer update's seconds (once per step).
        state_bytes: parameters, gradient accumulators and optimizer state.
        grad_bytes: the gradients a data-parallel replica all-reduces.
        activation_bytes: what one microbatch keeps for its backward.
        boundary_bytes: one layer's input (what a stage sends its neighbour).
        layers: the graph's layers (a scanned stack counts each iteration).
        scanned: whether the layers run as a scan over a stacked stack: a
            rematerialised stage then recomputes them one layer at a time
            (:func:`autopar.lower.stage_remat.remat_stages`).
        layer_forward_s / layer_backward_s: per layer, a microbatch's seconds (the
            embedding with the first layer, the head with the last:
            ``evaluate_pipeline(..., per_layer=True)``); empty when not profiled.
        layer_bytes: per layer, its share of the parameters and activations
            (:func:`autopar.search.interop.layer_bytes`), or ``None``.
        optimizer_share / param_share: the fractions of ``state_bytes`` that are
            optimizer state and parameters (what a fixed ZeRO stage splits over ``data``).
        pipe_share: the fraction of ``state_bytes`` (and of ``grad_bytes`` and
            ``update_s``) a pipeline splits over ``pipe``
            (:func:`autopar.search.interop.pipe_share`: a scanned stack's); the rest is
            whole on every stage, its gradients all-reduced over ``pipe``.
    """

    model: Mapping[str, int]
    microbatch_size: int
    forward_s: float
    backward_s: float
    update_s: float
    state_bytes: float
    grad_bytes: float
    activation_bytes: float
    boundary_bytes: float
    layers: int = 0
    scanned: bool = False
    layer_forward_s: tuple[float, ...] = ()
    layer_backward_s: tuple[float, ...] = ()
    layer_bytes: Any = None
    optimizer_share: float = 0.0
    param_share: float = 0.0
    pipe_share: float = 1.0


@dataclass(frozen=True)
class Screened:
    """A configuration's closed-form estimate (:func:`screen`)."""

    config: PipelineConfig
    step_time_s: float
    memory_bytes: float
    activation_bytes: float = 0.0  # of memory_bytes, what the in-flight microbatches hold
    stages: tuple[tuple[int, int], ...] | None = None  # the inter-op split (None: even)


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def batch_size(graph: Graph) -> int:
    """The step's global batch (the largest leading dim of its batch inputs)."""
    sizes = [gi.tensor.shape[0] for gi in graph.inputs if gi.role == "batch" and gi.tensor.ndim]
    if not sizes:
        raise InvalidOptionError(
            "the step has no batch input, so it cannot be split into microbatches or "
            "pipelined; fix the mesh (SearchOptions(mesh=...)) without 'pipe'."
        )
    return max(sizes)


def model_groups(graph: Graph, cluster: Any, options: SearchOptions) -> list[dict[str, int]]:
    """The model-parallel groups a stage may use: factorisations of each divisor of the
    node's device count over the model axes the graph offers, at most
    :data:`_GROUP_AXES` of them (``{}``: none). The solves of a fixed mesh keep its names,
    so an offered ``expert`` axis also gets groups of its own (``{"expert": k}``).

    Example:
        >>> model_groups(graph, Cluster.preset("dgx-a100-80gb", nodes=2), SearchOptions())
        [{}, {'tensor': 2}, {'tensor': 4}, {'tensor': 8}]
    """
    offered = offered_axes(graph, cluster.num_devices, options)
    model_axes = tuple(a for a in offered if AXES[a].splits in _MODEL_SPLITS)
    out: list[dict[str, int]] = [{}]
    if not model_axes:
        return out
    for k in _divisors(min(cluster.devices_per_node, cluster.num_devices))[1:]:
        found = candidate_meshes(k, SearchOptions(axes=model_axes), graph)
        out += [g for g in found if len(g) <= _GROUP_AXES]
        if "expert" in model_axes and {"expert": k} not in out:
            out.append({"expert": k})
    return out


def configurations(
    graph: Graph, cluster: Any, options: SearchOptions, groups: Iterable[Mapping[str, int]]
) -> list[PipelineConfig]:
    """Every configuration the options leave open (see the module docstring), the
    un-microbatched ``pipe = 1`` ones excepted (the intra-op search prices those). A
    stage count (times ``virtual_stages``) is at most the layer count and need not
    divide it: the stages then split the layers unevenly (a scanned stack: only at the
    stage count the options fix, ``pipeline_stages``).

    Example:
        >>> cs = configurations(graph, Cluster.preset("dgx-a100-80gb"), SearchOptions(), [{}])
        >>> sorted({c.pipe for c in cs})  # the MLP's 2 layers: at most 2 stages
        [1, 2]
    """
    n, layers = cluster.num_devices, len(graph.layers)
    scanned = any(layer.kind == "scan" for layer in graph.layers)
    batch = batch_size(graph)
    fixed_pipe = options.pipeline_stages
    schedules = [options.schedule] if options.schedule else ["1f1b", "interleaved-1f1b"]
    remats = [options.remat] if options.remat else ["none", "full"]
    zero = options.zero_stage
    out: list[PipelineConfig] = []
    for model in groups:
        k = math.prod(model.values()) if model else 1
        if n % k:
            continue
        for p in _divisors(n // k):
            # A stage count need not divide the layers: the stages then split them
            # unevenly (the inter-op split), each at least one layer. A scanned stack
            # split unevenly comes whole to every pipe device (padded slots:
            # autopar.lower.stages.StageCut.uneven_stacks), which the screen does not
            # price (it splits a scanned stack's state over pipe), so for a scanned
            # stack only when the options fix that stage count.
            if p > max(layers, 1) or (fixed_pipe is not None and p != fixed_pipe):
                continue
            if scanned and layers % p and fixed_pipe is None:
                continue
            d = n // (k * p)
            if batch % d:
                continue
            for b in _divisors(batch // d):
                m = batch // (d * b)
                if options.microbatch_size not in (None, b):
                    continue
                if options.microbatches not in (None, m):
                    continue
                if p == 1:
                    if m > 1 and options.remat in (None, "none") and not options.schedule:
                        out.append(PipelineConfig(1, dict(model), d, m, b, zero_stage=zero))
                    continue
                if m < p:
                    continue  # fewer microbatches than stages leaves a stage idle
                for sched in schedules:
                    v = 1
                    if sched == "interleaved-1f1b":
                        v = options.virtual_stages or 2
                        if (
                            layers < p * v
                            or m % p
                            or (scanned and layers % (p * v) and fixed_pipe is None)
                        ):
                            continue
                    elif options.virtual_stages not in (None, 1):
                        continue
                    for remat in remats:
                        out.append(PipelineConfig(p, dict(model), d, m, b, sched, v, remat, zero))
    return out


def screen(
    config: PipelineConfig,
    prof: Profile,
    cluster: Any,
    limit: float | None = None,
    *,
    lever: bool = True,
) -> Screened:
    """A configuration's step time and peak memory per device from its group's profile
    (``lever``: a pipeline with its ZeRO stage left open takes ZeRO-1 when its stage fits
    ``limit`` with it and not without; the result's ``config`` says so).

    Example: 4 stages, 8 microbatches of 1, one example's forward 1 s, backward 2 s.

        >>> prof = Profile({}, 1, 1.0, 2.0, 0.0, 4e9, 0.0, 1e9, 0.0)
        >>> s = screen(PipelineConfig(4, {}, 1, 8, 1), prof, cluster)
        >>> s.step_time_s, s.memory_bytes   # (8 + 3) slots of 3/4 s; 1e9 + 4 x 0.25e9
        (8.25, 2000000000.0)
    """
    c = config
    p, v, m = c.pipe, c.virtual_stages, c.microbatches
    scale = c.microbatch_size / prof.microbatch_size
    fwd, bwd = prof.forward_s * scale / p, prof.backward_s * scale / p
    if c.remat == "full":
        bwd += fwd
    ctx = CostContext(cluster, c.mesh)
    boundary = prof.boundary_bytes * scale
    p2p = ctx.collective("p2p", boundary, ("pipe",)).time_s if p > 1 and boundary else 0.0
    # The bottleneck device sets the steady state: with the profile's per-layer seconds,
    # each device's chunks of an even split (a scanned stack is cut evenly) are summed,
    # and the microbatches after the first run at the slowest device's pace, the first
    # through every stage: ``(m - 1) max_d + (1 + (p - 1) / v) mean_d`` (Alpa's
    # ``sum t_s + (m - 1) max t_s`` at v = 1; even devices: 1F1B's ``m + (p - 1)/v``
    # slots). The head and embedding sit on the last and first stage: counted in the
    # mean only, a 96-stage pipeline of one layer a stage screened about a third under
    # its bottleneck and outranked shallower pipelines it prices above (310.1B GPT on
    # 1920 A100s).
    busiest = _busiest_device(c, prof, scale)
    slot = fwd + bwd
    makespan = (m + (p - 1) / v) * slot + 2 * (p - 1) * p2p
    if busiest is not None:
        makespan = (m - 1) * busiest + (1 + (p - 1) / v) * slot + 2 * (p - 1) * p2p
    # What a stage's device holds of the state, the gradients and the update: its share
    # of a pipe-split stack, the rest whole (unrolled layers and embeddings, whose
    # gradients are all-reduced over pipe after the flush, exposed, as the runtime does).
    keep = prof.pipe_share / p + (1 - prof.pipe_share) if p > 1 else 1.0
    whole_grads = prof.grad_bytes * (1 - prof.pipe_share) if p > 1 else 0.0
    ar = ctx.collective("all-reduce", whole_grads, ("pipe",)).time_s if whole_grads else 0.0
    grads = 0.0
    if c.data > 1 and prof.grad_bytes:
        # The runtime reduces a microbatch's gradients over data before accumulating: at
        # least a reduce-scatter each (the stage's layouts may keep gradients and state
        # split over data, then gather the new parameters once per step), overlapped with
        # the backward as the intra-op pricing overlaps dp_grad; an all-reduce per
        # microbatch (twice the bytes) would rank many small microbatches below what
        # their full price shows.
        eta = float(cluster.overlap_efficiency)
        grad = prof.grad_bytes * keep
        rs = ctx.collective("reduce-scatter", grad, ("data",)).time_s
        ag = ctx.collective("all-gather", grad, ("data",)).time_s
        grads = (m * rs + ag) * (1 - eta)
    step = makespan + grads + prof.update_s * keep + ar
    act = prof.activation_bytes * scale / p  # one microbatch's, on one stage
    if p == 1:
        inflight = 1.0
    elif c.schedule == "gpipe":
        inflight = float(m)
    elif v > 1:
        inflight = min(m * v, 2 * (p - 1) + (v - 1) * p + 1) / v
    else:
        inflight = float(min(p, m))
    if c.remat != "full":
        held = act * inflight
    elif prof.scanned and prof.layers >= p:
        # Recomputed layer by layer (Megatron-LM): each microbatch in flight keeps its
        # stage's layer inputs; one layer's activations live during the recomputation.
        per_stage = prof.layers / p
        held = boundary * inflight * per_stage + act / per_stage
    else:  # the whole stage recomputed at once from its input
        held = boundary * inflight * v + act
    uneven = _uneven(c, prof, boundary, scale, limit)
    if uneven is not None:
        # The inter-op split (autopar.search.interop): Alpa's sum of stage times plus
        # (m - 1) bottlenecks, the stage's p2p sends as above; memory, the worst stage's.
        stages, times, mems = uneven
        makespan = sum(times) + (m - 1) * max(times) + 2 * (p - 1) * p2p
        step = makespan + grads + prof.update_s * keep + ar
        worst = max(range(p), key=lambda s: mems[s])
        a, b = stages[worst]
        split = prof.pipe_share * sum(prof.layer_bytes.params[a:b])
        state = prof.state_bytes * (split + 1 - prof.pipe_share)
        return Screened(config, step, mems[worst], mems[worst] - state, stages)
    state = prof.state_bytes * keep
    if p > 1 and c.data > 1 and c.zero_stage != 0:
        # ZeRO inside the stages: the optimizer state (and at stage 3 the parameters)
        # split over the data replicas. Searched (None), ZeRO-1 is a memory lever: taken
        # when the stage does not fit without it and does with it, within the bound (the
        # screen's slack let variants that price over it take every finalist's place).
        # A variant whose stages cannot be laid out takes no finalist's place and goes
        # back, with its group's variants with as few stages, to its screen without the
        # lever (``lever=False``, plan_outer): on 1T GPT five of them, none laid out, had
        # kept the best plan from being priced.
        zero = c.zero_stage
        if zero is None and lever and limit is not None and state + held > limit:
            cut = state * (1 - prof.optimizer_share * (1 - 1 / c.data))
            zero = 1 if cut + held <= limit else None
        if zero:
            share = prof.optimizer_share + (prof.param_share if zero == 3 else 0.0)
            state *= 1 - share * (1 - 1 / c.data)
            config = replace(config, zero_stage=zero)
    if p == 1 and c.data > 1:
        # Without a pipeline the intra-op search may split the state over the data
        # replicas too (ZeRO / FSDP, what the bound makes it do): at best a replica holds
        # its share. Counting it whole ruled out every such plan for a model whose state
        # outgrows a device (6.7B GPT on 16 A100s: ZeRO-3, 18.4 s, against the planner's
        # 8-stage pipeline, 20.9 s).
        state /= c.data
    return Screened(config, step, state + held, held)


def _busiest_device(c: PipelineConfig, prof: Profile, scale: float) -> float | None:
    """One microbatch's seconds on the busiest device of ``c``'s even split (its
    ``virtual_stages`` chunks summed; full remat adds each layer's forward again), from
    the profile's per-layer seconds; ``None`` without them or when the layers do not
    split evenly into ``pipe x virtual_stages`` chunks.

    Example: 4 layers of 1 s forward and 2 s backward, the last (with the head) 2 s and
    4 s; two stages: the second device runs 3 + 6 = 9 s a microbatch.

        >>> prof = Profile({}, 1, 5.0, 10.0, 0.0, 0.0, 0.0, 0.0, 0.0, 4,
        ...                layer_forward_s=(1, 1, 1, 2), layer_backward_s=(2, 2, 2, 4))
        >>> _busiest_device(PipelineConfig(2, {}, 1, 4, 1), prof, 1.0)
        9.0
    """
    p, v = c.pipe, c.virtual_stages
    n = len(prof.layer_forward_s)
    if p < 2 or n == 0 or n % (p * v) or len(prof.layer_backward_s) != n:
        return None
    redo = 1.0 if c.remat == "full" else 0.0
    costs = [
        (f * (1 + redo) + b) * scale
        for f, b in zip(prof.layer_forward_s, prof.layer_backward_s, strict=True)
    ]
    per = n // (p * v)
    chunks = [sum(costs[i * per : (i + 1) * per]) for i in range(p * v)]
    # Chunk j runs on device j mod p (the interleaved schedule's round robin).
    return float(max(sum(chunks[d::p]) for d in range(p)))


def _uneven(
    c: PipelineConfig, prof: Profile, boundary: float, scale: float, limit: float | None
) -> tuple[tuple[tuple[int, int], ...], list[float], list[float]] | None:
    """The inter-op split of an unrolled stack (not interleaved) and its stages' times and
    bytes, when it differs from the even split; ``None`` otherwise (a scanned stack splits
    evenly: :func:`autopar.lower.stages.cut_stages`)."""
    p, m = c.pipe, c.microbatches
    n = len(prof.layer_forward_s)
    if p < 2 or c.virtual_stages > 1 or prof.scanned or prof.layer_bytes is None or n < p:
        return None
    redo = 1.0 if c.remat == "full" else 0.0
    costs = [
        (f * (1 + redo) + b) * scale
        for f, b in zip(prof.layer_forward_s, prof.layer_backward_s, strict=True)
    ]
    split = stage_memory(
        prof.state_bytes * prof.pipe_share, prof.activation_bytes * scale, prof.layer_bytes,
        c.schedule, p, m, remat=c.remat == "full", boundary_bytes=boundary,
    )  # fmt: skip
    whole = prof.state_bytes * (1 - prof.pipe_share)  # on every stage (pipe_share)

    def memory(s: int, a: int, b: int) -> float:
        return split(s, a, b) + whole

    stages = split_stages(costs, p, memory=memory, limit=limit or math.inf)
    even = tuple((i * n // p, (i + 1) * n // p) for i in range(p))
    if stages is None or stages == even:
        return None
    times = [sum(costs[a:b]) for a, b in stages]
    return stages, times, [memory(s, a, b) for s, (a, b) in enumerate(stages)]


def _inner_options(options: SearchOptions, mesh: Mapping[str, int], m: int, limit: float):
    """The intra-op search's options on a stage's (or a microbatched step's) ``mesh``: the
    pipeline's knobs cleared; a fixed ZeRO stage kept (it says what the stage's layouts
    split over ``data``)."""
    return replace(
        options, mesh=dict(mesh), axes=None, pipeline_stages=None, schedule=None,
        virtual_stages=None, remat=None, microbatch_size=None,
        microbatches=m, memory_limit_bytes=limit,
    )  # fmt: skip


def _profile_options(options: SearchOptions, model: Mapping[str, int], acc: Any) -> SearchOptions:
    """The intra-op search options of a group's profile: its mesh, no memory bound."""
    return _inner_options(options, model or {"data": 1}, acc.microbatches, _UNBOUNDED)


def profile(
    graph: Graph,
    cluster: Any,
    options: SearchOptions,
    model: Mapping[str, int],
    acc: Any,
    built: Any = None,
) -> Profile:
    """Solve and price one microbatch (``acc``) on the group ``model`` (see the module
    docstring); ``built``: its problem, built already
    (:func:`autopar.search.planner.prebuild`)."""
    from autopar.search.planner import best_mesh
    from autopar.search.stages import evaluate_pipeline

    m = acc.microbatches
    # The search's own solution prices the profile (an estimate for the screen; the
    # finalists are solved and priced in full), not a second solve from its pins (on a
    # 48-block encoder-decoder that halved each profile), and no plan is written for it.
    best = best_mesh(
        graph, cluster, _profile_options(options, model, acc), accumulation=acc, built=built
    )
    one = Plan(best.mesh, pipeline=PipelinePlan(((0, len(graph.layers)),), "1f1b", m))
    ev = evaluate_pipeline(
        graph, one, cluster, acc, per_layer=True, completed=(best.built, best.solution)
    )
    bd = dict(ev.memory_breakdown)
    scanned = any(layer.kind == "scan" for layer in graph.layers)
    state = sum(b for k, b in bd.items() if k != "activations")
    return Profile(
        model=dict(model),
        microbatch_size=batch_size(acc.micro),
        forward_s=float(ev.extra["stage_forward_s"][0]),
        backward_s=float(ev.extra["stage_backward_s"][0]),
        update_s=float(ev.extra.get("update_s", 0.0)),
        state_bytes=state,
        grad_bytes=float(bd.get("grads", 0.0)),
        activation_bytes=float(bd.get("activations", 0.0)),
        boundary_bytes=float(ev.extra.get("boundary_bytes", 0.0)),
        layers=len(graph.layers),
        scanned=scanned,
        layer_forward_s=tuple(ev.extra.get("layer_forward_s", ())),
        layer_backward_s=tuple(ev.extra.get("layer_backward_s", ())),
        layer_bytes=None if scanned or not graph.layers else layer_bytes(acc.micro),
        optimizer_share=bd.get("optimizer", 0.0) / state if state else 0.0,
        param_share=bd.get("params", 0.0) / state if state else 0.0,
        pipe_share=pipe_share(graph),
    )


_UNBOUNDED = float(1 << 62)


def price_pipeline(
    fn: Callable, args: tuple, graph: Graph, cluster: Any, mesh: Mapping[str, int],
    m: int, schedule: str, v: int, remat: str, inner: Plan | None, acc: Any, limit: float,
    stages: tuple[tuple[int, int], ...] | None = None, reduce_after_flush: bool = False,
) -> tuple[Plan, Any]:  # fmt: skip
    """One pipeline plan and its price: the runtime's layout (``baselines.pipeline`` with
    ``inner`` inside the stages, the layer ranges ``stages``, or even), its stages'
    layouts pinned, priced by :func:`autopar.search.stages.evaluate_pipeline` from the
    program it lowers to (``reduce_after_flush``: its layouts completed for a program
    that reduces gradients after the flush, as there)."""
    from autopar import baselines
    from autopar.lower.program import pipeline_program
    from autopar.search.stages import evaluate_pipeline, pipeline_activations

    plan = baselines.pipeline(
        fn, dict(mesh), *args, microbatches=m, schedule=schedule, virtual_stages=v,
        inner=inner, stage_remat=remat, accumulation=acc, stages=stages,
    )  # fmt: skip
    if remat != "none":
        plan = replace(plan, name=f"{plan.name} (remat {remat})")
    # The stages' layouts pinned, so the program runs what is priced.
    pins = inner.activations if isinstance(inner, Plan) else ()
    pinned = pipeline_activations(
        graph, plan, cluster, acc, pins=pins, reduce_after_flush=reduce_after_flush
    )
    plan = replace(plan, activations=pinned)
    ev = evaluate_pipeline(
        graph, plan, cluster, acc, memory_limit_bytes=limit,
        program=pipeline_program(graph, plan, acc), reduce_after_flush=reduce_after_flush,
    )  # fmt: skip
    return plan, ev


def finish(plan: Plan, ev: Any, cluster: Any, shortlist: tuple) -> Plan:
    """``plan`` carrying its price ``ev`` and the shortlist it won."""
    return replace(
        plan,
        predicted=ev.to_predicted(),
        cluster=cluster.to_json(),
        cost_model_version=cost_models.COST_MODEL_VERSION,
        shortlist=shortlist,
    )


def _memory_key(c: PipelineConfig) -> tuple:
    """What a finalist's priced / screened memory teaches about others: the same model
    group, pipelined or not (a pipeline's stages price far over their screen, while a
    microbatched step without one prices about at it: 760M GPT on 2 A100s, 1.86x vs
    0.99x; one scale for both ruled out the fastest microbatch count that fit)."""
    return (c.pipe > 1, tuple(sorted(c.model.items())))


def _shape(c: PipelineConfig) -> tuple:
    return (c.pipe, tuple(sorted(c.model.items())))


def _next_finalist(
    screened: list[Screened],
    limit: float,
    taken: set[int],
    per: Mapping,
    scale: Mapping,
    smallest_first: bool = False,
    slower: Mapping[bool, float] | None = None,
    traced: Iterable[int] | None = None,
) -> int | None:
    """Index of the next configuration to price in full: the fastest that fits by the
    screen (its memory times what pricing its group taught, ``scale``, or the most any
    group of its kind, pipelined or not, taught for a group not priced yet; with slack), at most :data:`_PER_SHAPE` per
    stage count and model group; when none fits (or ``smallest_first``), the smallest.
    ``None`` when every configuration is taken or capped. ``slower``: per kind
    (pipelined or not), what pricing taught of the screen's step times (priced /
    screened), applied before comparing them."""
    best_fit: tuple[float, int, int] | None = None
    smallest: tuple[float, int] | None = None
    worst: dict[bool, float] = {}  # per kind (pipelined or not), the largest excess seen
    for (piped, _), v in scale.items():
        worst[piped] = max(worst.get(piped, 1.0), v)
    for i, s in enumerate(screened):
        if i in taken or per.get(_shape(s.config), 0) >= _PER_SHAPE:
            continue
        key = _memory_key(s.config)
        mem = s.memory_bytes * scale.get(key, worst.get(key[0], 1.0))
        if mem <= limit * _SCREEN_SLACK:
            # Screened ties (a microbatch of b examples costs b times one's here) go to
            # the larger microbatch: its matmuls run nearer peak when priced in full (350M
            # GPT on one A100: 128 microbatches of 8, 33.76 s, was never priced behind
            # 512 of 2 and 256 of 4, 33.90 s).
            t = s.step_time_s * (slower or {}).get(s.config.pipe > 1, 1.0)
            if traced is not None and s.config.pipe > 1 and s.config.microbatches not in traced:
                # Within the screen's noise, a pipeline at a microbatch count already traced
                # is the cheaper finalist: a new one traces the step again (GPT-3 175B on
                # 1024 A100s: pipe 8 x tensor 8 at 24 microbatches, screened 0.8% ahead of
                # pipe 16 x tensor 8 at the 48 traced, took the search from 26 to 79 CPU
                # seconds for the same plan). Not for plain accumulation, whose screen is
                # close to its price: there the handicap cost 1.2% (350M GPT on one A100
                # lost to data parallelism with 128 microbatches of 8).
                t *= 1 + _UNTRACED
            key = (float(f"{t:.9g}"), -s.config.microbatch_size, i)
            best_fit = min(best_fit or key, key)
        smallest = min(smallest or (mem, i), (mem, i))
    pick = smallest if smallest_first else best_fit or smallest
    return None if pick is None else pick[-1]


def _cannot_win(s: Screened, floor: float, best: float) -> bool:
    """Whether the screened configuration ``s`` cannot beat ``best`` (the fastest priced
    plan that fits): its screened step time times ``floor`` (the least priced / screened
    ratio known for it, :func:`_screen_floor`) is at least ``best``.

    The screen runs ahead of the full price (it leaves out the reshards and collectives
    the layouts add at the whole batch's size, and a pipeline's boundary layouts):
    t5-1b-4+4 on two DGX A100 nodes priced 1.75x its screen without a pipeline and 3.2x
    with one. So a configuration whose screen, scaled by the least excess seen, is not
    under the best price cannot win, and pricing it (solves of tens of seconds on a
    48-block encoder-decoder, and a trace of the step per new microbatch count) only
    costs time. With this test only after :data:`_FEWEST` finalists, t5-1b priced three
    finalists that all lost to the un-pipelined plan (80-250 s each).

    Example: screened at 60 ms, at least 1.75x over it when priced: at least 105 ms, so
    it cannot beat a 104.5 ms plan (it could beat 110 ms).

        >>> s = Screened(PipelineConfig(1, {}, 16, 2, 1), 0.060, 6e9)
        >>> _cannot_win(s, 1.75, 0.1045), _cannot_win(s, 1.75, 0.110)
        (True, False)
    """
    return s.step_time_s * floor >= best


def _screen_floor(
    s: Screened, ratios: Mapping[bool, list[float]], plain: Mapping[tuple, float]
) -> float:
    """The least priced / screened step-time ratio known for ``s``: its kind's finalists'
    (``ratios``: pipelined or not) and, for its model group, the whole cluster's mesh of
    that group priced by the intra-op search beside its screen as one microbatch
    (``plain``: group -> ratio, :func:`_plain_ratios`; it counts for pipelines too, whose
    stages run the same layers and whose screen leaves out what that one does, and
    more); 1 when none is known.

    The group's own mesh, not every mesh: the screen scales the profiled microbatch
    linearly to the examples a configuration runs, and larger matmuls price nearer peak,
    so a group whose whole-cluster mesh runs many examples per replica (t5-1b-4+4's
    ``data 2 x tensor 8``, 16) prices under its screen (0.76x) while ``data 16`` (2
    examples, the profiled size) prices 1.35x over it. A configuration of the group runs
    at most as many examples per replica and microbatch as that mesh (it splits them
    into microbatches), so its own excess is at least that mesh's.

    Example:
        >>> s = Screened(PipelineConfig(2, {"tensor": 2}, 4, 8, 1), 0.3, 5e10)
        >>> _screen_floor(s, {True: [3.2], False: [1.2]}, {(("tensor", 2),): 1.4, (): 0.9})
        1.4
        >>> _screen_floor(s, {True: [1.1]}, {(("tensor", 2),): 1.4})
        1.1
        >>> _screen_floor(s, {}, {})
        1.0
    """
    seen = list(ratios.get(s.config.pipe > 1, ()))
    group = tuple(sorted(s.config.model.items()))
    if group in plain:
        seen.append(plain[group])
    return min(seen, default=1.0)


def _plain_ratios(
    priced: Iterable[_Priced], profiles: Mapping[tuple, Profile], cluster: Any, batch: int
) -> dict[tuple, float]:
    """Per profiled model group, the priced / screened step time of the whole-cluster
    mesh of that group the intra-op search priced (no microbatches, no pipeline; the
    screen of ``PipelineConfig(1, group, data, 1, batch / data)``); the least if several."""
    out: dict[tuple, float] = {}
    for q in priced:
        c = q.candidate
        if c.step_time_s is None or c.step_time_s <= 0:  # not solved, or over the bound
            continue
        mesh = dict(c.mesh)
        data = mesh.pop("data", 1)
        key = tuple(sorted(mesh.items()))
        if key not in profiles or batch % data:
            continue
        est = screen(PipelineConfig(1, mesh, data, 1, batch // data), profiles[key], cluster)
        if est.step_time_s > 0:
            out[key] = min(out.get(key, math.inf), c.step_time_s / est.step_time_s)
    return out


@dataclass
class _Priced:
    label: str
    plan: Plan | None
    ev: Any
    candidate: Any


def plain_options(options: SearchOptions) -> SearchOptions:
    """The options of the intra-op search over the whole cluster that competes with the
    outer loop's configurations: no pipeline, no microbatches, none of their levers.

    Example:
        >>> plain_options(SearchOptions(axes=("pipe", "data"), remat="full")).axes
        ('data',)
    """
    axes = tuple(a for a in options.axes if a != "pipe") if options.axes else None
    return replace(
        options, axes=axes or None, pipeline_stages=None, schedule=None,
        virtual_stages=None, remat=None, microbatch_size=None,
    )  # fmt: skip


def with_levers(plan: Plan, graph: Graph) -> Plan:
    """``plan`` (the intra-op search's, which fits) with its shortlist filled to
    :data:`FINALISTS` by the memory levers left unsearched because it fits without them
    (:func:`autopar.api.plan` searches them only then): its mesh with ``k`` microbatches,
    and with ``k`` pipeline stages in place of ``k`` data replicas, for ``k`` = 2, 4, ...
    Each says why it was not priced: a pipeline cannot split an unrolled stack's state
    (``pipe_share`` 0), so every stage would hold, update and all-reduce all of it; a
    device's work is the same either way, plus a bubble and a reduction per microbatch.

    Example:
        >>> p = with_levers(replace(plan, shortlist=plan.shortlist[:1]), graph)
        >>> plan.mesh, [c.label for c in p.shortlist[1:3]]   # a batch of 64
        ({'data': 2, 'tensor': 4}, ['data 2 x tensor 4, 2 microbatches of 16', 'pipe 2 x tensor 4, 1f1b, 2 microbatches of 32, remat none'])
    """
    from autopar.search.shortlist import unsolved

    if len(plan.shortlist) >= FINALISTS or not plan.mesh:
        return plan
    mesh = dict(plan.mesh)
    data = mesh.pop("data", 1)
    batch = batch_size(graph)
    if batch % data:
        return plan
    per = batch // data  # examples per replica
    why = "a memory lever, searched only when no plan fits without it: " + (
        "no layer stack is scanned, so every stage would hold, update and all-reduce the "
        "whole state, and a device does the same work a microbatch at a time"
        if pipe_share(graph) == 0
        else "inside one node the whole mesh's collectives are fast and a pipeline adds a bubble"
    )
    levers = []
    k = 2
    while k <= max(per, data):
        if per % k == 0:
            levers.append(PipelineConfig(1, mesh, data, k, per // k))
        if data % k == 0 and len(graph.layers) >= k:
            levers.append(PipelineConfig(k, mesh, data // k, k, per))
        k *= 2
    extra = tuple(unsolved(c.label, c.mesh, why) for c in levers)
    return replace(plan, shortlist=plan.shortlist + extra[: FINALISTS - len(plan.shortlist)])


def plan_outer(
    fn: Callable,
    args: tuple,
    graph: Graph,
    cluster: Any,
    options: SearchOptions,
    *,
    plain_error: InfeasiblePlanError | None = None,
) -> Plan:
    """The whole plan for ``fn(*args)`` (traced: ``graph``) on ``cluster``: pipeline or
    not, the group inside the stages, microbatches, schedule, remat (see the module
    docstring). ``plain_error``: the intra-op search over the whole cluster
    (:func:`plain_options`) ran already and found nothing that fits; it is not run again.

    Raises:
        InfeasiblePlanError: nothing priced fits the memory bound; the message names the
            smallest footprint, the bound and the configuration (its levers) that came
            closest.
    """
    from autopar.progress import SearchProgress
    from autopar.search.planner import plan_graph, prebuild
    from autopar.search.shortlist import rank

    limit = float(options.memory_limit_bytes or cluster.device.hbm_bytes)
    batch = batch_size(graph)
    groups = model_groups(graph, cluster, options)
    priced: list[_Priced] = []
    accs: dict[int, Any] = {}  # microbatch count -> the step's accumulation, traced once
    with SearchProgress(len(groups) + FINALISTS + 1, "plan") as bar:
        if (
            plain_error is None
            and options.pipeline_stages in (None, 1)
            and options.microbatches in (None, 1)
        ):
            try:
                p0 = plan_graph(graph, cluster, plain_options(options))
                first = replace(p0.shortlist[0], verdict="")
                priced.append(_Priced(first.label, p0, p0.predicted, first))
                priced += [_Priced(c.label, None, None, c) for c in p0.shortlist[1:]]
            except InfeasiblePlanError as e:
                plain_error = e
        bar.advance("intra-op search over the whole cluster")
        try:
            acc1 = _profile_accumulation(fn, args, graph, batch, accs)
        except AccumulateError as e:
            # The step cannot be split into microbatches (so neither pipelined): the
            # intra-op plan is the answer, if there is one.
            if plain_error is not None:
                raise plain_error.restated(
                    f"{plain_error} The memory levers (microbatches, pipeline stages, stage "
                    f"remat) cannot help: {e}",
                    limit,
                ) from e
            if not priced:
                raise  # the options ask for microbatches or stages the step cannot take
            return priced[0].plan
        # Every group's problem is built first, each one's LP relaxation started on the
        # solver's background thread as it is built (it runs while the next is built).
        built = [prebuild(graph, cluster, _profile_options(options, g, acc1), acc1) for g in groups]
        profiles = {}
        for g, bp in zip(groups, built, strict=True):
            try:
                profiles[tuple(sorted(g.items()))] = profile(graph, cluster, options, g, acc1, bp)
            except SolveShardingError:
                pass  # the solver found no layout in time: the group is not offered
            bar.advance(f"profiled {g or 'one device'}")
        del built
        groups = [g for g in groups if tuple(sorted(g.items())) in profiles]
        # A group's profile is solved without a memory bound (fastest layouts); what it
        # could hold at best is the whole state split over the group, and the finalists'
        # full pricing tightens their stage layouts towards it (_price).
        whole = profiles[()].state_bytes if () in profiles else math.inf
        for key, prof in profiles.items():
            k = math.prod(n for _, n in key) if key else 1
            profiles[key] = replace(prof, state_bytes=min(prof.state_bytes, whole / k))
        # A microbatch smaller than the profiled one may not split (at one example,
        # shapes lose the batch dim's reductions): those are left out.
        smallest = batch_size(acc1.micro)
        configs = [
            c
            for c in configurations(graph, cluster, options, groups)
            if c.data * c.microbatch_size >= smallest
        ]
        screened = [
            screen(c, profiles[tuple(sorted(c.model.items()))], cluster, limit) for c in configs
        ]
        # Finalists one at a time: a group whose finalist priced over its screened
        # memory has its other configurations' memory scaled by that excess before the
        # next pick (the screen's state is a lower bound).
        taken: set[int] = set()
        failures = 0  # the screen's ZeRO-1 variants whose stages could not be laid out
        per: dict[tuple, int] = {}
        scale: dict[tuple, float] = {}
        # At least _FEWEST finalists; up to FINALISTS while none priced fits, or while
        # the next one's screened step time, times what pricing taught (the mean of
        # priced / screened over the finalists so far of its kind, pipelined or not: a
        # pipeline prices well over its screen, a step without one about at it, so one
        # mean for both stopped before any unpipelined plan was priced), beats the best
        # that fits.
        ratios: dict[bool, list[float]] = {}
        plain_ratios = _plain_ratios(priced, profiles, cluster, batch)
        while len(taken) < FINALISTS + _RESCUES:
            # Past FINALISTS with nothing that fits: the smallest footprints (rescues).
            rescue = len(taken) >= FINALISTS
            if rescue and any(_fits(q, limit) for q in priced):
                break
            slower = {k: sum(r) / len(r) for k, r in ratios.items()}
            i = _next_finalist(
                screened, limit, taken, {} if rescue else per, scale, rescue, slower,
                traced=set(accs),
            )  # fmt: skip
            if i is None:
                break
            s = screened[i]
            fit = [q.candidate.step_time_s for q in priced if _fits(q, limit)]
            # Once the shortlist holds _FEWEST priced plans (the whole cluster's meshes
            # count), a pick that cannot win ends the pricing: nor can the rest, the
            # pick is the most promising left.
            solved = sum(q.candidate.step_time_s is not None for q in priced)
            floor = _screen_floor(s, ratios, plain_ratios)
            if solved >= _FEWEST and fit and _cannot_win(s, floor, min(fit)):
                break
            if len(taken) >= _FEWEST and fit and ratios:
                if s.step_time_s * slower.get(s.config.pipe > 1, 1.0) >= min(fit):
                    break
            taken.add(i)
            per[_shape(s.config)] = per.get(_shape(s.config), 0) + 1
            q = _price(
                fn, args, graph, cluster, options, s, limit,
                scale.get(_memory_key(s.config), 1.0), accs,
            )  # fmt: skip
            priced.append(q)
            if options.zero_stage is None and s.config.zero_stage and q.plan is None:
                # The screen's ZeRO lever, not laid out. It teaches nothing (no
                # footprint) and takes no finalist's place: on 1T GPT five such variants
                # (pipe 16-64) kept the best plan from being priced. It and its group's
                # variants with as few stages or fewer (as much state a stage, or more)
                # go back to their screen without the lever; after _LEVER_FAILURES, every
                # variant does.
                failures += 1
                taken.discard(i)
                per[_shape(s.config)] -= 1
                for j, t in enumerate(screened):
                    if t.config.zero_stage and j not in taken and (
                        failures >= _LEVER_FAILURES
                        or (t.config.pipe <= s.config.pipe
                            and _memory_key(t.config) == _memory_key(s.config))
                    ):  # fmt: skip
                        prof = profiles[tuple(sorted(configs[j].model.items()))]
                        screened[j] = screen(configs[j], prof, cluster, limit, lever=False)
            if q.candidate.step_time_s is not None and s.step_time_s > 0:
                kind = ratios.setdefault(s.config.pipe > 1, [])
                kind.append(q.candidate.step_time_s / s.step_time_s)
            got = q.candidate.memory_bytes_per_device
            if got is not None and s.memory_bytes > 0:
                group = _memory_key(s.config)
                scale[group] = max(scale.get(group, 1.0), got / s.memory_bytes)
            bar.advance(f"priced {s.config.label}")
        # The shortlist holds at least FINALISTS candidates: the next screened ones fill
        # it, marked as screened only (their estimates, not a full price).
        best_fit = min((q.candidate.step_time_s for q in priced if _fits(q, limit)), default=None)
        while len(priced) < FINALISTS:
            i = _next_finalist(screened, limit, taken, {}, scale)
            if i is None:
                break
            taken.add(i)
            floor = _screen_floor(screened[i], ratios, plain_ratios)
            priced.append(_screened_only(screened[i], scale, floor, best_fit))
    fitting = [q for q in priced if _fits(q, limit)]
    if not fitting:
        raise _infeasible(priced, limit, plain_error, graph, cluster)
    best = min(fitting, key=lambda q: q.candidate.step_time_s)
    others = [q.candidate for q in priced if q is not best]
    short = rank(best.candidate, others, limit)
    if best.ev is best.plan.predicted:
        return replace(best.plan, shortlist=short)
    return finish(best.plan, best.ev, cluster, short)


def _fits(q: _Priced, limit: float) -> bool:
    return q.plan is not None and q.candidate.memory_bytes_per_device <= limit


def _screened_only(
    s: Screened, scale: Mapping, floor: float = 1.0, best: float | None = None
) -> _Priced:
    """A shortlist entry for a configuration only screened: its estimates and, when what
    pricing taught (``floor``, :func:`_screen_floor`) puts it at or over ``best`` (the
    fastest priced plan that fits), that it cannot win, so that a raw screen under the
    chosen plan's price does not read as a faster plan left out.

    Example: screened at 1.18 s, and plans of its kind priced at least 1.45x their
    screen: about 1.71 s, which cannot beat a plan priced at 1.68 s.

        >>> s = Screened(PipelineConfig(1, {}, 16, 8, 1), 1.18, 34.5 * 2**30)
        >>> print(_screened_only(s, {}, 1.45, 1.68).candidate.verdict)  # doctest: +NORMALIZE_WHITESPACE
        not solved: screened only (not priced in full): about 1.18 s per step, 34.5 GiB
        per device; priced plans of its kind took at least 1.45x their screen, about
        1.71 s, so it cannot beat the chosen 1.68 s
    """
    from autopar.search.shortlist import unsolved

    mem = s.memory_bytes * scale.get(_memory_key(s.config), 1.0)
    why = (
        f"screened only (not priced in full): about {s.step_time_s:.3g} s per step, "
        f"{mem / 2**30:.3g} GiB per device"
    )
    if best is not None and floor > 1.0 and _cannot_win(s, floor, best):
        why += (
            f"; priced plans of its kind took at least {floor:.3g}x their screen, about "
            f"{s.step_time_s * floor:.3g} s, so it cannot beat the chosen {best:.3g} s"
        )
    elif best is not None and s.step_time_s < best:
        why += (
            "; the screen runs ahead of the full price (it leaves out the reshards and "
            f"collectives of the layouts): the search priced its {FINALISTS} most "
            "promising configurations"
        )
    return _Priced(s.config.label, None, None, unsolved(s.config.label, s.config.mesh, why))


def _accumulation(fn: Callable, args: tuple, graph: Graph, m: int, memo: dict) -> Any:
    """``plan_accumulation`` of the step in ``m`` microbatches, once per search (``memo``:
    microbatch count -> result): finalists that share a microbatch count share the trace
    of one microbatch and its rules (on a 48-block encoder-decoder, about 40 s each)."""
    from autopar.lower.split import plan_accumulation

    if m not in memo:
        try:
            memo[m] = plan_accumulation(fn, args, m, full=graph)
        except AccumulateError as e:
            memo[m] = e
    if isinstance(memo[m], AccumulateError):
        raise memo[m]
    return memo[m]


def _profile_accumulation(fn: Callable, args: tuple, graph: Graph, batch: int, memo: dict) -> Any:
    """The step on the smallest microbatch it splits into: 2 examples when the batch is
    even (at 1, XLA-level shapes lose the batch dim's reductions), else 1."""
    for b in (2, 1) if batch % 2 == 0 else (1,):
        try:
            return _accumulation(fn, args, graph, batch // b, memo)
        except AccumulateError:
            if b == 1:
                raise
    raise AssertionError("unreachable")


def _price(
    fn: Callable, args: tuple, graph: Graph, cluster: Any, options: SearchOptions,
    screened: Screened, limit: float, learned: float, memo: dict,
) -> _Priced:  # fmt: skip
    """Plan and price one finalist in full (``memo``: as :func:`_accumulation`'s)."""
    c = screened.config
    from autopar.search.planner import plan_graph
    from autopar.search.shortlist import candidate

    try:
        acc = _accumulation(fn, args, graph, c.microbatches, memo)
    except AccumulateError as e:
        return _Priced(c.label, None, None, _unfit(c, str(e)))
    # The sub-mesh's axes are named by what the solution splits with them (an axis the
    # group calls ``tensor`` that splits experts is ``expert``), so the plan's names say
    # what each axis does.
    if c.pipe == 1:
        try:
            q = plan_graph(
                graph,
                cluster,
                _inner_options(options, c.sub_mesh, c.microbatches, limit),
                accumulation=acc,
                name_by_role=True,
            )
        except (InfeasiblePlanError, SolveShardingError) as e:
            return _Priced(c.label, None, None, _unfit(c, str(e)))
        label = _relabel(c, q.mesh)
        return _Priced(label, q, q.predicted, replace(q.shortlist[0], label=label, verdict=""))

    def priced(inner: Plan | None) -> tuple[Plan, Any]:
        mesh = c.mesh if inner is None else {"pipe": c.pipe, **inner.mesh}
        return price_pipeline(
            fn, args, graph, cluster, mesh, c.microbatches, c.schedule, c.virtual_stages,
            c.remat, inner, acc, limit, stages=screened.stages,
        )  # fmt: skip

    # A ZeRO stage (fixed, ``options.zero_stage``, or the screen's lever) is a layout the
    # stages' intra-op search gives them, data-only stages included.
    if c.zero_stage is not None and options.zero_stage is None:
        options = replace(options, zero_stage=c.zero_stage)
    if not c.model and not (c.zero_stage and c.data > 1):
        plan, ev = priced(None)  # data parallel inside the stages
        return _Priced(c.label, plan, ev, candidate(c.label, c.mesh, ev))
    # The stages' layouts: the intra-op search on the sub-mesh for the whole step, under
    # what the screen leaves a stage for its state (the bound less its in-flight
    # activations) times pipe (a stage holds 1/pipe of the layers), over what pricing
    # its group's earlier finalists taught (``learned``: priced / screened memory); if
    # the stage priced does not fit, once more under a bound tightened by its excess.
    bound = max(limit - screened.activation_bytes, limit / 4) * c.pipe / learned
    best: tuple[Plan, Any] | None = None
    floor_tried = False
    tries = 0
    inner_bytes = math.inf  # the last inner layouts' memory: a retry must ask for less
    while tries < _TIGHTEN:
        try:
            inner = plan_graph(
                graph, cluster, _inner_options(options, c.sub_mesh, c.microbatches, bound),
                accumulation=acc, name_by_role=True,
            )  # fmt: skip
        except InfeasiblePlanError as e:
            # A bound under the group's smallest footprint (what an earlier finalist's
            # excess taught can overshoot: 1T GPT on 3072 A100s, pipe 64's stages priced
            # 4.8x their screen, which put pipe 128's bound at half of what any layout
            # needs): once, the tightest layouts there are, just over that footprint.
            # Not when a stage of those layouts (1/pipe of the step's) cannot fit the
            # device anyway: solving just over a footprint is the solver's hardest
            # problem (a bound of 1000 bytes spent 70 s there to no avail).
            low = getattr(e, "smallest_bytes", None)
            if floor_tried or low is None or not bound < low < inner_bytes:
                break
            if low / c.pipe > limit:
                break
            floor_tried = True
            bound = low * (1 + _FLOOR_SLACK)
            continue
        except SolveShardingError:
            break
        tries += 1
        inner_bytes = inner.predicted.memory_bytes_per_device
        plan, ev = priced(inner)
        if best is None or (ev.fits, -ev.step_time_s) > (best[1].fits, -best[1].step_time_s):
            best = (plan, ev)
        if ev.fits:
            break
        bound *= _TIGHTER * limit / ev.memory_bytes_per_device
    if best is None:
        return _Priced(c.label, None, None, _unfit(c, "the stages' layouts do not fit"))
    plan, ev = best
    label = _relabel(c, plan.mesh)
    return _Priced(label, plan, ev, candidate(label, plan.mesh, ev))


def _relabel(c: PipelineConfig, mesh: Mapping[str, int]) -> str:
    """``c``'s label with the mesh as solved (its axes named by role)."""
    if list(mesh.items()) == list(c.mesh.items()):
        return c.label
    old = " x ".join(f"{a} {n}" for a, n in c.mesh.items())
    new = " x ".join(f"{a} {n}" for a, n in mesh.items())
    return c.label.replace(old, new, 1)


def _unfit(c: PipelineConfig, why: str):
    from autopar.search.shortlist import unsolved

    return unsolved(c.label, c.mesh, why.split(":")[0])


def _infeasible(
    priced: list[_Priced], limit: float, plain: AutoparError | None, graph: Graph | None = None,
    cluster: Any = None,
) -> InfeasiblePlanError:  # fmt: skip
    """Nothing fits: the smallest footprint priced, the bound, and the closest levers (and,
    for layers the pipeline cannot split or a device count the state cannot split by, what
    would)."""
    hint = _unrolled_hint(graph) + _factor_hint(graph, cluster)
    sized = [q for q in priced if q.candidate.memory_bytes_per_device is not None]
    if not sized:
        if isinstance(plain, InfeasiblePlanError) and plain.smallest_bytes is not None:
            # The whole cluster's search found a footprint; no pipeline or microbatched
            # plan got as far as one.
            return plain.restated(
                f"{plain} No pipeline or microbatched plan could be laid out under the bound "
                f"either.{hint}",
                limit,
            )
        return InfeasiblePlanError(
            f"no plan fits the memory bound of {limit:.4g} bytes per device and none could be "
            f"priced{f' ({plain})' if plain else ''}; use more devices or a larger "
            f"memory_limit_bytes.{hint}",
            bound_bytes=limit,
        )
    q = min(sized, key=lambda q: q.candidate.memory_bytes_per_device)
    need = q.candidate.memory_bytes_per_device
    return InfeasiblePlanError(
        f"no plan fits the memory bound of {limit:.4g} bytes ({limit / 2**30:.3f} GiB) per "
        f"device: the smallest footprint found is {need:.4g} bytes ({need / 2**30:.3f} GiB, "
        f"{need / limit - 1:+.1%}, {need - limit:.4g} bytes over), with {q.label} (the levers "
        "tried: pipeline stages, stage remat none/full, microbatches, the model-parallel group "
        f"inside a node). Use more devices, a smaller batch, or a larger memory_limit_bytes."
        f"{hint}",
        smallest_bytes=need,
        bound_bytes=limit,
        closest=q.label,
    )


def _unrolled_hint(graph: Graph | None) -> str:
    """For a step whose layers are unrolled (none is a scan): a pipeline splits only a
    scanned stack's state over ``pipe`` (:func:`autopar.search.interop.pipe_share`), so
    each stage holds every unrolled layer's."""
    if graph is None or len(graph.layers) < 2 or any(x.kind == "scan" for x in graph.layers):
        return ""
    return (
        f" The step's {len(graph.layers)} layers are unrolled, and a pipeline splits only a "
        "scanned layer stack over 'pipe': every stage holds every unrolled layer's "
        "parameters and optimizer state. Scanning the layers (flax.linen.scan, or "
        "jax.lax.scan over stacked layer parameters) lets the stages hold 1/pipe each."
    )


def _prime_powers(n: int) -> dict[int, int]:
    """``n``'s prime factorisation, prime -> its largest power dividing ``n``.

    Example:
        >>> _prime_powers(992)
        {2: 32, 31: 31}
    """
    out: dict[int, int] = {}
    q = 2
    while q * q <= n:
        while n % q == 0:
            out[q] = out.get(q, 1) * q
            n //= q
        q += 1
    if n > 1:
        out[n] = out.get(n, 1) * n
    return out


def _unsplittable(graph: Graph, n: int) -> list[int]:
    """The prime factors of ``n`` whose power in ``n`` divides no dim of most of the state
    (parameters and optimizer state, by bytes): an axis that has them cannot split that
    state evenly, and JAX shards only evenly."""
    state = [gi.tensor for gi in graph.inputs if gi.role in ("param", "opt_state")]
    total = sum(t.nbytes for t in state)
    out = []
    for q, qe in _prime_powers(n).items():
        split = sum(t.nbytes for t in state if any(d % qe == 0 for d in t.shape))
        if total and split < total / 2:
            out.append(q)
    return out


def _factor_hint(graph: Graph | None, cluster: Any) -> str:
    """For a device count with a prime factor the state cannot be split by (OPT-175B on
    992 = 2^5 x 31 A100s: 31 divides no weight dim): that factor, and the largest device
    count below (whole nodes) without such a factor."""
    if graph is None or cluster is None:
        return ""
    n, per = cluster.num_devices, max(1, cluster.devices_per_node)
    bad = _unsplittable(graph, n)
    if not bad:
        return ""
    fits = next((k for k in range(n - n % per, 0, -per) if not _unsplittable(graph, k)), None)
    factors = " x ".join(str(qe) for qe in _prime_powers(n).values())
    named = ", ".join(str(q) for q in bad)
    return (
        f" The {n} devices ({factors}) have the factor {named}, which divides no dimension of "
        "most of the parameters and optimizer state: an axis of that size cannot split them "
        "(JAX shards only evenly), so they stay whole over it."
        + (f" {fits} devices ({fits // per} nodes) have no such factor." if fits else "")
    )
