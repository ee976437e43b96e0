"""Which values the fusion model keeps in HBM, on traced functions (expected by hand)."""

import jax
import jax.numpy as jnp

from autopar.search.fusion import hbm_io
from autopar.trace import trace


def _io_by_primitive(graph):
    io = hbm_io(graph)
    return [(n.primitive, io.get(n.id)) for n in graph.nodes]


def test_elementwise_chain_reads_and_writes_only_its_ends():
    # x -> tanh -> exp -> y: one fused kernel reads x once and writes y once.
    g = trace(lambda x: jnp.exp(jnp.tanh(x)), jax.ShapeDtypeStruct((64, 64), jnp.float32))
    assert _io_by_primitive(g) == [
        ("tanh", ((True,), (False,))),  # reads x from HBM, keeps its result in registers
        ("exp", ((False,), (True,))),  # reads tanh's result from registers, writes y
    ]


def test_matmul_operands_and_reused_values_are_materialised():
    def f(x, w):
        h = jnp.tanh(x)  # read by the matmul: must be in HBM
        s = jnp.sin(x)  # read by two elementwise ops: one multi-output kernel with them
        return h @ w, s * 2.0, s + 1.0

    g = trace(
        f, jax.ShapeDtypeStruct((8, 8), jnp.float32), jax.ShapeDtypeStruct((8, 8), jnp.float32)
    )
    io = hbm_io(g)
    by = {n.primitive: io.get(n.id) for n in g.nodes}
    assert by["tanh"] == ((True,), (True,))
    # sin, s * 2 and s + 1 are one kernel: x read once, s kept in registers, both
    # results written (XLA:GPU's multi-output fusion).
    assert by["sin"] == ((True,), (False,))
    assert by["mul"] == ((False, False), (True,))
    assert by["add"] == ((False, False), (True,))
    assert "dot_general" not in io  # matmuls always read and write HBM
    # The reduction's input chain fuses into it; its result is stored.
    g = trace(lambda x: jnp.sum(jnp.square(x), axis=1), jax.ShapeDtypeStruct((8, 8), jnp.float32))
    by = {n.primitive: hbm_io(g).get(n.id) for n in g.nodes}
    assert by["square"] == ((True,), (False,))
    assert by["reduce_sum"] == ((False,), (True,))
