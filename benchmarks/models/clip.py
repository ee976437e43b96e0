"""CLIP: a two-tower contrastive model (Flax linen) laid out like Hugging Face's Flax CLIP.

Architecture (Radford et al. 2021; ``transformers.models.clip.modeling_flax_clip``):

* **vision tower** (a ViT): the image is cut into ``patch`` x ``patch`` patches by a
  bias-free strided convolution ``patch_embedding``, a learned ``class_embedding`` token
  is prepended and ``position_embedding`` added, then ``pre_layrnorm`` (Hugging Face's
  spelling), ``vision_layers`` pre-norm blocks and ``post_layernorm`` of the class token;
* **text tower**: token and position embeddings, ``text_layers`` *causal* pre-norm blocks,
  ``final_layer_norm``, pooled at each sequence's end-of-text token, which is the largest
  id in the sequence (``argmax`` of ``input_ids``, as Hugging Face pools OpenAI's vocab);
* each block is ``x + self_attn(layer_norm1(x))`` then ``x + mlp(layer_norm2(x))`` with
  biased ``q/k/v/out_proj`` and ``fc1 -> activation -> fc2`` (``quick_gelu``,
  ``x * sigmoid(1.702 x)``, in OpenAI's checkpoints; the exact, erf-based ``gelu`` in
  LAION's);
* the pooled outputs go through bias-free ``visual_projection`` / ``text_projection`` to
  ``projection_dim``, are L2-normalised, and their cosine similarities are scaled by
  ``exp(logit_scale)`` (initialised to ``log(1 / 0.07)``).

The loss is CLIP's symmetric contrastive loss: the mean of the cross-entropies of
``logits_per_text`` (``B x B``) and its transpose against the diagonal, in float32. Every
image is contrasted with every text of the *global* batch, so a data-parallel plan must
gather the other devices' embeddings: the loss couples the whole batch.

Parameter paths match Hugging Face's checkpoints, e.g.::

    text_model/embeddings/token_embedding/embedding
    text_model/encoder/layers/11/self_attn/q_proj/kernel
    text_model/final_layer_norm/scale
    vision_model/embeddings/class_embedding
    vision_model/embeddings/patch_embedding/kernel
    vision_model/encoder/layers/23/mlp/fc2/bias
    vision_model/post_layernorm/bias
    visual_projection/kernel
    text_projection/kernel
    logit_scale

The batch is ``{"pixel_values": float32[B, image, image, 3], "input_ids": int32[B, S]}``
(channels last, as Flax convolutions take them).
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

Activation = Literal["quick_gelu", "gelu"]
ACTIVATIONS: tuple[str, ...] = get_args(Activation)

_LN_EPS = 1e-5  # Hugging Face's CLIP layer_norm_eps


@dataclasses.dataclass(frozen=True)
class CLIPConfig:
    """Sizes and numerics of a CLIP model.

    Attributes:
        image_size: side of the square input image, in pixels.
        patch: side of one patch; ``image_size`` must be a multiple of it.
        vision_width: width of the vision tower.
        vision_layers: blocks of the vision tower.
        vision_heads: attention heads of the vision tower.
        vision_mlp: feed-forward inner width of the vision tower.
        vocab_size: text vocabulary size.
        seq_len: text context length ``S``.
        text_width: width of the text tower.
        text_layers: blocks of the text tower.
        text_heads: attention heads of the text tower.
        text_mlp: feed-forward inner width of the text tower.
        projection_dim: width of the shared embedding space.
        activation: ``"quick_gelu"`` (OpenAI) or ``"gelu"`` (LAION).
        precision: ``"mixed"`` (bf16 params/compute, fp32 master + Adam) or ``"fp32"``.

    Example:
        >>> CLIPConfig.preset("clip-vit-base-patch32").num_params()
        151277313
        >>> CLIPConfig.preset("tiny").num_patches
        16
    """

    image_size: int
    patch: int
    vision_width: int
    vision_layers: int
    vision_heads: int
    vision_mlp: int
    vocab_size: int
    seq_len: int
    text_width: int
    text_layers: int
    text_heads: int
    text_mlp: int
    projection_dim: int
    activation: Activation = "quick_gelu"
    precision: Precision = "mixed"

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.type == "int" and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{f.name}={value!r} must be a positive int")
        if self.image_size % self.patch:
            raise ValueError(
                f"image_size={self.image_size} is not a multiple of patch={self.patch}"
            )
        for tower in ("vision", "text"):
            width, heads = getattr(self, f"{tower}_width"), getattr(self, f"{tower}_heads")
            if width % heads:
                raise ValueError(f"{tower}_width={width} does not split into {heads} heads")
        if self.activation not in ACTIVATIONS:
            raise ValueError(
                f"activation={self.activation!r} is not supported; use one of {ACTIVATIONS}"
            )
        check_precision(self.precision)

    def tower(self, name: Literal["vision", "text"]) -> Tower:
        """The block shape of the ``"vision"`` (bidirectional) or ``"text"`` (causal)
        tower."""
        return Tower(
            getattr(self, f"{name}_width"), getattr(self, f"{name}_heads"),
            getattr(self, f"{name}_mlp"), getattr(self, f"{name}_layers"),
            causal=name == "text", activation=self.activation,
        )  # fmt: skip

    @property
    def num_patches(self) -> int:
        """Patches per image: ``(image_size / patch)^2`` (the vision sequence is one more)."""
        return (self.image_size // self.patch) ** 2

    def num_params(self) -> int:
        """Analytic parameter count.

        A block of width ``w`` and inner width ``f`` holds four ``w x w`` projections with
        biases, two layer norms (scale and bias) and ``fc1``/``fc2`` with biases:
        ``4 (w^2 + w) + 4 w + 2 w f + f + w``. The vision tower adds the patch kernel
        (``3 patch^2 w``), the class token, ``num_patches + 1`` positions and two layer
        norms; the text tower adds the token and position tables and one layer norm; each
        projection is ``w x projection_dim``; ``logit_scale`` is one number.

        Example:
            >>> CLIPConfig.preset("clip-vit-large-patch14").num_params()
            427616513
        """

        def block(w: int, f: int) -> int:
            return 4 * (w * w + w) + 4 * w + 2 * w * f + f + w

        wv, wt = self.vision_width, self.text_width
        vision = (
            3 * self.patch**2 * wv
            + wv
            + (self.num_patches + 1) * wv
            + 4 * wv
            + self.vision_layers * block(wv, self.vision_mlp)
        )
        text = (
            (self.vocab_size + self.seq_len) * wt
            + 2 * wt
            + self.text_layers * block(wt, self.text_mlp)
        )
        return vision + text + (wv + wt) * self.projection_dim + 1

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> CLIPConfig:
        """A named configuration, with any field overridden.

        Raises:
            ValueError: ``name`` is not in :data:`CLIP_PRESETS`.
        """
        return lookup_preset("CLIP", CLIP_PRESETS, name, overrides)


def _clip(
    image: int, patch: int, vision: tuple[int, int, int, int], text: tuple[int, int, int, int],
    projection: int, vocab: int = 49408, seq: int = 77, **kw: Any,
) -> CLIPConfig:  # fmt: skip
    (vw, vl, vh, vm), (tw, tl, th, tm) = vision, text
    return CLIPConfig(
        image_size=image, patch=patch, vision_width=vw, vision_layers=vl, vision_heads=vh,
        vision_mlp=vm, vocab_size=vocab, seq_len=seq, text_width=tw, text_layers=tl,
        text_heads=th, text_mlp=tm, projection_dim=projection, **kw,
    )  # fmt: skip


# Sources: openai/clip-vit-base-patch32 and clip-vit-large-patch14 (Radford et al. 2021,
# table 19; Hugging Face's configs: 151,277,313 and 427,616,513 parameters); LAION's
# CLIP-ViT-H-14 (OpenCLIP's ViT-H-14 config: a 32-block, 1280-wide vision tower and a
# 24-block, 1024-wide text tower, GELU, 0.99B parameters), the "~1B two-tower" model of
# autopar's benchmarks.
CLIP_PRESETS: dict[str, CLIPConfig] = {
    "tiny": _clip(32, 8, (64, 2, 4, 128), (48, 2, 4, 96), 32, vocab=256, seq=16),
    # fp32 so a lowered step can be checked against single-device jax.jit to 1e-5
    "demo": _clip(32, 8, (128, 2, 4, 256), (128, 2, 4, 256), 64, vocab=512, seq=16,
                  precision="fp32"),
    "clip-vit-base-patch32": _clip(224, 32, (768, 12, 12, 3072), (512, 12, 8, 2048), 512),
    "clip-vit-large-patch14": _clip(224, 14, (1024, 24, 16, 4096), (768, 12, 12, 3072), 768),
    "clip-vit-h-14": _clip(
        224, 14, (1280, 32, 16, 5120), (1024, 24, 16, 4096), 1024, activation="gelu"
    ),
}  # fmt: skip


def preset(name: str, **overrides: Any) -> CLIPConfig:
    """:meth:`CLIPConfig.preset` at module level (the ``autopar.models`` registry calls it)."""
    return CLIPConfig.preset(name, **overrides)


# ----------------------------------------------------------------------------- modules


def quick_gelu(x: jax.Array) -> jax.Array:
    """OpenAI CLIP's GELU approximation ``x * sigmoid(1.702 x)``.

    Example:
        >>> round(float(quick_gelu(jnp.float32(1.0))), 4)
        0.8458
    """
    return x * jax.nn.sigmoid(1.702 * x)


@dataclasses.dataclass(frozen=True)
class Tower:
    """The block shape of one tower: ``layers`` blocks of ``width`` with ``heads`` heads, an
    MLP of ``inner``, causal attention or not, and the MLP's activation.

    Example:
        >>> CLIPConfig.preset("clip-vit-h-14").tower("text")
        Tower(width=1024, heads=16, inner=4096, layers=24, causal=True, activation='gelu')
    """

    width: int
    heads: int
    inner: int
    layers: int
    causal: bool
    activation: Activation


class CLIPAttention(nn.Module):
    """Multi-head self-attention with biased ``q/k/v/out_proj``, logits scaled by
    ``1/sqrt(head_dim)`` and computed in float32; a causal tower masks future tokens."""

    tower: Tower
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        b, s, w = x.shape
        a = self.tower.heads
        dk = w // a
        init = nn.initializers.normal(stddev=w**-0.5)

        def proj(name: str) -> nn.Dense:
            return nn.Dense(w, dtype=self.dtype, kernel_init=init, name=name)

        q = proj("q_proj")(x).reshape(b, s, a, dk)
        k = proj("k_proj")(x).reshape(b, s, a, dk)
        v = proj("v_proj")(x).reshape(b, s, a, dk)
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) * dk**-0.5
        if self.tower.causal:
            row = jax.lax.broadcasted_iota(jnp.int32, (s, s), 0)
            col = jax.lax.broadcasted_iota(jnp.int32, (s, s), 1)
            scores = jnp.where(col > row, jnp.finfo(jnp.float32).min, scores)
        probs = jax.nn.softmax(scores, axis=-1).astype(self.dtype)
        out = jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, s, w)
        return proj("out_proj")(out)


class CLIPMLP(nn.Module):
    """``fc2(activation(fc1(x)))``."""

    tower: Tower
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        h = nn.Dense(self.tower.inner, dtype=self.dtype, name="fc1")(x)
        # Hugging Face's "gelu" is the exact, erf-based GELU (flax's default is tanh's)
        if self.tower.activation == "quick_gelu":
            h = quick_gelu(h)
        else:
            h = nn.gelu(h, approximate=False)
        return nn.Dense(self.tower.width, dtype=self.dtype, name="fc2")(h)


class CLIPEncoderLayer(nn.Module):
    """One pre-norm block: ``x + self_attn(layer_norm1(x))``, ``x + mlp(layer_norm2(x))``."""

    tower: Tower
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        ln = lambda name: nn.LayerNorm(_LN_EPS, dtype=self.dtype, name=name)  # noqa: E731
        x = x + CLIPAttention(self.tower, self.dtype, name="self_attn")(ln("layer_norm1")(x))
        return x + CLIPMLP(self.tower, self.dtype, name="mlp")(ln("layer_norm2")(x))


class CLIPLayerCollection(nn.Module):
    """The numbered blocks ``0 .. n - 1`` of one tower (Hugging Face's ``layers``)."""

    tower: Tower
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        for i in range(self.tower.layers):
            x = CLIPEncoderLayer(self.tower, self.dtype, name=str(i))(x)
        return x


class CLIPEncoder(nn.Module):
    """One tower's blocks, at ``encoder/layers/{i}``."""

    tower: Tower
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        return CLIPLayerCollection(self.tower, self.dtype, name="layers")(x)


class CLIPVisionEmbeddings(nn.Module):
    """Patch convolution, class token and learned positions: ``[B, num_patches + 1, w]``."""

    config: CLIPConfig
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, pixels: jax.Array) -> jax.Array:
        cfg, w = self.config, self.config.vision_width
        cls_token = self.param("class_embedding", nn.initializers.normal(w**-0.5), (w,))
        patches = nn.Conv(
            w,
            (cfg.patch, cfg.patch),
            strides=(cfg.patch, cfg.patch),
            padding="VALID",
            use_bias=False,
            dtype=self.dtype,
            name="patch_embedding",
        )(pixels.astype(self.dtype))
        b = patches.shape[0]
        patches = patches.reshape(b, cfg.num_patches, w)
        cls_tokens = jnp.broadcast_to(cls_token.astype(self.dtype), (b, 1, w))
        x = jnp.concatenate([cls_tokens, patches], axis=1)
        positions = jnp.arange(cfg.num_patches + 1)
        return x + nn.Embed(cfg.num_patches + 1, w, dtype=self.dtype, name="position_embedding")(
            positions
        )


class CLIPVisionTransformer(nn.Module):
    """``pixel_values -> pooled [B, vision_width]`` (the class token after
    ``post_layernorm``)."""

    config: CLIPConfig
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, pixels: jax.Array) -> jax.Array:
        cfg = self.config
        x = CLIPVisionEmbeddings(cfg, self.dtype, name="embeddings")(pixels)
        x = nn.LayerNorm(_LN_EPS, dtype=self.dtype, name="pre_layrnorm")(x)
        x = CLIPEncoder(cfg.tower("vision"), self.dtype, name="encoder")(x)
        return nn.LayerNorm(_LN_EPS, dtype=self.dtype, name="post_layernorm")(x[:, 0])


class CLIPTextEmbeddings(nn.Module):
    """Token plus position embeddings: ``[B, S, text_width]``."""

    config: CLIPConfig
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, input_ids: jax.Array) -> jax.Array:
        cfg = self.config
        init = nn.initializers.normal(stddev=0.02)
        embed = lambda n, name: nn.Embed(  # noqa: E731
            n, cfg.text_width, dtype=self.dtype, embedding_init=init, name=name
        )
        positions = jnp.arange(input_ids.shape[1])
        return embed(cfg.vocab_size, "token_embedding")(input_ids) + embed(
            cfg.seq_len, "position_embedding"
        )(positions)


class CLIPTextTransformer(nn.Module):
    """``input_ids -> pooled [B, text_width]``: the end-of-text token's final state."""

    config: CLIPConfig
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, input_ids: jax.Array) -> jax.Array:
        cfg = self.config
        x = CLIPTextEmbeddings(cfg, self.dtype, name="embeddings")(input_ids)
        x = CLIPEncoder(cfg.tower("text"), self.dtype, name="encoder")(x)
        x = nn.LayerNorm(_LN_EPS, dtype=self.dtype, name="final_layer_norm")(x)
        eot = jnp.argmax(input_ids, axis=-1)
        return x[jnp.arange(x.shape[0]), eot]


class CLIP(nn.Module):
    """``(pixel_values, input_ids) -> (logits_per_text [B, B], logits_per_image [B, B])``,
    float32."""

    config: CLIPConfig

    @nn.compact
    def __call__(self, pixels: jax.Array, input_ids: jax.Array) -> tuple[jax.Array, jax.Array]:
        cfg = self.config
        dtype = compute_dtype(cfg.precision)
        image = CLIPVisionTransformer(cfg, dtype, name="vision_model")(pixels)
        text = CLIPTextTransformer(cfg, dtype, name="text_model")(input_ids)

        def project(x: jax.Array, name: str) -> jax.Array:
            y = nn.Dense(cfg.projection_dim, use_bias=False, dtype=dtype, name=name)(x)
            y = y.astype(jnp.float32)
            return y / jnp.linalg.norm(y, axis=-1, keepdims=True)

        image, text = project(image, "visual_projection"), project(text, "text_projection")
        scale = self.param("logit_scale", nn.initializers.constant(math.log(1 / 0.07)), ())
        logits_per_text = jnp.exp(scale.astype(jnp.float32)) * text @ image.T
        return logits_per_text, logits_per_text.T


# ----------------------------------------------------------------------------- train step


def loss_fn(config: CLIPConfig, params: Any, batch: dict[str, jax.Array]) -> jax.Array:
    """CLIP's symmetric contrastive loss (float32): the mean of the text-to-image and
    image-to-text cross-entropies, each pair's match on the diagonal.

    Example:
        >>> cfg = CLIPConfig.preset("tiny", precision="fp32")
        >>> state, batch = make_train_step(cfg, 4, abstract=False)[1]
        >>> loss = jax.jit(loss_fn, static_argnums=0)(cfg, state["params"], batch)
        >>> abs(float(loss) - math.log(4)) < 1.0
        True
    """
    per_text, per_image = CLIP(config).apply(
        {"params": params}, batch["pixel_values"], batch["input_ids"]
    )
    labels = jnp.arange(per_text.shape[0])
    ce = optax.softmax_cross_entropy_with_integer_labels
    return (jnp.mean(ce(per_text, labels)) + jnp.mean(ce(per_image, labels))) / 2


def batch_spec(config: CLIPConfig, batch_size: int) -> dict[str, jax.ShapeDtypeStruct]:
    """Shapes of a batch: ``pixel_values`` ``float32[B, image, image, 3]``, ``input_ids``
    ``int32[B, S]``.

    Example:
        >>> batch_spec(CLIPConfig.preset("clip-vit-h-14"), 8)["pixel_values"].shape
        (8, 224, 224, 3)
    """
    side = config.image_size
    return {
        "pixel_values": jax.ShapeDtypeStruct((batch_size, side, side, 3), jnp.float32),
        "input_ids": jax.ShapeDtypeStruct((batch_size, config.seq_len), jnp.int32),
    }


def random_batch(config: CLIPConfig, batch_size: int, key: jax.Array) -> dict[str, jax.Array]:
    """Normal pixels and captions of random length ending in the end-of-text token: the
    vocabulary's last id, as in OpenAI's tokenizer, followed by padding (id 0)."""
    k_pix, k_ids, k_len = jax.random.split(key, 3)
    side, s, v = config.image_size, config.seq_len, config.vocab_size
    pixels = jax.random.normal(k_pix, (batch_size, side, side, 3), jnp.float32)
    ids = jax.random.randint(k_ids, (batch_size, s), 1, v - 1)
    length = jax.random.randint(k_len, (batch_size, 1), 1, s)  # the position of EOT
    pos = jnp.arange(s)[None]
    ids = jnp.where(pos == length, v - 1, jnp.where(pos > length, 0, ids))
    return {"pixel_values": pixels, "input_ids": ids.astype(jnp.int32)}


def make_train_step(
    config: CLIPConfig,
    batch_size: int,
    abstract: bool = True,
    seed: int = 0,
    *,
    learning_rate: float = 1e-3,
    weight_decay: float = 0.01,
) -> tuple[StepFn, tuple[dict[str, Any], dict[str, Any]]]:
    """An AdamW train step for ``config`` and its arguments ``(state, batch)``: the
    contract of :func:`benchmarks.models.gpt.make_train_step`, with ``batch_size``
    image-caption pairs (at least 2: each is contrasted with all the others).

    Example:
        >>> step, (state, batch) = make_train_step(CLIPConfig.preset("clip-vit-h-14"), 8)
        >>> state["params"]["vision_model"]["encoder"]["layers"]["31"]["mlp"]["fc1"]["kernel"]
        ShapeDtypeStruct(shape=(1280, 5120), dtype=bfloat16)
    """
    if batch_size < 2:
        raise ValueError(f"batch_size={batch_size} must be >= 2: a contrastive loss needs pairs")
    optimizer = AdamW(config.precision, learning_rate, weight_decay)

    def loss(params, model_state, batch, rng):
        return loss_fn(config, params, batch), model_state

    step_fn = build_step_fn(loss, optimizer, seed=seed)
    side = config.image_size
    pixels = jnp.zeros((2, side, side, 3), jnp.float32)
    ids = jnp.zeros((2, config.seq_len), jnp.int32)
    args = build_args(
        lambda key: CLIP(config).init(key, pixels, ids),
        optimizer,
        batch_spec(config, batch_size),
        lambda key: random_batch(config, batch_size, key),
        abstract=abstract,
        seed=seed,
    )
    return step_fn, args
