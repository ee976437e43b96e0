"""One pricing door: the number the solver minimises is the number the plan reports.

For every zoo model on every mesh shape of the search tests (and with the mesh left to
the search), the three numbers a user may read as "the predicted step time" are one:

* the solver's objective for the chosen layouts (``ShardingSolution.objective``,
  recomputed exactly from the problem's costs),
* ``plan.predicted.step_time_s`` (written by the planner),
* ``autopar.evaluate(graph, plan, cluster).step_time_s`` (re-scored from the saved plan).

The refinements the linear form leaves out are reported beside it and checked against
their definitions (hand-computed from the plan's own parts).
"""

from __future__ import annotations

import functools

import pytest

import autopar
from autopar.options import SearchOptions
from autopar.plan import Plan
from autopar.search import plan_graph
from autopar.search.pricing import class_weight
from autopar.trace import trace
from cost_models import HIDEABLE_CLASSES, Cluster, compose_step_time
from tests.lower._zoo import mesh_for, zoo_step

EIGHT = Cluster.preset("dgx-a100-80gb")
REL = 1e-9  # the acceptance bound: equal up to float summation order
MODELS = ("mlp", "gpt_scan", "gpt_unrolled", "moe", "wide_resnet")
SHAPES = ((8,), (2, 4), (4, 2), (2, 2, 2), None)  # None: the search picks the mesh


@functools.cache
def _graph(model: str):
    step, args = zoo_step(model, abstract=True)
    return trace(step, *args)


def _options(model: str, shape) -> SearchOptions:
    if shape is None:
        return SearchOptions()
    kind = "expert_parallel" if model == "moe" and len(shape) > 1 else "any"
    return SearchOptions(mesh=mesh_for(shape, kind))


# MoE on the open and the 2x2x2 mesh take ~50 s each (a 540-node ILP solved to its time
# limit on 2 cores): every case runs with `pytest -m slow`, the rest by default.
_SLOW = {("moe", None), ("moe", (2, 2, 2))}


def _cases():
    for model in MODELS:
        for shape in SHAPES:
            marks = (pytest.mark.slow,) if (model, shape) in _SLOW else ()
            name = "open" if shape is None else "x".join(map(str, shape))
            yield pytest.param(model, shape, marks=marks, id=f"{model}-{name}")


@pytest.mark.parametrize("model,shape", list(_cases()))
def test_objective_is_the_reported_step_time(model, shape):
    graph = _graph(model)
    results: list = []
    plan = plan_graph(graph, EIGHT, _options(model, shape), results=results)
    won = [
        r
        for r in results
        if r.evaluation is not None and r.evaluation.step_time_s == plan.predicted.step_time_s
    ]
    assert won, "no mesh result carries the plan's step time"
    objective = won[0].solution.objective
    assert plan.predicted.step_time_s == pytest.approx(objective, rel=REL)
    assert plan.predicted.objective == pytest.approx(objective, rel=REL)
    # Re-scored from the plan as saved and loaded (what a user replays).
    again = Plan.from_json(plan.to_json())
    ev = autopar.evaluate(graph, again, EIGHT)
    assert ev.step_time_s == pytest.approx(objective, rel=REL)
    assert ev.extra["problem_objective"] == pytest.approx(objective, rel=REL)


def test_refinements_are_named_apart_and_match_their_definitions():
    graph = _graph("gpt_unrolled")
    plan = plan_graph(graph, EIGHT, SearchOptions(mesh={"data": 2, "tensor": 4}))
    p = plan.predicted
    ev = autopar.evaluate(graph, plan, EIGHT)
    eta = EIGHT.overlap_efficiency
    # The linear form, recomputed by hand from the collectives the plan lists (what the
    # program runs) plus the reshards XLA merges, which the ILP charges per reader.
    linear = p.compute_s + p.merged_reshard_s
    linear += sum(class_weight(c.where, eta) * c.time_s for c in p.collectives)
    assert p.step_time_s == pytest.approx(linear, rel=1e-9)
    assert p.exposed_communication_s == pytest.approx(p.step_time_s - p.compute_s, rel=1e-9)
    # The overlap refinement is compose_step_time of the same parts, and never more
    # pessimistic about hiding than the linear weights allow.
    by_class: dict[str, float] = {}
    for c in p.collectives:
        by_class[c.where] = by_class.get(c.where, 0.0) + c.time_s
    overlap = compose_step_time(p.compute_s, by_class, ev.backward_compute_s, eta)
    assert p.overlap_step_time_s == pytest.approx(overlap.total_s, rel=1e-9)
    hideable = sum(t for cls, t in by_class.items() if cls in HIDEABLE_CLASSES)
    assert p.overlap_step_time_s >= p.step_time_s - p.merged_reshard_s - eta * hideable - 1e-15


def test_class_weights_follow_the_cost_model_classes():
    for cls in HIDEABLE_CLASSES:
        assert class_weight(cls, 0.25) == 0.75
    for cls in ("tensor", "seq", "expert", "reshard"):
        assert class_weight(cls, 0.25) == 1.0


def test_a_completion_for_reductions_after_the_flush_weighs_only_gradient_reductions():
    # m = 4 microbatches reduced once after the flush: each microbatch's reduction counts
    # 1/4 of its seconds; parameter gathers keep 1 - eta, the rest 1.
    assert class_weight("dp_grad", 0.25, dp_grad_weight=0.25) == 0.25
    assert class_weight("fsdp_gather", 0.25, dp_grad_weight=0.25) == 0.75
    assert class_weight("tensor", 0.25, dp_grad_weight=0.25) == 1.0
    from autopar.errors import InvalidOptionError
    from autopar.search.costs import CostContext

    cluster = Cluster.preset("dgx-a100-80gb")
    assert CostContext(cluster, {"data": 8}, dp_grad_weight=0.25).dp_grad_weight == 0.25
    with pytest.raises(InvalidOptionError, match=r"dp_grad_weight must be in \[0, 1\]"):
        CostContext(cluster, {"data": 8}, dp_grad_weight=-1.0)
