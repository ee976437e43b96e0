"""GPT: a GPT-2 style pre-LN decoder-only transformer (Flax linen) with an AdamW step.

Architecture (Radford et al. 2019; Megatron-LM's GPT): token + learned position embeddings;
``layers`` blocks of ``x + Dropout(Attn(LN(x)))`` then ``x + Dropout(MLP(LN(x)))``; a final
LayerNorm; logits through the tied token embedding (``h @ wte.T``); softmax cross-entropy
averaged over tokens. Attention is causal multi-head with separate ``q``/``k``/``v`` Dense
projections (biases on), grouped-query when ``kv_heads < heads`` (k/v repeated to all
heads), scores by ``einsum("bqhd,bkhd->bhqk")`` and the softmax in float32. The MLP is
``fc_in -> gelu -> fc_out`` or SwiGLU (``silu(fc_gate(x)) * fc_in(x) -> fc_out``).

Parameter names read like ``GPT/h_0/attn/q`` (``scan_layers=False``) or ``GPT/h/attn/q``
with a leading layer axis (``scan_layers=True``, one ``nn.scan`` over the block).

Llama-shaped presets keep this GPT-2 block (LayerNorm, biases, learned positions) and only
borrow Llama's sizes, vocabulary and SwiGLU MLP: close enough in FLOPs and bytes for
planning, not a faithful Llama.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any, Literal, get_args

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from benchmarks.models.precision import AdamW, Precision, check_precision, compute_dtype
from benchmarks.models.presets import lookup_preset
from benchmarks.models.train_step import (
    StepFn,
    build_args,
    build_step_fn,
    random_token_batch,
    token_batch_spec,
)

Activation = Literal["gelu", "swiglu"]
ACTIVATIONS: tuple[str, ...] = get_args(Activation)

_INIT_STD = 0.02  # GPT-2 / Megatron initializer standard deviation


def _swiglu_ffn(hidden: int) -> int:
    # Llama's rule: 2/3 of 4h, rounded up to a multiple of 256.
    return 256 * math.ceil(8 * hidden / 3 / 256)


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    """Sizes and numerics of a GPT model.

    ``kv_heads`` defaults to ``heads`` (plain multi-head attention) and ``ffn_hidden`` to
    ``4 * hidden`` (gelu) or Llama's ``256 * ceil(8h/3/256)`` (swiglu); both are resolved
    in ``__post_init__`` so the fields always hold ints.

    Attributes:
        vocab_size: vocabulary size ``V``.
        seq_len: maximum (and batch) sequence length ``s``; sizes the position table.
        hidden: model width ``h``.
        layers: number of transformer blocks ``l``.
        heads: attention heads ``a``; must divide ``hidden``.
        kv_heads: key/value heads for grouped-query attention; must divide ``heads``.
        ffn_hidden: MLP inner width.
        activation: ``"gelu"`` or ``"swiglu"``.
        dropout: dropout rate on embeddings, attention probabilities and both residual
            branches (Megatron's placement); 0 disables it.
        scan_layers: ``nn.scan`` over the blocks (params get a leading layer axis).
        precision: ``"mixed"`` (bf16 params/compute, fp32 master + Adam) or ``"fp32"``.
        attention_chunk: ``None``: attention materialises the ``[b, heads, s, s]`` scores.
            An int: memory-efficient attention over key chunks of this many positions
            (:func:`chunked_attention`), what long-context training needs: the scores of
            one chunk at a time, recomputed in the backward pass. Must divide ``seq_len``;
            not with dropout.

    Example:
        >>> GPTConfig.preset("gpt2-small").ffn_hidden
        3072
        >>> GPTConfig.preset("tiny", layers=3).layers
        3
    """

    vocab_size: int
    seq_len: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int | None = None
    ffn_hidden: int | None = None
    activation: Activation = "gelu"
    dropout: float = 0.0
    scan_layers: bool = True
    precision: Precision = "mixed"
    attention_chunk: int | None = None

    def __post_init__(self) -> None:
        for name in ("vocab_size", "seq_len", "hidden", "layers", "heads"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive int")
        if self.activation not in ACTIVATIONS:
            raise ValueError(
                f"activation={self.activation!r} is not supported; use one of {ACTIVATIONS}"
            )
        check_precision(self.precision)
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout={self.dropout!r} must be in [0, 1)")
        if self.hidden % self.heads:
            raise ValueError(
                f"hidden={self.hidden} is not divisible by heads={self.heads}; pick heads "
                f"among the divisors of {self.hidden}"
            )
        if self.kv_heads is None:
            object.__setattr__(self, "kv_heads", self.heads)
        if self.kv_heads < 1 or self.heads % self.kv_heads:
            raise ValueError(
                f"kv_heads={self.kv_heads} must be a positive divisor of heads={self.heads}"
            )
        if self.ffn_hidden is None:
            ffn = 4 * self.hidden if self.activation == "gelu" else _swiglu_ffn(self.hidden)
            object.__setattr__(self, "ffn_hidden", ffn)
        if self.ffn_hidden < 1:
            raise ValueError(f"ffn_hidden={self.ffn_hidden} must be >= 1")
        if self.attention_chunk is not None:
            c = self.attention_chunk
            if not isinstance(c, int) or c < 1 or self.seq_len % c:
                raise ValueError(
                    f"attention_chunk={c!r} must be a positive divisor of seq_len={self.seq_len}"
                )
            if self.dropout > 0:
                raise ValueError(
                    "attention_chunk does not take attention dropout: set dropout=0.0 or "
                    "attention_chunk=None"
                )

    @property
    def head_dim(self) -> int:
        """Width of one attention head, ``hidden // heads``."""
        return self.hidden // self.heads

    def num_params(self) -> int:
        """Analytic parameter count (tied embeddings, biases, two LayerNorms per block).

        Example:
            >>> GPTConfig.preset("gpt2-small").num_params()
            124439808
        """
        h, f, kv = self.hidden, self.ffn_hidden, self.kv_heads * self.head_dim
        attn = (h * h + h) * 2 + (h * kv + kv) * 2  # q, out; k, v
        n_in = 2 if self.activation == "swiglu" else 1
        mlp = n_in * (h * f + f) + f * h + h
        block = attn + mlp + 4 * h  # ln_1, ln_2: scale + bias
        return self.vocab_size * h + self.seq_len * h + self.layers * block + 2 * h

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> GPTConfig:
        """A named configuration, with any field overridden.

        Raises:
            ValueError: ``name`` is not in :data:`GPT_PRESETS`.
        """
        return lookup_preset("GPT", GPT_PRESETS, name, overrides)


def _gpt(v: int, s: int, h: int, l: int, a: int, **kw: Any) -> GPTConfig:  # noqa: E741
    return GPTConfig(vocab_size=v, seq_len=s, hidden=h, layers=l, heads=a, **kw)


# Sources: GPT-2 (Radford et al. 2019, table 2; 12/16/20/25 heads as released);
# GPT-3 (Brown et al. 2020, table 2.1; 1.3B uses 16 heads of 128 and 13B hidden 5120,
# as the paper's own 24 heads / d_model 5140 do not divide); Megatron-LM 2021 table 1
# (V = 51200, s = 2048; ../shared/reference/megatron2021_table1.csv); Llama 2 / Llama 3.
GPT_PRESETS: dict[str, GPTConfig] = {
    "tiny": _gpt(256, 32, 64, 2, 4),
    # `autopar demo`: small enough for 8 simulated CPU devices; fp32, as it checks losses
    # against single-device jax.jit to 1e-5
    "demo": _gpt(512, 64, 128, 4, 4, precision="fp32"),
    "gpt2-small": _gpt(50257, 1024, 768, 12, 12),
    "gpt2-medium": _gpt(50257, 1024, 1024, 24, 16),
    "gpt2-large": _gpt(50257, 1024, 1280, 36, 20),
    "gpt2-xl": _gpt(50257, 1024, 1600, 48, 25),
    "gpt3-1.3b": _gpt(50257, 2048, 2048, 24, 16),
    "gpt3-2.7b": _gpt(50257, 2048, 2560, 32, 32),
    "gpt3-6.7b": _gpt(50257, 2048, 4096, 32, 32),
    "gpt3-13b": _gpt(50257, 2048, 5120, 40, 40),
    "gpt3-175b": _gpt(50257, 2048, 12288, 96, 96),
    "megatron-1.7b": _gpt(51200, 2048, 2304, 24, 24),
    "megatron-3.6b": _gpt(51200, 2048, 3072, 30, 32),
    "megatron-7.5b": _gpt(51200, 2048, 4096, 36, 32),
    "megatron-18.4b": _gpt(51200, 2048, 6144, 40, 48),
    "megatron-39.1b": _gpt(51200, 2048, 8192, 48, 64),
    "megatron-76.1b": _gpt(51200, 2048, 10240, 60, 80),
    "megatron-145.6b": _gpt(51200, 2048, 12288, 80, 96),
    "megatron-310.1b": _gpt(51200, 2048, 16384, 96, 128),
    "megatron-529.6b": _gpt(51200, 2048, 20480, 105, 128),
    "megatron-1t": _gpt(51200, 2048, 25600, 128, 160),
    "llama2-7b": _gpt(32000, 4096, 4096, 32, 32, ffn_hidden=11008, activation="swiglu"),
    "llama3-8b": _gpt(
        128256, 8192, 4096, 32, 32, kv_heads=8, ffn_hidden=14336, activation="swiglu"
    ),
}


def preset(name: str, **overrides: Any) -> GPTConfig:
    """:meth:`GPTConfig.preset` at module level, as the model registry (the
    ``autopar.models`` entry points, ``autopar trace gpt --preset NAME``) calls it."""
    return GPTConfig.preset(name, **overrides)


# ----------------------------------------------------------------------------- modules


def _normal(std: float) -> Callable[..., jax.Array]:
    return nn.initializers.normal(stddev=std)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def chunked_attention(q: jax.Array, k: jax.Array, v: jax.Array, chunk: int) -> jax.Array:
    """Causal softmax attention over key chunks, never holding more than one chunk's scores.

    FlashAttention's recurrence (Dao et al. 2022; Dao 2023, algorithms 1 and 2; the
    memory-efficient attention of Rabe & Staats 2021), written with ``lax.scan``: the
    forward pass keeps a running row maximum, normaliser and unnormalised output over the
    ``s / chunk`` key chunks and saves only ``q, k, v``, the output and the rows'
    log-sum-exp; the backward pass recomputes each chunk's scores from them. Memory is
    ``O(s)`` per head, not ``O(s^2)``; FLOPs are the full attention's (masked chunks are
    computed too) plus the recomputed scores. Scores and the softmax are float32; the
    result has ``q``'s dtype.

    Args:
        q, k, v: ``[batch, seq, heads, head_dim]`` (``k``/``v`` already repeated to all
            heads).
        chunk: key positions per step; divides ``seq``.

    Example:
        >>> q = k = v = jnp.ones((1, 4, 1, 2))
        >>> chunked_attention(q, k, v, 2).shape
        (1, 4, 1, 2)
    """
    return _flash_forward(q, k, v, chunk)[0]


_LOWEST = float(jnp.finfo(jnp.float32).min)


def _chunks(x: jax.Array, chunk: int) -> jax.Array:
    b, s, h, d = x.shape
    return x.reshape(b, s // chunk, chunk, h, d).swapaxes(0, 1)


def _chunk_scores(q: jax.Array, k_j: jax.Array, j: jax.Array, chunk: int) -> jax.Array:
    """``q k_j^T / sqrt(d)`` in float32, causally masked: ``[b, heads, s, chunk]``."""
    s, d = q.shape[1], q.shape[3]
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k_j).astype(jnp.float32) / math.sqrt(d)
    q_pos = jnp.arange(s, dtype=jnp.int32)
    k_pos = j * chunk + jnp.arange(chunk, dtype=jnp.int32)
    return jnp.where(q_pos[:, None] >= k_pos[None, :], scores, _LOWEST)


def _flash_forward(
    q: jax.Array, k: jax.Array, v: jax.Array, chunk: int
) -> tuple[jax.Array, jax.Array]:
    """``(out [b, s, heads, d], log-sum-exp [b, heads, s])``."""
    b, s, h, d = q.shape

    def step(carry, xs):
        acc, top, norm = carry  # [b, h, s, d], [b, h, s], [b, h, s]: float32
        k_j, v_j, j = xs
        scores = _chunk_scores(q, k_j, j, chunk)
        new_top = jnp.maximum(top, scores.max(axis=-1))
        probs = jnp.exp(scores - new_top[..., None])
        fade = jnp.exp(top - new_top)
        pv = jnp.einsum("bhqk,bkhd->bhqd", probs.astype(v.dtype), v_j).astype(jnp.float32)
        return (acc * fade[..., None] + pv, new_top, norm * fade + probs.sum(axis=-1)), None

    init = (
        jnp.zeros((b, h, s, d), jnp.float32),
        jnp.full((b, h, s), _LOWEST, jnp.float32),
        jnp.zeros((b, h, s), jnp.float32),
    )
    steps = (_chunks(k, chunk), _chunks(v, chunk), jnp.arange(s // chunk, dtype=jnp.int32))
    (acc, top, norm), _ = jax.lax.scan(step, init, steps)
    out = (acc / norm[..., None]).astype(q.dtype).transpose(0, 2, 1, 3)
    return out, top + jnp.log(norm)


def _flash_fwd(q, k, v, chunk):
    out, lse = _flash_forward(q, k, v, chunk)
    return out, (q, k, v, out, lse)


def _flash_bwd(chunk, res, d_out):
    q, k, v, out, lse = res
    b, s, h, d = q.shape
    # D_i = sum_d dO_i O_i: the softmax's backward term (FlashAttention-2, algorithm 2).
    dots = jnp.einsum("bqhd,bqhd->bhq", d_out.astype(jnp.float32), out.astype(jnp.float32))

    def step(dq, xs):
        k_j, v_j, j = xs
        probs = jnp.exp(_chunk_scores(q, k_j, j, chunk) - lse[..., None])
        dv_j = jnp.einsum("bhqk,bqhd->bkhd", probs.astype(d_out.dtype), d_out)
        dp = jnp.einsum("bqhd,bkhd->bhqk", d_out, v_j).astype(jnp.float32)
        ds = (probs * (dp - dots[..., None]) / math.sqrt(d)).astype(q.dtype)
        dq = dq + jnp.einsum("bhqk,bkhd->bqhd", ds, k_j).astype(jnp.float32)
        dk_j = jnp.einsum("bhqk,bqhd->bkhd", ds, q)
        return dq, (dk_j, dv_j)

    steps = (_chunks(k, chunk), _chunks(v, chunk), jnp.arange(s // chunk, dtype=jnp.int32))
    dq, (dk, dv) = jax.lax.scan(step, jnp.zeros(q.shape, jnp.float32), steps)

    def whole(x: jax.Array) -> jax.Array:
        return x.swapaxes(0, 1).reshape(b, s, h, d)

    return dq.astype(q.dtype), whole(dk).astype(k.dtype), whole(dv).astype(v.dtype)


chunked_attention.defvjp(_flash_fwd, _flash_bwd)


class CausalSelfAttention(nn.Module):
    """Causal (grouped-query) multi-head self-attention with q/k/v/out projections."""

    hidden: int
    heads: int
    kv_heads: int
    dropout: float
    out_init_std: float
    deterministic: bool = True
    dtype: Any = jnp.float32
    chunk: int | None = None

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        b, s, _ = x.shape
        d = self.hidden // self.heads

        def dense(features: int, name: str, std: float = _INIT_STD) -> nn.Dense:
            return nn.Dense(features, dtype=self.dtype, kernel_init=_normal(std), name=name)

        q = dense(self.heads * d, "q")(x).reshape(b, s, self.heads, d)
        k = dense(self.kv_heads * d, "k")(x).reshape(b, s, self.kv_heads, d)
        v = dense(self.kv_heads * d, "v")(x).reshape(b, s, self.kv_heads, d)
        if self.kv_heads < self.heads:
            # GQA: every group of heads // kv_heads query heads shares one k/v head.
            k = jnp.repeat(k, self.heads // self.kv_heads, axis=2)
            v = jnp.repeat(v, self.heads // self.kv_heads, axis=2)
        if self.chunk is not None:
            out = chunked_attention(q, k, v, self.chunk).reshape(b, s, self.heads * d)
            return dense(self.hidden, "out", self.out_init_std)(out)
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) / math.sqrt(d)
        causal = jax.lax.broadcasted_iota(jnp.int32, (s, s), 0) >= jax.lax.broadcasted_iota(
            jnp.int32, (s, s), 1
        )
        scores = jnp.where(causal, scores, jnp.finfo(jnp.float32).min)
        probs = jax.nn.softmax(scores, axis=-1).astype(self.dtype)
        if self.dropout > 0:
            probs = nn.Dropout(self.dropout, name="attn_drop")(probs, self.deterministic)
        out = jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, s, self.heads * d)
        return dense(self.hidden, "out", self.out_init_std)(out)


class FeedForward(nn.Module):
    """The position-wise MLP: gelu (``fc_in``, ``fc_out``) or SwiGLU (+ ``fc_gate``)."""

    hidden: int
    ffn_hidden: int
    activation: Activation
    out_init_std: float
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        def dense(features: int, name: str, std: float = _INIT_STD) -> nn.Dense:
            return nn.Dense(features, dtype=self.dtype, kernel_init=_normal(std), name=name)

        if self.activation == "swiglu":
            y = nn.silu(dense(self.ffn_hidden, "fc_gate")(x)) * dense(self.ffn_hidden, "fc_in")(x)
        else:
            y = nn.gelu(dense(self.ffn_hidden, "fc_in")(x))
        return dense(self.hidden, "fc_out", self.out_init_std)(y)


class Block(nn.Module):
    """One pre-LN transformer block; ``(x, _) -> (x, None)`` so ``nn.scan`` can carry it."""

    config: GPTConfig
    deterministic: bool = True

    @nn.compact
    def __call__(self, x: jax.Array, _: Any = None) -> tuple[jax.Array, None]:
        cfg = self.config
        dtype = compute_dtype(cfg.precision)
        # GPT-2 scales the init of projections into the residual stream by 1/sqrt(2l).
        out_std = _INIT_STD / math.sqrt(2 * cfg.layers)
        h = nn.LayerNorm(dtype=dtype, name="ln_1")(x)
        h = CausalSelfAttention(
            hidden=cfg.hidden,
            heads=cfg.heads,
            kv_heads=cfg.kv_heads,
            dropout=cfg.dropout,
            out_init_std=out_std,
            deterministic=self.deterministic,
            dtype=dtype,
            chunk=cfg.attention_chunk,
            name="attn",
        )(h)
        x = x + _dropout(cfg.dropout, self.deterministic, "attn_resid_drop")(h)
        h = nn.LayerNorm(dtype=dtype, name="ln_2")(x)
        h = FeedForward(cfg.hidden, cfg.ffn_hidden, cfg.activation, out_std, dtype, name="mlp")(h)
        x = x + _dropout(cfg.dropout, self.deterministic, "mlp_resid_drop")(h)
        return x, None


def _dropout(rate: float, deterministic: bool, name: str) -> Callable[[jax.Array], jax.Array]:
    if rate == 0:
        return lambda x: x
    drop = nn.Dropout(rate, name=name)
    return lambda x: drop(x, deterministic)


class GPT(nn.Module):
    """The GPT model: ``tokens int32[B, S] -> logits[B, S, V]`` (compute dtype)."""

    config: GPTConfig
    deterministic: bool = True

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        cfg = self.config
        dtype = compute_dtype(cfg.precision)
        wte = nn.Embed(
            cfg.vocab_size, cfg.hidden, dtype=dtype, embedding_init=_normal(_INIT_STD), name="wte"
        )
        wpe = nn.Embed(
            cfg.seq_len, cfg.hidden, dtype=dtype, embedding_init=_normal(_INIT_STD), name="wpe"
        )
        positions = jnp.arange(tokens.shape[1], dtype=jnp.int32)
        x = wte(tokens) + wpe(positions)[None]
        x = _dropout(cfg.dropout, self.deterministic, "embd_drop")(x)
        if cfg.scan_layers:
            blocks = nn.scan(
                Block,
                variable_axes={"params": 0},
                split_rngs={"params": True, "dropout": True},
                length=cfg.layers,
            )
            x, _ = blocks(cfg, self.deterministic, name="h")(x, None)
        else:
            for i in range(cfg.layers):
                x, _ = Block(cfg, self.deterministic, name=f"h_{i}")(x, None)
        x = nn.LayerNorm(dtype=dtype, name="ln_f")(x)
        return wte.attend(x)  # tied output projection: x @ wte.T


# ----------------------------------------------------------------------------- train step


def loss_fn(
    config: GPTConfig,
    params: Any,
    batch: dict[str, jax.Array],
    rng: jax.Array | None = None,
) -> jax.Array:
    """Mean next-token cross-entropy (float32) of ``params`` on ``batch``.

    With ``rng`` given (and ``config.dropout > 0``) dropout is on; without it the model runs
    deterministically.

    Example:
        >>> cfg = GPTConfig.preset("tiny", precision="fp32")
        >>> state, batch = make_train_step(cfg, 2, abstract=False)[1]
        >>> float(loss_fn(cfg, state["params"], batch)) > 0
        True
    """
    train = rng is not None and config.dropout > 0
    model = GPT(config, deterministic=not train)
    rngs = {"dropout": rng} if train else {}
    logits = model.apply({"params": params}, batch["tokens"], rngs=rngs)
    # Cross-entropy in float32 even under mixed precision (Megatron does the same).
    losses = optax.softmax_cross_entropy_with_integer_labels(
        logits.astype(jnp.float32), batch["targets"]
    )
    return jnp.mean(losses)


def batch_spec(config: GPTConfig, batch_size: int) -> dict[str, jax.ShapeDtypeStruct]:
    """Shapes of a token batch: ``{"tokens", "targets"}``, both ``int32[B, S]``."""
    return token_batch_spec(config.seq_len, batch_size)


def random_batch(config: GPTConfig, batch_size: int, key: jax.Array) -> dict[str, jax.Array]:
    """Uniform random tokens; targets are the tokens shifted left by one (next token)."""
    return random_token_batch(config.seq_len, config.vocab_size, batch_size, key)


def make_train_step(
    config: GPTConfig,
    batch_size: int,
    abstract: bool = True,
    seed: int = 0,
    *,
    learning_rate: float = 1e-3,
    weight_decay: float = 0.01,
) -> tuple[StepFn, tuple[dict[str, Any], dict[str, Any]]]:
    """An AdamW train step for ``config`` and its arguments ``(state, batch)``.

    Args:
        config: the model.
        batch_size: sequences per step.
        abstract: ``jax.ShapeDtypeStruct`` args (nothing allocated) or concrete arrays.
        seed: parameter init and batch seed; also the base of the dropout keys.
        learning_rate: AdamW learning rate.
        weight_decay: AdamW decoupled weight decay.

    Returns:
        ``(step_fn, (state, batch))`` with ``step_fn(state, batch) -> (new_state, loss)``.

    Example:
        >>> step, (state, batch) = make_train_step(GPTConfig.preset("gpt3-175b"), 8)
        >>> batch["tokens"]
        ShapeDtypeStruct(shape=(8, 2048), dtype=int32)
    """
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size} must be >= 1")
    optimizer = AdamW(config.precision, learning_rate, weight_decay)

    def loss(params, model_state, batch, rng):
        return loss_fn(config, params, batch, rng), model_state

    step_fn = build_step_fn(loss, optimizer, seed=seed, uses_rng=config.dropout > 0)
    tokens = jnp.zeros((1, config.seq_len), jnp.int32)
    # Init is traced once per call; with scan_layers it stays cheap even for 175B.
    args = build_args(
        lambda key: GPT(config).init(key, tokens),
        optimizer,
        batch_spec(config, batch_size),
        lambda key: random_batch(config, batch_size, key),
        abstract=abstract,
        seed=seed,
    )
    return step_fn, args


def make_accumulating_step(
    config: GPTConfig, batch_size: int, microbatches: int = 4
) -> tuple[Callable[..., Any], tuple[Any, Any, dict[str, jax.ShapeDtypeStruct]]]:
    """The train step a user writes to accumulate gradients (abstract arguments): plain
    ``optax.adamw``, gradients summed over ``microbatches`` by a ``lax.scan`` and averaged,
    one update. ``step(params, opt_state, batch) -> (params, opt_state, loss)``.

    Example:
        >>> step, (params, opt_state, batch) = make_accumulating_step(
        ...     GPTConfig.preset("tiny"), 8, microbatches=2)
        >>> jax.eval_shape(step, params, opt_state, batch)[2].shape
        ()
    """
    if batch_size % microbatches:
        raise ValueError(f"batch_size={batch_size} must divide into {microbatches} microbatches")
    tx = optax.adamw(1e-3)

    def step(params: Any, opt_state: Any, batch: dict[str, jax.Array]) -> tuple[Any, Any, Any]:
        mbs = jax.tree.map(lambda x: x.reshape(microbatches, -1, *x.shape[1:]), batch)

        def body(acc: Any, mb: dict[str, jax.Array]) -> tuple[Any, jax.Array]:
            loss, g = jax.value_and_grad(functools.partial(loss_fn, config))(params, mb)
            return jax.tree.map(jnp.add, acc, g), loss

        zeros = jax.tree.map(jnp.zeros_like, params)
        grads, losses = jax.lax.scan(body, zeros, mbs)
        grads = jax.tree.map(lambda g: g / microbatches, grads)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, losses.mean()

    tokens = jnp.zeros((1, config.seq_len), jnp.int32)
    params = jax.eval_shape(lambda k: GPT(config).init(k, tokens), jax.random.key(0))["params"]
    return step, (params, jax.eval_shape(tx.init, params), batch_spec(config, batch_size))
