"""A pipeline evaluation's step with overlap bounded by compute
(``Evaluation.overlap_step_time_s``) and with data-parallel gradients reduced once after
the flush (``extra["after_flush_step_s"]``): the parts come from the evaluation's own
collective table (the stages' collectives, per device; the schedule's sends left out),
the rule from ``cost_models.overlap.bound_linear_overlap`` (tested by hand in
``tests/cost_models/test_overlap_bound.py``).

GPT tiny in float32, 2 unrolled layers, 1F1B over ``{pipe: 2, data: 4}``, 2 microbatches.
"""

from __future__ import annotations

import functools

import pytest

import autopar
from autopar import baselines
from cost_models import Cluster
from cost_models.overlap import bound_linear_overlap

CLUSTER = Cluster.preset("dgx-a100-80gb")
MESH = {"pipe": 2, "data": 4}
P, M = 2, 2


@functools.cache
def _scored():
    from benchmarks.models.gpt import GPTConfig, make_train_step

    cfg = GPTConfig.preset("tiny", precision="fp32", layers=2)
    step, args = make_train_step(cfg, 4 * M, abstract=True)
    plan = baselines.pipeline(step, MESH, *args, microbatches=M, schedule="1f1b")
    return autopar.evaluate(step, plan, CLUSTER, *args)


def test_pipeline_overlap_is_bounded_from_its_own_collectives():
    ev = _scored()
    eta = CLUSTER.overlap_efficiency
    # The stages' collectives (not over pipe: those are the schedule's sends and the
    # psums after the flush), per device of the P stages.
    hide = {"dp_grad": 0.0, "fsdp_gather": 0.0}
    exposed = 0.0
    for c in ev.collectives:
        if "pipe" in c.axes:
            continue
        if c.where in hide:
            hide[c.where] += c.time_s / P
        else:
            exposed += c.time_s / P
    assert hide["dp_grad"] > 0  # the stages reduce their gradients over data
    assert ev.extra["dp_grad_per_device_s"] == pytest.approx(hide["dp_grad"])
    assert ev.extra["fsdp_gather_per_device_s"] == pytest.approx(hide["fsdp_gather"])
    args = (ev.step_time_s, ev.compute_s, hide, exposed, eta)
    assert ev.overlap_step_time_s == pytest.approx(bound_linear_overlap(*args))
    # Bounded hiding never hides more than the linear form does, so it is never faster.
    assert ev.overlap_step_time_s >= ev.step_time_s - 1e-12


def test_after_the_flush_the_schedule_runs_without_the_reductions_then_one_is_paid():
    """Once after the flush, by the rule: the per-microbatch reductions (backward work,
    charged 1 - eta each in the stage times) leave the stages, the schedule is simulated
    again (``cost_models.simulate_schedule``, tested on its own), and then each device
    reduces its accumulated gradients, one microbatch's bytes, with nothing to hide
    behind: the slower device's reduction is exposed. No parameter gathers here."""
    from cost_models import simulate_schedule

    ev = _scored()
    eta = CLUSTER.overlap_efficiency
    g = ev.extra["chunk_dp_grad_s"]
    assert len(g) == P and min(g) > 0  # both stages reduce their gradients over data
    # Every stage's reductions over the M microbatches are the table's dp_grad over data.
    table = sum(c.time_s for c in ev.collectives if c.where == "dp_grad" and "pipe" not in c.axes)
    assert sum(g) * M == pytest.approx(table)
    assert ev.extra["fsdp_gather_per_device_s"] == 0.0
    fwd = ev.extra["chunk_forward_s"]
    bwd = [b - (1 - eta) * x for b, x in zip(ev.extra["chunk_backward_s"], g, strict=True)]
    sim = simulate_schedule("1f1b", fwd, bwd, M, p2p=ev.extra["p2p_s"])
    pipe_psum = sum(
        c.time_s for c in ev.collectives if c.axes == ("pipe",) and c.where == "dp_grad"
    )
    expected = sim.makespan + ev.extra["update_s"] + pipe_psum + max(g)
    assert ev.extra["after_flush_step_s"] == pytest.approx(expected)
    # The reductions are positive backward work: taken out, the schedule is shorter.
    assert sim.makespan < ev.extra["makespan_s"]
