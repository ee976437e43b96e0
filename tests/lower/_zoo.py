"""Shared helpers of the lowering tests: tiny zoo steps, meshes, baseline plans, tolerances.

Tolerances (written once, never loosened to make a test pass):

* ``LOSS_RTOL = 1e-5``: DESIGN.md's bound for float32, applied to each step's loss
  computed *from the same input state* (the single-device run's state before that step):
  the sharded program sums the same numbers in another order (per-shard partial sums,
  then an all-reduce), so the loss differs by a few float32 ulps (2**-24 ~ 6e-8) per
  reduction level, far below 1e-5. Comparing free-running losses after several steps
  would measure the training run's sensitivity instead: on one fixed batch the tiny
  Wide-ResNet's AdamW run moves its step-3 loss by up to 2e-5 relative when its initial
  weights change by one ulp, on a single device (measured over 8 perturbed runs), because
  AdamW's first step turns the rounding noise of an exactly-zero gradient into a full
  ``lr`` step. The free-running state is still compared, with the tolerances below.
* ``PARAM_ATOL = 1e-5``: after ``STEPS`` AdamW steps each parameter differs by (a) the
  rounding of ``p - lr * (u + wd * p)``, about one ulp of ``|p|`` per step (|p| < 4 in the
  tiny models: 4.8e-7 per step), plus (b) ``lr * |du|`` where ``u = m_hat / (sqrt(v_hat) +
  eps)`` changes by ``~ du/u ~ dg/|g|`` ~ 1e-6 for gradients well above their rounding
  noise ``dg``: 1e-3 * 1e-6 per step. Three steps: ~1.5e-6 + 3e-9, within 1e-5.
* ``PARAM_FLIP_ATOL = 2 * LR * STEPS``: an entry whose gradient is at the rounding level
  (``|g| <~ dg``) may flip the sign of AdamW's sign-like update ``lr * g / (|g| + eps)``,
  moving by up to ``2 lr`` per step. Such entries are allowed up to this bound, but must
  be rare: at most ``MAX_FLIP_FRACTION`` of a model's parameters (exactly-zero gradients,
  e.g. unused embedding rows, are zero in both programs and never flip).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from autopar import baselines

LR = 1e-3  # the zoo's default AdamW learning rate
STEPS = 3
LOSS_RTOL = 1e-5
PARAM_ATOL = 1e-5
PARAM_FLIP_ATOL = 2 * LR * STEPS
MAX_FLIP_FRACTION = 1e-3
BATCH = 8

# Mesh shape -> axis names. Plans that need a "tensor" axis take the variant with one.
MESH_NAMES: dict[tuple[int, ...], tuple[str, ...]] = {
    (8,): ("data",),
    (2, 4): ("data", "tensor"),
    (4, 2): ("data", "tensor"),
    (2, 2, 2): ("data", "fsdp", "tensor"),
}


def mesh_for(shape: tuple[int, ...], plan: str) -> dict[str, int]:
    names = MESH_NAMES[shape]
    if plan == "megatron" and names == ("data",):
        names = ("tensor",)
    if plan == "expert_parallel":
        names = names[:-1] + ("expert",)
    return dict(zip(names, shape, strict=True))


def make_plan(plan: str, step: Callable, mesh: dict[str, int], args: tuple) -> Any:
    if plan == "data_parallel":
        return baselines.data_parallel(step, mesh, *args)
    if plan == "zero3":
        tensor = "tensor" if "tensor" in mesh else None
        return baselines.zero(step, mesh, 3, *args, tensor_axis=tensor)
    if plan == "zero1":
        return baselines.zero(step, mesh, 1, *args)
    if plan == "megatron":
        return baselines.megatron(step, mesh, *args)
    if plan == "data_tensor":
        return baselines.data_tensor(step, mesh, *args)
    if plan == "expert_parallel":
        return baselines.expert_parallel(step, mesh, *args)
    raise ValueError(plan)


def zoo_step(model: str, abstract: bool = False) -> tuple[Callable, tuple]:
    """A tiny fp32 zoo train step and its (concrete) arguments."""
    if model == "mlp":
        from benchmarks.models.mlp import MLPConfig, make_train_step

        return make_train_step(MLPConfig.preset("tiny"), BATCH, abstract=abstract)
    if model in ("gpt_scan", "gpt_unrolled"):
        from benchmarks.models.gpt import GPTConfig, make_train_step

        cfg = GPTConfig.preset("tiny", precision="fp32", scan_layers=model == "gpt_scan")
        return make_train_step(cfg, BATCH, abstract=abstract)
    if model == "moe":
        from benchmarks.models.moe import MoEConfig, make_train_step

        return make_train_step(MoEConfig.preset("tiny", precision="fp32"), BATCH, abstract=abstract)
    if model == "wide_resnet":
        from benchmarks.models.wide_resnet import WideResNetConfig, make_train_step

        cfg = WideResNetConfig.preset("tiny", precision="fp32")
        return make_train_step(cfg, BATCH, abstract=abstract)
    raise ValueError(model)


def run_steps(fn: Callable, state: Any, batch: Any, steps: int = STEPS) -> tuple[Any, list[float]]:
    losses = []
    for _ in range(steps):
        state, loss = fn(state, batch)
        losses.append(float(loss))
    return state, losses


@functools.cache
def zoo_args(model: str) -> tuple[Callable, tuple]:
    """The step and concrete arguments on device 0 (built once per model)."""
    step, args = zoo_step(model)
    return step, jax.device_put(args, jax.devices()[0])


@functools.cache
def reference(model: str) -> tuple[Callable, tuple, Any, list[float], list[Any]]:
    """Single-device ``jax.jit`` run: (step, args, final state as numpy, losses, and the
    state each step started from, as numpy)."""
    step, args = zoo_args(model)
    state, batch = args
    jitted = jax.jit(step)
    losses, starts = [], []
    for _ in range(STEPS):
        starts.append(jax.tree.map(np.asarray, state))
        state, loss = jitted(state, batch)
        losses.append(float(loss))
    return step, args, jax.tree.map(np.asarray, state), losses, starts


def check_against_single_device(step: Callable, args: tuple, lowered: Callable) -> None:
    """``lowered`` against single-device ``jax.jit(step)`` for :data:`STEPS` steps: each
    step's loss from the reference's state before it (``LOSS_RTOL``), then the free-running
    state after all of them (:func:`compare_params`)."""
    state, batch = args
    jitted = jax.jit(step)
    want, starts, losses = state, [], []
    for _ in range(STEPS):
        starts.append(want)
        want, loss = jitted(want, batch)
        losses.append(float(loss))
    got_losses = [float(lowered(s, batch)[1]) for s in starts]
    np.testing.assert_allclose(got_losses, losses, rtol=LOSS_RTOL)
    got = state
    for _ in range(STEPS):
        got, _ = lowered(got, batch)
    compare_params(got, want)


def compare_params(got: Any, want: Any) -> tuple[float, float]:
    """Assert the tolerance contract; return (max |diff|, fraction above PARAM_ATOL)."""
    got_l, want_l = jax.tree.leaves(got), jax.tree.leaves(want)
    assert len(got_l) == len(want_l)
    worst, above, total = 0.0, 0, 0
    for g, w in zip(got_l, want_l, strict=True):
        d = np.abs(np.asarray(g, np.float64) - np.asarray(w, np.float64))
        worst = max(worst, float(d.max(initial=0.0)))
        above += int((d > PARAM_ATOL).sum())
        total += d.size
    frac = above / max(total, 1)
    assert worst <= PARAM_FLIP_ATOL + PARAM_ATOL, f"param diff {worst} > sign-flip bound"
    assert frac <= MAX_FLIP_FRACTION, f"{frac:.2%} of params differ by > {PARAM_ATOL}"
    return worst, frac


@functools.cache
def lowered_case(model: str, plan_name: str, shape: tuple[int, ...]) -> tuple[Any, Any, tuple]:
    """(plan, LoweredStep, concrete args) for one case, shared by the test modules."""
    from autopar.lower import lower_plan

    step, args = zoo_args(model)
    plan = make_plan(plan_name, step, mesh_for(shape, plan_name), args)
    return plan, lower_plan(step, plan, args), args


@functools.cache
def heavy_head_gpt(scan: bool, abstract: bool = True) -> tuple[Callable, tuple]:
    """A 6-layer tiny fp32 GPT whose 16384-word head outweighs a layer (batch 16): the
    model whose pipeline stages split best unevenly. ``abstract=False``: concrete
    arguments on the first device."""
    from benchmarks.models.gpt import GPTConfig, make_train_step

    cfg = GPTConfig.preset("tiny", precision="fp32", layers=6, vocab_size=16384, scan_layers=scan)
    step, args = make_train_step(cfg, 16, abstract=abstract)
    if not abstract:
        args = jax.device_put(args, jax.devices()[0])
    return step, args
