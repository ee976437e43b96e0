"""The ranked shortlist a plan carries (``Plan.shortlist``): candidates and why each lost."""

from __future__ import annotations

import json

import pytest

import autopar
from autopar import Candidate, Plan
from autopar.search import plan_graph
from autopar.search.shortlist import rank, unsolved
from cost_models import Cluster

GIB = 2**30


def _c(label, t, mem=1 * GIB, compute=1e-3, **comm):
    return Candidate(label, {"data": 8}, t, mem, compute, 0.0, comm)


def test_verdicts_name_what_grew_or_how_far_over():
    chosen = _c("a", 2e-3, dp_grad=1e-3)
    slower = _c("b", 3e-3, dp_grad=1e-3, tp_ar=2e-3)  # +50%, tensor all-reduce +2 ms
    over = _c("c", 1e-3, mem=3 * GIB)  # faster, but 1 GiB over a 2 GiB bound
    never = unsolved("d", {"tensor": 8}, "lower bound above the best step time")
    out = rank(chosen, [never, over, slower], memory_limit_bytes=2 * GIB)
    assert [c.label for c in out] == ["a", "b", "c", "d"]
    assert out[0].verdict == "chosen"
    assert out[1].verdict == "+50.0% step time: tp_ar +2000 us"
    assert out[2].verdict == "over the memory bound by 1 GiB (+50.0%)"
    assert out[3].verdict == "not solved: lower bound above the best step time"


def test_the_search_keeps_every_mesh_it_priced(mlp_graph):
    results = []
    plan = plan_graph(mlp_graph, Cluster.preset("dgx-a100-80gb"), results=results)
    short = plan.shortlist
    assert len(short) == len(results) >= 2
    assert short[0].verdict == "chosen" and short[0].mesh == plan.mesh
    assert short[0].step_time_s == pytest.approx(plan.predicted.step_time_s, rel=1e-12)
    solved = [c for c in short[1:] if c.step_time_s is not None]
    assert [c.step_time_s for c in solved] == sorted(c.step_time_s for c in solved)
    assert all(c.step_time_s >= short[0].step_time_s for c in solved)
    assert all(c.verdict for c in short)
    # Saved with the plan, and plans saved before the shortlist existed still load.
    again = Plan.from_json(plan.to_json())
    assert again.shortlist == short
    old = json.loads(plan.to_json())
    del old["shortlist"]
    assert Plan.from_dict(old).shortlist == ()
    assert "Candidates the search compared" in autopar.report.summary(plan)


@pytest.fixture(scope="module")
def mlp_graph():
    import jax
    import jax.numpy as jnp

    def step(w1, w2, x):
        def loss(w1, w2):
            return jnp.mean(jnp.tanh(x @ w1) @ w2)

        g1, g2 = jax.grad(loss, argnums=(0, 1))(w1, w2)
        return w1 - 0.1 * g1, w2 - 0.1 * g2

    return autopar.trace(step, jnp.ones((512, 2048)), jnp.ones((2048, 512)), jnp.ones((64, 512)))
