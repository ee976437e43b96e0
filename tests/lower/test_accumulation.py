"""Gradient accumulation from the plain step: microbatches give the single-device result.

The step is split at the gradients by data flow (``autopar.lower.split``): the gradient
computation runs once per microbatch, the update once. Expected values come from
single-device ``jax.jit`` of the same step on the whole batch (tolerances of
``tests/lower/_zoo.py``, written once), and from hand-written losses whose reduction we
know (mean, sum, a mean over a data-dependent count, batch statistics).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import autopar
from autopar import SearchOptions, baselines
from autopar.errors import InvalidOptionError
from autopar.lower import lower_plan
from autopar.lower.split import AccumulateError, plan_accumulation
from autopar.plan import PipelinePlan
from autopar.trace import trace
from cost_models import Cluster
from tests.lower._zoo import LOSS_RTOL, compare_params

EIGHT = Cluster.preset("dgx-a100-80gb")
BATCH = 32  # 8 data-parallel replicas x 4 microbatches x 1 example


@functools.cache
def _zoo(model: str):
    """A tiny fp32 zoo step on a batch of ``BATCH`` (concrete, on device 0)."""
    if model == "mlp":
        from benchmarks.models.mlp import MLPConfig, make_train_step

        step, args = make_train_step(MLPConfig.preset("tiny"), BATCH, abstract=False)
    elif model.startswith("gpt"):
        from benchmarks.models.gpt import GPTConfig, make_train_step

        cfg = GPTConfig.preset("tiny", precision="fp32", scan_layers=model == "gpt_scan")
        step, args = make_train_step(cfg, BATCH, abstract=False)
    elif model == "moe":
        from benchmarks.models.moe import MoEConfig, make_train_step

        step, args = make_train_step(
            MoEConfig.preset("tiny", precision="fp32"), BATCH, abstract=False
        )
    else:
        from benchmarks.models.wide_resnet import WideResNetConfig, make_train_step

        cfg = WideResNetConfig.preset("tiny", precision="fp32")
        step, args = make_train_step(cfg, 8, abstract=False)
    return step, jax.device_put(args, jax.devices()[0])


def _reference(step, args, steps=3):
    state, batch = args
    jitted = jax.jit(step)
    starts, losses = [], []
    for _ in range(steps):
        starts.append(state)
        state, loss = jitted(state, batch)
        losses.append(float(loss))
    return state, losses, starts


@pytest.mark.parametrize(
    "model,m",
    [
        ("mlp", 4),
        ("gpt_scan", 2),
        ("gpt_unrolled", 4),
        pytest.param("moe", 2, marks=pytest.mark.slow),
    ],
)
def test_data_parallel_microbatches_equal_single_device(model, m):
    step, args = _zoo(model)
    state, batch = args
    plan = baselines.data_parallel(step, {"data": 8}, *args)
    plan = dataclasses.replace(plan, pipeline=PipelinePlan(((0, 1),), "gpipe", m))
    # The plan really splits: every batch input over the 8 data-parallel devices.
    for rec in plan.inputs:
        if rec.role == "batch":
            assert rec.spec[0] == "data", rec
    lowered = lower_plan(step, plan, args)
    want_state, want_losses, starts = _reference(step, args)
    losses = [float(lowered(s, batch)[1]) for s in starts]
    np.testing.assert_allclose(losses, want_losses, rtol=LOSS_RTOL)
    got = state
    for _ in range(3):
        got, _ = lowered(got, batch)
    compare_params(got, want_state)
    # The microbatch loop is in the program: a while loop with m iterations.
    hlo = lowered.lower(state, batch).as_text()
    assert "while" in hlo


def test_searched_microbatched_plan_prices_what_it_reports():
    step, args = _zoo("gpt_scan")
    one = autopar.plan(step, *args, cluster=EIGHT, options=SearchOptions(mesh={"data": 8}))
    four = autopar.plan(
        step, *args, cluster=EIGHT, options=SearchOptions(mesh={"data": 8}, microbatches=4)
    )
    assert one.pipeline is None
    assert four.pipeline.microbatches == 4 and four.pipeline.num_stages == 1
    # The number the search minimised is the number re-scored from the saved plan.
    again = autopar.Plan.from_json(four.to_json())
    ev = autopar.evaluate(step, again, EIGHT, *args)
    assert ev.step_time_s == pytest.approx(four.predicted.step_time_s, rel=1e-9)

    # Activations scale with the examples a device holds at a time: a quarter of the batch
    # per microbatch, over the devices its batch dimension is split across (the search
    # may replicate a tiny microbatch rather than all-reduce its gradients four times;
    # the rest of the peak, state and accumulators, does not shrink).
    def examples_per_device(plan, microbatches):
        spec = plan.input("batch/tokens").spec[0]
        axes = () if spec is None else (spec,) if isinstance(spec, str) else spec
        return 1 / microbatches / int(np.prod([plan.mesh[a] for a in axes]))

    ratio = examples_per_device(four, 4) / examples_per_device(one, 1)
    a1 = one.predicted.memory_breakdown["activations"]
    a4 = four.predicted.memory_breakdown["activations"]
    assert a4 == pytest.approx(ratio * a1, rel=0.1), (ratio, a4 / a1)
    # Accumulators cost one float32 copy of the gradients, which the single pass does
    # not hold across the whole step.
    params = sum(np.prod(r.shape) * 4 for r in four.inputs if r.role == "param")
    assert four.predicted.memory_breakdown["grads"] >= params * (1 - 1e-9)


def test_microbatched_step_runs_from_the_decorator():
    step, args = _zoo("mlp")
    fast = autopar.autoparallel(
        step, cluster=EIGHT, options=SearchOptions(mesh={"data": 8}, microbatches=2)
    )
    state, loss = fast(*args)
    _, want, _ = _reference(step, args, steps=1)
    np.testing.assert_allclose(float(loss), want[0], rtol=LOSS_RTOL)
    assert fast.plan_for(*args).pipeline.microbatches == 2


# ----------------------------------------------------------------------------- reductions


def _linear_step(loss_kind: str):
    """``w`` regressing ``y``: the loss is a mean, a sum, or a mean over a data count."""
    tx = optax.sgd(0.1)

    def loss_fn(w, b):
        err = (b["x"] @ w - b["y"]) ** 2
        per = err.sum(axis=1)
        if loss_kind == "mean":
            return per.mean()
        if loss_kind == "sum":
            return per.sum()
        if loss_kind == "masked_mean":
            return (per * b["mask"]).sum() / b["mask"].sum()
        if loss_kind == "max":
            return per.max()
        if loss_kind == "batchnorm":
            h = b["x"] @ w
            h = (h - h.mean(axis=0)) / jnp.sqrt(h.var(axis=0) + 1e-5)
            return ((h - b["y"]) ** 2).mean()
        raise ValueError(loss_kind)

    def step(state, batch):
        loss, g = jax.value_and_grad(loss_fn)(state["w"], batch)
        upd, opt = tx.update(g, state["opt"], state["w"])
        return {"w": optax.apply_updates(state["w"], upd), "opt": opt}, loss

    k = jax.random.split(jax.random.key(0), 3)
    w = jax.random.normal(k[0], (4, 3))
    batch = {
        "x": jax.random.normal(k[1], (16, 4)),
        "y": jax.random.normal(k[2], (16, 3)),
        "mask": (jnp.arange(16) % 3 > 0).astype(jnp.float32),
    }
    return step, ({"w": w, "opt": tx.init(w)}, batch)


@pytest.mark.parametrize("kind", ["mean", "sum"])
def test_sum_and_mean_losses_are_recognised_and_exact(kind):
    step, args = _linear_step(kind)
    acc = plan_accumulation(step, args, 4)
    assert set(acc.rules) == {kind}
    plan = baselines.data_parallel(step, {"data": 4}, *args)
    plan = dataclasses.replace(plan, pipeline=PipelinePlan(((0, 1),), "gpipe", 4))
    mesh = jax.make_mesh(
        (4,), ("data",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:4]
    )
    lowered = lower_plan(step, plan, args, mesh=mesh)
    got_state, got_loss = lowered(*args)
    want_state, want_loss = jax.jit(step)(*args)
    np.testing.assert_allclose(float(got_loss), float(want_loss), rtol=LOSS_RTOL)
    np.testing.assert_allclose(got_state["w"], want_state["w"], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "kind,words",
    [
        ("masked_mean", "count taken from the batch"),
        ("max", "reduce_max"),
        ("batchnorm", "batch norm"),
    ],
)
def test_steps_that_microbatching_would_change_are_refused(kind, words):
    step, args = _linear_step(kind)
    with pytest.raises(AccumulateError, match=words):
        plan_accumulation(step, args, 4)


def test_batchnorm_model_is_refused_with_the_layer_named():
    step, args = _zoo("wide_resnet")
    with pytest.raises(AccumulateError, match="bn"):
        plan_accumulation(step, args, 2)


def test_bad_microbatch_options_are_refused():
    step, args = _linear_step("mean")
    g = trace(step, *args)
    with pytest.raises(AccumulateError, match="divide into 5 microbatches"):
        plan_accumulation(step, args, 5)
    with pytest.raises(InvalidOptionError, match="disagree"):
        autopar.plan(
            step,
            *args,
            cluster=EIGHT,
            options=SearchOptions(mesh={"data": 4}, microbatches=2, microbatch_size=1),
        )
    with pytest.raises(InvalidOptionError, match="fixed mesh"):
        autopar.plan(step, *args, cluster=EIGHT, options=SearchOptions(microbatch_size=2))
    with pytest.raises(InvalidOptionError, match="step function"):
        autopar.plan(g, cluster=EIGHT, options=SearchOptions(microbatches=2))
    # A pipeline is planned from the step function, never from a graph alone.
    with pytest.raises(InvalidOptionError, match="re-traces the step"):
        autopar.plan(g, cluster=EIGHT, options=SearchOptions(mesh={"pipe": 2, "data": 4}))
    # Pipelining options without a pipe axis are refused, never ignored.
    for opts in (
        SearchOptions(mesh={"data": 8}, schedule="1f1b"),
        SearchOptions(virtual_stages=2),
    ):
        with pytest.raises(InvalidOptionError, match="needs pipeline stages"):
            autopar.plan(g, cluster=EIGHT, options=opts)
