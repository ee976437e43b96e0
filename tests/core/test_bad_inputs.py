"""Every bad input raises an :class:`AutoparError` subclass saying what was wrong and what
to do (or, where the step can still run, warns and runs it).

Each test asserts the error class and the key words of the message: the offending value
or path, and the way out the message offers.
"""

from __future__ import annotations

import json
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autopar
from autopar.errors import (
    AutoparError,
    BindArgumentsError,
    InfeasiblePlanError,
    InvalidOptionError,
    LoadPlanError,
    LowerPlanError,
    ReplicatedControlFlowWarning,
    SolverTimeLimitWarning,
    TraceFunctionError,
    UnknownPresetError,
    UnknownPrimitiveWarning,
)
from autopar.plan import Plan
from cost_models import Cluster

MESH = {"data": 8}


def _loss(w, x):
    return jnp.mean(jnp.tanh(x @ w) ** 2)


def step(w, x):
    loss, g = jax.value_and_grad(_loss)(w, x)
    return w - 0.1 * g, loss


W = jnp.full((32, 6), 0.1, jnp.float32)  # 6: no mesh axis of 8 divides it
X = jnp.linspace(-1.0, 1.0, 64 * 32, dtype=jnp.float32).reshape(64, 32)


def _decorate(fn, **kwargs):
    kwargs.setdefault("options", autopar.SearchOptions(mesh=MESH))
    kwargs.setdefault("cluster", "cpu-sim")
    return autopar.autoparallel(fn, cache=False, **kwargs)


# ------------------------------------------------------------------- arguments, tracing


def test_a_string_where_an_array_belongs():
    with pytest.raises(
        TraceFunctionError, match=r"argument leaf w is of type str \('weights'\)"
    ) as e:
        _decorate(step)("weights", X)
    assert "jnp.asarray" in str(e.value) and "static_argnums" in str(e.value)


def test_an_object_deep_in_a_pytree_is_named_by_its_path():
    with pytest.raises(TraceFunctionError, match=r"argument leaf x/mask is of type object"):
        _decorate(lambda w, x: step(w, x["data"]))(W, {"data": X, "mask": object()})


def test_a_function_that_fails_to_trace():
    def wrong_shapes(w, x):
        return (w @ x).sum()  # (32, 6) @ (64, 32)

    with pytest.raises(TraceFunctionError, match=r"tracing .*wrong_shapes failed with TypeError"):
        _decorate(wrong_shapes)(W, X)
    with pytest.raises(TraceFunctionError, match=r"jax\.eval_shape\(fn, \*args\) reproduces it"):
        _decorate(wrong_shapes)(W, X)


def test_python_control_flow_on_a_traced_value():
    def branchy(w, x):
        if x.sum() > 0:  # a traced value in a Python `if`
            return w
        return -w

    with pytest.raises(TraceFunctionError, match=r"TracerBoolConversionError") as e:
        _decorate(branchy)(W, X)
    assert isinstance(e.value.__cause__, jax.errors.TracerBoolConversionError)


def test_an_unexpected_keyword():
    with pytest.raises(BindArgumentsError, match=r"unexpected keyword argument 'z'") as e:
        _decorate(step)(W, X, z=X)
    assert isinstance(e.value, TypeError)  # what jax.jit raises, for `except TypeError`
    assert "as you would call the function itself" in str(e.value)


def test_a_missing_argument_by_keyword():
    with pytest.raises(BindArgumentsError, match=r"missing a required argument: 'x'"):
        _decorate(step)(w=W)


def test_an_unhashable_static_argument():
    def scaled(w, x, factors):
        return step(w * sum(factors), x)

    f = _decorate(scaled, static_argnums=2)
    with pytest.raises(BindArgumentsError, match=r"static arguments must be hashable") as e:
        f(W, X, [1.0, 2.0])
    assert "Pass tuples instead of lists" in str(e.value)
    _, loss = f(W, X, (1.0, 2.0))  # the way out works
    np.testing.assert_allclose(
        float(loss), float(jax.jit(scaled, static_argnums=2)(W, X, (1.0, 2.0))[1]), rtol=1e-5
    )


def test_static_argnames_that_are_not_parameters():
    with pytest.raises(InvalidOptionError, match=r"static_argnames=\['n'\] names \['n'\]"):
        autopar.autoparallel(step, static_argnames="n")
    with pytest.raises(InvalidOptionError, match=r"donate_argnums=\(-1,\)"):
        autopar.autoparallel(step, donate_argnums=-1)


# --------------------------------------------------------------------------- primitives


def test_an_unknown_primitive_runs_replicated_with_a_warning_naming_it():
    def with_callback(w, x):
        host = jax.pure_callback(np.tanh, jax.ShapeDtypeStruct(x.shape, x.dtype), x)
        return step(w, host)

    f = _decorate(with_callback)
    with pytest.warns(UnknownPrimitiveWarning, match=r"no sharding rule for pure_callback \(x1\)"):
        new_w, loss = f(W, X)
    want_w, want_loss = jax.jit(with_callback)(W, X)
    np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(new_w), np.asarray(want_w), rtol=1e-5, atol=1e-6)


def test_known_primitives_do_not_warn():
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnknownPrimitiveWarning)
        _decorate(step)(W, X)


def test_a_branch_over_arrays_warns_that_it_runs_replicated():
    """``lax.cond`` on activations (and a loop over them) has no sharding rule: the
    warning names it; the values stay those of ``jax.jit``. A cond on scalars alone (a
    learning-rate switch) is whole anyway and does not warn."""

    def branchy(w, x, flag):
        h = jax.lax.cond(flag, lambda h: h * 1.5, lambda h: h, x)
        return step(w, h)

    f = _decorate(branchy)
    flag = jnp.bool_(True)
    with pytest.warns(ReplicatedControlFlowWarning, match=r"\(cond \(x1\)\).*jnp.where"):
        new_w, loss = f(W, X, flag)
    want_w, want_loss = jax.jit(branchy)(W, X, flag)
    np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(new_w), np.asarray(want_w), rtol=1e-5, atol=1e-6)

    def scalar_switch(w, x, flag):
        new_w, loss = step(w, x)
        lr = jax.lax.cond(flag, lambda: 1.0, lambda: 0.5)
        return w + lr * (new_w - w), loss

    with warnings.catch_warnings():
        warnings.simplefilter("error", ReplicatedControlFlowWarning)
        _decorate(scalar_switch)(W, X, flag)


# ------------------------------------------------------------------ memory and clusters


def test_a_memory_limit_nothing_fits():
    f = _decorate(step, options=autopar.SearchOptions(mesh=MESH, memory_limit_bytes=1024))
    with pytest.raises(
        InfeasiblePlanError, match=r"no plan fits the memory bound of 1024 bytes"
    ) as e:
        f(W, X)
    assert "a larger memory_limit_bytes" in str(e.value)
    assert e.value.bound_bytes == 1024 and e.value.smallest_bytes > 1024


def test_a_cluster_of_other_size_than_the_local_devices_is_refused_before_tracing():
    traced = []

    def counting(w, x):
        traced.append(1)
        return step(w, x)

    two_nodes = Cluster.preset("dgx-a100-80gb", nodes=2)
    f = autopar.autoparallel(counting, cluster=two_nodes, cache=False)
    with pytest.raises(InvalidOptionError, match=r"has 16 devices but JAX sees 8") as e:
        f(W, X)
    assert "autopar.plan(...)" in str(e.value) and "cluster=None" in str(e.value)
    assert not traced  # refused before tracing or searching
    # Planning alone for that cluster is fine.
    assert autopar.plan(step, W, X, cluster=two_nodes).num_devices == 16


def test_impossible_mesh_and_cluster_numbers():
    with pytest.raises(
        InvalidOptionError, match=r"mesh \{'data': 16\} has 16 devices but JAX sees 8"
    ):
        _decorate(step, options=autopar.SearchOptions(mesh={"data": 16}))(W, X)
    with pytest.raises(InvalidOptionError, match=r"mesh axis 'data' has size 0"):
        autopar.SearchOptions(mesh={"data": 0})
    with pytest.raises(InvalidOptionError, match=r"cluster=8 must be a cost_models.Cluster"):
        _decorate(step, cluster=8)(W, X)
    with pytest.raises(UnknownPresetError, match=r"unknown cluster preset 'dgx-z900'; known: "):
        _decorate(step, cluster="dgx-z900")(W, X)
    # A cluster described with impossible numbers, before autopar sees it: the cost models'
    # error is an AutoparError too (and still a ValueError).
    for bad in ({"nodes": 0}, {"nodes": 2.5}, {"nodes": -1}):
        with pytest.raises(AutoparError, match=r"nodes must be an integer") as e:
            Cluster.preset("dgx-h100", **bad)
        assert isinstance(e.value, ValueError)


def test_a_solver_out_of_time_returns_its_best_plan_with_a_warning():
    from benchmarks.models import gpt

    gstep, (state, batch) = gpt.make_train_step(gpt.GPTConfig.preset("tiny"), 8, abstract=True)
    options = autopar.SearchOptions(mesh={"data": 2, "tensor": 4}, solver_time_limit_s=1e-3)
    with pytest.warns(SolverTimeLimitWarning, match=r"time limit of 0.001 s") as rec:
        plan = autopar.plan(gstep, state, batch, cluster="dgx-a100-80gb", options=options)
    assert "solver_time_limit_s" in str(rec[0].message)
    assert plan.mesh == {"data": 2, "tensor": 4} and plan.predicted.step_time_s > 0


# ---------------------------------------------------------------------------- plan JSON


@pytest.fixture(scope="module")
def plan_json() -> dict:
    return json.loads(_decorate(step).plan_for(W, X).to_json())


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("{not json", "plan is not valid JSON"),
        ("[1, 2]", "plan JSON must be an object"),
        ('"plan"', "got a str"),
        ('{"schema_version": 99}', "plan schema version 99 is not supported"),
    ],
    ids=["garbage", "list", "string", "wrong-version"],
)
def test_malformed_or_wrong_version_plan_json(text, words, tmp_path):
    with pytest.raises(LoadPlanError, match=words):
        Plan.from_json(text)
    path = tmp_path / "plan.json"
    path.write_text(text)
    with pytest.raises(LoadPlanError, match=words):
        autopar.autoparallel(step, plan=str(path))


def _edited(d: dict, path: str, value) -> dict:
    d = json.loads(json.dumps(d))
    keys = path.split(".")
    target = d
    for k in keys[:-1]:
        target = target[int(k)] if k.isdigit() else target[k]
    if value is _DELETE:
        del target[keys[-1]]
    else:
        target[keys[-1] if not keys[-1].isdigit() else int(keys[-1])] = value
    return d


_DELETE = object()


@pytest.mark.parametrize(
    ("path", "value", "error", "words"),
    [
        ("mesh", {"data": "eight"}, LoadPlanError, r"malformed: its mesh is \{'data': 'eight'\}"),
        ("inputs.0.shape", _DELETE, LoadPlanError, r"malformed \(KeyError: 'shape'\)"),
        ("inputs.0.spec", 5, LoadPlanError, r"malformed \(TypeError"),
        ("inputs.0.spec", ["bogus"], LowerPlanError, r"uses axis 'bogus', not in the mesh"),
        ("inputs.1.spec", ["data", "data"], LowerPlanError, r"uses a mesh axis twice"),
        ("inputs.1.spec", ["data", None, None], LowerPlanError, r"3 entries for a rank-2 tensor"),
        (
            "inputs.0.spec",
            [None, "data"],
            LowerPlanError,
            r"dim 1 of size 6 is split over \('data',\)",
        ),
        ("mesh", {"data": 3}, LowerPlanError, r"needs 3 devices but 8 are available"),
        ("remat", "sometimes", LowerPlanError, r"remat='sometimes' is unknown"),
    ],
    ids=[
        "mesh-size-text",
        "no-shape",
        "spec-int",
        "unknown-axis",
        "axis-twice",
        "rank",
        "indivisible",
        "mesh-devices",
        "remat",
    ],
)
def test_hand_broken_plan_json(plan_json, path, value, error, words):
    d = _edited(plan_json, path, value)
    with pytest.raises(error, match=words):
        _decorate(step, plan=Plan.from_json(json.dumps(d)))(W, X)


def test_a_plan_for_another_signature(plan_json, tmp_path):
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan_json))
    f = autopar.autoparallel(step, plan=str(path), cache=False)
    with pytest.raises(
        LoadPlanError, match=r"input 1 is x \(128, 32\) float32 but the plan has x \(64, 32\)"
    ) as e:
        f(W, jnp.ones((128, 32)))
    assert "re-plan for this signature" in str(e.value)
    with pytest.raises(
        LoadPlanError, match=r"made for a function with 2 input leaves, this call has 1"
    ):
        autopar.autoparallel(lambda x: step(W, x), plan=str(path), cache=False)(X)


def test_every_error_above_is_an_autopar_error():
    for cls in (
        BindArgumentsError,
        InfeasiblePlanError,
        InvalidOptionError,
        LoadPlanError,
        LowerPlanError,
        TraceFunctionError,
        UnknownPresetError,
    ):
        assert issubclass(cls, AutoparError)
