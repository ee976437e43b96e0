"""Full rematerialisation per pipeline stage (``autopar.lower.stage_remat``).

Expected values: gradients from single-device ``jax.value_and_grad`` summed over the
microbatches (the pipeline's contract), and stash sizes from the model's shapes (a
recomputed stage keeps the activation it receives: ``[microbatch, features]``).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autopar
from autopar.errors import LowerPlanError
from autopar.lower.pipeline import buffer_slots, cut_stages, make_schedule, pipelined_gradients
from autopar.lower.stage_remat import remat_stages

RTOL = 1e-5  # float32 sums in another order (DESIGN.md's bound)
M = 4


def loss(ws, x):
    for w in ws:
        x = jnp.tanh(x @ w) + 0.1 * x
    return jnp.mean(x**2)


@functools.cache
def _cut():
    ws = [jnp.eye(8) * (k + 2) / 5 + 0.01 * k for k in range(4)]
    x = jnp.linspace(-1.0, 1.0, 4 * M * 8).reshape(4 * M, 8)
    g = autopar.trace(jax.value_and_grad(loss), ws, x[:4])
    return cut_stages(g, [(0, 2), (2, 4)], batch_inputs=[4]), ws, x


def _expected(ws, x):
    total_l, total_g = 0.0, None
    for m in range(M):
        lm, gm = jax.value_and_grad(loss)(ws, x[m::M])
        total_l += lm
        total_g = gm if total_g is None else jax.tree.map(jnp.add, total_g, gm)
    return total_l, total_g


@pytest.mark.parametrize("policies", [("full", "full"), ("none", "full"), ("full", "none")])
@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_recomputed_stages_give_the_same_gradients(policies, schedule):
    cut, ws, x = _cut()
    lean = remat_stages(cut, policies)
    mesh = autopar.lower.make_mesh({"pipe": 2, "data": 4})
    got_l, got_g = jax.jit(pipelined_gradients(lean, schedule, M, mesh))(ws, x)
    want_l, want_g = _expected(ws, x)
    np.testing.assert_allclose(float(got_l), float(want_l), rtol=RTOL)
    for a, b in zip(got_g, want_g, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=RTOL, atol=1e-7)


def test_a_recomputed_stage_stashes_its_input_and_reruns_its_forward():
    cut, _, _ = _cut()
    lean = remat_stages(cut, ("none", "full"))
    # Stage 1 receives one [4, 8] float32 activation; that is all it keeps.
    assert [cut.aval(v).shape for v in lean.forward(1).stash] == [(4, 8)]
    assert lean.forward(0).stash == cut.forward(0).stash  # "none": unchanged
    tanh = lambda pc: sum(e.primitive.name == "tanh" for e in pc.eqns)  # noqa: E731
    assert tanh(lean.backward(1)) == tanh(cut.backward(1)) + 2  # its two layers again
    slots = buffer_slots(lean, make_schedule("1f1b", 2, M))["stash"][1]
    before = buffer_slots(cut, make_schedule("1f1b", 2, M))["stash"][1]
    nbytes = lambda layout: sum(int(np.prod(s)) * d.itemsize for s, d in layout)  # noqa: E731
    assert nbytes(slots) < nbytes(before)


def test_unknown_or_miscounted_policies_are_refused():
    cut, _, _ = _cut()
    with pytest.raises(LowerPlanError, match="not available per pipeline stage"):
        remat_stages(cut, ("none", "selective"))
    with pytest.raises(LowerPlanError, match="one per"):
        remat_stages(cut, ("full",))


# ----------------------------------------------------------------- from the plain step

CLUSTER = "dgx-a100-80gb"
MESH = {"pipe": 2, "data": 4}


@functools.cache
def _gpt():
    from benchmarks.models.gpt import GPTConfig, make_train_step

    cfg = GPTConfig.preset("tiny", precision="fp32", scan_layers=True, layers=4)
    step, args = make_train_step(cfg, 16, abstract=False)
    return step, jax.device_put(args, jax.devices()[0])


def _priced(stage_remat: str, schedule: str = "gpipe"):
    step, args = _gpt()
    plan = autopar.baselines.pipeline(
        step, MESH, *args, microbatches=4, schedule=schedule, stage_remat=stage_remat
    )
    return plan, autopar.evaluate(step, plan, CLUSTER, *args)


def test_remat_stages_cost_a_forward_and_keep_one_activation():
    _, none = _priced("none")
    plan, full = _priced("full")
    assert plan.pipeline.stage_remat == ("full", "full")
    fwd0, fwd1 = none.extra["stage_forward_s"]
    # Each stage's backward gains at most its forward (the loss's reduction over the
    # batch is not re-run: the backward does not read it).
    for s, f in enumerate((fwd0, fwd1)):
        extra = full.extra["stage_backward_s"][s] - none.extra["stage_backward_s"][s]
        assert 0 < extra <= f * (1 + 1e-9)
    assert full.step_time_s > none.step_time_s
    # GPipe holds all 4 microbatches' stashes; with remat (per layer, as Megatron-LM) a
    # stash is its layers' inputs: one [1, 32, 64] float32 residual stream per device
    # (16 rows / 4 microbatches / 4) per layer of the stage (2), and on the last stage
    # also the stack's output, which the head's recomputation starts from. The padded
    # stash slot holds the larger: 3 streams.
    assert full.memory_breakdown["activations"] == 4 * 3 * (1 * 32 * 64 * 4)
    assert full.memory_bytes_per_device < none.memory_bytes_per_device


def test_remat_stages_run_equal_to_single_device_and_use_less_memory():
    from autopar.lower import lower_plan
    from tests.lower._zoo import check_against_single_device

    step, args = _gpt()
    temps = {}
    for remat in ("none", "full"):
        plan, ev = _priced(remat)
        lowered = lower_plan(step, plan, args)
        temps[remat] = lowered.memory_analysis(*args).temp_size_in_bytes
        if remat == "none":
            continue
        check_against_single_device(step, args, lowered)
        # A pipeline that splits: the scanned stack over pipe (each stage its layers).
        assert plan.input("params/h/attn/q/kernel").spec[0] == "pipe"
        report = autopar.verify(
            dataclasses.replace(plan, predicted=ev.to_predicted()), lowered, *args
        )
        assert report.row("collective-permute").status == "ok", report.to_text()
        # The prediction counts one layer's residuals of the stage's scan (recomputed
        # layer by layer) plus the head's re-created in one backward tick; XLA frees them
        # sooner: conservative (measured: 4.45 MB predicted, 3.24 MB compiled, +37%;
        # recomputing the whole stage at once compiled to 3.6 MiB).
        assert report.memory.predicted_bytes >= report.memory.compiled_bytes
    assert temps["full"] < temps["none"] / 2


def test_the_pipeline_search_rematerialises_when_nothing_else_fits():
    step, args = _gpt()
    _, none = _priced("none")
    _, full = _priced("full")
    limit = (none.memory_bytes_per_device + full.memory_bytes_per_device) / 2
    opts = autopar.SearchOptions(
        mesh=MESH, microbatches=4, schedule="gpipe", memory_limit_bytes=limit
    )
    plan = autopar.plan(step, *args, cluster=CLUSTER, options=opts)
    assert set(plan.pipeline.stage_remat) == {"full"}
    assert plan.predicted.memory_bytes_per_device <= limit
    # Below what any plan can reach: the state (parameters, AdamW's two moments, the
    # gradient accumulators: 4 x the 474,112 parameter bytes) split over all 8 devices is
    # 237,056 bytes per device before a single activation.
    state = 4 * full.memory_breakdown["params"]
    too_small = dataclasses.replace(opts, memory_limit_bytes=state / 8 * 0.9)
    with pytest.raises(autopar.InfeasiblePlanError, match="smallest footprint"):
        autopar.plan(step, *args, cluster=CLUSTER, options=too_small)


def test_a_scanned_stage_is_recomputed_layer_by_layer():
    """Megatron-LM's full recomputation: a stage keeps each of its layers' inputs per
    microbatch and its backward scan re-runs one layer's forward per iteration."""
    from autopar.lower.split import gradient_graph, plan_accumulation
    from benchmarks.models.gpt import GPTConfig, make_train_step

    cfg = GPTConfig.preset("tiny", precision="fp32", scan_layers=True, layers=4)
    step, args = make_train_step(cfg, 16, abstract=True)
    acc = plan_accumulation(step, args, M)
    cut = cut_stages(gradient_graph(acc, args), [(0, 2), (2, 4)], batch_inputs=acc.batch_inputs)
    lean = remat_stages(cut, ("full", "full"))
    # A microbatch is 16 / 4 = 4 sequences of 32 tokens, hidden 64: stage 0 keeps its two
    # layers' inputs (the first is the embedding's output), nothing else.
    assert [tuple(lean.aval(v).shape) for v in lean.forward(0).stash] == [(2, 4, 32, 64)]
    # The last stage also keeps the stack's output (the final LayerNorm and head
    # recompute from it).
    assert sorted(tuple(lean.aval(v).shape) for v in lean.forward(1).stash) == [
        (2, 4, 32, 64),
        (4, 32, 64),
    ]
    for s in range(2):
        scans = [e for e in lean.backward(s).eqns if e.primitive.name == "scan"]
        # no forward scan over the stage's layers is re-run whole in the backward piece
        assert [e.params["reverse"] for e in scans] == [True]
        (old,) = [e for e in cut.backward(s).eqns if e.primitive.name == "scan"]
        (fwd,) = [e for e in cut.forward(s).eqns if e.primitive.name == "scan"]
        dots = lambda e: sum(q.primitive.name == "dot_general" for q in e.params["jaxpr"].eqns)  # noqa: E731
        assert dots(scans[0]) == dots(old) + dots(fwd)  # one layer's forward, then backward
    # every residual stack of the forward scans is re-created one layer (of 2) at a time
    stacks = {v for s in range(2) for v in cut.forward(s).stash if lean.layer_recomputed.get(v)}
    assert stacks and set(lean.layer_recomputed.values()) == {2}


@pytest.mark.slow
def test_interleaved_chunks_recomputed_layer_by_layer_equal_single_device():
    """Interleaved 1F1B (2 chunks per device, 2 layers each) with every chunk's layer scan
    recomputed layer by layer runs equal to single-device ``jax.jit``."""
    from autopar.lower import lower_plan
    from benchmarks.models.gpt import GPTConfig, make_train_step
    from tests.lower._zoo import check_against_single_device

    cfg = GPTConfig.preset("tiny", precision="fp32", scan_layers=True, layers=8)
    step, args = make_train_step(cfg, 16, abstract=False)
    args = jax.device_put(args, jax.devices()[0])
    plan = autopar.baselines.pipeline(
        step, MESH, *args, microbatches=4, schedule="interleaved-1f1b", virtual_stages=2,
        stage_remat="full",
    )  # fmt: skip
    assert plan.pipeline.stages == ((0, 2), (2, 4), (4, 6), (6, 8))
    lowered = lower_plan(step, plan, args)
    check_against_single_device(step, args, lowered)
