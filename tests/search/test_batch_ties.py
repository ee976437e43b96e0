"""Inputs of one batch get one layout (issue 15, item 6): a Hugging-Face-style step
taking ``{"input_ids", "attention_mask", "labels"}`` used to get ``attention_mask`` and
``labels`` over ``('data', 'tensor')`` and ``input_ids`` over ``data`` on a data x tensor
mesh (the mask and labels feed the attention and the loss, which the plan splits over
both axes; the ids feed the embedding lookup)."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

import autopar
from autopar.options import SearchOptions
from autopar.search.batch_ties import batch_input_sets
from cost_models import Cluster

V, S, H, B = 2048, 128, 256, 64


class _TinyLM(nn.Module):
    @nn.compact
    def __call__(self, ids, mask):
        x = nn.Embed(V, H)(ids)
        q, k, v = nn.Dense(H)(x), nn.Dense(H)(x), nn.Dense(H)(x)
        s = jnp.einsum("bqd,bkd->bqk", q, k) / H**0.5
        s = jnp.where(mask[:, None, :] > 0, s, -1e9)
        x = x + jnp.einsum("bqk,bkd->bqd", jax.nn.softmax(s), v)
        x = x + nn.Dense(H)(nn.gelu(nn.Dense(4 * H)(x)))
        return nn.Dense(V)(x)


def _hf_step():
    model, tx = _TinyLM(), optax.adamw(1e-3)

    def step(state, batch):
        def loss_fn(p):
            logits = model.apply(p, batch["input_ids"], batch["attention_mask"])
            ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"])
            m = batch["attention_mask"].astype(jnp.float32)
            return (ce * m).sum() / m.sum()

        loss, grads = jax.value_and_grad(loss_fn)(state["params"])
        updates, opt = tx.update(grads, state["opt"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates), "opt": opt}, loss

    ids = jax.ShapeDtypeStruct((B, S), jnp.int32)
    zeros = jnp.zeros((B, S), jnp.int32)
    params = jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), zeros, zeros))
    state = {"params": params, "opt": jax.eval_shape(tx.init, params)}
    return step, (state, {"input_ids": ids, "attention_mask": ids, "labels": ids})


def test_inputs_of_one_batch_share_their_layout():
    step, args = _hf_step()
    graph = autopar.trace(step, *args)
    (tied,) = batch_input_sets(graph)
    assert sorted(graph.inputs[i].path for i in tied) == [
        "batch/attention_mask",
        "batch/input_ids",
        "batch/labels",
    ]
    plan = autopar.plan(
        graph,
        cluster=Cluster.preset("dgx-a100-80gb"),
        options=SearchOptions(mesh={"data": 4, "tensor": 2}),
    )
    specs = {r.path: r.spec for r in plan.inputs if r.role == "batch"}
    assert len(set(specs.values())) == 1, specs
    # ... and the batch is split (64 examples over at least the 4-way data axis).
    (spec,) = set(specs.values())
    assert spec[0] is not None and "data" in ((spec[0],) if isinstance(spec[0], str) else spec[0])
