"""A plan's ``remat`` (no pipeline stages, unrolled layers) is priced: ``autopar.evaluate``
counts again the forward nodes the lowering re-runs (``autopar.lower.remat.plan_remat``),
and the memory model drops what the policy does not store. Before, a plan with
``remat="full"`` was priced as if nothing were recomputed (the same step time and memory
as ``"none"``), and ``SearchOptions(remat=...)`` on a mesh without ``pipe`` was refused.
Now the search plans a fixed ``remat`` and reports what ``evaluate`` reports.

Expected values come from the graph, not from the evaluation: the extra FLOPs per device
are the traced FLOPs of the nodes ``plan_remat`` re-runs over the 8 data-parallel devices
(every one of them works on the batch, so each device does an eighth).
"""

from __future__ import annotations

import dataclasses
import functools

import pytest

import autopar
from autopar import SearchOptions, baselines
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


def test_a_fixed_remat_is_planned_priced_as_evaluate_prices_it_and_run():
    from tests.lower._zoo import check_against_single_device

    cfg = GPTConfig.preset("tiny", scan_layers=False, precision="fp32")
    step, args = make_train_step(cfg, 64, abstract=False)
    mesh = {"data": DEVICES}
    fast = autopar.autoparallel(
        step, cluster=CLUSTER, options=SearchOptions(mesh=mesh, remat="full"), cache=False
    )
    plan = fast.plan_for(*args)
    assert plan.remat == "full"
    # the number the search minimised is the number evaluate reports for the plan
    ev = autopar.evaluate(step, plan, CLUSTER, *args)
    assert ev.step_time_s == pytest.approx(plan.predicted.step_time_s, rel=1e-9)
    assert ev.memory_bytes_per_device == pytest.approx(plan.predicted.memory_bytes_per_device)
    plain = autopar.plan(step, *args, cluster=CLUSTER, options=SearchOptions(mesh=mesh))
    assert plan.predicted.memory_bytes_per_device < plain.predicted.memory_bytes_per_device
    # the lowered program recomputes and still equals single-device jax.jit
    check_against_single_device(step, args, fast)


def test_selective_remat_with_the_mesh_open_is_an_intra_op_plan():
    # Pipeline stages rematerialise "none" or "full"; a fixed "selective" plans without them.
    step, args = make_train_step(GPTConfig.preset("tiny", scan_layers=False), 64)
    plan = autopar.plan(step, *args, cluster=CLUSTER, options=SearchOptions(remat="selective"))
    assert plan.remat == "selective"
    assert plan.pipeline is None or plan.pipeline.num_stages == 1
    ev = autopar.evaluate(step, plan, CLUSTER, *args)
    assert ev.step_time_s == pytest.approx(plan.predicted.step_time_s, rel=1e-9)


def test_remat_is_the_lever_searched_when_nothing_fits_without_it():
    # Data parallel only, under a bound the unrematerialised step does not fit in: the
    # search rematerialises the layers rather than give up, and says what it tried when
    # even that does not fit.
    from autopar.errors import InfeasiblePlanError

    step, args = make_train_step(GPTConfig.preset("tiny", scan_layers=False), 64)
    bound = 1.5e6
    opts = SearchOptions(axes=("data",), memory_limit_bytes=bound)
    with pytest.raises(InfeasiblePlanError):
        autopar.plan(step, *args, cluster=CLUSTER, options=dataclasses.replace(opts, remat="none"))
    plan = autopar.plan(step, *args, cluster=CLUSTER, options=opts)
    assert plan.remat in ("selective", "full")
    assert plan.predicted.memory_bytes_per_device <= bound
    assert f"remat {plan.remat}" in plan.shortlist[0].label
    ev = autopar.evaluate(step, plan, CLUSTER, *args)
    assert ev.step_time_s == pytest.approx(plan.predicted.step_time_s, rel=1e-9)
    with pytest.raises(InfeasiblePlanError, match="Each layer rematerialised: smallest") as e:
        autopar.plan(
            step, *args, cluster=CLUSTER, options=dataclasses.replace(opts, memory_limit_bytes=4e5)
        )
    assert e.value.smallest_bytes > 4e5
