"""The outer loop's mesh search: which axes it offers, their order and its speed."""

import math
import time

import pytest

from autopar.options import SearchOptions
from autopar.search import plan_graph
from autopar.search.planner import candidate_meshes, expert_dims, offered_axes
from autopar.trace import trace
from benchmarks.models.gpt import GPTConfig, make_train_step
from cost_models import Cluster
from tests.search.models import moe

EIGHT = Cluster.preset("dgx-a100-80gb")
DEMO = GPTConfig(vocab_size=512, seq_len=64, hidden=128, layers=4, heads=4, precision="fp32")


@pytest.fixture(scope="module")
def demo_graph():
    step, args = make_train_step(DEMO, 16)  # what `autopar demo` plans
    return trace(step, *args)


@pytest.fixture(scope="module")
def moe_graph():
    step, args = moe(groups=8, tokens=64, d=128, h=256, experts=8, capacity=16)
    return trace(step, *args)


def test_dense_gpt_offers_data_and_tensor_only(demo_graph):
    # No expert dimension, 16 sequences of 64 tokens for 8 devices (no need to split the
    # sequence), and fsdp folded into data (ZeRO-3 = parameters sharded over data).
    assert offered_axes(demo_graph, 8, SearchOptions()) == ("data", "tensor")
    meshes = candidate_meshes(8, SearchOptions(), demo_graph)
    assert [tuple(m.items()) for m in meshes] == [
        (("data", 2), ("tensor", 4)),
        (("data", 4), ("tensor", 2)),
        (("data", 8),),
    ]
    # More devices than sequences: the sequence axis becomes worth searching.
    assert offered_axes(demo_graph, 32, SearchOptions()) == ("data", "seq", "tensor")


def test_explicit_axes_are_all_offered(demo_graph):
    options = SearchOptions(axes=("data", "fsdp", "tensor"))
    assert offered_axes(demo_graph, 8, options) == ("data", "fsdp", "tensor")


def test_moe_offers_the_expert_axis(moe_graph):
    # w_in [E, d, h] and w_out [E, h, d] are batched over their expert dim by the
    # per-expert einsums, and so is their Adam state.
    dims = expert_dims(moe_graph)
    by_path = {gi.path: dims.get(gi.index) for gi in moe_graph.inputs}
    assert by_path["state/params/w_in"] == 0 and by_path["state/params/w_out"] == 0
    assert by_path["state/params/gate"] is None
    assert sum(1 for p, d in by_path.items() if "opt_state" in p and d == 0) == 4  # mu, nu
    assert "expert" in offered_axes(moe_graph, 8, SearchOptions())


def test_demo_plans_fast_on_data_and_tensor(demo_graph):
    t0 = time.perf_counter()
    plan = plan_graph(demo_graph, EIGHT, SearchOptions())
    elapsed = time.perf_counter() - t0
    # ~4 s on 2 shared cores (it took 76 s with five axes and HiGHS); generous bound.
    assert elapsed < 30, elapsed
    assert set(plan.mesh) <= {"data", "tensor"}
    assert math.prod(plan.mesh.values()) == 8
    names = list(plan.mesh)
    assert names == sorted(names, key=["data", "tensor"].index)  # tensor innermost
    # The batch goes over the axis named data.
    tokens = plan.input("batch/tokens").spec
    assert tokens[0] == "data" or (isinstance(tokens[0], tuple) and "data" in tokens[0])
