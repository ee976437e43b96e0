"""Stage counts that do not divide the layers (issue 13, item 1): the inter-op split, the
outer loop's configurations and a fixed ``pipe`` in the mesh.

Expected values by hand: 5 equal layers on 2 stages have a bottleneck of at least
``ceil(5 / 2) = 3`` layers, on 4 stages of ``2``; the heavy-head GPT's split (5, 1) from
its FLOPs is worked out in ``tests/lower/test_pipeline_uneven.py``'s docstring (the head
over a 16,384 vocabulary weighs ~20 blocks, so its stage takes one block).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import pytest

import autopar
from autopar.options import SearchOptions
from autopar.search.interop import pipeline_time, split_stages
from autopar.search.outer import configurations
from cost_models import Cluster
from tests.lower._zoo import heavy_head_gpt

LAYERS, WIDTH, BATCH = 5, 16, 16


def test_five_equal_layers_on_two_and_four_stages():
    assert split_stages([1.0] * 5, 2) == ((0, 3), (3, 5))
    four = split_stages([1.0] * 5, 4)
    assert len(four) == 4 and max(b - a for a, b in four) == 2
    assert four[0][0] == 0 and four[-1][1] == 5
    assert all(x[1] == y[0] for x, y in zip(four, four[1:], strict=False))
    # Alpa's objective with 4 microbatches: 5 + 3 x 3 = 14 on two stages
    assert pipeline_time([1.0] * 5, ((0, 3), (3, 5)), 4) == 14.0


def _scanned_loss(ws, batch):
    def layer(h, w):
        return jnp.tanh(h @ w["w"] + w["b"]), None

    h, _ = jax.lax.scan(layer, batch["x"], ws)
    return jnp.mean((h - batch["y"]) ** 2)


def _unrolled_loss(ws, batch):
    h = batch["x"]
    for k in range(LAYERS):
        h = jnp.tanh(h @ ws["w"][k] + ws["b"][k])
    return jnp.mean((h - batch["y"]) ** 2)


def _step(loss):
    def step(ws, batch):
        value, grads = jax.value_and_grad(loss)(ws, batch)
        return jax.tree.map(lambda w, g: w - 0.1 * g, ws, grads), value

    return step


@functools.cache
def _graph(scanned: bool):
    if scanned:
        ws = {
            "w": jax.ShapeDtypeStruct((LAYERS, WIDTH, WIDTH), jnp.float32),
            "b": jax.ShapeDtypeStruct((LAYERS, WIDTH), jnp.float32),
        }
    else:
        ws = {
            "w": [jax.ShapeDtypeStruct((WIDTH, WIDTH), jnp.float32)] * LAYERS,
            "b": [jax.ShapeDtypeStruct((WIDTH,), jnp.float32)] * LAYERS,
        }
    batch = {
        "x": jax.ShapeDtypeStruct((BATCH, WIDTH), jnp.float32),
        "y": jax.ShapeDtypeStruct((BATCH, WIDTH), jnp.float32),
    }
    return autopar.trace(_step(_scanned_loss if scanned else _unrolled_loss), ws, batch)


EIGHT = Cluster.preset("dgx-a100-80gb", nodes=2, devices_per_node=4)


def test_configurations_offer_stage_counts_that_do_not_divide_the_layers():
    graph = _graph(False)
    assert len(graph.layers) == LAYERS
    configs = configurations(graph, EIGHT, SearchOptions(), [{}])
    # 8 devices: pipe 1, 2, 4 (8 would leave stages without a layer); 5 layers divide by
    # neither 2 nor 4, both are offered
    assert {c.pipe for c in configs} == {1, 2, 4}
    # interleaved: 2 stages x 2 chunks = 4 <= 5 layers; 4 x 2 = 8 > 5: not offered
    inter = {c.pipe for c in configs if c.schedule == "interleaved-1f1b"}
    assert inter == {2}
    for c in configs:
        assert c.pipe * c.virtual_stages <= LAYERS


def test_a_scanned_stack_splits_unevenly_at_a_fixed_stage_count_only():
    graph = _graph(True)
    assert [layer.kind for layer in graph.layers] == ["scan"] * LAYERS
    # The screen prices a scanned stack split over pipe; an uneven one comes whole.
    assert {c.pipe for c in configurations(graph, EIGHT, SearchOptions(), [{}])} == {1}
    fixed = configurations(graph, EIGHT, SearchOptions(pipeline_stages=2), [{}])
    assert {c.pipe for c in fixed} == {2}


def _heavy_head(abstract: bool = True):
    return heavy_head_gpt(True, abstract)


@functools.cache
def _fixed_pipe_plan():
    step, args = _heavy_head()
    options = SearchOptions(
        mesh={"pipe": 2, "data": 4}, schedule="1f1b", remat="none", microbatches=4
    )
    return autopar.plan(step, *args, cluster=Cluster.preset("dgx-a100-80gb"), options=options)


@pytest.mark.slow
def test_fixed_pipe_takes_the_inter_op_split_of_a_scanned_heavy_head_gpt():
    """``{pipe: 2, data: 4}`` fixed: the even split (3, 3) and the inter-op split (5, 1)
    are both priced; (5, 1) is faster (by hand, see the module docstring)."""
    step, args = _heavy_head()
    plan = _fixed_pipe_plan()
    assert plan.pipeline.stages == ((0, 5), (5, 6))
    even = autopar.baselines.pipeline(
        step, plan.mesh, *args, microbatches=4, schedule="1f1b", stages=((0, 3), (3, 6))
    )
    t_even = autopar.evaluate(step, even, Cluster.preset("dgx-a100-80gb"), *args)
    assert plan.predicted.step_time_s < t_even.step_time_s


@pytest.mark.slow
def test_fixed_pipe_uneven_scanned_plan_equals_single_device():
    from autopar.lower import lower_plan
    from tests.lower._zoo import check_against_single_device

    step, args = _heavy_head(abstract=False)
    check_against_single_device(step, args, lower_plan(step, _fixed_pipe_plan(), args))
