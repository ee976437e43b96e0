"""Search level 2: one mesh's intra-operator solve.

:func:`build_problem` builds the ILP of a graph on a mesh (:func:`autopar.search.ilp.build`)
under the options; :func:`solve_within_memory` solves it and keeps the exact peak within
the memory bound (lazy constraints); :func:`solve_mesh` does both and prices the
solution. A pipeline stage partitioner calls :func:`solve_mesh` once per (layer range,
sub-mesh) candidate.

Example: the 2-layer MLP on a fixed 2 x 4 mesh. Under 80 GB the cheapest layout of this
latency-bound step replicates it (no collective); under 4 MB, below the replicated 6.3 MB
of weights and AdamW moments (525,568 float32 parameters x 3), the solve splits the
layers over ``tensor`` and pays one 64 KiB all-reduce.

    >>> r = solve_mesh(graph, cluster, {"data": 2, "tensor": 4}, SearchOptions(), 80e9)
    >>> r.solution.status, r.evaluation.collectives, r.skipped
    ('optimal', (), '')
    >>> r = solve_mesh(graph, cluster, {"data": 2, "tensor": 4}, SearchOptions(), 4e6)
    >>> r.solution.status, r.evaluation.memory_bytes_per_device < 4e6
    ('optimal', True)
    >>> [(c.kind, c.axes, c.bytes) for c in r.evaluation.collectives]
    [('all-reduce', ('tensor',), 65536.0)]
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from autopar.axes import BATCH_AXES
from autopar.options import SearchOptions
from autopar.search.costs import CostContext
from autopar.search.evaluate import Evaluation, decode, remat_repeats
from autopar.search.ilp import BuiltProblem, build, with_accumulators
from autopar.search.problem import ShardingSolution
from autopar.search.solver import objective_lower_bound, solve
from autopar.trace.graph import Graph

_LAZY_MEMORY_ROUNDS = 6


@dataclass
class MeshResult:
    """One mesh the outer loop looked at (kept for reports and benchmarks).

    Attributes:
        mesh: the mesh (problem axis names).
        bound_s: a lower bound on its step time (:func:`step_lower_bound`).
        built: its problem (with the memory constraints the solve ended with).
        solution: the solver's answer.
        evaluation: the solution priced (``None`` if there is none).
        min_memory_bytes: the smallest footprint seen when nothing fit.
        skipped: why it was not solved or not kept (empty if it was).
        rename: problem axis -> plan axis name, once roles are known.
        time_limit_s: the solver time limit it got.
    """

    mesh: dict[str, int]
    bound_s: float
    built: BuiltProblem | None = None
    solution: ShardingSolution | None = None
    evaluation: Evaluation | None = None
    min_memory_bytes: float | None = None
    skipped: str = ""
    rename: dict[str, str] | None = None
    time_limit_s: float = 0.0


_FOOTPRINT_TIME_S = 5.0
"""Time limit of the solve for a mesh's smallest footprint when nothing fits its bound
(a 30 s solve on each of five 3-axis meshes was half of planning a 7B Llama on 32 H100s)."""


def _input_axes(
    graph: Graph, mesh: Mapping[str, int], options: SearchOptions
) -> tuple[dict[int, list[str]], dict[int, list[str]]]:
    """``(may use, must use)``: per input, the axes its layout may use and those it must
    use where it can, when ``options.zero_stage`` is fixed. Stage 0 keeps parameters and
    optimizer state off the data-parallel axes; 1 and 2 split the optimizer state over
    them and keep parameters off; 3 splits both. From stage 1 the batch is split over
    them too (ZeRO partitions the state of data-parallel replicas).

    Example:
        >>> allowed, required = _input_axes(graph, {"data": 4, "tensor": 2}, SearchOptions(zero_stage=1))
        >>> roles = {gi.index: gi.role for gi in graph.inputs}
        >>> sorted({roles[i]: a for i, a in allowed.items()}.items())
        [('param', ['tensor'])]
        >>> sorted({roles[i]: a for i, a in required.items()}.items())
        [('batch', ['data']), ('opt_state', ['data'])]
    """
    stage = options.zero_stage
    if stage is None:
        return {}, {}
    other = [a for a in mesh if a not in BATCH_AXES]
    data = [a for a in mesh if a in BATCH_AXES and mesh[a] > 1]
    allowed: dict[int, list[str]] = {}
    required: dict[int, list[str]] = {}
    for gi in graph.inputs:
        if gi.role == "param":
            if stage == 3:
                required[gi.index] = data
            else:
                allowed[gi.index] = other
        elif gi.role == "opt_state":
            if stage == 0:
                allowed[gi.index] = other
            else:
                required[gi.index] = data
        elif gi.role == "batch" and stage > 0:
            required[gi.index] = data
    return allowed, {i: a for i, a in required.items() if a}


def build_problem(
    graph: Graph,
    cluster: Any,
    mesh: Mapping[str, int],
    options: SearchOptions,
    memory_limit: float | None,
    accumulation: Any = None,
) -> BuiltProblem:
    """The :class:`BuiltProblem` of ``graph`` on ``mesh`` under ``options``.

    With ``accumulation`` (an :class:`autopar.lower.split.Accumulation` of ``graph``), the
    problem is the microbatched step's: built on one microbatch, its gradient computation
    run ``accumulation.microbatches`` times per step, with the accumulators and the
    resident batch in memory (:func:`autopar.search.ilp.with_accumulators`). A fixed
    ``options.remat`` (a plan without pipeline stages) is priced as :func:`autopar.evaluate`
    prices it (:func:`autopar.search.evaluate.remat_repeats`)."""
    ctx = CostContext(cluster, mesh)
    remat = options.remat or "none"
    if accumulation is None:
        allowed, required = _input_axes(graph, mesh, options)
        return build(
            graph,
            ctx,
            input_axes=allowed,
            required_axes=required,
            tie_optimizer_state=options.zero_stage not in (1, 2),
            coarsen_groups=options.coarsen,
            memory_limit=memory_limit,
            repeat=remat_repeats(graph, remat) if remat != "none" else None,
            remat=remat,
        )
    micro = accumulation.micro
    allowed, required = _input_axes(micro, mesh, options)
    repeat = dict.fromkeys(accumulation.gradient_eqns, float(accumulation.microbatches))
    bp = build(
        micro,
        ctx,
        input_axes=allowed,
        required_axes=required,
        tie_optimizer_state=options.zero_stage not in (1, 2),
        coarsen_groups=options.coarsen,
        memory_limit=memory_limit,
        repeat=remat_repeats(micro, remat, repeat) if remat != "none" else repeat,
        remat=remat,
    )
    return with_accumulators(bp, accumulation)


def solve_within_memory(
    bp: BuiltProblem,
    limit: float | None,
    time_limit_s: float,
    backend: str = "cpsat",
    peaks: list[float] | None = None,
) -> tuple[BuiltProblem, ShardingSolution]:
    """Solve, then check the exact peak over every moment; add the moment that breaks the
    bound as a constraint and re-solve (lazy constraint generation). A peak over the bound
    at a moment already constrained is over by resharded copies, which the constraints
    leave out (``BuiltProblem.peak``): the bound is lowered by the excess and the problem
    re-solved. The last solution may still not fit (the caller checks ``peak``). ``peaks``
    (if a list) receives the peak of every solution looked at."""
    sol = solve(bp.problem, time_limit_s, backend=backend)
    for _ in range(_LAZY_MEMORY_ROUNDS):
        if not sol.ok or limit is None:
            return bp, sol
        peak, moment, _ = bp.peak(sol.choice)
        if peaks is not None:
            peaks.append(peak)
        if peak <= limit * (1 + 1e-9):
            return bp, sol
        if moment in bp.moments:
            if bp.problem.memory_limit is None:
                return bp, sol
            tighter = bp.with_memory_limit(bp.problem.memory_limit - (peak - limit))
            again = solve(tighter.problem, time_limit_s, backend=backend)
            if not again.ok:
                return bp, sol
            bp, sol = tighter, again
        else:
            bp = bp.with_moments([*bp.moments, moment])
            sol = solve(bp.problem, time_limit_s, backend=backend)
    return bp, sol


def step_lower_bound(bp: BuiltProblem) -> float:
    """A lower bound on the step time on this mesh: the solver's presolve bound (edge
    minima moved onto the nodes, dominated strategies dropped, every node at its cheapest
    strategy). The objective *is* the step time, so it bounds that directly."""
    return objective_lower_bound(bp.problem)


def solve_mesh(
    graph: Graph,
    cluster: Any,
    mesh: Mapping[str, int],
    options: SearchOptions,
    memory_limit: float,
    *,
    time_limit_s: float | None = None,
    built: BuiltProblem | None = None,
    accumulation: Any = None,
) -> MeshResult:
    """Solve the intra-op problem of ``graph`` on one mesh under a memory bound.

    The entry a stage partitioner calls for a layer range on a sub-mesh: give it the
    stage's graph and the sub-mesh. The result holds the solution, its evaluation
    (priced by :mod:`autopar.search.pricing`, so ``evaluation.step_time_s`` equals the
    solver's objective) or why there is none (``skipped``, ``min_memory_bytes``).

    Example:
        >>> import math
        >>> r = solve_mesh(graph, cluster, {"data": 8}, SearchOptions(), 80e9)
        >>> math.isclose(r.evaluation.step_time_s, r.solution.objective)  # equal up to rounding
        True
        >>> r.bound_s <= r.solution.objective
        True
    """
    if built is None:
        built = build_problem(graph, cluster, mesh, options, memory_limit, accumulation)
    bp = built
    r = MeshResult(dict(mesh), step_lower_bound(bp), bp)
    r.time_limit_s = options.solver_time_limit_s if time_limit_s is None else time_limit_s
    peaks: list[float] = []
    r.built, r.solution = solve_within_memory(r.built, memory_limit, r.time_limit_s, peaks=peaks)
    if not r.solution.ok:
        if r.solution.status == "infeasible":
            # The smallest footprint only explains why nothing fits: a short solve (from
            # the memory-greedy start, itself a footprint) is enough.
            low = solve(r.built.problem, min(r.time_limit_s, _FOOTPRINT_TIME_S), minimize="memory")
            if low.ok:
                peaks.append(r.built.peak(low.choice)[0])
        # The smallest footprint seen: the memory-minimal choice of the constraints, or an
        # earlier solution (resharded copies are outside the constraints).
        r.min_memory_bytes = min(peaks, default=None)
        return r
    r.evaluation = decode(
        r.built, r.solution.choice, status=r.solution.status, memory_limit=memory_limit
    )
    if not r.evaluation.fits:
        r.min_memory_bytes = min(peaks, default=r.evaluation.memory_bytes_per_device)
        r.skipped = "rejected: its peak (with resharded copies) is over the memory bound"
    return r


__all__ = [
    "MeshResult",
    "build_problem",
    "solve_mesh",
    "solve_within_memory",
    "step_lower_bound",
]
