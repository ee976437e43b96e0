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
    data = {
        "x": jax.ShapeDtypeStruct((batch, d), dtype),
        "y": jax.ShapeDtypeStruct((batch, d), dtype),
    }
    return step, (abstract_state(params, tx), data)


def moe(groups: int, tokens: int, d: int, h: int, experts: int, capacity: int, dtype=jnp.float32):
    """A GShard-style top-1 mixture-of-experts layer: dispatch einsum -> per-expert MLP ->
    combine einsum. Returns (step, (state, batch))."""

    def loss_fn(p, b):
        x = b["x"]  # [G, S, M]
        logits = jnp.einsum("gsm,me->gse", x, p["gate"])
        probs = jax.nn.softmax(logits, axis=-1)
        expert = jax.nn.one_hot(jnp.argmax(logits, axis=-1), experts, dtype=dtype)  # [G,S,E]
        slot = jax.nn.one_hot(jnp.arange(tokens) % capacity, capacity, dtype=dtype)  # [S,C]
        dispatch = expert[..., None] * slot[None, :, None, :]  # [G,S,E,C]
        combine = dispatch * probs[..., None]
        expert_in = jnp.einsum("gsec,gsm->egcm", dispatch, x)
        hid = jax.nn.relu(jnp.einsum("egcm,emh->egch", expert_in, p["w_in"]))
        expert_out = jnp.einsum("egch,ehm->egcm", hid, p["w_out"])
        y = jnp.einsum("gsec,egcm->gsm", combine, expert_out)
        return jnp.mean((y - b["y"]) ** 2)

    step, tx = adam_step(loss_fn)
    params = {
        "gate": jax.ShapeDtypeStruct((d, experts), dtype),
        "w_in": jax.ShapeDtypeStruct((experts, d, h), dtype),
        "w_out": jax.ShapeDtypeStruct((experts, h, d), dtype),
    }
    shape = (groups, tokens, d)
    data = {"x": jax.ShapeDtypeStruct(shape, dtype), "y": jax.ShapeDtypeStruct(shape, dtype)}
    return step, (abstract_state(params, tx), data)
