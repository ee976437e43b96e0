"""Solve a :class:`ShardingProblem` with OR-Tools CP-SAT.

Formulation (one boolean ``x[n, s]`` per node ``n`` and strategy ``s``):

* ``sum_s x[n, s] == 1`` for every node; aliased nodes share one set of booleans.
* objective: ``sum c[n, s] x[n, s] + sum_edges sum_(i, j) r[e, i, j] y[e, i, j]`` with
  ``y[e, i, j] >= a[e, i] + b[e, j] - 1``, where ``a[e, i]`` says "the producer gives the
  value in layout class ``i``" (the sum of its strategies' ``x`` in that class) and
  ``b[e, j]`` the same for the consumer. Only pairs with a positive residual cost get a
  ``y``: each edge matrix is first reduced by its row minima (moved onto the producer's
  strategy costs) and then its column minima (onto the consumer's), which is exact because
  exactly one row and one column are selected and typically zeroes most pairs.
* memory: ``constant + sum b[n, s] x[n, s] <= limit`` for every memory constraint.

Before building, edges between aliased nodes become node costs, edges whose producer or
consumer has a single layout class become node costs, and parallel edges are merged.
Costs are scaled to integers (the largest coefficient near 1e7); the reported objective
is recomputed exactly from the choice.

Example:
    >>> solve(problem, time_limit_s=10).choice        # doctest: +SKIP
    (0, 0, 1)
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

from autopar.errors import SolveShardingError
from autopar.search.problem import ShardingProblem, ShardingSolution

_MAX_COEF = 1e7  # largest scaled objective coefficient


@dataclass
class _Reduced:
    """The problem after aliasing, presolve and edge merging (solver-internal)."""

    rep: list[int]  # node -> representative
    reps: list[int]  # representatives
    unary: dict[int, list[float]]  # representative -> cost per strategy
    # merged edges between distinct representatives: (src, dst, src_cls, dst_cls, matrix)
    edges: list[tuple[int, int, list[int], list[int], list[list[float]]]]


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
        src_cls, src_keys = _classes([tuple(e.src_classes[s] for e in group) for s in range(su)])
        dst_cls, dst_keys = _classes([tuple(e.dst_classes[s] for e in group) for s in range(sv)])
        mat = [
            [sum(e.costs[ki[k]][kj[k]] for k, e in enumerate(group)) for kj in dst_keys]
            for ki in src_keys
        ]
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
    return _Reduced(rep, reps, unary, edges)


def solve(
    problem: ShardingProblem,
    time_limit_s: float = 30.0,
    *,
    num_workers: int = 2,
    hint: Sequence[int] | None = None,
    minimize: str = "cost",
) -> ShardingSolution:
    """Solve ``problem`` with CP-SAT.

    Args:
        problem: the problem.
        time_limit_s: wall-clock limit; on expiry the best solution found is returned
            with status ``"feasible"``.
        num_workers: CP-SAT search workers.
        hint: a starting choice (e.g. the greedy one); need not be feasible.
        minimize: ``"cost"`` (the objective) or ``"memory"`` (the largest memory
            constraint, ignoring ``memory_limit``: the smallest achievable footprint).

    Returns:
        The solution; ``status == "infeasible"`` (empty choice) when no choice fits.

    Raises:
        SolveShardingError: the solver gave up without any solution before the time limit
            for a reason other than infeasibility.

    Example:
        >>> sol = solve(ShardingProblem((ProblemNode("a", (2.0, 1.0)),)))   # doctest: +SKIP
        >>> sol.choice, sol.status                                          # doctest: +SKIP
        ((1,), 'optimal')
    """
    from ortools.sat.python import cp_model

    t0 = time.perf_counter()
    red = _reduce(problem)
    model = cp_model.CpModel()
    x: dict[int, list] = {}
    for r in red.reps:
        k = len(red.unary[r])
        x[r] = [model.new_bool_var(f"x{r}_{s}") for s in range(k)]
        model.add_exactly_one(x[r])

    # Scale costs to integers.
    coefs = [abs(c) for u in red.unary.values() for c in u]
    coefs += [c for *_, mat in red.edges for row in mat for c in row]
    top = max(coefs, default=0.0)
    scale = _MAX_COEF / top if top > 0 else 1.0

    objective_terms = []
    base = {r: min(u) for r, u in red.unary.items()}  # constant shift keeps numbers small
    for r, u in red.unary.items():
        for s, c in enumerate(u):
            v = round((c - base[r]) * scale)
            if v:
                objective_terms.append(v * x[r][s])
    for u, v, src_cls, dst_cls, mat in red.edges:
        a = _class_literals(model, x[u], src_cls, len(mat))
        b = _class_literals(model, x[v], dst_cls, len(mat[0]))
        for i, row in enumerate(mat):
            for j, c in enumerate(row):
                w = round(c * scale)
                if w <= 0:
                    continue
                y = model.new_bool_var("")
                model.add_bool_or([a[i].Not(), b[j].Not(), y])
                objective_terms.append(w * y)

    if problem.memory:
        mem_top = max(
            [abs(m.constant) for m in problem.memory]
            + [b for m in problem.memory for _, bs in m.terms for b in bs]
            + [problem.memory_limit or 0.0]
        )
        unit = max(1.0, mem_top / _MAX_COEF)  # bytes per integer unit (rounded up: safe)
        exprs = []
        peak_ub = 0
        for m in problem.memory:
            terms = {}
            for n, bs in m.terms:
                r = red.rep[n]
                for s, b in enumerate(bs):
                    terms[(r, s)] = terms.get((r, s), 0) + b
            expr = sum(math.ceil(b / unit) * x[r][s] for (r, s), b in terms.items() if b)
            exprs.append((expr, m.constant / unit))
            per_rep: dict[int, float] = {}
            for (r, _), b in terms.items():
                per_rep[r] = max(per_rep.get(r, 0.0), b)
            peak_ub = max(
                peak_ub, math.ceil((m.constant + sum(per_rep.values())) / unit) + len(terms) + 1
            )
        if minimize == "memory":
            peak = model.new_int_var(0, peak_ub, "peak")
            for expr, const in exprs:
                model.add(expr + math.ceil(const) <= peak)
            model.minimize(peak)
        elif problem.memory_limit is not None:
            for expr, const in exprs:
                model.add(expr <= math.floor(problem.memory_limit / unit - const))
    if minimize != "memory":
        model.minimize(sum(objective_terms) if objective_terms else 0)
    elif not problem.memory:
        model.minimize(0)

    start = hint if hint is not None else greedy_choice(problem)
    for i, s in enumerate(start):
        r = red.rep[i]
        if i == r and 0 <= s < len(x[r]):
            for k, var in enumerate(x[r]):
                model.add_hint(var, k == s)

    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = float(time_limit_s)
    solver.parameters.num_workers = int(num_workers)
    status = solver.solve(model)
    elapsed = time.perf_counter() - t0
    if status == cp_model.INFEASIBLE:
        return ShardingSolution((), math.inf, "infeasible", elapsed)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        if elapsed >= time_limit_s * 0.95:
            return ShardingSolution((), math.inf, "unknown", elapsed)
        raise SolveShardingError(
            f"CP-SAT stopped with status {solver.status_name(status)} after {elapsed:.1f} s "
            f"on a problem of size {problem.size}; replay it with "
            "ShardingProblem.from_json(...) and a longer time limit."
        )
    rep_choice = {
        r: next(s for s, var in enumerate(x[r]) if solver.boolean_value(var)) for r in red.reps
    }
    choice = tuple(rep_choice[red.rep[i]] for i in range(len(problem.nodes)))
    objective = problem.objective(choice)
    if minimize == "cost" and objective_terms:
        bound = solver.best_objective_bound / scale + sum(base.values())
    else:
        bound = 0.0
    return ShardingSolution(
        choice,
        objective,
        "optimal" if status == cp_model.OPTIMAL else "feasible",
        elapsed,
        problem.memory_usage(choice),
        bound,
    )


def _class_literals(model, xs: list, classes: list[int], count: int) -> list:
    members: list[list] = [[] for _ in range(count)]
    for s, c in enumerate(classes):
        members[c].append(xs[s])
    out = []
    for group in members:
        if len(group) == 1:
            out.append(group[0])
        else:
            a = model.new_bool_var("")
            model.add(sum(group) == a)
            out.append(a)
    return out


def greedy_choice(problem: ShardingProblem) -> tuple[int, ...]:
    """Cheapest strategy per node by its own cost (ties: the first); a solver hint."""
    out = []
    for n in problem.nodes:
        out.append(min(range(n.num_strategies), key=lambda s: n.costs[s]))
    for group in problem.aliases:
        for a in group[1:]:
            out[a] = out[group[0]]
    return tuple(out)
