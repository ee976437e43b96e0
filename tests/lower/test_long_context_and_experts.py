"""Issue 13's long-context and MoE plans, lowered at toy size on the 8 CPU devices.

The zoo GPT with memory-efficient attention (``attention_chunk``) planned on a mesh with
a ``seq`` axis splits the sequence over it; the zoo MoE planned on a mesh with an
``expert`` axis splits its experts over it. Each lowered step equals single-device
``jax.jit`` under ``_zoo.check_against_single_device``'s tolerances (three AdamW steps).
The memory bound is what makes the split pay at this size: the replicated step does not
fit under it (asserted), as the 128k-token and Mixtral-size steps do not fit a GPU.
"""

from __future__ import annotations

import autopar
from autopar import SearchOptions
from benchmarks.models import gpt, moe
from tests.lower._zoo import check_against_single_device


def _replicated_bytes(step, args) -> float:
    one = autopar.plan(step, *args, options=SearchOptions(mesh={"data": 1}))
    return one.predicted.memory_bytes_per_device


def test_long_context_gpt_splits_the_sequence_and_equals_single_device():
    cfg = gpt.GPTConfig.preset("tiny", precision="fp32", seq_len=256, attention_chunk=32)
    step, args = gpt.make_train_step(cfg, 2, abstract=False)
    limit = 3e6
    assert _replicated_bytes(step, args) > 4 * limit
    fn = autopar.autoparallel(
        step, options=SearchOptions(mesh={"data": 2, "seq": 4}, memory_limit_bytes=limit)
    )
    plan = fn.plan_for(*args)
    # The batch splits over data; the activations' sequence dim over seq (the tokens
    # themselves may stay whole along seq: a few int32s each device slices for free).
    assert plan.input("batch/tokens").spec[0] == "data"
    hidden = [a.spec for a in plan.activations if len(a.spec) == 3]
    assert ("data", "seq", None) in hidden, hidden  # [batch, sequence, features]
    assert any(c.axes == ("seq",) for c in plan.predicted.collectives)
    assert plan.predicted.memory_bytes_per_device <= limit
    check_against_single_device(step, args, fn)


def test_moe_splits_the_experts_and_equals_single_device():
    cfg = moe.MoEConfig.preset("tiny", precision="fp32")
    step, args = moe.make_train_step(cfg, 8, abstract=False)
    limit = 4e6
    assert _replicated_bytes(step, args) > 2 * limit
    fn = autopar.autoparallel(
        step, options=SearchOptions(mesh={"expert": 2, "data": 4}, memory_limit_bytes=limit)
    )
    plan = fn.plan_for(*args)
    experts = [r for r in plan.inputs if r.path.startswith("state/params/") and "/moe/w" in r.path]
    assert experts and all(r.spec[0] == "expert" for r in experts)  # [experts, in, out]
    check_against_single_device(step, args, fn)
