"""Collective times vs hand-derived values on a DGX A100 cluster and a TPU torus.

DGX A100 links (reference README): NVLink 230 GB/s busbw; InfiniBand 25 GB/s per GPU
(one 200 Gb/s HDR NIC per GPU, 8 per node). GPU collectives follow NCCL's tuning model,
whose constants are re-typed here from NVIDIA/nccl src/graph/tuning.cc (v2.12): baseLat
ring (LL, LL128, Simple) = (6.6, 14.0, 8.4) us, tree (6.8, 14.0, 0); hwLat NVLink ring
(0.47, 1.9, 3.4), tree (0.52, 1.2, 28); network ring (2.7, 4.0, 9.6), tree (5.0, 8.5, 50).
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
US = 1e-6
B = 1e9


@pytest.fixture
def dgx8():
    return Cluster.preset("dgx-a100-80gb", nodes=8)


def test_ring_all_reduce_inside_a_node(dgx8):
    # Simple protocol: baseLat 8.4 us + 2(n-1) NVLink hops of 3.4 us
    expected = 2 * 7 / 8 * B / NV_BW + 8.4 * US + 2 * 7 * NV_A
    got = collective_time("all-reduce", B, dgx8, {"data": 8, "tensor": 8}, ["tensor"], "ring")
    assert got == pytest.approx(expected, rel=1e-12)
    # 1 GB: Simple beats LL128 (0.92 of the bandwidth) and the tree (capped at 110 GB/s)
    assert best_algorithm("all-reduce", B, dgx8, {"data": 8, "tensor": 8}, ["tensor"]) == (
        "ring/Simple",
        pytest.approx(expected),
    )


def test_all_gather_and_reduce_scatter_inside_a_node(dgx8):
    expected = 7 / 8 * B / NV_BW + 8.4 * US + 7 * NV_A  # B = full gathered output / full input
    for kind in ("all-gather", "reduce-scatter"):
        got = collective_time(kind, B, dgx8, {"data": 8, "tensor": 8}, ["tensor"])
        assert got == pytest.approx(expected, rel=1e-12)


def test_protocol_by_message_size_inside_a_node(dgx8):
    mesh, axes = {"data": 8, "tensor": 8}, ["tensor"]
    name, t = best_algorithm("all-reduce", 1e3, dgx8, mesh, axes)
    # LL: a quarter of the bus bandwidth (all-reduce), ring algbw = bus * n / (2(n-1))
    assert name == "ring/LL"
    assert t == pytest.approx(6.6 * US + 14 * 0.47 * US + 1e3 / (NV_BW / 4 * 8 / 14))
    assert best_algorithm("all-reduce", 1e7, dgx8, mesh, axes)[0] == "ring/LL128"
    assert best_algorithm("all-reduce", 1e9, dgx8, mesh, axes)[0] == "ring/Simple"


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


def test_rings_across_nodes_use_every_nic_of_the_group(dgx8):
    one_node = collective_time("all-reduce", B, dgx8, {"r": 8, "x": 8}, ["x"])
    eight_nodes = collective_time("all-reduce", B, dgx8, {"x": 8, "r": 8}, ["x"])  # 1 GPU per node
    all64 = collective_time("all-reduce", B, dgx8, {"x": 64}, ["x"])
    assert one_node == pytest.approx(2 * 7 / 8 * B / NV_BW + 8.4 * US + 14 * NV_A)
    # one GPU per node: its own NIC; a large multi-node Simple ring pays NCCL's 1.9x
    # "plateau" latency; 14 network hops
    assert eight_nodes == pytest.approx(2 * 7 / 8 * B / IB_BW + 1.9 * (8.4 + 14 * 9.6) * US)
    # 8 nodes x 8 GPUs: 8 channels over the node's 8 NICs, bus = min(230, 8 x 25) = 200 GB/s;
    # 126 steps, 14 of them across the network
    simple = 2 * 63 / 64 * B / 200e9 + 1.9 * (8.4 + 112 * 3.4 + 14 * 9.6) * US
    ll128 = 2 * 63 / 64 * B / (0.92 * 200e9) + (14.0 + 112 * 1.9 + 14 * 4.0) * US
    assert all64 == pytest.approx(min(simple, ll128))
    assert one_node < all64 < eight_nodes
    # the explicit two-level α-β form (RS in node, one NIC per GPU on 1/8 of the data, AG
    # in node) is slower here
    intra = 7 / 8 * B / NV_BW + 7 * NV_A
    inter = 7 / 8 * (B / 8) / IB_BW + 7 * IB_A
    hier = collective_time("all-reduce", B, dgx8, {"x": 64}, ["x"], "hierarchical")
    assert hier == pytest.approx(2 * intra + 2 * inter)
    assert hier > all64


def test_all_gather_across_nodes_uses_all_nics(dgx8):
    # NCCL runs all-gather / reduce-scatter as rings; 8 members per node drive 8 NICs
    got = collective_time("all-gather", B, dgx8, {"x": 64}, ["x"])
    assert got == pytest.approx(63 / 64 * B / 200e9 + (8.4 + 56 * 3.4 + 7 * 9.6) * US)
    # one member per node (the other 7 GPUs' groups hold the other NICs): one NIC
    one_nic = collective_time("all-gather", B, dgx8, {"x": 8, "t": 8}, ["x"])
    assert one_nic == pytest.approx(7 / 8 * B / IB_BW + (8.4 + 7 * 9.6) * US)
    hier = collective_time("all-gather", B, dgx8, {"x": 64}, ["x"], "hierarchical")
    assert hier == pytest.approx(7 / 8 * (B / 8) / IB_BW + 7 * IB_A + 7 / 8 * B / NV_BW + 7 * NV_A)
    assert got < hier < one_nic


def test_tree_wins_small_messages(dgx8):
    small = 1e3
    name, t = best_algorithm("all-reduce", small, dgx8, {"x": 64}, ["x"])
    assert name == "tree/LL"
    # tree bus = min(0.9 x 200, 80 GB/s over > 2 nodes) / 3.8 (LL); algbw = bus / 2;
    # latency 6.8 + 2 (7 x 0.52 x 1.8 + log2(8) x 5.0) us
    lat = (6.8 + 2 * (7 * 0.52 * 1.8 + 3 * 5.0)) * US
    assert t == pytest.approx(lat + small / (0.5 * 80e9 / 3.8))


def test_nvls_on_dgx_h100():
    h = Cluster.preset("dgx-h100")
    name, t = best_algorithm("all-reduce", B, h, {"t": 8}, ["t"])
    # NVLink SHARP: ~480 GB/s busbw (reference README), 25 us (tuning.cc, NVLS Simple)
    assert name == "nvls/Simple"
    assert t == pytest.approx(25 * US + 2 * 7 / 8 * B / 480e9)
    assert t < collective_time("all-reduce", B, h, {"t": 8}, ["t"], "ring")
    with pytest.raises(CostModelError, match="nvls"):
        collective_time("all-reduce", B, Cluster.preset("dgx-a100-80gb"), {"t": 8}, ["t"], "nvls")


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
    with pytest.raises(CostModelError, match="all-reduce only"):
        collective_time("reduce-scatter", B, dgx8, {"x": 64}, ["x"], "nvls")
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
