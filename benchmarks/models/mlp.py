"""MLP: a plain-JAX multilayer perceptron (no Flax) with an MSE loss and AdamW.

``params = {"layer_0": {"w": [d_in, hidden], "b": [hidden]}, ..., "layer_{n-1}": {...}}``;
``layers`` counts the dense layers, with the activation between them (not after the last).

Plain JAX leaves no name stacks in the jaxpr: on purpose, this model is the test case for
finding layers by structural repetition.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Literal, get_args

import jax
import jax.numpy as jnp

from benchmarks.models.precision import AdamW, Precision, check_precision
from benchmarks.models.presets import lookup_preset
from benchmarks.models.train_step import StepFn, build_args, build_step_fn

Activation = Literal["relu", "gelu", "tanh"]
ACTIVATIONS: tuple[str, ...] = get_args(Activation)
_ACTIVATION_FNS = {"relu": jax.nn.relu, "gelu": jax.nn.gelu, "tanh": jnp.tanh}


@dataclasses.dataclass(frozen=True)
class MLPConfig:
    """Sizes of an MLP.

    Attributes:
        d_in: input features.
        hidden: width of every hidden layer.
        d_out: output features.
        layers: dense layers (>= 1; 1 is a linear model ``d_in -> d_out``).
        activation: ``"relu"``, ``"gelu"`` or ``"tanh"`` between layers.
        precision: ``"fp32"`` (default) or ``"mixed"``.

    Example:
        >>> MLPConfig(8, 16, 4, layers=3).widths
        (8, 16, 16, 4)
    """

    d_in: int
    hidden: int
    d_out: int
    layers: int = 2
    activation: Activation = "relu"
    precision: Precision = "fp32"

    def __post_init__(self) -> None:
        for name in ("d_in", "hidden", "d_out", "layers"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive int")
        if self.activation not in ACTIVATIONS:
            raise ValueError(
                f"activation={self.activation!r} is not supported; use one of {ACTIVATIONS}"
            )
        check_precision(self.precision)

    @property
    def widths(self) -> tuple[int, ...]:
        """Feature widths from input to output (``layers + 1`` entries)."""
        return (self.d_in, *([self.hidden] * (self.layers - 1)), self.d_out)

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> MLPConfig:
        """A named configuration, with any field overridden.

        Raises:
            ValueError: ``name`` is not in :data:`MLP_PRESETS`.
        """
        return lookup_preset("MLP", MLP_PRESETS, name, overrides)


MLP_PRESETS: dict[str, MLPConfig] = {
    "tiny": MLPConfig(d_in=16, hidden=64, d_out=8, layers=3),
    # Large enough that a search for a DGX node splits the work (tiny replicates it).
    "small": MLPConfig(d_in=256, hidden=1024, d_out=256, layers=3),
    "mlp-1b": MLPConfig(d_in=8192, hidden=8192, d_out=8192, layers=16),
}


def preset(name: str, **overrides: Any) -> MLPConfig:
    """:meth:`MLPConfig.preset` at module level, as the model registry (the
    ``autopar.models`` entry points, ``autopar trace mlp --preset NAME``) calls it."""
    return MLPConfig.preset(name, **overrides)


def init_params(config: MLPConfig, key: jax.Array) -> dict[str, dict[str, jax.Array]]:
    """He-normal weights (``std = sqrt(2 / fan_in)``) and zero biases, in float32.

    Example:
        >>> p = init_params(MLPConfig(8, 16, 4), jax.random.PRNGKey(0))
        >>> p["layer_1"]["w"].shape
        (16, 4)
    """
    widths = config.widths
    keys = jax.random.split(key, config.layers)
    return {
        f"layer_{i}": {
            "w": jax.random.normal(keys[i], (n_in, n_out), jnp.float32) * math.sqrt(2 / n_in),
            "b": jnp.zeros((n_out,), jnp.float32),
        }
        for i, (n_in, n_out) in enumerate(zip(widths[:-1], widths[1:], strict=True))
    }


def apply(config: MLPConfig, params: dict[str, dict[str, jax.Array]], x: jax.Array) -> jax.Array:
    """The forward pass ``x[B, d_in] -> y[B, d_out]`` in the parameters' dtype."""
    act = _ACTIVATION_FNS[config.activation]
    h = x.astype(params["layer_0"]["w"].dtype)
    for i in range(config.layers):
        layer = params[f"layer_{i}"]
        h = h @ layer["w"] + layer["b"]
        if i < config.layers - 1:
            h = act(h)
    return h


def loss_fn(config: MLPConfig, params: Any, batch: dict[str, jax.Array]) -> jax.Array:
    """Mean squared error (float32) of the MLP on ``batch = {"x", "y"}``.

    Example:
        >>> cfg = MLPConfig(4, 8, 2)
        >>> p = init_params(cfg, jax.random.PRNGKey(0))
        >>> float(loss_fn(cfg, p, {"x": jnp.zeros((3, 4)), "y": jnp.zeros((3, 2))}))
        0.0
    """
    pred = apply(config, params, batch["x"]).astype(jnp.float32)
    return jnp.mean((pred - batch["y"]) ** 2)


def batch_spec(config: MLPConfig, batch_size: int) -> dict[str, jax.ShapeDtypeStruct]:
    """Shapes of a regression batch: ``x f32[B, d_in]``, ``y f32[B, d_out]``."""
    return {
        "x": jax.ShapeDtypeStruct((batch_size, config.d_in), jnp.float32),
        "y": jax.ShapeDtypeStruct((batch_size, config.d_out), jnp.float32),
    }


def random_batch(config: MLPConfig, batch_size: int, key: jax.Array) -> dict[str, jax.Array]:
    """Normal inputs and targets from a fixed random linear map (so there is a fit)."""
    k_x, k_w = jax.random.split(key)
    x = jax.random.normal(k_x, (batch_size, config.d_in), jnp.float32)
    w = jax.random.normal(k_w, (config.d_in, config.d_out), jnp.float32) / math.sqrt(config.d_in)
    return {"x": x, "y": x @ w}


def make_train_step(
    config: MLPConfig,
    batch_size: int,
    abstract: bool = True,
    seed: int = 0,
    *,
    learning_rate: float = 1e-3,
    weight_decay: float = 0.01,
) -> tuple[StepFn, tuple[dict[str, Any], dict[str, Any]]]:
    """An AdamW train step for ``config`` and its arguments ``(state, batch)``.

    Same contract as :func:`benchmarks.models.gpt.make_train_step`.

    Example:
        >>> step, (state, batch) = make_train_step(MLPConfig(8, 16, 4), 2)
        >>> state["params"]["layer_0"]["w"]
        ShapeDtypeStruct(shape=(8, 16), dtype=float32)
    """
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size} must be >= 1")
    optimizer = AdamW(config.precision, learning_rate, weight_decay)

    def loss(params, model_state, batch, rng):
        return loss_fn(config, params, batch), model_state

    step_fn = build_step_fn(loss, optimizer, seed=seed)
    args = build_args(
        lambda key: {"params": init_params(config, key)},
        optimizer,
        batch_spec(config, batch_size),
        lambda key: random_batch(config, batch_size, key),
        abstract=abstract,
        seed=seed,
    )
    return step_fn, args
