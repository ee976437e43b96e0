"""The lowered, sharded step computes what single-device ``jax.jit`` computes.

Every zoo model (tiny, float32) under every baseline plan on meshes (8,), (2,4), (4,2) and
(2,2,2), three AdamW steps: each step's loss (from the single-device run's state before
that step) to ``LOSS_RTOL`` and the free-running new state within the parameter
tolerances derived in ``_zoo.py``. A representative subset runs by default; the
full cross product is ``-m slow``.
"""

from __future__ import annotations

import itertools

import jax
import numpy as np
import pytest

from tests.lower._zoo import (
    LOSS_RTOL,
    compare_params,
    lowered_case,
    reference,
    run_steps,
)

MODELS = ("mlp", "gpt_scan", "gpt_unrolled", "moe", "wide_resnet")
PLANS = ("data_parallel", "zero3", "megatron", "data_tensor")
MESHES = ((8,), (2, 4), (4, 2), (2, 2, 2))

# Every plan and mesh at least once, on the models that compile in seconds; MoE and
# Wide-ResNet take 20-60 s each (compile time on 2 shared cores) and run with -m slow.
DEFAULT = (
    ("mlp", "data_parallel", (8,)),
    ("mlp", "zero3", (8,)),
    ("gpt_scan", "megatron", (2, 4)),
    ("gpt_scan", "zero3", (2, 2, 2)),
    ("gpt_unrolled", "data_tensor", (4, 2)),
)


def _cases():
    for model, plan, mesh in itertools.product(MODELS, PLANS, MESHES):
        if plan == "data_tensor" and len(mesh) == 1:
            continue  # needs a data and a tensor axis
        case = (model, plan, mesh)
        marks = () if case in DEFAULT else (pytest.mark.slow,)
        yield pytest.param(*case, marks=marks, id=f"{model}-{plan}-{'x'.join(map(str, mesh))}")
    yield pytest.param("moe", "expert_parallel", (2, 4), marks=pytest.mark.slow, id="moe-ep-2x4")


def _check(model: str, plan_name: str, shape: tuple[int, ...]) -> None:
    _, _, want_state, want_losses, starts = reference(model)
    _, lowered, args = lowered_case(model, plan_name, shape)
    batch = args[1]
    # Each step's loss from the state the single-device run started that step from.
    step_losses = [float(lowered(start, batch)[1]) for start in starts]
    np.testing.assert_allclose(step_losses, want_losses, rtol=LOSS_RTOL)
    # Free-running steps: the whole new state within the parameter tolerances.
    got_state, _ = run_steps(lowered, *args)
    compare_params(got_state, want_state)
    # The outputs come back laid out as planned (the next step takes them as they are).
    for leaf, sharding in zip(
        jax.tree.leaves(got_state), jax.tree.leaves(lowered.out_shardings[0]), strict=True
    ):
        assert leaf.sharding.is_equivalent_to(sharding, leaf.ndim)


@pytest.mark.parametrize("model,plan_name,shape", list(_cases()))
def test_matches_single_device(model: str, plan_name: str, shape: tuple[int, ...]) -> None:
    _check(model, plan_name, shape)
