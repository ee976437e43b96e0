"""Fidelity of searched plans: what ``plan.predicted.collectives`` lists is what XLA emits.

For each case the step is planned by the search (nothing hand-made), lowered, and the
post-partitioning HLO compared with the prediction by :func:`autopar.verify.verify`: every
predicted kind appears, bytes per kind within ``BYTES_TOLERANCE`` (10%), no unplanned kind
above 1% of the step's collective bytes. The gradient all-reduce is also checked against a
hand count: a data-parallel step reduces every parameter gradient once, i.e. the parameter
bytes (the tied embedding twice), plus the float32 mean loss.
"""

from __future__ import annotations

import pytest

import autopar
from autopar.verify.report import BYTES_TOLERANCE
from benchmarks.models import gpt, mlp

GPT = gpt.GPTConfig(vocab_size=256, seq_len=64, hidden=128, layers=2, heads=4, precision="fp32")
GPT_BATCH = 16
MLP = mlp.MLPConfig(d_in=16, hidden=64, d_out=8, layers=2)
MLP_BATCH = 32
MESHES = ({"data": 8}, {"data": 2, "tensor": 4})


def _searched(step, state, batch, mesh):
    f = autopar.autoparallel(
        step,
        cluster="dgx-a100-80gb",
        options=autopar.SearchOptions(mesh=mesh),
        cache=False,
        donate_argnums=0,  # the memory model assumes the state is donated
    )
    return f.plan_for(state, batch), f.verify(state, batch)


def _assert_collectives_match(plan, report) -> None:
    predicted = {c.kind for c in plan.predicted.collectives}
    for kind in predicted:
        row = report.row(kind)
        assert row is not None and row.hlo_count > 0, f"{kind} predicted, not emitted"
        assert abs(row.bytes_error) <= BYTES_TOLERANCE, str(report)
    for row in report.rows:
        assert row.ok, str(report)


@pytest.mark.parametrize(
    "mesh",
    [MESHES[0], pytest.param(MESHES[1], marks=pytest.mark.slow)],  # ~20 s each on 2 cores
    ids=lambda m: "x".join(map(str, m.values())),
)
def test_searched_gpt_collectives_match_hlo(mesh) -> None:
    step, (state, batch) = gpt.make_train_step(GPT, GPT_BATCH, abstract=False)
    plan, report = _searched(step, state, batch, mesh)
    _assert_collectives_match(plan, report)
    assert report.ok, str(report)
    # Hand count: each fp32 parameter gradient is reduced once per step, the tied embedding
    # twice (its lookup and its logits use each reduce their own partial gradient before
    # the two are added), plus the mean loss.
    grad_bytes = 4 * (GPT.num_params() + GPT.vocab_size * GPT.hidden)
    grads = sum(c.bytes for c in plan.predicted.collectives if c.where == "dp_grad")
    assert grads == pytest.approx(grad_bytes, rel=0.01)
    assert report.row("all-reduce").hlo_bytes == pytest.approx(grad_bytes + 4, rel=0.01)


@pytest.mark.parametrize("mesh", MESHES, ids=lambda m: "x".join(map(str, m.values())))
def test_searched_mlp_collectives_match_hlo(mesh) -> None:
    step, (state, batch) = mlp.make_train_step(MLP, MLP_BATCH, abstract=False)
    plan, report = _searched(step, state, batch, mesh)
    _assert_collectives_match(plan, report)
    assert report.ok, str(report)
