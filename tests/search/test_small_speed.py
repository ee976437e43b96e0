"""The shortcuts that keep small searches fast change no answer.

* A rounded LP relaxation within ``LP_PROOF_GAP`` of the relaxation's optimum is returned
  as optimal without CP-SAT: on real sharding problems it is the optimum CP-SAT proves
  and HiGHS's MIP finds; where the relaxation is fractional CP-SAT still runs.
* A problem that nothing couples is solved by each node's cheapest strategy.
* The whole search (``plan_graph``) picks the same plan with or without the LP proof.

Expectations come from brute force over every choice, or from the other solvers.
"""

from __future__ import annotations

import itertools

import pytest

from autopar.options import SearchOptions
from autopar.search import solver
from autopar.search.intra_op import build_problem
from autopar.search.meshes import candidate_meshes
from autopar.search.planner import plan_graph
from autopar.search.problem import ProblemEdge, ProblemNode, ShardingProblem, SharedCost
from autopar.trace import trace
from cost_models import Cluster
from tests.search.models import mlp


def _brute_force(problem: ShardingProblem) -> float:
    counts = [n.num_strategies for n in problem.nodes]
    return min(
        problem.objective(c)
        for c in itertools.product(*(range(k) for k in counts))
        if problem.is_feasible(c)
    )


def _no_cpsat(*args, **kwargs):
    raise AssertionError("CP-SAT ran though the LP bound proves the rounded choice")


@pytest.fixture(scope="module")
def mlp_graph():
    step, args = mlp(64, 32, 128)
    return trace(step, *args)


@pytest.fixture(scope="module")
def mlp_problems(mlp_graph):
    cluster = Cluster.preset("dgx-a100-80gb")
    options = SearchOptions(axes=("data", "tensor", "seq"))
    return [
        build_problem(mlp_graph, cluster, mesh, options, 80e9).problem
        for mesh in candidate_meshes(8, options, mlp_graph)
    ]


def test_lp_proof_agrees_with_cpsat_and_highs(mlp_problems, monkeypatch):
    assert len(mlp_problems) >= 4  # 1-, 2- and 3-axis meshes
    proved = []
    for problem in mlp_problems:
        with monkeypatch.context() as m:
            m.setattr(solver, "LP_PROOF_GAP", -1.0)  # CP-SAT proves every one
            exact = solver.solve(problem, time_limit_s=60)
        mip = solver.solve(problem, time_limit_s=60, backend="highs")
        fast = solver.solve(problem, time_limit_s=60)
        assert exact.status == mip.status == fast.status == "optimal"
        assert fast.objective == pytest.approx(exact.objective, rel=1e-6)
        assert fast.objective == pytest.approx(mip.objective, rel=1e-6)
        assert fast.bound <= fast.objective
        assert fast.objective == pytest.approx(problem.objective(fast.choice))
        proved.append(fast.objective)
    # ... and on these problems the LP alone proves it: CP-SAT is never called.
    monkeypatch.setattr(solver, "_solve_cpsat", _no_cpsat)
    again = [solver.solve(ShardingProblem.from_json(p.to_json())) for p in mlp_problems]
    assert [s.objective for s in again] == pytest.approx(proved, rel=1e-6)


def _frustrated_triangle() -> ShardingProblem:
    # Three nodes, two strategies each, every edge costs 1 when its ends agree: an odd
    # cycle, so some edge always agrees (optimum 3 * 1 + 1 = 4), while the relaxation
    # puts every node at 1/2 and pays no edge (3).
    agree = ((1.0, 0.0), (0.0, 1.0))
    return ShardingProblem(
        nodes=tuple(ProblemNode(n, (1.0, 1.0)) for n in "abc"),
        edges=(
            ProblemEdge(0, 1, (0, 1), (0, 1), agree),
            ProblemEdge(1, 2, (0, 1), (0, 1), agree),
            ProblemEdge(0, 2, (0, 1), (0, 1), agree),
        ),
    )


def test_fractional_relaxation_still_runs_cpsat(monkeypatch):
    problem = _frustrated_triangle()
    assert _brute_force(problem) == 4.0
    cp = solver._presolve(problem, "cost")
    _, bound = solver._lp_rounded(problem, cp, 10.0)
    assert bound == pytest.approx(3.0)  # the relaxation is below every choice
    calls = []
    real = solver._solve_cpsat
    monkeypatch.setattr(solver, "_solve_cpsat", lambda *a: calls.append(1) or real(*a))
    sol = solver.solve(problem, time_limit_s=10)
    assert calls  # the LP proved nothing: CP-SAT ran
    assert sol.status == "optimal" and sol.objective == pytest.approx(4.0)


def test_uncoupled_problem_takes_each_nodes_cheapest(monkeypatch):
    # No edges, no shared costs, no memory: the optimum is each node's own minimum. An
    # edge whose producer has one layout is such a problem too (presolve folds it).
    problem = ShardingProblem(
        nodes=(
            ProblemNode("a", (3.0, 1.0, 2.0)),
            ProblemNode("b", (0.5, 0.7)),
            ProblemNode("c", (2.0,)),
        ),
        edges=(ProblemEdge(2, 1, (0,), (0, 1), ((4.0, 0.0),)),),
    )
    monkeypatch.setattr(solver, "_solve_cpsat", _no_cpsat)
    monkeypatch.setattr(solver, "_solve_highs", _no_cpsat)
    sol = solver.solve(problem)
    assert sol.status == "optimal"
    assert sol.choice == (1, 1, 0)
    assert sol.objective == pytest.approx(_brute_force(problem)) == pytest.approx(3.7)


def test_shared_costs_keep_the_solver(monkeypatch):
    # A shared cost couples the nodes though no edge does: not solved node by node.
    problem = ShardingProblem(
        nodes=(ProblemNode("a", (1.0, 1.5)), ProblemNode("b", (1.0, 1.5))),
        shared=(SharedCost("ar", 2.0, ((0, (0,)), (1, (0,)))),),
    )
    sol = solver.solve(problem)
    assert sol.status == "optimal"
    assert sol.objective == pytest.approx(_brute_force(problem)) == pytest.approx(3.0)
    assert sol.choice == (1, 1)


def test_plan_graph_picks_the_same_plan_without_the_lp_proof(mlp_graph, monkeypatch):
    cluster = Cluster.preset("dgx-a100-80gb")
    options = SearchOptions(axes=("data", "tensor", "seq"))
    fast = plan_graph(mlp_graph, cluster, options)
    monkeypatch.setattr(solver, "LP_PROOF_GAP", -1.0)
    exact = plan_graph(mlp_graph, cluster, options)
    assert dict(fast.mesh) == dict(exact.mesh)
    assert fast.predicted.step_time_s == pytest.approx(exact.predicted.step_time_s, rel=1e-6)
    assert fast.layers == exact.layers
    assert [c.label for c in fast.shortlist] == [c.label for c in exact.shortlist]


def test_an_equal_completion_is_solved_once(mlp_graph, monkeypatch):
    # The search completes one plan more than once (the planner's polish, the outer loop
    # pricing it as a stage, a user's evaluate): the second time is the first's result,
    # equal to a fresh solve; another plan, cluster or microbatching is solved anew.
    from autopar import baselines
    from autopar.search import evaluate

    cluster = Cluster.preset("dgx-a100-80gb")
    plan = plan_graph(mlp_graph, cluster, SearchOptions(mesh={"data": 2, "tensor": 4}))
    solves = []
    real = evaluate._solve_completion
    monkeypatch.setattr(
        evaluate, "_solve_completion", lambda *a, **k: solves.append(a[1]) or real(*a, **k)
    )
    ev = evaluate.evaluate_plan(mlp_graph, plan, cluster)  # the polish completed it
    assert solves == []
    assert ev.step_time_s == pytest.approx(plan.predicted.step_time_s, rel=1e-9)
    dp = baselines.data_parallel(mlp_graph, {"data": 8})
    first = evaluate.evaluate_plan(mlp_graph, dp, cluster)
    again = evaluate.evaluate_plan(mlp_graph, dp, cluster)
    assert len(solves) == 1 and again.step_time_s == first.step_time_s
    fresh = evaluate.decode(*_fresh(real, mlp_graph, dp, cluster))
    assert first.step_time_s == pytest.approx(fresh.step_time_s, rel=1e-9)
    other = Cluster.preset("dgx-h100")
    assert evaluate.evaluate_plan(mlp_graph, dp, other).step_time_s < first.step_time_s
    assert len(solves) == 2


def _fresh(real, graph, plan, cluster):
    bp, sol = real(graph, plan, cluster, 60.0, True)
    return bp, sol.choice


def test_flattening_is_memoised_per_graph_and_constraints(mlp_graph):
    from autopar.search.build.flatten import flatten

    assert flatten(mlp_graph) is flatten(mlp_graph)
    top = next(n.id for n in mlp_graph.nodes if n.phase == "backward")
    twice = flatten(mlp_graph, repeat={top: 2.0})
    assert twice is not flatten(mlp_graph) and twice is flatten(mlp_graph, repeat={top: 2.0})
    # the repeat shows: the node's op runs twice per step there, once here
    op = flatten(mlp_graph).node_ops[((), top)]
    assert flatten(mlp_graph).ops[op].weight == 1.0 and twice.ops[op].weight == 2.0
