"""Planning GPT steps (benchmarks.models.gpt): tensor, sequence and scan-over-layers cases."""

import math

import pytest

from autopar.options import SearchOptions
from autopar.plan import Plan, TensorSharding
from autopar.search import evaluate_plan, plan_graph
from autopar.trace import trace
from benchmarks.models.gpt import GPTConfig, make_train_step
from cost_models import Cluster


def _axes(entry):
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def _traced(config, batch):
    step, args = make_train_step(config, batch)
    return trace(step, *args)


def _ops(plan):
    return {name: text for layer in plan.layers for name, text in layer.ops}


def _kernel_dims(plan, name, axis):
    """Dims of a kernel sharded over ``axis``."""
    spec = plan.input(f"params/h_0/{name}/kernel").spec
    return [d for d, e in enumerate(spec) if axis in _axes(e)]


def test_gpt_block_on_data_x_tensor():
    # Two 4-GPU nodes: "tensor" inside a node (NVLink), "data" across (InfiniBand).
    # Hidden 4096 with 8192 tokens: per data replica the activations (4096 x 4096) are
    # about the size of one weight, the regime where Megatron tensor parallelism inside
    # the node and data parallelism across nodes pay off.
    cluster = Cluster.preset("dgx-a100-80gb", nodes=2, devices_per_node=4)
    cfg = GPTConfig(
        vocab_size=1024, seq_len=512, hidden=4096, layers=1, heads=32, scan_layers=False
    )
    g = _traced(cfg, 16)
    mesh = {"data": 2, "tensor": 4}
    plan = plan_graph(g, cluster, SearchOptions(mesh=mesh))
    assert _axes(plan.input("batch/tokens").spec[0]) == ("data",)  # batch over data
    # Every weight of the block is split over the tensor axis on exactly one dim.
    for name in ("attn/q", "attn/k", "attn/v", "attn/out", "mlp/fc_in", "mlp/fc_out"):
        assert len(_kernel_dims(plan, name, "tensor")) == 1, name
    # MLP: column-split fc_in and row-split fc_out, both on the ffn dim.
    assert _kernel_dims(plan, "mlp/fc_in", "tensor") == [1]
    assert _kernel_dims(plan, "mlp/fc_out", "tensor") == [0]
    ops = _ops(plan)
    assert ops["GPT/h_0/mlp/fc_in"].endswith("column(tensor)")
    assert ops["GPT/h_0/mlp/fc_out"].startswith("row(tensor)")
    # Attention: heads split over tensor, batch over data, in both attention matmuls.
    for einsum in ("bqhd,bkhd->bhqk", "bhqk,bkhd->bqhd"):
        assert ops[f"GPT/h_0/attn/{einsum}"] == "batch(data)+heads(tensor)"

    # The textbook Megatron + data-parallel layout, scored by the same model, is no better.
    def spec(path, ndim):
        if path.startswith("batch/"):
            return ("data", None)
        for col in ("attn/q/", "attn/k/", "attn/v/", "mlp/fc_in/"):
            if col in path:
                return (None, "tensor") if path.endswith("kernel") else ("tensor",)
        if path.endswith(("attn/out/kernel", "mlp/fc_out/kernel")):
            return ("tensor", None)
        return (None,) * ndim

    megatron = Plan(
        mesh=mesh,
        inputs=tuple(
            TensorSharding(
                i.path, i.tensor.shape, i.tensor.dtype, spec(i.path, i.tensor.ndim), i.role
            )
            for i in g.inputs
        ),
    )
    assert plan.predicted.objective <= evaluate_plan(g, megatron, cluster).objective_s


def test_long_sequence_batch_one_shards_the_sequence():
    cfg = GPTConfig(
        vocab_size=256, seq_len=8192, hidden=256, layers=1, heads=4, scan_layers=False,
        precision="fp32",
    )  # fmt: skip
    g = _traced(cfg, 1)
    cluster = Cluster.preset("dgx-a100-80gb", devices_per_node=4)
    plan = plan_graph(g, cluster, SearchOptions(mesh={"seq": 4}))
    assert plan.input("batch/tokens").spec == (None, "seq")
    # The attention scores [b, h, q, k] are split along the queries.
    scores = [
        a
        for a in plan.activations
        if a.name.endswith("bqhd,bkhd->bhqk") and "transpose" not in a.name
    ]
    assert scores and all(_axes(a.spec[2]) == ("seq",) for a in scores)


def test_twelve_heads_never_split_eight_ways():
    cfg = GPTConfig(
        vocab_size=512, seq_len=64, hidden=768, layers=1, heads=12, scan_layers=False,
        precision="fp32",
    )  # fmt: skip
    g = _traced(cfg, 8)
    plan = plan_graph(g, Cluster.preset("dgx-a100-80gb"), SearchOptions(mesh={"tensor": 8}))
    for a in plan.activations:
        node = g.node(a.node)
        shape = node.out_tensors[a.output].shape
        for size, entry in zip(shape, a.spec, strict=False):
            ways = math.prod(plan.mesh[x] for x in _axes(entry))
            assert size % ways == 0, (a.name, shape, a.spec)
            if size == 12 and "h_0/attn" in a.name:
                assert ways == 1, (a.name, shape, a.spec)


def test_scan_over_layers_plans_the_body_once():
    cfg = GPTConfig.preset("tiny", precision="fp32")  # 2 layers under nn.scan
    g = _traced(cfg, 8)
    cluster = Cluster.preset("dgx-a100-80gb")
    plan = plan_graph(g, cluster, SearchOptions(mesh={"data": 2, "tensor": 2}))
    scans = [n for n in g.nodes if n.primitive == "scan"]
    assert scans and any(a.scope for a in plan.activations)  # constraints inside the body
    assert {a.scope[0][0] for a in plan.activations if a.scope} <= {n.id for n in scans}
    # Stacked layer parameters keep their layer dim whole.
    for r in plan.inputs:
        if "/h/" in r.path and r.shape:
            assert r.spec[0] is None, r
    ev = evaluate_plan(g, plan, cluster)
    assert ev.objective_s == pytest.approx(plan.predicted.objective, rel=1e-9)
