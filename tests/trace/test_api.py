"""trace(): arguments, errors, paths, roles and phases on small hand-written functions."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from autopar.errors import TraceFunctionError
from autopar.trace import Graph, trace

f32 = jnp.float32


def _sds(*shape, dtype=f32):
    return jax.ShapeDtypeStruct(shape, dtype)


def _loss(params, x):
    h = jnp.tanh(x @ params["w1"])
    return jnp.mean((h @ params["w2"]) ** 2)


PARAMS = {"w1": _sds(4, 8), "w2": _sds(8, 2)}
X = _sds(16, 4)


def _sgd(params, x):
    loss, grads = jax.value_and_grad(_loss)(params, x)
    return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), loss


def test_public_entry_point_forwards_to_trace():
    # autopar.trace is the subpackage made callable, so the name works whether or not a
    # later import of a submodule rebinds it.
    import autopar.trace.flops  # noqa: F401  (would rebind a plain function attribute)

    g = autopar.trace(_loss, PARAMS, X)
    assert isinstance(g, Graph) and len(g) == len(trace(_loss, PARAMS, X))


def test_abstract_and_concrete_arguments_give_the_same_graph():
    concrete = {"w1": np.ones((4, 8), np.float32), "w2": np.ones((8, 2), np.float32)}
    a = trace(_sgd, PARAMS, X)
    b = trace(_sgd, concrete, np.ones((16, 4), np.float32))
    assert [n.primitive for n in a] == [n.primitive for n in b]
    assert a.total_flops == b.total_flops
    assert [(i.path, i.role, i.output_index) for i in a.inputs] == [
        (i.path, i.role, i.output_index) for i in b.inputs
    ]


def test_paths_use_parameter_names_and_kwargs():
    def step(state, batch, *, scale):
        return state["params"]["w"] * batch["x"].sum() * scale

    g = trace(step, {"params": {"w": _sds(3)}}, {"x": _sds(2, 3)}, scale=_sds())
    assert [i.path for i in g.inputs] == ["state/params/w", "batch/x", "scale"]
    assert [i.index for i in g.inputs] == [0, 1, 2]
    assert [o.path for o in g.outputs] == ["out"]
    assert g.in_tree == jax.tree.structure((({"params": {"w": 0}}, {"x": 0}), {"scale": 0}))


def test_bad_inputs_raise_trace_function_error():
    with pytest.raises(TraceFunctionError, match="callable"):
        trace("not a function", X)
    with pytest.raises(TraceFunctionError, match="batch.*str"):
        trace(lambda x, batch: x, X, {"name": "oops"})

    def broken(x):
        return x @ jnp.ones((5, 5))  # shape mismatch: (16, 4) @ (5, 5)

    with pytest.raises(TraceFunctionError, match="broken") as info:
        trace(broken, X)
    assert isinstance(info.value.__cause__, TypeError)


def test_plain_sgd_step_phases_and_roles():
    g = trace(_sgd, PARAMS, X)
    phases = [n.phase for n in g]
    # program order: forward, then backward, then the update
    first_bwd, last_bwd = phases.index("backward"), len(phases) - 1 - phases[::-1].index("backward")
    assert set(phases[:first_bwd]) == {"forward"}
    assert set(phases[first_bwd : last_bwd + 1]) == {"backward"}
    # p - 0.1 * g: one mul and one sub per parameter
    assert sorted(n.primitive for n in g if n.phase == "optimizer") == ["mul", "mul", "sub", "sub"]
    roles = {i.path: (i.role, i.output_index) for i in g.inputs}
    assert roles == {"params/w1": ("param", 0), "params/w2": ("param", 1), "x": ("batch", None)}
    assert g.outputs[0].path == "out/0/w1"
    # forward matmuls 2*16*4*8 + 2*16*8*2; backward: dW2, dh, dW1 (x is not differentiated)
    fwd = 2 * 16 * 4 * 8 + 2 * 16 * 8 * 2
    bwd = 2 * 16 * 8 * 2 * 2 + 2 * 16 * 4 * 8
    mm = {ph: sum(n.flops for n in g if n.primitive == "dot_general" and n.phase == ph)
          for ph in ("forward", "backward")}  # fmt: skip
    assert mm == {"forward": fwd, "backward": bwd}


def test_lone_array_parameters_are_paired_by_data_flow():
    def step(w, x):
        loss, g = jax.value_and_grad(lambda w: jnp.mean(jnp.tanh(x @ w) ** 2))(w)
        return w - 0.1 * g, loss

    g = trace(step, _sds(4, 8), X)
    assert [(i.path, i.role, i.output_index) for i in g.inputs] == [
        ("w", "param", 0),
        ("x", "batch", None),
    ]


def test_gradient_outputs_mark_parameters():
    g = trace(jax.grad(_loss), PARAMS, X)
    assert {i.path: (i.role, i.output_index) for i in g.inputs} == {
        "params/w1": ("param", None),
        "params/w2": ("param", None),
        "x": ("batch", None),
    }


def test_forward_only_function():
    g = trace(_loss, PARAMS, X)
    assert {n.phase for n in g} == {"forward"}
    roles = {i.path: i.role for i in g.inputs}
    assert roles == {"params/w1": "other", "params/w2": "other", "x": "batch"}


def test_optax_state_is_opt_state():
    tx = optax.adam(1e-3)
    opt = jax.eval_shape(tx.init, PARAMS)

    def step(params, opt_state, x):
        loss, grads = jax.value_and_grad(_loss)(params, x)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    g = trace(step, PARAMS, opt, X)
    by_role: dict[str, list[str]] = {}
    for i in g.inputs:
        by_role.setdefault(i.role, []).append(i.path)
        if i.role in ("param", "opt_state"):
            # the updated value sits at the same place in the output tree
            out = g.outputs[i.output_index].path
            assert out.split("/")[2:] == i.path.split("/")[1:], (i.path, out)
    assert by_role["param"] == ["params/w1", "params/w2"]
    assert len(by_role["opt_state"]) == 5  # count, mu x2, nu x2
    assert by_role["batch"] == ["x"]
    # Adam's step counter update runs after the backward pass: optimizer, not forward
    count_out = next(o for o in g.outputs if o.path.endswith("count"))
    assert g.nodes[g.producer[count_out.value]].phase == "optimizer"


def test_gradient_accumulation_loop_splits_phases():
    def step(params, xs):
        def body(acc, x):
            return jax.tree.map(jnp.add, acc, jax.grad(_loss)(params, x)), None

        zeros = jax.tree.map(jnp.zeros_like, params)
        grads, _ = jax.lax.scan(body, zeros, xs)
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)

    g = trace(step, PARAMS, _sds(3, 16, 4))
    by_phase = g.flops_by_phase()
    fwd = 3 * (2 * 16 * 4 * 8 + 2 * 16 * 8 * 2)
    assert by_phase["backward"] > 1.5 * fwd
    assert by_phase["forward"] >= fwd
    scan = next(n for n in g if n.primitive == "scan")
    assert {n.phase for n in scan.body[0]} >= {"forward", "backward"}


def test_accumulation_loop_gives_parameters_and_an_optimizer_phase():
    """A step that accumulates gradients with ``lax.scan`` over microbatches, then runs
    Adam: its top-level equations carry no transform in their names (the gradients are
    taken inside the loop), yet the weights are parameters, Adam's moments optimizer
    state, and the update after the loop is the optimizer phase."""
    tx = optax.adam(1e-3)
    params = {"w1": jnp.ones((4, 8)), "w2": jnp.ones((8, 2))}
    opt = tx.init(params)

    def step(weights, opt_state, xs):
        def body(acc, x):
            return jax.tree.map(jnp.add, acc, jax.grad(_loss)(weights, x)), None

        grads, _ = jax.lax.scan(body, jax.tree.map(jnp.zeros_like, weights), xs)
        updates, opt_state = tx.update(grads, opt_state, weights)
        return optax.apply_updates(weights, updates), opt_state

    g = trace(step, params, opt, _sds(3, 16, 4))
    roles = {gi.path: gi.role for gi in g.inputs}
    assert roles["weights/w1"] == roles["weights/w2"] == "param"
    assert {r for p, r in roles.items() if p.startswith("opt_state/") and "mu" in p} == {
        "opt_state"
    }
    after = [n for n in g if n.id > next(n.id for n in g if n.primitive == "scan")]
    assert any(n.phase == "optimizer" for n in after)


def test_summary_is_text():
    g = trace(_sgd, PARAMS, X)
    text = g.summary()
    for word in ("forward", "backward", "optimizer", "param", "batch", "parameters: 48"):
        assert word in text, word
    assert "\x1b[" not in text  # no terminal escape codes
