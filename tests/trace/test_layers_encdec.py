"""Encoder-decoder and two-tower models: every repeated block of every stack is a layer.

Expected values come from the models' structure, not from the layer finder: a T5 stack of
``n`` blocks is ``n`` layers named ``encoder/block/{i}`` / ``decoder/block/{i}``; block 0
owns the relative position bias table (so it differs from block 1), and the matmul FLOPs of
a block follow from its shapes (``2 m k n`` per product).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest

from autopar.trace import trace
from benchmarks.models import t5
from benchmarks.models.precision import AdamW
from benchmarks.models.train_step import build_args, build_step_fn

B = 4


@pytest.fixture(scope="module")
def t5_graph():
    cfg = t5.T5Config.preset("tiny", layers=4, seq_len=32, target_len=16)
    step, args = t5.make_train_step(cfg, B)
    return cfg, trace(step, *args)


def test_t5_blocks_of_both_stacks_are_layers(t5_graph):
    cfg, g = t5_graph
    names = [layer.name for layer in g.layers]
    assert names == [f"encoder/block/{i}" for i in range(4)] + [
        f"decoder/block/{i}" for i in range(4)
    ]
    assert {layer.kind for layer in g.layers} == {"named"}
    enc, dec = g.layers[:4], g.layers[4:]
    # the middle blocks of a stack are identical; block 0 holds the bias table; the two
    # stacks differ (the decoder's blocks have cross-attention)
    assert enc[1].signature == enc[2].signature
    assert dec[1].signature == dec[2].signature
    assert enc[0].signature != enc[1].signature
    assert dec[0].signature != dec[1].signature
    assert enc[1].signature != dec[1].signature


def _matmul_flops(g, layer, phase="forward") -> float:
    return sum(
        g.nodes[i].flops
        for i in layer.nodes
        if g.nodes[i].phase == phase and g.nodes[i].primitive == "dot_general"
    )


def test_t5_layer_holds_its_whole_block(t5_graph):
    cfg, g = t5_graph
    d, inner, ff, a, dk = cfg.d_model, cfg.heads * cfg.d_kv, cfg.d_ff, cfg.heads, cfg.d_kv
    s, t = cfg.seq_len, cfg.target_len

    def attention(q_len: int, k_len: int) -> int:
        proj = 2 * B * q_len * d * inner * 2 + 2 * B * k_len * d * inner * 2  # q, o; k, v
        return proj + 2 * 2 * B * a * q_len * k_len * dk  # scores and probs @ v

    enc = attention(s, s) + 2 * 2 * B * s * d * ff
    dec = attention(t, t) + attention(t, s) + 2 * 2 * B * t * d * ff
    for layer in g.layers:
        want = enc if layer.name.startswith("encoder") else dec
        assert _matmul_flops(g, layer) == want, layer.name
        # the backward has two matmuls per forward one: dx and dW (dq and dk for scores)
        assert _matmul_flops(g, layer, "backward") == 2 * want, layer.name
    # outside the layers: the embedding lookups, the tied output projection and the loss
    lm_head = 2 * B * t * d * cfg.vocab_size
    outside = sum(n.flops for n in g.nodes if n.layer is None and n.primitive == "dot_general")
    assert outside == 3 * lm_head  # forward, dx and dW of the logits


def test_t5_optimizer_updates_join_their_block(t5_graph):
    _, g = t5_graph
    by_name = {layer.name: layer.index for layer in g.layers}
    consumers: dict[int, list] = {}
    for n in g.nodes:
        for v in n.inputs:
            consumers.setdefault(v, []).append(n)
    checked = 0
    for gi in g.inputs:
        # bf16 params are only cast; the fp32 master copy and Adam moments are updated
        if gi.role != "opt_state" or "/block/" not in gi.path:
            continue
        parts = gi.path.split("/")
        k = parts.index("block")
        want = by_name["/".join(parts[k - 1 : k + 2])]
        opt = [n for n in consumers.get(gi.value, []) if n.phase == "optimizer"]
        assert opt and all(n.layer == want for n in opt), gi.path
        checked += 1
    # master, mu and nu of every block leaf: an encoder block has q, k, v, o, wi, wo and
    # two RMS scales, a decoder block 4 + 1 more; block 0 of each stack the bias table
    assert checked == 3 * (4 * 8 + 4 * 13 + 2)


class _Block(nn.Module):
    width: int

    @nn.compact
    def __call__(self, x):
        return x + nn.Dense(self.width)(jax.nn.gelu(nn.Dense(2 * self.width)(x)))


class _Layers(nn.Module):
    """A numbered collection: ``<name>/0``, ``<name>/1``, ..."""

    n: int
    width: int

    @nn.compact
    def __call__(self, x):
        for i in range(self.n):
            x = _Block(self.width, name=str(i))(x)
        return x


class _TwoTower(nn.Module):
    """CLIP-like: a vision tower ``vis_{i}`` and a text tower ``text/layers/{i}`` of other
    widths, depths and naming schemes, joined by a contrastive-style product."""

    @nn.compact
    def __call__(self, image, text):
        v = nn.Dense(32, name="patch")(image)
        for i in range(3):
            v = _Block(32, name=f"vis_{i}")(v)
        w = nn.Dense(16, name="embed")(text)
        w = _Layers(2, 16, name="layers")(w)
        return nn.Dense(8, name="v_proj")(v) @ nn.Dense(8, name="t_proj")(w).T


def test_two_towers_with_different_naming_are_both_layers():
    model = _TwoTower()
    image, text = jnp.zeros((B, 24)), jnp.zeros((B, 12))
    opt = AdamW("fp32")

    def loss(params, model_state, batch, rng):
        logits = model.apply({"params": params}, batch["image"], batch["text"])
        labels = jnp.arange(logits.shape[0])
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean(), model_state

    spec = {"image": jax.ShapeDtypeStruct(image.shape, jnp.float32)}
    spec["text"] = jax.ShapeDtypeStruct(text.shape, jnp.float32)
    args = build_args(lambda k: model.init(k, image, text), opt, spec, None, abstract=True, seed=0)
    g = trace(build_step_fn(loss, opt), *args)
    assert [layer.name for layer in g.layers] == [
        "vis_0", "vis_1", "vis_2", "layers/0", "layers/1",
    ]  # fmt: skip
    sig = [layer.signature for layer in g.layers]
    assert sig[0] == sig[1] == sig[2] and sig[3] == sig[4] and sig[0] != sig[3]
