"""Plan: JSON round trip, atomic save, specs as PartitionSpec pytrees, load errors."""

import json
import os

import jax
import pytest
from jax.sharding import PartitionSpec as P

from autopar.errors import LoadPlanError
from autopar.plan import (
    ActivationConstraint,
    LayerStrategy,
    PipelinePlan,
    Plan,
    Predicted,
    PredictedCollective,
    TensorSharding,
    spec_axes,
    to_partition_spec,
)


def _plan() -> Plan:
    return Plan(
        mesh={"data": 2, "tensor": 4},
        inputs=(
            TensorSharding("state/params/w", (16, 32), "float32", (None, "tensor"), "param"),
            TensorSharding(
                "state/opt_state/mu/w", (16, 32), "float32", (("data",), "tensor"), "opt_state"
            ),
            TensorSharding("batch/x", (8, 16), "float32", ("data", None), "batch"),
        ),
        outputs=(TensorSharding("loss", (), "float32", (), "other"),),
        activations=(
            ActivationConstraint(12, 0, ("data", None, "tensor"), ((3, 0),), "h_0/mlp"),
            ActivationConstraint(14, 0, (None, "tensor"), (), "h_0/out", operand=1),
        ),
        pipeline=PipelinePlan(((0, 6), (6, 12)), "1f1b", 8),
        remat="selective",
        zero_stage=1,
        layers=(LayerStrategy("h_0", (("q", "column(tensor)"), ("out", "row(tensor)"))),),
        predicted=Predicted(
            step_time_s=0.25,
            compute_s=0.2,
            communication_s=0.1,
            exposed_communication_s=0.05,
            memory_bytes_per_device=1.5e9,
            memory_breakdown={"params": 1e9, "activations": 5e8},
            collectives=(
                PredictedCollective("all-reduce", ("tensor",), 4096.0, 24, 1e-3, "h_*/out"),
            ),
            objective=0.24,
        ),
        cluster={"name": "dgx-a100-80gb", "nodes": 1},
        fingerprint="abc",
    )


def test_json_round_trip_is_exact():
    p = _plan()
    q = Plan.from_json(p.to_json())
    assert q == p
    assert q.to_json() == p.to_json()
    # Every field survives, including nested tuples of axes.
    assert q.inputs[1].spec == (("data",), "tensor")
    assert q.activations[0].scope == ((3, 0),)
    assert list(q.mesh.items()) == [("data", 2), ("tensor", 4)]


def test_save_is_atomic_and_loads(tmp_path):
    p = _plan()
    path = tmp_path / "sub" / "plan.json"
    p.save(path)
    assert Plan.load(path) == p
    # No temporary files are left behind.
    assert os.listdir(path.parent) == ["plan.json"]


def test_in_specs_unflatten_to_the_argument_tree():
    p = _plan()
    # Leaves flatten in sorted-key order: a/w, b/mu/w, x, matching the plan's records.
    args = ({"a": {"w": 0}, "b": {"mu": {"w": 0}}}, {"x": 0})
    _, tree = jax.tree_util.tree_flatten(args)
    bound = p.bind(tree, None)
    specs = bound.in_specs
    assert specs[0]["a"]["w"] == P(None, "tensor")
    assert specs[0]["b"]["mu"]["w"] == P("data", "tensor")
    assert specs[1]["x"] == P("data")
    # Unbound plans (loaded from JSON) give a dict by path.
    assert p.in_specs["batch/x"] == P("data")


def test_spec_helpers():
    assert to_partition_spec(("data", None, None)) == P("data")
    assert to_partition_spec((("data", "fsdp"), "tensor")) == P(("data", "fsdp"), "tensor")
    assert spec_axes((None, ("data", "fsdp"), "tensor")) == ("data", "fsdp", "tensor")


def test_load_errors_are_actionable(tmp_path):
    with pytest.raises(LoadPlanError, match="no plan file"):
        Plan.load(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(LoadPlanError, match="not valid JSON"):
        Plan.load(bad)
    d = json.loads(_plan().to_json())
    d["schema_version"] = 99
    with pytest.raises(LoadPlanError, match="schema version 99"):
        Plan.from_dict(d)
    del d["mesh"]
    d["schema_version"] = 1
    with pytest.raises(LoadPlanError, match="malformed"):
        Plan.from_dict(d)
