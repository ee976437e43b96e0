"""A step that accumulates gradients with ``lax.scan`` plans, lowers and runs sharded.

The plan is searched for the user's own step (no autopar microbatching on top), its
layouts land inside the loop body (``plan.activations`` with the loop's scope), and the
program on 8 simulated CPU devices gives what single-device ``jax.jit(step)`` gives
(tolerances of ``tests/lower/_zoo.py``). The collectives XLA emits right after SPMD
partitioning are counted by hand against the model: one gradient all-reduce per parameter
and microbatch (the accumulators are carried replicated; reducing once after the loop
would need the carry to stay unreduced), which is also what the plan prices.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import autopar
from autopar import SearchOptions
from autopar.lower import lower_plan
from autopar.trace import trace
from autopar.verify.hlo import dump_spmd_hlo, parse_collectives
from cost_models import Cluster
from tests.lower._zoo import LOSS_RTOL, compare_params
from tests.trace.test_accumulation_scan import accumulating_step

EIGHT = Cluster.preset("dgx-a100-80gb")
M = 4
BATCH = 128  # 4 microbatches of 32 sequences: 4 per device under 8-way data parallelism


@functools.cache
def _case():
    """The tiny fp32 GPT (unrolled blocks) with the accumulating AdamW step, concrete."""
    from benchmarks.models.gpt import GPT, GPTConfig, loss_fn

    cfg = GPTConfig.preset("tiny", precision="fp32", scan_layers=False)
    tokens = jnp.zeros((1, cfg.seq_len), jnp.int32)
    params = GPT(cfg).init(jax.random.key(0), tokens)["params"]
    tx = optax.adamw(1e-3)
    toks = jax.random.randint(jax.random.key(1), (BATCH, cfg.seq_len), 0, cfg.vocab_size)
    batch = {"tokens": toks, "targets": jnp.roll(toks, -1, axis=1)}
    step = accumulating_step(functools.partial(loss_fn, cfg), tx, M)
    args = jax.device_put((params, tx.init(params), batch), jax.devices()[0])
    graph = trace(step, *args)
    plan = autopar.plan(step, *args, cluster=EIGHT, options=SearchOptions(mesh={"data": 8}))
    return step, args, graph, plan


def test_plan_splits_the_microbatch_over_data_inside_the_loop():
    _, _, graph, plan = _case()
    (acc,) = graph.accumulations
    body = graph.nodes[acc.node].body[0]
    scope = ((acc.node, 0),)
    # The layers' forward matmuls (q, k, v, out, fc_in, fc_out of both blocks) make
    # [microbatch, seq, features] values: each is pinned inside the loop body, its
    # microbatch dim split over the 8 'data' devices.
    dots = [
        n
        for layer in body.layers
        for n in (body.nodes[i] for i in layer.nodes)
        if n.primitive == "dot_general" and n.phase == "forward" and n.out_tensors[0].ndim == 3
        and n.out_tensors[0].shape[0] == BATCH // M
    ]  # fmt: skip
    assert len(dots) == 2 * 6
    pins = {
        c.node: c.spec for c in plan.activations if tuple(c.scope) == scope and c.operand is None
    }
    for n in dots:
        assert n.id in pins, n.name_stack
        assert pins[n.id][0] == "data", (n.name_stack, pins[n.id])
    assert plan.pipeline is None  # no autopar microbatching on top of the user's loop


def test_lowered_accumulating_step_equals_single_device():
    step, args, graph, plan = _case()
    lowered = lower_plan(step, plan, args, graph=graph)
    got_params, got_opt, got_loss = lowered(*args)
    want_params, want_opt, want_loss = jax.jit(step)(*args)
    np.testing.assert_allclose(float(got_loss), float(want_loss), rtol=LOSS_RTOL)
    compare_params(got_params, want_params)
    compare_params(got_opt, want_opt)
    # The program keeps the user's loop: one while loop of M trips.
    assert " while(" in lowered.hlo_text()


def test_gradient_all_reduces_are_counted_and_priced_per_microbatch():
    step, args, graph, plan = _case()
    lowered = lower_plan(step, plan, args, graph=graph)
    coll = parse_collectives(dump_spmd_hlo(lowered))
    reduces = [c for c in coll if c.kind == "all-reduce"]
    n_params = len(jax.tree.leaves(args[0]))
    # Hand count: every parameter's gradient (and the microbatch loss) is reduced over the
    # 8 devices inside the loop body, once per microbatch; the tied embedding table (token
    # lookup and output head) may have its two gradient contributions reduced apart,
    # before they are summed (they are when its batch inputs stay whole, as here).
    assert len(reduces) in (n_params + 1, n_params + 2)
    # The extra one is the embedding table's size: one more reduction of that many bytes
    # than there are parameters of that size.
    wte = int(np.prod(args[0]["wte"]["embedding"].shape)) * 4
    same_size = sum(int(np.prod(x.shape)) * 4 == wte for x in jax.tree.leaves(args[0]))
    assert sum(c.bytes == wte for c in reduces) == same_size + len(reduces) - n_params - 1
    assert {(c.count, c.group_size) for c in reduces} == {(M, 8)}
    # The plan prices the same number of all-reduce executions over 'data'.
    priced = [c for c in plan.predicted.collectives if c.kind == "all-reduce"]
    assert {tuple(c.axes) for c in priced} == {("data",)}
    assert sum(c.count for c in priced) == pytest.approx(sum(c.count for c in reduces))
