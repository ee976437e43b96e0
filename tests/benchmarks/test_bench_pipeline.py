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


def test_the_full_table_covers_the_acceptance_matrix():
    rows = bench_pipeline.cases()
    keys = {
        (name, scan, tuple(mesh.items()), schedule, m)
        for name, scan, mesh, _, schedule, m, _ in rows
    }
    meshes = [
        {"pipe": 2, "data": 4},
        {"pipe": 2, "data": 2, "tensor": 2},
        {"pipe": 4, "data": 2},
        {"pipe": 8},
    ]
    for name, scan in (("gpt", True), ("gpt", False), ("moe", False)):
        for mesh in meshes:
            for m in (4, 8):
                for schedule in ("gpipe", "1f1b"):
                    assert (name, scan, tuple(mesh.items()), schedule, m) in keys
                # Interleaved needs unrolled layers and m a multiple of p.
                if not scan and m % mesh["pipe"] == 0:
                    assert (name, scan, tuple(mesh.items()), "interleaved-1f1b", m) in keys
    for _, scan, mesh, layers, _, _, v in rows:
        assert layers >= mesh["pipe"] * v and (v == 1 or not scan)


@pytest.mark.slow
def test_interleaved_moe_row():
    r = bench_pipeline.row({"pipe": 2, "data": 4}, "interleaved-1f1b", 4, False, 4, "moe", 2)
    assert r["numerics"] == "ok", r
    assert r["closed_over_ideal"] == pytest.approx(1 / 8)  # (p-1)/(v m)
    assert len(r["stage_us"]) == 2 and abs(r["memory_error"]) <= 0.20
