"""Pipeline plans from the user's plain step: planned, priced, lowered, equal to one device.

The step is split at the gradients by data flow, its gradient computation re-traced on
one microbatch and cut into stages at the graph's layers (not at the zoo's names), run
over the ``pipe`` axis in the plan's schedule, and the update applied once. Expected values
come from single-device ``jax.jit`` of the same step (tolerances of ``tests/lower/_zoo.py``,
written once) and from the schedules' definitions (in-flight microbatches).
"""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest

import autopar
from autopar import SearchOptions, baselines
from autopar.lower import lower_plan
from cost_models import Cluster
from tests.lower._zoo import LOSS_RTOL, check_against_single_device, compare_params

EIGHT = Cluster.preset("dgx-a100-80gb")
BATCH = 16


@functools.cache
def _gpt(scan: bool, layers: int = 4):
    from benchmarks.models.gpt import GPTConfig, make_train_step

    cfg = GPTConfig.preset("tiny", precision="fp32", scan_layers=scan, layers=layers)
    step, args = make_train_step(cfg, BATCH, abstract=False)
    return step, jax.device_put(args, jax.devices()[0])


@functools.cache
def _moe():
    from benchmarks.models.moe import MoEConfig, make_train_step

    step, args = make_train_step(MoEConfig.preset("tiny", precision="fp32"), BATCH, abstract=False)
    return step, jax.device_put(args, jax.devices()[0])


def _check(step, args, plan):
    lowered = lower_plan(step, plan, args)
    check_against_single_device(step, args, lowered)
    return lowered


CASES = [
    pytest.param(True, {"pipe": 2, "data": 4}, "1f1b", 4, id="gpt_scan-pipe2_data4-1f1b-4"),
    # Unrolled layers on this mesh and schedule also run in test_pipeline.py's GPT_FAST
    # (the cut run directly); through the baseline's plan, with the slow tests.
    pytest.param(
        False,
        {"pipe": 4, "data": 2},
        "gpipe",
        8,
        marks=pytest.mark.slow,
        id="gpt_unrolled-pipe4_data2-gpipe-8",
    ),
    pytest.param(
        True,
        {"pipe": 2, "data": 2, "tensor": 2},
        "gpipe",
        4,
        marks=pytest.mark.slow,
        id="gpt_scan-pipe2_data2_tensor2-gpipe-4",
    ),
    pytest.param(
        True,
        {"pipe": 4, "data": 2},
        "1f1b",
        8,
        marks=pytest.mark.slow,
        id="gpt_scan-pipe4_data2-1f1b-8",
    ),
    pytest.param(
        False,
        {"pipe": 2, "data": 4},
        "1f1b",
        8,
        marks=pytest.mark.slow,
        id="gpt_unrolled-pipe2_data4-1f1b-8",
    ),
]


@pytest.mark.parametrize("scan,mesh,schedule,m", CASES)
def test_pipelined_step_equals_single_device(scan, mesh, schedule, m):
    step, args = _gpt(scan)
    plan = baselines.pipeline(step, mesh, *args, microbatches=m, schedule=schedule)
    assert plan.pipeline.num_stages == mesh["pipe"] and plan.pipeline.microbatches == m
    lowered = _check(step, args, plan)
    hlo = lowered.compile(*args).as_text()
    assert "collective-permute" in hlo  # activations really move between stages
    if scan:
        # Each stage holds only its layers of the stacked parameters.
        kernel = args[0]["params"]["h"]["attn"]["q"]["kernel"]
        rec = plan.input("state/params/h/attn/q/kernel")
        assert rec.spec[0] == "pipe" and kernel.shape[0] % mesh["pipe"] == 0


@pytest.mark.slow
def test_pipelined_moe_equals_single_device():
    step, args = _moe()
    plan = baselines.pipeline(step, {"pipe": 2, "data": 4}, *args, microbatches=4)
    _check(step, args, plan)


@pytest.mark.slow
def test_eight_stages_one_layer_each():
    step, args = _gpt(False, layers=8)
    plan = baselines.pipeline(step, {"pipe": 8}, *args, microbatches=8, schedule="1f1b")
    _check(step, args, plan)


# -- interleaved 1F1B over a scanned layer stack ---------------------------------------------

INTERLEAVED_SCAN = [
    pytest.param(4, {"pipe": 2, "data": 4}, 4, id="gpt_scan4-pipe2_data4-v2-4"),
    pytest.param(
        8, {"pipe": 4, "data": 2}, 4, marks=pytest.mark.slow, id="gpt_scan8-pipe4_data2-v2-4"
    ),
]


@pytest.mark.slow
@pytest.mark.parametrize("layers,mesh,m", INTERLEAVED_SCAN)
def test_interleaved_scanned_step_equals_single_device(layers, mesh, m):
    """``virtual_stages = 2`` over an ``nn.scan`` stack: device ``d`` runs chunks ``d`` and
    ``p + d`` of the stack, whose parameters and optimizer state stay split over ``pipe``
    in contiguous blocks between steps (the program moves the chunks). Loss of each step
    from the single-device run's state (1e-5), the free-running loss (1e-4) and the state
    after 3 steps (``compare_params``) equal single-device ``jax.jit(step)``; the
    relayout's collective-permutes carry what ``pipeline_program`` says."""
    from autopar.lower.program import pipeline_program
    from autopar.lower.split import plan_accumulation
    from autopar.verify.hlo import dump_spmd_hlo, parse_collectives

    step, args = _gpt(True, layers)
    state, batch = args
    p = mesh["pipe"]
    plan = baselines.pipeline(
        step, mesh, *args, microbatches=m, schedule="interleaved-1f1b", virtual_stages=2
    )
    assert plan.pipeline.num_stages == p and plan.pipeline.virtual_stages == 2
    assert len(plan.pipeline.stages) == 2 * p
    lowered = lower_plan(step, plan, args)
    jitted = jax.jit(step)
    want, want_losses = state, []
    for _ in range(3):
        _, loss = lowered(want, batch)  # from the reference's state: 1e-5
        want, want_loss = jitted(want, batch)
        assert float(loss) == pytest.approx(float(want_loss), rel=LOSS_RTOL)
        want_losses.append(float(want_loss))
    got, got_losses = state, []
    for _ in range(3):
        got, loss = lowered(got, batch)
        got_losses.append(float(loss))
    np.testing.assert_allclose(got_losses, want_losses, rtol=1e-4)
    compare_params(got, want)

    # the stack (and its optimizer state) really is split over pipe: L / p layers each
    kernel = got["params"]["h"]["attn"]["q"]["kernel"]
    assert kernel.shape[0] == layers
    spec0 = kernel.sharding.spec[0]
    assert spec0 == "pipe" or (isinstance(spec0, tuple) and "pipe" in spec0), kernel.sharding
    assert {s.data.shape[0] for s in kernel.addressable_shards} == {layers // p}
    rec = plan.input("state/params/h/attn/q/kernel")
    assert rec.spec[0] == "pipe"

    # the relayout: collective-permutes outside the tick loop, as the program describes
    text = dump_spmd_hlo(lowered, *args)
    once = [c for c in parse_collectives(text) if c.kind == "collective-permute" and c.count == 1]
    prog = pipeline_program(autopar.trace(step, *args), plan, plan_accumulation(step, args, m))
    assert prog is not None and prog.virtual_stages == 2
    assert sorted(c.bytes for c in once) == sorted(prog.relayout_sends)
    assert prog.relayout_bytes == pytest.approx(sum(c.bytes for c in once))
    assert not [c for c in parse_collectives(text) if c.kind in ("all-to-all", "all-gather")]


def test_planned_pipeline_is_priced_with_its_bubble_and_in_flight_memory():
    step, args = _gpt(False)
    plans = {}
    for schedule in ("gpipe", "1f1b"):
        for m in (4, 8):
            plans[schedule, m] = autopar.plan(
                step,
                *args,
                cluster=EIGHT,
                options=SearchOptions(
                    mesh={"pipe": 4, "data": 2}, microbatches=m, schedule=schedule
                ),
            )
    p = plans["1f1b", 4]
    assert p.pipeline.num_stages == 4 and p.predicted.bubble_s > 0
    # Re-scored from the saved plan: the same number.
    ev = autopar.evaluate(step, autopar.Plan.from_json(p.to_json()), EIGHT, *args)
    assert ev.step_time_s == pytest.approx(p.predicted.step_time_s, rel=1e-9)
    assert ev.extra["peak_inflight"] == (4, 3, 2, 1)  # 1F1B: p - s microbatches on stage s
    # GPipe keeps every microbatch of the step in flight: its activation memory grows
    # with m even though each microbatch shrinks; 1F1B keeps p - s, so it shrinks. (Data
    # parallel inside the stages for all four: the search may keep a microbatch of 2 rows
    # whole on each data device instead, which changes what a microbatch holds.)
    dp = {
        (schedule, m): autopar.evaluate(
            step,
            baselines.pipeline(
                step, {"pipe": 4, "data": 2}, *args, microbatches=m, schedule=schedule
            ),
            EIGHT,
            *args,
        )
        for schedule, m in plans
    }
    act = {k: ev.memory_breakdown["activations"] for k, ev in dp.items()}
    assert act["gpipe", 8] > act["gpipe", 4]
    assert act["1f1b", 8] < act["1f1b", 4]
    # More microbatches, smaller bubble (same schedule).
    assert dp["1f1b", 8].extra["bubble_s"] < dp["1f1b", 4].extra["bubble_s"]
