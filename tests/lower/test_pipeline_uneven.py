"""Uneven pipeline stages from the inter-op split (``autopar.search.interop``): a GPT whose
head outweighs its layers gets fewer layers in the head's stage, predicted faster than
the even split, lowered and equal to single-device ``jax.jit``.

Expected split worked by hand from FLOPs (forward, per token; the backward doubles both
sides): a block of the tiny GPT (hidden ``h = 64``, ``s = 32`` tokens) runs ``24 h^2 +
4 s h = 106,496`` FLOPs; the head over a ``V = 16,384`` vocabulary runs ``2 h V =
2,097,152``, about 20 blocks. With 6 blocks on 2 stages the head's stage costs at least
the head plus one block (~21 blocks) whatever the split, and the split (5, 1) reaches
that bound (its first stage, the embedding and 5 blocks, costs ~5): the only optimum.
The even split (3, 3) has a ~23-block bottleneck, so it is slower by Alpa's formula.
"""

from __future__ import annotations

import functools

import pytest

import autopar
from cost_models import Cluster
from tests.lower._zoo import heavy_head_gpt

TWO_NODES = Cluster.preset("dgx-a100-80gb", nodes=2, devices_per_node=4)
M = 4
OPTIONS = autopar.SearchOptions(
    pipeline_stages=2, schedule="1f1b", remat="none", microbatches=M, axes=("pipe", "data")
)


def _gpt(abstract: bool = True):
    return heavy_head_gpt(False, abstract)


@functools.cache
def _planned():
    step, args = _gpt()
    return autopar.plan(step, *args, cluster=TWO_NODES, options=OPTIONS)


def test_a_heavy_head_gets_a_stage_with_fewer_layers():
    step, args = _gpt()
    plan = _planned()
    assert plan.mesh == {"pipe": 2, "data": 4}
    assert plan.pipeline.stages == ((0, 5), (5, 6))
    even = autopar.baselines.pipeline(
        step, plan.mesh, *args, microbatches=M, schedule="1f1b", stages=((0, 3), (3, 6))
    )
    uneven = autopar.baselines.pipeline(
        step, plan.mesh, *args, microbatches=M, schedule="1f1b", stages=((0, 5), (5, 6))
    )
    t_even = autopar.evaluate(step, even, TWO_NODES, *args)
    t_uneven = autopar.evaluate(step, uneven, TWO_NODES, *args)
    assert t_uneven.step_time_s < t_even.step_time_s
    assert plan.predicted.step_time_s < t_even.step_time_s
    # The head's stage is the bottleneck either way; moving two blocks off it shortens it.
    fe, be = t_even.extra["stage_forward_s"], t_even.extra["stage_backward_s"]
    fu, bu = t_uneven.extra["stage_forward_s"], t_uneven.extra["stage_backward_s"]
    assert fe[1] + be[1] > fe[0] + be[0]
    assert fu[1] + bu[1] < fe[1] + be[1]
    assert fu[1] + bu[1] >= fu[0] + bu[0]


@pytest.mark.slow
def test_uneven_stages_run_equal_to_single_device():
    from autopar.lower import lower_plan
    from tests.lower._zoo import check_against_single_device

    step, args = _gpt(abstract=False)
    plan = _planned()
    lowered = lower_plan(step, plan, args)
    check_against_single_device(step, args, lowered)
