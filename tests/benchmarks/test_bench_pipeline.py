"""``benchmarks.bench_pipeline``: one row (the quickest case) has every column and its
pipelined loss equals single-device ``jax.jit`` (the row's own check, rel 1e-5)."""

from __future__ import annotations

import pytest

from benchmarks import bench_pipeline


def test_quickest_row_has_every_column_and_matches_one_device():
    r = bench_pipeline.row({"pipe": 2, "data": 4}, "1f1b", 4, scan=True)
    assert {k for k, _, _ in bench_pipeline.COLUMNS} <= r.keys()
    assert r["numerics"] == "ok", r
    assert r["loss"] == pytest.approx(r["reference_loss"], rel=bench_pipeline.LOSS_RTOL)
    # Closed forms for p = 2, m = 4; the cost model's bubble is positive and below the
    # makespan; memory figures are positive.
    assert r["closed_gpipe"] == pytest.approx(1 / 5) and r["closed_over_ideal"] == 0.25
    assert 0 < r["bubble_over_makespan"] < 1 and r["bubble_fraction"] > 0
    assert len(r["stage_us"]) == 2
    assert r["predicted_bytes"] > r["predicted_activation_bytes"] > 0
    assert r["compiled_bytes"] >= r["compiled_temp_bytes"] > 0
    assert len(bench_pipeline.format_row(r)) == len(bench_pipeline.COLUMNS)
