"""Numeric precision policies and the (mixed-precision) AdamW optimizer shared by the zoo.

Two policies:

* ``"fp32"``: parameters, activations, gradients and Adam moments are all float32; the
  optimizer state is plain ``optax.adamw`` state.
* ``"mixed"`` (Megatron-LM / ZeRO style): parameters are *stored* in bfloat16 in
  ``state["params"]``, forward and backward run in bfloat16 (softmax and loss in float32),
  gradients come out in bfloat16. The optimizer keeps a float32 master copy and float32
  Adam moments: ``opt_state = {"master": fp32 params, "adam": optax adamw state}``. One
  update upcasts the gradients, steps AdamW on the master copy and re-casts it to bfloat16.

Under ``"mixed"`` the model state is exactly 2 (params) + 2 (grads) + 4 + 4 + 4 (master,
momentum, variance) = 16 bytes per parameter, the ZeRO paper's ``(2 + 2 + K) Psi`` with
``K = 12``; ``params`` + ``opt_state`` hold 14 of them (plus one int32 step counter).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal, get_args

import jax
import jax.numpy as jnp
import optax

Precision = Literal["mixed", "fp32"]
PRECISIONS: tuple[str, ...] = get_args(Precision)

PyTree = Any


def check_precision(precision: str) -> None:
    """Raise ``ValueError`` unless ``precision`` is one of :data:`PRECISIONS`.

    Example:
        >>> check_precision("mixed")
    """
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r} is not supported; use one of {PRECISIONS}")


def compute_dtype(precision: Precision) -> jnp.dtype:
    """The dtype activations (and stored parameters) use under ``precision``.

    Example:
        >>> compute_dtype("mixed")
        dtype(bfloat16)
    """
    check_precision(precision)
    return jnp.dtype(jnp.bfloat16 if precision == "mixed" else jnp.float32)


@dataclasses.dataclass(frozen=True)
class AdamW:
    """AdamW with an optional fp32 master copy of bf16 parameters.

    ``init`` takes float32 parameters (as a model's ``init`` makes them) and returns the
    stored parameters and the optimizer state; ``update`` takes the gradients (same dtype
    as the stored parameters) and returns the new parameters and optimizer state, with
    exactly the same pytree structure, shapes and dtypes as before.

    Attributes:
        precision: ``"fp32"`` or ``"mixed"``.
        learning_rate: constant AdamW learning rate.
        weight_decay: decoupled weight decay (optax applies it to every parameter).

    Example:
        >>> opt = AdamW("mixed")
        >>> params, opt_state = opt.init({"w": jnp.ones((2, 2))})
        >>> params["w"].dtype, opt_state["master"]["w"].dtype
        (dtype(bfloat16), dtype('float32'))
    """

    precision: Precision = "fp32"
    learning_rate: float = 1e-3
    weight_decay: float = 0.01

    def __post_init__(self) -> None:
        check_precision(self.precision)
        if not self.learning_rate > 0:
            raise ValueError(f"learning_rate={self.learning_rate} must be > 0")
        if self.weight_decay < 0:
            raise ValueError(f"weight_decay={self.weight_decay} must be >= 0")

    @property
    def _tx(self) -> optax.GradientTransformation:
        return optax.adamw(self.learning_rate, weight_decay=self.weight_decay)

    def init(self, master_params: PyTree) -> tuple[PyTree, PyTree]:
        """Return ``(params, opt_state)`` from float32 parameters."""
        master = jax.tree.map(lambda p: p.astype(jnp.float32), master_params)
        if self.precision == "fp32":
            return master, self._tx.init(master)
        params = jax.tree.map(lambda p: p.astype(jnp.bfloat16), master)
        return params, {"master": master, "adam": self._tx.init(master)}

    def update(self, grads: PyTree, opt_state: PyTree, params: PyTree) -> tuple[PyTree, PyTree]:
        """Apply one AdamW step; returns ``(new_params, new_opt_state)``."""
        if self.precision == "fp32":
            updates, new_state = self._tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), new_state
        # Upcast the bf16 gradients and step the fp32 master copy: small updates that
        # bf16 would round away still accumulate in the master weights.
        grads32 = jax.tree.map(lambda g: g.astype(jnp.float32), grads)
        master = opt_state["master"]
        updates, adam = self._tx.update(grads32, opt_state["adam"], master)
        master = optax.apply_updates(master, updates)
        new_params = jax.tree.map(lambda m, p: m.astype(p.dtype), master, params)
        return new_params, {"master": master, "adam": adam}

    def step_count(self, opt_state: PyTree) -> jax.Array:
        """The number of updates applied so far (optax's int32 ``count``)."""
        return optax.tree_utils.tree_get(opt_state, "count")
