"""The solver's exact reduction (aliases merged, parallel edges summed, potentials moved
onto the nodes) keeps every alias-consistent choice's objective: checked on random
problems against ``ShardingProblem.objective``, summed term by term."""

from __future__ import annotations

import math
import random

from autopar.search.problem import ProblemEdge, ProblemNode, ShardingProblem
from autopar.search.solver import _merged_classes, _reduce, solve


def _random_problem(rng: random.Random, tied_blocks: int) -> ShardingProblem:
    """``tied_blocks`` copies of a 3-node block (aliased across copies), edges inside
    each block, parallel edges between two nodes, and edges from block to block."""
    sizes = (3, 4, 2)
    nodes, edges, aliases = [], [], [[] for _ in sizes]

    def edge(a: int, b: int) -> ProblemEdge:
        na, nb = nodes[a].num_strategies, nodes[b].num_strategies
        sc = tuple(rng.randrange(2) for _ in range(na))
        dc = tuple(rng.randrange(3) for _ in range(nb))
        costs = tuple(tuple(rng.choice((0.0, 0.5, 1.25, 3.0)) for _ in range(3)) for _ in range(2))
        return ProblemEdge(a, b, sc, dc, costs)

    for blk in range(tied_blocks):
        base = len(nodes)
        for j, n in enumerate(sizes):
            nodes.append(ProblemNode(f"b{blk}n{j}", tuple(rng.uniform(0, 2) for _ in range(n))))
            aliases[j].append(base + j)
        edges += [edge(base, base + 1), edge(base, base + 1), edge(base + 1, base + 2)]
        if blk:
            edges.append(edge(base - 1, base))
    return ShardingProblem(tuple(nodes), tuple(edges), aliases=tuple(tuple(a) for a in aliases))


def _reduced_objective(red, choice) -> float:
    total = sum(red.unary[r][choice[r]] for r in red.reps)
    for u, v, sc, dc, mat in red.edges:
        total += mat[sc[choice[u]]][dc[choice[v]]]
    return total


def test_merged_classes_sorted_like_numpy_unique_rows():
    # Strategies' class tuples (0,0) (1,0) (1,1) (0,1): sorted keys and each one's index;
    # the third edge repeats the first's classes, so it reads the first position.
    keys, cls, cols = _merged_classes([(0, 1, 1, 0), (0, 0, 1, 1), (0, 1, 1, 0)])
    assert keys == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert cls == [0, 2, 3, 1]
    assert cols == [0, 1, 0]


def test_reduction_keeps_every_tied_choice_objective():
    rng = random.Random(7)
    for trial in range(20):
        p = _random_problem(rng, tied_blocks=1 + trial % 4)
        red = _reduce(p)
        for _ in range(20):
            pick = [rng.randrange(n) for n in (3, 4, 2)]
            choice = [pick[i % 3] for i in range(len(p.nodes))]
            rep_choice = {r: choice[r] for r in red.reps}
            assert math.isclose(
                _reduced_objective(red, rep_choice), p.objective(choice), rel_tol=1e-12
            )


def test_solve_finds_brute_force_optimum_of_tied_problem():
    rng = random.Random(3)
    p = _random_problem(rng, tied_blocks=3)
    best = min(
        p.objective([(a, b, c)[i % 3] for i in range(len(p.nodes))])
        for a in range(3)
        for b in range(4)
        for c in range(2)
    )
    sol = solve(p, time_limit_s=10)
    assert sol.status == "optimal"
    assert math.isclose(sol.objective, best, rel_tol=1e-9)
