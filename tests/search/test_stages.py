"""Pricing pipeline plans (autopar.search.stages): interleaved 1F1B and the completion of
a stage's program.

GPT tiny in float32 (``benchmarks.models.gpt``, unrolled layers) on ``{pipe: 2, data:
4}``, plans from ``autopar.baselines.pipeline`` scored by ``autopar.evaluate``; expected
values are counted from the schedules' definitions (Narayanan et al. 2021, Megatron-LM's
interleaved schedule), not read off the code under test.
"""

from __future__ import annotations

import dataclasses
import functools

import pytest

import autopar
import cost_models
from autopar import baselines
from autopar.errors import LoadPlanError
from autopar.plan import PipelinePlan
from cost_models import Cluster

CLUSTER = Cluster.preset("dgx-a100-80gb")
MESH = {"pipe": 2, "data": 4}
P, V = 2, 2


@functools.cache
def _gpt(layers: int, batch: int, scan: bool = False):
    from benchmarks.models.gpt import GPTConfig, make_train_step

    cfg = GPTConfig.preset("tiny", precision="fp32", scan_layers=scan, layers=layers)
    return make_train_step(cfg, batch, abstract=True)


@functools.cache
def _scored(schedule: str, m: int, v: int = 1):
    step, args = _gpt(4, 4 * m)
    plan = baselines.pipeline(
        step, MESH, *args, microbatches=m, schedule=schedule, virtual_stages=v
    )
    return plan, autopar.evaluate(step, plan, CLUSTER, *args)


@pytest.mark.parametrize("m", [4, 8])
def test_interleaved_plan_is_priced_per_chunk(m: int) -> None:
    plan, ev = _scored("interleaved-1f1b", m, V)
    assert plan.pipeline.stages == ((0, 1), (1, 2), (2, 3), (3, 4))  # one layer a chunk
    x = ev.extra
    assert x["chunks"] == V and x["p2p_from"] == "program"
    chunk_f, chunk_b = x["chunk_forward_s"], x["chunk_backward_s"]
    assert len(chunk_f) == len(chunk_b) == P * V and all(t > 0 for t in chunk_f + chunk_b)
    # Device d runs chunks d and p + d.
    for d in range(P):
        assert x["stage_forward_s"][d] == pytest.approx(chunk_f[d] + chunk_f[P + d])
        assert x["stage_backward_s"][d] == pytest.approx(chunk_b[d] + chunk_b[P + d])
    # The embedding is chunk 0's, the head and the loss the last chunk's: chunks of
    # equal layers still differ.
    assert chunk_f[0] != pytest.approx(chunk_f[1]) and chunk_f[3] > chunk_f[1]
    # Megatron-LM's warm-up: device 0 runs 2(p-1) + (v-1)p chunk-forwards before its
    # first backward, so it holds that many plus the one in its first 1F1B pair (all
    # m v of them when m = p).
    want = min(2 * (P - 1) + (V - 1) * P + 1, m * V)
    assert x["peak_inflight"][0] == want


def test_interleaved_sends_every_tick_of_its_table() -> None:
    m = 4
    plan, ev = _scored("interleaved-1f1b", m, V)
    (p2p,) = [c for c in ev.collectives if c.kind == "collective-permute"]
    # Each device runs 2 m v chunk ops; the pipeline fills and drains over p - 1 ticks
    # at each end: 2 (m v + p - 1) = 18 ticks, each sending one buffer forward on the
    # ring and one backward. A buffer is one microbatch's residual stream: 4 rows split
    # over data = 4, [1, 32, 64] float32 per device.
    ticks = 2 * (m * V + P - 1)
    assert p2p.count == 2 * ticks
    assert p2p.bytes == 2 * ticks * 1 * 32 * 64 * 4


def test_interleaving_trades_idle_ticks_for_stage_crossings() -> None:
    m = 8
    _, flat = _scored("1f1b", m)
    _, inter = _scored("interleaved-1f1b", m, V)
    # The same work per device, in chunks.
    for key in ("stage_forward_s", "stage_backward_s"):
        assert sum(inter.extra[key]) == pytest.approx(sum(flat.extra[key]), rel=1e-6)

    # Without sends, the interleaved schedule's idle time shrinks as the closed forms
    # say for equal stages ((p-1)/m = 0.125 against (p-1)/(v m) = 0.0625).
    def bubble(ev, p2p: float) -> float:
        x = ev.extra
        return cost_models.simulate_schedule(
            "interleaved-1f1b" if x["chunks"] > 1 else "1f1b",
            x["chunk_forward_s"], x["chunk_backward_s"], m, p2p=p2p, chunks=x["chunks"],
            per_chunk=True,
        ).bubble_fraction  # fmt: skip

    assert bubble(inter, 0.0) < bubble(flat, 0.0)
    # Each microbatch crosses p v - 1 cuts instead of p - 1, and in a model this small a
    # send takes about as long as a chunk's work: the priced bubble grows instead.
    assert inter.extra["p2p_s"] > 0.5 * min(inter.extra["chunk_forward_s"])
    assert inter.extra["bubble_fraction"] > flat.extra["bubble_fraction"]
    assert inter.extra["bubble_fraction"] == pytest.approx(bubble(inter, inter.extra["p2p_s"]))


def test_interleaved_memory_follows_the_stash_it_carries() -> None:
    _, flat = _scored("1f1b", 8)
    _, inter = _scored("interleaved-1f1b", 8, V)
    # 1F1B keeps p = 2 microbatches of a stage (2 layers) in flight on device 0; the
    # interleaved schedule keeps 5 chunks of one layer each: 2.5 stage-equivalents, so
    # its stash is larger but not twice as large.
    a_flat, a_inter = flat.memory_breakdown["activations"], inter.memory_breakdown["activations"]
    assert a_flat < a_inter < 2 * a_flat


def test_chunks_need_the_interleaved_schedule_and_whole_groups_of_p() -> None:
    step, args = _gpt(4, 16)
    plan, _ = _scored("interleaved-1f1b", 4, V)
    stages = plan.pipeline.stages
    wrong = dataclasses.replace(plan, pipeline=PipelinePlan(stages, "1f1b", 4, chunks=V))
    with pytest.raises(LoadPlanError, match="interleaved-1f1b"):
        autopar.evaluate(step, wrong, CLUSTER, *args)


def test_a_stage_keeps_replicated_work_replicated() -> None:
    # The lowered pipeline pins nothing inside a stage: XLA's propagation lays its
    # values out, starting from the sharded batch. The position embedding's rows (a
    # slice of a replicated parameter, broadcast to the batch's rank) are reached by no
    # sharded value, so they stay whole and nothing is gathered (the completion once
    # split them for free and predicted 4 x 8 KiB all-gathers XLA never emits).
    _, ev = _scored("1f1b", 4)
    kinds = {c.kind for c in ev.collectives}
    assert kinds == {"collective-permute", "all-reduce"}
