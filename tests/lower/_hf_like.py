"""Models beyond the zoo, written as a new user would: ordinary Flax linen modules and an
optax AdamW step, nothing from ``benchmarks.models``.

* :class:`Llama`: RMSNorm, rotary position embeddings, causal multi-head attention without
  biases, SwiGLU MLP, untied output head (Touvron et al. 2023).
* :class:`GPTNeo`: learned absolute positions, LayerNorm, attention alternating global
  (causal) and local (causal within a window) layers, GELU MLP, tied output head
  (EleutherAI GPT-Neo).

Used by the memory-fidelity tests and benchmark (issue 14 item 4).

Example:
    >>> step, (state, batch) = llama_step(LikeConfig(hidden=64, layers=2), 8)  # doctest: +SKIP
    >>> new_state, loss = step(state, batch)  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax


@dataclasses.dataclass(frozen=True)
class LikeConfig:
    """Sizes of a Llama-like or GPT-Neo-like model (float32 throughout)."""

    vocab: int = 512
    seq: int = 128
    hidden: int = 512
    layers: int = 2
    heads: int = 8
    window: int = 32  # GPT-Neo's local attention window

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


class RMSNorm(nn.Module):
    eps: float = 1e-6

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        scale = self.param("scale", nn.initializers.ones, (x.shape[-1],))
        return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + self.eps) * scale


def _rotary(x: jax.Array) -> jax.Array:
    """Rotary embedding of ``x`` [batch, seq, heads, head_dim] (Su et al. 2021)."""
    _, s, _, d = x.shape
    inv = 1.0 / (10000.0 ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))
    ang = jnp.arange(s, dtype=jnp.float32)[:, None] * inv[None, :]
    cos, sin = jnp.cos(ang)[None, :, None, :], jnp.sin(ang)[None, :, None, :]
    x1, x2 = x[..., ::2], x[..., 1::2]
    return jnp.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1).reshape(x.shape)


def _attend(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(q.shape[-1]).astype(q.dtype)
    scores = jnp.where(mask[None, None], scores, jnp.finfo(scores.dtype).min)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v)


class LlamaBlock(nn.Module):
    cfg: LikeConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        c = self.cfg
        b, s, _ = x.shape
        h = RMSNorm(name="attn_norm")(x)
        q = nn.Dense(c.hidden, use_bias=False, name="q")(h).reshape(b, s, c.heads, c.head_dim)
        k = nn.Dense(c.hidden, use_bias=False, name="k")(h).reshape(b, s, c.heads, c.head_dim)
        v = nn.Dense(c.hidden, use_bias=False, name="v")(h).reshape(b, s, c.heads, c.head_dim)
        mask = jnp.tril(jnp.ones((s, s), bool))
        a = _attend(_rotary(q), _rotary(k), v, mask).reshape(b, s, c.hidden)
        x = x + nn.Dense(c.hidden, use_bias=False, name="o")(a)
        h = RMSNorm(name="mlp_norm")(x)
        ffn = 256 * -(-8 * c.hidden // 3 // 256)
        gate = nn.Dense(ffn, use_bias=False, name="gate")(h)
        up = nn.Dense(ffn, use_bias=False, name="up")(h)
        return x + nn.Dense(c.hidden, use_bias=False, name="down")(nn.silu(gate) * up)


class Llama(nn.Module):
    cfg: LikeConfig

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        c = self.cfg
        x = nn.Embed(c.vocab, c.hidden, name="embed")(tokens)
        for i in range(c.layers):
            x = LlamaBlock(c, name=f"layer_{i}")(x)
        return nn.Dense(c.vocab, use_bias=False, name="lm_head")(RMSNorm(name="norm")(x))


class NeoBlock(nn.Module):
    cfg: LikeConfig
    local: bool

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        c = self.cfg
        b, s, _ = x.shape
        h = nn.LayerNorm(name="ln_1")(x)
        q = nn.Dense(c.hidden, use_bias=False, name="q")(h).reshape(b, s, c.heads, c.head_dim)
        k = nn.Dense(c.hidden, use_bias=False, name="k")(h).reshape(b, s, c.heads, c.head_dim)
        v = nn.Dense(c.hidden, use_bias=False, name="v")(h).reshape(b, s, c.heads, c.head_dim)
        i, j = jnp.arange(s)[:, None], jnp.arange(s)[None, :]
        mask = (j <= i) & (i - j < c.window) if self.local else j <= i
        a = _attend(q, k, v, mask).reshape(b, s, c.hidden)
        x = x + nn.Dense(c.hidden, name="out")(a)
        h = nn.LayerNorm(name="ln_2")(x)
        h = nn.Dense(c.hidden, name="fc_out")(nn.gelu(nn.Dense(4 * c.hidden, name="fc_in")(h)))
        return x + h


class GPTNeo(nn.Module):
    cfg: LikeConfig

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        c = self.cfg
        wte = nn.Embed(c.vocab, c.hidden, name="wte")
        pos = self.param("wpe", nn.initializers.normal(0.02), (c.seq, c.hidden))
        x = wte(tokens) + pos[None, : tokens.shape[1]]
        for i in range(c.layers):
            x = NeoBlock(c, local=i % 2 == 1, name=f"h_{i}")(x)
        return wte.attend(nn.LayerNorm(name="ln_f")(x))


def _step(model: nn.Module, cfg: LikeConfig, batch_size: int) -> tuple[Callable, tuple]:
    opt = optax.adamw(1e-3, weight_decay=0.01)

    def loss_fn(params: Any, batch: dict[str, jax.Array]) -> jax.Array:
        logits = model.apply({"params": params}, batch["tokens"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()

    def step(state: dict[str, Any], batch: dict[str, jax.Array]) -> tuple[dict, jax.Array]:
        loss, grads = jax.value_and_grad(loss_fn)(state["params"], batch)
        updates, opt_state = opt.update(grads, state["opt_state"], state["params"])
        return {
            "params": optax.apply_updates(state["params"], updates),
            "opt_state": opt_state,
        }, loss

    key = jax.random.PRNGKey(0)
    params = model.init(key, jnp.zeros((1, cfg.seq), jnp.int32))["params"]
    state = {"params": params, "opt_state": opt.init(params)}
    tokens = jax.random.randint(key, (batch_size, cfg.seq + 1), 0, cfg.vocab)
    batch = {"tokens": tokens[:, :-1], "targets": tokens[:, 1:]}
    return step, (state, batch)


def llama_step(cfg: LikeConfig, batch_size: int) -> tuple[Callable, tuple]:
    """An AdamW train step of :class:`Llama` and concrete ``(state, batch)``."""
    return _step(Llama(cfg), cfg, batch_size)


def neo_step(cfg: LikeConfig, batch_size: int) -> tuple[Callable, tuple]:
    """An AdamW train step of :class:`GPTNeo` and concrete ``(state, batch)``."""
    return _step(GPTNeo(cfg), cfg, batch_size)
