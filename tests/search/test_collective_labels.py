"""The collectives table's ``where`` says what each collective is (issue 15, item 6): a
reduction over the data-parallel axes of a value that is no gradient (the loss) is a
``batch_reduce``, not a ``tensor`` collective; its pricing (exposed) is unchanged."""

from __future__ import annotations

import autopar
from autopar.search.pricing import class_weight, collective_class
from autopar.search.sharding import Collective
from benchmarks.models import mlp


def test_classes_of_a_strategys_own_collectives():
    loss = Collective("all-reduce", ("data",), 4.0, 1e-6)
    assert collective_class(loss, scalar=True) == "batch_reduce"
    assert collective_class(loss, gradient=True) == "dp_grad"
    # A reduction that is not to a scalar (a row-parallel matmul's partial sums) over an
    # axis however named is tensor parallelism's.
    assert collective_class(Collective("all-reduce", ("data",), 1e6, 1e-6)) == "tensor"
    assert collective_class(Collective("all-reduce", ("tensor",), 4.0, 1e-6)) == "tensor"
    # Exposed, as the tensor class it used to be filed under.
    assert class_weight("batch_reduce", 0.6) == class_weight("tensor", 0.6) == 1.0


def test_the_loss_reduction_of_a_data_parallel_plan_is_a_batch_reduce():
    cfg = mlp.MLPConfig(d_in=16, hidden=64, d_out=8, layers=2)
    step, args = mlp.make_train_step(cfg, 32, abstract=False)
    plan = autopar.baselines.data_parallel(step, {"data": 8}, *args)
    ev = autopar.evaluate(step, plan, "dgx-a100-80gb", *args)
    assert plan.input("batch/x").spec[0] == "data"  # data parallel: the batch is split
    # The loss's mean over the batch: a 4-byte scalar reduced over data, once.
    (loss,) = [c for c in ev.collectives if c.where == "batch_reduce"]
    assert (loss.kind, loss.axes, loss.bytes, loss.count) == ("all-reduce", ("data",), 4.0, 1)
