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


def _scanned_remat_encoder(vocab=256, dim=64, depth=2, heads=4, batch=16, seq=32):
    """A BERT-like encoder as users write one: ``nn.scan`` over ``nn.remat`` blocks with
    the attention mask broadcast into the loop (it enters the forward and the
    backward loops as a loop input), a tied output embedding, AdamW."""
    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    import optax

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x, mask):
            h = nn.MultiHeadDotProductAttention(num_heads=heads)(x, x, mask=mask)
            x = nn.LayerNorm()(x + h)
            h = nn.Dense(dim)(nn.gelu(nn.Dense(4 * dim)(x)))
            return nn.LayerNorm()(x + h), None

    class Encoder(nn.Module):
        @nn.compact
        def __call__(self, ids, attention_mask):
            tok = nn.Embed(vocab, dim)
            x = tok(ids) + nn.Embed(seq, dim)(jnp.arange(seq)[None])
            x = nn.LayerNorm()(x)
            mask = nn.make_attention_mask(attention_mask, attention_mask)
            stack = nn.scan(
                nn.remat(Block), variable_axes={"params": 0}, split_rngs={"params": True},
                in_axes=nn.broadcast, length=depth,
            )  # fmt: skip
            x, _ = stack()(x, mask)
            return tok.attend(nn.LayerNorm()(nn.gelu(nn.Dense(dim)(x))))

    model = Encoder()
    tx = optax.adamw(1e-4, weight_decay=0.01)
    ids = jax.random.randint(jax.random.key(1), (batch, seq), 0, vocab)
    mask = jnp.ones((batch, seq), jnp.int32).at[:, seq - 8 :].set(0)
    params = model.init(jax.random.key(0), ids[:1], mask[:1])["params"]
    state = {"params": params, "opt_state": tx.init(params)}

    def step(state, batch):
        def loss_fn(p):
            logits = model.apply({"params": p}, batch["input_ids"], batch["attention_mask"])
            ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["input_ids"])
            return ce.mean()

        loss, grads = jax.value_and_grad(loss_fn)(state["params"])
        updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
        return {
            "params": optax.apply_updates(state["params"], updates),
            "opt_state": opt_state,
        }, loss

    return step, state, {"input_ids": ids, "attention_mask": mask}


def test_a_value_entering_a_scanned_remat_loop_is_not_gathered_every_iteration() -> None:
    """The mask enters the loops in whatever layout XLA gives it (a loop's inputs cannot
    be pinned); a pin inside the backward body on a value made from it reshards it on
    every iteration: three all-gathers in the HLO where the plan predicted one."""
    step, state, batch = _scanned_remat_encoder()
    f = autopar.autoparallel(step, cache=False, donate_argnums=0)
    plan, report = f.plan_for(state, batch), f.verify(state, batch)
    assert "data" in plan.mesh and any(c.axes == ("data",) for c in plan.predicted.collectives), (
        "the plan splits nothing over data: the case does not test a batch layout"
    )
    _assert_collectives_match(plan, report)
    gathers = report.row("all-gather")
    if gathers is not None:
        assert gathers.hlo_count == gathers.predicted_count, str(report)
