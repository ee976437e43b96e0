"""Golden tests of the ILP solver: small problems whose optimum is worked out by hand
(or by brute force over every choice)."""

import inspect
import itertools
import random

import pytest

from autopar.errors import SolverTimeLimitWarning
from autopar.search import (
    MemoryConstraint,
    ProblemEdge,
    ProblemNode,
    ShardingProblem,
    SharedCost,
    solve,
)
from autopar.search.solver import _presolve, objective_lower_bound

BACKENDS = ["highs", "cpsat"]


def _chain(memory=(), limit=None):
    # A: (1, 3), B: (4, 1); moving between different layouts costs 10.
    return ShardingProblem(
        nodes=(ProblemNode("a", (1.0, 3.0)), ProblemNode("b", (4.0, 1.0))),
        edges=(ProblemEdge(0, 1, (0, 1), (0, 1), ((0.0, 10.0), (10.0, 0.0)), "a->b"),),
        memory=memory,
        memory_limit=limit,
    )


@pytest.mark.parametrize("backend", BACKENDS)
def test_chain_optimum(backend):
    # (0,0)=5, (0,1)=12, (1,0)=17, (1,1)=4.
    sol = solve(_chain(), backend=backend)
    assert sol.status == "optimal"
    assert sol.choice == (1, 1)
    assert sol.objective == pytest.approx(4.0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_memory_bound_flips_the_answer(backend):
    # Strategy 1 of each node holds 100 bytes, strategy 0 holds 10; at most 150 fit, so
    # (1,1) (200 B) is out and the best feasible choice is (0,0) = 5 s.
    mem = (MemoryConstraint("peak", 0.0, ((0, (10.0, 100.0)), (1, (10.0, 100.0)))),)
    assert solve(_chain(mem, None), backend=backend).choice == (1, 1)
    sol = solve(_chain(mem, 150.0), backend=backend)
    assert sol.choice == (0, 0)
    assert sol.objective == pytest.approx(5.0)
    assert sol.memory_bytes == pytest.approx(20.0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_infeasible_and_smallest_footprint(backend):
    mem = (MemoryConstraint("peak", 5.0, ((0, (10.0, 100.0)), (1, (10.0, 100.0)))),)
    problem = _chain(mem, 10.0)
    assert solve(problem, backend=backend).status == "infeasible"
    low = solve(problem, backend=backend, minimize="memory")
    assert low.choice == (0, 0)
    assert low.memory_bytes == pytest.approx(25.0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_smallest_footprint_across_two_moments(backend):
    # a's strategies trade moment 1 (10 B or 0) against moment 2 (0 or 8); b holds 5 B at
    # moment 2 either way. Each node's own fewest bytes (a: 8 < 10) gives peaks (0, 13):
    # 13. The other choice for a gives (10, 5): 10, the smallest footprint. So the
    # solve must look past the greedy start that proves the one-moment case at once.
    mem = (
        MemoryConstraint("m1", 0.0, ((0, (10.0, 0.0)), (1, (0.0, 0.0)))),
        MemoryConstraint("m2", 0.0, ((0, (0.0, 8.0)), (1, (5.0, 5.0)))),
    )
    low = solve(_chain(mem, 1.0), backend=backend, minimize="memory")
    assert low.choice[0] == 0
    assert low.memory_bytes == pytest.approx(10.0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_alias_forces_equal_choice(backend):
    # Alone: a picks 0 (1 s), b picks 1 (1 s). Aliased: (0,0)=4 beats (1,1)=6.
    nodes = (ProblemNode("param", (1.0, 5.0)), ProblemNode("state", (3.0, 1.0)))
    assert solve(ShardingProblem(nodes), backend=backend).choice == (0, 1)
    sol = solve(ShardingProblem(nodes, aliases=((0, 1),)), backend=backend)
    assert sol.choice == (0, 0)
    assert sol.objective == pytest.approx(4.0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_edge_classes_group_strategies(backend):
    # a's strategies 0 and 1 give the same layout (class 0); 2 gives class 1.
    # a0b0=2, a1b0=1, a2b0=3+7=10, a0b1=2+5=7, a1b1=6, a2b1=3 -> (1, 0) at 1 s.
    p = ShardingProblem(
        nodes=(ProblemNode("a", (2.0, 1.0, 3.0)), ProblemNode("b", (0.0, 0.0))),
        edges=(ProblemEdge(0, 1, (0, 0, 1), (0, 1), ((0.0, 5.0), (7.0, 0.0))),),
    )
    sol = solve(p, backend=backend)
    assert sol.choice == (1, 0)
    assert sol.objective == pytest.approx(1.0)


def _random_problem(rng: random.Random) -> ShardingProblem:
    n = rng.randint(3, 5)
    nodes = tuple(
        ProblemNode(f"n{i}", tuple(rng.uniform(0, 5) for _ in range(rng.randint(1, 3))))
        for i in range(n)
    )
    edges = []
    for _ in range(rng.randint(2, 6)):
        u, v = rng.sample(range(n), 2)
        su, sv = nodes[u].num_strategies, nodes[v].num_strategies
        src = tuple(rng.randrange(2) if su > 1 else 0 for _ in range(su))
        dst = tuple(rng.randrange(2) if sv > 1 else 0 for _ in range(sv))
        rows, cols = max(src) + 1, max(dst) + 1
        costs = tuple(
            tuple(rng.choice([0.0, rng.uniform(0, 8)]) for _ in range(cols)) for _ in range(rows)
        )
        edges.append(ProblemEdge(u, v, src, dst, costs))
    memory = (
        MemoryConstraint(
            "m",
            1.0,
            tuple(
                (i, tuple(rng.uniform(0, 10) for _ in range(nd.num_strategies)))
                for i, nd in enumerate(nodes)
            ),
        ),
    )
    return ShardingProblem(nodes, tuple(edges), memory, memory_limit=rng.uniform(15, 40))


@pytest.mark.parametrize("backend", BACKENDS)
def test_matches_brute_force_on_random_problems(backend):
    rng = random.Random(0)
    for _ in range(12):
        p = _random_problem(rng)
        choices = itertools.product(*(range(nd.num_strategies) for nd in p.nodes))
        feasible = [(p.objective(c), c) for c in choices if p.is_feasible(c)]
        sol = solve(p, backend=backend)
        if not feasible:
            assert sol.status == "infeasible"
            continue
        best = min(f for f, _ in feasible)
        assert sol.status == "optimal"
        assert sol.objective == pytest.approx(best, rel=1e-5, abs=1e-6)
        assert p.is_feasible(sol.choice)


def test_json_round_trip_replays_the_same_solve():
    mem = (MemoryConstraint("peak", 0.0, ((0, (10.0, 100.0)), (1, (10.0, 100.0)))),)
    p = _chain(mem, 150.0)
    q = ShardingProblem.from_json(p.to_json())
    assert q == p
    assert solve(q).choice == solve(p).choice == (0, 0)


def test_mismatched_alias_is_rejected():
    with pytest.raises(ValueError, match="alias group"):
        ShardingProblem((ProblemNode("a", (1.0,)), ProblemNode("b", (1.0, 2.0))), aliases=((0, 1),))


def test_cpsat_is_the_default_backend():
    assert inspect.signature(solve).parameters["backend"].default == "cpsat"


def _random_shared_problem(rng: random.Random) -> ShardingProblem:
    """Up to 4 nodes with up to 5 strategies, dense edges, an alias and shared costs."""
    n = rng.randint(3, 4)
    counts = [rng.randint(2, 5) for _ in range(n)]
    counts[1] = counts[0]  # nodes 0 and 1 may be aliased
    nodes = tuple(
        ProblemNode(f"n{i}", tuple(rng.uniform(0, 5) for _ in range(k)))
        for i, k in enumerate(counts)
    )
    edges = []
    for u, v in itertools.combinations(range(n), 2):
        if rng.random() < 0.7:
            src = tuple(rng.randrange(3) for _ in range(counts[u]))
            dst = tuple(rng.randrange(3) for _ in range(counts[v]))
            costs = tuple(
                tuple(rng.choice([0.0, rng.uniform(0, 6)]) for _ in range(max(dst) + 1))
                for _ in range(max(src) + 1)
            )
            edges.append(ProblemEdge(u, v, src, dst, costs))
    shared = tuple(
        SharedCost(
            f"s{k}",
            rng.uniform(0, 4),
            tuple((i, tuple(s for s in range(counts[i]) if rng.random() < 0.4)) for i in range(n)),
        )
        for k in range(2)
    )
    aliases = ((0, 1),) if rng.random() < 0.5 else ()
    return ShardingProblem(nodes, tuple(edges), aliases=aliases, shared=shared)


@pytest.mark.parametrize("backend", BACKENDS)
def test_shared_costs_and_presolve_match_brute_force(backend):
    # Dead-end elimination prunes these problems (dense edges, 2-5 strategies); whatever
    # it removes, the optimum must survive.
    rng = random.Random(1)
    for _ in range(15):
        p = _random_shared_problem(rng)
        choices = itertools.product(*(range(nd.num_strategies) for nd in p.nodes))
        best = min(p.objective(c) for c in choices if p.is_feasible(c))
        sol = solve(p, backend=backend)
        assert sol.status == "optimal"
        assert sol.objective == pytest.approx(best, rel=1e-6, abs=1e-6)


def test_shared_cost_is_paid_once():
    # Both nodes' strategy 1 joins the same combined collective (latency 3, paid once):
    # (1, 1) = 1 + 1 + 3 = 5, (1, 0) = 1 + 2 + 3 = 6, (0, 0) = 4 is the optimum.
    nodes = (ProblemNode("a", (2.0, 1.0)), ProblemNode("b", (2.0, 1.0)))
    shared = (SharedCost("ar", 3.0, ((0, (1,)), (1, (1,)))),)
    p = ShardingProblem(nodes, shared=shared)
    assert p.objective((1, 1)) == 5.0 and p.objective((1, 0)) == 6.0
    assert solve(p).choice == (0, 0)
    # Cheaper latency: (1, 1) = 1 + 1 + 1 = 3 beats (0, 0) = 4.
    cheap = ShardingProblem(nodes, shared=(SharedCost("ar", 1.0, shared[0].members),))
    assert solve(cheap).choice == (1, 1)
    assert ShardingProblem.from_json(cheap.to_json()) == cheap


def test_dead_end_elimination_drops_a_dominated_strategy():
    # b's strategies 0 and 2 give the same layout class, 2 costs more: 2 can never be
    # better whatever a picks (Goldstein: 3 - 1 + max_j(0) > 0). Strategy 1 (class 1)
    # survives: with a at 1 it avoids the edge cost of 4.
    p = ShardingProblem(
        nodes=(ProblemNode("a", (0.0, 0.5)), ProblemNode("b", (1.0, 1.5, 3.0))),
        edges=(ProblemEdge(0, 1, (0, 1), (0, 1, 0), ((0.0, 4.0), (4.0, 0.0))),),
    )
    cp = _presolve(p, "cost")
    assert list(cp.keep[1]) == [0, 1]
    assert solve(p).choice == (0, 0)


def test_lower_bound_from_presolve():
    # The chain: every node at its cheapest (1 + 1), the edge's row and column minima are
    # 0; the optimum (1, 1) costs 4.
    assert objective_lower_bound(_chain()) == pytest.approx(2.0)
    assert objective_lower_bound(_chain()) <= solve(_chain()).objective


def test_highs_writes_nothing_to_stdout(capfd):
    p = ShardingProblem.from_json(_chain().to_json())
    solve(p, backend="highs")
    solve(p, backend="cpsat")
    out, err = capfd.readouterr()
    assert out == "" and err == ""


def test_out_of_time_returns_the_starting_point(monkeypatch):
    # CP-SAT stopped by the time limit before any solution: the rounded-LP + local-search
    # start is still a valid choice. On the chain, local search from the LP lands on the
    # optimum (1, 1) = 4 s; it is reported as merely feasible (no proof).
    import autopar.search.solver as solver

    monkeypatch.setattr(solver, "_solve_cpsat", lambda *a, **k: (None, "unknown", 0.0))
    monkeypatch.setattr(solver, "LP_PROOF_GAP", -1.0)  # no proof from the LP bound either
    with pytest.warns(SolverTimeLimitWarning, match="best plan found so far"):
        sol = solve(_chain())
    assert sol.status == "feasible"
    assert sol.choice == (1, 1)
    assert sol.objective == pytest.approx(4.0)
    # ... unless the start breaks the memory bound: then there is no solution to give
    # (HiGHS's branch and bound, which small memory-bound problems get first, kept out).
    monkeypatch.setattr(solver, "MIP_FIRST_MAX_PAIRS", -1)
    mem = MemoryConstraint("m", 0.0, ((0, (10.0, 100.0)), (1, (10.0, 100.0))))
    sol = solve(_chain(memory=(mem,), limit=150.0))
    assert sol.status == "unknown" and sol.choice == ()


def test_small_memory_bound_problems_are_proved_by_highs_before_cp_sat(monkeypatch):
    # The memory-bound chain (the best that fits is (0, 0) = 5 s, by hand in
    # test_memory_bound_flips_the_answer) is proved by HiGHS's branch and bound: CP-SAT is
    # never called. Past MIP_FIRST_MAX_PAIRS, CP-SAT solves it.
    import autopar.search.solver as solver

    def no_cpsat(*a, **k):
        raise AssertionError("CP-SAT was called")

    mem = (MemoryConstraint("peak", 0.0, ((0, (10.0, 100.0)), (1, (10.0, 100.0)))),)
    monkeypatch.setattr(solver, "LP_PROOF_GAP", -1.0)  # the LP proves nothing here
    monkeypatch.setattr(solver, "_solve_cpsat", no_cpsat)
    sol = solve(_chain(mem, 150.0))
    assert (sol.status, sol.choice) == ("optimal", (0, 0))
    assert sol.objective == pytest.approx(5.0)
    monkeypatch.setattr(solver, "MIP_FIRST_MAX_PAIRS", -1)
    with pytest.raises(AssertionError, match="CP-SAT was called"):
        solve(_chain(mem, 150.0))


def test_a_prefetched_relaxation_is_the_one_solve_uses(monkeypatch):
    """The planner starts each mesh's LP relaxation on a background thread as soon as the
    mesh is built; ``solve`` must take that result up rather than run HiGHS again. Once
    the prefetched relaxation is done, HiGHS is made to fail: the chain's optimum (1, 1)
    = 4 (by hand, in test_chain_optimum) still comes back proved, from the prefetched
    relaxation, and CP-SAT is not called."""
    from autopar.search import solver

    problem = _chain()
    ahead = solver.prefetch_relaxation(problem, 10.0)
    picked, bound = ahead.result(timeout=60)
    assert bound == pytest.approx(4.0)

    def no_solver(*args, **kwargs):
        raise AssertionError("the prefetched relaxation should have been used")

    monkeypatch.setattr(solver, "_solve_highs", no_solver)
    monkeypatch.setattr(solver, "_solve_cpsat", no_solver)
    sol = solve(problem)
    assert (sol.choice, sol.status) == ((1, 1), "optimal")
    assert sol.objective == pytest.approx(4.0)
    # Taken once: a second solve of the same problem runs its own relaxation.
    with pytest.raises(AssertionError, match="prefetched"):
        solve(problem)


def test_a_relaxation_still_queued_is_run_by_the_solve_itself():
    """A prefetched relaxation that has not started when ``solve`` needs it (queued behind
    another problem's on the one background thread) is cancelled and run in the caller's
    thread, beside the other, instead of waiting for it."""
    import threading

    from autopar.search import solver

    gate = threading.Event()
    blocker = solver._LP_THREAD.submit(gate.wait, 60)  # occupies the background thread
    try:
        problem = _chain()
        ahead = solver.prefetch_relaxation(problem, 10.0)
        sol = solve(problem)
        assert ahead.cancelled()
        assert (sol.choice, sol.status) == ((1, 1), "optimal")
    finally:
        gate.set()
        blocker.result(timeout=60)


def test_a_relaxation_still_running_does_not_hold_up_the_end_of_a_script():
    """The background thread is a daemon: a relaxation still running when a script ends (a
    mesh the search skipped) is dropped, not waited for. A call that would block for two
    minutes is submitted, then the interpreter exits; it must be gone well before that."""
    import subprocess
    import sys
    import time

    script = (
        "import threading\n"
        "from autopar.search import solver\n"
        "started = threading.Event()\n"
        "solver._LP_THREAD.submit(lambda: (started.set(), threading.Event().wait(120)))\n"
        "assert started.wait(30)\n"
    )
    t0 = time.monotonic()
    subprocess.run([sys.executable, "-c", script], check=True, timeout=100)
    assert time.monotonic() - t0 < 60


def test_highs_matrix_is_compressed_by_column_with_repeated_entries_summed():
    import numpy as np

    from autopar.search.solver import _csc, _Lp

    # Two rows, three columns; (row 0, col 2) given twice (1.5 + 2.5), column 1 empty.
    lp = _Lp(
        cost=np.zeros(3), upper=np.ones(3),
        rows=np.array([1, 0, 0, 1, 0]), cols=np.array([0, 2, 0, 2, 2]),
        vals=np.array([7.0, 1.5, 3.0, 5.0, 2.5]),
        lo=np.zeros(2), hi=np.ones(2), x={}, num_x=0, scale=1.0,
    )  # fmt: skip
    start, index, value = _csc(lp)
    dense = np.zeros((2, 3))
    for c in range(3):
        for k in range(start[c], start[c + 1]):
            dense[index[k], c] += value[k]
    assert start.tolist() == [0, 2, 2, 4]
    assert dense.tolist() == [[3.0, 0.0, 4.0], [7.0, 0.0, 5.0]]
