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
from jax.sharding import PartitionSpec as P

import autopar
from autopar.errors import LowerPlanError
from autopar.lower.mesh import make_mesh
from autopar.lower.pipeline import (
    StageCut,
    cut_stages,
    make_schedule,
    pipelined_gradients,
    stack_relayout,
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
    """``p`` equal stages (with interleaving, ``p`` is the number of chunks, ``p v``)."""
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


def _check(name: str, layers: int, mesh_name: str, schedule: str, m: int, v: int = 1):
    mesh_shape = MESHES[mesh_name]
    p = mesh_shape["pipe"]
    cut = _cut(name, layers, p * v, m)
    run = pipelined_gradients(cut, schedule, m, make_mesh(mesh_shape), v)
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


# -- interleaved 1F1B ----------------------------------------------------------------------

INTERLEAVED = [(2, 4, 2), (2, 8, 2), (4, 8, 2), (4, 4, 2), (2, 2, 3), (4, 8, 3), (8, 16, 2)]


def _interleaved_warmup(p: int, m: int, v: int, d: int) -> int:
    """Megatron-LM's warm-up chunk-forwards on device ``d`` (all of them when m == p)."""
    return m * v if m == p else min(2 * (p - d - 1) + (v - 1) * p, m * v)


@pytest.mark.parametrize(("p", "m", "v"), INTERLEAVED)
def test_interleaved_schedule_runs_every_chunk_op_once_after_its_inputs(p, m, v):
    s = make_schedule("interleaved-1f1b", p, m, v)
    assert s.virtual_stages == v and s.num_stages == p
    at = {}
    for t, row in enumerate(s.ticks):
        for d, op in enumerate(row):
            if op is not None:
                kind, mb, k = op
                assert k % p == d, f"chunk {k} must run on device {k % p}, not {d}"
                assert op not in at
                at[op] = t
    n = p * v
    assert len(at) == 2 * n * m
    for mb in range(m):
        for k in range(n):
            if k > 0:
                assert at[("F", mb, k)] > at[("F", mb, k - 1)]
            if k < n - 1:
                assert at[("B", mb, k)] > at[("B", mb, k + 1)]
            assert at[("B", mb, k)] > at[("F", mb, k)]
    # microbatches go through each device's chunks in groups of p: device d's forwards of
    # chunk c run microbatches in order, and its first p*v forwards are the first group
    for d in range(p):
        fwd = [op for row in s.ticks if (op := row[d]) is not None and op[0] == "F"]
        for c in range(v):
            mbs = [op[1] for op in fwd if op[2] == c * p + d]
            assert mbs == list(range(m))
        assert [op[1] for op in fwd[: p * v]] == [j % p for j in range(p * v)]
        assert [op[2] // p for op in fwd[: p * v]] == [j // p for j in range(p * v)]


@pytest.mark.parametrize(("p", "m", "v"), INTERLEAVED)
def test_interleaved_schedule_is_the_cost_models_timeline(p, m, v):
    """With equal chunk forward and backward times (v seconds per microbatch and device, so
    1 per chunk op) ``cost_models.simulate_schedule`` starts every op at its tick, so the
    bubble the planner predicts is the program's."""
    from cost_models.pipeline import simulate_schedule

    s = make_schedule("interleaved-1f1b", p, m, v)
    r = simulate_schedule(
        "interleaved-1f1b", [float(v)] * p, [float(v)] * p, m, chunks=v, timeline=True
    )
    sim = {(e.op, e.microbatch, e.chunk * p + e.device): e.start for e in r.timeline}
    got = {(kind, mb, k): float(t) for t, _, kind, mb, k in s.ops()}
    assert got == sim
    assert len(s.ticks) == r.makespan
    # the paper's bubble (p - 1) / (v m), in ticks of 1/v stage-op
    assert (len(s.ticks) - 2 * m * v) / (2 * m * v) == pytest.approx((p - 1) / (v * m))
    assert r.bubble_fraction == pytest.approx((p - 1) / (v * m))
    one = make_schedule("1f1b", p, m)
    assert len(s.ticks) < v * len(one.ticks)  # shorter than 1F1B in the same time unit


@pytest.mark.parametrize(("p", "m", "v"), INTERLEAVED)
def test_interleaved_keeps_warmup_plus_one_chunks_in_flight(p, m, v):
    from cost_models.pipeline import simulate_schedule

    s = make_schedule("interleaved-1f1b", p, m, v)
    r = simulate_schedule("interleaved-1f1b", [float(v)] * p, [float(v)] * p, m, chunks=v)
    for d in range(p):
        live = peak = 0
        for row in s.ticks:
            op = row[d]
            if op is not None:
                live += 1 if op[0] == "F" else -1
                peak = max(peak, live)
        warm = _interleaved_warmup(p, m, v, d)
        assert peak == min(warm + 1, m * v) == r.peak_inflight[d]
    # the first device holds the most; the buffers the runtime allocates are that many
    from autopar.lower.pipeline import _tables

    assert _tables(s).s_slots == min(_interleaved_warmup(p, m, v, 0) + 1, m * v)


def test_interleaved_with_one_chunk_is_1f1b():
    assert make_schedule("interleaved-1f1b", 4, 6).ticks == make_schedule("1f1b", 4, 6).ticks


def test_interleaved_schedule_refuses_bad_sizes():
    with pytest.raises(LowerPlanError, match="multiple of the pipeline size"):
        make_schedule("interleaved-1f1b", 4, 6, 2)
    with pytest.raises(LowerPlanError, match="needs the 'interleaved-1f1b' schedule"):
        make_schedule("1f1b", 2, 4, 2)
    with pytest.raises(LowerPlanError, match=">= 1"):
        make_schedule("interleaved-1f1b", 2, 4, 0)


# -- numerics: MLP -------------------------------------------------------------------------


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize(("mesh_name", "m"), [("pipe2_data4", 4), ("pipe4_data2", 8), ("pipe8", 8)])
def test_mlp_pipeline_matches_single_device(mesh_name, schedule, m):
    _check("mlp", 8, mesh_name, schedule, m)


@pytest.mark.parametrize(
    ("mesh_name", "m", "v"), [("pipe2_data4", 4, 2), ("pipe2_data4", 8, 2), ("pipe4_data2", 8, 2)]
)
def test_mlp_interleaved_pipeline_matches_single_device(mesh_name, m, v):
    _check("mlp", 8, mesh_name, "interleaved-1f1b", m, v)


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


@pytest.mark.parametrize("m", [4, 8])
def test_gpt_interleaved_pipeline_matches_single_device(m):
    _check("gpt_unrolled", 4, "pipe2_data4", "interleaved-1f1b", m, 2)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("layers", "mesh_name", "m", "v"),
    [(8, "pipe2_data4", 4, 2), (8, "pipe2_data4", 8, 4), (8, "pipe4_data2", 8, 2)],
)
def test_gpt_interleaved_pipeline_matches_single_device_more(layers, mesh_name, m, v):
    _check("gpt_unrolled", layers, mesh_name, "interleaved-1f1b", m, v)


def test_gpt_interleaved_pipeline_over_a_scanned_stack_matches_single_device():
    """``v = 2`` over an ``nn.scan`` stack of 4 layers on ``pipe = 2``: chunks of one layer,
    device ``d`` runs chunks ``d`` and ``2 + d``; the loss and every gradient (the stack's
    included, returned split over ``pipe`` like the input) equal single-device."""
    cut, run = _check("gpt_scan", 4, "pipe2_data4", "interleaved-1f1b", 4, 2)
    assert cut.stacked_inputs and len(cut.stacked_outputs) == 16
    for i in cut.stacked_inputs:
        assert run.in_specs[i] == jax.sharding.PartitionSpec("pipe")


@pytest.mark.slow
@pytest.mark.parametrize(
    ("layers", "mesh_name", "m", "v"), [(8, "pipe4_data2", 4, 2), (8, "pipe2_data4", 4, 4)]
)
def test_gpt_interleaved_pipeline_over_a_scanned_stack_more(layers, mesh_name, m, v):
    _check("gpt_scan", layers, mesh_name, "interleaved-1f1b", m, v)


# -- the scanned stack's relayout (interleaved) ----------------------------------------------


@pytest.mark.parametrize(("p", "v"), [(2, 1), (2, 2), (4, 2), (2, 4), (4, 4), (8, 3), (3, 2)])
def test_stack_relayout_moves_each_chunk_once_in_as_few_rounds_as_the_busiest_device(p, v):
    """Chunk ``c`` (caller layout: slot ``c % v`` of device ``c // v``) must end at slot
    ``c // p`` of device ``c % p``. Each round is a partial permutation; the rounds are as
    many as the most chunks one device sends or receives (no device sends more than it
    must)."""
    r = stack_relayout(p, v)
    sent, recv = np.zeros(p, int), np.zeros(p, int)
    for c in range(p * v):
        if c // v != c % p:
            sent[c // v] += 1
            recv[c % p] += 1
    assert len(r.rounds) == max(sent.max(), recv.max())
    moved = []
    for k, pairs in enumerate(r.rounds):
        assert len({a for a, _ in pairs}) == len(pairs) == len({b for _, b in pairs})
        assert all(a != b for a, b in pairs)
        moved += [(a, int(r.send_slot[k, a]), b, int(r.recv_slot[k, b])) for a, b in pairs]
    want = [(c // v, c % v, c % p, c // p) for c in range(p * v) if c // v != c % p]
    assert sorted(moved) == sorted(want)
    for c in range(p * v):  # where each chunk slot is read from
        src = int(r.gather[c % p, c // p])
        if c // v == c % p:
            assert src == c % v
        else:
            k = src - v
            assert (c // v, c % p) in r.rounds[k] and r.send_slot[k, c // v] == c % v


@pytest.mark.parametrize(("p", "v"), [(2, 2), (4, 2), (2, 4), (8, 3)])
def test_stack_relayout_in_the_program_moves_chunks_there_and_back(p, v):
    mesh = make_mesh({"pipe": p, **({"data": 8 // p} if p < 8 else {})})
    r = stack_relayout(p, v)
    n = 2
    x = jnp.arange(p * v * n * 3, dtype=jnp.float32).reshape(p * v * n, 3)

    def there_and_back(x):
        chunks = r.to_chunks(x, "pipe")
        return chunks[None], r.from_chunks(chunks, "pipe")

    run = jax.shard_map(
        there_and_back,
        mesh=mesh,
        in_specs=P("pipe"),
        out_specs=(P("pipe"), P("pipe")),
        axis_names={"pipe"},
        check_vma=False,
    )
    chunks, back = jax.jit(run)(x)
    # device d holds chunks d, p + d, ...: [d, j] is chunk j p + d
    want = np.asarray(x).reshape(v, p, n, 3).transpose(1, 0, 2, 3)
    np.testing.assert_array_equal(np.asarray(chunks), want)
    np.testing.assert_array_equal(np.asarray(back), np.asarray(x))


def test_pipeline_program_describes_an_interleaved_scanned_plan():
    """``pipeline_program`` of an interleaved plan over a scanned stack: the schedule's
    chunk ticks, the padded sends, and the relayout (per round, one chunk of each stacked
    input and output); the plain 1F1B plan has none."""
    from autopar.lower.program import pipeline_program
    from autopar.lower.split import plan_accumulation
    from benchmarks.models.gpt import GPTConfig, make_train_step

    cfg = GPTConfig.preset("tiny", precision="fp32", scan_layers=True, layers=4)
    step, args = make_train_step(cfg, BATCH)
    graph = autopar.trace(step, *args)
    acc = plan_accumulation(step, args, 4, full=graph)
    mesh = {"pipe": 2, "data": 4}
    progs = {}
    for schedule, v in (("1f1b", 1), ("interleaved-1f1b", 2)):
        plan = autopar.baselines.pipeline(
            step, mesh, *args, microbatches=4, schedule=schedule, virtual_stages=v
        )
        progs[v] = pipeline_program(graph, plan, acc)
    one, two = progs[1], progs[2]
    assert one.virtual_stages == 1 and one.relayout_sends == () and one.relayout_bytes == 0.0
    assert two.virtual_stages == 2
    assert two.ticks == len(make_schedule("interleaved-1f1b", 2, 4, 2).ticks)
    assert one.ticks == len(make_schedule("1f1b", 2, 4).ticks)
    assert two.sends == one.sends  # one [microbatch / data, seq, hidden] each way
    stack = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(args[0]["params"]["h"]))
    # one round (each device sends one of its two chunks), params in and gradients back:
    # a quarter of the stack each way
    assert len(two.relayout_sends) == 2 * 16
    assert two.relayout_bytes == pytest.approx(2 * stack / 4)
    assert two.relayout_kind == "collective-permute"
    assert two.stacked_outputs == one.stacked_outputs and len(two.stacked_outputs) == 16


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


def test_interleaved_program_permutes_on_the_pipe_ring():
    """Chunk k feeds chunk k + 1 on device d + 1, and device p - 1 feeds device 0's next
    chunk: two collective-permutes per tick, a ring over ``pipe`` each way (the
    non-interleaved program has no wrap-around)."""
    import re

    mesh = make_mesh(MESHES["pipe4_data2"])
    _, ws, batch = _mlp(8)
    ids = np.vectorize(lambda d: d.id)(mesh.devices)  # [pipe, data]
    ring = {(int(ids[s, c]), int(ids[(s + 1) % 4, c])) for s in range(4) for c in range(2)}
    back = {(b, a) for a, b in ring}
    for v, schedule, want in ((2, "interleaved-1f1b", [ring, back]), (1, "1f1b", None)):
        run = pipelined_gradients(_cut("mlp", 8, 4 * v, 4), schedule, 4, mesh, v)
        hlo = jax.jit(run).lower(ws, batch).compile().as_text()
        got = [
            {tuple(int(x) for x in pr) for pr in re.findall(r"\{(\d+),(\d+)\}", m)}
            for m in re.findall(r"collective-permute\(.*source_target_pairs=\{(.*?\})\}", hlo)
        ]
        if want is not None:
            assert sorted(got, key=sorted) == sorted(want, key=sorted)
        else:  # the plain 1F1B program: the chain without the wrap-around
            assert got and all(g < ring | back and len(g) == 6 for g in got)


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


def test_cut_rejects_bad_ranges_and_pads_uneven_scans():
    loss, params, batch = _gpt(True, 4)
    micro = jax.tree.map(lambda x: x[:4], batch)
    graph = autopar.trace(jax.value_and_grad(loss), params, micro)
    with pytest.raises(LowerPlanError, match="contiguous"):
        cut_stages(graph, [(0, 2), (3, 4)])
    with pytest.raises(LowerPlanError, match="must stop at 4"):
        cut_stages(graph, [(0, 2), (2, 3)])
    # An uneven split of the scanned stack (1 + 3 layers): both stages hold 3 slots, the
    # stack's leaves come whole (not split over pipe) and the stages take their layers.
    cut = cut_stages(graph, [(0, 1), (1, 4)])
    assert cut.stacked_inputs == () and cut.stacked_outputs == ()
    assert len(cut.uneven_stacks) == 2 * 16  # every leaf of the block, in and out
    assert set(cut.uneven_stacks.values()) == {((0, 1), (1, 3))}


def test_pipeline_rejects_mesh_mismatch():
    cut = _cut("mlp", 8, 2, 4)
    with pytest.raises(LowerPlanError, match="2 stages"):
        pipelined_gradients(cut, "gpipe", 4, make_mesh({"pipe": 4, "data": 2}))
    with pytest.raises(LowerPlanError, match="no 'pipe' axis"):
        pipelined_gradients(cut, "gpipe", 4, make_mesh({"data": 8}))
    with pytest.raises(LowerPlanError, match="virtual_stages"):
        pipelined_gradients(cut, "gpipe", 4, make_mesh({"pipe": 2, "data": 4}), 2)
    cut4 = _cut("mlp", 8, 4, 4)
    with pytest.raises(LowerPlanError, match="needs the 'interleaved-1f1b' schedule"):
        pipelined_gradients(cut4, "1f1b", 4, make_mesh({"pipe": 2, "data": 4}), 2)
    with pytest.raises(LowerPlanError, match="multiple of the pipeline size"):
        pipelined_gradients(cut4, "interleaved-1f1b", 3, make_mesh({"pipe": 2, "data": 4}), 2)


def test_pipeline_rejects_a_batch_that_is_not_m_microbatches():
    cut = _cut("mlp", 8, 2, 4)  # traced on microbatches of BATCH // 4 rows
    run = pipelined_gradients(cut, "gpipe", 2, make_mesh({"pipe": 2, "data": 4}))
    _, ws, batch = _mlp(8)
    with pytest.raises(LowerPlanError, match="one microbatch"):
        run(ws, batch)


# -- the plain step: an interleaved plan lowered ---------------------------------------------


@functools.cache
def _gpt_step(layers: int = 4):
    from benchmarks.models.gpt import GPTConfig, make_train_step

    cfg = GPTConfig.preset("tiny", precision="fp32", scan_layers=False, layers=layers)
    step, args = make_train_step(cfg, BATCH, abstract=False)
    return step, jax.device_put(args, jax.devices()[0])


def test_interleaved_step_from_split_equals_single_device():
    """The plain step split at its gradients (``lower/split.py``), G cut into ``p v = 4``
    chunk ranges and run interleaved on ``pipe = 2``, the update applied once: the new
    state and loss equal single-device ``jax.jit(step)``."""
    from autopar.lower.split import pipelined_function, plan_accumulation

    step, (state, batch) = _gpt_step()
    mesh = make_mesh({"pipe": 2, "data": 4})
    acc = plan_accumulation(step, (state, batch), 4)
    ranges = tuple((k, k + 1) for k in range(4))
    run = pipelined_function(acc, (state, batch), ranges, "interleaved-1f1b", mesh, 2)
    assert run.cut.num_stages == 4
    flat, tree = jax.tree.flatten((state, batch))
    out = jax.jit(run)(*[np.asarray(x) for x in flat])  # uncommitted: placed by jit
    got = jax.tree.unflatten(jax.tree.structure(jax.eval_shape(step, state, batch)), out)
    want = jax.jit(step)(state, batch)
    assert float(got[1]) == pytest.approx(float(want[1]), rel=LOSS_RTOL)
    worst = max(
        float(np.abs(np.asarray(g, np.float64) - np.asarray(w)).max())
        for g, w in zip(jax.tree.leaves(got[0]), jax.tree.leaves(want[0]), strict=True)
    )
    # AdamW's first step moves each parameter by ~lr * sign(g): equal up to entries
    # whose gradient is ~0, where sign flips on rounding; a lost microbatch moves all
    assert worst <= 2e-3, f"state diff {worst}"


def test_interleaved_plan_from_the_plain_step_equals_single_device():
    """``autopar.baselines.pipeline``'s 1F1B plan edited to interleaved 1F1B (``chunks=2``,
    ``stages`` = the ``p v`` chunk ranges) and lowered with ``lower_plan``: the step's loss
    equals single-device ``jax.jit(step)`` (DESIGN.md's float32 bound)."""
    import dataclasses

    step, (state, batch) = _gpt_step()
    mesh = {"pipe": 2, "data": 4}
    plan = autopar.baselines.pipeline(step, mesh, state, batch, microbatches=4, schedule="1f1b")
    pp = dataclasses.replace(
        plan.pipeline,
        schedule="interleaved-1f1b",
        chunks=2,
        stages=tuple((k, k + 1) for k in range(4)),
    )
    plan = dataclasses.replace(plan, pipeline=pp)
    lowered = autopar.lower.lower_plan(step, plan, (state, batch))
    _, want = jax.jit(step)(state, batch)
    new_state, got = lowered(state, batch)
    assert float(got) == pytest.approx(float(want), rel=LOSS_RTOL)
    hlo = lowered.compile(state, batch).as_text()
    assert "collective-permute" in hlo
    assert jax.tree.structure(new_state) == jax.tree.structure(state)
