"""Uneven pipeline stages over a *scanned* layer stack (issue 13, item 1).

A ``lax.scan`` over 5 stacked layers does not split evenly over 2 or 4 stages. The stage
program is SPMD, so every stage holds ``n = max count`` slots of the stack and runs its
own count of scan iterations; the slots past it are padding (zeros, never read). The
stack comes whole (it cannot be split over ``pipe`` in equal blocks), each device takes
its slots, and the stack's gradients are scattered back and summed over ``pipe``
(:attr:`autopar.lower.stages.StageCut.uneven_stacks`).

Expected values: the slot tables and bytes are worked by hand below; numerics are the
single-device ``jax.jit(jax.value_and_grad(loss))`` over the whole batch, with the
tolerances of ``tests/lower/test_pipeline.py`` (``LOSS_RTOL = 1e-5``, ``GRAD_ATOL =
1e-5``, justified there). The GPT checks and ``verify`` against the compiled program
take minutes on this machine and are ``slow``.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autopar
from autopar.lower.mesh import make_mesh
from autopar.lower.pipeline import _uneven_slots, cut_stages, pipelined_gradients
from autopar.lower.stage_remat import remat_stages

LOSS_RTOL = 1e-5
GRAD_ATOL = 1e-5
LAYERS, WIDTH, BATCH, M = 5, 16, 16, 4


def _loss(ws, batch):
    def layer(h, w):
        return jnp.tanh(h @ w["w"] + w["b"]), None

    h, _ = jax.lax.scan(layer, batch["x"], ws)
    return jnp.mean((h - batch["y"]) ** 2)


@functools.cache
def _model():
    k = jax.random.split(jax.random.PRNGKey(0), 3)
    ws = {
        "w": jax.random.normal(k[0], (LAYERS, WIDTH, WIDTH)) / 4,
        "b": jnp.arange(LAYERS * WIDTH, dtype=jnp.float32).reshape(LAYERS, WIDTH) / 100,
    }
    batch = {
        "x": jax.random.normal(k[1], (BATCH, WIDTH)),
        "y": jax.random.normal(k[2], (BATCH, WIDTH)),
    }
    return ws, batch


@functools.cache
def _graph():
    ws, batch = _model()
    micro = jax.tree.map(lambda x: x[: BATCH // M], batch)
    return autopar.trace(jax.value_and_grad(_loss), ws, micro)


@functools.cache
def _reference():
    ws, batch = _model()
    value, grads = jax.jit(jax.value_and_grad(_loss))(ws, batch)
    return float(value), jax.tree.map(np.asarray, grads)


def test_the_traced_stack_is_five_scanned_layers():
    assert [layer.kind for layer in _graph().layers] == ["scan"] * LAYERS


def test_slots_of_an_uneven_split_by_hand():
    # 2 stages as 3 + 2 layers: 3 slots each; stage 1's third slot is padding (index 5,
    # past the stack).
    cut = cut_stages(_graph(), [(0, 3), (3, 5)], batch_inputs=[2, 3])
    assert cut.stacked_inputs == () and cut.stacked_outputs == ()
    assert cut.uneven_stacks[("in", 0)] == ((0, 3), (3, 2))
    assert _uneven_slots(cut, 2, 1)[("in", 0)].tolist() == [[0, 1, 2], [3, 4, 5]]
    w = cut.jaxpr.jaxpr.invars[1]  # the stacked kernels, (5, 16, 16)
    assert cut.aval(w).shape == (3, WIDTH, WIDTH)
    # Interleaved, p = 2 devices x v = 2 chunks of (2, 1, 1, 1) layers: 2 slots a chunk.
    # Device 0 runs chunks 0 (layers 0, 1) and 2 (layer 3, pad); device 1 runs chunks 1
    # (layer 2, pad) and 3 (layer 4, pad).
    cut4 = cut_stages(_graph(), [(0, 2), (2, 3), (3, 4), (4, 5)], batch_inputs=[2, 3])
    assert _uneven_slots(cut4, 2, 2)[("in", 0)].tolist() == [[0, 1, 3, 5], [2, 5, 4, 5]]


def test_even_splits_keep_the_stack_split_over_pipe():
    cut = cut_stages(_graph(), [(0, 5)], batch_inputs=[2, 3])
    assert cut.uneven_stacks == {} and cut.stacked_inputs == (0, 1)


FAST = [
    # (mesh, stages, schedule, virtual stages, stage remat)
    ({"pipe": 2, "data": 4}, [(0, 3), (3, 5)], "1f1b", 1, "none"),
    ({"pipe": 2, "data": 4}, [(0, 2), (2, 3), (3, 4), (4, 5)], "interleaved-1f1b", 2, "none"),
]
SLOW = [
    ({"pipe": 2, "data": 4}, [(0, 2), (2, 5)], "1f1b", 1, "full"),
    ({"pipe": 4, "data": 2}, [(0, 1), (1, 2), (2, 3), (3, 5)], "gpipe", 1, "none"),
]
CASES = FAST + SLOW


@pytest.mark.parametrize(("mesh", "stages", "schedule", "v", "remat"), FAST)
def test_uneven_scanned_pipeline_matches_single_device(mesh, stages, schedule, v, remat):
    _check_mlp(mesh, stages, schedule, v, remat)


@pytest.mark.slow
@pytest.mark.parametrize(("mesh", "stages", "schedule", "v", "remat"), SLOW)
def test_uneven_scanned_pipeline_matches_single_device_more(mesh, stages, schedule, v, remat):
    """Stage remat (the short stage recomputes its 2 layers one at a time) and 4 stages."""
    _check_mlp(mesh, stages, schedule, v, remat)


def _check_mlp(mesh, stages, schedule, v, remat):
    ws, batch = _model()
    cut = cut_stages(_graph(), stages, batch_inputs=[2, 3])
    if remat != "none":
        cut = remat_stages(cut, (remat,) * len(stages))
    run = pipelined_gradients(cut, schedule, M, make_mesh(mesh), v)
    loss_sum, grads_sum = jax.jit(run)(ws, batch)
    want_loss, want_grads = _reference()
    assert float(loss_sum) / M == pytest.approx(want_loss, rel=LOSS_RTOL)
    for g, w in zip(jax.tree.leaves(grads_sum), jax.tree.leaves(want_grads), strict=True):
        assert g.shape == w.shape  # the whole stack's gradient, every layer once
        assert float(np.abs(np.asarray(g) / M - w).max()) <= GRAD_ATOL


def _step(ws, batch):
    loss, grads = jax.value_and_grad(_loss)(ws, batch)
    return jax.tree.map(lambda w, g: w - 0.1 * g, ws, grads), loss


def test_pipeline_program_prices_the_padded_slots():
    """The slots a device takes (padding included) are held beside the whole stack:
    3 slots of (16 x 16 + 16) float32 = 3,264 bytes per device, whatever a stage runs."""
    from autopar.lower.program import pipeline_program
    from autopar.lower.split import plan_accumulation

    ws, batch = _model()
    mesh = {"pipe": 2, "data": 4}
    plan = autopar.baselines.pipeline(
        _step, mesh, ws, batch, microbatches=M, schedule="1f1b", stages=((0, 3), (3, 5))
    )
    # the stack is whole on every pipe device (5 layers do not split over 2 equal blocks)
    assert all("pipe" not in (r.spec or ()) for r in plan.inputs)
    acc = plan_accumulation(_step, (ws, batch), M)
    prog = pipeline_program(autopar.trace(_step, ws, batch), plan, acc)
    assert prog.relayout_copy_bytes == 3 * (WIDTH * WIDTH + WIDTH) * 4
    assert prog.relayout_sends == ()
    # the stack's two gradients are summed over pipe with the loss: 3 psums
    assert prog.psums == 3 and prog.stacked_outputs == frozenset()


@pytest.mark.slow
def test_uneven_scanned_plan_runs_what_was_priced():
    """``verify`` on the lowered uneven plan: the collectives compiled are those
    predicted (1F1B, p = 2, m = 4: 2 (m + p - 1) = 10 ticks of one send each way), and
    memory within verify's tolerance."""
    from autopar.lower import lower_plan
    from autopar.verify import verify
    from cost_models import Cluster

    ws, batch = _model()
    plan = autopar.baselines.pipeline(
        _step, {"pipe": 2, "data": 4}, ws, batch, microbatches=M, schedule="1f1b",
        stages=((0, 3), (3, 5)),
    )  # fmt: skip
    ev = autopar.evaluate(_step, plan, Cluster.preset("dgx-a100-80gb"), ws, batch)
    plan = dataclasses.replace(plan, predicted=ev.to_predicted())
    report = verify(plan, lower_plan(_step, plan, (ws, batch)), ws, batch)
    assert report.row("collective-permute").hlo_count == 20
    assert report.ok, report.to_text()


@functools.cache
def _gpt(layers: int):
    from benchmarks.models.gpt import GPTConfig, loss_fn, make_train_step

    cfg = GPTConfig.preset("tiny", precision="fp32", scan_layers=True, layers=layers)
    _, (state, batch) = make_train_step(cfg, BATCH, abstract=False)
    return functools.partial(loss_fn, cfg), state["params"], batch


@pytest.mark.slow
@pytest.mark.parametrize(("mesh", "stages", "schedule", "v", "remat"), CASES)
def test_uneven_scanned_gpt_matches_single_device(mesh, stages, schedule, v, remat):
    """The zoo GPT with ``scan_layers=True`` and 5 layers (measured ~35 s a case)."""
    loss, params, batch = _gpt(LAYERS)
    micro = jax.tree.map(lambda x: x[: BATCH // M], batch)
    cut = cut_stages(autopar.trace(jax.value_and_grad(loss), params, micro), stages)
    assert cut.uneven_stacks
    if remat != "none":
        cut = remat_stages(cut, (remat,) * len(stages))
    run = pipelined_gradients(cut, schedule, M, make_mesh(mesh), v)
    loss_sum, grads_sum = jax.jit(run)(params, batch)
    dev = jax.devices()[0]
    want_loss, want_grads = jax.jit(jax.value_and_grad(loss))(
        jax.device_put(params, dev), jax.device_put(batch, dev)
    )
    assert float(loss_sum) / M == pytest.approx(float(want_loss), rel=LOSS_RTOL)
    for g, w in zip(jax.tree.leaves(grads_sum), jax.tree.leaves(want_grads), strict=True):
        assert float(np.abs(np.asarray(g) / M - np.asarray(w)).max()) <= GRAD_ATOL


@pytest.mark.slow
@pytest.mark.parametrize(
    ("stages", "v", "ticks"),
    [(((0, 3), (3, 5)), 1, 10), (((0, 2), (2, 3), (3, 4), (4, 5)), 2, 18)],
)
def test_uneven_scanned_gpt_plan_runs_what_was_priced(stages, v, ticks):
    """The scanned GPT's uneven plans through ``verify``: every collective kind and the
    memory agree (measured: all-reduce 365/365, collective-permute 20/20 and 36/36,
    memory -2.2% and -5.8%). Ticks by hand: 1F1B ``2 (m + p - 1) = 10``; interleaved
    ``2 (m v + p - 1) = 18``; one send each way per tick."""
    from autopar.lower import lower_plan
    from autopar.verify import verify
    from benchmarks.models.gpt import GPTConfig, make_train_step
    from cost_models import Cluster

    cfg = GPTConfig.preset("tiny", precision="fp32", scan_layers=True, layers=LAYERS)
    step, args = make_train_step(cfg, BATCH, abstract=True)
    plan = autopar.baselines.pipeline(
        step, {"pipe": 2, "data": 4}, *args, microbatches=M,
        schedule="1f1b" if v == 1 else "interleaved-1f1b", virtual_stages=v, stages=stages,
    )  # fmt: skip
    ev = autopar.evaluate(step, plan, Cluster.preset("dgx-a100-80gb"), *args)
    plan = dataclasses.replace(plan, predicted=ev.to_predicted())
    report = verify(plan, lower_plan(step, plan, args), *args)
    assert report.row("collective-permute").hlo_count == 2 * ticks
    assert report.ok, report.to_text()
