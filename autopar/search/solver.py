"""Solve a :class:`ShardingProblem` exactly: OR-Tools CP-SAT (default) or HiGHS.

Formulation (one boolean ``x[n, s]`` per node ``n`` and strategy ``s``):

* ``sum_s x[n, s] == 1`` for every node (CP-SAT ``AddExactlyOne``); aliased nodes (a
  parameter and its optimizer state, the same op in identical layers) share one set of
  booleans, so tied layers are decided once.
* every edge ``e`` gets pair booleans ``y[e, i, j]`` over (producer layout class ``i``,
  consumer layout class ``j``) with the local-polytope marginalisation
  ``sum_j y[e, i, j] == a[e, i]`` and ``sum_i y[e, i, j] == b[e, j]``, where ``a[e, i]``
  is the sum of the producer's ``x`` whose strategies give the value in layout ``i`` (and
  ``b`` the same for the consumer). Its LP relaxation is nearly tight on sharding
  problems, which is what CP-SAT's ``max_lp`` worker exploits to prove optimality fast.
  (Measured on GPT-2 small: the clause form ``y >= a + b - 1`` with pair booleans only for
  non-zero costs left CP-SAT 20% off after 30 s; row/column cover inequalities over the
  non-zero pairs only proved the optimum in ~4 s; the full marginalisation in ~1.5 s.)
* objective: ``sum c[n, s] x[n, s] + sum r[e, i, j] y[e, i, j] + sum w[k] z[k]``,
  costs scaled to integers (the largest coefficient becomes 1e7); ``z[k]`` is a shared
  cost's indicator, at least the sum of each node's member strategies (``sum x <= z``).
* memory: ``constant + sum b[n, s] x[n, s] <= limit`` for every memory constraint.

Presolve, shared by both backends and exact:

1. aliased nodes merge into one representative; edges inside an alias group, edges whose
   producer or consumer has a single layout class, and parallel edges are folded;
2. every edge matrix is reduced by its row minima (moved onto the producer's strategy
   costs) and then its column minima (onto the consumer's): exact, since one row and one
   column are chosen;
3. memory constraints that no choice can violate are dropped;
4. dead-end elimination (Goldstein's criterion, from protein design): strategy ``s`` of a
   node goes when another strategy ``t`` of that node is no worse whatever its neighbours
   choose (``c_t - c_s + sum_e max_j (r_e[t, j] - r_e[s, j]) <= 0``, plus the shared
   costs ``t`` may switch on) and uses no more memory in any remaining constraint;
   repeated to a fixpoint, then edges are restricted to the surviving layouts and reduced
   again (about half the strategies of a GPT problem go).

CP-SAT's starting point (``AddHint`` on the node booleans; propagation completes the
pair booleans) is the LP relaxation solved by HiGHS, rounded to each node's largest
value and improved by iterated conditional modes (each node in turn moves to its best
strategy given its neighbours). The relaxation is nearly integral on these problems, so
the hint is usually the optimum and CP-SAT's job is to prove it; without it (greedy +
local search) CP-SAT was stuck 50% above the optimum of a 3-axis mesh after 45 s. A
caller's ``hint`` replaces the LP. The relaxation's optimum is a lower bound too: when
the rounded choice fits and costs within :data:`LP_PROOF_GAP` of it, the choice is
returned as optimal and CP-SAT is not run at all (every mesh of the zoo's tiny GPT and
GPT-2 small, 3-axis ones included: GPT-2 small on data x seq x tensor took CP-SAT 8-20 s
to prove what the 2-3 s LP proves). A problem that nothing couples after presolve (no
edges, shared costs or binding memory rows) is solved by each node's cheapest strategy.

CP-SAT runs ``num_workers`` workers: ``max_lp`` (the full LP relaxation at every node:
the bound that closes these problems) and ``core`` as full workers, first-solution
heuristics and LNS in the interleaved slot. CP-SAT's presolve and probing are off: on
these models they spend seconds (probing adds millions of binary clauses) for nothing.

The reported objective is recomputed exactly from the choice in seconds.

Example: a chain ``a -> b -> c`` of two strategies each; a layout change costs 5 on the
first edge and 0.5 on the second, so ``a`` takes its dearer strategy to agree with ``b``.

    >>> from autopar.search.problem import ProblemEdge, ProblemNode
    >>> problem = ShardingProblem(
    ...     nodes=(ProblemNode("a", (1.0, 2.0)), ProblemNode("b", (2.0, 1.0)),
    ...            ProblemNode("c", (3.0, 1.0))),
    ...     edges=(ProblemEdge(0, 1, (0, 1), (0, 1), ((0.0, 5.0), (5.0, 0.0))),
    ...            ProblemEdge(1, 2, (0, 1), (0, 1), ((0.0, 0.5), (0.5, 0.0)))),
    ... )
    >>> sol = solve(problem, time_limit_s=10)
    >>> sol.choice, sol.status, sol.objective
    ((1, 1, 1), 'optimal', 4.0)
"""

from __future__ import annotations

import math
import queue
import threading
import time
import warnings
import weakref
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

import numpy as np

from autopar.errors import SolverTimeLimitWarning, SolveShardingError
from autopar.search.problem import ShardingProblem, ShardingSolution

_MAX_COEF = 1e7  # largest scaled objective / memory coefficient
_VERBOSE = False  # solver logs (debugging only: they go to stdout)
_DEE_ROUNDS = 20
_PAIR_BLOCK = 1 << 22  # elements per block when comparing layout classes pairwise
BACKENDS: tuple[str, ...] = ("cpsat", "highs")
_SUBSOLVERS = ["max_lp", "core"]  # CP-SAT's full workers; the rest share the LNS slot
MIP_FIRST_MAX_PAIRS = 50_000
"""Problems with at most this many edge-pair columns after presolve, when memory rows keep
the LP relaxation from proving them, go to HiGHS's branch and bound before CP-SAT.
Measured on this machine (2 cores; CP-SAT / HiGHS seconds to a proof): the tiny GPT
under a 4 MB bound on {data 2, tensor 4} (20k pairs) 8.7 / 1.7, GPT-2 small under 3 GB
(18k pairs) 0.63 / 0.40; past it CP-SAT can win: GPT-2 small on three axes (306k pairs)
3.2 / 10.7."""
MIP_FIRST_S = 5.0
"""The most seconds HiGHS gets there before CP-SAT takes over (with its incumbent)."""
LP_PROOF_GAP = 1e-7
"""A rounded LP relaxation whose objective is within this fraction of the relaxation's
optimum (a lower bound) is returned as optimal without CP-SAT: the gap is below the
rounding of CP-SAT's own integer objective (coefficients scaled to 1e7) and far below
the planner's 1e-4 tie between meshes."""


@dataclass
class _Reduced:
    """The problem after aliasing, edge folding and merging (solver-internal)."""

    rep: list[int]  # node -> representative
    reps: list[int]  # representatives
    unary: dict[int, list[float]]  # representative -> cost per strategy
    # merged edges between distinct representatives: (src, dst, src_cls, dst_cls, matrix)
    edges: list[tuple[int, int, list[int], list[int], list[list[float]]]]
    # shared costs: (seconds, representative -> member strategies)
    shared: list[tuple[float, dict[int, set[int]]]] = field(default_factory=list)


@dataclass
class _Edge:
    src: int
    dst: int
    src_cls: np.ndarray  # class per kept strategy of src
    dst_cls: np.ndarray  # class per kept strategy of dst
    mat: np.ndarray  # (classes of src) x (classes of dst), >= 0, a zero in every row/column


@dataclass
class _Compact:
    """The reduced problem over the strategies that survived presolve."""

    red: _Reduced
    keep: dict[int, np.ndarray]  # rep -> original strategy indices still in play
    unary: dict[int, np.ndarray]  # rep -> cost per kept strategy (minimum 0)
    offset: float  # cost moved out of the variables (seconds)
    edges: list[_Edge]
    memory: list[tuple[float, dict[int, np.ndarray]]]  # (bytes, rep -> bytes per kept)
    shared: list[tuple[float, dict[int, np.ndarray]]]  # (seconds, rep -> member mask)
    stats: dict[str, int] = field(default_factory=dict)


def _find(parent: list[int], a: int) -> int:
    while parent[a] != a:
        parent[a] = parent[parent[a]]
        a = parent[a]
    return a


def _classes(keys: Sequence) -> tuple[list[int], list]:
    index: dict = {}
    out = []
    for k in keys:
        out.append(index.setdefault(k, len(index)))
    return out, list(index)


def _merged_classes(
    classes: Sequence[Sequence[int]],
) -> tuple[list[tuple[int, ...]], list[int], list[int]]:
    """Parallel edges' classes merged: the distinct tuples of the edges' classes per
    strategy ``s`` (``(classes[0][s], classes[1][s], ...)``, an edge whose class list
    repeats an earlier one's left out: it splits nothing further), sorted (as
    ``np.unique(..., axis=0)`` orders rows), each strategy's index among them, and per
    edge its position in a tuple.

    Plain Python: the merged groups are small (tens of strategies) and there are
    thousands of them on a 48-block model, where ``np.unique``'s per-call overhead was
    two thirds of the reduction's time; the tied blocks' parallel edges share their
    class lists, so most merged tuples have one entry.

    Example:
        >>> _merged_classes([(0, 1, 1, 0), (0, 0, 1, 1), (0, 1, 1, 0)])
        ([(0, 0), (0, 1), (1, 0), (1, 1)], [0, 2, 3, 1], [0, 1, 0])
    """
    distinct: dict[tuple[int, ...], int] = {}
    cols = [distinct.setdefault(tuple(c), len(distinct)) for c in classes]
    rows = list(zip(*distinct, strict=True))
    keys = sorted(set(rows))
    index = {k: i for i, k in enumerate(keys)}
    return keys, [index[r] for r in rows], cols


def _merged_matrix(
    group: Sequence,
    src_keys: Sequence[tuple[int, ...]],
    src_cols: Sequence[int],
    dst_keys: Sequence[tuple[int, ...]],
    dst_cols: Sequence[int],
) -> list[list[float]]:
    """The parallel edges' cost matrices summed over merged classes (edge ``k``'s entry
    at ``(src_keys[i][src_cols[k]], dst_keys[j][dst_cols[k]])``, added in edge order).

    Each edge's matrix is read at its classes' rows and columns as one array and the
    arrays are added one edge after the other from zero, so every entry is the same
    sequence of float additions as a loop over the edges would make; a tied block's
    copies share one matrix object, converted once.

    Example:
        >>> from types import SimpleNamespace as E
        >>> a, b = E(costs=((1.0, 2.0), (3.0, 4.0))), E(costs=((10.0, 20.0), (30.0, 40.0)))
        >>> _merged_matrix([a, b], [(0, 1), (1, 0)], [0, 1], [(0, 0), (1, 1)], [0, 1])
        [[31.0, 42.0], [13.0, 24.0]]
    """
    arrays: dict[int, np.ndarray] = {}
    rows: dict[int, np.ndarray] = {}
    cols: dict[int, np.ndarray] = {}
    out = np.zeros((len(src_keys), len(dst_keys)))
    for e, sc, dc in zip(group, src_cols, dst_cols, strict=True):
        m = arrays.get(id(e.costs))
        if m is None:
            m = arrays[id(e.costs)] = np.asarray(e.costs, dtype=np.float64)
        r = rows.get(sc)
        if r is None:
            r = rows[sc] = np.array([a[sc] for a in src_keys], dtype=np.intp)
        c = cols.get(dc)
        if c is None:
            c = cols[dc] = np.array([b[dc] for b in dst_keys], dtype=np.intp)
        out += m[r[:, None], c[None, :]]
    return out.tolist()


def _reduce(problem: ShardingProblem) -> _Reduced:
    n = len(problem.nodes)
    parent = list(range(n))
    for group in problem.aliases:
        for a in group[1:]:
            ra, rb = _find(parent, group[0]), _find(parent, a)
            if ra != rb:
                parent[rb] = ra
    rep = [_find(parent, i) for i in range(n)]
    reps = sorted(set(rep))
    unary = {r: [0.0] * problem.nodes[r].num_strategies for r in reps}
    for i, node in enumerate(problem.nodes):
        u = unary[rep[i]]
        for s, c in enumerate(node.costs):
            u[s] += c
    merged: dict[tuple[int, int], list] = {}
    for e in problem.edges:
        u, v = rep[e.src], rep[e.dst]
        if u == v:
            for s in range(len(unary[u])):
                unary[u][s] += e.cost(s, s)
            continue
        merged.setdefault((u, v), []).append(e)
    edges = []
    for (u, v), group in merged.items():
        su, sv = len(unary[u]), len(unary[v])
        # A merged class is the tuple of the parallel edges' classes.
        src_keys, src_cls, src_cols = _merged_classes([e.src_classes for e in group])
        dst_keys, dst_cls, dst_cols = _merged_classes([e.dst_classes for e in group])
        mat = _merged_matrix(group, src_keys, src_cols, dst_keys, dst_cols)
        if len(src_keys) == 1 or len(dst_keys) == 1:
            # One side's layout never changes: the edge is a cost of the other side alone.
            if len(src_keys) == 1:
                for s in range(sv):
                    unary[v][s] += mat[0][dst_cls[s]]
            else:
                for s in range(su):
                    unary[u][s] += mat[src_cls[s]][0]
            continue
        # Potential decomposition: row minima onto the producer, column minima onto the
        # consumer; the residual is zero on most pairs.
        for i, row in enumerate(mat):
            m = min(row)
            if m:
                for s in range(su):
                    if src_cls[s] == i:
                        unary[u][s] += m
                mat[i] = [c - m for c in row]
        for j in range(len(dst_keys)):
            m = min(row[j] for row in mat)
            if m:
                for s in range(sv):
                    if dst_cls[s] == j:
                        unary[v][s] += m
                for row in mat:
                    row[j] -= m
        if any(c > 0 for row in mat for c in row):
            edges.append((u, v, src_cls, dst_cls, mat))
    shared = []
    for sc in problem.shared:
        members: dict[int, set[int]] = {}
        for n, ss in sc.members:
            members.setdefault(rep[n], set()).update(ss)
        if sc.cost > 0 and members:
            shared.append((sc.cost, members))
    return _Reduced(rep, reps, unary, edges, shared)


# ----------------------------------------------------------------------------- presolve


def _memory_by_rep(problem: ShardingProblem, red: _Reduced) -> list[tuple[float, dict]]:
    """Every memory constraint as (constant bytes, rep -> bytes per strategy)."""
    rows = []
    for m in problem.memory:
        terms: dict[int, np.ndarray] = {}
        for n, bs in m.terms:
            r = red.rep[n]
            vec = terms.get(r)
            if vec is None:
                terms[r] = np.asarray(bs, dtype=np.float64).copy()
            else:
                vec += np.asarray(bs, dtype=np.float64)
        rows.append((float(m.constant), terms))
    return rows


def _can_bind(row: tuple[float, dict], limit: float) -> bool:
    const, terms = row
    return const + sum(float(v.max()) for v in terms.values()) > limit


def _pair_max(m: np.ndarray) -> np.ndarray:
    """``E[a, b] = max_j (m[b, j] - m[a, j])`` for the rows of ``m``: how much worse
    switching from row ``a`` to row ``b`` can be, whatever column is chosen."""
    k, c = m.shape
    out = np.empty((k, k))
    block = max(1, _PAIR_BLOCK // max(1, k * c))
    for lo in range(0, k, block):
        hi = min(k, lo + block)
        out[lo:hi] = (m[None, :, :] - m[lo:hi, None, :]).max(axis=2)
    return out


def _dead_end_elimination(
    red: _Reduced, memory: list[tuple[float, dict]], tol: float
) -> dict[int, np.ndarray]:
    """Alive mask per representative after Goldstein dead-end elimination to a fixpoint.

    Strategy ``s`` is eliminated by a surviving ``t`` of the same node when
    ``c_t - c_s + sum_e max_j (M_e[t, j] - M_e[s, j]) + sum_k [t in k, s not in k] w_k
    <= tol`` (``j`` over the neighbour's surviving layouts, ``k`` over shared costs:
    ``t`` may switch one on that nothing else pays for) and ``t`` needs no more bytes
    than ``s`` in every memory constraint. Eliminations are sequential, each checked
    against the survivors of the moment, so an optimal choice always survives (swap
    ``s`` for ``t`` in it).
    """
    unary = {r: np.asarray(red.unary[r], dtype=np.float64) for r in red.reps}
    alive = {r: np.ones(len(unary[r]), dtype=bool) for r in red.reps}
    adj: dict[int, list] = {r: [] for r in red.reps}
    for u, v, sc, dc, mat in red.edges:
        m = np.asarray(mat, dtype=np.float64)
        sc_a, dc_a = np.asarray(sc), np.asarray(dc)
        adj[u].append((sc_a, m, v, dc_a))
        adj[v].append((dc_a, m.T.copy(), u, sc_a))
    mem: dict[int, list[np.ndarray]] = {r: [] for r in red.reps}
    for _, terms in memory:
        for r, vec in terms.items():
            if vec.max() > vec.min():
                mem[r].append(vec)
    # extra[r][s, t]: shared costs t belongs to and s does not.
    extra: dict[int, np.ndarray] = {}
    for cost, members in red.shared:
        for r, ss in members.items():
            m = np.zeros(len(unary[r]))
            m[sorted(ss)] = 1.0
            e = extra.setdefault(r, np.zeros((len(m), len(m))))
            e += cost * (1.0 - m)[:, None] * m[None, :]
    # Only a node whose own or neighbours' survivors changed since it was last checked can
    # lose a strategy: the others are skipped (the eliminations are the same).
    neighbours: dict[int, set[int]] = {r: {other for *_, other, _ in adj[r]} for r in red.reps}
    dirty = set(red.reps)
    for _ in range(_DEE_ROUNDS):
        changed = False
        for r in red.reps:
            if r not in dirty:
                continue
            dirty.discard(r)
            al = np.flatnonzero(alive[r])
            if len(al) <= 1:
                continue
            c = unary[r][al]
            d = c[None, :] - c[:, None]  # d[s, t] = c_t - c_s
            if r in extra:
                d += extra[r][np.ix_(al, al)]
            for cls, m, other, ocls in adj[r]:
                cols = np.unique(ocls[alive[other]])
                rows, inv = np.unique(cls[al], return_inverse=True)
                e = _pair_max(m[np.ix_(rows, cols)])
                d += e[np.ix_(inv, inv)]
            ok = d <= tol
            for vec in mem[r]:
                b = vec[al]
                ok &= b[None, :] <= b[:, None]
            np.fill_diagonal(ok, False)
            if not ok.any():
                continue
            keep = np.ones(len(al), dtype=bool)
            for s in np.argsort(-c, kind="stable"):  # the dearest go first
                if (ok[s] & keep).any():
                    keep[s] = False
            if not keep.all():
                alive[r][al[~keep]] = False
                changed = True
                dirty.add(r)
                dirty.update(neighbours[r])
        if not changed:
            break
    return alive


def _compact(
    red: _Reduced,
    alive: dict[int, np.ndarray],
    memory: list[tuple[float, dict]],
) -> _Compact:
    """Restrict the reduced problem to the surviving strategies and reduce edges again."""
    keep = {r: np.flatnonzero(alive[r]) for r in red.reps}
    unary = {r: np.asarray(red.unary[r], dtype=np.float64)[keep[r]] for r in red.reps}
    edges: list[_Edge] = []
    for u, v, sc, dc, mat in red.edges:
        src_full = np.asarray(sc)[keep[u]]
        dst_full = np.asarray(dc)[keep[v]]
        rows, src_cls = np.unique(src_full, return_inverse=True)
        cols, dst_cls = np.unique(dst_full, return_inverse=True)
        m = np.asarray(mat, dtype=np.float64)[np.ix_(rows, cols)]
        if m.shape[0] == 1 or m.shape[1] == 1:
            unary[u] += m.min(axis=1)[src_cls]
            unary[v] += (m - m.min(axis=1, keepdims=True)).min(axis=0)[dst_cls]
            continue
        lo = m.min(axis=1, keepdims=True)
        unary[u] += lo[:, 0][src_cls]
        m = m - lo
        lo = m.min(axis=0, keepdims=True)
        unary[v] += lo[0][dst_cls]
        m = m - lo
        if (m > 0).any():
            edges.append(_Edge(u, v, src_cls, dst_cls, m))
    offset = 0.0
    for r in red.reps:
        lo = float(unary[r].min())
        offset += lo
        unary[r] = unary[r] - lo
    mem = [(const, {r: vec[keep[r]] for r, vec in terms.items()}) for const, terms in memory]
    shared = []
    for cost, members in red.shared:
        masks = {}
        for r, ss in members.items():
            m = np.isin(keep[r], sorted(ss))
            if m.any():
                masks[r] = m
        if masks:
            shared.append((cost, masks))
    stats = {
        "strategies": sum(len(red.unary[r]) for r in red.reps),
        "kept": sum(len(k) for k in keep.values()),
        "edges": len(edges),
        "pairs": sum(e.mat.size for e in edges),
    }
    return _Compact(red, keep, unary, offset, edges, mem, shared, stats)


# Presolved problems by id (with a weak reference, so an entry goes with its problem): the
# outer loop asks for a mesh's lower bound and then solves it, both from one presolve.
_PRESOLVED: dict[int, tuple[weakref.ref, dict[tuple[str, bool], _Compact]]] = {}


def _presolve(problem: ShardingProblem, minimize: str, eliminate: bool = True) -> _Compact:
    """The presolved problem (memoised per problem object: problems are immutable and
    nothing downstream changes a :class:`_Compact`)."""
    key = id(problem)
    entry = _PRESOLVED.get(key)
    if entry is None or entry[0]() is not problem:
        ref = weakref.ref(problem, lambda _, key=key: _PRESOLVED.pop(key, None))
        entry = _PRESOLVED[key] = (ref, {})
    cp = entry[1].get((minimize, eliminate))
    if cp is None:
        cp = entry[1][(minimize, eliminate)] = _presolve_uncached(problem, minimize, eliminate)
    return cp


def _presolve_uncached(problem: ShardingProblem, minimize: str, eliminate: bool) -> _Compact:
    red = _reduce(problem)
    memory = _memory_by_rep(problem, red)
    if minimize == "cost":
        limit = problem.memory_limit
        memory = [] if limit is None else [m for m in memory if _can_bind(m, limit)]
    if minimize == "cost" and eliminate:
        top = max((abs(c) for u in red.unary.values() for c in u), default=0.0)
        top = max([top] + [c for *_, mat in red.edges for row in mat for c in row])
        top = max([top] + [c for c, _ in red.shared])
        alive = _dead_end_elimination(red, memory, 1e-12 * top)
    else:
        alive = {r: np.ones(len(red.unary[r]), dtype=bool) for r in red.reps}
    return _compact(red, alive, memory)


def presolve_stats(problem: ShardingProblem) -> dict[str, int]:
    """How big the problem is after the exact presolve (what the backends solve):
    ``choices`` (representative nodes kept), ``strategies`` (before elimination),
    ``kept`` (after), ``edges`` and ``pairs`` (edge matrix entries).

    Example:
        >>> from autopar.search.problem import ProblemNode
        >>> p = ShardingProblem((ProblemNode("a", (1.0, 2.0)), ProblemNode("b", (2.0, 1.0))))
        >>> presolve_stats(p)["kept"]
        2
    """
    cp = _presolve(problem, "cost")
    return {"choices": len(cp.keep), **cp.stats}


# ----------------------------------------------------------------------------- heuristics


def _local_search(cp: _Compact, start: dict[int, int], max_passes: int = 50) -> dict[int, int]:
    """Iterated conditional modes: each node in turn takes its best strategy given its
    neighbours' current ones, until a full pass changes nothing (memory ignored)."""
    adj: dict[int, list] = {r: [] for r in cp.keep}
    for e in cp.edges:
        adj[e.src].append((e.src_cls, e.mat, e.dst, e.dst_cls))
        adj[e.dst].append((e.dst_cls, e.mat.T, e.src, e.src_cls))
    charges: dict[int, list[tuple[int, float, np.ndarray]]] = {r: [] for r in cp.keep}
    for k, (cost, masks) in enumerate(cp.shared):
        for r, m in masks.items():
            charges[r].append((k, cost, m))
    choice = dict(start)
    # How many representatives' current strategies belong to each shared cost.
    active = [sum(int(m[choice[r]]) for r, m in masks.items()) for _, masks in cp.shared]
    for _ in range(max_passes):
        changed = False
        for r, u in cp.unary.items():
            if len(u) == 1:
                continue
            local = u.copy()
            for cls, m, other, ocls in adj[r]:
                local += m[cls, ocls[choice[other]]]
            for k, cost, m in charges[r]:
                if active[k] - int(m[choice[r]]) == 0:  # nobody else pays for it
                    local += cost * m
            best = int(np.argmin(local))
            if local[best] < local[choice[r]] - 1e-15:
                for k, _, m in charges[r]:
                    active[k] += int(m[best]) - int(m[choice[r]])
                choice[r] = best
                changed = True
        if not changed:
            break
    return choice


def _lp_rounded(
    problem: ShardingProblem, cp: _Compact, time_limit_s: float
) -> tuple[dict[int, int], float]:
    """The LP relaxation (HiGHS dual simplex on the same formulation, all variables
    continuous), rounded to each node's largest value, then improved by local search;
    and the relaxation's optimum (seconds; 0 if the LP did not finish), a lower bound.

    On sharding problems the relaxation is nearly integral: rounding it lands on or next
    to the optimum (GPT-2 small: the optimum itself, 0.3 s), where greedy + local search
    can be 10-50% off; CP-SAT then only has to prove it, unless the bound proves it
    already. Falls back to the greedy start if the LP does not finish. A relaxation
    :func:`prefetch_relaxation` started is taken up (waited for if it is running).
    """
    ahead = _prefetched(problem)
    picked, bound = ahead.result() if ahead is not None else _relaxation(problem, cp, time_limit_s)
    return (_start(cp, None) if picked is None else _local_search(cp, picked)), bound


def _relaxation(
    problem: ShardingProblem, cp: _Compact, time_limit_s: float
) -> tuple[dict[int, int] | None, float]:
    """The LP relaxation's rounded choice and optimum (``None, 0.0`` if HiGHS failed)."""
    try:
        picked, _, bound = _solve_highs(problem, cp, time_limit_s, "cost", relax=True)
    except SolveShardingError:
        return None, 0.0
    return picked, bound


class _Background:
    """One daemon thread running submitted calls in order, each with a
    :class:`~concurrent.futures.Future` (``submit`` as an executor's). A daemon, unlike a
    ``ThreadPoolExecutor``'s worker, which the interpreter joins at exit: a relaxation
    still running for a mesh the search skipped must not hold up the end of a script."""

    def __init__(self, name: str) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._name = name
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def submit(self, fn, *args) -> Future:
        future: Future = Future()
        self._queue.put((future, fn, args))
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
        return future

    def _run(self) -> None:
        while True:
            future, fn, args = self._queue.get()
            if not future.set_running_or_notify_cancel():
                continue  # cancelled while queued
            try:
                future.set_result(fn(*args))
            except BaseException as e:  # noqa: BLE001 - handed to whoever waits on it
                future.set_exception(e)


# One background thread for LP relaxations started ahead of their solve. HiGHS releases
# the GIL while it runs, so a relaxation proceeds beside the caller's Python (the planner
# builds the next mesh's problem meanwhile) on a second core.
_LP_THREAD = _Background("autopar-lp")
_AHEAD = "relaxation"  # the key of a started relaxation in a problem's _PRESOLVED entry


def prefetch_relaxation(problem: ShardingProblem, time_limit_s: float) -> Future | None:
    """Start the LP relaxation that :func:`solve` would run first for ``problem`` (the
    default backend, minimising cost) on a background thread; ``solve`` takes it up.

    The planner calls it after building each mesh's problem: the relaxation (seconds on a
    48-block encoder-decoder) runs while the next mesh is built. The result is the one
    ``solve`` would compute itself (same HiGHS run, same time limit), so plans do not
    change. Returns the future (``None`` when ``solve`` would not run a relaxation); the
    caller may ``cancel()`` it if the problem is never solved. A future not started
    when ``solve`` needs it is cancelled and the relaxation run in the caller's thread.

    Example:
        >>> from autopar.search.problem import ProblemEdge, ProblemNode
        >>> p = ShardingProblem(
        ...     (ProblemNode("a", (1.0, 2.0)), ProblemNode("b", (2.0, 1.5))),
        ...     (ProblemEdge(0, 1, (0, 1), (0, 1), ((0.0, 5.0), (5.0, 0.0))),),
        ... )
        >>> ahead = prefetch_relaxation(p, 10.0)
        >>> sol = solve(p)
        >>> ahead.done(), sol.choice, sol.objective
        (True, (0, 0), 3.0)
    """
    cp = _presolve(problem, "cost")
    if not cp.edges:
        return None  # solve() needs no relaxation (nothing couples the nodes' layouts)
    slot = _PRESOLVED[id(problem)][1]
    ahead = slot.get(_AHEAD)
    if ahead is None:
        ahead = slot[_AHEAD] = _LP_THREAD.submit(_relaxation, problem, cp, time_limit_s)
    return ahead


def _prefetched(problem: ShardingProblem) -> Future | None:
    """The relaxation started for ``problem``, if any is running or done (taken out)."""
    entry = _PRESOLVED.get(id(problem))
    if entry is None or entry[0]() is not problem:
        return None
    ahead = entry[1].pop(_AHEAD, None)
    if ahead is not None and ahead.cancel():
        return None  # still queued behind another problem's: run it here instead
    return ahead


def _start(cp: _Compact, hint: Sequence[int] | None) -> dict[int, int]:
    """Kept-strategy index per representative: the hint where it survived presolve, else
    the cheapest; then improved by local search."""
    out: dict[int, int] = {}
    for r, u in cp.unary.items():
        s = int(np.argmin(u))
        if hint is not None and r < len(hint):
            hit = np.flatnonzero(cp.keep[r] == hint[r])
            if len(hit):
                s = int(hit[0])
        out[r] = s
    return _local_search(cp, out)


def _smallest_start(cp: _Compact) -> dict[int, int]:
    """Kept-strategy index per representative with the fewest bytes summed over the
    memory constraints (ties: the cheaper): the footprint solve's starting point, a
    solution of its own (memory is a sum over the nodes' choices)."""
    load = {r: np.zeros(len(u)) for r, u in cp.unary.items()}
    for _, terms in cp.memory:
        for r, vec in terms.items():
            load[r] = load[r] + vec
    return {r: int(np.lexsort((cp.unary[r], load[r]))[0]) for r in cp.unary}


def greedy_choice(problem: ShardingProblem) -> tuple[int, ...]:
    """Cheapest strategy per node by its own cost (ties: the first); a solver hint."""
    out = []
    for n in problem.nodes:
        out.append(min(range(n.num_strategies), key=lambda s: n.costs[s]))
    for group in problem.aliases:
        for a in group[1:]:
            out[a] = out[group[0]]
    return tuple(out)


# ----------------------------------------------------------------------------- entry


def solve(
    problem: ShardingProblem,
    time_limit_s: float = 30.0,
    *,
    backend: str = "cpsat",
    num_workers: int = 2,
    hint: Sequence[int] | None = None,
    minimize: str = "cost",
) -> ShardingSolution:
    """Solve ``problem`` exactly (up to the time limit).

    Args:
        problem: the problem.
        time_limit_s: wall-clock limit of the solver; on expiry the best solution found is
            returned with status ``"feasible"``.
        backend: ``"cpsat"`` (default: OR-Tools CP-SAT) or ``"highs"`` (the HiGHS MIP
            solver through ``highspy``, on the same formulation with
            continuous pair variables; a cross-check).
        num_workers: CP-SAT workers (HiGHS runs single-threaded).
        hint: a starting choice (default: greedy + local search); need not be feasible.
        minimize: ``"cost"`` (the objective) or ``"memory"`` (the largest memory
            constraint, ignoring ``memory_limit``: the smallest achievable footprint).

    Returns:
        The solution; ``status == "infeasible"`` (empty choice) when no choice fits.

    Raises:
        SolveShardingError: the solver failed without a solution for a reason other than
            infeasibility or the time limit.

    Example:
        >>> from autopar.search.problem import ProblemNode
        >>> p = ShardingProblem((ProblemNode("a", (2.0, 1.0)),))
        >>> sol = solve(p)
        >>> sol.choice, sol.status
        ((1,), 'optimal')
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r}; choose one of {BACKENDS}")
    if minimize not in ("cost", "memory"):
        raise ValueError(f"minimize={minimize!r}; choose 'cost' or 'memory'")
    t0 = time.perf_counter()
    if not problem.nodes:
        return ShardingSolution((), 0.0, "optimal", 0.0)
    cp = _presolve(problem, minimize)
    if minimize == "cost" and not (cp.edges or cp.shared or cp.memory):
        # Nothing couples the nodes: each one's cheapest strategy is the optimum.
        best = {r: int(np.argmin(u)) for r, u in cp.unary.items()}
        return _proved(problem, cp, best, cp.offset, t0)
    if backend == "cpsat" and hint is None and minimize == "cost" and cp.edges:
        start, lp_bound = _lp_rounded(problem, cp, 0.5 * time_limit_s)
        if lp_bound > 0:
            choice = _choice_of(problem, cp, start)
            if problem.is_feasible(choice) and problem.objective(choice) <= lp_bound * (
                1 + LP_PROOF_GAP
            ):
                # The rounded relaxation is within the gap of the relaxation's optimum, a
                # lower bound: it is optimal, and CP-SAT has nothing left to prove.
                return _proved(problem, cp, start, lp_bound, t0)
        if cp.memory and cp.stats.get("pairs", math.inf) <= MIP_FIRST_MAX_PAIRS:
            # A small problem whose memory rows keep the relaxation fractional: HiGHS's
            # branch and bound first, briefly (it proves these several times faster than
            # CP-SAT, and deterministically); CP-SAT only if it does not finish.
            left = time_limit_s - (time.perf_counter() - t0)
            picked, status, bound = _solve_highs(problem, cp, min(MIP_FIRST_S, 0.5 * left), "cost")
            if picked is not None:
                choice = _choice_of(problem, cp, picked)
                if status == "optimal" and problem.is_feasible(choice):
                    return _proved(problem, cp, picked, bound, t0)
                if problem.is_feasible(choice):
                    start = _local_search(cp, picked)  # CP-SAT's hint
    elif minimize == "memory" and hint is None:
        start = _smallest_start(cp)
        low = max(
            (m.constant + sum(min(bs) for _, bs in m.terms) for m in problem.memory), default=0.0
        )
        if problem.memory_usage(_choice_of(problem, cp, start)) <= low * (1 + 1e-9):
            # Every moment's smallest sum is reached at once: no footprint is smaller (on a
            # 7B Llama's 227-node problem CP-SAT took 25 s to prove this without the start).
            return _proved(problem, cp, start, 0.0, t0)
    else:
        start = _start(cp, hint)
    remaining = max(0.01, time_limit_s - (time.perf_counter() - t0))
    if backend == "cpsat":
        picked, status, bound = _solve_cpsat(problem, cp, remaining, num_workers, start, minimize)
    else:
        picked, status, bound = _solve_highs(problem, cp, remaining, minimize)
    elapsed = time.perf_counter() - t0
    if picked is None and status == "unknown" and minimize == "memory":
        # Out of time before the solver's first solution: the starting point is one (the
        # footprint ignores the memory bound), the smallest this far.
        fallback = _choice_of(problem, cp, start)
        return ShardingSolution(
            fallback, problem.objective(fallback), "feasible", elapsed,
            problem.memory_usage(fallback), 0.0,
        )  # fmt: skip
    if picked is None and status == "unknown" and minimize == "cost":
        # Out of time before the solver's first solution: the starting point (rounded LP
        # relaxation + local search, or the caller's hint) is a solution too, if it fits.
        fallback = _choice_of(problem, cp, start)
        if problem.is_feasible(fallback):
            _warn_time_limit(time_limit_s, problem.objective(fallback), 0.0, len(problem.nodes))
            return ShardingSolution(
                fallback, problem.objective(fallback), "feasible", elapsed,
                problem.memory_usage(fallback), 0.0,
            )  # fmt: skip
    if picked is None:
        return ShardingSolution((), math.inf, status, elapsed)
    rep_choice = {r: int(cp.keep[r][s]) for r, s in picked.items()}
    choice = tuple(rep_choice[cp.red.rep[i]] for i in range(len(problem.nodes)))
    if status == "feasible" and minimize == "cost":
        _warn_time_limit(time_limit_s, problem.objective(choice), bound, len(problem.nodes))
    return ShardingSolution(
        choice, problem.objective(choice), status, elapsed, problem.memory_usage(choice), bound
    )


def _warn_time_limit(time_limit_s: float, objective: float, bound: float, nodes: int) -> None:
    """Say that a solve stopped at its time limit with a solution not proved optimal."""
    gap = (
        f"at most {objective / bound - 1:.1%} above the optimum"
        if bound > 0 and math.isfinite(objective)
        else "its distance to the optimum unknown"
    )
    warnings.warn(
        f"the sharding solver reached its time limit of {time_limit_s:g} s on a problem of "
        f"{nodes} nodes before proving its plan optimal: using the best plan found so far "
        f"(predicted {objective * 1e3:.4g} ms, {gap}). For a better plan raise "
        "SearchOptions(solver_time_limit_s=...).",
        SolverTimeLimitWarning,
        stacklevel=3,
    )


def _proved(
    problem: ShardingProblem, cp: _Compact, picked: dict[int, int], bound: float, t0: float
) -> ShardingSolution:
    """The solution ``picked`` (kept-strategy index per representative), proved optimal
    without CP-SAT (``bound``: the lower bound that proves it)."""
    choice = _choice_of(problem, cp, picked)
    return ShardingSolution(
        choice, problem.objective(choice), "optimal", time.perf_counter() - t0,
        problem.memory_usage(choice), min(bound, problem.objective(choice)),
    )  # fmt: skip


def _choice_of(problem: ShardingProblem, cp: _Compact, start: dict[int, int]) -> tuple[int, ...]:
    rep_choice = {r: int(cp.keep[r][s]) for r, s in start.items()}
    return tuple(rep_choice[cp.red.rep[i]] for i in range(len(problem.nodes)))


def objective_lower_bound(problem: ShardingProblem) -> float:
    """A lower bound on the optimum in seconds, from presolve alone: every edge at its
    row and column minima (moved onto the nodes), every node at its cheapest surviving
    strategy, memory ignored.

    Example:
        >>> from autopar.search.problem import ProblemNode
        >>> objective_lower_bound(ShardingProblem((ProblemNode("a", (2.0, 1.0)),)))
        1.0
    """
    if not problem.nodes:
        return 0.0
    return _presolve(problem, "cost").offset


# ----------------------------------------------------------------------------- scaling


def _objective_scale(cp: _Compact) -> float:
    top = max((float(u.max()) for u in cp.unary.values() if len(u)), default=0.0)
    top = max([top] + [float(e.mat.max()) for e in cp.edges] + [c for c, _ in cp.shared])
    return _MAX_COEF / top if top > 0 else 1.0


def _memory_unit(cp: _Compact, limit: float | None) -> float:
    top = max(
        [abs(c) for c, _ in cp.memory]
        + [float(v.max()) for _, t in cp.memory for v in t.values() if len(v)]
        + [limit or 0.0, 1.0]
    )
    return top / _MAX_COEF


# ----------------------------------------------------------------------------- CP-SAT


_INT64_MIN = -(2**63)
_BOOL_VAR_TEXT = "variables { domain: 0 domain: 1 }\n"


def _cpsat_model(problem, cp: _Compact, minimize: str):
    """The CP-SAT model proto of the formulation in the module docstring, and the index of
    each representative's first boolean (its strategies' booleans are consecutive).

    Every variable, row and the objective are written into the proto directly, exactly as
    ``CpModel``'s modelling calls write them (variables in creation order, each linear
    row's terms by variable index), only without a Python object per variable, and
    without importing ``cp_model`` (which imports pandas: 0.6 s of a small search)."""
    from ortools.sat.python import cp_model_helper as cmh

    proto = cmh.CpModelProto()
    first: dict[int, int] = {}
    n = 0
    for r, u in cp.unary.items():
        first[r] = n
        n += len(u)
    scale = _objective_scale(cp)
    obj_vars: list[int] = []
    obj_coefs: list[int] = []
    constraints = proto.constraints
    for r, u in cp.unary.items():
        xs = range(first[r], first[r] + len(u))
        constraints.add().exactly_one.literals.extend(xs)
        for s, c in enumerate(u.tolist()):
            w = round(c * scale)
            if w:
                obj_vars.append(first[r] + s)
                obj_coefs.append(w)
    for e in cp.edges:
        n_rows, n_cols = e.mat.shape
        y0 = n
        n += n_rows * n_cols
        src, dst = first[e.src], first[e.dst]
        a: list[list[int]] = [[] for _ in range(n_rows)]
        b: list[list[int]] = [[] for _ in range(n_cols)]
        for s, k in enumerate(e.src_cls.tolist()):
            a[k].append(src + s)
        for s, k in enumerate(e.dst_cls.tolist()):
            b[k].append(dst + s)
        # sum_j y[i, j] == a[i] and sum_i y[i, j] == b[j]: the strategies' booleans come
        # first (they were created before the pair booleans).
        for i in range(n_rows):
            lin = constraints.add().linear
            lin.vars.extend(a[i])
            lin.vars.extend(range(y0 + i * n_cols, y0 + (i + 1) * n_cols))
            lin.coeffs.extend([-1] * len(a[i]) + [1] * n_cols)
            lin.domain.extend((0, 0))
        for j in range(n_cols):
            lin = constraints.add().linear
            lin.vars.extend(b[j])
            lin.vars.extend(range(y0 + j, y0 + n_rows * n_cols, n_cols))
            lin.coeffs.extend([-1] * len(b[j]) + [1] * n_rows)
            lin.domain.extend((0, 0))
        w = np.rint(e.mat * scale).astype(np.int64)
        nz = np.flatnonzero(w)
        obj_vars.extend((nz + y0).tolist())
        obj_coefs.extend(w.ravel()[nz].tolist())
    if minimize == "cost":
        for cost, masks in cp.shared:
            w = round(cost * scale)
            if not w:
                continue
            z = n
            n += 1
            for r, m in masks.items():
                # A node's member strategies exclude each other: their sum is a tighter
                # (and smaller) relaxation of "any member => z" than one row per member.
                members = (np.flatnonzero(m) + first[r]).tolist()
                lin = constraints.add().linear
                lin.vars.extend(members)
                lin.vars.append(z)
                lin.coeffs.extend([1] * len(members) + [-1])
                lin.domain.extend((_INT64_MIN, 0))
            obj_vars.append(z)
            obj_coefs.append(w)
    proto.merge_text_format(_BOOL_VAR_TEXT * n)  # n booleans, as new_bool_var("") makes them
    if cp.memory:
        unit = _memory_unit(cp, problem.memory_limit)
        peak = None
        if minimize == "memory":
            total = sum(abs(c) + sum(float(v.max()) for v in t.values()) for c, t in cp.memory)
            peak = n  # new_int_var(0, total / unit + 2, "peak")
            proto.merge_text_format(
                f'variables {{ name: "peak" domain: 0 domain: {int(total / unit) + 2} }}\n'
            )
        for const, terms in cp.memory:
            vs, cs = [], []
            for r, vec in terms.items():
                for s, bts in enumerate(vec):
                    k = math.ceil(bts / unit)
                    if k:
                        vs.append(first[r] + s)
                        cs.append(k)
            if peak is not None:  # expr + ceil(const / unit) <= peak
                lin = constraints.add().linear
                lin.vars.extend([*vs, peak])
                lin.coeffs.extend([*cs, -1])
                lin.domain.extend((_INT64_MIN, -math.ceil(const / unit)))
            elif problem.memory_limit is not None:  # expr <= floor(limit / unit - const / unit)
                lin = constraints.add().linear
                lin.vars.extend(vs)
                lin.coeffs.extend(cs)
                lin.domain.extend(
                    (_INT64_MIN, math.floor(problem.memory_limit / unit - const / unit))
                )
        if peak is not None:
            proto.objective.vars.append(peak)
            proto.objective.coeffs.append(1)
            proto.objective.scaling_factor = 1.0
    if minimize == "cost":
        # The terms are in variable order already (booleans, then pairs, then shared).
        objective = proto.objective
        objective.vars.extend(obj_vars)
        objective.coeffs.extend(obj_coefs)
        objective.scaling_factor = 1.0
    return proto, first, scale


def _solve_cpsat(problem, cp: _Compact, time_limit_s, workers, start, minimize):
    from ortools.sat.python import cp_model_helper as cmh

    proto, first, scale = _cpsat_model(problem, cp, minimize)
    # Hint the node booleans only: propagation fixes every pair boolean from them.
    hint = proto.solution_hint
    for r, u in cp.unary.items():
        hint.vars.extend(range(first[r], first[r] + len(u)))
        hint.values.extend(int(s == start[r]) for s in range(len(u)))
    p = cmh.SatParameters()
    p.max_time_in_seconds = float(time_limit_s)
    p.num_workers = max(1, int(workers))
    p.log_search_progress = _VERBOSE
    p.cp_model_probing_level = 0
    p.cp_model_presolve = False
    if p.num_workers > 1:
        p.subsolvers.extend(_SUBSOLVERS)
    else:
        p.linearization_level = 2  # the one worker gets max_lp's full relaxation
    wrapper = cmh.SolveWrapper()
    wrapper.set_parameters(p)
    response = wrapper.solve(proto)
    status = response.status
    if status == cmh.CpSolverStatus.INFEASIBLE:
        return None, "infeasible", 0.0
    if status not in (cmh.CpSolverStatus.OPTIMAL, cmh.CpSolverStatus.FEASIBLE):
        if status == cmh.CpSolverStatus.MODEL_INVALID:
            raise SolveShardingError(
                f"CP-SAT rejected the model ({status.name}) of a problem of "
                f"size {problem.size}; replay it with ShardingProblem.from_json(...) or "
                "backend='highs'."
            )
        return None, "unknown", 0.0
    values = list(response.solution)
    picked = {
        r: next(s for s in range(len(u)) if values[first[r] + s]) for r, u in cp.unary.items()
    }
    bound = 0.0
    if minimize == "cost":
        bound = response.best_objective_bound / scale + cp.offset
    return picked, "optimal" if status == cmh.CpSolverStatus.OPTIMAL else "feasible", bound


# ----------------------------------------------------------------------------- HiGHS


@dataclass
class _Lp:
    """The formulation as one sparse matrix (HiGHS's input): ``x`` columns first (the
    representatives' strategies, consecutive per representative), then each edge's pair
    columns (row-major), then the shared-cost and peak columns."""

    cost: np.ndarray
    upper: np.ndarray
    rows: np.ndarray
    cols: np.ndarray
    vals: np.ndarray
    lo: np.ndarray
    hi: np.ndarray
    x: dict[int, np.ndarray]  # representative -> its x columns
    num_x: int
    scale: float


def _lp_matrix(problem: ShardingProblem, cp: _Compact, minimize: str) -> _Lp:
    """The formulation of the module docstring as coordinate arrays (numpy throughout: a
    3-axis GPT problem has ~300k pair columns)."""
    scale = _objective_scale(cp)
    inf = float("inf")
    cost_x = [u * scale if minimize == "cost" else np.zeros(len(u)) for u in cp.unary.values()]
    sizes = np.asarray([len(u) for u in cp.unary.values()], dtype=np.int64)
    num_x = int(sizes.sum())
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
    x = {
        r: np.arange(s, s + k)
        for r, s, k in zip(cp.unary, starts.tolist(), sizes.tolist(), strict=True)
    }
    costs: list[np.ndarray] = [*cost_x]
    rows: list[np.ndarray] = [np.repeat(np.arange(len(sizes)), sizes)]
    cols: list[np.ndarray] = [np.arange(num_x)]
    vals: list[np.ndarray] = [np.ones(num_x)]
    lo: list[np.ndarray] = [np.ones(len(sizes))]
    hi: list[np.ndarray] = [np.ones(len(sizes))]
    n_rows, n_cols = len(sizes), num_x
    for e in cp.edges:
        a, b = e.mat.shape
        k = a * b
        y = n_cols + np.arange(k)
        n_cols += k
        costs.append(e.mat.ravel() * scale if minimize == "cost" else np.zeros(k))
        # Local-polytope marginalisation: the pair columns of a row sum to the producer's
        # class indicator, those of a column to the consumer's.
        rows += [
            n_rows + np.repeat(np.arange(a), b),
            n_rows + e.src_cls,
            n_rows + a + np.tile(np.arange(b), a),
            n_rows + a + e.dst_cls,
        ]
        cols += [y, x[e.src], y, x[e.dst]]
        vals += [np.ones(k), -np.ones(len(e.src_cls)), np.ones(k), -np.ones(len(e.dst_cls))]
        lo.append(np.zeros(a + b))
        hi.append(np.zeros(a + b))
        n_rows += a + b
    upper_extra: list[float] = []
    if minimize == "cost":
        for c, masks in cp.shared:
            z = n_cols
            n_cols += 1
            costs.append(np.asarray([c * scale]))
            upper_extra.append(1.0)
            for r, m in masks.items():
                members = x[r][m]
                rows += [np.asarray([n_rows]), np.full(len(members), n_rows)]
                cols += [np.asarray([z]), members]
                vals += [np.ones(1), -np.ones(len(members))]
                lo.append(np.zeros(1))
                hi.append(np.full(1, inf))
                n_rows += 1
    if cp.memory:
        unit = _memory_unit(cp, problem.memory_limit)
        peak = None
        if minimize == "memory":
            peak = n_cols
            n_cols += 1
            costs.append(np.ones(1))
            upper_extra.append(inf)
        for const, terms in cp.memory:
            if peak is None and problem.memory_limit is None:
                continue
            for r, vec in terms.items():
                rows.append(np.full(len(vec), n_rows))
                cols.append(x[r])
                vals.append(np.asarray(vec, dtype=np.float64) / unit)
            lo.append(np.full(1, -inf))
            if peak is not None:
                rows.append(np.asarray([n_rows]))
                cols.append(np.asarray([peak]))
                vals.append(-np.ones(1))
                hi.append(np.full(1, -const / unit))
            else:
                hi.append(np.full(1, (problem.memory_limit - const) / unit))
            n_rows += 1
    cost = np.concatenate(costs)
    upper = np.ones(n_cols)
    if upper_extra:
        upper[n_cols - len(upper_extra) :] = upper_extra
    return _Lp(
        cost, upper, np.concatenate(rows), np.concatenate(cols), np.concatenate(vals),
        np.concatenate(lo), np.concatenate(hi), x, num_x, scale,
    )  # fmt: skip


def _csc(lp: _Lp) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The coordinate entries of ``lp`` as compressed columns (start, row index, value),
    entries at one position summed: HiGHS's column-wise matrix."""
    n_rows, n_cols = len(lp.lo), len(lp.cost)
    key = lp.cols.astype(np.int64) * n_rows + lp.rows
    order = np.argsort(key, kind="stable")
    key = key[order]
    first = np.flatnonzero(np.r_[True, key[1:] != key[:-1]]) if len(key) else np.zeros(0, int)
    values = np.add.reduceat(lp.vals[order], first) if len(key) else np.zeros(0)
    key = key[first]
    start = np.searchsorted(key // n_rows, np.arange(n_cols + 1), side="left")
    return start.astype(np.int32), (key % n_rows).astype(np.int32), values.astype(np.float64)


def _solve_highs(problem, cp: _Compact, time_limit_s, minimize, relax: bool = False):
    """HiGHS on the formulation (``x`` binary unless ``relax``; pair and shared-cost
    columns continuous). Returns ``(picked, status, bound)``: with ``relax``, ``picked``
    rounds the relaxation (each node's largest ``x``) and ``bound`` is the relaxation's
    optimum in seconds, a lower bound on the problem's (0 when the LP did not finish).

    HiGHS is called through ``highspy``, its own bindings: ``scipy.optimize.milp`` runs
    the same solver (HiGHS 1.12, the version pinned), but importing ``scipy.optimize``
    takes 0.55 s (a sixth of planning a 0.1M-parameter GPT), ``highspy`` 0.13 s. ``run``
    releases the GIL, so a relaxation on the background thread runs beside the caller's
    Python."""
    import highspy

    lp = _lp_matrix(problem, cp, minimize)
    start, index, value = _csc(lp)
    model = highspy.HighsLp()
    model.num_col_, model.num_row_ = len(lp.cost), len(lp.lo)
    model.col_cost_, model.col_lower_, model.col_upper_ = lp.cost, np.zeros(len(lp.cost)), lp.upper
    model.row_lower_, model.row_upper_ = lp.lo, lp.hi
    matrix = model.a_matrix_
    matrix.format_ = highspy.MatrixFormat.kColwise
    matrix.num_col_, matrix.num_row_ = model.num_col_, model.num_row_
    matrix.start_, matrix.index_, matrix.value_ = start, index, value
    # ``_Highs``, not the ``Highs`` subclass: that one enables its callbacks on
    # construction, which prints HiGHS's banner to stdout before output can be turned off.
    highs = highspy._Highs()
    highs.setOptionValue("output_flag", _VERBOSE)
    highs.setOptionValue("time_limit", float(time_limit_s))
    highs.setOptionValue("mip_rel_gap", 1e-6)
    # HiGHS's presolve halves nothing on the relaxation and doubles its time (GPT-2 small
    # on a 3-axis mesh: 2.4 s without, 4.6 s with).
    highs.setOptionValue("presolve", "off" if relax else "on")
    if not relax and lp.num_x:
        model.integrality_ = [highspy.HighsVarType.kInteger] * lp.num_x + [
            highspy.HighsVarType.kContinuous
        ] * (model.num_col_ - lp.num_x)
    if highs.passModel(model) == highspy.HighsStatus.kError:
        raise SolveShardingError(
            f"HiGHS refused the formulation of a problem of size {problem.size}; replay it "
            "with ShardingProblem.from_json(...) or backend='cpsat'."
        )
    highs.run()
    status = highs.getModelStatus()
    info = highs.getInfo()
    S = highspy.HighsModelStatus
    limits = (S.kTimeLimit, S.kIterationLimit, S.kSolutionLimit)
    if status == S.kInfeasible:
        return None, "infeasible", 0.0
    solved = status == S.kOptimal or (
        not relax and status in limits and info.objective_function_value < highspy.kHighsInf
    )
    if not solved:
        if status in limits:
            return None, "unknown", 0.0
        raise SolveShardingError(
            f"HiGHS stopped ({highs.modelStatusToString(status)}) on a problem of size "
            f"{problem.size}; replay it with ShardingProblem.from_json(...) or backend='cpsat'."
        )
    values = np.asarray(highs.getSolution().col_value)
    picked = {r: int(np.argmax(values[idx])) for r, idx in lp.x.items()}
    bound = 0.0
    dual = info.objective_function_value if relax else info.mip_dual_bound
    if minimize == "cost" and np.isfinite(dual):
        bound = dual / lp.scale + cp.offset
    return picked, "optimal" if status == S.kOptimal else "feasible", bound


__all__ = [
    "BACKENDS",
    "greedy_choice",
    "objective_lower_bound",
    "prefetch_relaxation",
    "presolve_stats",
    "solve",
]
