"""The search's speed-ups change nothing: the CP-SAT model written into its proto equals
the one CP-SAT's modelling calls write, presolve is memoised per problem, and the cached
reshard routes price exactly as :func:`autopar.search.sharding.reshard_steps` walks."""

from __future__ import annotations

import gc
import itertools
import math

import numpy as np
import pytest

from autopar.options import SearchOptions
from autopar.search import solver
from autopar.search.costs import CostContext, _swapped_axes
from autopar.search.intra_op import build_problem
from autopar.search.meshes import candidate_meshes
from autopar.search.problem import MemoryConstraint, ProblemEdge, ProblemNode, ShardingProblem
from autopar.search.sharding import (
    Collective,
    enumerate_shardings,
    reshard_moves,
    reshard_steps,
    shards,
)
from autopar.trace import trace
from cost_models import Cluster
from tests.search.models import mlp


def _reference_model(problem, cp, minimize):
    """The CP-SAT model as the modelling calls build it (what ``_cpsat_model`` writes)."""
    from ortools.sat.python import cp_model

    model = cp_model.CpModel()
    x: dict[int, list] = {}
    for r, u in cp.unary.items():
        x[r] = [model.new_bool_var("") for _ in range(len(u))]
        model.add_exactly_one(x[r])
    scale = solver._objective_scale(cp)
    obj_vars, obj_coefs = [], []
    for r, u in cp.unary.items():
        for s, c in enumerate(u):
            w = round(float(c) * scale)
            if w:
                obj_vars.append(x[r][s])
                obj_coefs.append(w)
    for e in cp.edges:
        n_rows, n_cols = e.mat.shape
        a: list[list] = [[] for _ in range(n_rows)]
        b: list[list] = [[] for _ in range(n_cols)]
        for s, k in enumerate(e.src_cls):
            a[k].append(x[e.src][s])
        for s, k in enumerate(e.dst_cls):
            b[k].append(x[e.dst][s])
        y = [[model.new_bool_var("") for _ in range(n_cols)] for _ in range(n_rows)]
        for i in range(n_rows):
            model.add(cp_model.LinearExpr.sum(y[i]) == cp_model.LinearExpr.sum(a[i]))
        for j in range(n_cols):
            col = [y[i][j] for i in range(n_rows)]
            model.add(cp_model.LinearExpr.sum(col) == cp_model.LinearExpr.sum(b[j]))
        w = np.rint(e.mat * scale).astype(np.int64)
        for i, j in zip(*np.nonzero(w), strict=True):
            obj_vars.append(y[i][j])
            obj_coefs.append(int(w[i, j]))
    if minimize == "cost":
        for cost, masks in cp.shared:
            w = round(cost * scale)
            if not w:
                continue
            z = model.new_bool_var("")
            for r, m in masks.items():
                model.add(cp_model.LinearExpr.sum([x[r][s] for s in np.flatnonzero(m)]) <= z)
            obj_vars.append(z)
            obj_coefs.append(w)
    if cp.memory:
        unit = solver._memory_unit(cp, problem.memory_limit)
        peak = None
        if minimize == "memory":
            total = sum(abs(c) + sum(float(v.max()) for v in t.values()) for c, t in cp.memory)
            peak = model.new_int_var(0, int(total / unit) + 2, "peak")
        for const, terms in cp.memory:
            vs, cs = [], []
            for r, vec in terms.items():
                for s, bts in enumerate(vec):
                    k = math.ceil(bts / unit)
                    if k:
                        vs.append(x[r][s])
                        cs.append(k)
            expr = cp_model.LinearExpr.weighted_sum(vs, cs)
            if peak is not None:
                model.add(expr + math.ceil(const / unit) <= peak)
            elif problem.memory_limit is not None:
                model.add(expr <= math.floor(problem.memory_limit / unit - const / unit))
        if peak is not None:
            model.minimize(peak)
    if minimize == "cost":
        model.minimize(cp_model.LinearExpr.weighted_sum(obj_vars, obj_coefs))
    return model


def _hand_problem() -> ShardingProblem:
    # Three nodes, parallel and single-class edges, a shared cost and a binding memory row.
    m = ((0.0, 2.0, 5.0), (3.0, 0.0, 1.0))
    return ShardingProblem(
        nodes=(
            ProblemNode("a", (1.0, 2.0, 0.5)),
            ProblemNode("b", (2.0, 1.0, 3.0)),
            ProblemNode("c", (0.0, 0.2, 0.1)),
        ),
        edges=(
            ProblemEdge(0, 1, (0, 1, 1), (0, 1, 2), m),
            ProblemEdge(1, 2, (0, 0, 1), (1, 0, 1), ((0.0, 4.0), (4.0, 0.5))),
            ProblemEdge(0, 2, (0, 1, 0), (0, 1, 1), ((0.0, 1.5), (0.7, 0.0))),
        ),
        memory=(MemoryConstraint("t0", 1.0, ((0, (4.0, 2.0, 1.0)), (2, (3.0, 1.0, 2.0)))),),
        memory_limit=6.0,
    )


@pytest.fixture(scope="module")
def mlp_problems():
    step, args = mlp(64, 32, 128)
    graph = trace(step, *args)
    cluster = Cluster.preset("dgx-a100-80gb")
    options = SearchOptions(axes=("data", "tensor", "seq"))
    out = []
    for mesh in candidate_meshes(8, options, graph)[:2]:
        bp = build_problem(graph, cluster, mesh, options, 80e9)
        out.append(bp.problem)
        # Every moment constrained, under a bound some choices break.
        tight = bp.with_moments(range(0, 16, 3)).problem
        limit = 0.5 * tight.memory_usage((0,) * len(tight.nodes))
        out.append(ShardingProblem(**{**vars(tight), "memory_limit": limit}))
    return out


@pytest.mark.parametrize("minimize", ["cost", "memory"])
def test_cpsat_proto_equals_the_modelling_calls(mlp_problems, minimize):
    for problem in [_hand_problem(), *mlp_problems]:
        cp = solver._presolve(problem, minimize)
        proto, first, _ = solver._cpsat_model(problem, cp, minimize)
        assert str(proto) == str(_reference_model(problem, cp, minimize).proto)
        assert list(first) == list(cp.unary)


def test_presolve_is_memoised_per_problem():
    problem = _hand_problem()
    cp = solver._presolve(problem, "cost")
    assert solver._presolve(problem, "cost") is cp
    assert solver._presolve(problem, "memory") is not cp
    twin = ShardingProblem.from_json(problem.to_json())  # equal, but another object
    assert solver._presolve(twin, "cost") is not cp
    key = id(problem)
    del problem, cp
    gc.collect()
    assert key not in solver._PRESOLVED


def _reference_reshard(ctx, shape, dtype, src, dst):
    """``CostContext.reshard`` priced straight from ``reshard_steps``/``reshard_moves``."""
    if src == dst:
        return 0.0, ()
    colls = []
    prev = src
    for step in reshard_steps(shape, src, dst, ctx.mesh):
        a2a, gather, reorder = reshard_moves(shape, prev, step, ctx.mesh)
        total = math.prod(shape) * 4
        per_device = total / shards(prev, ctx.mesh)
        if a2a:
            colls.append(ctx.collective("all-to-all", per_device, a2a))
        swapped = _swapped_axes(prev, step)
        if reorder or swapped:
            nbytes = per_device if reorder else total / shards(step, ctx.mesh)
            p2p = ctx.collective("p2p", nbytes, ctx.mesh.order(set(reorder) | set(swapped)))
            colls.append(Collective("collective-permute", p2p.axes, p2p.nbytes, p2p.time_s))
        if gather:
            colls.append(ctx.collective("all-gather", per_device * ctx.mesh.prod(gather), gather))
        prev = step
    return sum(c.time_s for c in colls), tuple(colls)


@pytest.mark.parametrize("mesh", [{"d": 2, "f": 2, "e": 2}, {"d": 2, "e": 4}])
def test_cached_reshard_routes_price_as_reshard_steps(mesh):
    ctx = CostContext(Cluster.preset("dgx-a100-80gb"), mesh)
    # Shapes that some layouts divide and others do not, so steps are skipped.
    for shape in [(8, 8), (4, 6), (2, 16), (6, 4)]:
        specs = enumerate_shardings((8, 8), ctx.mesh)
        for src, dst in itertools.product(specs, specs):
            got = ctx.reshard(shape, "float32", src, dst)
            assert got == _reference_reshard(ctx, shape, "float32", src, dst), (shape, src, dst)


def test_solve_reads_its_answer_from_the_proto():
    sol = solver.solve(_hand_problem(), time_limit_s=10)
    best = min(
        (c for c in itertools.product(range(3), repeat=3) if _hand_problem().is_feasible(c)),
        key=_hand_problem().objective,
    )
    assert sol.status == "optimal"
    assert sol.objective == pytest.approx(_hand_problem().objective(best))
