"""The train-step skeleton every zoo model shares: state layout, RNG, args building.

A model supplies a loss function and an initializer; this module turns them into the
zoo's contract:

* ``step_fn(state, batch) -> (new_state, loss)``: a plain, pure, un-jitted function.
  ``state = {"params": ..., "opt_state": ..., **model_state}`` where ``model_state`` holds
  non-trainable collections (``"batch_stats"`` for BatchNorm). ``new_state`` has the same
  pytree structure, shapes and dtypes; ``loss`` is a float32 scalar.
* ``args = (state, batch)``: ``jax.ShapeDtypeStruct`` leaves when ``abstract=True`` (built
  with :func:`jax.eval_shape`, so nothing is allocated), concrete arrays otherwise.

Dropout needs randomness but the step takes no key: the key is
``fold_in(PRNGKey(seed), step)`` with ``step`` the optimizer's update counter kept in
``opt_state``. Each step thus draws fresh, reproducible masks without an ``"rng"`` entry
in the state. Models without dropout never build a key, so their jaxprs carry no PRNG ops.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from benchmarks.models.precision import AdamW

PyTree = Any
StepFn = Callable[[dict[str, Any], dict[str, jax.Array]], tuple[dict[str, Any], jax.Array]]
# loss_fn(params, model_state, batch, rng) -> (loss, new_model_state)
LossFn = Callable[[PyTree, dict[str, Any], dict[str, jax.Array], jax.Array | None], Any]

_RESERVED = ("params", "opt_state")


def dropout_rng(seed: int, step: jax.Array) -> jax.Array:
    """The dropout key for update number ``step`` (a raw uint32 ``PRNGKey``).

    Example:
        >>> dropout_rng(0, jnp.int32(3)).shape
        (2,)
    """
    return jax.random.fold_in(jax.random.PRNGKey(seed), step)


def build_step_fn(
    loss_fn: LossFn, optimizer: AdamW, *, seed: int = 0, uses_rng: bool = False
) -> StepFn:
    """Wrap ``loss_fn`` into a ``step_fn(state, batch) -> (new_state, loss)``.

    Args:
        loss_fn: ``(params, model_state, batch, rng) -> (loss, new_model_state)`` where
            ``model_state`` is the state dict without ``params``/``opt_state``.
        optimizer: the :class:`AdamW` that made ``state["opt_state"]``.
        seed: base seed of the dropout keys.
        uses_rng: whether ``loss_fn`` needs a key; if not it receives ``None``.

    Example:
        >>> opt = AdamW()
        >>> loss = lambda p, ms, b, rng: (jnp.sum((p["w"] - b["x"]) ** 2), ms)
        >>> step = build_step_fn(loss, opt)
        >>> params, opt_state = opt.init({"w": jnp.zeros(2)})
        >>> _, l = step({"params": params, "opt_state": opt_state}, {"x": jnp.ones(2)})
        >>> float(l)
        2.0
    """

    def step_fn(state: dict[str, Any], batch: dict[str, jax.Array]):
        params, opt_state = state["params"], state["opt_state"]
        model_state = {k: v for k, v in state.items() if k not in _RESERVED}
        rng = dropout_rng(seed, optimizer.step_count(opt_state)) if uses_rng else None
        (loss, new_model_state), grads = jax.value_and_grad(loss_fn, has_aux=True)(
            params, model_state, batch, rng
        )
        new_params, new_opt_state = optimizer.update(grads, opt_state, params)
        new_state = {"params": new_params, "opt_state": new_opt_state, **new_model_state}
        return new_state, loss.astype(jnp.float32)

    return step_fn


def build_args(
    init_variables: Callable[[jax.Array], dict[str, PyTree]],
    optimizer: AdamW,
    batch_spec: dict[str, jax.ShapeDtypeStruct],
    make_batch: Callable[[jax.Array], dict[str, jax.Array]],
    *,
    abstract: bool,
    seed: int,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Build ``(state, batch)``, abstract or concrete.

    Args:
        init_variables: ``key -> {"params": fp32 params, **other collections}`` (a Flax
            ``model.init`` or a plain-JAX initializer).
        optimizer: turns the fp32 parameters into stored params + optimizer state.
        batch_spec: the batch's shapes and dtypes.
        make_batch: ``key -> concrete batch`` matching ``batch_spec``.
        abstract: ``True`` for ``jax.ShapeDtypeStruct`` leaves (allocates nothing).
        seed: seeds parameters (``PRNGKey(seed)``) and the batch (a fold-in of it).

    Example:
        >>> init = lambda key: {"params": {"w": jax.random.normal(key, (3,))}}
        >>> spec = {"x": jax.ShapeDtypeStruct((3,), jnp.float32)}
        >>> state, batch = build_args(init, AdamW(), spec, lambda k: {"x": jnp.ones(3)},
        ...                           abstract=True, seed=0)
        >>> batch["x"]
        ShapeDtypeStruct(shape=(3,), dtype=float32)
    """

    def init_state() -> dict[str, Any]:
        variables = dict(init_variables(jax.random.PRNGKey(seed)))
        params, opt_state = optimizer.init(variables.pop("params"))
        return {"params": params, "opt_state": opt_state, **variables}

    if abstract:
        return jax.eval_shape(init_state), dict(batch_spec)

    def init_args() -> tuple[dict[str, Any], dict[str, Any]]:
        return init_state(), make_batch(jax.random.fold_in(jax.random.PRNGKey(seed), 1))

    # One compiled program builds everything: eager random ops would each compile on
    # their own. It runs once, and on CPU XLA spends seconds optimising every parameter's
    # random-number kernel, so compile it unoptimised (the values are the same).
    compiled = jax.jit(init_args).lower().compile({"xla_backend_optimization_level": 0})
    state, batch = compiled()
    for name, spec in batch_spec.items():
        leaf = batch[name]
        if leaf.shape != spec.shape or leaf.dtype != spec.dtype:
            raise AssertionError(f"batch[{name!r}] is {leaf.shape} {leaf.dtype}, spec {spec}")
    return state, batch


def token_batch_spec(seq_len: int, batch_size: int) -> dict[str, jax.ShapeDtypeStruct]:
    """Shapes of a language-model batch: ``{"tokens", "targets"}``, both ``int32[B, S]``.

    Example:
        >>> token_batch_spec(16, 2)["tokens"].shape
        (2, 16)
    """
    shape = (batch_size, seq_len)
    return {k: jax.ShapeDtypeStruct(shape, jnp.int32) for k in ("tokens", "targets")}


def random_token_batch(
    seq_len: int, vocab_size: int, batch_size: int, key: jax.Array
) -> dict[str, jax.Array]:
    """Uniform random tokens; targets are the tokens shifted left by one (next token)."""
    seq = jax.random.randint(key, (batch_size, seq_len + 1), 0, vocab_size).astype(jnp.int32)
    return {"tokens": seq[:, :-1], "targets": seq[:, 1:]}
