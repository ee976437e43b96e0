"""A plan's pin that reshards a step input (a weight gathered for its matmul) runs once per
step before the pipeline's ticks, not in every piece (``autopar.lower.pipeline``).

Issue 13 item 4: with Megatron-LM layouts inside unrolled stages the compiled program
gathered every weight in the forward and again in the backward piece of every microbatch
(268 all-gathers, 6.8 MiB, where 93 / 1.1 MiB were priced: the cost model prices a
reshard of a step input once per step, as XLA hoists it out of a microbatch loop, but not
out of the tick loop's switch). Here: an unrolled 4-layer MLP whose kernels are pinned
replicated where they are read; the expected values are the pins' count (one per kernel,
by construction). The hoisted program's numerics with a plan's own pins:
``tests/lower/test_pipeline_within.py::test_pinned_megatron_inside_equals_single_device``
(slow), and its collectives: ``test_megatron_inside_unrolled_stages_run_what_was_priced``
(slow; all-gathers 268 -> 97 compiled against 93 priced).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import autopar
from autopar.lower.mesh import make_mesh
from autopar.lower.pipeline import _hoisted_layouts, cut_stages

LAYERS, WIDTH, BATCH, M = 4, 16, 16, 4
MESH = make_mesh({"pipe": 2, "data": 4})
WHOLE = NamedSharding(MESH, P())


def _loss(ws, batch):
    x = batch["x"]
    for w in ws:
        x = jnp.tanh(x @ jax.lax.with_sharding_constraint(w["w"], WHOLE) + w["b"])
    return jnp.mean((x - batch["y"]) ** 2)


def test_pinned_weights_are_resharded_once_before_the_ticks():
    k = jax.random.split(jax.random.PRNGKey(1), LAYERS + 2)
    ws = [
        {"w": jax.random.normal(k[i], (WIDTH, WIDTH)) / 4, "b": jnp.full((WIDTH,), 0.01 * i)}
        for i in range(LAYERS)
    ]
    batch = {
        "x": jax.random.normal(k[-2], (BATCH, WIDTH)),
        "y": jax.random.normal(k[-1], (BATCH, WIDTH)),
    }
    micro = jax.tree.map(lambda x: x[: BATCH // M], batch)
    graph = autopar.trace(jax.value_and_grad(_loss), ws, micro)
    cut = cut_stages(graph, [(0, 2), (2, 4)], batch_inputs=[2 * LAYERS, 2 * LAYERS + 1])
    hoisted, at = _hoisted_layouts(cut, set(cut.batch_inputs))
    invars = cut.jaxpr.jaxpr.invars
    kernels = {i for i, v in enumerate(invars) if v.aval.shape == (WIDTH, WIDTH)}
    assert {i for i, _ in hoisted} == kernels and len(hoisted) == LAYERS
    assert len(at) >= LAYERS  # every pin on a kernel stands for its one reshard
