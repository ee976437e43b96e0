"""Everything legal in ``jax.jit`` stays legal through ``autopar.autoparallel(step)(...)``.

Each test runs a decorated step on the 8 simulated CPU devices and compares it with the
same step under single-device ``jax.jit`` (the expected values): integers, booleans and
PRNG key data exactly, float32 to ``rtol=1e-5`` (DESIGN.md), bfloat16 to its own
precision. Steps whose plan could split something get a memory bound the replicated step
does not fit (``_splitting``: 40% of the replicated plan's predicted footprint), so their
plan has to shard; the test asserts what it shards (a test that passes on a fully
replicated plan would prove nothing about sharding).
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autopar
from autopar.errors import MatchSignatureError, ReplicatedControlFlowWarning

F32_RTOL, F32_ATOL = 1e-5, 1e-6  # DESIGN.md: f32 to 1e-5 (atol for values near zero)
BF16_RTOL = 2**-6  # bf16 keeps 8 mantissa bits; a sharded sum adds in another order
MESH = {"data": 8}
B = 512  # batch: divisible by 8, large enough that the activations dominate memory
SPLIT = 0.4  # memory bound, as a fraction of what the replicated plan needs
DATA = ("data", None)  # the spec of a batch split over data


# ------------------------------------------------------------------------------ helpers


def _params(d_in: int = 32, hidden: int = 128, d_out: int = 32, dtype=jnp.float32) -> dict:
    k1, k2 = jax.random.split(jax.random.PRNGKey(0))
    return {
        "w1": (jax.random.normal(k1, (d_in, hidden)) / np.sqrt(d_in)).astype(dtype),
        "w2": (jax.random.normal(k2, (hidden, d_out)) / np.sqrt(hidden)).astype(dtype),
    }


def _batch(n: int = B, d_in: int = 32, d_out: int = 32, dtype=jnp.float32) -> tuple:
    kx, ky = jax.random.split(jax.random.PRNGKey(1))
    return (
        jax.random.normal(kx, (n, d_in)).astype(dtype),
        jax.random.normal(ky, (n, d_out)).astype(dtype),
    )


def _loss(p: dict, x: jax.Array, y: jax.Array) -> jax.Array:
    h = jnp.tanh(x @ p["w1"])
    return jnp.mean((h @ p["w2"] - y) ** 2)


def _sgd(p: dict, g: dict, lr) -> dict:
    return jax.tree.map(lambda a, b: a - lr * b, p, g)


def step(p: dict, x: jax.Array, y: jax.Array) -> tuple[dict, jax.Array]:
    """The base train step: one SGD step of a 2-layer MLP."""
    loss, g = jax.value_and_grad(_loss)(p, x, y)
    return _sgd(p, g, 0.1), loss


def _splitting(
    fn, *args, ap_kwargs: dict | None = None, frac: float = SPLIT, **kwargs
) -> autopar.SearchOptions:
    """Options under which the replicated plan of ``fn(*args, **kwargs)`` does not fit:
    ``frac`` of the memory the plan without a bound predicts."""
    probe = autopar.autoparallel(
        fn,
        cluster="cpu-sim",
        options=autopar.SearchOptions(mesh=MESH),
        cache=False,
        **(ap_kwargs or {}),
    )
    need = probe.plan_for(*args, **kwargs).predicted.memory_bytes_per_device
    return autopar.SearchOptions(mesh=MESH, memory_limit_bytes=int(frac * need))


def _decorate(fn, options: autopar.SearchOptions | None = None, **ap_kwargs):
    return autopar.autoparallel(
        fn,
        cluster="cpu-sim",
        options=options or autopar.SearchOptions(mesh=MESH),
        cache=False,
        **ap_kwargs,
    )


def _assert_same(got, want) -> None:
    """Leaf by leaf: same structure, shapes, dtypes; ints/bools/keys exact, floats close."""
    got_leaves, got_tree = jax.tree.flatten(got)
    want_leaves, want_tree = jax.tree.flatten(want)
    assert got_tree == want_tree
    for g, w in zip(got_leaves, want_leaves, strict=True):
        assert g.shape == w.shape and g.dtype == w.dtype, (g.shape, g.dtype, w.shape, w.dtype)
        if jax.dtypes.issubdtype(w.dtype, jax.dtypes.prng_key):
            np.testing.assert_array_equal(jax.random.key_data(g), jax.random.key_data(w))
        elif w.dtype == jnp.bfloat16:
            np.testing.assert_allclose(
                np.asarray(g, np.float32), np.asarray(w, np.float32), rtol=BF16_RTOL, atol=1e-3
            )
        elif jnp.issubdtype(w.dtype, jnp.floating):
            np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=F32_RTOL, atol=F32_ATOL)
        else:
            np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def _specs(plan) -> dict[str, tuple]:
    return {r.path: tuple(r.spec) for r in plan.inputs}


# ------------------------------------------------------------------------- arguments


def test_positional_and_keyword_arguments_share_one_plan():
    p, (x, y) = _params(), _batch()
    f = _decorate(step, _splitting(step, p, x, y))
    want = jax.jit(step)(p, x, y)
    for args, kwargs in [((p, x, y), {}), ((p,), {"x": x, "y": y}), ((), {"p": p, "x": x, "y": y})]:
        _assert_same(jax.jit(step)(*args, **kwargs), want)  # legal in jax.jit ...
        _assert_same(f(*args, **kwargs), want)  # ... and through autopar
    # Keywords bound to their positions: one signature, one plan, the batch split.
    plan = f.plan_for(p, x=x, y=y)
    assert plan == f.plan_for(p, x, y)
    assert len(f._entries) == 1
    specs = _specs(plan)
    assert specs["x"] == DATA and specs["y"] == DATA
    assert specs["p/w1"] == (None, None)


def test_keyword_only_arguments():
    def kw_step(p, x, *, y, lr):
        loss, g = jax.value_and_grad(_loss)(p, x, y)
        return _sgd(p, g, lr), loss

    p, (x, y) = _params(), _batch()
    lr = jnp.float32(0.05)
    f = _decorate(kw_step, _splitting(kw_step, p, x, y=y, lr=lr))
    _assert_same(f(p, x, y=y, lr=lr), jax.jit(kw_step)(p, x, y=y, lr=lr))
    specs = _specs(f.plan_for(p, x, y=y, lr=lr))
    assert specs["x"] == DATA and specs["kwargs/y"] == DATA
    assert specs["kwargs/lr"] == ()


def test_none_leaves():
    def none_step(p, batch, extra):
        assert extra is None and batch["mask"] is None and p["unused"] is None
        loss, g = jax.value_and_grad(_loss)({"w1": p["w1"], "w2": p["w2"]}, batch["x"], batch["y"])
        return {**_sgd({"w1": p["w1"], "w2": p["w2"]}, g, 0.1), "unused": None}, loss

    p = {**_params(), "unused": None}
    x, y = _batch()
    batch = {"x": x, "y": y, "mask": None}
    f = _decorate(none_step, _splitting(none_step, p, batch, None))
    out = f(p, batch, None)
    _assert_same(out, jax.jit(none_step)(p, batch, None))
    assert out[0]["unused"] is None
    assert _specs(f.plan_for(p, batch, None))["batch/x"] == DATA


def test_python_scalars():
    def scalar_step(p, x, y, lr, steps):
        loss, g = jax.value_and_grad(_loss)(p, x, y)
        return _sgd(p, g, lr), loss * steps

    p, (x, y) = _params(), _batch()
    f = _decorate(scalar_step, _splitting(scalar_step, p, x, y, 0.1, 3))
    _assert_same(f(p, x, y, 0.1, 3), jax.jit(scalar_step)(p, x, y, 0.1, 3))
    # A Python number is a dynamic argument, as in jax.jit: another value, same program.
    _assert_same(f(p, x, y, 0.5, 2), jax.jit(scalar_step)(p, x, y, 0.5, 2))
    assert len(f._entries) == 1
    specs = _specs(f.plan_for(p, x, y, 0.1, 3))
    assert specs["x"] == DATA and specs["lr"] == () and specs["steps"] == ()


def test_static_argnums_and_static_argnames():
    def static_step(p, x, y, n, activation):
        act = {"tanh": jnp.tanh, "relu": jax.nn.relu}[activation]

        def loss(p):
            return jnp.mean((act(x @ p["w1"]) @ p["w2"] - y) ** 2)

        for _ in range(n):  # a Python loop: n must be static
            value, g = jax.value_and_grad(loss)(p)
            p = _sgd(p, g, 0.1)
        return p, value

    p, (x, y) = _params(), _batch()
    # jax.jit completes the names from the positions only when no names are given.
    ref = jax.jit(static_step, static_argnums=(3, 4))
    ap = {"static_argnums": 3, "static_argnames": "activation"}
    f = _decorate(
        static_step,
        _splitting(static_step, p, x, y, 2, activation="tanh", ap_kwargs=ap),
        **ap,
    )
    _assert_same(f(p, x, y, 2, activation="tanh"), ref(p, x, y, 2, activation="tanh"))
    # Another static value is another program, as in jax.jit; by name or by position.
    _assert_same(f(p, x, y, n=1, activation="relu"), ref(p, x, y, n=1, activation="relu"))
    _assert_same(f(p, x, y, 1, "relu"), ref(p, x, y, 1, "relu"))
    assert len(f._entries) == 2
    specs = _specs(f.plan_for(p, x, y, 2, activation="tanh"))
    assert "n" not in specs and "activation" not in specs  # baked in, not inputs
    assert specs["x"] == DATA


# ---------------------------------------------------------------------------- dtypes


def test_integer_bool_int8_and_bf16_inputs():
    def mixed_step(p, tokens, mask, q, scale, y):
        # int32 tokens index an embedding, a bool mask zeroes rows, int8 weights are
        # dequantised, bf16 parameters are trained; integer results are returned too.
        def loss(p):
            h = p["embed"][tokens].astype(jnp.float32) * mask[:, None]
            h = h @ (q.astype(jnp.float32) * scale)
            out = (h @ p["head"].astype(jnp.float32)).astype(jnp.bfloat16)
            return jnp.mean((out.astype(jnp.float32) - y) ** 2)

        loss_value, g = jax.value_and_grad(loss)(p)
        new_p = jax.tree.map(lambda a, b: (a - 0.1 * b).astype(a.dtype), p, g)
        return new_p, loss_value, jnp.sum(mask.astype(jnp.int32)), jnp.argmax(tokens)

    k = jax.random.split(jax.random.PRNGKey(2), 4)
    p = {
        "embed": jax.random.normal(k[0], (64, 32)).astype(jnp.bfloat16),
        "head": (jax.random.normal(k[1], (128, 32)) / 8).astype(jnp.bfloat16),
    }
    tokens = jax.random.randint(k[2], (B,), 0, 64, dtype=jnp.int32)
    mask = (jnp.arange(B) % 3) != 0
    q = jax.random.randint(k[3], (32, 128), -127, 128, dtype=jnp.int32).astype(jnp.int8)
    scale = jnp.float32(0.01)
    y = jnp.ones((B, 32), jnp.float32)
    args = (p, tokens, mask, q, scale, y)
    # Under the bound the targets (and the activations they meet) are split over data.
    f = _decorate(mixed_step, _splitting(mixed_step, *args))
    got = f(*args)
    want = jax.jit(mixed_step)(*args)
    _assert_same(got, want)
    assert got[0]["embed"].dtype == jnp.bfloat16 and got[2].dtype == jnp.int32
    specs = _specs(f.plan_for(*args))
    assert specs["y"] == DATA
    assert specs["p/embed"] in (DATA, (None, None))  # its rows may be split too
    assert specs["mask"] in ((None,), ("data",)) and specs["q"] == (None, None)


def test_zero_d_arrays():
    def counter_step(p, x, y, lr, count):
        loss, g = jax.value_and_grad(_loss)(p, x, y)
        return _sgd(p, g, lr), loss, count + 1

    p, (x, y) = _params(), _batch()
    args = (p, x, y, jnp.float32(0.1), jnp.int32(41))
    f = _decorate(counter_step, _splitting(counter_step, *args))
    got = f(*args)
    _assert_same(got, jax.jit(counter_step)(*args))
    assert got[2].shape == () and int(got[2]) == 42
    specs = _specs(f.plan_for(*args))
    assert specs["lr"] == () and specs["count"] == () and specs["x"] == DATA


def test_shapes_no_mesh_axis_divides():
    p = _params(d_in=7, hidden=13, d_out=3)
    x, y = _batch(n=13, d_in=7, d_out=3)
    f = _decorate(step)
    _assert_same(f(p, x, y), jax.jit(step)(p, x, y))
    plan = f.plan_for(p, x, y)
    # Nothing of size 7, 13 or 3 can be split over 8 devices: every layout is whole.
    assert all(spec == (None,) * len(spec) for spec in _specs(plan).values())


# ----------------------------------------------------------------------- control flow


def test_lax_cond():
    def cond_step(p, x, y):
        loss, g = jax.value_and_grad(_loss)(p, x, y)
        # Clip: one branch or the other, chosen on a traced value.
        g = jax.lax.cond(loss > 0.5, lambda g: jax.tree.map(lambda a: 0.5 * a, g), lambda g: g, g)
        return _sgd(p, g, 0.1), loss

    p, (x, y) = _params(), _batch()
    # The cond over the gradients runs replicated, and says so.
    with pytest.warns(ReplicatedControlFlowWarning, match=r"\(cond \(x1\)\)"):
        f = _decorate(cond_step, _splitting(cond_step, p, x, y))
        got = f(p, x, y)
    _assert_same(got, jax.jit(cond_step)(p, x, y))
    _assert_same(f(p, 0.01 * x, 0.01 * y), jax.jit(cond_step)(p, 0.01 * x, 0.01 * y))
    assert _specs(f.plan_for(p, x, y))["x"] == DATA


def test_fori_loop_and_while_loop():
    def fori_step(p, x, y):
        def body(_, carry):
            p, _ = carry
            loss, g = jax.value_and_grad(_loss)(p, x, y)
            return _sgd(p, g, 0.1), loss

        return jax.lax.fori_loop(0, 3, body, (p, jnp.float32(0)))

    def while_step(p, x, y):
        def body(carry):
            p, _, i = carry
            loss, g = jax.value_and_grad(_loss)(p, x, y)
            return _sgd(p, g, 0.1), loss, i + 1

        p, loss, i = jax.lax.while_loop(lambda c: c[2] < 3, body, (p, jnp.float32(0), 0))
        return p, loss, i

    p, (x, y) = _params(), _batch()
    # fori_loop (a scan of known length): under the bound the loop body's weights are
    # split over data, Megatron-style (w1 by columns, w2 by rows), the batch kept whole.
    f = _decorate(fori_step, _splitting(fori_step, p, x, y))
    with warnings.catch_warnings():
        warnings.simplefilter("error", ReplicatedControlFlowWarning)  # a scan: sharded
        got = f(p, x, y)
    _assert_same(got, jax.jit(fori_step)(p, x, y))
    specs = _specs(f.plan_for(p, x, y))
    assert specs["p/w1"] == (None, "data") and specs["p/w2"] == DATA
    assert specs["x"] == (None, None)
    # while_loop: the search finds no plan under any bound below the replicated footprint
    # (its smallest is above it), so this one runs the replicated plan it picks unbounded.
    f = _decorate(while_step)
    with pytest.warns(ReplicatedControlFlowWarning, match=r"\(while \(x1\)\)"):
        got = f(p, x, y)
    _assert_same(got, jax.jit(while_step)(p, x, y))
    assert all(spec == (None,) * len(spec) for spec in _specs(f.plan_for(p, x, y)).values())


def test_scan_over_microbatches():
    def scan_step(p, x, y):
        def body(p, xy):
            loss, g = jax.value_and_grad(_loss)(p, *xy)
            return _sgd(p, g, 0.1), loss

        return jax.lax.scan(body, p, (x.reshape(4, B // 4, -1), y.reshape(4, B // 4, -1)))

    p, (x, y) = _params(), _batch()
    f = _decorate(scan_step, _splitting(scan_step, p, x, y))
    got = f(p, x, y)
    _assert_same(got, jax.jit(scan_step)(p, x, y))
    assert got[1].shape == (4,)
    specs = _specs(f.plan_for(p, x, y))
    # Under the bound the batch is split: over its examples, or (when a microbatch of 128
    # rows does not split 8 ways in the scan's reshape) over its features.
    assert specs["x"] in (DATA, (None, "data")), specs["x"]
    assert specs["y"] == specs["x"]  # one batch, one layout


def test_custom_vjp_and_checkpoint_inside_the_model():
    @jax.custom_vjp
    def clipped_tanh(h):
        return jnp.tanh(h)

    def fwd(h):
        t = jnp.tanh(h)
        return t, t

    def bwd(t, g):
        return (jnp.clip(g * (1 - t**2), -1.0, 1.0),)

    clipped_tanh.defvjp(fwd, bwd)

    def model_step(p, x, y):
        layer = jax.checkpoint(lambda w, h: clipped_tanh(h @ w))

        def loss(p):
            return jnp.mean((layer(p["w1"], x) @ p["w2"] - y) ** 2)

        value, g = jax.value_and_grad(loss)(p)
        return _sgd(p, g, 0.1), value

    p, (x, y) = _params(), _batch()
    f = _decorate(model_step, _splitting(model_step, p, x, y))
    _assert_same(f(p, x, y), jax.jit(model_step)(p, x, y))
    assert _specs(f.plan_for(p, x, y))["x"] == DATA


# ---------------------------------------------------------------------- RNG, donation


@pytest.mark.parametrize("new_style", [False, True], ids=["uint32-key", "typed-key"])
def test_rng_keys(new_style):
    def dropout_step(p, x, y, key):
        key, sub = jax.random.split(key)

        def loss(p):
            h = jnp.tanh(x @ p["w1"])
            keep = jax.random.bernoulli(sub, 0.9, h.shape)
            return jnp.mean((jnp.where(keep, h / 0.9, 0.0) @ p["w2"] - y) ** 2)

        value, g = jax.value_and_grad(loss)(p)
        return _sgd(p, g, 0.1), value, key

    p, (x, y) = _params(), _batch()
    key = jax.random.key(0) if new_style else jax.random.PRNGKey(0)
    f = _decorate(dropout_step, _splitting(dropout_step, p, x, y, key))
    got = f(p, x, y, key)
    _assert_same(got, jax.jit(dropout_step)(p, x, y, key))
    if new_style:
        assert jax.dtypes.issubdtype(got[2].dtype, jax.dtypes.prng_key)
        assert str(f.plan_for(p, x, y, key).input("key").dtype) == "key<fry>"
    assert _specs(f.plan_for(p, x, y, key))["x"] == DATA


def test_a_batch_of_typed_keys_is_split_with_the_batch():
    def per_example_noise(p, x, y, keys):
        noise = jax.vmap(lambda k: jax.random.normal(k, (x.shape[1],)))(keys)
        return step(p, x + 0.01 * noise, y)

    p, (x, y) = _params(), _batch()
    keys = jax.random.split(jax.random.key(3), B)
    f = _decorate(per_example_noise, _splitting(per_example_noise, p, x, y, keys))
    _assert_same(f(p, x, y, keys), jax.jit(per_example_noise)(p, x, y, keys))
    specs = _specs(f.plan_for(p, x, y, keys))
    # The batch is split; the keys stay whole (random bits are generated replicated).
    assert specs["x"] == DATA and specs["keys"] == (None,)


@pytest.mark.parametrize("how", ["argnums", "argnames"])
def test_donated_arguments(how):
    p, (x, y) = _params(), _batch()
    want = jax.jit(step)(p, x, y)
    ap = {"donate_argnums": 0} if how == "argnums" else {"donate_argnames": "p"}
    f = _decorate(step, _splitting(step, p, x, y), **ap)
    placed = f.lower(p, x, y).place_inputs((p, x, y))
    got = f(*placed)
    _assert_same(got, want)
    # The planned-layout state was donated (its buffers reused); the batch was not, and
    # the user's own arrays never are.
    assert all(a.is_deleted() for a in jax.tree.leaves(placed[0]))
    assert not placed[1].is_deleted()
    assert not any(a.is_deleted() for a in jax.tree.leaves(p))
    # The loop a user writes: feed the returned state back in, donated each step.
    ref_p, s = want[0], got[0]
    for _ in range(2):
        ref_p, ref_loss = jax.jit(step)(ref_p, x, y)
        s, loss = f(s, x, y)
    _assert_same((s, loss), (ref_p, ref_loss))


# -------------------------------------------------------------------- repeated calls


def test_later_calls_reuse_the_program_and_replan_for_new_signatures():
    p, (x, y) = _params(), _batch()
    f = _decorate(step, _splitting(step, p, x, y))
    s, _ = f(p, x, y)
    assert f._fast is not None  # plain positional calls go straight to the jitted program
    s2, loss2 = f(s, x, y)
    _assert_same((s2, loss2), jax.jit(step)(*jax.jit(step)(p, x, y)[:1], x, y))
    assert len(f._entries) == 1
    # Another batch size: the program refuses it while tracing, and a new plan is made.
    x2, y2 = _batch(n=2 * B)
    _assert_same(f(p, x2, y2), jax.jit(step)(p, x2, y2))
    assert len(f._entries) == 2
    with pytest.raises(MatchSignatureError, match=r"input leaf 2 \(x\) is \(1024, 32\)"):
        f.lower(p, x, y).jitted(p, x2, y2)
    # Inputs committed to another layout (whole arrays on one device) are moved.
    one = jax.devices()[1]
    committed = jax.device_put((p, x, y), one)
    _assert_same(f(*committed), jax.jit(step)(p, x, y))


def test_called_inside_an_outer_jit():
    p, (x, y) = _params(), _batch()
    f = _decorate(step, _splitting(step, p, x, y))
    f(p, x, y)

    @jax.jit
    def two_steps(p, x, y):
        p, _ = f(p, x, y)
        return f(p, x, y)

    ref = jax.jit(step)
    _assert_same(two_steps(p, x, y), ref(*ref(p, x, y)[:1], x, y))
