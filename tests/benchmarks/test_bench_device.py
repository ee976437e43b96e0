"""``benchmarks.bench_device`` on the simulated CPU devices: one row planned, lowered and
timed; its numbers consistent with the plan, its loss equal to single-device ``jax.jit``'s."""

from __future__ import annotations

import math

import jax
import pytest

from benchmarks import bench_device
from tests.lower._zoo import LOSS_RTOL


def test_a_row_is_planned_lowered_and_timed_against_jax_jit():
    import autopar
    from benchmarks.models.gpt import GPTConfig, make_train_step
    from cost_models import Cluster

    row = bench_device.device_row("tiny", 8, True, steps=1, rounds=1, precision="fp32")
    assert "error" not in row
    # The plan is the search's for the local devices (the 8 simulated ones here).
    assert math.prod(row["mesh"].values()) == len(jax.devices())
    step, args = make_train_step(GPTConfig.preset("tiny", precision="fp32"), 8)
    plan = autopar.plan(step, *args, cluster=Cluster.local())
    assert row["predicted_s"] == pytest.approx(plan.predicted.step_time_s, rel=1e-9)
    assert row["measured_s"] > 0 and row["jit_s"] > 0
    assert row["ratio"] == pytest.approx(row["measured_s"] / row["predicted_s"])
    assert row["loss_rel_err"] <= LOSS_RTOL


def test_bad_rows_are_refused():
    with pytest.raises(ValueError, match="PRESET:BATCH"):
        bench_device.parse_row("gpt2-small")
    with pytest.raises(ValueError):
        bench_device.ratio(1.0, 0.0)
