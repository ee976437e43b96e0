"""MoE: a GPT-like transformer whose MLP is a GShard top-k mixture of experts every few layers.

Same embeddings, attention, LayerNorms and tied output as :mod:`benchmarks.models.gpt`;
block ``i`` (0-based) uses a mixture-of-experts layer instead of the dense MLP when
``(i + 1) % moe_every == 0`` (GShard puts one in every other layer).

The MoE layer follows GShard (Lepikhin et al. 2020) with einsum dispatch and combine:
tokens are split into groups of ``group_size``; a float32 router gives per-token expert
probabilities; the top-k experts are picked one after another (``argmax``, then masked),
each expert takes at most ``capacity = ceil(top_k * capacity_factor * group_size / E)``
tokens per group in arrival order (later ones are dropped and pass through the residual
only). With the dispatch mask ``[g, s, e, c]``::

    expert_in = einsum("gsec,gsm->egcm", dispatch, x)
    y = gelu(expert_in @ wi[e]) @ wo[e]          # wi: [E, hidden, ffn], wo: [E, ffn, hidden]
    out = einsum("gsec,egcm->gsm", combine, y)   # combine = dispatch * gate

The top-k gates are renormalised to sum to one when ``top_k > 1``. Each MoE layer adds the
Switch/GShard load-balancing loss ``E * sum_e f_e * P_e`` (``f_e`` = fraction of tokens whose
first choice is ``e``, ``P_e`` = mean router probability; 1.0 when perfectly balanced),
and the step minimises ``cross_entropy + aux_loss_weight * sum over MoE layers``.

Parameter names: ``MoE/h_1/moe/router``, ``MoE/h_1/moe/wi``, ``MoE/h_1/moe/wo``; with
``scan_layers=True`` one ``nn.scan`` named ``h`` runs over groups of ``moe_every`` blocks
(``MoE/h/block_{j}/...``, leading axis ``layers // moe_every``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from benchmarks.models.gpt import _INIT_STD, CausalSelfAttention, FeedForward
from benchmarks.models.precision import AdamW, Precision, check_precision, compute_dtype
from benchmarks.models.presets import lookup_preset
from benchmarks.models.train_step import (
    StepFn,
    build_args,
    build_step_fn,
    random_token_batch,
    token_batch_spec,
)


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """Sizes and numerics of a MoE transformer.

    Attributes:
        vocab_size: vocabulary size.
        seq_len: sequence length (position table size and batch length).
        hidden: model width.
        layers: number of transformer blocks.
        heads: attention heads; must divide ``hidden``.
        num_experts: experts per MoE layer ``E``.
        top_k: experts each token is sent to (1 = Switch, 2 = GShard).
        expert_ffn: expert (and dense MLP) inner width; defaults to ``4 * hidden``.
        capacity_factor: slack of the per-expert capacity over a perfect balance.
        moe_every: every ``moe_every``-th block is a MoE block.
        scan_layers: ``nn.scan`` over groups of ``moe_every`` blocks.
        precision: ``"mixed"`` or ``"fp32"`` (see :mod:`benchmarks.models.precision`).
        group_size: tokens per routing group; defaults to ``seq_len`` (one sequence) and
            must divide ``batch_size * seq_len``.
        aux_loss_weight: weight of the load-balancing loss (GShard/Switch use 0.01).

    Example:
        >>> MoEConfig.preset("tiny").capacity
        20
    """

    vocab_size: int
    seq_len: int
    hidden: int
    layers: int
    heads: int
    num_experts: int
    top_k: int = 2
    expert_ffn: int | None = None
    capacity_factor: float = 1.25
    moe_every: int = 2
    scan_layers: bool = False
    precision: Precision = "mixed"
    group_size: int | None = None
    aux_loss_weight: float = 0.01

    def __post_init__(self) -> None:
        for name in ("vocab_size", "seq_len", "hidden", "layers", "heads", "num_experts"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive int")
        check_precision(self.precision)
        if self.hidden % self.heads:
            raise ValueError(f"hidden={self.hidden} is not divisible by heads={self.heads}")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"top_k={self.top_k} must be in [1, num_experts={self.num_experts}]")
        if not 1 <= self.moe_every <= self.layers:
            raise ValueError(f"moe_every={self.moe_every} must be in [1, layers={self.layers}]")
        if self.scan_layers and self.layers % self.moe_every:
            raise ValueError(
                f"scan_layers=True scans groups of moe_every={self.moe_every} blocks, so "
                f"layers={self.layers} must be a multiple of it (or use scan_layers=False)"
            )
        if self.capacity_factor <= 0:
            raise ValueError(f"capacity_factor={self.capacity_factor} must be > 0")
        if self.aux_loss_weight < 0:
            raise ValueError(f"aux_loss_weight={self.aux_loss_weight} must be >= 0")
        if self.expert_ffn is None:
            object.__setattr__(self, "expert_ffn", 4 * self.hidden)
        if self.group_size is None:
            object.__setattr__(self, "group_size", self.seq_len)
        if self.expert_ffn < 1 or self.group_size < 1:
            raise ValueError(
                f"expert_ffn={self.expert_ffn} and group_size={self.group_size} must be >= 1"
            )

    @property
    def capacity(self) -> int:
        """Tokens each expert accepts per group: ``ceil(k * factor * group_size / E)``."""
        c = math.ceil(self.top_k * self.capacity_factor * self.group_size / self.num_experts)
        return max(1, c)

    def is_moe_layer(self, i: int) -> bool:
        """Whether block ``i`` (0-based) holds a MoE layer."""
        return (i + 1) % self.moe_every == 0

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> MoEConfig:
        """A named configuration, with any field overridden.

        Raises:
            ValueError: ``name`` is not in :data:`MOE_PRESETS`.
        """
        return lookup_preset("MoE", MOE_PRESETS, name, overrides)


def _alpa(h: int, l: int, e: int) -> MoEConfig:  # noqa: E741
    # Alpa's MoE benchmark family (Zheng et al. 2022, benchmark/alpa/suite_auto_moe.py):
    # s = 1024, 16 heads, V = 32000, expert group 2048 tokens, an expert in every layer.
    return MoEConfig(32000, 1024, h, l, 16, e, moe_every=1, group_size=2048)


MOE_PRESETS: dict[str, MoEConfig] = {
    "tiny": MoEConfig(256, 32, 64, 4, 4, num_experts=4),
    "alpa-moe-380m": _alpa(768, 8, 8),
    "alpa-moe-690m": _alpa(768, 8, 16),
    "alpa-moe-1.3b": _alpa(768, 16, 16),
    "alpa-moe-2.4b": _alpa(1024, 16, 16),
    "alpa-moe-10b": _alpa(1536, 16, 32),
    "alpa-moe-27b": _alpa(2048, 16, 48),
    "alpa-moe-70b": _alpa(2048, 32, 64),
}
# Mixtral 8x7B's sizes (Jiang et al. 2024, table 1: dim 4096, 32 layers, 32 heads, FFN
# 14336, 8 experts, top 2, vocabulary 32000) on this GPT-like block: an expert in every
# layer, gelu experts of two matrices (Mixtral's are SwiGLU, three), full multi-head
# attention (Mixtral's has 8 KV heads), 4096-token sequences.
MOE_PRESETS["mixtral-8x7b"] = MoEConfig(
    32000, 4096, 4096, 32, 32, num_experts=8, top_k=2, expert_ffn=14336, moe_every=1
)
# The GShard-style ~1B model the brief asks for is Alpa's "1.3B" row.
MOE_PRESETS["gshard-1b"] = MOE_PRESETS["alpa-moe-1.3b"]


def preset(name: str, **overrides: Any) -> MoEConfig:
    """:meth:`MoEConfig.preset` at module level, as the model registry (the
    ``autopar.models`` entry points, ``autopar trace moe --preset NAME``) calls it."""
    return MoEConfig.preset(name, **overrides)


# ----------------------------------------------------------------------------- modules


def route(probs: jax.Array, top_k: int, capacity: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """GShard top-k routing with per-expert capacity: dispatch and combine tensors.

    Choices are made one rank at a time (best expert, then the best remaining one, ...);
    within a rank tokens queue in group order, and rank ``r`` queues behind every rank
    ``< r`` choice. A token whose slot would be ``>= capacity`` is dropped for that expert.

    Args:
        probs: router probabilities ``f32[groups, tokens, experts]``.
        top_k: experts per token.
        capacity: slots per expert per group.

    Returns:
        ``dispatch`` (0/1) and ``combine`` (gate-weighted) ``f32[g, s, e, capacity]``, and
        the load-balancing loss ``E * sum_e f_e * P_e`` averaged over groups (``f_e``:
        fraction of first choices on ``e``; ``P_e``: mean probability of ``e``).

    Example:
        >>> probs = jnp.array([[[0.9, 0.1], [0.8, 0.2], [0.7, 0.3]]])
        >>> dispatch, combine, aux = route(probs, top_k=1, capacity=2)
        >>> dispatch[0, :, 0].tolist()   # the third token overflows expert 0
        [[1.0, 0.0], [0.0, 1.0], [0.0, 0.0]]
    """
    e = probs.shape[-1]
    remaining = probs
    fill = jnp.zeros((probs.shape[0], e), jnp.float32)  # slots already taken per expert
    picks = []  # (expert one-hot [g,s,e], slot [g,s,e], gate [g,s]) per rank
    for _ in range(top_k):
        mask = jax.nn.one_hot(jnp.argmax(remaining, axis=-1), e, dtype=jnp.float32)
        slot = (jnp.cumsum(mask, axis=1) - 1.0 + fill[:, None, :]) * mask
        fill = fill + jnp.sum(mask, axis=1)
        picks.append((mask, slot, jnp.sum(probs * mask, axis=-1)))
        remaining = remaining * (1.0 - mask)
    if top_k > 1:  # GShard renormalises the chosen gates; top-1 (Switch) keeps the raw prob
        total = sum(gate for _, _, gate in picks)
        picks = [(mask, slot, gate / total) for mask, slot, gate in picks]

    dispatch = jnp.zeros((*probs.shape, capacity), jnp.float32)
    combine = jnp.zeros_like(dispatch)
    for mask, slot, gate in picks:
        # one_hot of a slot >= capacity is all zeros: that token overflows and is dropped.
        kept = mask[..., None] * jax.nn.one_hot(slot.astype(jnp.int32), capacity)
        dispatch = dispatch + kept
        combine = combine + gate[:, :, None, None] * kept

    first_choice = picks[0][0]
    aux = e * jnp.mean(jnp.sum(jnp.mean(first_choice, 1) * jnp.mean(probs, 1), -1))
    return dispatch, combine, aux


class MoELayer(nn.Module):
    """GShard top-k MoE FFN: ``x[B, S, M] -> (y[B, S, M], aux_loss f32 scalar)``."""

    config: MoEConfig
    out_init_std: float
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        cfg = self.config
        b, s, m = x.shape
        e, f, c = cfg.num_experts, cfg.expert_ffn, cfg.capacity
        if (b * s) % cfg.group_size:
            raise ValueError(
                f"batch_size*seq_len={b * s} is not divisible by group_size={cfg.group_size}"
            )
        xg = x.reshape(b * s // cfg.group_size, cfg.group_size, m)  # [g, s, m]

        # Router in float32: its softmax and the top-k choice are precision-sensitive.
        router = nn.Dense(
            e,
            use_bias=False,
            dtype=jnp.float32,
            name="router",
            kernel_init=nn.initializers.normal(_INIT_STD),
        )
        probs = jax.nn.softmax(router(xg), axis=-1)  # [g, s, e]

        dispatch, combine, aux = route(probs, cfg.top_k, c)

        wi = self.param("wi", nn.initializers.normal(_INIT_STD), (e, m, f), jnp.float32)
        wo = self.param("wo", nn.initializers.normal(self.out_init_std), (e, f, m), jnp.float32)
        wi, wo = wi.astype(self.dtype), wo.astype(self.dtype)
        expert_in = jnp.einsum("gsec,gsm->egcm", dispatch.astype(self.dtype), xg)
        h = nn.gelu(jnp.einsum("egcm,emf->egcf", expert_in, wi))
        expert_out = jnp.einsum("egcf,efm->egcm", h, wo)
        y = jnp.einsum("gsec,egcm->gsm", combine.astype(self.dtype), expert_out)

        return y.reshape(b, s, m), aux


class MoEBlock(nn.Module):
    """Pre-LN block with a dense MLP or a MoE layer; carry = ``(x, aux_loss_sum)``."""

    config: MoEConfig
    use_moe: bool

    @nn.compact
    def __call__(self, carry: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        cfg = self.config
        x, aux = carry
        dtype = compute_dtype(cfg.precision)
        out_std = _INIT_STD / math.sqrt(2 * cfg.layers)
        h = nn.LayerNorm(dtype=dtype, name="ln_1")(x)
        x = x + CausalSelfAttention(
            hidden=cfg.hidden,
            heads=cfg.heads,
            kv_heads=cfg.heads,
            dropout=0.0,
            out_init_std=out_std,
            dtype=dtype,
            name="attn",
        )(h)
        h = nn.LayerNorm(dtype=dtype, name="ln_2")(x)
        if self.use_moe:
            h, layer_aux = MoELayer(cfg, out_std, dtype, name="moe")(h)
            aux = aux + layer_aux
        else:
            h = FeedForward(cfg.hidden, cfg.expert_ffn, "gelu", out_std, dtype, name="mlp")(h)
        return x + h, aux


class BlockGroup(nn.Module):
    """``moe_every`` consecutive blocks (the last one MoE): the unit ``nn.scan`` repeats."""

    config: MoEConfig

    @nn.compact
    def __call__(self, carry: Any, _: Any = None) -> tuple[Any, None]:
        n = self.config.moe_every
        for j in range(n):
            carry = MoEBlock(self.config, use_moe=j == n - 1, name=f"block_{j}")(carry)
        return carry, None


class MoE(nn.Module):
    """The MoE model: ``tokens int32[B, S] -> (logits[B, S, V], aux_loss f32)``."""

    config: MoEConfig

    @nn.compact
    def __call__(self, tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
        cfg = self.config
        dtype = compute_dtype(cfg.precision)
        init = nn.initializers.normal(_INIT_STD)
        wte = nn.Embed(cfg.vocab_size, cfg.hidden, dtype=dtype, embedding_init=init, name="wte")
        wpe = nn.Embed(cfg.seq_len, cfg.hidden, dtype=dtype, embedding_init=init, name="wpe")
        x = wte(tokens) + wpe(jnp.arange(tokens.shape[1], dtype=jnp.int32))[None]
        carry = (x, jnp.zeros((), jnp.float32))
        if cfg.scan_layers:
            groups = nn.scan(
                BlockGroup,
                variable_axes={"params": 0},
                split_rngs={"params": True},
                length=cfg.layers // cfg.moe_every,
            )
            carry, _ = groups(cfg, name="h")(carry, None)
        else:
            for i in range(cfg.layers):
                carry = MoEBlock(cfg, use_moe=cfg.is_moe_layer(i), name=f"h_{i}")(carry)
        x, aux = carry
        x = nn.LayerNorm(dtype=dtype, name="ln_f")(x)
        return wte.attend(x), aux


# ----------------------------------------------------------------------------- train step


def loss_fn(config: MoEConfig, params: Any, batch: dict[str, jax.Array]) -> jax.Array:
    """Cross-entropy plus ``aux_loss_weight`` times the summed load-balancing losses.

    Example:
        >>> cfg = MoEConfig.preset("tiny", precision="fp32")
        >>> state, batch = make_train_step(cfg, 2, abstract=False)[1]
        >>> float(loss_fn(cfg, state["params"], batch)) > 0
        True
    """
    logits, aux = MoE(config).apply({"params": params}, batch["tokens"])
    ce = optax.softmax_cross_entropy_with_integer_labels(
        logits.astype(jnp.float32), batch["targets"]
    )
    return jnp.mean(ce) + config.aux_loss_weight * aux


def batch_spec(config: MoEConfig, batch_size: int) -> dict[str, jax.ShapeDtypeStruct]:
    """Shapes of a token batch: ``{"tokens", "targets"}``, both ``int32[B, S]``."""
    return token_batch_spec(config.seq_len, batch_size)


def random_batch(config: MoEConfig, batch_size: int, key: jax.Array) -> dict[str, jax.Array]:
    """Uniform random tokens; targets are the tokens shifted left by one (next token)."""
    return random_token_batch(config.seq_len, config.vocab_size, batch_size, key)


def make_train_step(
    config: MoEConfig,
    batch_size: int,
    abstract: bool = True,
    seed: int = 0,
    *,
    learning_rate: float = 1e-3,
    weight_decay: float = 0.01,
) -> tuple[StepFn, tuple[dict[str, Any], dict[str, Any]]]:
    """An AdamW train step for ``config`` and its arguments ``(state, batch)``.

    Same contract as :func:`benchmarks.models.gpt.make_train_step`.

    Raises:
        ValueError: ``batch_size * seq_len`` is not a multiple of ``group_size``.

    Example:
        >>> step, (state, batch) = make_train_step(MoEConfig.preset("alpa-moe-1.3b"), 8)
        >>> state["params"]["h_0"]["moe"]["wi"].shape
        (16, 768, 3072)
    """
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size} must be >= 1")
    if (batch_size * config.seq_len) % config.group_size:
        raise ValueError(
            f"batch_size*seq_len={batch_size * config.seq_len} is not divisible by "
            f"group_size={config.group_size}; change the batch size or group_size"
        )
    optimizer = AdamW(config.precision, learning_rate, weight_decay)

    def loss(params, model_state, batch, rng):
        return loss_fn(config, params, batch), model_state

    step_fn = build_step_fn(loss, optimizer, seed=seed)
    # Init on the real batch shape: it is whole routing groups (checked above). Under jit
    # or eval_shape the forward pass that init traces costs nothing that is kept.
    tokens = jnp.zeros((batch_size, config.seq_len), jnp.int32)
    args = build_args(
        lambda key: MoE(config).init(key, tokens),
        optimizer,
        batch_spec(config, batch_size),
        lambda key: random_batch(config, batch_size, key),
        abstract=abstract,
        seed=seed,
    )
    return step_fn, args
