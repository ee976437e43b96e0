"""Small plain-JAX training steps for the search tests (Adam via optax)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax


def adam_step(loss_fn, lr: float = 1e-3):
    """``step(state, batch) -> (new_state, loss)`` with ``state = {"params", "opt_state"}``."""
    tx = optax.adam(lr)

    def step(state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(state["params"], batch)
        updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        return {"params": params, "opt_state": opt_state}, loss

    return step, tx


def abstract_state(params, tx):
    """Abstract ``{"params", "opt_state"}`` for ``params`` (a pytree of ShapeDtypeStruct)."""
    opt_state = jax.eval_shape(tx.init, params)
    return {"params": params, "opt_state": opt_state}


def mlp(batch: int, d: int, h: int, dtype=jnp.float32):
    """A 2-layer MLP ``relu(x @ w1) @ w2`` regressing ``y``: (step, (state, batch))."""

    def loss_fn(p, b):
        hid = jax.nn.relu(b["x"] @ p["w1"])
        return jnp.mean((hid @ p["w2"] - b["y"]) ** 2)

    step, tx = adam_step(loss_fn)
    params = {
        "w1": jax.ShapeDtypeStruct((d, h), dtype),
        "w2": jax.ShapeDtypeStruct((h, d), dtype),
    }
    data = {"x": jax.ShapeDtypeStruct((batch, d), dtype), "y": jax.ShapeDtypeStruct((batch, d), dtype)}
    return step, (abstract_state(params, tx), data)
