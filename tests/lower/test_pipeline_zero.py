"""ZeRO inside pipeline stages (issue 13: ``zero_stage`` is a lever the options can fix
with a ``pipe`` axis): the stages' optimizer state (ZeRO-1) or state and parameters
(ZeRO-3) split over ``data``, the lowered pipeline equal to single device, and the
outer loop's candidates carrying the fixed stage.

Expected layouts come from the ZeRO definitions (Rajbhandari et al. 2020): stage 1
partitions the optimizer state over the data-parallel ranks and keeps parameters whole
on each; stage 3 partitions the parameters too. The tiny zoo GPT's state is dominated by
its blocks' matmul weights, whose dims (64, 256) the 4 data replicas divide.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import pytest

import autopar
from autopar import SearchOptions
from autopar.lower import lower_plan
from autopar.search.outer import PipelineConfig, Profile, screen
from cost_models import Cluster
from tests.lower._zoo import check_against_single_device

MESH = {"pipe": 2, "data": 4}


@functools.cache
def _step(scan: bool):
    from benchmarks.models.gpt import GPTConfig, make_train_step

    cfg = GPTConfig.preset("tiny", precision="fp32", scan_layers=scan, layers=4)
    step, args = make_train_step(cfg, 16, abstract=False)
    return step, jax.device_put(args, jax.devices()[0])


def _bytes_over_data(plan, role: str) -> float:
    """The fraction of ``role``'s bytes whose layout uses the ``data`` axis."""
    total = over = 0
    for r in plan.inputs:
        if r.role != role:
            continue
        n = 1
        for d in r.shape:
            n *= d
        total += n
        axes = {a for e in r.spec if e for a in ((e,) if isinstance(e, str) else e)}
        over += n * ("data" in axes)
    return over / total


@pytest.mark.parametrize(
    ("scan", "zero"),
    [(True, 1), pytest.param(False, 1, marks=pytest.mark.slow), (True, 3)],  # unrolled: slow
)
def test_pipeline_with_a_fixed_zero_stage_splits_the_state_and_equals_single_device(scan, zero):
    step, args = _step(scan)
    opts = SearchOptions(mesh=MESH, microbatches=4, schedule="1f1b", zero_stage=zero)
    plan = autopar.plan(step, *args, options=opts)
    assert plan.pipeline is not None and plan.mesh["pipe"] == 2
    assert plan.zero_stage == zero
    # ZeRO-1: most optimizer-state bytes over data, parameters kept off it; ZeRO-3 both.
    assert _bytes_over_data(plan, "opt_state") > 0.5
    if zero == 1:
        assert _bytes_over_data(plan, "param") == 0.0
    else:
        assert _bytes_over_data(plan, "param") > 0.5
    check_against_single_device(step, args, lower_plan(step, plan, args))


def test_zero_1_inside_the_stages_holds_less_state_than_plain_data_parallel():
    # The same pipeline priced with and without ZeRO-1: the optimizer state (AdamW's two
    # moments, twice the parameters' bytes) drops to about 1/4 on 4 replicas.
    step, args = _step(True)
    base = SearchOptions(mesh=MESH, microbatches=4, schedule="1f1b", zero_stage=0)
    plain = autopar.plan(step, *args, options=base)
    zero = autopar.plan(step, *args, options=dataclasses.replace(base, zero_stage=1))
    opt0 = plain.predicted.memory_breakdown["optimizer"]
    opt1 = zero.predicted.memory_breakdown["optimizer"]
    assert opt1 < opt0 / 2
    assert plain.zero_stage == 0


def test_screen_splits_the_optimizer_share_over_data_for_a_fixed_zero_stage():
    # 8 GB of state per group, half of it optimizer state (AdamW's moments over fp32
    # parameters and gradients: 8 of 16 bytes per parameter); 4 stages, 2 replicas:
    # a stage holds 2 GB, of which ZeRO-1 splits the 1 GB of optimizer state in two.
    prof = Profile({}, 1, 1.0, 2.0, 0.0, 8e9, 0.0, 0.0, 0.0, optimizer_share=0.5, param_share=0.25)
    cluster = Cluster.preset("dgx-a100-80gb", nodes=2, devices_per_node=4)
    z0 = screen(PipelineConfig(4, {}, 2, 8, 1), prof, cluster)
    z1 = screen(PipelineConfig(4, {}, 2, 8, 1, zero_stage=1), prof, cluster)
    z3 = screen(PipelineConfig(4, {}, 2, 8, 1, zero_stage=3), prof, cluster)
    assert z0.memory_bytes == pytest.approx(2e9)
    assert z1.memory_bytes == pytest.approx(2e9 - 0.5e9)
    assert z3.memory_bytes == pytest.approx(2e9 - 0.75e9)
    assert z1.config.label.endswith("ZeRO-1")


def test_the_outer_loop_keeps_a_fixed_zero_stage_in_every_candidate():
    from benchmarks.models.gpt import GPTConfig, make_train_step

    cfg = GPTConfig.preset("tiny", precision="fp32", layers=4)
    step, args = make_train_step(cfg, 16)
    cluster = Cluster.preset("dgx-a100-80gb", nodes=2, devices_per_node=4)
    # Two stages fixed: at this size the embeddings' all-reduce over pipe (whole on every
    # stage) keeps pipelines out of an open search's shortlist.
    opts = SearchOptions(zero_stage=1, pipeline_stages=2)
    plan = autopar.plan(step, *args, cluster=cluster, options=opts)
    assert plan.zero_stage == 1
    # The data replicas split the batch's leading dim (ZeRO's ranks), not its sequence.
    for r in plan.inputs:
        if r.role == "batch":
            lead = r.spec[0] if r.spec else None
            assert "data" in ((lead,) if isinstance(lead, str) else (lead or ())), r
    piped = [c for c in plan.shortlist if c.label.startswith("pipe ")]
    assert piped, [c.label for c in plan.shortlist]
    assert all(c.label.endswith("ZeRO-1") for c in piped)


def test_a_zero_pipeline_that_cannot_fit_says_by_how_much():
    # 1 kB per device holds not even the embedding table's share.
    from autopar import InfeasiblePlanError

    step, args = _step(True)
    opts = SearchOptions(mesh=MESH, microbatches=4, zero_stage=1, memory_limit_bytes=1000)
    with pytest.raises(InfeasiblePlanError) as info:
        autopar.plan(step, *args, options=opts)
    assert info.value.smallest_bytes is not None and info.value.smallest_bytes > 1000
    assert info.value.bound_bytes == 1000
    assert "fits the bound of 1000 bytes per device" in str(info.value)
    assert "zero_stage=1" in str(info.value)


def test_screen_takes_zero_1_as_a_lever_only_when_it_makes_the_stage_fit():
    # 8 GB of state, half of it optimizer state, on 4 stages: 2 GB a stage without ZeRO;
    # ZeRO-1 over 2 replicas halves the optimizer's half: 1.5 GB.
    prof = Profile({}, 1, 1.0, 2.0, 0.0, 8e9, 0.0, 0.0, 0.0, optimizer_share=0.5)
    cluster = Cluster.preset("dgx-a100-80gb", nodes=2, devices_per_node=4)
    searched = PipelineConfig(4, {}, 2, 8, 1)
    assert searched.zero_stage is None
    roomy = screen(searched, prof, cluster, 3e9)  # fits without: no ZeRO
    assert roomy.config.zero_stage is None and roomy.memory_bytes == pytest.approx(2e9)
    tight = screen(searched, prof, cluster, 1.6e9)  # fits only with ZeRO-1
    assert tight.config.zero_stage == 1 and tight.memory_bytes == pytest.approx(1.5e9)
    assert tight.config.label.endswith("ZeRO-1")
    hopeless = screen(searched, prof, cluster, 1.2e9)  # fits with neither: left as is
    assert hopeless.config.zero_stage is None and hopeless.memory_bytes == pytest.approx(2e9)
    fixed = screen(PipelineConfig(4, {}, 2, 8, 1, zero_stage=0), prof, cluster, 1.6e9)
    assert fixed.config.zero_stage == 0 and fixed.memory_bytes == pytest.approx(2e9)
