"""PRNG keys, Python-int counters and dropout in steps that are microbatched or pipelined.

A ``TrainState`` holds its step as a Python ``int`` and often a PRNG key it splits every
step; dropout draws its mask from such a key. The expected values come from the same
step run by ``jax.jit`` on one device.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import autopar
from autopar import SearchOptions, baselines
from autopar.lower.split import AccumulateError, microbatch_args, plan_accumulation
from tests.lower._zoo import LOSS_RTOL


def _noisy_step(typed: bool):
    """Four tanh layers whose weights get noise from ``fold_in(key, layer)`` (random bits
    that do not depend on the batch); the state's key is split every step and its
    counter is a Python int."""
    tx = optax.sgd(0.1)

    def loss_fn(ws, key, b):
        h = b["x"]
        for i, w in enumerate(ws):
            h = jnp.tanh(h @ (w + 1e-2 * jax.random.normal(jax.random.fold_in(key, i), w.shape)))
        return jnp.mean((h - b["y"]) ** 2)

    def step(state, batch):
        key, sub = jax.random.split(state["key"])
        loss, g = jax.value_and_grad(loss_fn)(state["w"], sub, batch)
        upd, opt = tx.update(g, state["opt"], state["w"])
        new = {"w": optax.apply_updates(state["w"], upd), "opt": opt}
        return {**new, "key": key, "step": state["step"] + 1}, loss

    ks = jax.random.split(jax.random.key(0), 6)
    ws = [jax.random.normal(ks[i], (8, 8)) / 3 for i in range(4)]
    key = jax.random.key(1) if typed else jax.random.PRNGKey(1)
    state = {"w": ws, "opt": tx.init(ws), "key": key, "step": 0}
    batch = {"x": jax.random.normal(ks[4], (16, 8)), "y": jax.random.normal(ks[5], (16, 8))}
    return step, (state, batch)


def _key_bits(key):
    return np.asarray(
        jax.random.key_data(key) if jnp.issubdtype(key.dtype, jax.dtypes.prng_key) else key
    )


@pytest.mark.parametrize("typed", [True, False], ids=["typed-key", "uint32-key"])
@pytest.mark.parametrize(
    "mesh", [{"pipe": 2, "data": 4}, {"data": 8}], ids=["pipeline", "accumulate"]
)
def test_a_key_and_a_counter_in_the_state_come_out_as_on_one_device(typed, mesh):
    step, args = _noisy_step(typed)
    want_state, want_loss = jax.jit(step)(*args)
    f = autopar.autoparallel(step, options=SearchOptions(mesh=mesh, microbatches=2), cache=False)
    got_state, got_loss = f(*args)
    plan = f.plan_for(*args)
    assert plan.pipeline.microbatches == 2
    assert plan.pipeline.num_stages == mesh.get("pipe", 1)
    np.testing.assert_allclose(float(got_loss), float(want_loss), rtol=LOSS_RTOL)
    for a, b in zip(got_state["w"], want_state["w"], strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    # Bit for bit: a key or a counter averaged over microbatches through a float would not be.
    np.testing.assert_array_equal(_key_bits(got_state["key"]), _key_bits(want_state["key"]))
    assert int(got_state["step"]) == 1


def _dropout_step(per_example_keys: bool):
    tx = optax.sgd(0.1)

    def loss_fn(w, b):
        h = jnp.tanh(b["x"] @ w)
        if per_example_keys:  # one key per example, split with the batch
            keep = jax.vmap(lambda k, r: jax.random.bernoulli(k, 0.9, r.shape))(b["keys"], h)
        else:
            keep = jax.random.bernoulli(b["key"], 0.9, h.shape)
        return jnp.mean((jnp.where(keep, h / 0.9, 0.0) - b["y"]) ** 2)

    def step(state, batch):
        loss, g = jax.value_and_grad(loss_fn)(state["w"], batch)
        upd, opt = tx.update(g, state["opt"], state["w"])
        return {"w": optax.apply_updates(state["w"], upd), "opt": opt}, loss

    ks = jax.random.split(jax.random.key(0), 3)
    w = jax.random.normal(ks[0], (8, 8)) / 3
    batch = {"x": jax.random.normal(ks[1], (16, 8)), "y": jax.random.normal(ks[2], (16, 8))}
    if per_example_keys:
        batch["keys"] = jax.random.split(jax.random.key(7), 16)
    else:
        batch["key"] = jax.random.key(7)
    return step, ({"w": w, "opt": tx.init(w)}, batch)


def test_dropout_drawn_from_one_key_is_not_microbatched():
    # A microbatch of 8 would draw an 8-row mask from the key, not rows 0-7 (or 8-15) of
    # the whole batch's 16-row mask: the step would change.
    step, args = _dropout_step(per_example_keys=False)
    with pytest.raises(AccumulateError, match="random_bits .* one key"):
        plan_accumulation(step, args, 2)
    with pytest.raises(AccumulateError, match="random bits"):
        autopar.plan(step, *args, options=SearchOptions(mesh={"data": 8}, microbatches=2))


def test_dropout_drawn_from_per_example_keys_is_microbatched_exactly():
    step, args = _dropout_step(per_example_keys=True)
    want_state, want_loss = jax.jit(step)(*args)
    f = autopar.autoparallel(
        step, options=SearchOptions(mesh={"data": 8}, microbatches=2), cache=False
    )
    got_state, got_loss = f(*args)
    assert f.plan_for(*args).pipeline.microbatches == 2
    np.testing.assert_allclose(float(got_loss), float(want_loss), rtol=LOSS_RTOL)
    np.testing.assert_allclose(got_state["w"], want_state["w"], rtol=1e-5, atol=1e-6)


def test_microbatch_args_keep_python_scalars_and_typed_keys():
    state = {"step": 0, "key": jax.random.key(3), "lr": 0.5}
    batch = jnp.zeros((8, 3))
    (b, s) = microbatch_args((batch, state), batch_inputs=[0], m=4)
    assert (b.shape, str(b.dtype)) == ((2, 3), "float32")
    assert (s["step"].shape, str(s["step"].dtype), s["step"].weak_type) == ((), "int32", True)
    assert (s["lr"].shape, str(s["lr"].dtype), s["lr"].weak_type) == ((), "float32", True)
    assert s["key"].dtype == jax.random.key(0).dtype and s["key"].shape == ()


def test_baselines_take_a_python_int_and_a_typed_key():
    step, args = _noisy_step(typed=True)
    plan = baselines.data_parallel(step, {"data": 8}, *args)
    dtypes = {t.path: t.dtype for t in plan.inputs}
    assert dtypes["state/step"] == "int32"
    assert dtypes["state/key"] == "key<fry>"
    assert dtypes["batch/x"] == "float32"


def test_verify_and_checkpoints_take_a_typed_key_in_the_state(tmp_path):
    """``verify`` counts a typed key's state bytes (two uint32 words, by hand: the state
    is 4 x 8 x 8 float32 weights, no optimizer state (SGD), an 8-byte key and the
    counter), and a checkpoint restores the key under the plan bit for bit."""
    from autopar import checkpoint
    from autopar.verify.report import state_bytes_per_device

    step, (state, batch) = _noisy_step(typed=True)
    f = autopar.autoparallel(step, options=SearchOptions(mesh={"data": 8}), cache=False)
    plan = f.plan_for(state, batch)
    report = f.verify(state, batch)  # raised TypeError: data type 'key<fry>' not understood
    assert report.memory is not None
    split = [r for r in plan.inputs if r.role in ("param", "opt_state") and any(r.spec)]
    assert not split, "the expected bytes below assume the tiny state stays whole"
    assert state_bytes_per_device(plan) == 4 * 8 * 8 * 4 + 8 + 4
    checkpoint.save(tmp_path / "run", state, plan, step=0)
    back = checkpoint.restore(tmp_path / "run", plan, like=state)
    assert back["key"].dtype == state["key"].dtype
    np.testing.assert_array_equal(_key_bits(back["key"]), _key_bits(state["key"]))
