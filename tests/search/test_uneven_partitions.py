"""ZeRO-3's padded partitions: a dim the ZeRO axes do not divide, split anyway (``ceil(n /
k)`` per device, as DeepSpeed's flattened and padded buffers), priced by the evaluation
with the padding moved by every gather and reduce-scatter; the lowering refuses it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import autopar
from autopar.errors import LowerPlanError
from autopar.lower import lower_plan
from autopar.plan import Plan, TensorSharding
from autopar.search.sharding import (
    MeshShape,
    device_bytes,
    divides,
    padded_elements,
    splits,
    uneven_plan,
)
from cost_models import Cluster

F32 = 4


def test_padded_partition_sizes_by_hand():
    even = MeshShape(("data",), (1120,))
    padded = MeshShape(("data",), (1120,), padded=True)
    # 20480 = 2^12 x 5 and 1120 = 2^5 x 5 x 7: no even split; padded, 19 per device
    assert not splits(20480, 1120, even) and splits(20480, 1120, padded)
    assert not splits(105, 1120, padded)  # fewer elements than devices: never
    assert padded_elements((20480,), (("data",),), padded) == 19 * 1120
    # 2 bytes per element: one device holds 19 of them
    assert device_bytes(2 * 20480, (20480,), (("data",),), padded) == pytest.approx(38.0)
    # an even split is the same either way
    assert device_bytes(640.0, (64, 5), (("data",), ()), MeshShape(("data",), (8,), True)) == 80.0
    assert divides((105, 20480), ((), ("data",)), padded)
    assert not divides((105, 20480), (("data",), ()), padded)
    w = TensorSharding("w", (20480,), "float32", ("data",), "param")
    assert uneven_plan(Plan(mesh={"data": 1120}, inputs=(w,), outputs=()))
    assert not uneven_plan(Plan(mesh={"data": 640}, inputs=(w,), outputs=()))


def _step(params, x):
    def loss(p):
        return jnp.mean((jnp.tanh(x @ p["w1"]) @ p["w2"]) ** 2)

    value, grads = jax.value_and_grad(loss)(params)
    return jax.tree.map(lambda w, g: w - 0.1 * g, params, grads), value


PARAMS = {"w1": jnp.ones((12, 20)), "w2": jnp.ones((20, 12))}
X = jnp.ones((64, 12))


def _by_kind(ev) -> dict[str, float]:
    out: dict[str, float] = {}
    for c in ev.collectives:
        if c.bytes:
            out[f"{c.kind}/{c.where}"] = out.get(f"{c.kind}/{c.where}", 0.0) + c.bytes
    return out


def test_zero3_pads_what_the_axis_does_not_divide_and_gathers_the_padding():
    cluster = Cluster.preset("dgx-a100-80gb", nodes=1)
    # 8 divides neither 12 nor 20: without padding both weights stay whole (no gather,
    # gradients all-reduced: 2 x 12 x 20 x 4 = 1920 bytes)
    whole = autopar.baselines.zero(_step, {"data": 8}, 3, PARAMS, X)
    assert whole.input("params/w1").spec == (None, None)
    got = _by_kind(autopar.evaluate(_step, whole, cluster, PARAMS, X))
    assert "all-gather/fsdp_gather" not in got
    assert got["all-reduce/dp_grad"] == 2 * 12 * 20 * F32
    # padded: each weight split on its 20-wide dim, ceil(20 / 8) = 3 per device, so a
    # gather moves 8 x 3 = 24 of them: 24 x 12 x 4 = 1152 bytes per weight, and the
    # gradients are reduce-scattered from the same padded buffer
    padded = autopar.baselines.zero(_step, {"data": 8}, 3, PARAMS, X, pad=True)
    assert padded.input("params/w1").spec == (None, "data")
    assert padded.input("params/w2").spec == ("data", None)
    got = _by_kind(autopar.evaluate(_step, padded, cluster, PARAMS, X))
    assert got["all-gather/fsdp_gather"] == 2 * 24 * 12 * F32
    assert got["reduce-scatter/dp_grad"] == 2 * 24 * 12 * F32
    assert "all-reduce/dp_grad" not in got


def test_the_lowering_refuses_padded_partitions():
    padded = autopar.baselines.zero(_step, {"data": 8}, 3, PARAMS, X, pad=True)
    with pytest.raises(LowerPlanError, match="does not divide"):
        lower_plan(_step, padded, (PARAMS, X))
