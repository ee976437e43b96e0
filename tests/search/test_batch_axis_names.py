"""Axes named by what they do (issue 15, item 6): a microbatched GPT on a fixed mesh
``{"data": 2, "tensor": 4}`` whose search splits the batch over both axes. ``tensor``
then splits only the batch: it is data parallelism whatever its name, and since a mesh
the user fixed keeps its names (and only one axis can be ``data``), the summary says so.
"""

from __future__ import annotations

import functools

import autopar
from autopar.options import SearchOptions
from autopar.plan import Plan, TensorSharding
from autopar.search.to_plan import batch_only_axes
from benchmarks.models import gpt


@functools.cache
def _plan() -> Plan:
    cfg = gpt.GPTConfig(vocab_size=1024, seq_len=128, hidden=256, layers=2, heads=4)
    step, args = gpt.make_train_step(cfg, 64)
    options = SearchOptions(microbatches=2, mesh={"data": 2, "tensor": 4})
    return autopar.plan(step, *args, cluster="dgx-a100-80gb", options=options)


def test_an_axis_splitting_only_the_batch_is_reported_as_data_parallel():
    plan = _plan()
    assert plan.mesh == {"data": 2, "tensor": 4}
    assert plan.pipeline is not None and plan.pipeline.microbatches == 2
    # The premise: 64 sequences over 8 devices, over both axes; no weight split.
    assert plan.input("batch/tokens").spec == (("data", "tensor"), None)
    assert not any(r.spec != (None,) * len(r.shape) for r in plan.inputs if r.role == "param")
    assert batch_only_axes(plan) == ("data", "tensor")
    # 64 sequences = 2 microbatches x 8 replicas x 4: every axis splitting the batch is a
    # replica, whatever its name (counting 'data' alone said 16).
    assert plan.pipeline.microbatch_size == 64 // (2 * 8) == 4
    # No collective over them is tensor parallelism's.
    assert {c.where for c in plan.predicted.collectives} <= {"dp_grad", "batch_reduce"}
    text = autopar.report.summary(plan)
    assert "axis 'tensor' splits only the batch" in text
    assert "'data' x 'tensor'" in text


def test_an_axis_that_also_splits_weights_or_other_dims_is_not_batch_only():
    x = TensorSharding("x", (64, 8), "float32", (("data", "tensor"), None), "batch")
    w_split = TensorSharding("w", (8, 8), "float32", (None, "tensor"), "param")
    w_whole = TensorSharding("w", (8, 8), "float32", (None, None), "param")
    seq = TensorSharding("t", (64, 128), "int32", ("data", "tensor"), "batch")
    mesh = {"data": 2, "tensor": 4}
    assert batch_only_axes(Plan(mesh=mesh, inputs=(x, w_whole))) == ("data", "tensor")
    assert batch_only_axes(Plan(mesh=mesh, inputs=(x, w_split))) == ("data",)
    assert batch_only_axes(Plan(mesh=mesh, inputs=(seq, w_whole))) == ("data",)
    # Size-1 axes split nothing.
    assert batch_only_axes(Plan(mesh={"data": 8, "tensor": 1}, inputs=(x,))) == ("data",)
