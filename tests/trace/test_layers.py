"""Layers from Flax names, from scans over layers, and from structural repetition."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx

from autopar.trace import trace
from autopar.trace.layers import components

D, B, N = 16, 8, 4  # width, batch, blocks


class _Block(nn.Module):
    @nn.compact
    def __call__(self, x, _=None):
        y = nn.Dense(4 * D, name="fc")(nn.LayerNorm(name="ln_1")(x))
        return x + nn.Dense(D, name="proj")(jax.nn.gelu(y)), None


class _Net(nn.Module):
    scan: bool

    @nn.compact
    def __call__(self, x):
        x = nn.Dense(D, name="embed")(x)
        if self.scan:
            blocks = nn.scan(
                _Block, variable_axes={"params": 0}, split_rngs={"params": True}, length=N
            )
            x, _ = blocks(name="h")(x, None)
        else:
            for i in range(N):
                x, _ = _Block(name=f"h_{i}")(x)
        return nn.Dense(1, name="head")(x)


def _linen_step(scan: bool):
    model = _Net(scan)
    x = jax.ShapeDtypeStruct((B, 8), jnp.float32)
    params = jax.eval_shape(model.init, jax.random.PRNGKey(0), x)["params"]
    tx = optax.adamw(1e-3)
    state = {"params": params, "opt_state": jax.eval_shape(tx.init, params)}

    def step(state, batch):
        def loss(p):
            return jnp.mean((model.apply({"params": p}, batch["x"]) - batch["y"]) ** 2)

        value, grads = jax.value_and_grad(loss)(state["params"])
        updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        return {"params": params, "opt_state": opt_state}, value

    batch = {"x": x, "y": jax.ShapeDtypeStruct((B, 1), jnp.float32)}
    return step, (state, batch)


# per block: fc (D -> 4D) and proj (4D -> D) matmuls on B rows, forward
BLOCK_FWD_MM = 2 * B * D * 4 * D * 2


def _mm(graph, nodes, phase):
    total = 0.0
    for i in nodes:
        n = graph.nodes[i]
        if n.phase != phase:
            continue
        if n.primitive == "dot_general":
            total += n.flops
        for b in n.body:
            total += n.length * sum(m.flops for m in b if m.primitive == "dot_general")
    return total


def test_components_strip_transforms():
    assert components("transpose(jvp(GPT))/h_3/attn/q") == ["GPT", "h_3", "attn", "q"]
    assert components("jvp()") == [] and components("") == []


def test_named_layers_from_flax_linen():
    step, args = _linen_step(scan=False)
    g = trace(step, *args)
    assert [layer.name for layer in g.layers] == [f"h_{i}" for i in range(N)]
    assert {layer.kind for layer in g.layers} == {"named"}
    assert len({layer.signature for layer in g.layers}) == 1
    flops = {layer.flops for layer in g.layers}
    assert len(flops) == 1
    for layer in g.layers:
        assert _mm(g, layer.nodes, "forward") == BLOCK_FWD_MM
        assert _mm(g, layer.nodes, "backward") == 2 * BLOCK_FWD_MM
        # the optimizer's updates of this block's parameters are in the layer
        assert layer.optimizer_flops > 0
        opt = [g.nodes[i] for i in layer.nodes if g.nodes[i].phase == "optimizer"]
        assert opt and all(n.name_stack == "" for n in opt)
        assert all(g.nodes[i].layer == layer.index for i in layer.nodes)
        assert g.layer_of(min(layer.nodes)) is layer
    # program order: layer k's first node comes before layer k+1's
    firsts = [min(layer.nodes) for layer in g.layers]
    assert firsts == sorted(firsts)


def test_scan_layers_split_the_loops():
    step, args = _linen_step(scan=True)
    g = trace(step, *args)
    assert [layer.name for layer in g.layers] == [f"h[{i}]" for i in range(N)]
    assert [layer.iteration for layer in g.layers] == list(range(N))
    assert {layer.kind for layer in g.layers} == {"scan"}
    scans = [n for n in g if n.primitive == "scan"]
    fwd = next(n for n in scans if n.phase == "forward")
    bwd = next(n for n in scans if n.phase == "backward")
    layer = g.layers[0]
    assert fwd.id in layer.nodes and bwd.id in layer.nodes
    assert layer.forward_flops == pytest.approx(fwd.flops / N)
    assert layer.backward_flops == pytest.approx(bwd.flops / N)
    assert _mm(g, [fwd.id], "forward") == N * BLOCK_FWD_MM
    assert _mm(g, [bwd.id], "backward") == 2 * N * BLOCK_FWD_MM
    assert len({(x.flops, x.signature) for x in g.layers}) == 1
    # same model unrolled: the layers have (nearly) the same FLOPs
    step, args = _linen_step(scan=False)
    unrolled = trace(step, *args)
    assert layer.flops == pytest.approx(unrolled.layers[0].flops, rel=0.02)


class _NNXBlock(nnx.Module):
    def __init__(self, rngs):
        self.ln = nnx.LayerNorm(D, rngs=rngs)
        self.fc = nnx.Linear(D, 4 * D, rngs=rngs)
        self.proj = nnx.Linear(4 * D, D, rngs=rngs)

    def __call__(self, x):
        return x + self.proj(jax.nn.gelu(self.fc(self.ln(x))))


class _NNXNet(nnx.Module):
    def __init__(self, rngs):
        self.embed = nnx.Linear(8, D, rngs=rngs)
        self.blocks = nnx.List([_NNXBlock(rngs) for _ in range(N)])
        self.head = nnx.Linear(D, 1, rngs=rngs)

    def __call__(self, x):
        x = self.embed(x)
        for blk in self.blocks:
            x = blk(x)
        return self.head(x)


def test_repetition_layers_for_nnx():
    graphdef, params = nnx.split(nnx.eval_shape(lambda: _NNXNet(nnx.Rngs(0))), nnx.Param)
    tx = optax.adamw(1e-3)

    def step(params, opt_state, x, y):
        def loss(p):
            return jnp.mean((nnx.merge(graphdef, p)(x) - y) ** 2)

        value, grads = jax.value_and_grad(loss)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    x = jax.ShapeDtypeStruct((B, 8), jnp.float32)
    y = jax.ShapeDtypeStruct((B, 1), jnp.float32)
    g = trace(step, params, jax.eval_shape(tx.init, params), x, y)
    # nnx records no module names: only transforms
    assert {components(n.name_stack) == [] for n in g} == {True}
    assert len(g.layers) == N and {layer.kind for layer in g.layers} == {"repeat"}
    for layer in g.layers:
        assert _mm(g, layer.nodes, "forward") == BLOCK_FWD_MM
        assert _mm(g, layer.nodes, "backward") == 2 * BLOCK_FWD_MM
        assert layer.optimizer_flops > 0
    # interior blocks are identical; all blocks have the same matmul work
    assert g.layers[1].signature == g.layers[2].signature
    assert g.layers[1].flops == g.layers[2].flops


def test_repetition_layers_for_plain_jax_mlp():
    from benchmarks.models.mlp import MLPConfig, make_train_step

    cfg = MLPConfig.preset("tiny")  # 16 -> 64 -> 64 -> 8, three dense layers
    batch = 4
    step, args = make_train_step(cfg, batch)
    g = trace(step, *args)
    assert [layer.kind for layer in g.layers] == ["repeat"] * 3
    widths = [16, 64, 64, 8]
    for k, layer in enumerate(g.layers):
        fwd = 2 * batch * widths[k] * widths[k + 1]
        assert _mm(g, layer.nodes, "forward") == fwd
        # dW always; dx except for the first layer (the data is not differentiated)
        assert _mm(g, layer.nodes, "backward") == (fwd if k == 0 else 2 * fwd)
