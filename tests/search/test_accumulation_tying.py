"""Repeated layers inside a user's gradient-accumulation ``lax.scan`` are tied.

The accumulation loop's body runs the whole model once per microbatch; its layers are
found on the body graph (``Graph.accumulations``). :func:`autopar.search.build.coarsen.
tie_layers` ties them as it ties top-level layers, so the solver decides one block and
tiles the rest. Expected values come from the model, not from the tying code: every GPT
block makes 8 matmuls (q, k, v, out, fc_in, fc_out and attention's two contractions),
each one forward and two backward ``dot_general`` equations, which lead a group apiece,
and reads its parameter leaves (counted on the parameter pytree). Tying a block to the
first removes one free decision per such group. The plan must not change: the untied
problem (``tie_layers`` stubbed out) gives the same layouts and predicted step time, and
the tied plan still lowers to single-device ``jax.jit``'s numerics.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import autopar
import autopar.search.ilp as ilp
from autopar import SearchOptions
from autopar.lower import lower_plan
from autopar.search.costs import CostContext
from autopar.search.ilp import build
from autopar.search.problem import ShardingProblem
from autopar.trace import trace
from autopar.trace.graph import Graph
from cost_models import Cluster
from tests.lower._zoo import LOSS_RTOL, compare_params
from tests.lower.test_accumulation_scan import BATCH, EIGHT, M
from tests.lower.test_accumulation_scan import _case as lowered_case
from tests.trace.test_accumulation_scan import accumulating_step

MATMULS_PER_BLOCK = 8  # q, k, v, out, fc_in, fc_out, q @ k^T, softmax @ v
DOTS_PER_MATMUL = 3  # forward, and the backward products for each operand


@functools.cache
def _abstract(layers: int) -> tuple[Graph, int]:
    """The accumulating AdamW step of a tiny fp32 GPT with ``layers`` blocks (abstract
    arguments) and the number of parameter leaves in one block."""
    from benchmarks.models.gpt import GPT, GPTConfig, loss_fn

    cfg = GPTConfig.preset("tiny", precision="fp32", scan_layers=False, layers=layers)
    tokens = jnp.zeros((1, cfg.seq_len), jnp.int32)
    params = jax.eval_shape(lambda k: GPT(cfg).init(k, tokens), jax.random.key(0))["params"]
    tx = optax.adamw(1e-3)
    batch = {
        k: jax.ShapeDtypeStruct((BATCH, cfg.seq_len), jnp.int32) for k in ("tokens", "targets")
    }
    step = accumulating_step(functools.partial(loss_fn, cfg), tx, M)
    graph = trace(step, params, jax.eval_shape(tx.init, params), batch)
    return graph, len(jax.tree.leaves(params["h_1"]))


def _free(problem: ShardingProblem) -> int:
    """Decisions the solver makes: nodes, less the extra members of each alias set."""
    return len(problem.nodes) - sum(len(a) - 1 for a in problem.aliases)


def _untied(monkeypatch: pytest.MonkeyPatch) -> None:
    """Build problems without layer tying (the optimizer-state families stay)."""
    monkeypatch.setattr(ilp, "tie_layers", lambda *a, **k: [])


@pytest.mark.parametrize("layers", [2, 3])
@pytest.mark.parametrize("mesh", [{"data": 8}, {"data": 2, "tensor": 4}], ids=str)
def test_tied_body_layers_leave_one_block_of_decisions(layers, mesh, monkeypatch):
    graph, leaves_per_block = _abstract(layers)
    (acc,) = graph.accumulations
    assert graph.layers == ()  # every layer is inside the loop: only the body can tie
    assert len(graph.nodes[acc.node].body[0].layers) == layers
    ctx = CostContext(EIGHT, mesh)
    tied = build(graph, ctx).problem
    with monkeypatch.context() as m:
        _untied(m)
        untied = build(graph, ctx).problem
    assert len(tied.nodes) == len(untied.nodes)
    per_block = MATMULS_PER_BLOCK * DOTS_PER_MATMUL + leaves_per_block
    assert _free(untied) - _free(tied) == (layers - 1) * per_block


def _layouts(plan: autopar.Plan) -> tuple:
    acts = sorted(
        (tuple(map(tuple, c.scope)), c.node, -1 if c.operand is None else c.operand, c.spec)
        for c in plan.activations
    )
    return acts, sorted((r.path, r.spec) for r in plan.inputs), plan.mesh, plan.zero_stage


def test_tied_plan_is_the_untied_plan_and_lowers_to_single_device(monkeypatch):
    step, args, graph, plan = lowered_case()  # planned with tying
    with monkeypatch.context() as m:
        _untied(m)
        before = autopar.plan(step, *args, cluster=EIGHT, options=SearchOptions(mesh={"data": 8}))
    assert plan.predicted.step_time_s == pytest.approx(before.predicted.step_time_s, rel=1e-9)
    assert _layouts(plan) == _layouts(before)
    # What it splits: every forward matmul of the loop body making a
    # [microbatch, seq, features] value, its microbatch dim over the 8 'data' devices.
    (acc,) = graph.accumulations
    body = graph.nodes[acc.node].body[0]
    scope = ((acc.node, 0),)
    pins = {
        c.node: c.spec for c in plan.activations if tuple(c.scope) == scope and c.operand is None
    }
    dots = [
        n
        for layer in body.layers
        for n in (body.nodes[i] for i in layer.nodes)
        if n.primitive == "dot_general" and n.phase == "forward" and n.out_tensors[0].ndim == 3
    ]
    assert len(dots) == 2 * 6
    assert {pins[n.id][0] for n in dots} == {"data"}
    lowered = lower_plan(step, plan, args, graph=graph)
    got_params, got_opt, got_loss = lowered(*args)
    want_params, want_opt, want_loss = jax.jit(step)(*args)
    np.testing.assert_allclose(float(got_loss), float(want_loss), rtol=LOSS_RTOL)
    compare_params(got_params, want_params)
    compare_params(got_opt, want_opt)


def test_default_search_plan_is_unchanged_by_tying(monkeypatch):
    """The planner's own mesh search (it picks ``data`` x ``tensor`` here) lands on the
    same plan with and without tying the loop body's layers."""
    graph, _ = _abstract(2)
    cluster = Cluster.preset("dgx-a100-80gb")
    tied = autopar.plan(graph, cluster=cluster)
    with monkeypatch.context() as m:
        _untied(m)
        untied = autopar.plan(graph, cluster=cluster)
    assert tied.predicted.step_time_s == pytest.approx(untied.predicted.step_time_s, rel=1e-9)
    assert _layouts(tied) == _layouts(untied)
