"""Collective times vs hand-derived α-β values on a DGX A100 cluster and a TPU torus.

DGX A100 links (reference README + NCCL tuning.cc): NVLink 230 GB/s, 3.4 us per step;
InfiniBand 25 GB/s per GPU, 9.6 us per step.
"""

import math

import pytest

from cost_models import (
    Cluster,
    CollectiveCost,
    CostModelError,
    best_algorithm,
    bytes_on_wire,
    collective_time,
)

NV_BW, NV_A = 230e9, 3.4e-6
IB_BW, IB_A = 25e9, 9.6e-6
B = 1e9


@pytest.fixture
def dgx8():
    return Cluster.preset("dgx-a100-80gb", nodes=8)


def test_ring_all_reduce_inside_a_node(dgx8):
    expected = 2 * 7 / 8 * B / NV_BW + 2 * 7 * NV_A
    got = collective_time("all-reduce", B, dgx8, {"data": 8, "tensor": 8}, ["tensor"], "ring")
    assert got == pytest.approx(expected, rel=1e-12)
    assert collective_time(
        "all-reduce", B, dgx8, {"data": 8, "tensor": 8}, ["tensor"]
    ) == pytest.approx(expected)


def test_all_gather_and_reduce_scatter_inside_a_node(dgx8):
    expected = 7 / 8 * B / NV_BW + 7 * NV_A  # B = full gathered output / full input
    for kind in ("all-gather", "reduce-scatter"):
        got = collective_time(kind, B, dgx8, {"data": 8, "tensor": 8}, ["tensor"])
        assert got == pytest.approx(expected, rel=1e-12)


def test_all_to_all_inside_a_node_and_across(dgx8):
    inside = collective_time("all-to-all", B, dgx8, {"d": 8, "e": 8}, ["e"])
    assert inside == pytest.approx(7 / 8 * B / NV_BW + 7 * NV_A)
    # 16 experts over 2 nodes (8 per node): intra and network parts run side by side
    across = collective_time("all-to-all", B, dgx8, {"d": 4, "e": 16}, ["e"])
    expected = max(7 / 16 * B / NV_BW, 8 / 16 * B / IB_BW) + 7 * NV_A + 8 * IB_A
    assert across == pytest.approx(expected)


def test_p2p(dgx8):
    mesh = {"pipe": 8, "tensor": 8}
    assert collective_time("p2p", B, dgx8, mesh, ["pipe"]) == pytest.approx(B / IB_BW + IB_A)
    assert collective_time("p2p", B, dgx8, mesh, ["tensor"]) == pytest.approx(B / NV_BW + NV_A)


def test_hierarchical_ordering_and_values(dgx8):
    one_node = collective_time("all-reduce", B, dgx8, {"r": 8, "x": 8}, ["x"])
    eight_nodes = collective_time("all-reduce", B, dgx8, {"x": 8, "r": 8}, ["x"])  # 1 GPU per node
    all64 = collective_time("all-reduce", B, dgx8, {"x": 64}, ["x"])
    assert one_node == pytest.approx(2 * 7 / 8 * B / NV_BW + 14 * NV_A)
    # one GPU per node: a plain ring over the network (beats tree for 1 GB)
    assert eight_nodes == pytest.approx(2 * 7 / 8 * B / IB_BW + 14 * IB_A)
    # 64 = 8 nodes x 8: RS in node, AR across nodes on 1/8 of the data, AG in node
    intra = 7 / 8 * B / NV_BW + 7 * NV_A
    inter = 7 / 8 * (B / 8) / IB_BW + 7 * IB_A
    assert all64 == pytest.approx(2 * intra + 2 * inter)
    assert one_node < all64 < eight_nodes
    # a flat ring over 64 GPUs would pay the network bandwidth on the full buffer
    flat = collective_time("all-reduce", B, dgx8, {"x": 64}, ["x"], "ring")
    assert flat == pytest.approx(2 * 63 / 64 * B / IB_BW + 2 * (56 * NV_A + 7 * IB_A))
    assert best_algorithm("all-reduce", B, dgx8, {"x": 64}, ["x"])[0] == "hierarchical"


def test_all_gather_across_nodes_is_a_ring(dgx8):
    # NCCL: all-gather / reduce-scatter only as rings -> network bandwidth on the full buffer
    got = collective_time("all-gather", B, dgx8, {"x": 64}, ["x"])
    assert got == pytest.approx(63 / 64 * B / IB_BW + 56 * NV_A + 7 * IB_A)
    hier = collective_time("all-gather", B, dgx8, {"x": 64}, ["x"], "hierarchical")
    assert hier == pytest.approx(7 / 8 * (B / 8) / IB_BW + 7 * IB_A + 7 / 8 * B / NV_BW + 7 * NV_A)
    assert hier < got


def test_tree_wins_small_messages(dgx8):
    small = 1e3
    name, t = best_algorithm("all-reduce", small, dgx8, {"x": 64}, ["x"])
    assert name == "tree"
    assert t == pytest.approx(2 * small / IB_BW + 2 * (7 * NV_A + 3 * IB_A))


def test_torus_ring_and_all_to_all():
    c = Cluster.preset("tpu-v4", chips=64)  # torus (4, 4, 4), 1.1 PB/s / 4096 per chip
    bw = 1.1e15 / 4096
    # 16 chips along two of three torus dims: 2/3 of the per-chip bandwidth, 3+3 ring steps
    got = collective_time("all-reduce", B, c, {"a": 4, "b": 16}, ["b"])
    assert got == pytest.approx(2 * 15 / 16 * B / (bw * 2 / 3) + 2 * 6 * 1e-6)
    # all-to-all along one dim of 4: bisection factor max(3/4, 4 * 1 / 4) = 1
    a2a = collective_time("all-to-all", B, c, {"a": 16, "b": 4}, ["b"])
    assert a2a == pytest.approx(B / (bw / 3) + 3 * 1e-6)
    p2p = collective_time("p2p", B, c, {"a": 16, "b": 4}, ["b"])
    assert p2p == pytest.approx(B / (bw / 6) + 1e-6)  # one link, one direction


def test_trivial_groups_cost_nothing(dgx8):
    assert collective_time("all-reduce", B, dgx8, {"x": 64}, []) == 0.0
    assert collective_time("all-gather", B, dgx8, {"x": 1, "y": 64}, ["x"]) == 0.0
    assert collective_time("all-reduce", 0.0, dgx8, {"x": 64}, ["x"]) == 0.0


def test_errors(dgx8):
    with pytest.raises(CostModelError, match="all-reduce only"):
        collective_time("all-gather", B, dgx8, {"x": 64}, ["x"], "tree")
    with pytest.raises(CostModelError, match="collective kind"):
        collective_time("broadcast", B, dgx8, {"x": 64}, ["x"])
    with pytest.raises(CostModelError, match="algorithm"):
        collective_time("all-reduce", B, dgx8, {"x": 64}, ["x"], "butterfly")
    with pytest.raises(CostModelError, match="pairwise"):
        collective_time("all-to-all", B, dgx8, {"x": 64}, ["x"], "hierarchical")
    with pytest.raises(CostModelError, match="nbytes"):
        collective_time("all-reduce", -1.0, dgx8, {"x": 64}, ["x"])
    with pytest.raises(CostModelError, match="sequence"):
        collective_time("all-reduce", B, dgx8, {"x": 64}, "x")


def test_bytes_on_wire_and_cost_record():
    assert bytes_on_wire("all-reduce", 100.0, 4) == 150.0
    assert bytes_on_wire("all-gather", 100.0, 4) == 75.0
    assert bytes_on_wire("p2p", 100.0, 2) == 100.0
    assert bytes_on_wire("all-reduce", 100.0, 1) == 0.0
    rec = CollectiveCost("all-gather", 1.0, ["fsdp"], 0.5, count=3)
    assert rec.axes == ("fsdp",) and math.isclose(rec.total_s, 1.5)
