"""Cluster presets, mesh-axis placement, JSON, and Cluster.local on simulated CPU devices."""

import pytest

from cost_models import PRESETS, Cluster, CostModelError, LinkLevel, torus_shape_for


def names(levels):
    return tuple(level.name for level in levels)


def test_axis_levels_tensor_inside_data_across():
    c = Cluster.preset("dgx-a100-80gb", nodes=4)
    levels = c.axis_levels({"data": 4, "tensor": 8})
    assert names(levels["tensor"]) == ("nvlink",)
    assert names(levels["data"]) == ("infiniband",)


def test_axis_levels_hierarchical_data():
    c = Cluster.preset("dgx-a100-80gb", nodes=4)
    levels = c.axis_levels({"data": 16, "tensor": 2})
    assert names(levels["tensor"]) == ("nvlink",)
    # 16 data ranks: stride 2, so 4 per node over 4 nodes -> both levels
    assert names(levels["data"]) == ("nvlink", "infiniband")


def test_group_layout_counts():
    c = Cluster.preset("dgx-a100-80gb", nodes=8)
    lay = c.group_layout({"pipe": 2, "data": 4, "tensor": 8}, ["data"])
    assert (lay.size, lay.per_node, lay.nodes) == (4, 1, 4)
    lay = c.group_layout({"pipe": 2, "data": 4, "tensor": 8}, ["data", "tensor"])
    assert (lay.size, lay.per_node, lay.nodes) == (32, 8, 4)
    lay = c.group_layout({"pipe": 2, "data": 4, "tensor": 8}, [])
    assert (lay.size, lay.per_node, lay.nodes) == (1, 1, 1)


def test_mesh_errors():
    c = Cluster.preset("dgx-a100-80gb", nodes=1)
    with pytest.raises(CostModelError, match="needs 16 devices"):
        c.axis_levels({"data": 16})
    with pytest.raises(CostModelError, match="not in the mesh"):
        c.group_layout({"data": 8}, ["tensor"])
    with pytest.raises(CostModelError, match="integer"):
        c.axis_levels({"data": 2.5})


def test_group_members_match_a_row_major_device_array():
    """The group over some axes holding device 0: what indexing ``arange(n).reshape(sizes)``
    at coordinate 0 on every other axis gives (jax.sharding.Mesh's device order)."""
    import numpy as np

    from cost_models.cluster import group_members

    mesh = {"pipe": 2, "data": 3, "tensor": 4}
    devices = np.arange(24).reshape(2, 3, 4)
    assert group_members(mesh, ["tensor"]) == tuple(devices[0, 0, :])  # 0..3
    assert group_members(mesh, ["data"]) == tuple(devices[0, :, 0])  # 0, 4, 8
    assert group_members(mesh, ["pipe", "tensor"]) == tuple(devices[:, 0, :].ravel())
    assert group_members(mesh, []) == (0,)
    with pytest.raises(CostModelError, match="axis 'seq' is not in the mesh"):
        group_members(mesh, ["seq"])


def test_presets_sizes_and_links():
    assert Cluster.preset("dgx-a100-80gb", nodes=48).num_devices == 384
    dgx = Cluster.preset("dgx-a100-80gb")
    assert dgx.intra.bandwidth == 230e9 and dgx.inter.bandwidth == 25e9  # reference README
    assert Cluster.preset("dgx-h100").intra.bandwidth == 370e9
    assert Cluster.preset("tpu-v4", nodes=2).num_devices == 8  # 4 chips per host
    v5e = Cluster.preset("tpu-v5e", chips=256)
    assert v5e.torus_shape == (16, 16) and v5e.intra.bandwidth == pytest.approx(200e9)
    for name in PRESETS:
        assert Cluster.preset(name).num_devices >= 1
    with pytest.raises(CostModelError, match="known"):
        Cluster.preset("dgx-b200")
    with pytest.raises(CostModelError, match="nodes="):
        Cluster.preset("dgx-h100", chips=8)


def test_torus_shapes():
    assert torus_shape_for(64, 3) == (4, 4, 4)
    assert torus_shape_for(16, 3) == (2, 2, 4)
    assert torus_shape_for(8, 2) == (2, 4)
    with pytest.raises(CostModelError, match="power of two"):
        torus_shape_for(12, 3)
    with pytest.raises(CostModelError, match="torus_shape"):
        Cluster(
            "x",
            Cluster.preset("tpu-v4").device,
            1,
            4,
            LinkLevel("ici", 1e9, 0.0),
            LinkLevel("ici", 1e9, 0.0),
            topology="torus",
            torus_shape=(2, 4),
        )


def test_torus_group_extents():
    c = Cluster.preset("tpu-v5p", chips=64)  # torus (4, 4, 4)
    lay = c.group_layout({"a": 4, "b": 16}, ["b"])  # inner 16 chips: last two dims
    assert lay.torus_extents == (4, 4)
    lay = c.group_layout({"a": 4, "b": 16}, ["a"])
    assert lay.torus_extents == (4,)


def test_json_round_trip_and_describe():
    for name in PRESETS:
        c = Cluster.preset(name)
        assert Cluster.from_json(c.to_json()) == c
    on_cpu = Cluster.preset("dgx-a100-80gb").compiled_on("cpu")
    assert Cluster.from_json(on_cpu.to_json()).device.compiler == "xla:cpu"
    text = Cluster.preset("dgx-a100-80gb", nodes=2).describe()
    assert "2 nodes x 8 a100-80gb = 16 devices" in text
    assert "infiniband" in text


def test_validation():
    with pytest.raises(CostModelError, match="overlap_efficiency"):
        Cluster(
            "x",
            Cluster.preset("cpu-sim").device,
            1,
            1,
            LinkLevel("host", 1e9, 0.0),
            LinkLevel("host", 1e9, 0.0),
            overlap_efficiency=1.5,
        )
    with pytest.raises(CostModelError, match="LinkLevel.name"):
        LinkLevel("pcie-gen9", 1e9, 0.0)


def test_local_cluster_on_simulated_cpus():
    import jax

    c = Cluster.local()
    assert c.device.name == "cpu-sim"
    assert c.num_devices == len(jax.devices()) == 8  # tests/conftest.py
    assert c.num_nodes == 1
    assert c.device == Cluster.preset("cpu-sim").device  # CPU profiles are never applied
