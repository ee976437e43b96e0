"""autopar.checkpoint: a sharded train state saved under one plan comes back bit for bit
under the same plan, another plan on fewer devices (the elastic case), a lowered step or
explicit shardings; a save killed midway leaves the previous step readable.

The step is an MLP (256 -> 1024 -> 256, batch 64) whose searched 8-device plan splits the
weights over ``tensor``; expected values are the saved arrays themselves (bitwise) and, for
the continued run, the 8-device run's losses (``LOSS_RTOL``).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import numpy as np
import pytest

import autopar
from autopar import checkpoint
from autopar.checkpoint import RestoreCheckpointError, SaveCheckpointError
from autopar.lower import lower_plan
from autopar.lower.mesh import make_mesh
from autopar.plan import idle_axes, spec_axes
from benchmarks.models import mlp
from cost_models import Cluster

LOSS_RTOL = 1e-5  # DESIGN.md: loss to 1e-5 relative in f32
ROOT = Path(__file__).resolve().parents[2]


def _split(plan) -> dict[str, list[str]]:
    """``{axis: [input paths it splits]}``."""
    out: dict[str, list[str]] = {}
    for r in plan.inputs:
        for a in spec_axes(r.spec):
            out.setdefault(a, []).append(r.path)
    return out


def _assert_same_values(got, want) -> None:
    """Same pytree, every leaf bit for bit."""
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert g.shape == w.shape and g.dtype == w.dtype
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def _assert_laid_out(tree, target) -> None:
    """Every leaf of ``tree`` has the sharding of ``target``'s (ShapeDtypeStruct) leaf."""
    for x, t in zip(jax.tree.leaves(tree), jax.tree.leaves(target), strict=True):
        assert x.sharding.is_equivalent_to(t.sharding, x.ndim), (x.sharding, t.sharding)


@pytest.fixture(scope="module")
def run():
    """The 8-device decorated step after one step: (step, batch, train_step, plan, state1)."""
    step, (state, batch) = mlp.make_train_step(
        mlp.MLPConfig(d_in=256, hidden=1024, d_out=256, layers=2), 64, abstract=False
    )
    train_step = autopar.autoparallel(step, cluster="cpu-sim", cache=False)
    plan = train_step.plan_for(state, batch)
    state1, _ = train_step(state, batch)
    return step, batch, train_step, plan, state1


def test_save_and_restore_under_the_same_plan(run, tmp_path):
    step, batch, train_step, plan, state1 = run
    # The plan really shards the state: tensor splits the weights (Megatron-style).
    split = _split(plan)
    assert "state/params/layer_0/w" in split.get("tensor", []), split
    assert "tensor" not in idle_axes(plan)
    w = state1["params"]["layer_0"]["w"]
    assert not w.sharding.is_fully_replicated and w.sharding.num_devices == 8

    path = checkpoint.save(tmp_path, state1, plan, step=1)
    assert path == tmp_path / "1" and checkpoint.steps(tmp_path) == (1,)
    assert checkpoint.saved_plan(tmp_path) == plan

    back = checkpoint.restore(tmp_path, plan)
    _assert_same_values(back, state1)
    _assert_laid_out(back, checkpoint.shardings(plan))
    # The same from the lowered step, and from a plan read back from JSON (with like=).
    lowered = train_step.lower(state1, batch)
    _assert_laid_out(checkpoint.restore(tmp_path, lowered), lowered.abstract_args[0])
    loaded = autopar.Plan.from_json(plan.to_json())
    back = checkpoint.restore(tmp_path, loaded, like=state1)
    _assert_same_values(back, state1)
    _assert_laid_out(back, checkpoint.shardings(plan))
    # The next step runs from the restored state as from the saved one.
    np.testing.assert_array_equal(train_step(back, batch)[1], train_step(state1, batch)[1])


def test_restore_into_a_four_device_plan_and_continue(run, tmp_path):
    """The elastic case: saved on 8 devices, a node lost, re-planned for 4, continued."""
    step, batch, train_step, plan8, state1 = run
    checkpoint.save(tmp_path, state1, plan8, step=1)

    four = jax.devices()[:4]
    abstract = jax.eval_shape(lambda s: s, state1)
    plan4 = autopar.plan(step, abstract, batch, cluster=Cluster.local(four))
    assert plan4.num_devices == 4 and plan4.mesh != plan8.mesh
    assert set(_split(plan4)) - set(idle_axes(plan4)), "the 4-device plan shards nothing"

    state4 = checkpoint.restore(tmp_path, plan4, devices=four)
    _assert_same_values(state4, state1)
    _assert_laid_out(state4, checkpoint.shardings(plan4, devices=four))
    assert {d for x in jax.tree.leaves(state4) for d in x.sharding.device_set} == set(four)

    # Continue 2 steps on the 4 devices; the 8-device job continuing gives the same losses.
    mesh4 = make_mesh(plan4.mesh, four)
    graph = autopar.trace(step, abstract, batch)
    lowered4 = lower_plan(step, plan4, (abstract, batch), graph=graph, mesh=mesh4)
    got, want, s4, s8 = [], [], state4, state1
    for _ in range(2):
        s4, loss4 = lowered4(s4, batch)
        s8, loss8 = train_step(s8, batch)
        got.append(float(loss4))
        want.append(float(loss8))
    np.testing.assert_allclose(got, want, rtol=LOSS_RTOL)


def test_restore_into_explicit_shardings(run, tmp_path):
    _, _, _, _, state1 = run
    checkpoint.save(tmp_path, state1, step=0)
    assert checkpoint.saved_plan(tmp_path) is None
    mesh = make_mesh({"a": 2, "b": 4})
    rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("b"))
    target = jax.tree.map(
        lambda x: rows if x.ndim and x.shape[0] % 4 == 0 else rows.update(spec=()), state1
    )
    back = checkpoint.restore(tmp_path, target, like=state1)
    _assert_same_values(back, state1)
    assert back["params"]["layer_0"]["w"].sharding.spec == jax.sharding.PartitionSpec("b")


def test_keep_only_the_newest_steps(tmp_path):
    for k in range(4):
        checkpoint.save(tmp_path, {"k": np.full((4,), k, np.int32)}, step=10 * k, keep=2)
    assert checkpoint.steps(tmp_path) == (20, 30) and checkpoint.latest_step(tmp_path) == 30
    like = {"k": np.zeros((4,), np.int32)}
    target = {"k": jax.sharding.SingleDeviceSharding(jax.devices()[0])}
    assert (np.asarray(checkpoint.restore(tmp_path, target, like=like)["k"]) == 3).all()


def test_bad_input_is_explained(run, tmp_path):
    _, batch, _, plan, state1 = run
    with pytest.raises(SaveCheckpointError, match="not an array"):
        checkpoint.save(tmp_path, {"w": state1["params"]["layer_0"]["w"], "tag": "v1"}, step=0)
    with pytest.raises(SaveCheckpointError, match="step=-1"):
        checkpoint.save(tmp_path, state1, step=-1)
    with pytest.raises(RestoreCheckpointError, match="no committed checkpoint"):
        checkpoint.restore(tmp_path / "missing", plan)
    checkpoint.save(tmp_path, state1, step=2)
    with pytest.raises(SaveCheckpointError, match="step 2 exists already"):
        checkpoint.save(tmp_path, state1, step=2)
    with pytest.raises(RestoreCheckpointError, match="its steps are \\[2\\]"):
        checkpoint.restore(tmp_path, plan, step=1)
    with pytest.raises(RestoreCheckpointError, match="does not fit the target"):
        checkpoint.restore(tmp_path, plan, arg="batch")  # the batch is not what was saved
    with pytest.raises(RestoreCheckpointError, match="pass like=state"):
        checkpoint.restore(tmp_path, autopar.Plan.from_json(plan.to_json()))
    with pytest.raises(RestoreCheckpointError, match="no argument named 'params'"):
        checkpoint.restore(tmp_path, plan, arg="params")


_KILLED_SAVE = """
import os, signal, sys
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from autopar import checkpoint
from autopar.lower.mesh import make_mesh
from orbax.checkpoint._src.path import atomicity

directory = sys.argv[1]
mesh = make_mesh({"data": 2})

def state(k):
    w = jax.device_put(np.full((512, 256), k, np.float32), NamedSharding(mesh, P("data")))
    return {"w": w, "step": np.int32(k)}

checkpoint.save(directory, state(1), step=1)

def die(self, *a, **k):  # the data of step 2 is written, its commit (the rename) is next
    os.kill(os.getpid(), signal.SIGKILL)

atomicity.AtomicRenameTemporaryPath.finalize = die
atomicity.CommitFileTemporaryPath.finalize = die
checkpoint.save(directory, state(2), step=2)
print("not killed")
"""


def test_a_save_killed_midway_leaves_the_previous_step_readable(tmp_path):
    env = dict(
        os.environ,
        XLA_FLAGS="--xla_force_host_platform_device_count=2",
        JAX_PLATFORMS="cpu",
    )
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_KILLED_SAVE), str(tmp_path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stdout + proc.stderr[-3000:]
    leftovers = sorted(p.name for p in tmp_path.iterdir())
    assert any(n.startswith("2.") and "tmp" in n for n in leftovers), leftovers  # step 2's data
    assert checkpoint.steps(tmp_path) == (1,) and checkpoint.latest_step(tmp_path) == 1

    like = {"w": jax.ShapeDtypeStruct((512, 256), np.float32), "step": np.int32(0)}
    replicated = jax.sharding.NamedSharding(make_mesh({"data": 8}), jax.sharding.PartitionSpec())
    target = jax.tree.map(lambda _: replicated, like)
    back = checkpoint.restore(tmp_path, target, like=like)
    assert (np.asarray(back["w"]) == 1).all() and int(back["step"]) == 1

    # The job restarts and saves step 2 again over the leftovers.
    w = np.full((512, 256), 2, np.float32)
    checkpoint.save(tmp_path, {"w": w, "step": np.int32(2)}, step=2)
    assert checkpoint.steps(tmp_path) == (1, 2)
    assert (np.asarray(checkpoint.restore(tmp_path, target, like=like)["w"]) == 2).all()
