"""Per-node FLOPs, bytes and JSON parameters, checked against hand-derived counts."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import pytest

from autopar.trace import trace

f32 = jnp.float32


def _sds(*shape, dtype=f32):
    return jax.ShapeDtypeStruct(shape, dtype)


def _only(graph, prim):
    nodes = [n for n in graph if n.primitive == prim]
    assert len(nodes) == 1, [n.primitive for n in graph]
    return nodes[0]


def test_matmul_flops_and_params():
    g = trace(lambda x, w: x @ w, _sds(8, 16), _sds(16, 32))
    n = _only(g, "dot_general")
    assert n.flops == 2 * 8 * 32 * 16  # one multiply-add per (i, j, k)
    assert n.params["dimension_numbers"] == [[[1], [0]], [[], []]]
    assert n.bytes_in == (8 * 16 + 16 * 32) * 4 and n.bytes_out == 8 * 32 * 4


def test_batched_einsum_flops():
    b, q, k, h, d = 2, 8, 8, 4, 16
    g = trace(lambda a, c: jnp.einsum("bqhd,bkhd->bhqk", a, c), _sds(b, q, h, d), _sds(b, k, h, d))
    n = _only(g, "dot_general")
    assert n.flops == 2 * (b * h * q * k) * d
    (lc, rc), (lb, rb) = n.params["dimension_numbers"]
    assert lc == [3] and rc == [3] and sorted(lb) == [0, 2] and sorted(rb) == [0, 2]


@pytest.mark.parametrize("groups", [1, 2])
def test_conv_flops_exact(groups):
    n_, hw, cin, cout, kh = 2, 16, 4, 8, 3

    def conv(x, w):
        return jax.lax.conv_general_dilated(
            x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"),
            feature_group_count=groups,
        )  # fmt: skip

    g = trace(conv, _sds(n_, hw, hw, cin), _sds(kh, kh, cin // groups, cout))
    n = _only(g, "conv_general_dilated")
    # each output element: (cin / groups) * kh * kw multiply-adds
    assert n.flops == 2 * (n_ * hw * hw * cout) * (cin // groups) * kh * kh
    dn = n.params["dimension_numbers"]
    assert set(dn) == {"lhs_spec", "rhs_spec", "out_spec"}
    assert n.params["feature_group_count"] == groups


def test_elementwise_reduction_transcendental_and_data_movement():
    def f(x):
        y = jnp.exp(x)  # 20
        z = y * 2.0  # 20
        s = jnp.sum(z, axis=1)  # reduce over 20 inputs
        t = jnp.transpose(x)  # 0
        return s, t.reshape(-1)

    g = trace(f, _sds(4, 5))
    by = {n.primitive: n.flops for n in g}
    assert by == {"exp": 20, "mul": 20, "reduce_sum": 20, "transpose": 0, "reshape": 0}
    add = trace(lambda a, b: a + b, _sds(4, 5), _sds(4, 5)).nodes[0]
    assert (add.bytes_in, add.bytes_out) == (160, 80)
    red = _only(g, "reduce_sum")
    assert red.params["axes"] == [1]


def test_gather_reads_only_the_slice():
    g = trace(lambda t, i: jnp.take(t, i, axis=0), _sds(1000, 64), _sds(8, dtype=jnp.int32))
    n = _only(g, "gather")
    out_bytes = 8 * 64 * 4
    assert n.bytes_out == out_bytes and n.bytes_in < 1000 * 64 * 4
    assert isinstance(n.params["dimension_numbers"], str)


def test_loops_scale_their_bodies():
    w = _sds(16, 16)

    def f(x, w):
        def body(c, _):
            return jnp.tanh(c @ w), None

        c, _ = jax.lax.scan(body, x, None, length=5)
        c = jax.lax.cond(c.sum() > 0, lambda a: a @ w, lambda a: a * 2.0, c)
        c = jax.lax.while_loop(lambda a: a.sum() > 1e9, lambda a: a @ w, c)
        return c

    g = trace(f, _sds(4, 16), w)
    mm = 2 * 4 * 16 * 16
    scan = _only(g, "scan")
    assert scan.length == 5 and len(scan.body) == 1
    assert scan.flops == 5 * (mm + 4 * 16)
    assert scan.params["length"] == 5 and scan.params["num_carry"] == 1
    assert scan.params["num_consts"] == 1
    cond = _only(g, "cond")
    assert len(cond.body) == 2 and cond.flops == mm  # the more expensive branch
    assert cond.params["num_branches"] == 2
    loop = _only(g, "while")
    assert len(loop.body) == 2  # cond_jaxpr, body_jaxpr
    # one trip of the body (unknown trip count) plus one evaluation of the condition
    assert loop.flops == mm + loop.body[0].total_flops
    assert loop.body[0].total_flops == 4 * 16 + 1  # reduce_sum + gt
    # body nodes know where they are and inherit the loop's phase
    assert all(n.scope == ((scan.id, 0),) for n in scan.body[0])
    assert scan.body[0].scope == ((scan.id, 0),)


def test_all_params_are_json_serialisable():
    from benchmarks.models.gpt import GPTConfig, make_train_step

    step, args = make_train_step(GPTConfig.preset("tiny"), 2)
    g = trace(step, *args)

    def walk(graph):
        for n in graph:
            json.dumps(n.params)
            for b in n.body:
                walk(b)

    walk(g)
    prims = {n.primitive: n.params for n in g}
    assert "new_dtype" in prims["convert_element_type"]
