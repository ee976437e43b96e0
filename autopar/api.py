"""The public entry points; the only module that composes the stages.

``trace`` (fn -> Graph) -> ``plan`` (Graph -> Plan) -> ``lower`` (Plan -> jitted program),
with ``evaluate`` to score any plan and ``autoparallel`` to do all of it on first call.
"""

from __future__ import annotations

import functools
import inspect
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax

from autopar.cache import PlanCache, plan_key, signature_fingerprint
from autopar.errors import AutoparError, InvalidOptionError, LoadPlanError, UnknownPresetError
from autopar.options import LoweringOptions, SearchOptions
from autopar.plan import Plan
from autopar.trace import Graph, trace
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
        # One node's intra-op search first; the memory levers (pipeline stages, stage
        # remat, microbatches) only when nothing fits without them.
        try:
            return (
                plan_graph(graph, cluster, options)
                if m == 1
                else _plan_accumulated(fn, args, graph, cluster, options, m)
            )
        except InfeasiblePlanError:
            from autopar.search.outer import plan_outer

            return plan_outer(fn, args, graph, cluster, options)
    return _plan_accumulated(fn, args, graph, cluster, options, m)


def _may_pipeline(graph: Graph, options: SearchOptions) -> bool:
    """Whether the options leave pipelining open and the graph has layers to stage."""
    return (
        options.pipeline_stages != 1
        and (options.axes is None or "pipe" in options.axes)
        and options.zero_stage in (None, 0)
        and len(graph.layers) >= 2
        and any(gi.role == "batch" and gi.tensor.ndim for gi in graph.inputs)
    )


def _searches_pipelines(fn: Callable | Graph, graph: Graph, cluster: Any, options: Any) -> bool:
    """The 4D outer loop (:func:`autopar.search.outer.plan_outer`) plans the step when the
    mesh is open and the cluster spans nodes, or the options ask for a pipeline or its
    levers (stages, a schedule, stage remat) without fixing the mesh."""
    if options.mesh is not None or isinstance(fn, Graph) or not _may_pipeline(graph, options):
        return False
    asks = (
        (options.pipeline_stages or 1) > 1
        or options.schedule is not None
        or (options.remat not in (None, "none"))
    )
    return asks or cluster.num_nodes > 1


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


def _plan_pipeline(
    fn: Callable, args: tuple, graph: Graph, cluster: Any, options: SearchOptions, m: int
) -> Plan:
    """A pipeline plan for a mesh with a ``pipe`` axis (the simple search of this version).

    The layers are split evenly over the stages, in the options' schedule (1F1B by
    default) and microbatches (``2 * pipe`` by default). Inside the stages two candidates
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

    from autopar.errors import InfeasiblePlanError
    from autopar.search import plan_graph
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
    if options.zero_stage not in (None, 0):
        raise InvalidOptionError(
            f"zero_stage={options.zero_stage} in a pipeline is not available yet: use None "
            "or 0 (parameters of a scanned stack are split over 'pipe' already)."
        )
    acc = _accumulation(fn, args, graph, m)
    limit = float(options.memory_limit_bytes or cluster.device.hbm_bytes)
    sub = {a: n for a, n in options.mesh.items() if a != "pipe"}
    inners: list[Any] = [None]
    if math.prod(sub.values()) > 1:
        inner_options = replace(
            options,
            mesh=sub,
            pipeline_stages=None,
            schedule=None,
            virtual_stages=None,
            remat="none",
            zero_stage=None,
            memory_limit_bytes=limit * pipe,
            microbatches=m,
            microbatch_size=None,
        )
        try:
            inners.append(plan_graph(graph, cluster, inner_options, accumulation=acc))
        except InfeasiblePlanError:
            pass  # the stages' share may fit though the whole step does not
    # Remat is a memory lever: tried when the options say so, or when nothing fits without.
    remats = [options.remat] if options.remat is not None else ["none", "full"]
    priced: list[tuple] = []
    for remat in remats:
        if priced and any(not bad for bad, *_ in priced):
            break
        for inner in inners:
            plan, ev = price_pipeline(
                fn, args, graph, cluster, options.mesh, m, schedule, v, remat, inner, acc, limit
            )
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


def _finish_plan(p: Plan, graph: Graph) -> Plan:
    from dataclasses import replace

    if not p.fingerprint:
        p = replace(p, fingerprint=signature_fingerprint(graph))
    return p.bind(graph.in_tree, graph.out_tree)


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
    """One compiled specialisation of an ``@autoparallel`` function."""

    plan: Plan
    graph: Graph
    lowered: Any  # autopar.lower.LoweredStep
    timings: dict[str, float] = field(default_factory=dict)


class AutoParallel:
    """A training step that plans, lowers and compiles itself on first call.

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
        donate_argnums: int | Sequence[int] = (),
        cache: bool | str = True,
    ) -> None:
        if not callable(fn):
            raise InvalidOptionError(f"@autoparallel needs a function, got {fn!r}.")
        self.fn = fn
        functools.update_wrapper(self, fn)
        self._cluster_arg = cluster
        self.options = _resolve_options(options)
        if isinstance(static_argnums, int):
            static_argnums = (static_argnums,)
        if isinstance(donate_argnums, int):
            donate_argnums = (donate_argnums,)
        self.lowering_options = LoweringOptions(
            donate_argnums=tuple(donate_argnums), static_argnums=tuple(static_argnums)
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
        self._cluster: Cluster | None = None
        self.last_timings: dict[str, float] = {}

    # -- specialisation ---------------------------------------------------------------
    @property
    def cluster(self) -> Cluster:
        if self._cluster is None:
            self._cluster = _resolve_cluster(self._cluster_arg)
        return self._cluster

    def _split_static(self, args: tuple) -> tuple[tuple, tuple]:
        static = self.lowering_options.static_argnums
        for i in static:
            if i >= len(args):
                raise InvalidOptionError(
                    f"static_argnums names argument {i} but only {len(args)} were passed."
                )
        dyn = tuple(a for i, a in enumerate(args) if i not in static)
        stat = tuple((i, args[i]) for i in static)
        return dyn, stat

    def _key(self, args: tuple) -> Any:
        dyn, stat = self._split_static(args)
        leaves, tree = jax.tree_util.tree_flatten(dyn)
        avals = tuple((tuple(x.shape), str(x.dtype)) for x in leaves)
        return (tree, avals, stat)

    def _bound_fn(self, args: tuple) -> tuple[Callable, tuple]:
        """The function of the dynamic arguments only (static ones closed over)."""
        static = dict(self._split_static(args)[1])
        if not static:
            return self.fn, args
        dyn = tuple(a for i, a in enumerate(args) if i not in static)
        n = len(args)
        fn = self.fn

        def bound(*dyn_args):
            it = iter(dyn_args)
            full = [static[i] if i in static else next(it) for i in range(n)]
            return fn(*full)

        try:
            bound.__signature__ = _dynamic_signature(fn, static)
        except (TypeError, ValueError):
            pass
        return bound, dyn

    def _specialise(self, args: tuple) -> _Entry:
        from autopar.lower import lower_plan

        timings: dict[str, float] = {}
        fn, dyn = self._bound_fn(args)
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
        lowered = lower_plan(fn, p, dyn, graph=graph, options=self._dyn_lowering_options(args))
        timings["lower_s"] = time.perf_counter() - t0
        return _Entry(plan=p, graph=graph, lowered=lowered, timings=timings)

    def _dyn_lowering_options(self, args: tuple) -> LoweringOptions:
        """Re-number donated arguments after static ones are removed."""
        static = set(self.lowering_options.static_argnums)
        dyn_index = [i for i in range(len(args)) if i not in static]
        donate = tuple(dyn_index.index(i) for i in self.lowering_options.donate_argnums)
        return LoweringOptions(donate_argnums=donate)

    def _entry(self, args: tuple) -> _Entry:
        key = self._key(args)
        entry = self._entries.get(key)
        if entry is None:
            entry = self._specialise(args)
            self._entries[key] = entry
            self.last_timings = dict(entry.timings)
        self._last = (key, entry)
        return entry

    # -- user API ---------------------------------------------------------------------
    def __call__(self, *args: Any):
        entry = self._entry(args)
        dyn = self._split_static(args)[0] if self.lowering_options.static_argnums else args
        try:
            # Fast path: arguments already laid out as planned (e.g. the previous step's
            # outputs), or uncommitted host/single-device arrays that jit places itself.
            return entry.lowered.jitted(*dyn)
        except ValueError as e:
            if "does not match the sharding" not in str(e):
                raise
        # Committed to another layout: copy onto the planned shardings. The user's arrays
        # are left untouched (never donated unless named in donate_argnums).
        return entry.lowered.jitted(*entry.lowered.place_inputs(dyn))

    def plan_for(self, *args: Any) -> Plan:
        """The plan this function uses for ``args`` (traces and plans, does not run)."""
        return self._entry(args).plan

    def graph_for(self, *args: Any) -> Graph:
        """The traced graph for ``args``."""
        return self._entry(args).graph

    def lower(self, *args: Any):
        """The lowered step for ``args``: ``.hlo_text()``, ``.compile()``,
        ``.memory_analysis()``; pass it to :func:`autopar.verify`."""
        return self._entry(args).lowered

    def verify(self, *args: Any):
        """Plan-vs-compiled report for ``args`` (collectives and memory)."""
        entry = self._entry(args)
        _, dyn = self._split_static(args)
        return verify(entry.plan, entry.lowered, *dyn)


def _is_spec_tree(x: Any) -> bool:
    from autopar.export import is_spec_tree

    return is_spec_tree(x)


def _plan_from_spec_tree(f: AutoParallel, fn: Callable, specs: Any, dyn: tuple, graph: Graph):
    """``autoparallel(plan=specs)``: a ``PartitionSpec`` / ``NamedSharding`` pytree for the
    arguments as a plan (:func:`autopar.export.plan_from_specs`; the mesh from the
    ``NamedSharding``s or ``options.mesh``)."""
    from autopar.export import plan_from_specs

    return plan_from_specs(fn, specs, *dyn, mesh=f.options.mesh, cluster=f.cluster, graph=graph)


def _dynamic_signature(fn: Callable, static: dict[int, Any]) -> inspect.Signature:
    sig = inspect.signature(fn)
    params = [p for i, p in enumerate(sig.parameters.values()) if i not in static]
    return sig.replace(parameters=params)


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
    donate_argnums: int | Sequence[int] = (),
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
        static_argnums: arguments that are Python values, baked into the program.
        donate_argnums: arguments whose buffers the step may reuse.
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
            donate_argnums=donate_argnums,
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
