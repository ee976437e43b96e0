"""evaluate_inlined: the inlined jaxpr computes fn, and hooks see (and can change) values."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from autopar.errors import TraceFunctionError
from autopar.trace import as_function, evaluate_inlined, trace


def test_hook_sees_every_node_and_its_return_is_used():
    def f(x):
        return jnp.sin(x) * 2.0

    x = jnp.array([0.1, 0.5, 1.0])
    g = trace(f, x)
    seen = []

    def hook(node, outs):
        seen.append(node.id)
        return [o * 2.0 for o in outs] if node.primitive == "sin" else outs

    (out,) = evaluate_inlined(g, x, hook=hook)
    assert seen == [0, 1]
    np.testing.assert_allclose(out, 4.0 * np.sin(np.asarray(x)), rtol=1e-6)
    np.testing.assert_allclose(as_function(g)(x), f(x), rtol=1e-6)


def _loops(x):
    def body(c, xs):
        return c + xs, c * 1.0

    c, ys = jax.lax.scan(body, x, jnp.ones((3,) + x.shape))
    c = jax.lax.cond(c.sum() > 0, lambda a: a * 2.0, lambda a: a - 1.0, c)
    return jax.lax.while_loop(lambda a: a.sum() < 100.0, lambda a: a + 1.0, c), ys


def test_hooks_inside_loop_bodies():
    x = jnp.zeros(2)
    g = trace(_loops, x)
    scan, cond, loop = (next(n for n in g if n.primitive == p) for p in ("scan", "cond", "while"))
    scopes = set()

    def hook(node, outs):
        scopes.add(node.scope)
        if node.scope == ((scan.id, 0),) and node.primitive == "add":
            return [o + 10.0 for o in outs]  # every iteration adds 11 instead of 1
        return outs

    c, ys = jax.jit(lambda v: evaluate_inlined(g, v, hook=hook, into_bodies=True))(x)
    # scan: c = 33; cond: 66; while adds 1 until the sum (2 elements) reaches 100 -> 66
    np.testing.assert_allclose(c, [66.0, 66.0])
    np.testing.assert_allclose(ys[:, 0], [0.0, 11.0, 22.0])
    assert {(), ((scan.id, 0),), ((cond.id, 0),), ((cond.id, 1),)} <= scopes
    assert ((loop.id, 0),) in scopes and ((loop.id, 1),) in scopes

    # a predicate enters only the chosen loops; without into_bodies nothing is entered
    scopes.clear()
    evaluate_inlined(g, x, hook=hook, into_bodies=lambda n: n.primitive == "while")
    assert scopes == {(), ((loop.id, 0),), ((loop.id, 1),)}
    scopes.clear()
    evaluate_inlined(g, x, hook=hook)
    assert scopes == {()}


def test_hook_errors_are_reported():
    g = trace(lambda x: jnp.sin(x), jnp.ones(2))
    with pytest.raises(TraceFunctionError, match="returned 2 values"):
        evaluate_inlined(g, jnp.ones(2), hook=lambda n, outs: outs * 2)
    with pytest.raises(TraceFunctionError, match="flat arguments"):
        evaluate_inlined(g)

    h = trace(_loops, jnp.zeros(2))
    with pytest.raises(TraceFunctionError, match="output types"):
        evaluate_inlined(
            h, jnp.zeros(2), hook=lambda n, outs: [o.astype(jnp.float16) for o in outs] if n.scope else outs,
            into_bodies=True,
        )  # fmt: skip


# Unoptimised XLA code compiles in half the time; both sides use it, so the comparison holds.
_FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


@pytest.mark.parametrize("scan_layers", [True, False])
def test_gpt_tiny_step_matches_jit(scan_layers):
    from benchmarks.models.gpt import GPTConfig, make_train_step

    cfg = GPTConfig.preset("tiny", scan_layers=scan_layers, precision="fp32")
    step, args = make_train_step(cfg, 2, abstract=False)
    g = trace(step, *args)
    flat = jax.tree.leaves(args)
    count = {"top": 0, "body": 0}
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("d",))
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())

    def hook(node, outs):
        count["body" if node.scope else "top"] += 1
        if node.primitive != "dot_general":
            return outs
        # what the lowering does; a replicated constraint must not change any value
        return [jax.lax.with_sharding_constraint(o, replicated) for o in outs]

    hooked = jax.jit(lambda *xs: evaluate_inlined(g, *xs, hook=hook, into_bodies=True))
    got = hooked.lower(*flat).compile(compiler_options=_FAST_COMPILE)(*flat)
    want = jax.tree.leaves(
        jax.jit(step).lower(*args).compile(compiler_options=_FAST_COMPILE)(*args)
    )
    assert len(got) == len(want) == len(g.outputs)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    assert count["top"] == len(g)
    body_nodes = sum(len(b) for n in g for b in n.body)
    assert count["body"] == body_nodes and (body_nodes > 0) == scan_layers
