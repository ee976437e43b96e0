"""The pipeline runtime (``autopar.lower.pipeline``): cut, schedules, numerics, placement.

Tolerances (written once, never loosened to make a test pass). The pipelined program
returns the *sum* over ``M`` microbatches of ``G``'s outputs; the reference is one
single-device ``jax.jit(jax.value_and_grad(loss))`` over the whole batch, and the
pipelined sums divided by ``M`` must match it (the losses are means, so the mean of the
microbatch means is the full-batch mean, whatever rows each microbatch holds):

* ``LOSS_RTOL = 1e-5``: DESIGN.md's float32 bound. The two programs add the same per-token
  losses in another order (per microbatch, then over microbatches; the data axis splits
  each microbatch again), a few float32 ulps (2**-24 ~ 6e-8 relative) per reduction level.
* ``GRAD_ATOL = 1e-5``: a gradient entry is a sum of per-token products; reordering that
  sum changes it by ~ulp(|partial sums|) per level. The tiny models' gradients are below
  ~1 in magnitude (measured max |g| ~ 0.3 for the GPT, ~0.5 for the MLP), so the error is
  ~1e-7; 1e-5 leaves two orders of magnitude for the longer sums of 8 microbatches and
  for the data-axis all-reduce, and is still far below any real bug (a lost or doubled
  microbatch moves gradients by their own size, ~1e-2).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autopar
from autopar.errors import LowerPlanError
from autopar.lower.mesh import make_mesh
from autopar.lower.pipeline import (
    StageCut,
    cut_stages,
    make_schedule,
    pipelined_gradients,
)

LOSS_RTOL = 1e-5
GRAD_ATOL = 1e-5
BATCH = 16

MESHES: dict[str, dict[str, int]] = {
    "pipe2_data4": {"pipe": 2, "data": 4},
    "pipe4_data2": {"pipe": 4, "data": 2},
    "pipe8": {"pipe": 8},
}


# -- models --------------------------------------------------------------------------------


def _mlp_loss(ws, batch):
    x = batch["x"]
    for w in ws:
        x = jnp.tanh(x @ w["w"] + w["b"])
    return jnp.mean((x - batch["y"]) ** 2)


@functools.cache
def _mlp(layers: int):
    keys = jax.random.split(jax.random.PRNGKey(0), layers + 2)
    ws = [
        {"w": jax.random.normal(keys[k], (16, 16)) / 4, "b": jnp.full((16,), 0.01 * k)}
        for k in range(layers)
    ]
    batch = {
        "x": jax.random.normal(keys[-2], (BATCH, 16)),
        "y": jax.random.normal(keys[-1], (BATCH, 16)),
    }
    return _mlp_loss, ws, batch


@functools.cache
def _gpt(scan: bool, layers: int):
    from benchmarks.models.gpt import GPTConfig, loss_fn, make_train_step

    cfg = GPTConfig.preset("tiny", precision="fp32", scan_layers=scan, layers=layers)
    _, (state, batch) = make_train_step(cfg, BATCH, abstract=False)
    return functools.partial(loss_fn, cfg), state["params"], batch


def _model(name: str, layers: int):
    if name == "mlp":
        return _mlp(layers)
    return _gpt(name == "gpt_scan", layers)


@functools.cache
def _cut(name: str, layers: int, p: int, m: int) -> StageCut:
    loss, params, batch = _model(name, layers)
    micro = jax.tree.map(lambda x: x[: BATCH // m], batch)
    graph = autopar.trace(jax.value_and_grad(loss), params, micro)
    assert len(graph.layers) == layers
    per = layers // p
    return cut_stages(graph, [(s * per, (s + 1) * per) for s in range(p)])


@functools.cache
def _reference(name: str, layers: int):
    loss, params, batch = _model(name, layers)
    dev = jax.devices()[0]
    value, grads = jax.jit(jax.value_and_grad(loss))(
        jax.device_put(params, dev), jax.device_put(batch, dev)
    )
    return float(value), jax.tree.map(np.asarray, grads)


def _check(name: str, layers: int, mesh_name: str, schedule: str, m: int):
    mesh_shape = MESHES[mesh_name]
    p = mesh_shape["pipe"]
    cut = _cut(name, layers, p, m)
    run = pipelined_gradients(cut, schedule, m, make_mesh(mesh_shape))
    _, params, batch = _model(name, layers)
    loss_sum, grads_sum = jax.jit(run)(params, batch)
    want_loss, want_grads = _reference(name, layers)
    got_loss = float(loss_sum) / m
    assert got_loss == pytest.approx(want_loss, rel=LOSS_RTOL)
    worst = 0.0
    for g, w in zip(jax.tree.leaves(grads_sum), jax.tree.leaves(want_grads), strict=True):
        d = np.abs(np.asarray(g, np.float64) / m - w)
        worst = max(worst, float(d.max()))
    assert worst <= GRAD_ATOL, f"grad diff {worst}"
    return cut, run


# -- schedules -----------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize(("p", "m"), [(2, 4), (4, 8), (8, 8), (4, 2)])
def test_schedule_runs_every_op_once_after_its_inputs(name, p, m):
    s = make_schedule(name, p, m)
    at = {}
    for t, row in enumerate(s.ticks):
        for stage, op in enumerate(row):
            if op is not None:
                assert (op, stage) not in at
                at[(op, stage)] = t
    assert len(at) == 2 * p * m
    for mb in range(m):
        for st in range(p):
            if st > 0:
                assert at[(("F", mb), st)] > at[(("F", mb), st - 1)]
            if st < p - 1:
                assert at[(("B", mb), st)] > at[(("B", mb), st + 1)]
            assert at[(("B", mb), st)] > at[(("F", mb), st)]


@pytest.mark.parametrize(("p", "m"), [(2, 4), (4, 8), (8, 8)])
def test_1f1b_keeps_at_most_p_minus_s_microbatches_in_flight(p, m):
    s = make_schedule("1f1b", p, m)
    gpipe = make_schedule("gpipe", p, m)
    for sched, bound in ((s, lambda st: p - st), (gpipe, lambda st: m)):
        for st in range(p):
            live = peak = 0
            for row in sched.ticks:
                op = row[st]
                if op is not None:
                    live += 1 if op[0] == "F" else -1
                    peak = max(peak, live)
            assert peak == min(bound(st), m)
    # 1F1B is as short as GPipe with equal forward/backward ticks: 2(M + p - 1)
    assert len(s.ticks) == len(gpipe.ticks) == 2 * (m + p - 1)


def test_schedule_rejects_unknown_names():
    with pytest.raises(LowerPlanError, match="not supported"):
        make_schedule("zero-bubble", 2, 4)


# -- numerics: MLP -------------------------------------------------------------------------


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize(("mesh_name", "m"), [("pipe2_data4", 4), ("pipe4_data2", 8), ("pipe8", 8)])
def test_mlp_pipeline_matches_single_device(mesh_name, schedule, m):
    _check("mlp", 8, mesh_name, schedule, m)


# -- numerics: zoo GPT ---------------------------------------------------------------------

GPT_FAST = [
    ("gpt_scan", 4, "pipe2_data4", "gpipe", 4),
    ("gpt_scan", 4, "pipe2_data4", "1f1b", 8),
    ("gpt_scan", 4, "pipe4_data2", "1f1b", 4),
    ("gpt_unrolled", 4, "pipe2_data4", "1f1b", 4),
    ("gpt_unrolled", 4, "pipe4_data2", "gpipe", 8),
]
GPT_SLOW = [
    ("gpt_scan", 4, "pipe4_data2", "gpipe", 8),
    ("gpt_unrolled", 4, "pipe2_data4", "gpipe", 8),
    ("gpt_unrolled", 4, "pipe4_data2", "1f1b", 4),
    ("gpt_scan", 8, "pipe8", "1f1b", 8),
    ("gpt_scan", 8, "pipe8", "gpipe", 4),
    ("gpt_unrolled", 8, "pipe8", "1f1b", 8),
    ("gpt_unrolled", 8, "pipe8", "gpipe", 4),
]


@pytest.mark.parametrize(("name", "layers", "mesh_name", "schedule", "m"), GPT_FAST)
def test_gpt_pipeline_matches_single_device(name, layers, mesh_name, schedule, m):
    _check(name, layers, mesh_name, schedule, m)


@pytest.mark.slow
@pytest.mark.parametrize(("name", "layers", "mesh_name", "schedule", "m"), GPT_SLOW)
def test_gpt_pipeline_matches_single_device_more_meshes(name, layers, mesh_name, schedule, m):
    _check(name, layers, mesh_name, schedule, m)


# -- what the program does -----------------------------------------------------------------


def _pipe_pairs(mesh) -> set[tuple[int, int]]:
    """Device-id pairs of neighbouring stages along ``pipe`` (either direction)."""
    devs = np.moveaxis(np.vectorize(lambda d: d.id)(mesh.devices), 0, -1).reshape(
        -1, mesh.shape["pipe"]
    )
    out = set()
    for row in devs:
        for a, b in zip(row[:-1], row[1:], strict=True):
            out |= {(int(a), int(b)), (int(b), int(a))}
    return out


def test_compiled_program_permutes_over_pipe_and_keeps_stage_params_local():
    cut = _cut("gpt_scan", 4, 2, 4)
    mesh = make_mesh(MESHES["pipe2_data4"])
    run = pipelined_gradients(cut, "1f1b", 4, mesh)
    _, params, batch = _model("gpt_scan", 4)
    flat = jax.tree.leaves((params, batch))
    shardings = run.input_shardings()
    placed = [jax.device_put(x, s) for x, s in zip(flat, shardings, strict=True)]
    args = jax.tree.unflatten(jax.tree.structure((params, batch)), placed)

    # the scanned block's stacked parameters live only on their stage's devices
    stacked = [flat[i] for i in cut.stacked_inputs]
    assert len(stacked) == 16  # every leaf of the scanned block
    pipe_of = {d.id: i for i, row in enumerate(mesh.devices) for d in row.flat}
    for i in cut.stacked_inputs:
        full = np.asarray(flat[i])
        for shard in placed[i].addressable_shards:
            stage = pipe_of[shard.device.id]
            assert shard.data.shape[0] == full.shape[0] // 2
            np.testing.assert_array_equal(np.asarray(shard.data), full[2 * stage : 2 * stage + 2])

    compiled = jax.jit(run).lower(*args).compile()
    in_specs = [s.spec for s in jax.tree.leaves(compiled.input_shardings)]
    for i in cut.stacked_inputs:
        assert in_specs[i][0] == "pipe", in_specs[i]
    hlo = compiled.as_text()
    permutes = [ln for ln in hlo.splitlines() if "collective-permute" in ln and "pairs" in ln]
    assert permutes, "no collective-permute in the compiled pipeline"
    pairs = _pipe_pairs(mesh)
    for ln in permutes:
        got = {
            tuple(int(x) for x in pr.split(","))
            for pr in ln.split("source_target_pairs={")[1].split("}")[0].strip("{").split("},{")
        }
        assert got <= pairs, f"permute outside pipe neighbours: {got}"
    loss_sum, _ = compiled(*args)
    assert float(loss_sum) / 4 == pytest.approx(_reference("gpt_scan", 4)[0], rel=LOSS_RTOL)


def test_cut_places_embedding_on_first_and_head_on_last_stage():
    cut = _cut("gpt_unrolled", 4, 2, 4)
    first, last = cut.forward(0), cut.forward(1)
    f0 = {str(e.source_info.name_stack) for e in first.eqns}
    f1 = {str(e.source_info.name_stack) for e in last.eqns}
    assert any("wte" in n for n in f0) and any("h_1" in n for n in f0)
    assert any("ln_f" in n for n in f1) and not any("h_1" in n for n in f1)
    assert any("h_0" in n for n in {str(e.source_info.name_stack) for e in cut.backward(0).eqns})
    # one activation crosses each boundary forward, one cotangent backward: the tied
    # embedding's gradient is accumulated on both stages (not sent from the head's stage)
    assert len(first.send) == 1 and first.send[0].aval.shape == (4, 32, 64)
    assert len(cut.backward(1).send) == 1 and cut.backward(1).send[0].aval.shape == (4, 32, 64)
    wte = [
        i
        for i, pc_ in enumerate(cut.pieces)
        for o, _ in pc_.outputs
        if o == len(cut.jaxpr.jaxpr.outvars) - 1
    ]
    assert sorted(wte) == [2, 3]  # B1 (head) and B0 (embedding) both hold a part
    assert "stage 0" in cut.describe()


def test_scanned_cut_shards_the_stack_and_keeps_residuals_local():
    cut = _cut("gpt_scan", 4, 2, 4)
    assert len(cut.stacked_outputs) == 16
    for pc in cut.pieces:
        scans = [e for e in pc.eqns if e.primitive.name == "scan"]
        assert len(scans) == 1 and scans[0].params["length"] == 2
    # the forward scan's stacked residuals are stashed on their stage, as local slices
    local = [v for v in cut.forward(0).stash if cut.aval(v) is not v.aval]
    assert local
    for v in local:
        assert cut.aval(v).shape == (2, *v.aval.shape[1:])


# -- errors --------------------------------------------------------------------------------


def test_cut_rejects_bad_ranges_and_uneven_scans():
    loss, params, batch = _gpt(True, 4)
    micro = jax.tree.map(lambda x: x[:4], batch)
    graph = autopar.trace(jax.value_and_grad(loss), params, micro)
    with pytest.raises(LowerPlanError, match="contiguous"):
        cut_stages(graph, [(0, 2), (3, 4)])
    with pytest.raises(LowerPlanError, match="must stop at 4"):
        cut_stages(graph, [(0, 2), (2, 3)])
    with pytest.raises(LowerPlanError, match="split evenly"):
        cut_stages(graph, [(0, 1), (1, 4)])


def test_pipeline_rejects_mesh_mismatch():
    cut = _cut("mlp", 8, 2, 4)
    with pytest.raises(LowerPlanError, match="2 stages"):
        pipelined_gradients(cut, "gpipe", 4, make_mesh({"pipe": 4, "data": 2}))
    with pytest.raises(LowerPlanError, match="no 'pipe' axis"):
        pipelined_gradients(cut, "gpipe", 4, make_mesh({"data": 8}))
    with pytest.raises(LowerPlanError, match="virtual_stages"):
        pipelined_gradients(cut, "gpipe", 4, make_mesh({"pipe": 2, "data": 4}), 2)


def test_pipeline_rejects_a_batch_that_is_not_m_microbatches():
    cut = _cut("mlp", 8, 2, 4)  # traced on microbatches of BATCH // 4 rows
    run = pipelined_gradients(cut, "gpipe", 2, make_mesh({"pipe": 2, "data": 4}))
    _, ws, batch = _mlp(8)
    with pytest.raises(LowerPlanError, match="one microbatch"):
        run(ws, batch)
