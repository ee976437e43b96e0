"""``benchmarks.bench_device`` on the simulated CPU devices: one row planned, lowered and
timed; its numbers consistent with the plan, its loss equal to single-device ``jax.jit``'s
(the plan replicates the tiny step there: this tests the benchmark, not sharding)."""

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
    assert row["mesh"] == dict(plan.mesh)
    # This checks the benchmark's bookkeeping and numerics, not sharding: priced for the
    # simulated CPU devices (Cluster.local()), the tiny step's collectives cost more than
    # they save and the plan replicates it (the lowering's splits are tested in
    # tests/lower/).
    assert row["measured_s"] > 0 and row["jit_s"] > 0
    assert row["ratio"] == pytest.approx(row["measured_s"] / row["predicted_s"])
    assert row["loss_rel_err"] <= LOSS_RTOL


def test_bad_rows_are_refused(capsys):
    with pytest.raises(ValueError, match="PRESET:BATCH"):
        bench_device.parse_row("gpt2-small")
    with pytest.raises(ValueError):
        bench_device.ratio(1.0, 0.0)
    with pytest.raises(SystemExit) as e:  # the command line: a usage error, no traceback
        bench_device.main(["--rows", "gpt2-small:x"])
    assert e.value.code == 2 and "PRESET:BATCH" in capsys.readouterr().err
