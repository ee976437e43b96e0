"""The inter-op split: which layers each pipeline stage runs.

Alpa (Zheng et al. 2022, section 5.2) splits a model's layers into stages with a dynamic
program over (layer range, sub-mesh, intra-op configuration) minimising

    T = sum_s t_s + (m - 1) * max_s t_s

(``t_s``: stage ``s``'s forward + backward seconds of one microbatch, ``m`` microbatches),
each stage's memory under its in-flight microbatches within the device's bound. Here:

* **Sub-mesh and intra-op configuration.** The runtime is one SPMD program over the
  ``pipe`` axis (:mod:`autopar.lower.pipeline`), so every stage runs on the same sub-mesh
  (the mesh without ``pipe``); the outer loop (:mod:`autopar.search.outer`) enumerates the
  sub-mesh and its intra-op group, and the intra-op search solves the step once per group
  (repeated layers solved once and tied). The stage cost of a layer range is then the sum
  of its layers' costs from that one solve (``evaluate_pipeline(..., per_layer=True)``:
  the embedding counted with the first layer, the head and loss with the last, like any
  other layer's work), not one solve per range.
* **Layer ranges.** With additive stage costs and the same boundary activation at every
  cut (a transformer's residual stream), ``sum_s t_s`` is the same for every split, so the
  objective's optimum is the split with the smallest bottleneck ``max_s t_s``: the
  contiguous min-max partition. :func:`split_stages` finds it exactly by bisection on the
  bottleneck with a greedy feasibility check (the stage-by-stage dynamic program's
  optimum; a stage's cost and memory only grow with its range, so taking the most layers
  that fit at every stage reaches at least as far as any feasible split).
* **Memory per schedule.** Stage ``s`` of ``p`` holds ``min(p - s, m)`` microbatches in
  flight under 1F1B (the first stage ``p``, the last 1), all ``m`` under GPipe
  (:func:`inflight`); a stage's bytes are its layers' share of the state plus its
  layers' activations times that (:func:`stage_memory`).

A heavy head (a large vocabulary) thus gets a last stage with fewer layers.

Example: six layers of 1 s, the last one carrying a 9 s head, on two stages.

    >>> split_stages([1, 1, 1, 1, 1, 10], 2)
    ((0, 5), (5, 6))
    >>> pipeline_time([1, 1, 1, 1, 1, 10], ((0, 5), (5, 6)), 4)   # 15 + 3 x 10
    45.0
    >>> pipeline_time([1, 1, 1, 1, 1, 10], ((0, 3), (3, 6)), 4)   # even: 15 + 3 x 12
    51.0
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from autopar.errors import InvalidOptionError
from autopar.trace.graph import Graph

__all__ = [
    "LayerBytes",
    "inflight",
    "layer_bytes",
    "pipe_share",
    "pipeline_time",
    "split_stages",
    "stage_memory",
]

Stages = tuple[tuple[int, int], ...]

_BISECT_STEPS = 64  # halvings of the bottleneck interval (float64 resolution)


def pipeline_time(costs: Sequence[float], stages: Stages, microbatches: int) -> float:
    """Alpa's pipeline latency ``sum_s t_s + (m - 1) max_s t_s`` of a split, ``t_s`` the
    sum of its layers' ``costs``.

    Example:
        >>> pipeline_time([2, 2, 2, 2], ((0, 2), (2, 4)), 3)   # 8 + 2 x 4
        16.0
    """
    t = [float(sum(costs[a:b])) for a, b in stages]
    return sum(t) + (microbatches - 1) * max(t)


def inflight(schedule: str, p: int, m: int, s: int) -> int:
    """Microbatches stage ``s`` of ``p`` holds at once: 1F1B ``min(p - s, m)``, GPipe
    ``m`` (PipeDream-Flush / Megatron-LM's 1F1B warm-up; GPipe runs every forward first).

    Example:
        >>> [inflight("1f1b", 4, 8, s) for s in range(4)], inflight("gpipe", 4, 8, 3)
        ([4, 3, 2, 1], 8)
    """
    if schedule == "gpipe":
        return m
    return max(1, min(p - s, m))


def split_stages(
    costs: Sequence[float],
    p: int,
    *,
    memory: Callable[[int, int, int], float] | None = None,
    limit: float = math.inf,
) -> Stages | None:
    """The split of the layers into ``p`` contiguous stages with the smallest bottleneck
    stage (so the smallest :func:`pipeline_time`), each stage within ``limit`` bytes.

    Args:
        costs: per layer, its forward + backward seconds of one microbatch (the first
            with the embedding, the last with the head; with remat, the forward again).
        p: stages, at most ``len(costs)``; each gets at least one layer.
        memory: ``memory(s, start, stop)``: bytes per device of stage ``s`` running layers
            ``[start, stop)`` (non-decreasing as the range grows, non-increasing in ``s``);
            ``None``: no bound.
        limit: the bound on ``memory``.

    Returns:
        ``p`` ``(start, stop)`` ranges, or ``None`` when no split fits ``limit``.

    Raises:
        InvalidOptionError: ``p`` is below 1 or above the layer count.

    Example:
        >>> split_stages([1, 1, 1, 1], 2)
        ((0, 2), (2, 4))
        >>> mem = lambda s, a, b: (b - a) * (2 - s)   # stage 0 holds two microbatches
        >>> split_stages([1, 1, 1, 1], 2, memory=mem, limit=3)
        ((0, 1), (1, 4))
        >>> split_stages([1, 1, 1, 1], 2, memory=mem, limit=2)
    """
    n = len(costs)
    if p < 1 or p > n:
        raise InvalidOptionError(f"{n} layers cannot be split into {p} pipeline stages.")
    pre = [0.0]
    for c in costs:
        pre.append(pre[-1] + float(c))

    def fits(s: int, a: int, b: int) -> bool:
        return memory is None or memory(s, a, b) <= limit

    def greedy(bound: float) -> list[tuple[int, int]] | None:
        out, a = [], 0
        for s in range(p):
            if a == n:
                break
            b = a
            while b < n and pre[b + 1] - pre[a] <= bound and fits(s, a, b + 1):
                b += 1
            if b == a:
                return None
            out.append((a, b))
            a = b
        return out if a == n else None

    lo, hi = max(max(costs, default=0.0), pre[-1] / p), pre[-1]
    lo = float(lo) * (1 - 1e-12)
    best = greedy(hi * (1 + 1e-12))
    if best is None:
        return None
    if greedy(lo) is not None:
        best = greedy(lo)
    else:
        for _ in range(_BISECT_STEPS):
            mid = (lo + hi) / 2
            got = greedy(mid)
            if got is None:
                lo = mid
            else:
                hi, best = mid, got
            if hi - lo <= 1e-12 * max(hi, 1e-30):
                break
    assert best is not None
    return _fill(best, p, pre, fits)


def _fill(
    stages: list[tuple[int, int]],
    p: int,
    pre: Sequence[float],
    fits: Callable[[int, int, int], bool],
) -> Stages:
    """``stages`` (at most ``p``) cut further until there are ``p``: each time the
    costliest stage of two or more layers at its most even point (no bottleneck grows;
    later stages move to higher indices, where a schedule holds no more microbatches)."""
    out = list(stages)
    while len(out) < p:
        cands = [i for i, (a, b) in enumerate(out) if b - a >= 2]
        i = max(cands, key=lambda i: (pre[out[i][1]] - pre[out[i][0]], out[i][1] - out[i][0]))
        a, b = out[i]
        k = min(range(a + 1, b), key=lambda k: max(pre[k] - pre[a], pre[b] - pre[k]))
        out[i : i + 1] = [(a, k), (k, b)]
    return tuple(out)


@dataclass(frozen=True)
class LayerBytes:
    """Per layer, its share of the step's parameters and of one microbatch's activations
    (each sums to 1 over the layers).

    Attributes:
        params: parameter bytes read first by the layer's forward (the embedding's with the
            first layer, the head's with the last; a scanned stack's split evenly), over
            all parameter bytes. Optimizer state and gradients follow their parameters.
        activations: bytes of the values the layer's forward makes that the backward reads
            (its residuals), over all of them.
    """

    params: tuple[float, ...]
    activations: tuple[float, ...]


def layer_bytes(graph: Graph) -> LayerBytes:
    """Each layer's share of the parameters and of the residuals (:class:`LayerBytes`),
    work placed as :func:`autopar.search.stages.node_layers` places it.

    Example:
        >>> lb = layer_bytes(graph)
        >>> round(sum(lb.params), 6), round(sum(lb.activations), 6)
        (1.0, 1.0)
    """
    from autopar.search.stages import node_layers

    n = len(graph.layers)
    if n == 0:
        raise InvalidOptionError("the step has no layers to split into pipeline stages.")
    shares = node_layers(graph)
    params, acts = [0.0] * n, [0.0] * n
    param_of = {gi.value: gi for gi in graph.inputs if gi.role == "param"}
    taken: set[int] = set()
    for node in graph.nodes:
        if node.phase != "forward":
            continue
        share = shares.get(node.id, {0: 1.0})
        for v in node.inputs:
            if v in taken or v < 0:
                continue
            gi = param_of.get(v)
            if gi is None:
                continue
            taken.add(v)
            for k, x in share.items():
                params[k] += gi.tensor.nbytes * x
        for v in node.outputs:
            if any(graph.nodes[c].phase == "backward" for c in graph.consumers.get(v, ())):
                for k, x in share.items():
                    acts[k] += graph.values[v].nbytes * x
    return LayerBytes(_normalised(params), _normalised(acts))


def pipe_share(graph: Graph) -> float:
    """The fraction of the step's parameter and optimizer-state bytes a pipeline splits
    over ``pipe``: a scanned layer stack's (its stacked inputs, and their optimizer
    state), which each stage holds only its layers of. The rest (unrolled layers,
    embeddings, the head) is whole on every ``pipe`` device in this runtime
    (:mod:`autopar.lower.pipeline`), its update run on each, its gradients all-reduced
    over ``pipe`` after the flush.

    A stacked input is one a layer scan iterates over (an ``xs`` operand), reached from
    the scan through same-shape single-operand work (a cast).

    Example:
        >>> pipe_share(graph)   # the MLP: unrolled layers, nothing split over pipe
        0.0
    """
    from autopar.search.build.coarsen import match_optimizer_state

    state = {gi.value: gi for gi in graph.inputs if gi.role in ("param", "opt_state")}
    total = sum(gi.tensor.nbytes for gi in state.values())
    if not total or not any(layer.kind == "scan" for layer in graph.layers):
        return 0.0
    producer = {v: n for n in graph.nodes for v in n.outputs}
    stacked: set[int] = set()
    for layer in graph.layers:
        if layer.kind != "scan":
            continue
        for nid in layer.nodes:
            n = graph.nodes[nid]
            if n.primitive != "scan":
                continue
            k = int(n.params.get("num_consts", 0)) + int(n.params.get("num_carry", 0))
            for v in n.inputs[k:]:
                # Back through a cast (or a copy) to the step input it reads.
                while v not in state and v in producer:
                    src = producer[v]
                    live = [u for u in src.inputs if u >= 0]
                    if len(live) != 1 or src.in_tensors[0].shape != src.out_tensors[0].shape:
                        break
                    v = live[0]
                if v in state and state[v].role == "param":
                    stacked.add(state[v].index)
    for param, states in match_optimizer_state(graph).items():
        if param in stacked:
            stacked.update(states)
    split = sum(gi.tensor.nbytes for gi in state.values() if gi.index in stacked)
    return split / total


def _normalised(xs: list[float]) -> tuple[float, ...]:
    tot = sum(xs)
    if tot <= 0:
        return tuple(1.0 / len(xs) for _ in xs)
    return tuple(x / tot for x in xs)


def stage_memory(
    state_bytes: float,
    activation_bytes: float,
    shares: LayerBytes,
    schedule: str,
    p: int,
    m: int,
    *,
    remat: bool = False,
    boundary_bytes: float = 0.0,
) -> Callable[[int, int, int], float]:
    """``memory(s, start, stop)`` for :func:`split_stages`: stage ``s``'s share of
    ``state_bytes`` (the whole model's state per device of the group) plus its layers'
    share of ``activation_bytes`` (one microbatch's, whole model) times its in-flight
    microbatches (:func:`inflight`); with ``remat`` the stage keeps its input
    (``boundary_bytes``) per microbatch in flight and re-creates one microbatch's
    activations at a time.

    Example:
        >>> lb = LayerBytes((0.5, 0.5), (0.25, 0.75))
        >>> mem = stage_memory(8.0, 4.0, lb, "1f1b", 2, 4)
        >>> mem(0, 0, 1), mem(1, 1, 2)   # 4 + 1 x 2 microbatches; 4 + 3 x 1
        (6.0, 7.0)
    """
    pp, pa = [0.0], [0.0]
    for x in shares.params:
        pp.append(pp[-1] + x)
    for x in shares.activations:
        pa.append(pa[-1] + x)

    def memory(s: int, a: int, b: int) -> float:
        held = inflight(schedule, p, m, s)
        act = activation_bytes * (pa[b] - pa[a])
        kept = boundary_bytes * held + act if remat else act * held
        return state_bytes * (pp[b] - pp[a]) + kept

    return memory
