"""Shardings, reshape propagation and resharding plans (pure functions, expected by hand)."""

from autopar.search.sharding import (
    MeshShape,
    enumerate_shardings,
    from_plan_spec,
    reshape_sharding,
    reshard_plan,
    reshard_steps,
    shards,
    to_plan_spec,
)

M24 = MeshShape(("data", "tensor"), (2, 4))


def test_enumerate_respects_divisibility_and_axis_order():
    # dim 0 (size 6) takes only "data" (6 % 4 != 0); dim 1 (size 8) takes either or both.
    specs = set(enumerate_shardings((6, 8), M24))
    assert specs == {
        ((), ()),
        (("data",), ()),
        ((), ("data",)),
        ((), ("tensor",)),
        ((), ("data", "tensor")),
        (("data",), ("tensor",)),
    }


def test_enumerate_never_splits_12_heads_eight_ways():
    mesh = MeshShape(("tensor",), (8,))
    assert enumerate_shardings((12, 64), mesh) == [((), ()), ((), ("tensor",))]


def test_size_one_axes_are_ignored():
    mesh = MeshShape(("data", "tensor"), (1, 4))
    assert set(enumerate_shardings((4,), mesh)) == {((),), (("tensor",),)}


def test_plan_spec_round_trip():
    spec = ((), ("data", "tensor"), ("seq",))
    assert to_plan_spec(spec) == (None, ("data", "tensor"), "seq")
    assert from_plan_spec(to_plan_spec(spec), 3) == spec
    assert from_plan_spec(("data",), 3) == (("data",), (), ())
    assert shards(spec, MeshShape(("data", "tensor", "seq"), (2, 2, 2))) == 8


def test_reshape_merge_keeps_major_dim_sharding():
    # [b, s, heads, head_dim] -> [b, s, heads * head_dim]: heads sharded survives.
    m = MeshShape(("tensor",), (4,))
    kept, out = reshape_sharding((2, 8, 12, 64), (2, 8, 768), ((), (), ("tensor",), ()), m)
    assert kept == ((), (), ("tensor",), ())
    assert out == ((), (), ("tensor",))


def test_reshape_merge_drops_minor_dim_sharding():
    # Sharding the minor dim of a merge interleaves blocks: it cannot survive.
    m = MeshShape(("tensor",), (4,))
    kept, out = reshape_sharding((2, 8, 12, 64), (2, 8, 768), ((), (), (), ("tensor",)), m)
    assert kept == ((), (), (), ())
    assert out == ((), (), ())


def test_reshape_split_needs_divisible_major_dim():
    m8 = MeshShape(("tensor",), (8,))
    # 768 -> (12, 64): 12 heads do not split 8 ways, so the sharding is dropped.
    assert reshape_sharding((4, 768), (4, 12, 64), ((), ("tensor",)), m8)[1] == ((), (), ())
    m4 = MeshShape(("tensor",), (4,))
    assert reshape_sharding((4, 768), (4, 12, 64), ((), ("tensor",)), m4)[1] == (
        (),
        ("tensor",),
        (),
    )


def test_reshape_two_axes_spill_into_the_next_dim():
    # (2*32) split into (2, 32) with ("data", "tensor") = 2 x 4: data takes the 2, tensor 32.
    kept, out = reshape_sharding((64,), (2, 32), (("data", "tensor"),), M24)
    assert out == (("data",), ("tensor",))
    assert kept == (("data", "tensor"),)


def test_reshard_plan_classifies_axes():
    # data moves dim 0 -> dim 1 (all-to-all), tensor leaves (all-gather).
    a2a, gather = reshard_plan((8, 8), (("data",), ("tensor",)), ((), ("data",)), M24)
    assert a2a == ("data",)
    assert gather == ("tensor",)
    # Replicated -> sharded is a local slice: no collective.
    assert reshard_plan((8, 8), ((), ()), (("data",), ("tensor",)), M24) == ((), ())


def test_axes_trading_places_cost_a_collective_permute():
    # Measured on 8 CPU devices (post-partitioning HLO): a float32 [64, 64] laid out
    # data x expert going to expert x data is an all-to-all plus a collective-permute
    # of the per-device buffer (64*64*4 / 8 = 2048 bytes); keeping the order is not.
    from autopar.search.costs import CostContext
    from cost_models import Cluster

    ctx = CostContext(Cluster.preset("dgx-a100-80gb"), {"data": 2, "expert": 4})
    _, colls = ctx.reshard((64, 64), "float32", (("data",), ("expert",)), (("expert",), ("data",)))
    permutes = [c for c in colls if c.kind == "collective-permute"]
    assert len(permutes) == 1 and permutes[0].nbytes == 2048
    assert set(permutes[0].axes) == {"data", "expert"}
    _, colls = ctx.reshard((64, 64), "float32", (("data", "expert"), ()), (("data",), ("expert",)))
    assert not [c for c in colls if c.kind == "collective-permute"]


def test_axes_keeping_their_dim_behind_other_axes_are_permuted_not_gathered():
    # Measured on 8 CPU devices (post-partitioning HLO), a float32 [8, 8, 8] on mesh
    # d=2, f=2, e=2 (per-device buffers: 2048 bytes / ways):
    #   (e+d+f, -, -) -> (d+f, -, -): collective-permute 256 + all-gather over e 512
    #   (e+d, -, -)   -> (d, -, -):   collective-permute 512 + all-gather over e 1024
    #   (d+f, -, -)   -> (f, d, -):   all-to-all over d 512 + collective-permute 512
    #   (d+e, -, -)   -> (d, -, -):   all-gather over e 1024 (d keeps its place)
    #   (d+f, -, -)   -> (d, -, f):   all-to-all over f 512 (d keeps its place)
    #   (e, -, d+f)   -> (e+d+f, -, -): all-to-all over d+f 256 (dim 2 empties: no permute)
    from autopar.search.costs import CostContext
    from cost_models import Cluster

    ctx = CostContext(Cluster.preset("dgx-a100-80gb"), {"d": 2, "f": 2, "e": 2})

    def colls(src, dst):
        _, cs = ctx.reshard((8, 8, 8), "float32", src, dst)
        return sorted((c.kind, c.nbytes) for c in cs)

    assert colls((("e", "d", "f"), (), ()), (("d", "f"), (), ())) == [
        ("all-gather", 512),
        ("collective-permute", 256),
    ]
    assert colls((("e", "d"), (), ()), (("d",), (), ())) == [
        ("all-gather", 1024),
        ("collective-permute", 512),
    ]
    assert colls((("d", "f"), (), ()), (("f",), ("d",), ())) == [
        ("all-to-all", 512),
        ("collective-permute", 512),
    ]
    assert colls((("d", "e"), (), ()), (("d",), (), ())) == [("all-gather", 1024)]
    assert colls((("d", "f"), (), ()), (("d",), (), ("f",))) == [("all-to-all", 512)]
    assert colls((("e",), (), ("d", "f")), (("e", "d", "f"), (), ())) == [("all-to-all", 256)]


def test_a_reshard_is_priced_step_by_step_as_it_is_lowered():
    # (d+f, -, -) -> (-, d, -): d moves (all-to-all) and f leaves (all-gather). Lowered
    # as reshard_steps, XLA (8 CPU devices, float32 [8, 8, 8]) first moves d, which
    # leaves f alone on dim 0 behind no outer axis (a permute of the 512-byte buffer),
    # then gathers f: all-to-all 512 + collective-permute 512 + all-gather 1024.
    from autopar.search.costs import CostContext
    from cost_models import Cluster

    mesh = {"d": 2, "f": 2, "e": 2}
    src, dst = (("d", "f"), (), ()), ((), ("d",), ())
    assert reshard_steps((8, 8, 8), src, dst, MeshShape.from_mapping(mesh)) == (
        (("f",), ("d",), ()),
        dst,
    )
    ctx = CostContext(Cluster.preset("dgx-a100-80gb"), mesh)
    _, colls = ctx.reshard((8, 8, 8), "float32", src, dst)
    assert sorted((c.kind, c.nbytes) for c in colls) == [
        ("all-gather", 1024),
        ("all-to-all", 512),
        ("collective-permute", 512),
    ]


def test_a_reshard_over_an_axis_of_size_one_moves_nothing():
    # Every device holds the whole tensor along an axis of size 1: leaving it is free
    # and no collective runs (the memory model counts no copy for it); the bigger axis
    # next to it still all-gathers the whole 8x8 float32 buffer.
    from autopar.search.costs import CostContext
    from cost_models import Cluster

    ctx = CostContext(Cluster.preset("dgx-a100-80gb"), {"one": 1, "data": 8})
    assert ctx.reshard((8, 8), "float32", (("one",), ()), ((), ())) == (0.0, ())
    _, colls = ctx.reshard((8, 8), "float32", (("one", "data"), ()), ((), ()))
    assert [(c.kind, c.nbytes) for c in colls] == [("all-gather", 8 * 8 * 4)]
