"""Property tests (issue 16, item 4): random models, batches and meshes.

Hypothesis draws a zoo MLP (``benchmarks.models.mlp``: widths, depth, activation) or a
zoo GPT (``benchmarks.models.gpt``, width, depth, heads, sequence), a batch size and a
mesh of the 8 CPU devices, and checks three properties of what autopar makes of it:

* the lowered step equals single-device ``jax.jit`` (``LOSS_RTOL`` on the loss, the new
  state within ``_zoo``'s parameter tolerances), whatever the plan splits;
* a plan's JSON reads back into an equal plan that writes the same bytes;
* with a memory bound, the plan's predicted peak per device respects it, or the search
  says nothing fits (``InfeasiblePlanError``, whose smallest footprint is over the bound).

Each example compiles a sharded program (a few seconds on 2 cores), so the example
counts are small; the strategies favour the shapes meshes do not divide evenly.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import autopar
from autopar import SearchOptions
from autopar.errors import InfeasiblePlanError
from autopar.plan import Plan, spec_axes
from benchmarks.models import gpt, mlp
from tests.lower._zoo import LOSS_RTOL, compare_params

MESHES = ({"data": 8}, {"data": 2, "tensor": 4}, {"data": 4, "tensor": 2}, {"tensor": 8})
SLOW = settings(
    max_examples=3,
    deadline=None,
    derandomize=True,  # the same examples on every run and machine: CI is reproducible
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@st.composite
def mlp_steps(draw):
    cfg = mlp.MLPConfig(
        d_in=draw(st.sampled_from([3, 8, 12, 16])),
        hidden=draw(st.sampled_from([8, 24, 32, 40])),
        d_out=draw(st.sampled_from([1, 4, 8])),
        layers=draw(st.integers(1, 3)),
        activation=draw(st.sampled_from(mlp.ACTIVATIONS)),
    )
    batch = draw(st.sampled_from([1, 6, 8, 16, 24]))
    return ("mlp", cfg, batch)


@st.composite
def gpt_steps(draw):
    heads = draw(st.sampled_from([1, 2, 4]))
    cfg = gpt.GPTConfig(
        vocab_size=draw(st.sampled_from([32, 60, 64])),
        seq_len=draw(st.sampled_from([4, 8, 12])),
        hidden=heads * draw(st.sampled_from([4, 8])),
        layers=draw(st.integers(1, 2)),
        heads=heads,
        scan_layers=draw(st.booleans()),
        precision="fp32",
    )
    return ("gpt", cfg, draw(st.sampled_from([2, 4, 8])))


def _step(case):
    kind, cfg, batch = case
    module = mlp if kind == "mlp" else gpt
    return module.make_train_step(cfg, batch, abstract=False)


@SLOW
@given(case=st.one_of(mlp_steps(), gpt_steps()), mesh=st.sampled_from(MESHES))
def test_lowered_step_equals_single_device(case, mesh):
    step, args = _step(case)
    want_state, want_loss = jax.jit(step)(*args)
    fn = autopar.autoparallel(step, options=SearchOptions(mesh=mesh), cache=False)
    got_state, got_loss = fn(*args)
    np.testing.assert_allclose(float(got_loss), float(want_loss), rtol=LOSS_RTOL)
    compare_params(got_state, want_state)
    assert fn.plan_for(*args).mesh == mesh


@settings(max_examples=6, deadline=None, derandomize=True)
@given(case=st.one_of(mlp_steps(), gpt_steps()), mesh=st.sampled_from(MESHES))
def test_plan_json_round_trips_byte_exact(case, mesh):
    step, args = _step(case)
    plan = autopar.plan(step, *args, options=SearchOptions(mesh=mesh))
    text = plan.to_json()
    back = Plan.from_json(text)
    assert back == plan
    assert back.to_json() == text


@settings(max_examples=4, deadline=None, derandomize=True)
@given(
    case=st.one_of(mlp_steps(), gpt_steps()),
    mesh=st.sampled_from(MESHES),
    fraction=st.sampled_from([0.05, 0.2, 0.5, 0.9]),
)
def test_predicted_memory_respects_the_bound(case, mesh, fraction):
    step, args = _step(case)
    one = autopar.plan(step, *args, options=SearchOptions(mesh={"data": 1}))
    bound = fraction * one.predicted.memory_bytes_per_device
    try:
        plan = autopar.plan(step, *args, options=SearchOptions(mesh=mesh, memory_limit_bytes=bound))
    except InfeasiblePlanError as e:
        assert e.smallest_bytes is not None and e.smallest_bytes > bound
        return
    assert plan.predicted.memory_bytes_per_device <= bound


def test_a_property_example_that_shards():
    # The properties above hold for replicated plans too; this draw is checked to split:
    # under half the replicated footprint, the parameters must be split over the mesh.
    cfg = mlp.MLPConfig(d_in=64, hidden=2048, d_out=64, layers=2)
    step, args = mlp.make_train_step(cfg, 64, abstract=False)
    one = autopar.plan(step, *args, options=SearchOptions(mesh={"data": 1}))
    bound = 0.5 * one.predicted.memory_bytes_per_device
    fn = autopar.autoparallel(
        step, options=SearchOptions(mesh={"data": 2, "tensor": 4}, memory_limit_bytes=bound)
    )
    plan = fn.plan_for(*args)
    weights = [r for r in plan.inputs if r.path.startswith("state/params/") and r.path[-1] == "w"]
    assert any(spec_axes(r.spec) for r in weights)
    assert plan.predicted.memory_bytes_per_device <= bound
    want_state, want_loss = jax.jit(step)(*args)
    got_state, got_loss = fn(*args)
    np.testing.assert_allclose(float(got_loss), float(want_loss), rtol=LOSS_RTOL)
    compare_params(got_state, want_state)


pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
