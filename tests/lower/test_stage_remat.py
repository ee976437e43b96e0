"""Full rematerialisation per pipeline stage (``autopar.lower.stage_remat``).

Expected values: gradients from single-device ``jax.value_and_grad`` summed over the
microbatches (the pipeline's contract), and stash sizes from the model's shapes (a
recomputed stage keeps the activation it receives: ``[microbatch, features]``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autopar
from autopar.errors import LowerPlanError
from autopar.lower.pipeline import buffer_slots, cut_stages, make_schedule, pipelined_gradients
from autopar.lower.stage_remat import remat_stages

RTOL = 1e-5  # float32 sums in another order (DESIGN.md's bound)
M = 4


def loss(ws, x):
    for w in ws:
        x = jnp.tanh(x @ w) + 0.1 * x
    return jnp.mean(x**2)


@functools.cache
def _cut():
    ws = [jnp.eye(8) * (k + 2) / 5 + 0.01 * k for k in range(4)]
    x = jnp.linspace(-1.0, 1.0, 4 * M * 8).reshape(4 * M, 8)
    g = autopar.trace(jax.value_and_grad(loss), ws, x[:4])
    return cut_stages(g, [(0, 2), (2, 4)], batch_inputs=[4]), ws, x


def _expected(ws, x):
    total_l, total_g = 0.0, None
    for m in range(M):
        lm, gm = jax.value_and_grad(loss)(ws, x[m::M])
        total_l += lm
        total_g = gm if total_g is None else jax.tree.map(jnp.add, total_g, gm)
    return total_l, total_g


@pytest.mark.parametrize("policies", [("full", "full"), ("none", "full"), ("full", "none")])
@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_recomputed_stages_give_the_same_gradients(policies, schedule):
    cut, ws, x = _cut()
    lean = remat_stages(cut, policies)
    mesh = autopar.lower.make_mesh({"pipe": 2, "data": 4})
    got_l, got_g = jax.jit(pipelined_gradients(lean, schedule, M, mesh))(ws, x)
    want_l, want_g = _expected(ws, x)
    np.testing.assert_allclose(float(got_l), float(want_l), rtol=RTOL)
    for a, b in zip(got_g, want_g, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=RTOL, atol=1e-7)


def test_a_recomputed_stage_stashes_its_input_and_reruns_its_forward():
    cut, _, _ = _cut()
    lean = remat_stages(cut, ("none", "full"))
    # Stage 1 receives one [4, 8] float32 activation; that is all it keeps.
    assert [cut.aval(v).shape for v in lean.forward(1).stash] == [(4, 8)]
    assert lean.forward(0).stash == cut.forward(0).stash  # "none": unchanged
    tanh = lambda pc: sum(e.primitive.name == "tanh" for e in pc.eqns)  # noqa: E731
    assert tanh(lean.backward(1)) == tanh(cut.backward(1)) + 2  # its two layers again
    slots = buffer_slots(lean, make_schedule("1f1b", 2, M))["stash"][1]
    before = buffer_slots(cut, make_schedule("1f1b", 2, M))["stash"][1]
    nbytes = lambda layout: sum(int(np.prod(s)) * d.itemsize for s, d in layout)  # noqa: E731
    assert nbytes(slots) < nbytes(before)


def test_unknown_or_miscounted_policies_are_refused():
    cut, _, _ = _cut()
    with pytest.raises(LowerPlanError, match="not available per pipeline stage"):
        remat_stages(cut, ("none", "selective"))
    with pytest.raises(LowerPlanError, match="one per"):
        remat_stages(cut, ("full",))
