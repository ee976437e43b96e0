"""``autopar.evaluate`` prices a plan's ``remat``: the forward nodes the lowering re-runs
(``autopar.lower.remat.plan_remat``) count again, and the memory model drops what the
policy does not store. Before, a plan with ``remat="full"`` was priced as if nothing were
recomputed: the same step time and the same memory as ``"none"``.

Expected values come from the graph, not from the evaluation: the extra FLOPs per device
are the traced FLOPs of the nodes ``plan_remat`` re-runs over the 8 data-parallel devices
(every one of them works on the batch, so each device does an eighth).
"""

from __future__ import annotations

import dataclasses
import functools

import pytest

import autopar
from autopar import baselines
from autopar.errors import LowerPlanError
from autopar.lower.remat import plan_remat
from benchmarks.models.gpt import GPTConfig, make_train_step
from cost_models import Cluster

DEVICES = 8
CLUSTER = Cluster.preset("dgx-a100-80gb")


@functools.cache
def _case():
    step, args = make_train_step(GPTConfig.preset("tiny", scan_layers=False), 64)
    plan = baselines.data_parallel(step, {"data": DEVICES}, *args)
    graph = autopar.trace(step, *args)
    priced = {
        r: autopar.evaluate(step, dataclasses.replace(plan, remat=r), CLUSTER, *args)
        for r in ("none", "selective", "full")
    }
    return graph, priced


@pytest.mark.parametrize("policy", ["selective", "full"])
def test_recomputed_forward_flops_are_priced(policy):
    graph, priced = _case()
    rerun = sum(graph.nodes[n].flops for b in plan_remat(graph, policy).blocks for n in b.nodes)
    assert rerun > 0
    extra = priced[policy].flops_per_device - priced["none"].flops_per_device
    assert extra == pytest.approx(rerun / DEVICES, rel=1e-4)


def test_remat_trades_step_time_for_memory():
    _, priced = _case()
    time = {r: p.step_time_s for r, p in priced.items()}
    memory = {r: p.memory_bytes_per_device for r, p in priced.items()}
    assert time["none"] < time["selective"] < time["full"]
    assert memory["none"] > memory["selective"] > memory["full"]


def test_remat_of_a_scanned_stack_is_refused_as_the_lowering_refuses_it():
    step, args = make_train_step(GPTConfig.preset("tiny", scan_layers=True), 16)
    plan = dataclasses.replace(
        baselines.data_parallel(step, {"data": DEVICES}, *args), remat="full"
    )
    with pytest.raises(LowerPlanError, match="handles unrolled layers only"):
        autopar.evaluate(step, plan, CLUSTER, *args)
