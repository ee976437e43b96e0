"""Planning GPT steps (benchmarks.models.gpt): tensor, sequence and scan-over-layers cases."""

import math

import pytest

from autopar.options import SearchOptions
from autopar.plan import ActivationConstraint, Plan, TensorSharding
from autopar.search import evaluate_plan, plan_graph
from autopar.trace import trace
from benchmarks.models.gpt import GPTConfig, make_train_step
from cost_models import Cluster, collective_time, compute_time


def _axes(entry):
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def _traced(config, batch):
    step, args = make_train_step(config, batch)
    return trace(step, *args)


def _ops(plan):
    return {name: text for layer in plan.layers for name, text in layer.ops}


def _ways(plan, entry):
    return math.prod(plan.mesh[a] for a in _axes(entry))


def _kernel_dims(plan, name, axis):
    """Dims of a kernel sharded over ``axis``."""
    spec = plan.input(f"params/h_0/{name}/kernel").spec
    return [d for d, e in enumerate(spec) if axis in _axes(e)]


# Two 4-GPU DGX A100 nodes: "tensor" inside a node (NVLink, 4 GPUs), "data" across
# (InfiniBand, 2 nodes): the axis names then mean what they say physically.
TWO_NODES = Cluster.preset("dgx-a100-80gb", nodes=2, devices_per_node=4)
MESH = {"data": 2, "tensor": 4}
BLOCK = ("attn/q", "attn/k", "attn/v", "attn/out", "mlp/fc_in", "mlp/fc_out")


def _megatron_plan(g, heads, sequence_parallel=False):
    """Megatron-LM's layout by hand: batch over data; q/k/v/fc_in column-split and
    out/fc_out row-split over tensor; attention split by heads; vocab-parallel embedding.
    Forward matmul results are pinned (inputs alone would leave the completion free to
    pick other activation layouts); Megatron-SP leaves out/fc_out sequence-split."""

    def spec(path, ndim):
        if path.startswith("batch/"):
            return ("data", None)
        for col in ("attn/q/", "attn/k/", "attn/v/", "mlp/fc_in/"):
            if col in path:
                return (None, "tensor") if path.endswith("kernel") else ("tensor",)
        if path.endswith(("attn/out/kernel", "mlp/fc_out/kernel", "wte/embedding")):
            return ("tensor", None)
        return (None,) * ndim

    acts = []
    for n in g.nodes:
        if n.primitive != "dot_general" or n.phase != "forward":
            continue
        name, shape = n.name_stack, n.out_tensors[0].shape
        if name.endswith(("attn/q", "attn/k", "attn/v", "mlp/fc_in", "wte.attend")):
            pin = ("data", None, "tensor")
        elif name.endswith(("attn/out", "mlp/fc_out")):
            pin = ("data", "tensor", None) if sequence_parallel else ("data", None, None)
        elif name.endswith(("bqhd,bkhd->bhqk", "bhqk,bkhd->bqhd")):
            pin = tuple(
                "data" if d == 0 else "tensor" if d > 0 and size == heads else None
                for d, size in enumerate(shape)
            )
        else:
            continue
        acts.append(ActivationConstraint(n.id, 0, pin, (), name))
    inputs = tuple(
        TensorSharding(i.path, i.tensor.shape, i.tensor.dtype, spec(i.path, i.tensor.ndim), i.role)
        for i in g.inputs
    )
    return Plan(mesh=MESH, inputs=inputs, activations=tuple(acts))


def _per_layer_comm(hidden, seq, batch):
    """Hand prices of one layer's communication on TWO_NODES (cost_models only).

    Returns (Megatron tensor-parallel collectives, Megatron gradient all-reduce over
    data, data-parallel gradient all-reduce over all 8 GPUs, hideable budget), seconds.
    """
    act = batch // 2 * seq * hidden * 2  # one data replica's [b/2, s, h] in bf16
    weights = 12 * hidden * hidden * 2  # q, k, v, out (4 h^2) + fc_in, fc_out (8 h^2), bf16
    tp = 4 * collective_time("all-reduce", act, TWO_NODES, MESH, ["tensor"])
    tp_grads = collective_time("all-reduce", weights / 4, TWO_NODES, MESH, ["data"])
    dp_grads = collective_time("all-reduce", weights, TWO_NODES, MESH, ["data", "tensor"])
    fwd = compute_time(
        (24 * batch * seq * hidden**2 + 4 * batch * seq**2 * hidden) / 8, 0, TWO_NODES.device
    )
    return tp, tp_grads, dp_grads, TWO_NODES.overlap_efficiency * 2 * fwd


def test_megatron_block_on_data_x_tensor():
    """A GPT-3 6.7B-sized block (hidden 4096, 32 heads, sequence 2048, two sequences per
    data replica): Megatron's layout.

    Hand prices per layer (``_per_layer_comm``, bf16, A100 NVLink 230 GB/s, IB 25 GB/s per
    GPU): Megatron moves [2, 2048, 4096] = 32 MiB activations 4 times (2 all-reduces
    forward, 2 backward; Megatron-SP: 4 all-gathers + 4 reduce-scatters, the same bytes)
    over the 4 NVLink GPUs: 4 x 0.24 ms = 0.96 ms on the critical path, and all-reduces
    the gradients of its quarter of the 12 h^2 weights (100 MiB) over InfiniBand: 4.0 ms,
    of which ~2.1 ms (0.6 x the 3.5 ms backward) hides. Data parallelism over all 8 GPUs
    is impossible (4 sequences); putting the batch on the NVLink axis and splitting the
    weights over InfiniBand moves 16 MiB 4 times over IB: 2.8 ms exposed. So: Megatron
    for the MLP (8 h^2).

    The attention's weights (4 h^2 = 128 MiB) may in addition be sharded over data
    (ZeRO-3 over all 8 GPUs): NCCL runs a gather over both nodes on all 4 NICs of each
    (bus min(230, 4 x 25) = 100 GB/s), 7/8 x 134 MB / 100 GB/s = 1.2 ms, the same order as
    the one-NIC gradient all-reduce over data it replaces; the planner may take either,
    and its plan must price no worse than the hand-written Megatron layouts.
    """
    tp, tp_grads, _, budget = _per_layer_comm(4096, 2048, 4)
    assert tp == pytest.approx(0.96e-3, rel=0.05)
    assert tp_grads == pytest.approx(4.05e-3, rel=0.05) and budget == pytest.approx(
        2.1e-3, rel=0.05
    )
    swapped = 4 * collective_time("all-reduce", 2048 * 4096 * 2, TWO_NODES, MESH, ["data"])
    assert swapped > 2 * tp
    attn = 4 * 4096 * 4096 * 2
    gather = collective_time("all-gather", attn, TWO_NODES, MESH, ["data", "tensor"])
    assert gather == pytest.approx(7 / 8 * attn / 100e9, rel=0.05)

    cfg = GPTConfig(
        vocab_size=1024, seq_len=2048, hidden=4096, layers=1, heads=32, scan_layers=False
    )
    g = _traced(cfg, 4)
    plan = plan_graph(g, TWO_NODES, SearchOptions(mesh=MESH))
    assert _axes(plan.input("batch/tokens").spec[0]) == ("data",)  # batch over data
    for name in BLOCK:  # every weight split over tensor on exactly one dim
        assert len(_kernel_dims(plan, name, "tensor")) == 1, name
    # The MLP as Megatron: fc_in column-split, fc_out row-split, not over data.
    assert _kernel_dims(plan, "mlp/fc_in", "tensor") == [1]
    assert _kernel_dims(plan, "mlp/fc_out", "tensor") == [0]
    for name in ("mlp/fc_in", "mlp/fc_out"):
        assert not _kernel_dims(plan, name, "data"), name
    ops = _ops(plan)
    assert ops["GPT/h_0/mlp/fc_in"] == "batch(data)+column(tensor)"
    assert ops["GPT/h_0/mlp/fc_out"].startswith("row(tensor)+batch(data)")
    for einsum in ("bqhd,bkhd->bhqk", "bhqk,bkhd->bqhd"):  # attention split by heads
        assert ops[f"GPT/h_0/attn/{einsum}"] == "batch(data)+heads(tensor)"
    # The hand-written Megatron and Megatron-SP plans, scored by the same model, are no
    # better than what the planner found.
    for sp in (False, True):
        hand = evaluate_plan(g, _megatron_plan(g, 32, sequence_parallel=sp), TWO_NODES)
        assert plan.predicted.objective <= hand.objective_s * (1 + 1e-9), sp


def test_gpt2_small_block_is_data_parallel():
    """GPT-2 small's block (hidden 768, 12 heads, sequence 1024, batch 8): weights are
    small next to the activations, so data parallelism beats Megatron.

    Hand prices per layer (NCCL's model, cost_models/collectives.py): Megatron's 4
    all-reduces of [4, 1024, 768] bf16 = 6 MiB over the 4 NVLink GPUs, each a Simple ring
    2 x 3/4 x 6.29 MB / 230 GB/s + (8.4 + 6 x 3.4) us = 70 us: 0.28 ms on the critical path
    (plus its gradient all-reduce over data); data parallelism over all 8 GPUs all-reduces
    the layer's 12 x 768^2 bf16 gradients (14 MiB, one combined collective) as an LL128
    ring over both nodes' 4 NICs (bus 0.92 x min(230, 4 x 25) GB/s): 2 x 7/8 x 14.2 MB /
    92 GB/s + (14 + 12 x 1.9 + 2 x 4) us = 0.31 ms, of which 0.6 x the backward compute
    (~0.08 ms) hides behind it, with no redundant LayerNorm/residual work.
    """
    tp, tp_grads, dp_grads, budget = _per_layer_comm(768, 1024, 8)
    assert tp == pytest.approx(4 * (2 * 3 / 4 * 6291456 / 230e9 + 28.8e-6), rel=0.01)
    grads = 12 * 768 * 768 * 2
    assert dp_grads == pytest.approx(2 * 7 / 8 * grads / 92e9 + 44.8e-6, rel=0.01)
    assert dp_grads - budget < tp  # DP's exposed gradient time < Megatron's exposed TP

    cfg = GPTConfig(
        vocab_size=1024, seq_len=1024, hidden=768, layers=1, heads=12, scan_layers=False
    )
    g = _traced(cfg, 8)
    plan = plan_graph(g, TWO_NODES, SearchOptions(mesh=MESH))
    assert _ways(plan, plan.input("batch/tokens").spec[0]) == 8
    # No tensor parallelism in the block: a weight is whole, or ZeRO-3-sharded over all 8
    # GPUs (the batch's axes; gathered before use, which NCCL runs on both nodes' NICs),
    # and no collective sits on the critical path of the layer's compute.
    for name in BLOCK:
        spec = plan.input(f"params/h_0/{name}/kernel").spec
        assert all(e is None or set(_axes(e)) == {"data", "tensor"} for e in spec), name
    assert not evaluate_plan(g, plan, TWO_NODES).communication_by_class.get("tensor")
    hand = evaluate_plan(g, _megatron_plan(g, 12, sequence_parallel=True), TWO_NODES)
    assert plan.predicted.objective < hand.objective_s


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
        if a.name.endswith("bqhd,bkhd->bhqk")
        and "transpose" not in a.name
        and a.operand is None  # the result, not how the einsum reads its inputs
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
        value = node.out_tensors[a.output] if a.operand is None else node.in_tensors[a.operand]
        shape = value.shape
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
