"""Export: a plan as PartitionSpec pytrees and Flax logical-axis rules, and back.

The round trip: plan -> ``partition_specs`` -> ``autoparallel(plan=specs)`` runs, equals
single-device ``jax.jit``, and lowers with the original plan's shardings and compiled
collectives.
"""

import collections
import functools

import flax.linen as nn
import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import autopar
from autopar import export
from autopar.plan import Plan, TensorSharding
from autopar.verify.hlo import parse_collectives
from benchmarks.models.mlp import MLPConfig, make_train_step

MESH = {"data": 2, "tensor": 4}
# The MLP's 525,568 float32 parameters (256*1024 + 1024 + 1024*256 + 256) and their two AdamW
# moments take 6,306,816 bytes replicated. Unbounded, the cost model replicates this
# latency-bound step even on a fixed mesh (a tensor split pays an all-reduce that costs more
# than the compute it saves); under this bound it must split the layers.
REPLICATED_STATE_BYTES = 3 * 4 * (256 * 1024 + 1024 + 1024 * 256 + 256)
MEMORY_BOUND = 4_000_000


@functools.cache
def _step():
    step, (state, batch) = make_train_step(
        MLPConfig(d_in=256, hidden=1024, d_out=256, layers=2), 64, abstract=False
    )
    return step, state, batch


@functools.cache
def _plan() -> Plan:
    step, state, batch = _step()
    assert MEMORY_BOUND < REPLICATED_STATE_BYTES
    options = autopar.SearchOptions(mesh=MESH, memory_limit_bytes=MEMORY_BOUND)
    return autopar.plan(step, state, batch, cluster="dgx-a100-80gb", options=options)


def _collectives(lowered) -> collections.Counter:
    """(kind, group size) -> executions, from the compiled HLO."""
    out: collections.Counter = collections.Counter()
    for c in parse_collectives(lowered.hlo_text()):
        out[(c.kind, c.group_size)] += c.count
    return out


def test_partition_specs_match_the_plan_and_the_arguments():
    step, state, batch = _step()
    plan = _plan()
    # The plan shards something: the first layer's weight column-wise over one axis.
    w0 = plan.input("params/layer_0/w")
    assert sum(e is not None for e in w0.spec) == 1, w0.spec
    specs = export.partition_specs(plan)
    assert jax.tree.structure(specs, is_leaf=lambda x: isinstance(x, P)) == jax.tree.structure(
        jax.tree.map(lambda _: 0, (state, batch))
    )
    assert specs[0]["params"]["layer_0"]["w"] == P(*w0.spec)
    # A plan loaded from JSON does not know the pytree: by path, or shaped like= the args.
    loaded = Plan.from_json(plan.to_json())
    assert export.partition_specs(loaded)["state/params/layer_0/w"] == P(*w0.spec)
    assert export.partition_specs(loaded, like=(state, batch)) == specs
    with pytest.raises(export.ImportSpecsError, match="leaves"):
        export.partition_specs(loaded, like=(state,))
    sh = export.named_shardings(loaded, like=(state, batch))
    assert isinstance(sh[0]["params"]["layer_0"]["w"], NamedSharding)
    assert dict(sh[0]["params"]["layer_0"]["w"].mesh.shape) == MESH


def test_round_trip_through_autoparallel_equals_jit_with_the_same_shardings():
    step, state, batch = _step()
    plan = _plan()
    specs = export.partition_specs(plan)
    original = autopar.autoparallel(step, plan=plan, cache=False)
    # Completed on the cluster the plan was made for (the default is the local CPUs,
    # whose prices need not pick the same activation layouts).
    options = autopar.SearchOptions(mesh=MESH, memory_limit_bytes=MEMORY_BOUND)
    again = autopar.autoparallel(
        step, plan=specs, cluster="dgx-a100-80gb", options=options, cache=False
    )
    imported = again.plan_for(state, batch)
    assert imported.mesh == plan.mesh
    assert [r.spec for r in imported.inputs] == [r.spec for r in plan.inputs]
    assert [r.spec for r in imported.outputs] == [r.spec for r in plan.outputs]
    lo, li = original.lower(state, batch), again.lower(state, batch)
    assert jax.tree.map(lambda s: s.spec, li.in_shardings) == jax.tree.map(
        lambda s: s.spec, lo.in_shardings
    )
    assert jax.tree.map(lambda s: s.spec, li.out_shardings) == jax.tree.map(
        lambda s: s.spec, lo.out_shardings
    )
    # Same compiled collectives (kind, group size, executions) as the original plan.
    assert _collectives(li) == _collectives(lo)
    # Numerics: equal to the single-device program.
    want_state, want_loss = jax.jit(step)(state, batch)
    got_state, got_loss = again(state, batch)
    np.testing.assert_allclose(np.asarray(got_loss), np.asarray(want_loss), rtol=1e-5)
    for a, b in zip(jax.tree.leaves(got_state), jax.tree.leaves(want_state), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)
    # NamedShardings carry the mesh: no options needed.
    shardings = export.named_shardings(plan)
    by_sharding = autopar.autoparallel(step, plan=shardings, cache=False).plan_for(state, batch)
    assert [r.spec for r in by_sharding.inputs] == [r.spec for r in plan.inputs]


def test_bad_specs_are_clear_errors():
    step, state, batch = _step()
    good = export.partition_specs(_plan())
    with pytest.raises(export.ImportSpecsError, match="structure"):
        export.plan_from_specs(step, (good[0],), state, batch, mesh=MESH, complete=False)
    bad_axis = (good[0], {"x": P("pipe"), "y": None})
    with pytest.raises(export.ImportSpecsError, match="'pipe'"):
        export.plan_from_specs(step, bad_axis, state, batch, mesh=MESH, complete=False)
    two_axes = (good[0], {"x": P("data"), "y": P("tensor")})
    with pytest.raises(export.ImportSpecsError, match="sizes"):
        export.plan_from_specs(step, two_axes, state, batch, complete=False)
    replicated = jax.tree.map(lambda _: P(), good[0], is_leaf=lambda x: isinstance(x, P))
    data_only = (replicated, {"x": P("data"), "y": P("data")})
    one_axis = export.plan_from_specs(step, data_only, state, batch, complete=False)
    assert one_axis.mesh == {"data": 8}  # one axis named, no sizes: every device
    uneven = (good[0], {"x": P(None, ("data", "tensor")), "y": P(("data", "tensor"), None)})
    p = export.plan_from_specs(step, uneven, state, batch, mesh=MESH, complete=False)
    assert p.input("batch/x").spec == (None, ("data", "tensor"))
    with pytest.raises(export.ImportSpecsError, match="not divisible"):
        export.plan_from_specs(
            step, data_only, state, batch, mesh={"data": 3}, complete=False,
        )  # fmt: skip
    with pytest.raises(autopar.InvalidOptionError, match="PartitionSpec"):
        autopar.autoparallel(step, plan=42)


def test_logical_axis_rules_reproduce_every_parameter_spec():
    plan = Plan(
        mesh=MESH,
        inputs=(
            TensorSharding("s/params/h/q/kernel", (2, 16, 32), "f32", (None, None, "tensor")),
            TensorSharding("s/params/h/q/bias", (2, 32), "f32", (None, "tensor")),
            TensorSharding("s/params/h/out/kernel", (2, 32, 16), "f32", (None, "tensor", None)),
            TensorSharding("s/params/h/out/bias", (2, 16), "f32", (None, None)),
            TensorSharding("s/params/wte/embedding", (64, 16), "f32", (("data", "tensor"), None)),
            TensorSharding("s/params/enc/q/kernel", (16, 32), "f32", ("data", None)),
            TensorSharding("s/opt/opt_state/mu/h/q/kernel", (2, 16, 32), "f32",
                           (None, "data", "tensor"), "opt_state"),
            TensorSharding("b/tokens", (8, 4), "i32", ("data", None), "batch"),
        ),
    )  # fmt: skip
    plan = Plan(
        mesh=plan.mesh,
        inputs=tuple(
            TensorSharding(r.path, r.shape, r.dtype, r.spec, "param") if r.role == "other" else r
            for r in plan.inputs
        ),
    )
    la = export.logical_axes(plan)
    assert la.axes["h/q/kernel"] == ("q.stack0", "q.in", "q.out")
    assert la.axes["wte/embedding"] == ("wte.vocab", "wte.embed")
    rules = dict(la.rules)
    assert rules["q.out"] == "tensor" and rules["out.in"] == "tensor"
    assert rules["wte.vocab"] == ("data", "tensor") and rules["wte.embed"] is None
    # enc/q/kernel would clash with h/q (q.in, q.out): its dims get names of their own.
    assert la.axes["enc/q/kernel"] == ("enc/q/kernel.0", "enc/q/kernel.1")
    for r in plan.inputs:
        if r.role != "param":
            continue
        names = la.axes[r.path.split("/params/")[1]]
        got = nn.logical_to_mesh_axes(names, export.logical_axis_rules(plan))
        assert tuple(got) == r.spec, (r.path, got, r.spec)
    assert dict(la.unmapped) == {
        "s/opt/opt_state/mu/h/q/kernel": "optimizer state laid out P(None, 'data', 'tensor'), "
        "its parameter P(None, None, 'tensor')",
        "b/tokens": "batch input laid out P('data', None)",
    }


def test_logical_axis_rules_of_a_searched_plan():
    plan = _plan()
    la = export.logical_axes(plan)
    rules = export.logical_axis_rules(plan)
    for r in plan.inputs:
        if r.role == "param":
            names = la.axes[r.path.split("/params/")[1]]
            assert tuple(nn.logical_to_mesh_axes(names, rules)) == r.spec
    w0 = plan.input("params/layer_0/w").spec
    assert dict(rules)["layer_0.out"] == w0[1]
