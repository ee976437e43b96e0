"""verify on pipeline plans: what the plan predicts the stages send each other is what the
compiled program sends, and the compiled memory follows the schedule.

GPT tiny in float32 (``benchmarks.models.gpt``, 4 layers) on ``{pipe: 2, data: 4}``,
plans from ``autopar.baselines.pipeline`` scored by ``autopar.evaluate``. Expected values
are counted by hand from the schedules' definitions; memory is read from
``memory_analysis()`` (CPU scratch counted, as ``autopar.verify`` compiles it).
"""

from __future__ import annotations

import dataclasses
import functools

import pytest

import autopar
from autopar import baselines
from autopar.lower import lower_plan
from autopar.verify import MEMORY_TOLERANCE, memory_row, parse_collectives, verify
from cost_models import Cluster

CLUSTER = Cluster.preset("dgx-a100-80gb")
MESH = {"pipe": 2, "data": 4}
SEQ, HIDDEN = 32, 64  # GPT tiny
F32 = 4


# A shard_map tick loop as the SPMD partitioner leaves it: the counter and its bound
# wrapped in copies (no known_trip_count), a switch whose branch 1 all-reduces, and a
# collective-permute after the switch.
TICKS = """HloModule ticks, num_partitions=4

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %s = f32[] add(%x, %y)
}

%idle (a: f32[8]) -> f32[8] {
  ROOT %a = f32[8]{0} parameter(0)
}

%piece (b: f32[8]) -> f32[8] {
  %b = f32[8]{0} parameter(0)
  ROOT %piece_ar = f32[8]{0} all-reduce(%b), channel_id=1, replica_groups={{0,1},{2,3}}, to_apply=%add
}

%tick_cond (p: (s32[], f32[8])) -> pred[] {
  %p = (s32[], f32[8]{0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %i.c = s32[] copy(%i)
  %n = s32[] constant(6)
  %n.c = s32[] copy(%n)
  ROOT %lt = pred[] compare(%i.c, %n.c), direction=LT
}

%tick_body (q: (s32[], f32[8])) -> (s32[], f32[8]) {
  %q = (s32[], f32[8]{0}) parameter(0)
  %j = s32[] get-tuple-element(%q), index=0
  %v = f32[8]{0} get-tuple-element(%q), index=1
  %one = s32[] constant(1)
  %one.c = s32[] copy(%one)
  %j.1 = s32[] add(%j, %one.c)
  %j.2 = s32[] copy(%j.1)
  %sw = f32[8]{0} conditional(%j, %v, %v), branch_computations={%idle, %piece}
  %send = f32[8]{0} collective-permute(%sw), channel_id=2, source_target_pairs={{0,2},{1,3}}
  ROOT %r = (s32[], f32[8]{0}) tuple(%j.2, %send)
}

ENTRY %main (a: f32[8]) -> f32[8] {
  %a = f32[8]{0} parameter(0)
  %zero = s32[] constant(0)
  %zero.c = s32[] copy(%zero)
  %init = (s32[], f32[8]{0}) tuple(%zero.c, %a)
  %loop = (s32[], f32[8]{0}) while(%init), condition=%tick_cond, body=%tick_body
  ROOT %out = f32[8]{0} get-tuple-element(%loop), index=1
}
"""


def test_tick_loop_counts_through_copies_and_names_the_branch() -> None:
    got = {c.name: c for c in parse_collectives(TICKS)}
    assert got["send"].count == 6 and got["send"].trip_count_known
    assert got["send"].branches == ()
    # Every branch counts each time its conditional runs; the branch is recorded so a
    # pipeline's verify can count a piece once per microbatch instead.
    assert got["piece_ar"].count == 6
    assert got["piece_ar"].branches == (("sw", 1, 2),)


@functools.cache
def _gpt(scan: bool, batch: int):
    from benchmarks.models.gpt import GPTConfig, make_train_step

    cfg = GPTConfig.preset("tiny", precision="fp32", scan_layers=scan, layers=4)
    return make_train_step(cfg, batch, abstract=True)


def _scored(scan: bool, batch: int, schedule: str, m: int, v: int = 1):
    step, args = _gpt(scan, batch)
    plan = baselines.pipeline(
        step, MESH, *args, microbatches=m, schedule=schedule, virtual_stages=v
    )
    ev = autopar.evaluate(step, plan, CLUSTER, *args)
    assert ev.extra["p2p_from"] == "program"  # priced from the runtime's own layout
    plan = dataclasses.replace(plan, predicted=ev.to_predicted())
    return plan, lower_plan(step, plan, args), args


@pytest.mark.parametrize("scan", [True, False], ids=["gpt_scan", "gpt_unrolled"])
def test_stage_to_stage_traffic_is_predicted_exactly(scan: bool) -> None:
    plan, lowered, args = _scored(scan, 16, "1f1b", 4)
    report = verify(plan, lowered, *args, check_memory=False)
    row = report.row("collective-permute")
    # By hand: 1F1B over p = 2 stages and m = 4 microbatches runs 2 (m + p - 1) = 10
    # ticks; every tick sends one buffer forward and one backward (idle ticks send
    # zeros): the residual stream of one microbatch, 16 / 4 = 4 rows split over data = 4,
    # so [1, 32, 64] float32 per device.
    ticks, per_tick = 10, 2
    assert row.hlo_count == ticks * per_tick
    assert row.hlo_bytes == ticks * per_tick * 1 * SEQ * HIDDEN * F32
    assert (row.predicted_count, row.predicted_bytes) == (row.hlo_count, row.hlo_bytes)
    assert row.hlo_axes == row.predicted_axes == ("pipe",) and row.status == "ok"
    # The other traffic: the stages' gradient all-reduces over data (once per microbatch,
    # inside each stage's backward piece) and the psums over pipe after the flush.
    assert report.row("all-reduce").status == "ok", report.to_text()
    assert any("inside a stage's piece count 4 runs" in n for n in report.notes)
    # Nothing else: no all-gather is predicted that XLA does not emit.
    assert {r.kind for r in report.rows} == {"all-reduce", "collective-permute"}
    assert report.ok, report.to_text()


def test_interleaved_stage_to_stage_traffic_and_memory() -> None:
    m, v = 4, 2
    plan, lowered, args = _scored(False, 16, "interleaved-1f1b", m, v)
    report = verify(plan, lowered, *args)
    row = report.row("collective-permute")
    # By hand: each device runs 2 m v = 16 chunk ops, and the pipeline fills and drains
    # over p - 1 = 1 tick at each end: 2 (m v + p - 1) = 18 ticks, each sending one
    # [1, 32, 64] float32 buffer forward on the ring and one backward.
    ticks = 2 * (m * v + 2 - 1)
    assert row.hlo_count == row.predicted_count == ticks * 2
    assert row.hlo_bytes == row.predicted_bytes == ticks * 2 * 1 * SEQ * HIDDEN * F32
    assert report.ok, report.to_text()


@pytest.mark.slow
def test_interleaved_scanned_stack_relayout_is_predicted() -> None:
    """A scanned stack run interleaved moves its chunks to the devices that run them and
    the gradients back: one ppermute per stacked leaf each way (p = v = 2: one round)."""
    m, v = 4, 2
    plan, lowered, args = _scored(True, 16, "interleaved-1f1b", m, v)
    report = verify(plan, lowered, *args)
    row = report.row("collective-permute")
    ticks = 2 * (m * v + 2 - 1)
    stacked = sum(1 for r in plan.inputs if r.role == "param" and r.spec and r.spec[0] == "pipe")
    # By hand: the tick sends as above, plus each stacked parameter's chunk in and its
    # gradient's chunk back (one round of the relayout for p = v = 2).
    assert row.hlo_count == row.predicted_count == ticks * 2 + 2 * stacked
    assert row.hlo_bytes == row.predicted_bytes
    assert report.ok, report.to_text()


def _compiled_memory(scan: bool, batch: int, schedule: str, m: int) -> tuple[float, float]:
    """(compiled bytes per device, predicted bytes for the same program): the program is
    lowered without donation, so the new state sits beside the old (as verify adds).
    ``memory_analysis`` compiles with CPU scratch counted
    (``autopar.lower.CPU_MEMORY_COMPILER_OPTIONS``)."""
    plan, lowered, args = _scored(scan, batch, schedule, m)
    row = memory_row(lowered.memory_analysis(*args), plan)
    return row.compiled_bytes, row.predicted_bytes


# The unrolled variants compile 2-3x longer; they run with the slow tests (benchmarks).
_SCAN_FAST_UNROLLED_SLOW = [True, pytest.param(False, marks=pytest.mark.slow)]


@pytest.mark.parametrize("scan", _SCAN_FAST_UNROLLED_SLOW, ids=["gpt_scan", "gpt_unrolled"])
def test_one_f_one_b_memory_is_flat_in_the_microbatches(scan: bool) -> None:
    # Microbatches of 4 examples (one per data shard): m = 4 on a batch of 16, m = 8 on
    # 32. 1F1B keeps at most p = 2 microbatches in flight whatever m is.
    c4, p4 = _compiled_memory(scan, 16, "1f1b", 4)
    c8, p8 = _compiled_memory(scan, 32, "1f1b", 8)
    assert c8 == pytest.approx(c4, rel=0.01)
    for compiled, predicted in ((c4, p4), (c8, p8)):
        assert abs(predicted - compiled) <= MEMORY_TOLERANCE * compiled


@pytest.mark.parametrize("scan", _SCAN_FAST_UNROLLED_SLOW, ids=["gpt_scan", "gpt_unrolled"])
def test_gpipe_memory_grows_with_the_microbatches(scan: bool) -> None:
    # The same microbatches: GPipe keeps all m in flight (its stash has m + 1 slots).
    c4, p4 = _compiled_memory(scan, 16, "gpipe", 4)
    c8, p8 = _compiled_memory(scan, 32, "gpipe", 8)
    assert c8 > 1.2 * c4
    # Both sides grow by the 4 more stashed microbatches, within 10% of each other.
    assert p8 - p4 == pytest.approx(c8 - c4, rel=0.10)
    for compiled, predicted in ((c4, p4), (c8, p8)):
        assert abs(predicted - compiled) <= MEMORY_TOLERANCE * compiled


def test_verify_reports_pipeline_memory_within_tolerance() -> None:
    plan, lowered, args = _scored(True, 16, "1f1b", 4)
    report = verify(plan, lowered, *args)
    assert report.memory is not None and report.memory.ok, report.to_text()
    assert report.row("collective-permute").status == "ok"


@pytest.mark.slow
@pytest.mark.parametrize("scan", [True, False], ids=["gpt_scan", "gpt_unrolled"])
def test_memory_from_4_to_16_microbatches(scan: bool) -> None:
    # Microbatches of 4 examples (one per data shard): m = 4, 8, 16 on batches of 16,
    # 32, 64. 1F1B keeps at most p = 2 microbatches in flight whatever m is; GPipe
    # keeps all m (its stash has m + 1 slots), so from m = 4 to 16 it stashes 12 more.
    flat = [_compiled_memory(scan, 4 * m, "1f1b", m) for m in (4, 8, 16)]
    grow = [_compiled_memory(scan, 4 * m, "gpipe", m) for m in (4, 8, 16)]
    c4 = flat[0][0]
    for compiled, _ in flat[1:]:
        assert compiled == pytest.approx(c4, rel=0.01)
    (g4, p4), (g8, _), (g16, p16) = grow
    # Linear in m: 8 more stashed microbatches from 8 to 16, twice the 4 from 4 to 8.
    assert g16 - g8 == pytest.approx(2 * (g8 - g4), rel=0.10) and g16 > 1.5 * g4
    # Both sides grow by the 12 more stashed microbatches, within 10% of each other.
    assert p16 - p4 == pytest.approx(g16 - g4, rel=0.10)
    for compiled, predicted in flat + grow:
        assert abs(predicted - compiled) <= MEMORY_TOLERANCE * compiled
