"""Wide-ResNet: a bottleneck ResNet with a width multiplier (Flax linen, BatchNorm) + AdamW.

The architecture is torchvision's ResNet v1.5 (He et al. 2016; Zagoruyko & Komodakis 2016
for the width), the family Alpa benchmarks as "Wide-ResNet":

* stem: 7x7/2 conv (``base_channels``), BatchNorm, ReLU, 3x3/2 max-pool;
* four stages of bottleneck blocks ``1x1 -> 3x3 (stride here) -> 1x1``; stage ``i`` has
  inner width ``base * 2**i * width`` and output width ``base * 2**i * 4``; the first
  block of a stage projects the shortcut with a 1x1 conv + BatchNorm when shapes change;
* global average pool and a dense classifier; softmax cross-entropy on integer labels.

Convolutions have no bias (BatchNorm follows each). ``depth = 3 * sum(blocks) + 2`` picks
the blocks per stage (50 -> 3, 4, 6, 3). With ``width=2`` and ``depth=50`` this is
torchvision's ``wide_resnet50_2`` (68,883,240 parameters); ``width=1`` is ResNet-50.

BatchNorm runs in training mode inside the step: batch statistics normalise, and the
running averages in ``state["batch_stats"]`` (float32 under every precision) are updated
with momentum 0.9. Parameter names: ``WideResNet/block_{k}/conv1`` ... with ``k`` counting
residual blocks over all stages.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from benchmarks.models.precision import AdamW, Precision, check_precision, compute_dtype
from benchmarks.models.presets import lookup_preset
from benchmarks.models.train_step import StepFn, build_args, build_step_fn

# Blocks per stage of the bottleneck ResNets (He et al. 2016, table 1), plus shallow ones
# for tests; depth = 3 * sum(blocks) + 2 (the stem conv and the classifier).
STAGE_BLOCKS: dict[int, tuple[int, int, int, int]] = {
    14: (1, 1, 1, 1),
    26: (2, 2, 2, 2),
    38: (3, 3, 3, 3),
    50: (3, 4, 6, 3),
    101: (3, 4, 23, 3),
    152: (3, 8, 36, 3),
}

_BN_MOMENTUM = 0.9  # torchvision's 0.1 in its convention (weight of the new batch)
_BN_EPSILON = 1e-5


@dataclasses.dataclass(frozen=True)
class WideResNetConfig:
    """Sizes and numerics of a Wide-ResNet.

    Attributes:
        depth: one of :data:`STAGE_BLOCKS` (14, 26, 38, 50, 101, 152).
        width: multiplier of the bottleneck's inner width (1 = plain ResNet).
        num_classes: classifier outputs.
        image_size: square input resolution.
        channels: input channels.
        base_channels: stem width (64 in ResNet); stage widths scale from it.
        precision: ``"mixed"`` or ``"fp32"`` (see :mod:`benchmarks.models.precision`).

    Example:
        >>> WideResNetConfig.preset("wrn-50-2").stage_blocks
        (3, 4, 6, 3)
    """

    depth: int = 50
    width: int = 2
    num_classes: int = 1000
    image_size: int = 224
    channels: int = 3
    base_channels: int = 64
    precision: Precision = "mixed"

    def __post_init__(self) -> None:
        if self.depth not in STAGE_BLOCKS:
            raise ValueError(
                f"depth={self.depth!r} is not supported; use one of {sorted(STAGE_BLOCKS)}"
            )
        for name in ("width", "num_classes", "image_size", "channels", "base_channels"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive int")
        check_precision(self.precision)

    @property
    def stage_blocks(self) -> tuple[int, int, int, int]:
        """Residual blocks in each of the four stages."""
        return STAGE_BLOCKS[self.depth]

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> WideResNetConfig:
        """A named configuration, with any field overridden.

        Raises:
            ValueError: ``name`` is not in :data:`WRN_PRESETS`.
        """
        return lookup_preset("Wide-ResNet", WRN_PRESETS, name, overrides)


WRN_PRESETS: dict[str, WideResNetConfig] = {
    "tiny": WideResNetConfig(depth=14, width=2, num_classes=10, image_size=32, base_channels=8),
    "resnet-50": WideResNetConfig(depth=50, width=1),
    "wrn-50-2": WideResNetConfig(depth=50, width=2),
    "wrn-101-2": WideResNetConfig(depth=101, width=2),
}


def preset(name: str, **overrides: Any) -> WideResNetConfig:
    """:meth:`WideResNetConfig.preset` at module level, as the model registry (the
    ``autopar.models`` entry points, ``autopar trace wide_resnet --preset NAME``) calls it."""
    return WideResNetConfig.preset(name, **overrides)


# ----------------------------------------------------------------------------- modules


def _conv(features: int, kernel: int, stride: int, dtype: Any, name: str) -> nn.Conv:
    # torchvision's padding (kernel // 2), no bias (a BatchNorm follows) and init
    # (kaiming_normal_, fan_out, untruncated).
    return nn.Conv(
        features,
        (kernel, kernel),
        (stride, stride),
        padding=[(kernel // 2, kernel // 2)] * 2,
        use_bias=False,
        dtype=dtype,
        kernel_init=nn.initializers.variance_scaling(2.0, "fan_out", "normal"),
        name=name,
    )


def _batch_norm(dtype: Any, name: str) -> nn.BatchNorm:
    # Training mode: normalise with batch statistics and update the running averages.
    return nn.BatchNorm(
        use_running_average=False,
        momentum=_BN_MOMENTUM,
        epsilon=_BN_EPSILON,
        dtype=dtype,
        name=name,
    )


class Bottleneck(nn.Module):
    """``relu(bn3(conv3(relu(bn2(conv2(relu(bn1(conv1(x)))))))) + shortcut(x))``."""

    inner: int
    out: int
    stride: int
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        dt = self.dtype
        y = nn.relu(_batch_norm(dt, "bn1")(_conv(self.inner, 1, 1, dt, "conv1")(x)))
        y = nn.relu(_batch_norm(dt, "bn2")(_conv(self.inner, 3, self.stride, dt, "conv2")(y)))
        y = _batch_norm(dt, "bn3")(_conv(self.out, 1, 1, dt, "conv3")(y))
        if self.stride != 1 or x.shape[-1] != self.out:
            shortcut = _conv(self.out, 1, self.stride, dt, "shortcut_conv")
            x = _batch_norm(dt, "shortcut_bn")(shortcut(x))
        return nn.relu(x + y)


class WideResNet(nn.Module):
    """``images f32[B, H, W, C] -> logits[B, num_classes]``; BatchNorm in training mode."""

    config: WideResNetConfig

    @nn.compact
    def __call__(self, images: jax.Array) -> jax.Array:
        cfg = self.config
        dtype = compute_dtype(cfg.precision)
        x = _conv(cfg.base_channels, 7, 2, dtype, "stem_conv")(images.astype(dtype))
        x = nn.relu(_batch_norm(dtype, "stem_bn")(x))
        x = nn.max_pool(x, (3, 3), strides=(2, 2), padding=((1, 1), (1, 1)))
        k = 0
        for stage, blocks in enumerate(cfg.stage_blocks):
            inner = cfg.base_channels * 2**stage * cfg.width
            out = cfg.base_channels * 2**stage * 4
            for j in range(blocks):
                stride = 2 if stage > 0 and j == 0 else 1
                x = Bottleneck(inner, out, stride, dtype, name=f"block_{k}")(x)
                k += 1
        x = jnp.mean(x, axis=(1, 2))
        return nn.Dense(cfg.num_classes, dtype=dtype, name="head")(x)


# ----------------------------------------------------------------------------- train step


def loss_fn(
    config: WideResNetConfig,
    params: Any,
    batch_stats: Any,
    batch: dict[str, jax.Array],
) -> tuple[jax.Array, Any]:
    """Mean cross-entropy (float32) and the updated BatchNorm running statistics.

    Example:
        >>> cfg = WideResNetConfig.preset("tiny", precision="fp32")
        >>> state, batch = make_train_step(cfg, 2, abstract=False)[1]
        >>> loss, stats = loss_fn(cfg, state["params"], state["batch_stats"], batch)
        >>> float(loss) > 0
        True
    """
    logits, updates = WideResNet(config).apply(
        {"params": params, "batch_stats": batch_stats}, batch["images"], mutable=["batch_stats"]
    )
    losses = optax.softmax_cross_entropy_with_integer_labels(
        logits.astype(jnp.float32), batch["labels"]
    )
    return jnp.mean(losses), updates["batch_stats"]


def batch_spec(config: WideResNetConfig, batch_size: int) -> dict[str, jax.ShapeDtypeStruct]:
    """Shapes of an image batch: ``images f32[B, H, W, C]``, ``labels int32[B]``."""
    s = config.image_size
    return {
        "images": jax.ShapeDtypeStruct((batch_size, s, s, config.channels), jnp.float32),
        "labels": jax.ShapeDtypeStruct((batch_size,), jnp.int32),
    }


def random_batch(config: WideResNetConfig, batch_size: int, key: jax.Array) -> dict[str, jax.Array]:
    """Standard-normal images and uniform random labels."""
    k_img, k_lab = jax.random.split(key)
    spec = batch_spec(config, batch_size)
    images = jax.random.normal(k_img, spec["images"].shape, jnp.float32)
    labels = jax.random.randint(k_lab, (batch_size,), 0, config.num_classes).astype(jnp.int32)
    return {"images": images, "labels": labels}


def make_train_step(
    config: WideResNetConfig,
    batch_size: int,
    abstract: bool = True,
    seed: int = 0,
    *,
    learning_rate: float = 1e-3,
    weight_decay: float = 0.01,
) -> tuple[StepFn, tuple[dict[str, Any], dict[str, Any]]]:
    """An AdamW train step for ``config`` and its arguments ``(state, batch)``.

    ``state = {"params", "opt_state", "batch_stats"}``; the step also returns the updated
    BatchNorm running statistics. Otherwise the contract of
    :func:`benchmarks.models.gpt.make_train_step`.

    Example:
        >>> step, (state, batch) = make_train_step(WideResNetConfig.preset("wrn-50-2"), 32)
        >>> batch["images"]
        ShapeDtypeStruct(shape=(32, 224, 224, 3), dtype=float32)
    """
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size} must be >= 1")
    optimizer = AdamW(config.precision, learning_rate, weight_decay)

    def loss(params, model_state, batch, rng):
        value, stats = loss_fn(config, params, model_state["batch_stats"], batch)
        return value, {"batch_stats": stats}

    step_fn = build_step_fn(loss, optimizer, seed=seed)
    s = config.image_size
    images = jnp.zeros((1, s, s, config.channels), jnp.float32)
    args = build_args(
        lambda key: WideResNet(config).init(key, images),
        optimizer,
        batch_spec(config, batch_size),
        lambda key: random_batch(config, batch_size, key),
        abstract=abstract,
        seed=seed,
    )
    return step_fn, args
