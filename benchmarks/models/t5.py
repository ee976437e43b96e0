"""T5: an encoder-decoder transformer (Flax linen) laid out like Hugging Face's Flax T5.

Architecture (Raffel et al. 2020; ``transformers.models.t5.modeling_flax_t5``): one token
table ``shared`` embeds both the encoder's inputs and the decoder's (shifted) targets. Each
stack is ``layers`` blocks of pre-norm residual sub-layers with RMS LayerNorm (a scale, no
bias, no mean subtraction) and bias-free Dense projections:

* encoder block: ``x + SelfAttention(LN(x))``, then ``x + DenseReluDense(LN(x))``;
* decoder block: causal ``SelfAttention``, then ``EncDecAttention`` (queries from the
  decoder, keys and values from the encoder's output), then ``DenseReluDense``.

Attention logits are not scaled by ``1/sqrt(d_kv)`` (T5 folds that into the init) and get a
learned relative position bias: block 0 of each stack owns ``relative_attention_bias``
(``num_buckets`` x ``heads``, log-spaced buckets up to ``max_distance``, bidirectional in
the encoder, causal in the decoder) and passes the bias to every later block of its stack,
as T5 does. The feed-forward is ``wi -> relu -> wo`` or gated GELU (T5 v1.1:
``gelu(wi_0(x)) * wi_1(x) -> wo``). The output projection is the tied ``shared`` table
(with T5's ``d_model ** -0.5`` rescale) or an untied ``lm_head``. The loss is the mean
cross-entropy (float32) of the decoder's logits against ``targets``.

Parameter paths match Hugging Face's checkpoints, e.g.::

    shared/embedding
    encoder/block/0/layer/0/SelfAttention/relative_attention_bias/embedding
    encoder/block/3/layer/1/DenseReluDense/wi/kernel
    decoder/block/3/layer/1/EncDecAttention/k/kernel
    decoder/block/3/layer/2/layer_norm/weight
    decoder/final_layer_norm/weight
    lm_head/kernel                                   (untied presets only)

The batch is ``{"inputs": int32[B, S], "decoder_inputs": int32[B, T], "targets":
int32[B, T]}`` with ``decoder_inputs`` the targets shifted right behind token 0 (T5's
``decoder_start_token_id``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Literal, get_args

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from benchmarks.models.precision import AdamW, Precision, check_precision, compute_dtype
from benchmarks.models.presets import lookup_preset
from benchmarks.models.train_step import StepFn, build_args, build_step_fn

FeedForward = Literal["relu", "gated-gelu"]
FEED_FORWARDS: tuple[str, ...] = get_args(FeedForward)

_LN_EPS = 1e-6


@dataclasses.dataclass(frozen=True)
class T5Config:
    """Sizes and numerics of a T5 encoder-decoder.

    Attributes:
        vocab_size: vocabulary size ``V`` (shared by both stacks).
        seq_len: encoder input length ``S``.
        target_len: decoder length ``T``; defaults to ``seq_len``.
        d_model: model width.
        layers: encoder blocks.
        decoder_layers: decoder blocks; defaults to ``layers``.
        heads: attention heads.
        d_kv: width of one head (T5 does not require ``heads * d_kv == d_model``).
        d_ff: feed-forward inner width.
        feed_forward: ``"relu"`` (T5 1.0) or ``"gated-gelu"`` (T5 1.1).
        tie_embeddings: logits through ``shared`` (T5 1.0) or an untied ``lm_head``.
        num_buckets: relative position buckets.
        max_distance: distance beyond which all positions share the last bucket.
        dropout: dropout rate after every sub-layer and on embeddings; 0 disables it.
        precision: ``"mixed"`` (bf16 params/compute, fp32 master + Adam) or ``"fp32"``.

    Example:
        >>> T5Config.preset("t5-large").num_params()
        737668096
        >>> T5Config.preset("tiny", layers=3).decoder_layers
        3
    """

    vocab_size: int
    seq_len: int
    d_model: int
    layers: int
    heads: int
    d_kv: int
    d_ff: int
    target_len: int | None = None
    decoder_layers: int | None = None
    feed_forward: FeedForward = "relu"
    tie_embeddings: bool = True
    num_buckets: int = 32
    max_distance: int = 128
    dropout: float = 0.0
    precision: Precision = "mixed"

    def __post_init__(self) -> None:
        for name in ("vocab_size", "seq_len", "d_model", "layers", "heads", "d_kv", "d_ff"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive int")
        if self.target_len is None:
            object.__setattr__(self, "target_len", self.seq_len)
        if self.decoder_layers is None:
            object.__setattr__(self, "decoder_layers", self.layers)
        for name in ("target_len", "decoder_layers"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive int")
        if self.feed_forward not in FEED_FORWARDS:
            raise ValueError(
                f"feed_forward={self.feed_forward!r} is not supported; use one of {FEED_FORWARDS}"
            )
        if self.num_buckets < 4 or self.num_buckets % 2:
            raise ValueError(f"num_buckets={self.num_buckets} must be an even int >= 4")
        if self.max_distance <= self.num_buckets // 2:
            raise ValueError(
                f"max_distance={self.max_distance} must exceed num_buckets // 2 = "
                f"{self.num_buckets // 2}"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout={self.dropout!r} must be in [0, 1)")
        check_precision(self.precision)

    def num_params(self) -> int:
        """Analytic parameter count.

        Per encoder block: q, k, v, o (``4 d_model heads d_kv``), the feed-forward
        (``2`` or ``3`` matrices of ``d_model d_ff``) and two RMS scales; a decoder block
        adds ``EncDecAttention`` and a third scale. Block 0 of each stack adds
        ``num_buckets heads``; each stack ends in one RMS scale; the token table is
        ``V d_model`` (twice when the head is untied).

        Example:
            >>> T5Config.preset("t5-small").num_params()
            60506624
        """
        d, inner = self.d_model, self.heads * self.d_kv
        attn = 4 * d * inner
        ff = (3 if self.feed_forward == "gated-gelu" else 2) * d * self.d_ff
        enc = self.layers * (attn + ff + 2 * d)
        dec = self.decoder_layers * (2 * attn + ff + 3 * d)
        bias = 2 * self.num_buckets * self.heads
        embed = self.vocab_size * d * (1 if self.tie_embeddings else 2)
        return embed + enc + dec + bias + 2 * d

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> T5Config:
        """A named configuration, with any field overridden.

        Overriding ``layers`` (``seq_len``) also sets ``decoder_layers`` (``target_len``)
        when the preset has them equal and the override does not name them.

        Raises:
            ValueError: ``name`` is not in :data:`T5_PRESETS`.
        """
        base = T5_PRESETS.get(name)
        for enc, dec in (("layers", "decoder_layers"), ("seq_len", "target_len")):
            if base is not None and enc in overrides and dec not in overrides:
                if getattr(base, enc) == getattr(base, dec):
                    overrides = {**overrides, dec: overrides[enc]}
        return lookup_preset("T5", T5_PRESETS, name, overrides)


def _t5(v: int, s: int, d: int, l: int, a: int, kv: int, ff: int, **kw: Any) -> T5Config:  # noqa: E741
    return T5Config(vocab_size=v, seq_len=s, d_model=d, layers=l, heads=a, d_kv=kv, d_ff=ff, **kw)


# Sources: T5 1.0 (Raffel et al. 2020, table 14 and the released configs: small 60M,
# base 220M, large 770M with V = 32128, 512 tokens); T5 1.1 (google/t5-v1_1-*: gated GELU,
# untied head). "t5-1b" is t5-large's shape with T5 1.1's gated, untied layout and a 4096
# feed-forward: 0.97B parameters, the "~1B encoder-decoder" of autopar's benchmarks, at the
# 2048-token inputs and targets those benchmarks use.
T5_PRESETS: dict[str, T5Config] = {
    "tiny": _t5(256, 32, 64, 2, 4, 16, 128, num_buckets=8, max_distance=16),
    # fp32 so a lowered step can be checked against single-device jax.jit to 1e-5
    "demo": _t5(512, 64, 128, 2, 4, 32, 256, precision="fp32"),
    "t5-small": _t5(32128, 512, 512, 6, 8, 64, 2048),
    "t5-base": _t5(32128, 512, 768, 12, 12, 64, 3072),
    "t5-large": _t5(32128, 512, 1024, 24, 16, 64, 4096),
    "t5-v1_1-large": _t5(
        32128, 512, 1024, 24, 16, 64, 2816, feed_forward="gated-gelu", tie_embeddings=False
    ),
    "t5-1b": _t5(
        32128, 2048, 1024, 24, 16, 64, 4096, feed_forward="gated-gelu", tie_embeddings=False
    ),
}


def preset(name: str, **overrides: Any) -> T5Config:
    """:meth:`T5Config.preset` at module level (the ``autopar.models`` registry calls it)."""
    return T5Config.preset(name, **overrides)


# ----------------------------------------------------------------------------- modules


def relative_position_bucket(
    relative_position: jax.Array, bidirectional: bool, num_buckets: int, max_distance: int
) -> jax.Array:
    """T5's bucket of each ``key - query`` offset: exact below ``num_buckets // 4`` (half
    of them per direction when ``bidirectional``), log-spaced up to ``max_distance``.

    Example:
        >>> rel = jnp.array([-200, -3, 0, 3, 200])
        >>> relative_position_bucket(rel, True, 32, 128).tolist()
        [15, 3, 0, 19, 31]
        >>> relative_position_bucket(rel, False, 32, 128).tolist()
        [31, 3, 0, 0, 0]
    """
    buckets = jnp.zeros_like(relative_position)
    if bidirectional:
        num_buckets //= 2
        buckets = buckets + (relative_position > 0).astype(relative_position.dtype) * num_buckets
        relative_position = jnp.abs(relative_position)
    else:
        relative_position = -jnp.minimum(relative_position, 0)
    max_exact = num_buckets // 2
    is_small = relative_position < max_exact
    # log-spaced buckets; the max() only keeps log away from 0 where is_small wins anyway
    scaled = jnp.log(jnp.maximum(relative_position, 1).astype(jnp.float32) / max_exact)
    large = max_exact + (
        scaled / math.log(max_distance / max_exact) * (num_buckets - max_exact)
    ).astype(relative_position.dtype)
    large = jnp.minimum(large, num_buckets - 1)
    return buckets + jnp.where(is_small, relative_position, large)


class T5LayerNorm(nn.Module):
    """RMS LayerNorm: ``weight * x / sqrt(mean(x^2) + eps)``, statistics in float32."""

    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        weight = self.param("weight", nn.initializers.ones, (x.shape[-1],))
        x32 = x.astype(jnp.float32)
        var = jnp.mean(jnp.square(x32), axis=-1, keepdims=True)
        y = (x32 * jax.lax.rsqrt(var + _LN_EPS)).astype(self.dtype)
        return weight.astype(self.dtype) * y


class T5Attention(nn.Module):
    """Multi-head attention with bias-free q/k/v/o and an additive position bias.

    With ``has_relative_attention_bias`` it owns the bucketed bias table and computes the
    bias (``[1, heads, q, k]``, float32, the causal mask folded in when ``causal``);
    otherwise it uses the ``position_bias`` it is given. Returns ``(out, bias)``.
    """

    config: T5Config
    causal: bool = False
    has_relative_attention_bias: bool = False
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(
        self, x: jax.Array, kv: jax.Array | None = None, position_bias: jax.Array | None = None
    ) -> tuple[jax.Array, jax.Array | None]:
        cfg = self.config
        a, dk, d = cfg.heads, cfg.d_kv, cfg.d_model
        kv = x if kv is None else kv
        b, q_len, _ = x.shape
        k_len = kv.shape[1]

        def dense(features: int, name: str, std: float) -> nn.Dense:
            init = nn.initializers.normal(stddev=std)
            return nn.Dense(features, use_bias=False, dtype=self.dtype, kernel_init=init, name=name)

        # Mesh-TensorFlow's init, as Hugging Face's T5 uses it (no 1/sqrt(d_kv) in logits).
        q = dense(a * dk, "q", (d * dk) ** -0.5)(x).reshape(b, q_len, a, dk)
        k = dense(a * dk, "k", d**-0.5)(kv).reshape(b, k_len, a, dk)
        v = dense(a * dk, "v", d**-0.5)(kv).reshape(b, k_len, a, dk)
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32)
        if self.has_relative_attention_bias:
            position_bias = self._bias(q_len, k_len)
        if position_bias is not None:
            scores = scores + position_bias
        probs = jax.nn.softmax(scores, axis=-1).astype(self.dtype)
        out = jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, q_len, a * dk)
        return dense(d, "o", (a * dk) ** -0.5)(out), position_bias

    def _bias(self, q_len: int, k_len: int) -> jax.Array:
        cfg = self.config
        table = nn.Embed(
            cfg.num_buckets,
            cfg.heads,
            embedding_init=nn.initializers.normal(stddev=cfg.d_model**-0.5),
            name="relative_attention_bias",
        )
        context = jax.lax.broadcasted_iota(jnp.int32, (q_len, k_len), 0)
        memory = jax.lax.broadcasted_iota(jnp.int32, (q_len, k_len), 1)
        buckets = relative_position_bucket(
            memory - context, not self.causal, cfg.num_buckets, cfg.max_distance
        )
        bias = jnp.transpose(table(buckets).astype(jnp.float32), (2, 0, 1))[None]
        if self.causal:
            bias = jnp.where(memory >= context + 1, jnp.finfo(jnp.float32).min, bias)
        return bias


class T5LayerSelfAttention(nn.Module):
    """``x + SelfAttention(layer_norm(x))``; returns ``(x, position_bias)``."""

    config: T5Config
    causal: bool
    has_relative_attention_bias: bool
    deterministic: bool = True
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array, position_bias: jax.Array | None):
        h = T5LayerNorm(self.dtype, name="layer_norm")(x)
        h, position_bias = T5Attention(
            self.config,
            causal=self.causal,
            has_relative_attention_bias=self.has_relative_attention_bias,
            dtype=self.dtype,
            name="SelfAttention",
        )(h, position_bias=position_bias)
        return x + _dropout(self.config.dropout, self.deterministic)(h), position_bias


class T5LayerCrossAttention(nn.Module):
    """``x + EncDecAttention(layer_norm(x), encoder_hidden)`` (no position bias)."""

    config: T5Config
    deterministic: bool = True
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array, encoder_hidden: jax.Array) -> jax.Array:
        h = T5LayerNorm(self.dtype, name="layer_norm")(x)
        h, _ = T5Attention(self.config, dtype=self.dtype, name="EncDecAttention")(h, encoder_hidden)
        return x + _dropout(self.config.dropout, self.deterministic)(h)


class T5DenseReluDense(nn.Module):
    """``wo(relu(wi(x)))`` or, gated, ``wo(gelu(wi_0(x)) * wi_1(x))``."""

    config: T5Config
    deterministic: bool = True
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        cfg = self.config

        def dense(features: int, name: str, fan_in: int) -> nn.Dense:
            init = nn.initializers.normal(stddev=fan_in**-0.5)
            return nn.Dense(features, use_bias=False, dtype=self.dtype, kernel_init=init, name=name)

        if cfg.feed_forward == "gated-gelu":
            h = nn.gelu(dense(cfg.d_ff, "wi_0", cfg.d_model)(x)) * dense(
                cfg.d_ff, "wi_1", cfg.d_model
            )(x)
        else:
            h = nn.relu(dense(cfg.d_ff, "wi", cfg.d_model)(x))
        h = _dropout(cfg.dropout, self.deterministic)(h)
        return dense(cfg.d_model, "wo", cfg.d_ff)(h)


class T5LayerFF(nn.Module):
    """``x + DenseReluDense(layer_norm(x))``."""

    config: T5Config
    deterministic: bool = True
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        h = T5LayerNorm(self.dtype, name="layer_norm")(x)
        h = T5DenseReluDense(self.config, self.deterministic, self.dtype, name="DenseReluDense")(h)
        return x + _dropout(self.config.dropout, self.deterministic)(h)


class T5Block(nn.Module):
    """The sub-layers of one block, named ``"0"``, ``"1"`` (decoder), ``"2"``."""

    config: T5Config
    causal: bool
    has_relative_attention_bias: bool
    deterministic: bool = True
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(
        self, x: jax.Array, position_bias: jax.Array | None, encoder_hidden: jax.Array | None
    ) -> tuple[jax.Array, jax.Array | None]:
        cfg, det, dt = self.config, self.deterministic, self.dtype
        x, position_bias = T5LayerSelfAttention(
            cfg, self.causal, self.has_relative_attention_bias, det, dt, name="0"
        )(x, position_bias)
        ff = "1"
        if self.causal:
            x = T5LayerCrossAttention(cfg, det, dt, name="1")(x, encoder_hidden)
            ff = "2"
        return T5LayerFF(cfg, det, dt, name=ff)(x), position_bias


class T5LayerCollection(nn.Module):
    """One numbered block (``block/3``) holding its :class:`T5Block` as ``layer``."""

    config: T5Config
    causal: bool
    has_relative_attention_bias: bool
    deterministic: bool = True
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x, position_bias, encoder_hidden):
        return T5Block(
            self.config,
            self.causal,
            self.has_relative_attention_bias,
            self.deterministic,
            self.dtype,
            name="layer",
        )(x, position_bias, encoder_hidden)


class T5BlockCollection(nn.Module):
    """The numbered blocks ``0 .. n - 1``; block 0 computes the position bias for all."""

    config: T5Config
    causal: bool
    deterministic: bool = True
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array, encoder_hidden: jax.Array | None = None) -> jax.Array:
        n = self.config.decoder_layers if self.causal else self.config.layers
        position_bias = None
        for i in range(n):
            x, position_bias = T5LayerCollection(
                self.config, self.causal, i == 0, self.deterministic, self.dtype, name=str(i)
            )(x, position_bias, encoder_hidden)
        return x


class T5Stack(nn.Module):
    """Embedded tokens -> dropout -> ``block`` -> ``final_layer_norm`` -> dropout."""

    config: T5Config
    causal: bool
    deterministic: bool = True
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array, encoder_hidden: jax.Array | None = None) -> jax.Array:
        drop = _dropout(self.config.dropout, self.deterministic)
        x = T5BlockCollection(
            self.config, self.causal, self.deterministic, self.dtype, name="block"
        )(drop(x), encoder_hidden)
        return drop(T5LayerNorm(self.dtype, name="final_layer_norm")(x))


def _dropout(rate: float, deterministic: bool):
    if rate == 0:
        return lambda x: x
    drop = nn.Dropout(rate)
    return lambda x: drop(x, deterministic)


class T5(nn.Module):
    """``(inputs int32[B, S], decoder_inputs int32[B, T]) -> logits[B, T, V]``."""

    config: T5Config
    deterministic: bool = True

    @nn.compact
    def __call__(self, inputs: jax.Array, decoder_inputs: jax.Array) -> jax.Array:
        cfg = self.config
        dtype = compute_dtype(cfg.precision)
        shared = nn.Embed(
            cfg.vocab_size,
            cfg.d_model,
            dtype=dtype,
            embedding_init=nn.initializers.normal(stddev=1.0),
            name="shared",
        )
        encoded = T5Stack(cfg, False, self.deterministic, dtype, name="encoder")(shared(inputs))
        h = T5Stack(cfg, True, self.deterministic, dtype, name="decoder")(
            shared(decoder_inputs), encoded
        )
        if cfg.tie_embeddings:
            return shared.attend(h * cfg.d_model**-0.5)
        init = nn.initializers.normal(stddev=cfg.d_model**-0.5)
        return nn.Dense(
            cfg.vocab_size, use_bias=False, dtype=dtype, kernel_init=init, name="lm_head"
        )(h)


# ----------------------------------------------------------------------------- train step


def loss_fn(
    config: T5Config, params: Any, batch: dict[str, jax.Array], rng: jax.Array | None = None
) -> jax.Array:
    """Mean cross-entropy (float32) of the decoder's logits against ``batch["targets"]``.

    Example:
        >>> cfg = T5Config.preset("tiny", precision="fp32")
        >>> state, batch = make_train_step(cfg, 2, abstract=False)[1]
        >>> abs(float(loss_fn(cfg, state["params"], batch)) - math.log(cfg.vocab_size)) < 1.5
        True
    """
    train = rng is not None and config.dropout > 0
    model = T5(config, deterministic=not train)
    rngs = {"dropout": rng} if train else {}
    logits = model.apply({"params": params}, batch["inputs"], batch["decoder_inputs"], rngs=rngs)
    losses = optax.softmax_cross_entropy_with_integer_labels(
        logits.astype(jnp.float32), batch["targets"]
    )
    return jnp.mean(losses)


def batch_spec(config: T5Config, batch_size: int) -> dict[str, jax.ShapeDtypeStruct]:
    """Shapes of a batch: ``inputs`` ``int32[B, S]``; ``decoder_inputs``, ``targets``
    ``int32[B, T]``.

    Example:
        >>> batch_spec(T5Config.preset("t5-1b"), 32)["targets"].shape
        (32, 2048)
    """
    enc = jax.ShapeDtypeStruct((batch_size, config.seq_len), jnp.int32)
    dec = jax.ShapeDtypeStruct((batch_size, config.target_len), jnp.int32)
    return {"inputs": enc, "decoder_inputs": dec, "targets": dec}


def random_batch(config: T5Config, batch_size: int, key: jax.Array) -> dict[str, jax.Array]:
    """Uniform random inputs and targets; ``decoder_inputs`` = targets shifted right by one
    behind token 0."""
    k_in, k_out = jax.random.split(key)
    inputs = jax.random.randint(k_in, (batch_size, config.seq_len), 0, config.vocab_size)
    targets = jax.random.randint(k_out, (batch_size, config.target_len), 0, config.vocab_size)
    start = jnp.zeros((batch_size, 1), targets.dtype)
    decoder_inputs = jnp.concatenate([start, targets[:, :-1]], axis=1)
    return {
        "inputs": inputs.astype(jnp.int32),
        "decoder_inputs": decoder_inputs.astype(jnp.int32),
        "targets": targets.astype(jnp.int32),
    }


def make_train_step(
    config: T5Config,
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
        batch_size: sequence pairs per step.
        abstract: ``jax.ShapeDtypeStruct`` args (nothing allocated) or concrete arrays.
        seed: parameter init and batch seed; also the base of the dropout keys.
        learning_rate: AdamW learning rate.
        weight_decay: AdamW decoupled weight decay.

    Returns:
        ``(step_fn, (state, batch))`` with ``step_fn(state, batch) -> (new_state, loss)``.

    Example:
        >>> step, (state, batch) = make_train_step(T5Config.preset("t5-1b"), 32)
        >>> state["params"]["decoder"]["block"]["3"]["layer"]["1"]["EncDecAttention"]["k"]
        {'kernel': ShapeDtypeStruct(shape=(1024, 1024), dtype=bfloat16)}
    """
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size} must be >= 1")
    optimizer = AdamW(config.precision, learning_rate, weight_decay)

    def loss(params, model_state, batch, rng):
        return loss_fn(config, params, batch, rng), model_state

    step_fn = build_step_fn(loss, optimizer, seed=seed, uses_rng=config.dropout > 0)
    enc = jnp.zeros((1, config.seq_len), jnp.int32)
    dec = jnp.zeros((1, config.target_len), jnp.int32)
    args = build_args(
        lambda key: T5(config).init(key, enc, dec),
        optimizer,
        batch_spec(config, batch_size),
        lambda key: random_batch(config, batch_size, key),
        abstract=abstract,
        seed=seed,
    )
    return step_fn, args
