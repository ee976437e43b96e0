"""Strategies of single operations, on hand-built nodes (expected lists worked out by hand)."""

import pytest

from autopar.search.costs import CostContext
from autopar.search.strategies import enumerate_strategies, follow_strategy
from autopar.trace.graph import Node, TensorInfo
from cost_models import Cluster, collective_time, compute_time

CLUSTER = Cluster.preset("dgx-a100-80gb")
F32 = "float32"


def _node(primitive, ins, outs, flops=0.0, **params):
    return Node(
        0,
        primitive,
        tuple(range(len(ins))),
        tuple(range(len(ins), len(ins) + len(outs))),
        tuple(TensorInfo(s, F32 if len(s) else F32) for s in ins),
        tuple(TensorInfo(s, F32) for s in outs),
        params,
        flops,
    )


def test_matmul_strategies_on_one_axis():
    ctx = CostContext(CLUSTER, {"x": 2})
    flops = 2 * 8 * 32 * 16
    mm = _node(
        "dot_general", [(8, 16), (16, 32)], [(8, 32)], flops,
        dimension_numbers=(((1,), (0,)), ((), ())),
    )  # fmt: skip
    got = enumerate_strategies(mm, ctx)
    x, r = ("x",), ()
    assert {(s.ins[0], s.ins[1], s.outs[0]) for s in got} == {
        ((r, r), (r, r), (r, r)),  # replicated
        ((x, r), (r, r), (x, r)),  # split the rows (batch)
        ((r, r), (r, x), (r, x)),  # split the columns (column parallel)
        ((r, x), (x, r), (r, r)),  # split the contraction: partial sums -> all-reduce
        ((r, x), (x, r), (x, r)),  # ... -> reduce-scatter onto the rows
        ((r, x), (x, r), (r, x)),  # ... -> reduce-scatter onto the columns
    }
    ar = next(s for s in got if s.ins[0] == (r, x) and s.outs[0] == (r, r))
    assert [c.kind for c in ar.comm] == ["all-reduce"]
    assert ar.comm[0].nbytes == 8 * 32 * 4  # the whole fp32 result, per device
    assert ar.comm[0].time_s == pytest.approx(
        collective_time("all-reduce", 1024, CLUSTER, {"x": 2}, ["x"])
    )
    rs = next(s for s in got if s.ins[0] == (r, x) and s.outs[0] == (x, r))
    assert [c.kind for c in rs.comm] == ["reduce-scatter"]
    assert rs.comm[0].nbytes == 1024  # full input of the reduce-scatter
    for s in got:  # every sharded strategy halves the FLOPs per device
        sharded = s.ins[0] != (r, r) or s.ins[1] != (r, r)
        assert s.flops == pytest.approx(flops / 2 if sharded else flops)


def test_matmul_never_splits_an_indivisible_dim():
    ctx = CostContext(CLUSTER, {"tensor": 8})
    # [b, s, 12 heads, 64] x [b, s, 12, 64] -> scores [b, 12, s, s]; heads only 12.
    mm = _node(
        "dot_general",
        [(2, 16, 12, 64), (2, 16, 12, 64)],
        [(2, 12, 16, 16)],
        dimension_numbers=(((3,), (3,)), ((0, 2), (0, 2))),
    )
    for s in enumerate_strategies(mm, ctx):
        assert s.ins[0][2] == ()  # never the heads dim
        assert s.outs[0][1] == ()


def test_embedding_gather_table_sharded_on_vocab_all_reduces():
    ctx = CostContext(CLUSTER, {"x": 2})
    dn = (
        "GatherDimensionNumbers(offset_dims=(2,), collapsed_slice_dims=(0,), start_index_map=(0,), "
        "operand_batching_dims=(), start_indices_batching_dims=())"
    )
    g = _node("gather", [(16, 8), (4, 5, 1)], [(4, 5, 8)], dimension_numbers=dn, slice_sizes=(1, 8))
    got = enumerate_strategies(g, ctx)
    x = ("x",)
    by = {(s.ins[0], s.ins[1], s.outs[0], tuple(c.kind for c in s.comm)) for s in got}
    assert by == {
        (((), ()), ((), (), ()), ((), (), ()), ()),  # replicated
        (((), ()), (x, (), ()), (x, (), ()), ()),  # batch of indices
        (((), x), ((), (), ()), ((), (), x), ()),  # table split on hidden
        ((x, ()), ((), (), ()), ((), (), ()), ("all-reduce",)),  # vocab: masked lookup
        ((x, ()), ((), (), ()), (x, (), ()), ("reduce-scatter",)),
        ((x, ()), ((), (), ()), ((), (), x), ("reduce-scatter",)),
    }
    vocab = next(s for s in got if s.ins[0] == (x, ()) and s.comm[0].kind == "all-reduce")
    assert vocab.comm[0].nbytes == 4 * 5 * 8 * 4


def test_reduction_over_a_sharded_dim_all_reduces():
    ctx = CostContext(CLUSTER, {"x": 2})
    r = _node("reduce_sum", [(8, 4)], [(4,)], 32.0, axes=(0,))
    s = follow_strategy(r, 0, (("x",), ()), ctx)
    assert s.outs == (((),),)
    assert [c.kind for c in s.comm] == ["all-reduce"] and s.comm[0].nbytes == 16
    # Reducing an unsharded dim keeps the other dim's sharding, no collective.
    s = follow_strategy(r, 0, ((), ("x",)), ctx)
    assert s.outs == ((("x",),),) and s.comm == ()


def test_sums_over_dims_split_on_different_axes_all_reduce_once_per_dim():
    # Measured on 8 CPU devices (post-partitioning HLO, mesh data=2 x tensor=4): summing
    # a [8, 16, 64] array over dims 0 and 1 laid out (data, tensor) emits an all-reduce
    # over tensor, then one over data, each of the whole [64] result (256 bytes); laid
    # out (data+tensor, -), one all-reduce over both. The same holds for an einsum
    # "bsh,bsk->hk" contracting both dims: two all-reduces of the [64, 32] result.
    ctx = CostContext(CLUSTER, {"data": 2, "tensor": 4})
    r = _node("reduce_sum", [(8, 16, 64)], [(64,)], 0.0, axes=(0, 1))
    s = follow_strategy(r, 0, (("data",), ("tensor",), ()), ctx)
    assert [(c.kind, c.axes, c.nbytes) for c in s.comm] == [
        ("all-reduce", ("tensor",), 256),
        ("all-reduce", ("data",), 256),
    ]
    s = follow_strategy(r, 0, (("data", "tensor"), (), ()), ctx)
    assert [(c.kind, c.axes, c.nbytes) for c in s.comm] == [("all-reduce", ("data", "tensor"), 256)]
    mm = _node(
        "dot_general", [(8, 16, 64), (8, 16, 32)], [(64, 32)], 0.0,
        dimension_numbers=(((0, 1), (0, 1)), ((), ())),
    )  # fmt: skip
    split = ((("data",), ("tensor",), ()), (("data",), ("tensor",), ()))
    ar = [s for s in enumerate_strategies(mm, ctx) if s.ins[:2] == split and s.outs[0] == ((), ())]
    assert len(ar) == 1
    assert [(c.kind, c.axes, c.nbytes) for c in ar[0].comm] == [
        ("all-reduce", ("tensor",), 64 * 32 * 4),
        ("all-reduce", ("data",), 64 * 32 * 4),
    ]


def test_cumsum_and_slices_do_not_shard_their_dim():
    ctx = CostContext(CLUSTER, {"x": 2})
    c = _node("cumsum", [(8, 4)], [(8, 4)], axis=1)
    s = follow_strategy(c, 0, (("x",), ("x",)), ctx)  # (invalid input on purpose)
    assert s.ins[0][1] == () and s.outs[0][1] == ()
    sl = _node(
        "slice", [(8, 4)], [(8, 2)], start_indices=(0, 0), limit_indices=(8, 2), strides=None
    )
    s = follow_strategy(sl, 0, (("x",), ()), ctx)
    assert s.outs == ((("x",), ()),)


def test_transpose_and_broadcast_move_the_sharding():
    ctx = CostContext(CLUSTER, {"x": 2})
    t = _node("transpose", [(8, 4)], [(4, 8)], permutation=(1, 0))
    assert follow_strategy(t, 0, (("x",), ()), ctx).outs == (((), ("x",)),)
    b = _node("broadcast_in_dim", [(4,)], [(8, 4)], shape=(8, 4), broadcast_dimensions=(1,))
    assert follow_strategy(b, 0, (("x",),), ctx).outs == (((), ("x",)),)


def test_elementwise_broadcasts_size_one_dims():
    # LayerNorm's x - mean: x [8, 4, 6] split on the batch, mean [8, 4, 1] follows it on
    # the batch (no gather of the statistics) and stays whole on its size-1 dim.
    ctx = CostContext(CLUSTER, {"x": 2})
    sub = _node("sub", [(8, 4, 6), (8, 4, 1)], [(8, 4, 6)])
    x = ("x",)
    s = follow_strategy(sub, 0, (x, (), ()), ctx)
    assert s.ins == ((x, (), ()), (x, (), ()))
    assert s.outs == ((x, (), ()),)
    # A hidden-split x cannot split mean's size-1 hidden dim: mean stays whole there.
    s = follow_strategy(sub, 0, ((), (), x), ctx)
    assert s.ins == (((), (), x), ((), (), ())) and s.outs == (((), (), x),)
    # Neither operand has the result's shape (scale [1, 1, 6] x rstd [8, 4, 1]): the op
    # can still follow the statistics' layout.
    mul = _node("mul", [(8, 4, 1), (1, 1, 6)], [(8, 4, 6)])
    s = follow_strategy(mul, 0, (x, (), ()), ctx)
    assert s.ins == ((x, (), ()), ((), (), ())) and s.outs == ((x, (), ()),)


def test_fused_values_cost_no_hbm_traffic():
    # An elementwise op whose operand and result stay in registers (io says so) moves no
    # bytes; the same op reading and writing HBM pays (in + out) / bandwidth.
    ctx = CostContext(CLUSTER, {"x": 2})
    n = 1 << 20
    tanh = _node("tanh", [(n,)], [(n,)], float(n))
    spec = ((),)
    fused = follow_strategy(tanh, 0, spec, ctx, ((False,), (False,)))
    alone = follow_strategy(tanh, 0, spec, ctx)
    dev = CLUSTER.device
    assert alone.compute_s == pytest.approx(compute_time(n, 8 * n, dev, "float32", "elementwise"))
    assert fused.compute_s == pytest.approx(compute_time(n, 0, dev, "float32", "elementwise"))
    assert fused.compute_s < alone.compute_s / 10
