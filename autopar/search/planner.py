"""The outer loop: try meshes, solve each one's intra-op problem, keep the best plan.

Three search levels, one module each:

1. :mod:`autopar.search.meshes`: which meshes to try (:func:`candidate_meshes`);
2. :mod:`autopar.search.intra_op`: one mesh's solve (:func:`solve_mesh`), the entry a
   stage partitioner calls per (layer range, sub-mesh);
3. :mod:`autopar.search.to_plan`: the winning solution -> the :class:`Plan`.

:func:`plan_graph` builds each candidate mesh's problem, ranks the meshes by a step-time
lower bound (the solver's presolve bound), solves at most ``max_meshes`` of them in that
order, skips those whose bound cannot beat the best step time found, gives those whose
bound is well above it a quarter of the time limit, and keeps the plan with the lowest
predicted step time that fits the per-device memory bound. The step time compared is the
solver's objective (:mod:`autopar.search.pricing`). Pipelining (a stage DP over layer
ranges and sub-meshes, ``search/stages.py``) plugs in here, above :func:`solve_mesh`.

Example: the 2-layer MLP train step on one node of 8 A100s, under 4 MB per device (the
replicated step holds 6.3 MB of weights and AdamW moments; unbounded, the cost model
replicates this latency-bound step rather than pay a tensor all-reduce).

    >>> results = []
    >>> plan = plan_graph(autopar.trace(step, state, batch),
    ...                   Cluster.preset("dgx-a100-80gb"),
    ...                   SearchOptions(memory_limit_bytes=4_000_000), results=results)
    >>> [dict(r.mesh) for r in results]   # the meshes solved
    [{'data': 8}, {'data': 2, 'tensor': 4}, {'data': 4, 'tensor': 2}]
    >>> plan.mesh, plan.layers[0].ops
    ({'data': 2, 'tensor': 4}, (('dot_general', 'column(tensor)'),))
"""

from __future__ import annotations

import dataclasses
from typing import Any

from autopar.axes import AXIS_NAMES, BATCH_AXES
from autopar.errors import InfeasiblePlanError, InvalidOptionError, SolveShardingError
from autopar.options import SearchOptions
from autopar.plan import Candidate, PipelinePlan, Plan
from autopar.progress import SearchProgress
from autopar.search.evaluate import complete_layouts, decode
from autopar.search.ilp import BuiltProblem
from autopar.search.intra_op import MeshResult, build_problem, solve_mesh, step_lower_bound
from autopar.search.meshes import candidate_meshes, expert_dims, offered_axes
from autopar.search.shortlist import candidate, rank, unsolved
from autopar.search.solver import prefetch_relaxation
from autopar.search.to_plan import batch_layouts, role_names, write_plan
from autopar.trace.graph import Graph

_NO_PIPELINES = " (plan_graph, the intra-op search, does not pipeline)"
_CLOSE = 0.10  # meshes whose bound is within this of the best step time get the full limit
_LOSER_TIME_FRACTION = 0.25  # the others get this fraction of the solver time limit


def _better(a: MeshResult, b: MeshResult) -> bool:
    """Lower step time wins; on a tie (0.01%) the mesh with fewer axes (simpler plan),
    then the one whose axes, named by role, are in the conventional order (``data``
    outer, ``tensor`` inner)."""
    ta, tb = a.evaluation.step_time_s, b.evaluation.step_time_s
    if abs(ta - tb) <= 1e-4 * max(ta, tb):
        if len(a.mesh) != len(b.mesh):
            return len(a.mesh) < len(b.mesh)
        return _canonical(a) and not _canonical(b)
    return ta < tb


def _canonical(r: MeshResult) -> bool:
    names = [(r.rename or {}).get(a, a) for a in r.mesh]
    return names == sorted(names, key=AXIS_NAMES.index)


def _check(options: SearchOptions, cluster: Any) -> None:
    """Refuse what the search cannot do yet, rather than ignore it."""
    if options.pipeline_stages is not None and options.pipeline_stages > 1:
        raise InvalidOptionError(
            f"pipeline_stages={options.pipeline_stages}: plan_graph is the intra-op search, "
            "which does not choose pipelines; plan the step function with "
            "autopar.plan(fn, *args, options=...), whose outer loop pipelines a traced step "
            "(autopar.search.outer)."
        )
    if options.mesh is not None and options.mesh.get("pipe", 1) > 1:
        raise InvalidOptionError(
            f"mesh {dict(options.mesh)} has a 'pipe' axis of {options.mesh['pipe']}: a "
            "pipeline re-traces the step on one microbatch, so plan the step function with "
            "autopar.plan(fn, *args, options=...), not a traced graph (the intra-op search "
            "alone does not pipeline)."
        )
    if options.axes is not None and "pipe" in options.axes:
        raise InvalidOptionError(
            f"axes={options.axes!r}: plan_graph does not pipeline ('pipe'); plan the step "
            "function with autopar.plan(fn, *args, options=...), or drop 'pipe'."
        )
    if options.schedule is not None:
        raise InvalidOptionError(
            f"schedule={options.schedule!r} needs pipeline stages: give the mesh a 'pipe' "
            f"axis, or leave the mesh open for autopar.plan(fn, *args) to choose them"
            f"{_NO_PIPELINES}, or leave schedule=None."
        )
    if (options.virtual_stages or 1) > 1:
        raise InvalidOptionError(
            f"virtual_stages={options.virtual_stages} needs pipeline stages: give the mesh a "
            "'pipe' axis, or leave the mesh open for autopar.plan(fn, *args) to choose them"
            f"{_NO_PIPELINES}, or leave virtual_stages=None."
        )
    if options.mesh is not None:
        size = 1
        for s in options.mesh.values():
            size *= s
        if size > cluster.num_devices:
            raise InvalidOptionError(
                f"mesh {dict(options.mesh)} needs {size} devices; the cluster has {cluster.num_devices}."
            )


def microbatch_count(graph: Graph, options: SearchOptions) -> int:
    """How many microbatches the options ask for (1: none).

    ``microbatches`` is taken as given; ``microbatch_size`` (examples per data-parallel
    replica) needs a fixed mesh, whose batch axes (:data:`autopar.axes.BATCH_AXES`) give
    the replicas. Giving both is an error unless they agree with the batch.

    Example:
        >>> microbatch_count(graph, SearchOptions(mesh={"data": 8}, microbatch_size=2))
        4
    """
    batch = [gi.tensor.shape[0] for gi in graph.inputs if gi.role == "batch" and gi.tensor.ndim]
    if options.microbatch_size is None:
        return options.microbatches or 1
    if not batch:
        raise InvalidOptionError(
            f"microbatch_size={options.microbatch_size}: the step has no batch input."
        )
    if options.mesh is None:
        raise InvalidOptionError(
            f"microbatch_size={options.microbatch_size} is per data-parallel replica, so it "
            "needs a fixed mesh; give SearchOptions(mesh=...) too, or microbatches instead."
        )
    replicas = 1
    for a in BATCH_AXES:
        replicas *= options.mesh.get(a, 1)
    size = max(batch)
    per_replica, rest = divmod(size, replicas)
    m, rest2 = divmod(per_replica, options.microbatch_size) if not rest else (0, 1)
    if rest or rest2 or m < 1:
        raise InvalidOptionError(
            f"microbatch_size={options.microbatch_size} does not divide the batch of {size} "
            f"over {replicas} data-parallel replicas; pick a divisor of {size // max(replicas, 1)}."
        )
    if options.microbatches is not None and options.microbatches != m:
        raise InvalidOptionError(
            f"microbatches={options.microbatches} and microbatch_size={options.microbatch_size} "
            f"disagree: a batch of {size} over {replicas} replicas in microbatches of "
            f"{options.microbatch_size} is {m} microbatches; give one of them."
        )
    return m


def plan_graph(
    graph: Graph,
    cluster: Any,
    options: SearchOptions | None = None,
    *,
    results: list | None = None,
    accumulation: Any = None,
    name_by_role: bool = False,
    polish: bool = True,
) -> Plan:
    """Search a parallel plan for a traced training step.

    Args:
        graph: from ``autopar.trace``.
        cluster: a ``cost_models.Cluster``.
        options: what is fixed and what is searched (default: everything searched).
        results: if given, a list that receives one :class:`MeshResult` per mesh looked at.
        accumulation: the step analysed for microbatching
            (:func:`autopar.lower.split.plan_accumulation`), needed when the options ask
            for microbatches (``autopar.plan`` makes it from the step function).
        name_by_role: name the axes of a fixed ``options.mesh`` by what the solution
            splits with them (as an open mesh's are: ``expert`` for an expert dimension,
            ``data`` for the batch, ...); the outer loop solves stage sub-meshes this way.
        polish: solve the written plan's own problem once more and predict from it
            (:func:`_polish`, the default: the prediction is what ``evaluate_plan``
            reports). ``False`` keeps the search's solution (the outer loop's profiles,
            estimates for its screen, read from ``results``).

    Returns:
        The plan with the lowest predicted step time that fits the memory bound; its
        ``predicted.step_time_s`` is the objective the solver minimised.

    Raises:
        InvalidOptionError: the options ask for something the search cannot do yet
            (pipelining, rematerialisation) or a mesh larger than the cluster.
        InfeasiblePlanError: no mesh and layout fits the per-device memory bound; the
            message gives the bound, the smallest footprint found and the excess.

    Example:
        >>> plan = plan_graph(graph, Cluster.preset("dgx-a100-80gb"),
        ...                   SearchOptions(mesh={"data": 2, "tensor": 4},
        ...                                 memory_limit_bytes=4_000_000))
        >>> plan.mesh, plan.predicted.memory_bytes_per_device < 4e6
        ({'data': 2, 'tensor': 4}, True)
        >>> p = plan.predicted   # layer 1's row-parallel partial sums: 64 x 256 float32
        >>> [(c.kind, c.axes, c.bytes) for c in p.collectives]
        [('all-reduce', ('tensor',), 65536.0)]
    """
    options = options or SearchOptions()
    best, tried, pipeline, accumulation = _search(
        graph, cluster, options, accumulation, results, name_by_role
    )
    limit = float(options.memory_limit_bytes or cluster.device.hbm_bytes)
    plan = write_plan(best, graph, cluster, limit, pipeline)
    if options.remat not in (None, "none"):  # priced by the search (build_problem)
        plan = dataclasses.replace(plan, remat=options.remat)
    if polish:
        plan, best = _polish(
            plan, best, tried, graph, cluster, options, limit, pipeline, accumulation
        )

    if results is not None:
        results.extend(tried)
    return dataclasses.replace(plan, shortlist=_shortlist(plan, best, tried, limit))


def best_mesh(
    graph: Graph,
    cluster: Any,
    options: SearchOptions,
    *,
    accumulation: Any = None,
    results: list | None = None,
    built: BuiltProblem | None = None,
) -> MeshResult:
    """The intra-op search of :func:`plan_graph` without writing a plan: the best mesh's
    result (its built problem, solution and evaluation). The outer loop's profiles price
    this solution directly (writing a plan of a 48-block step costs half a second each).
    ``built``: the problem of ``options.mesh``, built already (by :func:`prebuild`).

    Example:
        >>> import math
        >>> r = best_mesh(graph, Cluster.preset("dgx-a100-80gb"),
        ...               SearchOptions(mesh={"data": 2, "tensor": 4}))
        >>> r.mesh, math.isclose(r.evaluation.step_time_s, r.solution.objective)
        ({'data': 2, 'tensor': 4}, True)
    """
    best, tried, _, _ = _search(graph, cluster, options, accumulation, results, False, built)
    if results is not None:
        results.extend(tried)
    return best


def prebuild(
    graph: Graph, cluster: Any, options: SearchOptions, accumulation: Any = None
) -> BuiltProblem:
    """The problem of ``options.mesh`` (a fixed mesh) as :func:`best_mesh` builds it, with
    its LP relaxation started on the solver's background thread: the outer loop builds
    every group's profile problem first, so each relaxation runs while the next group's
    problem is built, then solves them (``best_mesh(..., built=...)``)."""
    if options.mesh is None:
        raise InvalidOptionError("prebuild needs options.mesh: it builds one mesh's problem.")
    _check(options, cluster)
    accumulation = _microbatched(graph, options, accumulation)
    limit = float(options.memory_limit_bytes or cluster.device.hbm_bytes)
    bp = build_problem(graph, cluster, options.mesh, options, limit, accumulation)
    prefetch_relaxation(bp.problem, 0.5 * options.solver_time_limit_s)
    return bp


def _microbatched(graph: Graph, options: SearchOptions, accumulation: Any) -> Any:
    """The accumulation the options' microbatch count needs (``None`` for one), checked."""
    m = microbatch_count(graph, options)
    if m <= 1:
        return None
    if accumulation is None or accumulation.microbatches != m:
        raise InvalidOptionError(
            f"{m} microbatches: microbatching re-traces the step on one microbatch; plan "
            "the step function with autopar.plan(fn, *args, options=...) rather than a "
            "traced graph."
        )
    return accumulation


def _search(
    graph: Graph,
    cluster: Any,
    options: SearchOptions,
    accumulation: Any,
    results: list | None,
    name_by_role: bool,
    built: BuiltProblem | None = None,
) -> tuple[MeshResult, list[MeshResult], PipelinePlan | None, Any]:
    """Build (``built``: the one mesh's problem, built already) and solve the candidate
    meshes: (the best result that fits, every mesh's result, the microbatched step's
    one-stage pipeline or ``None``, the accumulation in use). Raises what
    :func:`plan_graph` documents when nothing fits."""
    _check(options, cluster)
    m = microbatch_count(graph, options)
    accumulation = _microbatched(graph, options, accumulation)
    pipeline = PipelinePlan(((0, len(graph.layers)),), "gpipe", m) if m > 1 else None
    limit = float(options.memory_limit_bytes or cluster.device.hbm_bytes)
    allowed = offered_axes(graph, cluster.num_devices, options)
    tried: list[MeshResult] = []
    meshes = list(candidate_meshes(cluster.num_devices, options, graph))
    ahead = []  # LP relaxations run on a second core while the next mesh is built
    with SearchProgress(2 * len(meshes), "search") as bar:
        try:
            if built is not None and meshes != [dict(built.ctx.mesh_dict)]:
                raise InvalidOptionError(
                    f"a problem built for mesh {dict(built.ctx.mesh_dict)} was given for "
                    f"meshes {meshes}: build it with prebuild(graph, cluster, options)."
                )
            for mesh in meshes:
                bp = built or build_problem(graph, cluster, mesh, options, limit, accumulation)
                tried.append(MeshResult(mesh, step_lower_bound(bp), bp))
                if len(meshes) > 1:
                    ahead.append(prefetch_relaxation(bp.problem, 0.5 * options.solver_time_limit_s))
                bar.advance(f"built {_mesh_str(mesh)}")
            best = _solve_meshes(
                tried, graph, cluster, options, limit, accumulation, allowed, bar, name_by_role
            )
        finally:
            for f in ahead:
                if f is not None:
                    f.cancel()  # a mesh skipped: its relaxation is not started (or is moot)
    if best is None:
        if results is not None:
            results.extend(tried)
        lows = [(r.min_memory_bytes, r.mesh) for r in tried if r.min_memory_bytes is not None]
        if lows:
            low, mesh = min(lows, key=lambda t: t[0])
            raise InfeasiblePlanError(
                f"no plan fits the memory bound of {limit:.4g} bytes ({limit / 2**30:.3f} GiB) "
                f"per device: the smallest footprint found needs {low:.4g} bytes "
                f"({low / 2**30:.3f} GiB, on mesh {mesh}), {low - limit:.4g} bytes "
                f"({(low / limit - 1) * 100:.1f}%) over. Use more devices, a larger "
                "memory_limit_bytes, or a smaller batch.",
                smallest_bytes=low,
                bound_bytes=limit,
                closest=_mesh_str(mesh),
            )
        # Nothing proved infeasible: the solver ran out of time before finding any plan.
        raise SolveShardingError(
            f"no plan found within {options.solver_time_limit_s} s on meshes "
            f"{[r.mesh for r in tried]}; raise solver_time_limit_s."
        )
    if pipeline is not None:
        # Replicas: the axes the batch is split over in the solution, whatever their
        # names (a fixed mesh's 'tensor' may split only the batch).
        used = batch_layouts(best.built, best.solution.choice).values()
        split = {a for spec in used if spec and spec[0] for a in spec[0]}
        replicas = 1
        for a, size in best.mesh.items():
            if a in split:
                replicas *= size
        batch = max((gi.tensor.shape[0] for gi in graph.inputs if gi.role == "batch"), default=0)
        per = batch // (m * replicas) if batch % (m * replicas) == 0 else None
        pipeline = PipelinePlan(pipeline.stages, pipeline.schedule, m, microbatch_size=per)
    return best, tried, pipeline, accumulation


def _shortlist(
    plan: Plan, best: MeshResult, tried: list[MeshResult], limit: float
) -> tuple[Candidate, ...]:
    """The plan first, then every other mesh looked at, best first, with why it lost."""
    chosen = candidate(_mesh_str(plan.mesh), plan.mesh, best.evaluation)
    others = []
    for r in tried:
        named = {(r.rename or {}).get(a, a): n for a, n in r.mesh.items()}
        if r is best:
            continue
        if r.evaluation is not None and not r.skipped:
            others.append(candidate(_mesh_str(named), named, r.evaluation))
        elif r.min_memory_bytes is not None:
            others.append(
                Candidate(
                    _mesh_str(named), named, None, r.min_memory_bytes,
                    verdict=f"does not fit: its smallest footprint is {r.min_memory_bytes / 2**30:.3g} GiB, "
                    f"{r.min_memory_bytes / limit - 1:+.1%} over the bound",
                )
            )  # fmt: skip
        else:
            why = r.skipped or "no solution within the time limit"
            if r.bound_s:
                why += f" (step time >= {r.bound_s * 1e6:.0f} us)"
            others.append(unsolved(_mesh_str(named), named, why))
    return rank(chosen, others, limit)


def _mesh_str(mesh: dict[str, int]) -> str:
    return " x ".join(f"{a} {n}" for a, n in mesh.items())


def _solve_meshes(
    tried: list[MeshResult],
    graph: Graph,
    cluster: Any,
    options: SearchOptions,
    limit: float,
    accumulation: Any,
    allowed: Any,
    bar: SearchProgress,
    name_by_role: bool = False,
) -> MeshResult | None:
    """Solve the meshes in ``tried`` (most promising first, skipping those whose bound
    cannot win); ``tried`` receives each mesh's result. Returns the best that fits."""
    rename_roles = (options.mesh is None or name_by_role) and options.zero_stage is None
    best: MeshResult | None = None
    # The most promising mesh first (by its step-time lower bound; fewer axes on a tie):
    # it sets the incumbent that lets the others be skipped or solved briefly.
    tried.sort(key=lambda r: (r.bound_s, len(r.mesh)))
    solved = 0
    for i, r in enumerate(tried):
        if solved >= options.max_meshes:
            r.skipped = "max_meshes reached"
            bar.advance(f"skipped {_mesh_str(r.mesh)}")
            continue
        incumbent = None if best is None else best.evaluation.step_time_s
        if incumbent is not None and r.bound_s >= incumbent:
            r.skipped = "lower bound above the best step time"
            bar.advance(f"skipped {_mesh_str(r.mesh)}")
            continue
        solved += 1
        # A mesh whose bound is well above the incumbent is unlikely to win: a short solve
        # (its best solution is still compared) keeps it from eating the time of the search.
        time_limit = options.solver_time_limit_s
        if incumbent is not None and r.bound_s > (1 - _CLOSE) * incumbent:
            time_limit *= _LOSER_TIME_FRACTION
        r = tried[i] = solve_mesh(
            graph,
            cluster,
            r.mesh,
            options,
            limit,
            time_limit_s=time_limit,
            built=r.built,
            accumulation=accumulation,
        )
        bar.advance(f"solved {_mesh_str(r.mesh)}")
        if r.evaluation is None or r.skipped:
            continue
        if rename_roles:
            r.rename = role_names(r.built, r.solution.choice, allowed)
        if best is None or _better(r, best):
            best = r
    return best


def _polish(
    plan: Plan,
    best: MeshResult,
    tried: list[MeshResult],
    graph: Graph,
    cluster: Any,
    options: SearchOptions,
    limit: float,
    pipeline: PipelinePlan | None,
    accumulation: Any,
) -> tuple[Plan, MeshResult]:
    """Solve the written plan's own problem (everything it pins fixed; the problem
    ``evaluate_plan`` solves for it) and predict from that solution.

    The plan keeps its pins; what they leave free (which algorithm makes a pinned layout,
    when the first solve stopped at its time limit before the cheapest) takes its
    cheapest choice, so the prediction is exactly what ``evaluate_plan`` reports for the
    plan, and never more than the first solve's objective."""
    bp, sol = complete_layouts(
        graph,
        plan,
        cluster,
        time_limit_s=options.solver_time_limit_s,
        coarsen=options.coarsen,
        accumulation=accumulation,
    )
    polished = MeshResult(dict(bp.ctx.mesh_dict), best.bound_s, bp, sol)
    polished.evaluation = decode(bp, sol.choice, status=sol.status, memory_limit=limit)
    polished.time_limit_s = best.time_limit_s
    polished.rename = best.rename
    tried[tried.index(best)] = polished
    return dataclasses.replace(plan, predicted=polished.evaluation.to_predicted()), polished


__all__ = [
    "MeshResult",
    "best_mesh",
    "build_problem",
    "candidate_meshes",
    "expert_dims",
    "microbatch_count",
    "offered_axes",
    "plan_graph",
    "prebuild",
]
