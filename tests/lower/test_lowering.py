"""lower_plan: meshes, leaf checks, refusals, activation constraints (scan bodies too),
ZeRO-3 gathering, and never deleting or changing the caller's arrays."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, PartitionSpec

from autopar import baselines
from autopar.errors import LoadPlanError, LowerPlanError
from autopar.lower import lower_plan, make_mesh, remat_policy
from autopar.options import LoweringOptions
from autopar.plan import ActivationConstraint, PipelinePlan, Plan, TensorSharding
from autopar.search.sharding import to_plan_spec
from autopar.trace import trace
from autopar.verify import dump_spmd_hlo, parse_collectives
from tests.lower._zoo import PARAM_ATOL, lowered_case, reference

# ------------------------------------------------------------------------------- mesh


def test_make_mesh_axes_order_and_types() -> None:
    mesh = make_mesh({"data": 2, "tensor": 4})
    assert mesh.axis_names == ("data", "tensor")
    assert dict(mesh.shape) == {"data": 2, "tensor": 4}
    assert all(t == AxisType.Auto for t in mesh.axis_types)
    # Inner axis on consecutive devices.
    ids = np.vectorize(lambda d: d.id)(mesh.devices)
    assert ids.tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_make_mesh_refuses_wrong_device_count() -> None:
    with pytest.raises(LowerPlanError, match=r"needs 4 devices but 8"):
        make_mesh({"data": 4})
    with pytest.raises(LowerPlanError, match=r"needs 16 devices but 8"):
        make_mesh({"data": 2, "tensor": 8})


# ------------------------------------------------------------------------------- a tiny step


def _scan_step(w: jax.Array, x: jax.Array):
    """Loss and gradient of a 3-layer tanh net run by lax.scan (w: [L, d, d])."""

    def loss(w, x):
        def body(c, wi):
            return jnp.tanh(c @ wi), None

        y, _ = jax.lax.scan(body, x, w)
        return jnp.mean(y**2)

    return jax.value_and_grad(loss)(w, x)


def _scan_args():
    kw, kx = jax.random.split(jax.random.PRNGKey(0))
    w = jax.random.normal(kw, (3, 64, 64), jnp.float32) / 8
    x = jax.random.normal(kx, (16, 64), jnp.float32)
    return w, x


def _scan_plan(**kw) -> Plan:
    rep3 = (None, None, None)
    return Plan(
        mesh={"data": 8},
        inputs=(
            TensorSharding("w", (3, 64, 64), "float32", rep3, "param"),
            TensorSharding("x", (16, 64), "float32", ("data", None), "batch"),
        ),
        outputs=(
            TensorSharding("out/0", (), "float32", (), "other"),
            TensorSharding("out/1", (3, 64, 64), "float32", rep3, "other"),
        ),
        **kw,
    )


def test_lowered_step_api() -> None:
    w, x = _scan_args()
    lowered = lower_plan(_scan_step, _scan_plan(), (w, x))
    assert isinstance(lowered.lower(), jax.stages.Lowered)
    assert isinstance(lowered.compile(), jax.stages.Compiled)
    assert "HloModule" in lowered.hlo_text()
    assert lowered.in_shardings[1].spec == PartitionSpec("data")
    assert lowered.out_shardings[0].spec == PartitionSpec()
    mem = lowered.memory_analysis()
    assert mem.argument_size_in_bytes == 3 * 64 * 64 * 4 + 2 * 64 * 4  # w + x/8 per device
    loss, grad = lowered(w, x)
    want_loss, want_grad = jax.jit(_scan_step)(w, x)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    np.testing.assert_allclose(grad, want_grad, atol=1e-6)


def test_leaf_mismatch_names_the_leaf() -> None:
    w, x = _scan_args()
    plan = _scan_plan()
    bad = dataclasses.replace(
        plan, inputs=(plan.inputs[0], dataclasses.replace(plan.inputs[1], shape=(32, 64)))
    )
    with pytest.raises(LoadPlanError, match=r"input leaf 1 is x \(16, 64\) float32.*\(32, 64\)"):
        lower_plan(_scan_step, bad, (w, x))
    renamed = dataclasses.replace(
        plan, inputs=(dataclasses.replace(plan.inputs[0], path="v"), plan.inputs[1])
    )
    with pytest.raises(LoadPlanError, match=r"input leaf 0 is w"):
        lower_plan(_scan_step, renamed, (w, x))
    with pytest.raises(LoadPlanError, match=r"1 input leaves but the function has 2"):
        lower_plan(_scan_step, dataclasses.replace(plan, inputs=plan.inputs[:1]), (w, x))


def test_refusals() -> None:
    w, x = _scan_args()
    plan = _scan_plan()
    indivisible = dataclasses.replace(
        plan,
        inputs=(dataclasses.replace(plan.inputs[0], spec=("data", None, None)), plan.inputs[1]),
    )
    with pytest.raises(LowerPlanError, match=r"dim 0 of size 3 is split over \('data',\)"):
        lower_plan(_scan_step, indivisible, (w, x))
    unknown_axis = dataclasses.replace(
        plan, inputs=(plan.inputs[0], dataclasses.replace(plan.inputs[1], spec=("tensor", None)))
    )
    with pytest.raises(LowerPlanError, match=r"axis 'tensor', not in the mesh"):
        lower_plan(_scan_step, unknown_axis, (w, x))
    with pytest.raises(LowerPlanError, match=r"remat='full'.*inside the model"):
        lower_plan(_scan_step, dataclasses.replace(plan, remat="full"), (w, x))
    with pytest.raises(LowerPlanError, match=r"2 pipeline stages"):
        lower_plan(
            _scan_step, dataclasses.replace(plan, pipeline=PipelinePlan(((0, 1), (1, 3)))), (w, x)
        )
    constrained = dataclasses.replace(plan, activations=(ActivationConstraint(0, 0, (None,)),))
    with pytest.raises(LowerPlanError, match=r"pass graph="):
        lower_plan(_scan_step, constrained, (w, x))
    # A user who applied remat in the model says so and gets the policy.
    opts = LoweringOptions(extra={"remat": "in_model"})
    lower_plan(_scan_step, dataclasses.replace(plan, remat="selective"), (w, x), options=opts)
    assert remat_policy("selective") is jax.checkpoint_policies.dots_with_no_batch_dims_saveable
    assert remat_policy("none") is None


# ------------------------------------------------------------------------------- constraints


def _loop_reshards(hlo: str) -> list:
    """Collectives inside loops other than the per-layer weight-gradient all-reduce."""
    return [c for c in parse_collectives(hlo) if c.count > 1 and c.kind != "all-reduce"]


def test_activation_constraints_top_level_and_inside_scan() -> None:
    w, x = _scan_args()
    graph = trace(_scan_step, w, x)
    fwd_scan = next(n for n in graph.nodes if n.primitive == "scan" and n.phase == "forward")
    body = fwd_scan.body[0]
    dot = next(n for n in body.nodes if n.primitive == "dot_general")
    top = next(n for n in graph.nodes if n.primitive == "integer_pow")  # y ** 2, [16, 64]
    bad = ActivationConstraint(dot.id, 0, (None, "data"), scope=((fwd_scan.id, 5),), name="bad")
    with pytest.raises(LowerPlanError, match=r"not a loop body"):
        lower_plan(_scan_step, _scan_plan(activations=(bad,)), (w, x), graph=graph)

    plain = lower_plan(_scan_step, _scan_plan(), (w, x), graph=graph)
    assert not _loop_reshards(dump_spmd_hlo(plain))  # pure data parallel: no resharding

    # Shard the hidden dim instead of the batch inside the forward loop body, and the
    # squared output at top level: XLA must reshard in every iteration.
    plan = _scan_plan(
        activations=(
            ActivationConstraint(
                dot.id, 0, (None, "data"), scope=((fwd_scan.id, 0),), name="h/dot"
            ),
            ActivationConstraint(top.id, 0, (None, "data"), name="y2"),
        )
    )
    lowered = lower_plan(_scan_step, plan, (w, x), graph=graph)
    loop = _loop_reshards(dump_spmd_hlo(lowered))
    assert loop and all(c.count == 3 for c in loop)  # once per layer, 3 layers
    assert {c.kind for c in loop} & {"all-to-all", "all-gather"}
    loss, grad = lowered(w, x)
    want_loss, want_grad = jax.jit(_scan_step)(w, x)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    np.testing.assert_allclose(grad, want_grad, atol=PARAM_ATOL)
    off = lower_plan(
        _scan_step, plan, (w, x), graph=graph,
        options=LoweringOptions(activation_constraints=False),
    )  # fmt: skip
    assert not _loop_reshards(dump_spmd_hlo(off))


def test_operand_constraints_choose_how_a_contraction_is_partitioned() -> None:
    """x @ w with the contracted dim split over the mesh: XLA multiplies the local
    shards and all-reduces the partial sums. The plan that reads both operands
    replicated (gather them, then multiply) gets all-gathers and no all-reduce; the
    value itself, and every other reader, keeps its split layout."""

    def f(x, w):
        return jnp.sum(jnp.tanh(x @ w) ** 2) + jnp.sum(x)

    x = jax.random.normal(jax.random.PRNGKey(1), (32, 64), jnp.float32)
    w = jax.random.normal(jax.random.PRNGKey(2), (64, 48), jnp.float32) / 8
    graph = trace(f, x, w)
    dot = next(n for n in graph.nodes if n.primitive == "dot_general")
    plan = Plan(
        mesh={"data": 8},
        inputs=(
            TensorSharding("x", (32, 64), "float32", (None, "data"), "other"),
            TensorSharding("w", (64, 48), "float32", ("data", None), "other"),
        ),
        outputs=(TensorSharding("out", (), "float32", (), "other"),),
    )

    def kinds(p: Plan) -> dict[str, float]:
        lowered = lower_plan(f, p, (x, w), graph=graph)
        np.testing.assert_allclose(lowered(x, w), jax.jit(f)(x, w), rtol=1e-5)
        out: dict[str, float] = {}
        for c in parse_collectives(dump_spmd_hlo(lowered)):
            if c.bytes > 4:  # the scalar sums' all-reduces
                out[c.kind] = out.get(c.kind, 0.0) + c.total_bytes
        return out

    assert kinds(plan) == {"all-reduce": 32 * 48 * 4}  # partial sums of the [32, 48] result
    gathered = dataclasses.replace(
        plan,
        activations=(
            ActivationConstraint(dot.id, 0, (None, None), name="x", operand=0),
            ActivationConstraint(dot.id, 0, (None, None), name="w", operand=1),
        ),
    )
    assert kinds(gathered) == {"all-gather": (32 * 64 + 64 * 48) * 4}  # both, whole
    bad = dataclasses.replace(
        plan, activations=(ActivationConstraint(dot.id, 0, (None,), name="x", operand=5),)
    )
    with pytest.raises(LowerPlanError, match=r"names operand 5, but dot_general has 2 operands"):
        lower_plan(f, bad, (x, w), graph=graph)


def test_operand_constraints_apply_in_order_as_reshard_steps() -> None:
    """Moving axis d from dim 1 to dim 0 while splitting dim 0 further over f: the plan
    prices an all-to-all of the per-device buffer (8*8*8*4 / 2 = 1024 bytes) and a free
    slice. Told step by step (reshard_steps), XLA does exactly that; told only the end
    layout it may replicate the whole tensor instead."""
    from autopar.search.sharding import MeshShape, reshard_steps

    mesh = {"d": 2, "f": 2, "e": 2}
    src, dst = ((), ("d",), ()), (("d", "f"), (), ())
    steps = reshard_steps((8, 8, 8), src, dst, MeshShape.from_mapping(mesh))
    assert steps == ((("d",), (), ()), dst)

    def f(x):
        return jnp.tanh(x)

    x = jnp.arange(512, dtype=jnp.float32).reshape(8, 8, 8) / 512
    graph = trace(f, x)
    (tanh,) = [n for n in graph.nodes if n.primitive == "tanh"]
    plan = Plan(
        mesh=mesh,
        inputs=(TensorSharding("x", (8, 8, 8), "float32", (None, "d", None), "other"),),
        outputs=(TensorSharding("out", (8, 8, 8), "float32", (("d", "f"), None, None), "other"),),
        activations=tuple(
            ActivationConstraint(tanh.id, 0, to_plan_spec(s), name=f"step{i}", operand=0)
            for i, s in enumerate(steps)
        ),
    )
    lowered = lower_plan(f, plan, (x,), graph=graph)
    np.testing.assert_allclose(lowered(x), jnp.tanh(x), rtol=1e-6)
    got = [(c.kind, c.bytes) for c in parse_collectives(dump_spmd_hlo(lowered))]
    assert got == [("all-to-all", 1024.0)]


# ------------------------------------------------------------------------------- ZeRO-3


def test_zero3_gathers_parameters_and_reduce_scatters_gradients() -> None:
    plan, lowered, _ = lowered_case("mlp", "zero3", (8,))
    colls = parse_collectives(dump_spmd_hlo(lowered))
    # tiny MLP 16 -> 64 -> 64 -> 8: weights and biases, float32, by hand.
    param_bytes = (16 * 64 + 64 + 64 * 64 + 64 + 64 * 8 + 8) * 4
    assert all(r.spec != (None,) * len(r.shape) for r in plan.inputs if r.role == "param")
    gathered = sum(c.total_bytes for c in colls if c.kind == "all-gather")
    scattered = sum(c.total_bytes for c in colls if c.kind == "reduce-scatter")
    assert gathered == param_bytes
    assert scattered == param_bytes


# ------------------------------------------------------------------------------- donation


def test_caller_arrays_survive_without_donation() -> None:
    _, lowered, args = lowered_case("mlp", "data_parallel", (8,))
    state, batch = args
    before = jax.tree.map(np.array, (state, batch))
    lowered(state, batch)
    lowered(state, batch)
    for leaf, want in zip(jax.tree.leaves((state, batch)), jax.tree.leaves(before), strict=True):
        assert not leaf.is_deleted()
        np.testing.assert_array_equal(np.asarray(leaf), want)


def test_donating_a_placed_copy_keeps_the_callers_array() -> None:
    step, args, *_ = reference("mlp")
    plan = baselines.data_parallel(step, {"data": 8}, *args)
    lowered = lower_plan(step, plan, args, options=LoweringOptions(donate_argnums=(0,)))
    # Fresh single-device arrays (the cached reference args are shared with other tests).
    state, batch = jax.device_put(jax.tree.map(np.array, args), jax.devices()[0])
    before = jax.tree.map(np.array, state)
    new_state, _ = lowered(state, batch)
    for leaf, want in zip(jax.tree.leaves(state), jax.tree.leaves(before), strict=True):
        assert not leaf.is_deleted()
        np.testing.assert_array_equal(np.asarray(leaf), want)
    # Already laid out as planned: passed through, and then donated as asked.
    placed = lowered.place_inputs((new_state, batch))
    pairs = zip(jax.tree.leaves(placed[0]), jax.tree.leaves(new_state), strict=True)
    assert all(a is b for a, b in pairs)
    lowered(new_state, batch)
    assert all(leaf.is_deleted() for leaf in jax.tree.leaves(new_state))


def test_static_arguments_are_closed_over() -> None:
    w, x = _scan_args()

    def step(w, x, scale):
        loss, grad = _scan_step(w, x)
        return loss * scale, grad

    opts = LoweringOptions(static_argnums=(2,))
    lowered = lower_plan(step, _scan_plan(), (w, x, 2.0), options=opts)
    loss, _ = lowered(w, x, 2.0)
    np.testing.assert_allclose(loss, 2 * jax.jit(_scan_step)(w, x)[0], rtol=1e-5)
    with pytest.raises(LowerPlanError, match=r"static argument 2"):
        lowered(w, x, 3.0)
