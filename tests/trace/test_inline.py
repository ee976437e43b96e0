"""Inlining: call-like equations disappear, loops stay composite, semantics are kept."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from autopar.trace import inline_jaxpr, trace


def _prims(closed) -> list[str]:
    return [e.primitive.name for e in closed.jaxpr.eqns]


def _all_prims(closed) -> set[str]:
    out = set()
    for e in closed.jaxpr.eqns:
        out.add(e.primitive.name)
        for sub in jax.extend.core.jaxprs_in_params(e.params):
            inner = sub if isinstance(sub, jax.extend.core.ClosedJaxpr) else None
            out |= _all_prims(inner) if inner is not None else {x.primitive.name for x in sub.eqns}
    return out


@jax.custom_vjp
def _cvjp(x):
    return jnp.sin(x)


_cvjp.defvjp(lambda x: (jnp.sin(x), x), lambda r, g: (g * jnp.cos(r),))


@jax.custom_jvp
def _cjvp(x):
    return jnp.tanh(x)


_cjvp.defjvp(lambda p, t: (jnp.tanh(p[0]), t[0]))

_inner_jit = jax.jit(lambda x: x * 3.0 + 1.0)


def _mixed(x):
    y = jax.checkpoint(lambda z: _cvjp(z) * 2.0)(x)
    y = _cjvp(y)
    y = _inner_jit(y)

    def body(c, xs):
        return _inner_jit(c) + xs, c

    c, ys = jax.lax.scan(body, y, jnp.arange(12.0).reshape(3, 4))
    c = jax.lax.cond(c[0] > 0, lambda a: a * 2.0, lambda a: a - 1.0, c)
    c = jax.lax.while_loop(lambda s: s[0] < 3, lambda s: (s[0] + 1, s[1] * 1.5), (0, c))[1]
    return c.sum() + ys.sum()


def test_calls_are_spliced_and_loops_kept():
    closed = jax.make_jaxpr(_mixed)(jnp.ones(4))
    assert {"remat2", "custom_vjp_call", "custom_jvp_call", "jit"} <= _all_prims(closed)
    inlined = inline_jaxpr(closed)
    prims = _all_prims(inlined)
    for call in ("remat2", "checkpoint", "custom_vjp_call", "custom_jvp_call", "jit", "pjit"):
        assert call not in prims
    top = _prims(inlined)
    assert top.count("scan") == 1 and top.count("cond") == 1 and top.count("while") == 1
    # the jit call inside the scan body was inlined too
    scan = next(e for e in inlined.jaxpr.eqns if e.primitive.name == "scan")
    assert [e.primitive.name for e in scan.params["jaxpr"].jaxpr.eqns] == ["mul", "add", "add"]


@pytest.mark.parametrize(
    "x", [np.array([0.3, -1.0, 2.0, 0.1], np.float32), np.zeros(4, np.float32)]
)
def test_inlined_jaxpr_computes_the_same_function(x):
    closed = jax.make_jaxpr(_mixed)(x)
    inlined = inline_jaxpr(closed)
    (got,) = jax.core.eval_jaxpr(inlined.jaxpr, inlined.consts, x)
    np.testing.assert_allclose(np.asarray(got), np.asarray(_mixed(x)), rtol=1e-6)


def test_name_stack_of_call_site_is_prepended():
    @jax.jit
    def inner(x):
        with jax.named_scope("inner"):
            return jnp.exp(x)

    def outer(x):
        with jax.named_scope("outer"):
            return inner(x) + 1.0

    g = trace(outer, jnp.ones(3))
    assert [n.primitive for n in g] == ["exp", "add"]
    assert g.nodes[0].name_stack == "outer/inner"
    assert g.nodes[1].name_stack == "outer"


def test_consts_of_inlined_calls_are_kept():
    table = np.arange(6, dtype=np.float32)

    @jax.jit
    def lookup(i):
        return jnp.asarray(table)[i] * 2.0

    def f(i):
        return lookup(i) + 1.0

    i = jnp.int32(4)
    closed = jax.make_jaxpr(f)(i)
    inlined = inline_jaxpr(closed)
    got = jax.core.eval_jaxpr(inlined.jaxpr, inlined.consts, i)[0]
    assert float(got) == 9.0
