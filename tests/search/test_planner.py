"""End-to-end planning: trace a step, search a plan, check the layouts an expert expects.

Expected layouts come from the textbook analyses (data parallel when the batch dominates,
Megatron when the hidden size does, expert parallel for MoE, sequence parallel for one long
sequence, ZeRO when state does not fit) and from hand arithmetic, never from a previous
run of the planner.
"""

import math
import re

import pytest

from autopar.errors import InfeasiblePlanError, InvalidOptionError
from autopar.options import SearchOptions
from autopar.plan import ActivationConstraint, Plan, TensorSharding
from autopar.search import evaluate_plan, plan_graph
from autopar.trace import trace
from cost_models import Cluster, collective_time
from tests.search.models import mlp, moe

FOUR = Cluster.preset("dgx-a100-80gb", devices_per_node=4)
EIGHT = Cluster.preset("dgx-a100-80gb")


def _axes(entry):
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def _ways(plan, entry):
    return math.prod(plan.mesh[a] for a in _axes(entry))


def _ops(plan):
    return [(name, text) for layer in plan.layers for name, text in layer.ops]


@pytest.fixture(scope="module")
def mlp_batch_heavy():
    step, args = mlp(batch=65536, d=256, h=256)
    return trace(step, *args)


@pytest.fixture(scope="module")
def mlp_hidden_heavy():
    step, args = mlp(batch=32, d=8192, h=32768)
    return trace(step, *args)


def test_batch_heavy_mlp_is_data_parallel(mlp_batch_heavy):
    plan = plan_graph(mlp_batch_heavy, FOUR)  # mesh and layout both searched
    x, y = plan.input("batch/x"), plan.input("batch/y")
    assert _ways(plan, x.spec[0]) == 4 and x.spec[1] is None
    assert _ways(plan, y.spec[0]) == 4
    ops = _ops(plan)
    assert len(ops) == 2 and all(re.fullmatch(r"batch\([a-z,]+\)", t) for _, t in ops), ops
    # No tensor-parallel traffic: only gradient reductions (and ZeRO gathers, if any) and
    # the loss's reduction over the batch.
    wheres = {c.where for c in plan.predicted.collectives}
    assert wheres <= {"dp_grad", "fsdp_gather", "batch_reduce"}
    assert all(c.bytes < 1e6 for c in plan.predicted.collectives if c.where == "tensor")


def test_batch_heavy_mlp_without_zero_replicates_weights(mlp_batch_heavy):
    plan = plan_graph(mlp_batch_heavy, FOUR, SearchOptions(mesh={"data": 4}, zero_stage=0))
    assert plan.input("params/w1").spec == (None, None)
    assert plan.input("params/w2").spec == (None, None)
    assert plan.input("batch/x").spec == ("data", None)
    assert plan.zero_stage == 0
    grads = [c for c in plan.predicted.collectives if c.where == "dp_grad"]
    assert [c.kind for c in grads] == ["all-reduce"]
    assert grads[0].bytes == pytest.approx(2 * 256 * 256 * 4)  # both fp32 gradients


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_fixed_zero_stage_splits_what_that_stage_splits(stage):
    # A 64-wide MLP on a batch of 64: left free, the planner replicates everything (the
    # gradient all-reduce costs more than the compute it saves), so a fixed stage must
    # come from the option. ZeRO-1/2 split the optimizer state over data, ZeRO-3 the
    # parameters too, and the batch is split over data from stage 1.
    step, args = mlp(batch=64, d=64, h=64)
    plan = plan_graph(trace(step, *args), FOUR, SearchOptions(mesh={"data": 4}, zero_stage=stage))
    by_role: dict[str, list] = {}
    for t in plan.inputs:
        if t.shape:  # Adam's step count is a scalar: nothing to split
            by_role.setdefault(t.role, []).append("data" in [a for e in t.spec for a in _axes(e)])
    assert all(by_role["opt_state"]) and len(by_role["opt_state"]) == 4
    assert all(by_role["batch"]) and len(by_role["batch"]) == 2
    assert by_role["param"] == [stage == 3] * 2
    assert plan.zero_stage == (3 if stage == 3 else 1)


def test_hidden_heavy_mlp_is_megatron(mlp_hidden_heavy):
    plan = plan_graph(mlp_hidden_heavy, FOUR)
    w1, w2 = plan.input("params/w1").spec, plan.input("params/w2").spec
    assert w1[0] is None and _ways(plan, w1[1]) == 4  # first kernel: split its output dim
    assert w2[1] is None and _ways(plan, w2[0]) == 4  # second kernel: split its input dim
    assert _axes(w1[1]) == _axes(w2[0])
    (_, first), (_, second) = _ops(plan)
    assert (
        first.startswith("column(") and second.startswith("row(") and second.endswith("all-reduce")
    )
    # One all-reduce of the [32, 8192] fp32 activation for the layer pair (the input x
    # needs no gradient, so the backward has none).
    ars = [c for c in plan.predicted.collectives if c.kind == "all-reduce" and c.where == "tensor"]
    assert len(ars) == 1 and ars[0].count == 1 and ars[0].bytes == 32 * 8192 * 4


def test_evaluate_agrees_with_the_planner(mlp_hidden_heavy):
    plan = plan_graph(mlp_hidden_heavy, FOUR, SearchOptions(mesh={"tensor": 4}))
    ev = evaluate_plan(mlp_hidden_heavy, plan, FOUR)
    assert ev.objective_s == pytest.approx(plan.predicted.objective, rel=1e-9)
    assert ev.step_time_s == pytest.approx(plan.predicted.step_time_s, rel=1e-9)
    assert ev.memory_bytes_per_device == pytest.approx(plan.predicted.memory_bytes_per_device)
    # Replayed from JSON, the plan still evaluates the same.
    again = evaluate_plan(mlp_hidden_heavy, Plan.from_json(plan.to_json()), FOUR)
    assert again.objective_s == pytest.approx(ev.objective_s, rel=1e-9)


def test_hand_written_data_parallel_plan_is_scored_and_beaten(mlp_batch_heavy):
    g = mlp_batch_heavy
    # Data parallel by hand: batch split, weights replicated, the forward matmuls pinned
    # to batch-split results (inputs alone leave the activations' layouts to the
    # completion, which may slice the replicated weights instead).
    forward = [n for n in g.nodes if n.primitive == "dot_general" and n.phase == "forward"]
    dp = Plan(
        mesh={"data": 4},
        inputs=tuple(
            TensorSharding(
                i.path, i.tensor.shape, i.tensor.dtype,
                ("data", None) if i.role == "batch" else (None,) * i.tensor.ndim, i.role,
            )
            for i in g.inputs
        ),
        activations=tuple(ActivationConstraint(n.id, 0, ("data", None)) for n in forward),
    )  # fmt: skip
    ev = evaluate_plan(g, dp, FOUR)
    # Each weight gradient is all-reduced once: 2 x 256 x 256 fp32 = 512 KiB, and XLA
    # combines the two independent all-reduces into one: one latency, both payloads.
    grads = [c for c in ev.collectives if c.where == "dp_grad"]
    assert [c.kind for c in grads] == ["all-reduce"]
    assert grads[0].bytes == pytest.approx(2 * 256 * 256 * 4)
    assert grads[0].count == 2  # as the partitioner emits them, before combining
    one = collective_time("all-reduce", 256 * 256 * 4, FOUR, {"data": 4}, ["data"])
    latency = collective_time("all-reduce", 1, FOUR, {"data": 4}, ["data"])
    assert grads[0].time_s == pytest.approx(2 * one - latency)
    assert ev.memory_breakdown["params"] == pytest.approx(2 * 256 * 256 * 4)  # replicated
    best = plan_graph(g, FOUR, SearchOptions(mesh={"data": 4}))
    assert best.predicted.objective <= ev.objective_s * (1 + 1e-9)
    # Where each predicted collective comes from: the two weight-gradient matmuls.
    sources = []
    evaluate_plan(g, dp, FOUR, sources=sources)
    ar = [s for s in sources if s.where_class == "dp_grad"]
    assert sorted(s.bytes for s in ar) == [256 * 256 * 4] * 2
    assert all(s.where.startswith("transpose(") and s.where.endswith("(op)") for s in ar)


def _stored_state(plan):
    """Bytes per device of parameters and optimizer state under the plan's specs."""
    return sum(
        math.prod(r.shape) * 4 / math.prod(_ways(plan, e) for e in r.spec)
        for r in plan.inputs
        if r.role in ("param", "opt_state") and r.shape
    )


def test_memory_bound_below_replicated_state_shards_it():
    step, args = mlp(batch=1024, d=4096, h=4096)
    g = trace(step, *args)
    replicated_state = 3 * 2 * 4096 * 4096 * 4  # params + Adam mu, nu: 384 MiB
    limit = 300 * 2**20
    assert limit < replicated_state
    plan = plan_graph(g, FOUR, SearchOptions(mesh={"data": 4}, memory_limit_bytes=limit))
    assert plan.predicted.memory_bytes_per_device <= limit
    assert _stored_state(plan) <= replicated_state / 4 * 1.01  # every big leaf split 4 ways


def test_a_plan_is_within_the_bound_or_refused_with_its_footprint():
    """Near the smallest footprint, resharded copies (outside the ILP's memory
    constraints) decide whether a plan fits: the planner either returns one whose whole
    predicted peak is within the bound, or refuses with a footprint above it."""
    step, args = mlp(batch=64, d=4096, h=4096)
    g = trace(step, *args)
    # Parameters, Adam mu and nu (3 x 128 MiB) split 4 ways are 96 MiB alone.
    for mib in (131, 129, 125):
        limit = mib * 2**20
        try:
            plan = plan_graph(g, FOUR, SearchOptions(mesh={"data": 4}, memory_limit_bytes=limit))
        except InfeasiblePlanError as err:
            need = float(re.search(r"footprint found needs ([0-9.e+]+) bytes", str(err)).group(1))
            assert need > limit
        else:
            assert 96 * 2**20 < plan.predicted.memory_bytes_per_device <= limit


def test_nothing_fits_raises_with_the_numbers():
    step, args = mlp(batch=1024, d=4096, h=4096)
    g = trace(step, *args)
    with pytest.raises(InfeasiblePlanError) as err:
        plan_graph(g, FOUR, SearchOptions(mesh={"data": 4}, memory_limit_bytes=2**20))
    msg = str(err.value)
    assert "1.049e+06 bytes" in msg  # the bound
    need = float(re.search(r"footprint found needs ([0-9.e+]+) bytes", msg).group(1))
    # At best all 384 MiB of parameters and Adam state split 4 ways: >= 96 MiB.
    assert need >= 96 * 2**20
    over = float(re.search(r"\), ([0-9.e+]+) bytes \(", msg).group(1))
    assert over == pytest.approx(need - 2**20, rel=1e-3)


def test_moe_shards_experts_with_all_to_all():
    step, args = moe(groups=8, tokens=256, d=1024, h=4096, experts=8, capacity=64)
    g = trace(step, *args)
    plan = plan_graph(g, FOUR, SearchOptions(mesh={"expert": 4}))
    assert plan.input("params/w_in").spec == ("expert", None, None)
    assert plan.input("params/w_out").spec == ("expert", None, None)
    assert any(c.kind == "all-to-all" and c.axes == ("expert",) for c in plan.predicted.collectives)
    texts = dict(_ops(plan))
    assert texts["egcm,emh->egch"].startswith("expert(expert)")
    assert texts["egch,ehm->egcm"].startswith("expert(expert)")


def test_pipeline_stages_without_a_pipe_mesh_is_refused(mlp_batch_heavy):
    # plan_graph is the intra-op level: a stage count is refused, never ignored (the
    # outer loop of autopar.plan pipelines, from the step function).
    with pytest.raises(InvalidOptionError, match="does not choose pipelines"):
        plan_graph(mlp_batch_heavy, FOUR, SearchOptions(pipeline_stages=2))
