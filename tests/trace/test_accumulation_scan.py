"""A step that accumulates gradients itself (``lax.scan`` over microbatches) is understood.

Expected values are derived independently of the tracer: leaf counts of the parameter and
optimizer-state pytrees, the model's own layer names, and the plain (non-accumulating)
step traced on one microbatch, whose layers the accumulation loop's body must repeat.
"""

from __future__ import annotations

import functools
from collections import Counter

import jax
import jax.numpy as jnp
import optax
import pytest

from autopar.trace import trace
from autopar.trace.accumulate import find_accumulations

M = 4  # microbatches
BATCH = 32


@functools.cache
def _gpt(scan_layers: bool = False):
    """Tiny fp32 GPT (abstract): parameters, AdamW state, a token batch, the loss."""
    from benchmarks.models.gpt import GPT, GPTConfig, loss_fn

    cfg = GPTConfig.preset("tiny", precision="fp32", scan_layers=scan_layers)
    tokens = jnp.zeros((1, cfg.seq_len), jnp.int32)
    params = jax.eval_shape(lambda k: GPT(cfg).init(k, tokens), jax.random.key(0))["params"]
    tx = optax.adamw(1e-3)
    batch = {
        k: jax.ShapeDtypeStruct((BATCH, cfg.seq_len), jnp.int32) for k in ("tokens", "targets")
    }
    return params, tx, jax.eval_shape(tx.init, params), batch, functools.partial(loss_fn, cfg)


def accumulating_step(loss_fn, tx, m: int = M):
    """The train step users write: gradients summed over ``m`` microbatches by a scan."""

    def step(params, opt_state, batch):
        mbs = jax.tree.map(lambda x: x.reshape(m, -1, *x.shape[1:]), batch)

        def body(acc, mb):
            loss, g = jax.value_and_grad(loss_fn)(params, mb)
            return jax.tree.map(jnp.add, acc, g), loss

        grads, losses = jax.lax.scan(body, jax.tree.map(jnp.zeros_like, params), mbs)
        grads = jax.tree.map(lambda g: g / m, grads)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, losses.mean()

    return step


def plain_step(loss_fn, tx):
    def step(params, opt_state, batch):
        loss, g = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = tx.update(g, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step


@pytest.fixture(scope="module")
def gpt_graph():
    params, tx, opt_state, batch, loss = _gpt()
    return trace(accumulating_step(loss, tx), params, opt_state, batch)


def test_roles_of_an_accumulating_step(gpt_graph):
    params, _, opt_state, _, _ = _gpt()
    roles = Counter(i.role for i in gpt_graph.inputs)
    assert roles == {
        "param": len(jax.tree.leaves(params)),
        "opt_state": len(jax.tree.leaves(opt_state)),
        "batch": 2,
    }


def test_the_accumulation_loop_is_recognised(gpt_graph):
    params = _gpt()[0]
    n_params = len(jax.tree.leaves(params))
    (acc,) = gpt_graph.accumulations
    node = gpt_graph.nodes[acc.node]
    assert node.primitive == "scan" and node.length == M == acc.microbatches
    # The loop closes over every parameter and scans over both batch leaves.
    assert sorted(gi for _, gi in acc.params) == [
        i.index for i in gpt_graph.inputs if i.role == "param"
    ]
    assert sorted(gi for _, gi in acc.batch) == [
        i.index for i in gpt_graph.inputs if i.role == "batch"
    ]
    # One accumulator per parameter, each paired (through the update) with a distinct
    # parameter of its own shape.
    assert len(acc.accumulators) == n_params
    paired = [a.param for a in acc.accumulators]
    assert None not in paired and len(set(paired)) == n_params
    for a in acc.accumulators:
        assert gpt_graph.inputs[a.param].tensor.shape == a.shape
    # The body's inputs carry those roles; the accumulators are neither params nor data.
    body = node.body[0]
    assert Counter(i.role for i in body.inputs) == {
        "param": n_params,
        "batch": 2,
        "other": n_params,
    }
    assert body.inputs[acc.params[0][0]].path.endswith(gpt_graph.inputs[acc.params[0][1]].path)


def test_layers_inside_the_loop_match_the_plain_step_on_one_microbatch(gpt_graph):
    params, tx, opt_state, batch, loss = _gpt()
    micro = jax.tree.map(lambda x: jax.ShapeDtypeStruct((BATCH // M, *x.shape[1:]), x.dtype), batch)
    plain = trace(plain_step(loss, tx), params, opt_state, micro)
    assert [layer.name for layer in plain.layers] == ["h_0", "h_1"]  # the reference
    (acc,) = gpt_graph.accumulations
    body = gpt_graph.nodes[acc.node].body[0]
    assert acc.layers == len(body.layers) == 2
    assert [(layer.name, layer.kind) for layer in body.layers] == [
        ("h_0", "named"),
        ("h_1", "named"),
    ]
    # Structurally identical layers (the search solves one and tiles the other).
    assert body.layers[0].signature == body.layers[1].signature
    for got, want in zip(body.layers, plain.layers, strict=True):
        # Same forward and backward work per microbatch as the plain step's layer.
        assert got.forward_flops == pytest.approx(want.forward_flops, rel=1e-12)
        assert got.backward_flops == pytest.approx(want.backward_flops, rel=1e-12)
        # Node -> layer indices agree both ways.
        for nid in got.nodes:
            assert body.nodes[nid].layer == got.index
        phases = {body.nodes[nid].phase for nid in got.nodes}
        assert phases == {"forward", "backward"}
    # The top level has no model equations: no layer there to stage or remat.
    assert gpt_graph.layers == ()
    text = gpt_graph.summary()
    assert f"over {M} microbatches" in text and "h_0, h_1" in text


def test_scanned_layers_inside_the_loop_are_found():
    params, tx, opt_state, batch, loss = _gpt(scan_layers=True)
    g = trace(accumulating_step(loss, tx), params, opt_state, batch)
    (acc,) = g.accumulations
    body = g.nodes[acc.node].body[0]
    assert [(layer.name, layer.kind) for layer in body.layers] == [
        ("h[0]", "scan"),
        ("h[1]", "scan"),
    ]


def test_plain_jax_layers_inside_the_loop_are_found_by_repetition():
    sizes = [16, 32, 32, 32, 32, 4]
    params = [
        {
            "w": jax.ShapeDtypeStruct((a, b), jnp.float32),
            "b": jax.ShapeDtypeStruct((b,), jnp.float32),
        }
        for a, b in zip(sizes[:-1], sizes[1:], strict=True)
    ]
    tx = optax.adam(1e-3)

    def loss(p, b):
        h = b["x"]
        for layer in p[:-1]:
            h = jnp.tanh(h @ layer["w"] + layer["b"])
        return jnp.mean((h @ p[-1]["w"] + p[-1]["b"] - b["y"]) ** 2)

    batch = {
        "x": jax.ShapeDtypeStruct((32, 16), jnp.float32),
        "y": jax.ShapeDtypeStruct((32, 4), jnp.float32),
    }
    g = trace(accumulating_step(loss, tx), params, jax.eval_shape(tx.init, params), batch)
    (acc,) = g.accumulations
    layers = g.nodes[acc.node].body[0].layers
    assert {layer.kind for layer in layers} == {"repeat"}
    # Four tanh layers: the middle ones (32 -> 32) are identical.
    assert len(layers) == 4
    assert layers[1].signature == layers[2].signature


def test_scans_that_do_not_accumulate_gradients_are_left_alone():
    w = jax.ShapeDtypeStruct((8, 8), jnp.float32)
    xs = jax.ShapeDtypeStruct((4, 2, 8), jnp.float32)

    def forward_only(w, batch):  # scans the batch, no gradient
        return jax.lax.scan(lambda c, x: (c + jnp.tanh(x @ w).sum(), None), 0.0, batch)[0]

    def overwrite(w, batch):  # gradients in the loop, but the carry keeps the last one
        def body(c, x):
            return jax.grad(lambda w: jnp.tanh(x @ w).sum())(w), None

        g = jax.lax.scan(body, jnp.zeros_like(w), batch)[0]
        return w - 0.1 * g

    for fn in (forward_only, overwrite):
        g = trace(fn, w, xs)
        assert any(n.primitive == "scan" for n in g.nodes)
        assert g.accumulations == ()
        assert find_accumulations(g.nodes, g.inputs, g.outputs) == []


def test_global_norm_clipping_leaves_accumulators_unpaired():
    params, _, _, batch, loss = _gpt()
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))
    g = trace(accumulating_step(loss, tx), params, jax.eval_shape(tx.init, params), batch)
    (acc,) = g.accumulations
    # Every gradient reaches every parameter through the global norm: no unique pairing.
    assert len(acc.accumulators) == len(jax.tree.leaves(params))
    assert all(a.param is None for a in acc.accumulators)
    assert Counter(i.role for i in g.inputs)["param"] == len(jax.tree.leaves(params))
