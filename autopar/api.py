"""The public entry points; the only module that composes the stages.

``trace`` (fn -> Graph) -> ``plan`` (Graph -> Plan) -> ``lower`` (Plan -> jitted program),
with ``evaluate`` to score any plan and ``autoparallel`` to do all of it on first call.
"""

from __future__ import annotations

import functools
import inspect
import math
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax

from autopar.cache import PlanCache, plan_key, signature_fingerprint
from autopar.errors import (
    AutoparError,
    BindArgumentsError,
    InvalidOptionError,
    LoadPlanError,
    MatchSignatureError,
    ReplicatedControlFlowWarning,
    UnknownPresetError,
    UnknownPrimitiveWarning,
)
from autopar.gc_pause import gc_paused
from autopar.options import LoweringOptions, SearchOptions
from autopar.plan import Plan
from autopar.trace import Graph, trace
from autopar.trace.api import check_arguments
from autopar.trace.roles import positional_names
from cost_models import Cluster


def _resolve_cluster(cluster: Cluster | str | None) -> Cluster:
    if cluster is None:
        return Cluster.local()
    if isinstance(cluster, str):
        from cost_models import CostModelError

        try:
            return Cluster.preset(cluster)
        except CostModelError as e:
            raise UnknownPresetError(f"cluster {cluster!r}: {e}") from e
    if not isinstance(cluster, Cluster):
        raise InvalidOptionError(
            f"cluster={cluster!r} must be a cost_models.Cluster, a preset name such as "
            "'dgx-a100-80gb', or None for the local devices."
        )
    return cluster


def _resolve_options(options: SearchOptions | None) -> SearchOptions:
    if options is None:
        return SearchOptions()
    if not isinstance(options, SearchOptions):
        raise InvalidOptionError(f"options={options!r} must be an autopar.SearchOptions.")
    return options


def plan(
    fn: Callable | Graph,
    *args: Any,
    cluster: Cluster | str | None = None,
    options: SearchOptions | None = None,
    **kwargs: Any,
) -> Plan:
    """Search a parallel plan for ``fn(*args, **kwargs)`` on ``cluster``.

    Args:
        fn: the single-device training step (or an already traced :class:`Graph`).
        *args: concrete arrays or ``jax.ShapeDtypeStruct`` pytrees (nothing is allocated).
        cluster: a :class:`cost_models.Cluster`, a preset name, or ``None`` for the local
            devices.
        options: :class:`SearchOptions` (fix the mesh, memory limit, ...).

    Returns:
        A :class:`Plan` whose ``in_specs`` match ``args``.

    Example:
        >>> p = autopar.plan(step, state, batch, cluster=Cluster.preset("dgx-a100-80gb"),
        ...                  options=SearchOptions(mesh={"data": 2, "tensor": 4}))
        >>> p.mesh, p.predicted.step_time_s > 0
        ({'data': 2, 'tensor': 4}, True)
    """
    with gc_paused():  # planning keeps millions of small objects alive (autopar.gc_pause)
        graph = fn if isinstance(fn, Graph) else trace(fn, *args, **kwargs)
        if kwargs and not isinstance(fn, Graph):
            fn, args = _positional(fn, args, kwargs)
        result = _plan_graph(fn, args, graph, _resolve_cluster(cluster), _resolve_options(options))
        return _finish_plan(result, graph)


def _positional(fn: Callable, args: tuple, kwargs: dict) -> tuple[Callable, tuple]:
    """``fn(*args, **kwargs)`` as a function of one positional pytree (same flat leaves)."""

    def bound(a: tuple, k: dict) -> Any:
        return fn(*a, **k)

    return bound, (tuple(args), dict(kwargs))


def _accumulation(fn: Callable, args: tuple, graph: Graph, microbatches: int) -> Any:
    """The step analysed for ``microbatches`` (``None`` for one)."""
    if microbatches <= 1:
        return None
    from autopar.lower.split import plan_accumulation

    return plan_accumulation(fn, args, microbatches, full=graph)


def _plan_graph(
    fn: Callable | Graph, args: tuple, graph: Graph, cluster: Any, options: Any
) -> Plan:
    """Plan ``graph`` (``fn(*args)`` traced), microbatched if the options ask for it."""
    from autopar.errors import InfeasiblePlanError
    from autopar.search import plan_graph
    from autopar.search.planner import microbatch_count

    if _searches_pipelines(fn, graph, cluster, options):
        from autopar.search.outer import plan_outer

        return plan_outer(fn, args, graph, cluster, options)
    m = microbatch_count(graph, options)
    pipe = (options.mesh or {}).get("pipe", 1)
    if pipe > 1 and not isinstance(fn, Graph):
        return _plan_pipeline(fn, args, graph, cluster, options, m if m > 1 else 2 * pipe)
    if options.mesh is None and not isinstance(fn, Graph) and _may_pipeline(graph, options):
        # The intra-op search first; the memory levers (pipeline stages, stage remat,
        # microbatches) only when nothing fits without them.
        from autopar.search.outer import plain_options, plan_outer, with_levers

        if m > 1:
            try:
                return _plan_accumulated(fn, args, graph, cluster, options, m)
            except InfeasiblePlanError:
                return plan_outer(fn, args, graph, cluster, options)
        try:
            return with_levers(plan_graph(graph, cluster, plain_options(options)), graph)
        except InfeasiblePlanError as e:  # searched once: the outer loop does not again
            remats, tried = _remat_plans(graph, cluster, options)
            try:
                outer = [plan_outer(fn, args, graph, cluster, options, plain_error=e)]
            except InfeasiblePlanError as e2:
                if not remats:
                    raise e2.restated(f"{e2}{tried}") from e2
                outer = []
            return _fastest(outer + remats, options, cluster) if remats else outer[0]
    try:
        return _plan_accumulated(fn, args, graph, cluster, options, m)
    except InfeasiblePlanError as e:
        if m > 1 or isinstance(fn, Graph) or options.pipeline_stages not in (None, 1):
            raise
        remats, tried = _remat_plans(graph, cluster, options)
        if not remats:
            raise e.restated(f"{e}{tried}") from e
        return _fastest(remats, options, cluster)


_LAYER_REMATS = ("selective", "full")


def _remat_plans(graph: Graph, cluster: Any, options: SearchOptions) -> tuple[list[Plan], str]:
    """The intra-op plans of an unrolled step with each layer rematerialised (selective,
    then full), searched when nothing fits without a memory lever and the options leave
    ``remat`` open: ``(the plans that fit, what the others came to, in words)``. A scanned
    stack rematerialises per pipeline stage instead (the outer loop's lever), or inside
    the model (``nn.remat``)."""
    from dataclasses import replace

    from autopar.errors import InfeasiblePlanError, LowerPlanError
    from autopar.search import plan_graph
    from autopar.search.outer import plain_options

    if options.remat is not None or any(layer.kind == "scan" for layer in graph.layers):
        return [], ""
    # Remat frees activations only: when the state split over every device is over the
    # bound already, no policy can fit (and each search costs a whole-cluster search).
    state = sum(gi.tensor.nbytes for gi in graph.inputs if gi.role in ("param", "opt_state"))
    if state / cluster.num_devices > float(options.memory_limit_bytes or cluster.device.hbm_bytes):
        return [], ""
    plans, notes = [], []
    for remat in _LAYER_REMATS:
        try:
            plans.append(plan_graph(graph, cluster, replace(plain_options(options), remat=remat)))
        except LowerPlanError:
            return plans, ""  # nothing to recompute (no layer residuals)
        except InfeasiblePlanError as e:
            if e.smallest_bytes is not None:
                notes.append(f"{remat} {e.smallest_bytes / 2**30:.4g} GiB")
    tried = f" Each layer rematerialised: smallest footprints {', '.join(notes)}." if notes else ""
    return plans, tried


def _fastest(plans: list[Plan], options: SearchOptions, cluster: Any) -> Plan:
    """The fastest of ``plans`` (each fits), its shortlist holding the others' choices
    beside its own, ranked against it; a rematerialising plan's candidates say so."""
    from dataclasses import replace

    from autopar.search.shortlist import rank

    best = min(plans, key=lambda p: p.predicted.step_time_s)
    if not best.shortlist:
        return best

    def label(p: Plan, c: Any) -> Any:
        return replace(c, label=f"{c.label}, remat {p.remat}") if p.remat != "none" else c

    others = [label(p, c) for p in plans for c in p.shortlist if c is not best.shortlist[0]]
    # verdicts are re-said against the new winner; unsolved ones keep theirs
    others = [replace(c, verdict="") if c.step_time_s is not None else c for c in others]
    limit = float(options.memory_limit_bytes or cluster.device.hbm_bytes)
    return replace(best, shortlist=rank(label(best, best.shortlist[0]), others, limit))


def _may_pipeline(graph: Graph, options: SearchOptions) -> bool:
    """Whether the options leave pipelining open and the graph has layers to stage (a
    fixed ``remat="selective"`` is the intra-op search's: stages rematerialise ``"none"``
    or ``"full"``)."""
    return (
        options.pipeline_stages != 1
        and options.remat != "selective"
        and (options.axes is None or "pipe" in options.axes)
        and len(graph.layers) >= 2
        and any(gi.role == "batch" and gi.tensor.ndim for gi in graph.inputs)
    )


def _searches_pipelines(fn: Callable | Graph, graph: Graph, cluster: Any, options: Any) -> bool:
    """The 4D outer loop (:func:`autopar.search.outer.plan_outer`) plans the step when the
    mesh is open and the cluster spans nodes, or the options ask for a pipeline or its
    levers (stages, a schedule, full stage remat) without fixing the mesh. A fixed mesh
    without ``pipe`` and a fixed ``remat`` is an intra-op plan that rematerialises each
    unrolled layer (:func:`autopar.search.evaluate.remat_repeats`).

    Across nodes only when a pipeline splits some of the state (a scanned layer stack,
    :func:`autopar.search.interop.pipe_share`): then its stages hold and update less,
    and reduce fewer gradients over ``data``, than a whole-cluster mesh, and may beat it.
    Without one, as on one node, pipelines and microbatches are memory levers only: every
    stage holds, updates and all-reduces the whole state, and a device does the same
    work a microbatch at a time, plus a bubble. They are searched when nothing fits
    without them (a 48-block encoder-decoder on two nodes: 10 of its 25 s planning went
    to tracing a microbatch and profiling stages the screen then ruled out).
    """
    if options.mesh is not None or isinstance(fn, Graph) or not _may_pipeline(graph, options):
        return False
    asks = (
        (options.pipeline_stages or 1) > 1
        or options.schedule is not None
        or (options.remat not in (None, "none"))
    )
    if asks:
        return True
    from autopar.search.interop import pipe_share

    return cluster.num_nodes > 1 and pipe_share(graph) > 0


def _plan_accumulated(
    fn: Callable | Graph, args: tuple, graph: Graph, cluster: Any, options: Any, m: int
) -> Plan:
    from autopar.search import plan_graph

    acc = None
    if m > 1:
        if isinstance(fn, Graph):
            raise InvalidOptionError(
                f"{m} microbatches re-trace the step on one microbatch: pass the step "
                "function and its arguments, not a traced graph."
            )
        acc = _accumulation(fn, args, graph, m)
    return plan_graph(graph, cluster, options, accumulation=acc)


def _program(graph: Graph, plan: Plan, acc: Any) -> Any:
    """What the lowered pipeline of ``plan`` runs (sends, buffers), for its pricing."""
    from autopar.lower.program import pipeline_program

    return pipeline_program(graph, plan, acc)


def _inner_plan(graph: Graph, cluster: Any, options: Any, acc: Any, floor: bool) -> Plan:
    """The intra-op plan inside a pipeline's stages, solved for the whole step under
    ``options.memory_limit_bytes`` (``pipe`` times the device's: a stage holds about
    ``1/pipe`` of the step). With ``floor``, a step whose smallest footprint is over that
    is solved again just over it (the layouts that need the least; a stage holds its
    share of the activations, so they may fit where the whole step does not)."""
    from dataclasses import replace

    from autopar.errors import InfeasiblePlanError
    from autopar.search import plan_graph
    from autopar.search.outer import _FLOOR_SLACK  # the outer loop's floor retry, alike

    try:
        return plan_graph(graph, cluster, options, accumulation=acc)
    except InfeasiblePlanError as e:
        low = getattr(e, "smallest_bytes", None)
        if not floor or low is None:
            raise
        again = replace(options, memory_limit_bytes=low * (1 + _FLOOR_SLACK))
        return plan_graph(graph, cluster, again, accumulation=acc)


def _plan_pipeline(
    fn: Callable, args: tuple, graph: Graph, cluster: Any, options: SearchOptions, m: int
) -> Plan:
    """A pipeline plan for a mesh with a ``pipe`` axis (the simple search of this version).

    The layers are split over the stages evenly and, where it differs, by the inter-op
    split (:func:`_stage_splits`: Alpa's objective on the per-layer seconds; a stage
    count need not divide the layers, scanned stacks included), both priced, in the
    options' schedule (1F1B by default) and microbatches (``2 * pipe`` by default).
    Inside the stages two candidates
    are priced by :func:`autopar.search.stages.evaluate_pipeline` and the faster that fits
    is returned: data parallel over the other axes, and the intra-op plan the search finds
    for one microbatch on the mesh without ``pipe`` (memory bound: a stage's share,
    ``1/pipe`` of the whole step, so the bound given is multiplied by ``pipe``). When
    neither fits and ``remat`` is not fixed, both are priced again with every stage
    rematerialised (``stage_remat="full"``). Every candidate's stage layouts are pinned
    (:func:`autopar.search.stages.pipeline_activations`, in ``plan.activations``) and
    priced with those pins, so the lowered stages run what was priced. The plan's
    prediction is the winner's price; every candidate priced is in its shortlist."""
    from dataclasses import replace

    from autopar.axes import BATCH_AXES
    from autopar.errors import InfeasiblePlanError
    from autopar.search.outer import finish, price_pipeline
    from autopar.search.shortlist import candidate, rank

    schedule = options.schedule or "1f1b"
    v = options.virtual_stages or (2 if schedule == "interleaved-1f1b" else 1)
    if schedule not in ("gpipe", "1f1b", "interleaved-1f1b"):
        raise InvalidOptionError(
            f"schedule={schedule!r}: this version pipelines with 'gpipe', '1f1b' or "
            "'interleaved-1f1b'; 'zero-bubble' is priced by cost_models but not run yet."
        )
    if v > 1 and schedule != "interleaved-1f1b":
        raise InvalidOptionError(
            f"virtual_stages={v} needs schedule='interleaved-1f1b'; got {schedule!r}."
        )
    if options.remat not in (None, "none", "full"):
        raise InvalidOptionError(
            f"remat={options.remat!r} in a pipeline is not available: stages rematerialise "
            "'full' (keep their input, re-run their forward) or 'none'; use one of them or None."
        )
    pipe = options.mesh["pipe"]
    if options.pipeline_stages not in (None, pipe):
        raise InvalidOptionError(
            f"pipeline_stages={options.pipeline_stages} disagrees with the mesh's 'pipe' axis "
            f"of {pipe}: one stage per pipe device; give one of them."
        )
    acc = _accumulation(fn, args, graph, m)
    limit = float(options.memory_limit_bytes or cluster.device.hbm_bytes)
    sub = {a: n for a, n in options.mesh.items() if a != "pipe"}
    # A fixed ZeRO stage over data replicas is a layout the intra-op search gives the
    # stages (plain data parallel keeps the state whole on every replica).
    zero = bool(options.zero_stage) and any(a in BATCH_AXES and n > 1 for a, n in sub.items())
    inners: list[Any] = [] if zero else [None]
    if math.prod(sub.values()) > 1:
        inner_options = replace(
            options,
            mesh=sub,
            pipeline_stages=None,
            schedule=None,
            virtual_stages=None,
            remat="none",
            zero_stage=options.zero_stage,
            memory_limit_bytes=limit * pipe,
            microbatches=m,
            microbatch_size=None,
        )
        try:
            inners.append(_inner_plan(graph, cluster, inner_options, acc, floor=zero))
        except InfeasiblePlanError as e:
            if zero:
                raise e.restated(
                    f"no pipeline on {dict(options.mesh)} with zero_stage="
                    f"{options.zero_stage} fits the bound of {limit:.4g} bytes per device: "
                    f"the stages' layouts, searched for the whole step under {pipe} times "
                    f"that bound (a stage holds about 1/{pipe} of it), found none: {e}",
                    limit,
                ) from e
            # the stages' share may fit though the whole step does not
    # Remat is a memory lever: tried when the options say so, or when nothing fits without.
    remats = [options.remat] if options.remat is not None else ["none", "full"]
    splits = _stage_splits(graph, cluster, options, sub, acc, pipe * v, remats)
    priced: list[tuple] = []
    for remat in remats:
        if priced and any(not bad for bad, *_ in priced):
            break
        # The even split, and the inter-op split where it differs: each priced in full.
        split = splits.get(remat)
        for inner in inners:
            for stages in (None,) if split is None else (None, split):
                plan, ev = price_pipeline(
                    fn, args, graph, cluster, options.mesh, m, schedule, v, remat, inner, acc,
                    limit, stages=stages,
                )  # fmt: skip
                priced.append((not ev.fits, ev.step_time_s, len(priced), plan, ev))
    bad, _, index, plan, ev = min(priced, key=lambda t: t[:3])
    if bad:
        _, _, _, small, sev = min(priced, key=lambda t: t[4].memory_bytes_per_device)
        need = sev.memory_bytes_per_device
        raise InfeasiblePlanError(
            f"no pipeline plan on {dict(options.mesh)} fits the bound of {limit:.4g} bytes "
            f"per device: the smallest footprint found is {need:.4g} bytes "
            f"({need / limit - 1:+.1%}, {need - limit:.4g} bytes over), with "
            f"{small.name!r} (the levers tried: {', '.join(remats)} stage remat, data "
            "parallel or searched layouts inside the stages); use more stages, more "
            "microbatches (1F1B), or a larger memory_limit_bytes."
        )
    others = [candidate(q.name, q.mesh, e) for *_, i, q, e in priced if i != index]
    return finish(plan, ev, cluster, rank(candidate(plan.name, plan.mesh, ev), others, limit))


def _stage_splits(
    graph: Graph, cluster: Any, options: SearchOptions, sub: Mapping[str, int], acc: Any,
    chunks: int, remats: Sequence[str],
) -> dict[str, tuple[tuple[int, int], ...]]:  # fmt: skip
    """Per stage remat policy, the inter-op split of the layers into ``chunks`` stages
    (:func:`autopar.search.interop.split_stages`: Alpa's objective, the smallest
    bottleneck) from one microbatch's per-layer seconds on the mesh without ``pipe``
    (:func:`autopar.search.outer.profile`: the embedding with the first layer, the head
    with the last; full remat runs each layer's forward twice), where it differs from
    the even split; unrolled or scanned stacks alike (a scanned stack split unevenly runs
    in padded slots: :attr:`autopar.lower.stages.StageCut.uneven_stacks`).

    Example: a heavy head on the last of 6 layers, 2 stages: ``{"none": ((0, 5), (5, 6))}``.
    """
    from autopar.lower.split import even_stages
    from autopar.search.interop import split_stages
    from autopar.search.outer import profile

    n = len(graph.layers)
    if n < chunks or chunks < 2:
        return {}
    prof = profile(graph, cluster, options, dict(sub) or {"data": 1}, acc)
    fwd, bwd = prof.layer_forward_s, prof.layer_backward_s
    if len(fwd) != n or len(bwd) != n:
        return {}
    out = {}
    for remat in remats:
        redo = 1.0 if remat == "full" else 0.0
        costs = [f * (1 + redo) + b for f, b in zip(fwd, bwd, strict=True)]
        stages = split_stages(costs, chunks)
        if stages is not None and stages != even_stages(n, chunks):
            out[remat] = stages
    return out


def _finish_plan(p: Plan, graph: Graph) -> Plan:
    from dataclasses import replace

    if not p.fingerprint:
        p = replace(p, fingerprint=signature_fingerprint(graph))
    return p.bind(graph.in_tree, graph.out_tree)


@gc_paused()  # it traces and builds as plan does (autopar.gc_pause)
def evaluate(
    fn_or_graph: Callable | Graph,
    plan: Plan,
    cluster: Cluster | str | None = None,
    *args: Any,
    **kwargs: Any,
):
    """Score any plan (searched or hand-written) with the cost model.

    Args:
        fn_or_graph: a traced :class:`Graph`, or the step function followed by its ``args``.
        plan: the plan to score.
        cluster: the hardware to score it on (default: the local devices).

    Returns:
        An ``Evaluation`` with the predicted step time, its compute / communication /
        bubble breakdown, per-collective times and per-device memory.

    Example:
        >>> ev = autopar.evaluate(graph, autopar.baselines.data_parallel(graph, {"data": 8}),
        ...                       "dgx-a100-80gb")
        >>> dict(ev.mesh), ev.step_time_s >= ev.compute_s > 0
        ({'data': 8}, True)
    """
    from autopar.search import evaluate_plan

    graph = fn_or_graph if isinstance(fn_or_graph, Graph) else trace(fn_or_graph, *args, **kwargs)
    m = plan.pipeline.microbatches if plan.pipeline is not None else 1
    acc = None
    if m > 1 and not isinstance(fn_or_graph, Graph):
        fn, a = _positional(fn_or_graph, args, kwargs) if kwargs else (fn_or_graph, args)
        acc = _accumulation(fn, a, graph, m)
    if plan.pipeline is not None and plan.pipeline.num_stages > 1:
        from autopar.search.stages import evaluate_pipeline

        if acc is None:
            raise InvalidOptionError(
                "a pipeline plan is scored from the step function: "
                "autopar.evaluate(fn, plan, cluster, *args)."
            )
        return evaluate_pipeline(
            graph, plan, _resolve_cluster(cluster), acc, program=_program(graph, plan, acc)
        )
    return evaluate_plan(graph, plan, _resolve_cluster(cluster), accumulation=acc)


@gc_paused()  # it traces and builds as plan does (autopar.gc_pause)
def complete(
    fn_or_graph: Callable | Graph,
    plan: Plan,
    cluster: Cluster | str | None = None,
    *args: Any,
    **kwargs: Any,
) -> Plan:
    """``plan`` with every activation layout pinned and its prediction filled in, so that
    the program lowered from it is the one the cost model scored (a hand-written plan
    fixes only input and output layouts; see ``autopar.search.complete_plan``).

    Example:
        >>> dp = autopar.complete(graph, autopar.baselines.data_parallel(graph, {"data": 8}),
        ...                       "dgx-a100-80gb")
        >>> dp.predicted.step_time_s > 0
        True
    """
    from dataclasses import replace

    from autopar.search import complete_plan

    graph = fn_or_graph if isinstance(fn_or_graph, Graph) else trace(fn_or_graph, *args, **kwargs)
    cluster = _resolve_cluster(cluster)
    if plan.pipeline is not None and plan.pipeline.num_stages > 1:
        # A pipeline's stages are completed on one microbatch, without ``pipe``
        # (autopar.search.stages.pipeline_activations), and priced with those pins.
        from autopar.search.stages import evaluate_pipeline, pipeline_activations

        if isinstance(fn_or_graph, Graph):
            raise InvalidOptionError(
                "a pipeline plan is completed from the step function: "
                "autopar.complete(fn, plan, cluster, *args)."
            )
        fn, a = _positional(fn_or_graph, args, kwargs) if kwargs else (fn_or_graph, args)
        acc = _accumulation(fn, a, graph, plan.pipeline.microbatches)
        pinned = replace(plan, activations=pipeline_activations(graph, plan, cluster, acc))
        ev = evaluate_pipeline(graph, pinned, cluster, acc, program=_program(graph, pinned, acc))
        return _finish_plan(replace(pinned, predicted=ev.to_predicted()), graph)
    return _finish_plan(complete_plan(graph, plan, cluster), graph)


def verify(plan: Plan, lowered: Any, *args: Any):
    """Compare what XLA compiled (collectives, memory) with what ``plan`` predicted.

    ``lowered`` is what ``f.lower(*args)`` returns for an ``@autoparallel`` function.
    """
    from autopar.verify import verify as _verify

    return _verify(plan, lowered, *args)


@dataclass
class _Entry:
    """One compiled specialisation of an ``@autoparallel`` function.

    ``fast``: calls of this signature hand their positional arguments unchanged to
    ``lowered.jitted`` (no static arguments, no keywords), so the next call may try the
    ``jax.jit`` object directly (:meth:`AutoParallel.__call__`)."""

    plan: Plan
    graph: Graph
    lowered: Any  # autopar.lower.LoweredStep
    fast: bool = False
    timings: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class _Call:
    """One call's arguments, split the way ``jax.jit`` splits them.

    Attributes:
        n: how many positional arguments (after binding keywords to positions).
        static_pos: ``{position: value}`` of static positional arguments.
        static_kw: ``{name: value}`` of static keyword-only arguments.
        dyn: the dynamic arguments the lowered program takes: the dynamic positional
            ones, then (when keyword-only arguments were passed) one dict of them.
        kw_names: the names of the dynamic keyword-only arguments (``()``: none).
    """

    n: int
    static_pos: Mapping[int, Any]
    static_kw: Mapping[str, Any]
    dyn: tuple[Any, ...]
    kw_names: tuple[str, ...]

    @property
    def plain(self) -> bool:
        """The dynamic arguments are the call's positional arguments, unchanged."""
        return not self.static_pos and not self.static_kw and not self.kw_names


_FAST_FALLBACK = (MatchSignatureError, ValueError, TypeError)


class AutoParallel:
    """A training step that plans, lowers and compiles itself on first call.

    Calls take what ``jax.jit`` takes: positional and keyword arguments, pytrees with
    ``None`` leaves, Python numbers, static arguments (``static_argnums`` /
    ``static_argnames``), typed PRNG keys. Each new signature (tree structure, shapes,
    dtypes, static values) is traced, planned and lowered once; later calls with a
    signature already seen go straight to its ``jax.jit`` program (see :meth:`__call__`).

    Use through :func:`autoparallel`.
    """

    def __init__(
        self,
        fn: Callable,
        *,
        cluster: Cluster | str | None = None,
        options: SearchOptions | None = None,
        plan: Plan | str | None = None,
        static_argnums: int | Sequence[int] = (),
        static_argnames: str | Sequence[str] = (),
        donate_argnums: int | Sequence[int] = (),
        donate_argnames: str | Sequence[str] = (),
        cache: bool | str = True,
    ) -> None:
        if not callable(fn):
            raise InvalidOptionError(f"@autoparallel needs a function, got {fn!r}.")
        self.fn = fn
        functools.update_wrapper(self, fn)
        self._cluster_arg = cluster
        self.options = _resolve_options(options)
        self._signature = _signature_of(fn)
        static_nums, self._static_names = _resolve_argnames(
            fn, self._signature, "static", static_argnums, static_argnames
        )
        donate_nums, donate_names = _resolve_argnames(
            fn, self._signature, "donate", donate_argnums, donate_argnames
        )
        kw_only = sorted(set(donate_names) - set(_positional_names(self._signature)))
        if kw_only:
            raise InvalidOptionError(
                f"donate_argnames={kw_only} names keyword-only parameters of "
                f"{_name(fn)}; donation is by position: make them positional parameters, "
                "or leave them out of donate_argnames."
            )
        self.lowering_options = LoweringOptions(
            donate_argnums=donate_nums, static_argnums=static_nums
        )
        if isinstance(plan, str):
            plan = Plan.load(plan)
        if plan is not None and not isinstance(plan, Plan) and not _is_spec_tree(plan):
            raise InvalidOptionError(
                f"plan={plan!r} must be an autopar.Plan, a JSON path, or a pytree of "
                "PartitionSpec / NamedSharding for the arguments (autopar.export)."
            )
        self._fixed_plan = plan
        if cache is False:
            self._cache = None
        else:
            self._cache = PlanCache(None if cache is True else cache)
        self._entries: dict[Any, _Entry] = {}
        self._last: tuple[Any, _Entry] | None = None
        # The jax.jit object of the last plain signature called: tried first by __call__.
        self._fast: Callable | None = None
        self._cluster: Cluster | None = None
        self.last_timings: dict[str, float] = {}

    # -- specialisation ---------------------------------------------------------------
    @property
    def cluster(self) -> Cluster:
        if self._cluster is None:
            self._cluster = _resolve_cluster(self._cluster_arg)
        return self._cluster

    def _split(self, args: tuple, kwargs: dict) -> _Call:
        """Bind ``args``/``kwargs`` as the function would and split off static ones."""
        if kwargs:
            if self._signature is not None:
                try:
                    bound = self._signature.bind(*args, **kwargs)
                except TypeError as e:
                    raise BindArgumentsError(
                        f"{_name(self.fn)}{self._signature} cannot take these arguments: {e}. "
                        "Call the decorated step as you would call the function itself."
                    ) from e
                args, kwargs = bound.args, bound.kwargs
        static = self.lowering_options.static_argnums
        static_pos = {i: args[i] for i in static if i < len(args)}
        static_kw = {k: v for k, v in kwargs.items() if k in self._static_names}
        dyn_kw = {k: v for k, v in kwargs.items() if k not in self._static_names}
        dyn = tuple(a for i, a in enumerate(args) if i not in static_pos)
        if dyn_kw:
            dyn = (*dyn, dyn_kw)
        return _Call(len(args), static_pos, static_kw, dyn, tuple(dyn_kw))

    def _key(self, call: _Call) -> Any:
        """The signature ``call`` is compiled for: tree structure, shapes and dtypes of the
        dynamic leaves, and the static values (which must be hashable, as in ``jax.jit``)."""
        leaves, tree = jax.tree_util.tree_flatten(call.dyn)
        avals = []
        for x in leaves:
            try:
                aval = jax.typeof(x)
            except TypeError:
                # Not a JAX type: name the leaf and say what to do (TraceFunctionError).
                check_arguments(self.fn, call.dyn, {})
                aval = jax.ShapeDtypeStruct(tuple(x.shape), x.dtype)
            avals.append((tuple(aval.shape), str(aval.dtype)))
        static = (
            tuple(sorted(call.static_pos.items())),
            tuple(sorted(call.static_kw.items())),
        )
        try:
            hash(static)
        except TypeError as e:
            where = {**{f"argument {i}": v for i, v in call.static_pos.items()}, **call.static_kw}
            raise BindArgumentsError(
                f"static arguments must be hashable (they key the compiled program, as in "
                f"jax.jit), got {where!r:.200} ({e}). Pass tuples instead of lists, a frozen "
                "dataclass instead of a dict, or make the argument dynamic (an array)."
            ) from e
        return (tree, tuple(avals), call.n, static)

    def _bound_fn(self, call: _Call) -> Callable:
        """The function of ``call.dyn`` (static arguments closed over, keyword-only
        arguments in one trailing dict), named like the user's parameters."""
        if call.plain:
            return self.fn
        fn, n, static_pos, static_kw = self.fn, call.n, dict(call.static_pos), call.static_kw
        has_kw = bool(call.kw_names)

        def bound(*dyn_args: Any) -> Any:
            pos = dyn_args[:-1] if has_kw else dyn_args
            kw = {**static_kw, **(dyn_args[-1] if has_kw else {})}
            it = iter(pos)
            return fn(*[static_pos[i] if i in static_pos else next(it) for i in range(n)], **kw)

        try:
            bound.__signature__ = _dynamic_signature(fn, static_pos, n, has_kw)
        except (TypeError, ValueError):
            pass
        bound.__name__ = getattr(fn, "__name__", "step")
        bound.__qualname__ = getattr(fn, "__qualname__", bound.__name__)
        return bound

    def _check_devices(self) -> None:
        """The plan must run here: the mesh (fixed, or the whole cluster) needs exactly the
        devices JAX sees. Checked before tracing, not after a search."""
        need = (
            math.prod(self.options.mesh.values())
            if self.options.mesh is not None
            else self.cluster.num_devices
        )
        have = jax.device_count()
        if need != have:
            where = (
                f"the mesh {dict(self.options.mesh)}"
                if self.options.mesh is not None
                else f"the cluster {self.cluster.name!r} ({self.cluster.num_nodes} node(s) x "
                f"{self.cluster.devices_per_node} devices)"
            )
            raise InvalidOptionError(
                f"{where} has {need} devices but JAX sees {have} here, and @autoparallel runs "
                f"the step here: give a mesh or cluster of {have} devices (cluster=None uses "
                "the local ones), or plan for other hardware with autopar.plan(...) without "
                "running it."
            )

    def _specialise(self, call: _Call) -> _Entry:
        from autopar.lower import lower_plan

        timings: dict[str, float] = {}
        fn, dyn = self._bound_fn(call), call.dyn
        if self._fixed_plan is None:
            self._check_devices()
        t0 = time.perf_counter()
        graph = trace(fn, *dyn)
        timings["trace_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        p = self._fixed_plan
        if p is not None and not isinstance(p, Plan):
            p = _plan_from_spec_tree(self, fn, p, dyn, graph)
        if p is not None:
            check_plan_matches(p, graph)
            timings["plan_source"] = 0.0  # user-supplied
        else:
            warn_unknown_primitives(graph)
            key = None
            if self._cache is not None:
                key = plan_key(graph, self.cluster, self.options)
                p = self._cache.get(key)
                timings["cache_hit"] = float(p is not None)
            if p is None:
                p = _plan_graph(fn, dyn, graph, self.cluster, self.options)
                if self._cache is not None:
                    self._cache.put(key, _finish_plan(p, graph))
        p = _finish_plan(p, graph)
        timings["plan_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        lowered = lower_plan(fn, p, dyn, graph=graph, options=self._dyn_lowering_options(call))
        timings["lower_s"] = time.perf_counter() - t0
        return _Entry(plan=p, graph=graph, lowered=lowered, fast=call.plain, timings=timings)

    def _dyn_lowering_options(self, call: _Call) -> LoweringOptions:
        """Re-number donated arguments after static ones are removed."""
        dyn_index = [i for i in range(call.n) if i not in call.static_pos]
        donate = tuple(
            dyn_index.index(i) for i in self.lowering_options.donate_argnums if i in dyn_index
        )
        return LoweringOptions(donate_argnums=donate)

    def _entry(self, args: tuple, kwargs: dict) -> tuple[_Entry, _Call]:
        call = self._split(args, kwargs)
        key = self._key(call)
        entry = self._entries.get(key)
        if entry is None:
            entry = self._specialise(call)
            self._entries[key] = entry
            self.last_timings = dict(entry.timings)
        self._last = (key, entry)
        return entry, call

    # -- user API ---------------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Run the step. The first call per signature traces, plans, lowers and compiles.

        Later calls of a plain signature (positional arguments, nothing static) go
        straight to the ``jax.jit`` object the plan was lowered to, so they cost what a
        hand-written ``jax.jit`` call costs (its C++ dispatch). That program refuses, while
        tracing, arguments of another signature (``MatchSignatureError``), and ``jax.jit``
        refuses inputs committed to other layouts: both fall through to the full path,
        which finds (or builds) the signature's program and copies misplaced inputs.
        """
        fast = self._fast
        if fast is not None and not kwargs:
            try:
                return fast(*args)
            except _FAST_FALLBACK:
                pass  # another signature or layout, or a real error the full path explains
        return self._call(args, kwargs)

    def _call(self, args: tuple, kwargs: dict) -> Any:
        entry, call = self._entry(args, kwargs)
        jitted = entry.lowered.jitted
        self._fast = jitted if entry.fast else None
        try:
            # Arguments already laid out as planned (e.g. the previous step's outputs), or
            # uncommitted host/single-device arrays that jit places itself.
            return jitted(*call.dyn)
        except ValueError as e:
            if "does not match the sharding" not in str(e):
                raise
        # Committed to another layout: copy onto the planned shardings. The user's arrays
        # are left untouched (never donated unless named in donate_argnums).
        return jitted(*entry.lowered.place_inputs(call.dyn))

    def plan_for(self, *args: Any, **kwargs: Any) -> Plan:
        """The plan this function uses for ``args`` (traces and plans, does not run)."""
        return self._entry(args, kwargs)[0].plan

    def graph_for(self, *args: Any, **kwargs: Any) -> Graph:
        """The traced graph for ``args``."""
        return self._entry(args, kwargs)[0].graph

    def lower(self, *args: Any, **kwargs: Any):
        """The lowered step for ``args``: ``.hlo_text()``, ``.compile()``,
        ``.memory_analysis()``; pass it to :func:`autopar.verify`."""
        return self._entry(args, kwargs)[0].lowered

    def verify(self, *args: Any, **kwargs: Any):
        """Plan-vs-compiled report for ``args`` (collectives and memory)."""
        entry, call = self._entry(args, kwargs)
        return verify(entry.plan, entry.lowered, *call.dyn)


def _name(fn: Callable) -> str:
    return getattr(fn, "__qualname__", getattr(fn, "__name__", repr(fn)))


def _signature_of(fn: Callable) -> inspect.Signature | None:
    try:
        return inspect.signature(fn)
    except (TypeError, ValueError):
        return None


def _positional_names(sig: inspect.Signature | None) -> list[str]:
    if sig is None:
        return []
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return [p.name for p in sig.parameters.values() if p.kind in kinds]


def _resolve_argnames(
    fn: Callable,
    sig: inspect.Signature | None,
    what: str,
    nums: int | Sequence[int],
    names: str | Sequence[str],
) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """``(argnums, argnames)`` completed from each other through the signature, as
    ``jax.jit`` does: a name of a positional parameter adds its position, a position of a
    named parameter adds its name."""
    nums = (nums,) if isinstance(nums, int) else tuple(nums)
    names = (names,) if isinstance(names, str) else tuple(names)
    bad = [n for n in nums if not isinstance(n, int) or isinstance(n, bool) or n < 0]
    if bad:
        raise InvalidOptionError(
            f"{what}_argnums={nums!r}: give non-negative argument positions (ints)."
        )
    if not all(isinstance(n, str) for n in names):
        raise InvalidOptionError(f"{what}_argnames={names!r}: give parameter names (str).")
    positional = _positional_names(sig)
    if sig is not None:
        params = sig.parameters
        var_kw = any(p.kind == p.VAR_KEYWORD for p in params.values())
        unknown = [n for n in names if n not in params and not var_kw]
        if unknown:
            raise InvalidOptionError(
                f"{what}_argnames={list(names)} names {unknown}, not parameters of "
                f"{_name(fn)}{sig}; use its parameter names."
            )
    out_nums = set(nums) | {positional.index(n) for n in names if n in positional}
    out_names = set(names) | {
        positional[i]
        for i in nums
        if i < len(positional)
        and sig is not None
        and sig.parameters[positional[i]].kind != inspect.Parameter.POSITIONAL_ONLY
    }
    return tuple(sorted(out_nums)), tuple(sorted(out_names))


def _is_spec_tree(x: Any) -> bool:
    from autopar.export import is_spec_tree

    return is_spec_tree(x)


def _plan_from_spec_tree(f: AutoParallel, fn: Callable, specs: Any, dyn: tuple, graph: Graph):
    """``autoparallel(plan=specs)``: a ``PartitionSpec`` / ``NamedSharding`` pytree for the
    arguments as a plan (:func:`autopar.export.plan_from_specs`; the mesh from the
    ``NamedSharding``s or ``options.mesh``)."""
    from autopar.export import plan_from_specs

    return plan_from_specs(fn, specs, *dyn, mesh=f.options.mesh, cluster=f.cluster, graph=graph)


def _dynamic_signature(
    fn: Callable, static: Mapping[int, Any], n: int, has_kw: bool
) -> inspect.Signature:
    """The signature of the bound function of a call's dynamic arguments: the first ``n``
    positional parameters without the static ones, then ``kwargs`` if keyword-only
    arguments were passed (their dict)."""
    sig = inspect.signature(fn)
    names = positional_names(fn, n)
    kind = inspect.Parameter.POSITIONAL_ONLY
    params = [inspect.Parameter(names[i], kind) for i in range(n) if i not in static]
    if has_kw:
        params.append(inspect.Parameter("kwargs", kind))
    return sig.replace(parameters=params, return_annotation=inspect.Signature.empty)


def warn_unknown_primitives(graph: Graph) -> None:
    """Warn about what the search can only replicate: primitives of ``graph`` (loop
    bodies included) autopar has no sharding rule for (:class:`UnknownPrimitiveWarning`),
    and branches or loops over arrays (``cond``, ``while``:
    :class:`ReplicatedControlFlowWarning`; ``scan`` is sharded)."""
    from autopar.primitives import KNOWN

    counts: dict[str, int] = {}
    control: dict[str, int] = {}

    def walk(g: Graph) -> None:
        for node in g.nodes:
            if node.primitive not in KNOWN:
                counts[node.primitive] = counts.get(node.primitive, 0) + 1
            elif node.primitive in _REPLICATED_CONTROL_FLOW and any(
                t.size > 1 for t in node.in_tensors
            ):
                control[node.primitive] = control.get(node.primitive, 0) + 1
            for body in node.body:
                walk(body)

    walk(graph)
    for found, what, cls in (
        (
            counts,
            "autopar has no sharding rule for {names}: these equations run replicated (every "
            "device computes them on whole tensors, after gathering their inputs) and count "
            "0 FLOPs in the cost model. The step still computes the same values; to have "
            "them sharded, express them with standard jax.numpy / lax operations.",
            UnknownPrimitiveWarning,
        ),
        (
            control,
            "the step branches or loops over arrays ({names}): autopar cannot shard "
            "lax.cond / lax.switch / lax.while_loop yet, so their array operands and results "
            "are whole on every device (the plan gathers them first; a cond over the "
            "optimizer state, as optax.MultiSteps or a loss-scale skip makes, rules out "
            "ZeRO). The values are unchanged. For an elementwise choice use jnp.where; for "
            "a loop with a known trip count, lax.scan or lax.fori_loop with static bounds; "
            "to accumulate gradients, SearchOptions(microbatches=k) instead of "
            "optax.MultiSteps.",
            ReplicatedControlFlowWarning,
        ),
    ):
        if found:
            names = ", ".join(f"{p} (x{n})" for p, n in sorted(found.items()))
            warnings.warn(what.format(names=names), cls, stacklevel=3)


_REPLICATED_CONTROL_FLOW = frozenset({"cond", "while"})


def check_plan_matches(p: Plan, graph: Graph) -> None:
    """Refuse a plan made for a different function signature, naming the first difference."""
    if len(p.inputs) != len(graph.inputs):
        raise LoadPlanError(
            f"the plan was made for a function with {len(p.inputs)} input leaves, this call "
            f"has {len(graph.inputs)}; re-plan with autopar.plan(...) for this signature."
        )
    for rec, inp in zip(p.inputs, graph.inputs, strict=True):
        if (
            rec.path != inp.path
            or tuple(rec.shape) != inp.tensor.shape
            or rec.dtype != inp.tensor.dtype
        ):
            raise LoadPlanError(
                f"the plan does not match this function: input {inp.index} is {inp.path} "
                f"{inp.tensor.shape} {inp.tensor.dtype} but the plan has {rec.path} "
                f"{tuple(rec.shape)} {rec.dtype}; re-plan for this signature."
            )


def autoparallel(
    fn: Callable | None = None,
    *,
    cluster: Cluster | str | None = None,
    options: SearchOptions | None = None,
    plan: Plan | str | None = None,
    static_argnums: int | Sequence[int] = (),
    static_argnames: str | Sequence[str] = (),
    donate_argnums: int | Sequence[int] = (),
    donate_argnames: str | Sequence[str] = (),
    cache: bool | str = True,
):
    """Decorate a single-device training step so it runs sharded over a device mesh.

    Usable bare (``@autoparallel``) or with arguments. The first call per input signature
    traces, plans (or reads the plan cache), lowers and compiles; later calls dispatch
    straight to the compiled program. Only arguments in ``donate_argnums`` are donated.

    Args:
        fn: the step function.
        cluster: hardware to plan for (default: the local devices). It may describe other
            hardware than the local devices when the device counts agree.
        options: :class:`SearchOptions`.
        plan: a :class:`Plan`, a path to plan JSON, or a pytree of ``PartitionSpec`` /
            ``NamedSharding`` for the arguments (``autopar.export.partition_specs``), to
            use instead of searching.
        static_argnums: arguments that are Python values, baked into the program (one
            program per value, which must be hashable), as in ``jax.jit``.
        static_argnames: the same, by parameter name.
        donate_argnums: arguments whose buffers the step may reuse.
        donate_argnames: the same, by parameter name.
        cache: ``True`` (default cache dir), ``False`` (no cache), or a directory.

    Example:
        >>> @autopar.autoparallel(options=SearchOptions(mesh={"data": 2, "tensor": 4}),
        ...                       cache=False)
        ... def train_step(state, batch):
        ...     return step(state, batch)                  # the single-device step
        >>> print(autopar.report.summary(train_step.plan_for(state, batch)))  # plans only
        Plan 'autopar': mesh data=2 x tensor=4 (8 devices), ZeRO stage ...
        >>> state, loss = train_step(state, batch)  # compiles, ~1 s  # doctest: +SKIP
    """

    def wrap(f: Callable) -> AutoParallel:
        return AutoParallel(
            f,
            cluster=cluster,
            options=options,
            plan=plan,
            static_argnums=static_argnums,
            static_argnames=static_argnames,
            donate_argnums=donate_argnums,
            donate_argnames=donate_argnames,
            cache=cache,
        )

    if fn is not None:
        return wrap(fn)
    return wrap


__all__ = [
    "AutoParallel",
    "AutoparError",
    "autoparallel",
    "check_plan_matches",
    "evaluate",
    "plan",
    "trace",
    "verify",
]
