"""``benchmarks.bench_published``: the published runs as the reference CSVs give them, the
2021 software generation's clusters, which runs reduce gradients after the flush, and the
rows against their targets (slow)."""

from __future__ import annotations

import math

import pytest

from benchmarks import bench_published as bp
from cost_models import Cluster, collective_time


def test_runs_read_from_the_copied_reference_csvs():
    runs = bp.published_runs()
    groups = [r.group for r in runs]
    # Megatron-LM 2021 Table 1 has ten rows, Table 2 twelve; BLOOM one
    assert groups.count("megatron2021-t1") == 10
    assert groups.count("megatron2021-t2") == 12
    assert groups.count("bloom") == 1
    by = {r.name: r for r in runs}
    # Table 1, 39.1B: t8 p2 on 512 GPUs -> d = 512 / 16 = 32; batch 1536 / 32 = 48
    # microbatches of 1; 48 layers / 2 stages = 24 per stage, even -> interleaved, 2 chunks
    r = by["t1-39.1b"]
    assert (r.tensor, r.pipeline, r.data, r.microbatches) == (8, 2, 32, 48)
    assert (r.layers, r.hidden, r.heads) == (48, 8192, 64)
    assert r.schedule() == ("interleaved-1f1b", 2)
    # 530B: 105 layers / 35 stages = 3 per stage -> v = 3 (280 microbatches, 8 per stage)
    assert by["t1-529.6b"].schedule() == ("interleaved-1f1b", 3)
    # 76.1B: 60 / 4 = 15 per stage -> v = 3; no pipeline -> 1F1B (one stage)
    assert by["t1-76.1b"].schedule() == ("interleaved-1f1b", 3)
    assert by["t1-1.7b"].schedule() == ("1f1b", 1)
    # Table 2, ZeRO-3 175B on 1536 GPUs: microbatch 1, batch 1536 -> one microbatch each
    z = by["t2-zero3-175b-x1536"]
    assert (z.data, z.microbatch, z.microbatches, z.zero_stage) == (1536, 1, 1, 3)
    assert (z.layers, z.hidden, z.heads) == (96, 12288, 96)
    # BLOOM: t4 p12 d8 = 384 GPUs, microbatch 2, batch 2048 -> 2048 / (8 x 2) = 128
    b = by["bloom-176b"]
    assert (b.gpus, b.microbatches, b.zero_stage, b.vocab) == (384, 128, 1, 250880)
    assert b.schedule() == ("1f1b", 1)  # 70 layers do not split evenly over 12 stages
    with pytest.raises(ValueError, match="unknown rows"):
        bp.published_runs(["t1-2b"])


def test_the_2021_generation_gathers_at_one_nic_and_jean_zay_has_omni_path():
    # 16 nodes x 8: an all-gather over all 128 GPUs. NCCL (default): 8 channels over the
    # node's 8 NICs, bus min(230, 8 x 25) = 200 GB/s; ZeRO's per-owner broadcasts (2021):
    # one GPU's 25 GB/s on the whole buffer, 8.4 us + 112 NVLink hops + 15 network hops.
    B = 1e9
    new = collective_time("all-gather", B, Cluster.preset("dgx-a100-80gb", 16), {"d": 128}, ["d"])
    old = collective_time("all-gather", B, bp.cluster_2021(128), {"d": 128}, ["d"])
    assert old == pytest.approx(127 / 128 * B / 25e9 + (8.4 + 112 * 3.4 + 15 * 9.6) * 1e-6)
    assert new < old / 6
    # all-reduce is NCCL's in both generations
    ar = [
        collective_time("all-reduce", B, c, {"d": 128}, ["d"])
        for c in (Cluster.preset("dgx-a100-80gb", 16), bp.cluster_2021(128))
    ]
    assert ar[0] == ar[1]
    # Jean Zay: 4 x 100 Gb/s Omni-Path per 8-GPU node = 6.25 GB/s per GPU
    jz = bp.jean_zay(384)
    assert jz.num_nodes == 48 and jz.inter.bandwidth == pytest.approx(6.25e9)


def test_which_runs_reduce_gradients_after_the_flush():
    # Megatron-LM (Table 1, Table 2's PTD-P) and Megatron-DeepSpeed (BLOOM, ZeRO-1)
    # reduce gradients once after the flush; DeepSpeed's ZeRO-3 during each backward.
    by = {r.name: r for r in bp.published_runs()}
    assert by["t1-1.7b"].reduces_after_flush and by["bloom-176b"].reduces_after_flush
    assert by["t2-ptdp-530b-x560"].reduces_after_flush
    assert not by["t2-zero3-530b-x1120"].reduces_after_flush


def test_zero3_175b_falls_as_published():
    """Table 2's ZeRO-3 175B rows (144 -> 88 -> 44 TFLOP/s per GPU on 384 -> 768 -> 1536
    GPUs) come out of the planner's evaluation falling as published: the
    per-GPU gather volume is the same at every size (the whole model, per step), the
    compute per GPU halves with each doubling."""
    names = ["t2-zero3-175b-x384", "t2-zero3-175b-x768", "t2-zero3-175b-x1536"]
    rows = [bp.evaluate_run(run) for run in bp.published_runs(names)]
    for r in rows:
        assert "error" not in r, r.get("error")
    for r in rows:
        assert abs(r["err"]) <= 0.20, (r["row"], r["predicted"], r["published"])
    pred = [r["predicted"] for r in rows]
    assert pred[0] > pred[1] > pred[2]
    assert pred[2] < 0.5 * pred[0]  # published: 44 / 144 = 0.31


def test_ptdp_530b_reduces_after_the_flush_on_layouts_completed_for_it():
    """Table 2's PTD-P 530B rows on 1120 and 2240 GPUs (167 and 159 TFLOP/s per GPU;
    280-560 microbatches, gradients reduced once after the flush) within the 20% target.
    Priced on stage layouts completed for the program that reduces after the flush:
    completed for the lowered program instead (each microbatch's reduction at 1 - eta),
    they were -23.7% / -23.6% at an overlap efficiency of 0.3
    (docs/cost-model-validation.md)."""
    names = ["t2-ptdp-530b-x1120", "t2-ptdp-530b-x2240"]
    for r in [bp.evaluate_run(run) for run in bp.published_runs(names)]:
        assert "error" not in r, r.get("error")
        assert abs(r["err"]) <= 0.20, (r["row"], r["predicted"], r["published"])


def test_zero3_530b_pads_what_1120_and_2240_do_not_divide():
    """Table 2's ZeRO-3 530B rows on 1120 and 2240 GPUs (98 and 48 TFLOP/s per GPU): no
    dim of the 530B model's weights (105 layers, 20480, 61440 / 81920 wide, vocabulary
    51200) divides 1120 = 2^5 x 5 x 7 or 2240, so only padded partitions (DeepSpeed's
    flattened buffers) shard them; every byte is then gathered, and the prediction falls
    as published, within the 20% target."""
    names = ["t2-zero3-530b-x1120", "t2-zero3-530b-x2240"]
    rows = [bp.evaluate_run(run) for run in bp.published_runs(names)]
    for r in rows:
        assert "error" not in r, r.get("error")
        assert abs(r["err"]) <= 0.20, (r["row"], r["predicted"], r["published"])
    # the gathers: the whole model per step at every size, so halving the compute per
    # GPU (1120 -> 2240, microbatch 2 -> 1) roughly halves the throughput (48 / 98)
    assert rows[1]["predicted"] < 0.6 * rows[0]["predicted"]


@pytest.mark.slow
@pytest.mark.parametrize("run", bp.published_runs(), ids=lambda r: r.name)
def test_published_rows_within_their_targets(run):
    """Issue 14's targets: Table 1 within 15%, Table 2 within 20%, BLOOM within 15%."""
    r = bp.evaluate_run(run)
    assert "error" not in r, r.get("error")
    assert math.isfinite(r["predicted"])
    assert abs(r["err"]) <= bp.TOLERANCE[run.group], (
        f"{run.name}: predicted {r['predicted']:.1f} vs published {run.published_tflops:g}"
    )


@pytest.mark.slow
def test_the_2021_overlap_constant_is_the_fit():
    """``OVERLAP_EFFICIENCY_2021`` is what the planner's evaluation fits on Table 2's six
    ZeRO-3 rows (least squares of the log error), to two digits."""
    from cost_models.cluster import OVERLAP_EFFICIENCY_2021

    assert round(bp.fit_overlap_efficiency(), 2) == OVERLAP_EFFICIENCY_2021
