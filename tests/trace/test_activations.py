"""Activation memory measured on traced graphs, against hand counts and Korthikanti 2022.

Reference (../shared/reference/README.md, Korthikanti et al. 2022, Table 2), bytes per
transformer layer with 16-bit activations and 1-byte dropout masks:
no recompute ``s b h (34 + 5 a s / h)``, selective recompute ``34 s b h``, full recompute
``2 s b h`` (the layer input). Expected values below come from that table or are counted
by hand from the model's structure, never from the program's output.
"""

from __future__ import annotations

import contextlib
import io
import re

import jax
import jax.numpy as jnp
import pytest
from jax.ad_checkpoint import print_saved_residuals

from autopar.errors import InvalidOptionError
from autopar.trace import activation_memory, trace

F32 = jnp.float32

# ----------------------------------------------------------------------------- plain MLP

B, D, FF, L = 16, 32, 64, 3  # batch, width, hidden width, residual blocks


def _mlp_loss(params, x):
    h = x
    for wa, wb in params:
        u = jnp.tanh(h @ wa)
        h = h + u @ wb
    return jnp.sum(h)


def _mlp_step(params, x):
    grads = jax.grad(_mlp_loss)(params, x)
    return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)


@pytest.fixture(scope="module")
def mlp():
    params = [
        (jax.ShapeDtypeStruct((D, FF), F32), jax.ShapeDtypeStruct((FF, D), F32)) for _ in range(L)
    ]
    x = jax.ShapeDtypeStruct((B, D), F32)
    graph = trace(_mlp_step, params, x)
    assert len(graph.layers) == L
    return graph, params, x


def test_mlp_residuals_counted_by_hand(mlp):
    graph, _, _ = mlp
    mem = activation_memory(graph)
    # Block i's backward: dWb = u^T dy reads u = tanh(h @ Wa) [B, FF]; dWa = h^T dz reads
    # the block input h [B, D] (block 0's is the argument x: alive anyway, free); tanh's
    # derivative 1 - u^2 is recomputed from u. d(sum)/dh is all ones: nothing else.
    u, h = 4 * B * FF, 4 * B * D
    assert mem.layer_bytes == (u, u + h, u + h)
    assert mem.outside_bytes == 0
    assert mem.total_bytes == L * u + (L - 1) * h
    assert mem.by_primitive == {"tanh": L * u, "add": (L - 1) * h}
    assert mem.by_dtype == {"float32": mem.total_bytes}
    # no attention matmul (both operands activations) here: selective changes nothing
    assert activation_memory(graph, "selective").layer_bytes == mem.layer_bytes


def test_mlp_full_remat_keeps_block_inputs(mlp):
    graph, _, _ = mlp
    mem = activation_memory(graph, "full")
    assert mem.layer_bytes == (0, 4 * B * D, 4 * B * D)  # block 0's input is x: free
    assert mem.outside_bytes == 0


def test_mlp_literal_residuals_match_jax(mlp):
    """Without elementwise recomputation the stored set is JAX's own residual set: what
    ``jax.ad_checkpoint.print_saved_residuals`` lists, less the arguments."""
    graph, params, x = mlp
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        print_saved_residuals(_mlp_loss, params, x)
    expected = 0
    for line in out.getvalue().splitlines():
        if "from the argument" in line:
            continue
        dtype, dims = re.match(r"(\w+)\[([\d,]*)\]", line).groups()
        assert dtype == "f32", line
        n = 1
        for d in dims.split(","):
            n *= int(d)
        expected += 4 * n
    mem = activation_memory(graph, recompute_elementwise=False)
    assert mem.total_bytes == expected
    # by hand: per block tanh's output and 1 - u^2, plus blocks 1, 2's input
    assert expected == L * 2 * 4 * B * FF + (L - 1) * 4 * B * D


def test_forward_only_graph_stores_nothing():
    x = jax.ShapeDtypeStruct((4, 8), F32)
    graph = trace(lambda x: jnp.tanh(x @ x.T).sum(), x)
    mem = activation_memory(graph)
    assert mem.total_bytes == 0 and mem.saved == ()


def test_unknown_policy_is_rejected(mlp):
    with pytest.raises(InvalidOptionError, match="selective"):
        activation_memory(mlp[0], "everything")  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- zoo GPT

S, H, A, BATCH, LAYERS, V = 256, 256, 8, 2, 2, 512
SBH = S * BATCH * H
CORE = A * S * S * BATCH  # elements of one attention score tensor: a s^2 b
PAPER_NONE = SBH * (34 + 5 * A * S / H)
PAPER_SELECTIVE = 34 * SBH
PAPER_FULL = 2 * SBH
# fp32 statistics the cut keeps (tiny, not in the paper): per LayerNorm the sums of x and
# x^2 [b, s], for the softmax its max and sum [b, a, s], 4 bytes each: 8 b s (a + 2).
STATS = 4 * BATCH * S * (2 * 2 + 2 * A)


def _gpt_graph(scan_layers: bool, precision: str = "mixed"):
    from benchmarks.models.gpt import GPTConfig, make_train_step

    cfg = GPTConfig(
        vocab_size=V, seq_len=S, hidden=H, layers=LAYERS, heads=A, dropout=0.1,
        scan_layers=scan_layers, precision=precision,
    )  # fmt: skip
    step, args = make_train_step(cfg, BATCH)
    graph = trace(step, *args)
    assert len(graph.layers) == LAYERS
    return graph


@pytest.fixture(scope="module", params=[True, False], ids=["scan", "unrolled"])
def gpt(request):
    return _gpt_graph(request.param)


def test_gpt_no_recompute_matches_korthikanti(gpt):
    mem = activation_memory(gpt)
    for layer in mem.layer_bytes:
        # measured ratio 1.004 (the fp32 statistics)
        assert layer / PAPER_NONE == pytest.approx(1.0, abs=0.15)
        # Megatron's set exactly: LayerNorm inputs and outputs 8 sbh, Q K V 6, output
        # projection input 2, fc_in output and GeLU output 16, residual dropout masks 2
        # (34 sbh); bf16 scores, dropout mask, dropped-out probabilities 5 a s^2 b.
        assert layer == 34 * SBH + 5 * CORE + STATS
    assert mem.total_bytes == sum(mem.layer_bytes) + mem.outside_bytes
    assert 0 < mem.outside_bytes < PAPER_NONE  # embedding, final LayerNorm, logits


def test_gpt_literal_jax_residuals(gpt):
    """JAX's own residual set (no elementwise recomputation) is 1.92x the paper here, for
    reasons of modelling, counted by hand from the zoo's layer and JAX's jvp rules:

    * attention core 7 a s^2 b: fp32 softmax numerator ``exp`` (4), bf16 probabilities
      after dropout (2), the mask (1); Megatron stores the bf16 softmax output instead.
    * each LayerNorm 14 sbh: fp32 ``x - mean`` (4), two fp32 products (8), bf16 output (2).
    * tanh GeLU 48 sbh: fc_in output, three products, ``tanh``, ``1 - tanh^2`` (6 x 8).
    * Q, K, V 6, output projection input 2, residual dropout masks 2.
    * fp32 statistics: softmax max and sum terms 8 a b s, per LayerNorm four [b, s] 16 b s.
    """
    mem = activation_memory(gpt, recompute_elementwise=False)
    expected = (2 * 14 + 48 + 6 + 2 + 2) * SBH + 7 * CORE + 8 * A * BATCH * S + 32 * BATCH * S
    for layer in mem.layer_bytes:
        assert layer == expected
        assert layer / PAPER_NONE == pytest.approx(1.924, abs=0.001)


def test_gpt_selective_recompute(gpt):
    mem = activation_memory(gpt, "selective")
    for layer in mem.layer_bytes:
        assert layer / PAPER_SELECTIVE == pytest.approx(1.0, abs=0.15)  # measured 1.002
        assert layer == 34 * SBH + 4 * BATCH * S * 2 * 2  # LayerNorm statistics remain
    assert mem.outside_bytes == activation_memory(gpt).outside_bytes


def test_gpt_full_recompute_keeps_the_layer_input(gpt):
    mem = activation_memory(gpt, "full")
    assert mem.layer_bytes == (PAPER_FULL,) * LAYERS
    (stored,) = {s.tensor.dtype for s in mem.saved if s.layers}
    assert stored == "bfloat16"


def test_gpt_scan_and_unrolled_agree():
    scan, unrolled = _gpt_graph(True), _gpt_graph(False)
    for remat in ("none", "selective", "full"):
        a, b = activation_memory(scan, remat), activation_memory(unrolled, remat)
        assert a.layer_bytes == b.layer_bytes
        assert a.outside_bytes == b.outside_bytes


def test_gpt_fp32_roughly_doubles():
    mixed = activation_memory(_gpt_graph(True)).layer_bytes[0]
    fp32 = activation_memory(_gpt_graph(True, "fp32")).layer_bytes[0]
    # every stored tensor but the 1-byte masks doubles: 32 sbh -> 64 (+2 masks), the core
    # 4 a s^2 b -> 8 (+1 mask): s b h (66 + 9 a s / h), 1.87x at a s / h = 8. In fp32 the
    # softmax numerator exp(x - max) costs what the scores do, so it is stored in their
    # place and the softmax max is not needed: statistics 4 b s (4 + a).
    assert fp32 == 66 * SBH + 9 * CORE + 4 * BATCH * S * (4 + A)
    assert 1.7 < fp32 / mixed < 2.1
