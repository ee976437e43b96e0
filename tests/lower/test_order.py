"""Gathers of inputs placed right before their use (autopar.lower.order)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from autopar.lower import lower_plan
from autopar.lower.order import late_gathers
from autopar.lower.remat import GUARD_SCOPE
from autopar.options import LoweringOptions
from autopar.plan import ActivationConstraint, Plan, TensorSharding
from autopar.trace import trace
from autopar.verify import dump_spmd_hlo, parse_collectives

N = 512  # weights N x N float32: 1 MiB each when whole


def _two_layers(w1, w2, x):
    h = jnp.tanh(x @ w1)
    z = h @ w2
    return jnp.tanh(z) @ w2  # w2 read a second time, in the same layout


def _args():
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    w1 = jax.random.normal(k1, (N, N), jnp.float32) / N**0.5
    w2 = jax.random.normal(k2, (N, N), jnp.float32) / N**0.5
    x = jax.random.normal(k3, (8, N), jnp.float32)
    return w1, w2, x


def _gather_plan(graph, specs=(("d", None), ("d", None), (None, None))) -> Plan:
    """Weights split over d between steps, every matmul reading its weight whole."""
    dots = [n for n in graph.nodes if n.primitive == "dot_general"]
    names = ("w1", "w2", "x")
    return Plan(
        mesh={"d": 8},
        inputs=tuple(
            TensorSharding(
                n, graph.inputs[i].tensor.shape, "float32", s, "other" if n == "x" else "param"
            )
            for i, (n, s) in enumerate(zip(names, specs, strict=True))
        ),
        outputs=(TensorSharding("out", (8, N), "float32", (None, None), "other"),),
        activations=tuple(
            ActivationConstraint(d.id, 0, (None, None), name=f"gather{k}", operand=1)
            for k, d in enumerate(dots)
        ),
    )


def test_first_reader_is_tied_later_readers_reuse() -> None:
    w1, w2, x = _args()
    graph = trace(_two_layers, w1, w2, x)
    dot1, dot2, dot3 = [n for n in graph.nodes if n.primitive == "dot_general"]
    plan = _gather_plan(graph)
    late = late_gathers(graph, plan.activations, [r.spec for r in plan.inputs], plan.mesh)
    # dot1 reads x (an input) and w1: x is not computed in the step, so there is no
    # partner to wait for; dot2 reads h (computed) and w2; dot3 reads w2 again.
    assert dict(late.ties) == {((), dot2.id): {1: 0}}
    assert dict(late.reuse) == {((), dot3.id): {1: (dot2.id, 1)}}
    # Nothing to order when the plan does not gather (weights already whole).
    whole = _gather_plan(graph, ((None, None), (None, None), (None, None)))
    none = late_gathers(graph, whole.activations, [r.spec for r in whole.inputs], whole.mesh)
    assert not none.ties and not none.reuse


def _temp_bytes(late: bool):
    w1, w2, x = _args()
    graph = trace(_two_layers, w1, w2, x)
    lowered = lower_plan(
        _two_layers,
        _gather_plan(graph),
        (w1, w2, x),
        graph=graph,
        options=LoweringOptions(late_gathers=late),
    )
    np.testing.assert_allclose(lowered(w1, w2, x), _two_layers(w1, w2, x), rtol=2e-5, atol=2e-5)
    colls = parse_collectives(dump_spmd_hlo(lowered))
    return lowered.memory_analysis(w1, w2, x).temp_size_in_bytes, colls


def test_tied_gather_waits_for_its_use_and_is_shared() -> None:
    whole = N * N * 4
    tied, colls = _temp_bytes(True)
    # One gather per weight: dot3 reuses dot2's copy of w2 (no second gather).
    gathers = [c.total_bytes for c in colls if c.kind == "all-gather"]
    assert sorted(gathers) == [whole, whole]
    # On CPU the tie is a conditional on one opaque predicate, drawn on one device and
    # shared by a scalar all-reduce, tagged so that verify can leave it out.
    guard = [(c.kind, c.total_bytes) for c in colls if GUARD_SCOPE in c.op_name]
    assert guard == [("all-reduce", 4.0)]
    untied, colls = _temp_bytes(False)
    assert not [c for c in colls if GUARD_SCOPE in c.op_name]
    # Left to XLA:CPU's scheduler both gathers run first: both copies live together.
    assert untied >= 2 * whole
    # Tied, w2 is gathered after dot1 has consumed w1's copy: one copy at a time, plus
    # activations of a few KiB.
    assert tied < 1.5 * whole
