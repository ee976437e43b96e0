"""Acceptance on the zoo's GPT-2 small (124M) AdamW step, batch 8, abstract arguments.

Expected values are derived by hand from the architecture (Megatron-LM's FLOP accounting):
per layer the non-embedding matmul weights are 12 h^2 (q, k, v, out: 4 h^2; MLP: 8 h^2);
attention scores and values add 2 * 2 * b * s^2 * h per layer; the tied logits add
2 * b * s * h * V. The backward pass does twice the forward matmul work (dx and dW).
"""

from __future__ import annotations

import pytest

from autopar.trace import trace

V, S, H, L, B = 50257, 1024, 768, 12, 8
TOKENS = B * S
FWD_MM = 2 * (12 * H * H * L) * TOKENS + 2 * 2 * B * S * S * H * L + 2 * TOKENS * H * V
# wte + wpe + per block (12 h^2 weights, 13 h biases/LayerNorm) + final LayerNorm
N_PARAMS = V * H + S * H + L * (12 * H * H + 13 * H) + 2 * H


@pytest.fixture(scope="module", params=[True, False], ids=["scan", "unrolled"])
def gpt2(request):
    from benchmarks.models.gpt import GPTConfig, make_train_step

    cfg = GPTConfig.preset("gpt2-small", scan_layers=request.param)
    assert (cfg.vocab_size, cfg.seq_len, cfg.hidden, cfg.layers, cfg.heads) == (V, S, H, L, 12)
    step, args = make_train_step(cfg, B)
    return request.param, trace(step, *args)


def _matmul_flops(graph, phase):
    total = 0.0
    for n in graph:
        if n.primitive == "dot_general" and n.phase == phase:
            total += n.flops
        for body in n.body:
            total += n.length * sum(
                m.flops for m in body if m.primitive == "dot_general" and m.phase == phase
            )
    return total


def test_matmul_flops_match_the_analytic_count(gpt2):
    _, g = gpt2
    assert _matmul_flops(g, "forward") == pytest.approx(FWD_MM, rel=0.01)
    assert _matmul_flops(g, "backward") == pytest.approx(2 * FWD_MM, rel=0.01)
    assert _matmul_flops(g, "optimizer") == 0


def test_backward_is_twice_forward(gpt2):
    _, g = gpt2
    phases = g.flops_by_phase()
    assert phases["backward"] == pytest.approx(2 * phases["forward"], rel=0.02)
    # AdamW touches each parameter a few dozen times: tiny next to the model
    assert 0 < phases["optimizer"] < 100 * N_PARAMS
    assert g.total_flops == pytest.approx(sum(phases.values()))


def test_twelve_equal_layers(gpt2):
    scan, g = gpt2
    assert len(g.layers) == L
    assert {layer.kind for layer in g.layers} == {"scan" if scan else "named"}
    names = [layer.name for layer in g.layers]
    assert names == ([f"h[{i}]" for i in range(L)] if scan else [f"h_{i}" for i in range(L)])
    first = g.layers[0]
    for layer in g.layers:
        assert layer.flops == pytest.approx(first.flops, rel=1e-12)
        assert layer.signature == first.signature
    # a block: 12 h^2 weights and attention, forward + backward (x3)
    block_mm = 2 * 12 * H * H * TOKENS + 2 * 2 * B * S * S * H
    assert first.forward_flops == pytest.approx(block_mm, rel=0.02)
    assert first.backward_flops == pytest.approx(2 * block_mm, rel=0.02)


def test_inputs_paths_and_roles(gpt2):
    scan, g = gpt2
    assert g.parameter_count == N_PARAMS
    for i in g.inputs:
        head = i.path.split("/")[:2]
        expected = {
            ("state", "params"): "param",
            ("state", "opt_state"): "opt_state",
            ("batch", "tokens"): "batch",
            ("batch", "targets"): "batch",
        }[tuple(head)]
        assert i.role == expected, i.path
        if i.path.startswith("state/"):
            # the updated value is at the same place under the first output (new_state)
            assert g.outputs[i.output_index].path == "out/0/" + i.path[len("state/") :]
        else:
            assert i.output_index is None
    kernel = "state/params/h/attn/q/kernel" if scan else "state/params/h_3/attn/q/kernel"
    q = g.input(kernel)
    assert q.tensor.shape == ((L, H, H) if scan else (H, H))
    assert q.tensor.dtype == "bfloat16"  # mixed precision stores bf16 parameters
    assert g.input("state/opt_state/master/wte/embedding").tensor.dtype == "float32"
    assert [o.path for o in g.outputs][-1] == "out/1"  # the loss


def test_summary_mentions_the_layers(gpt2):
    _, g = gpt2
    text = g.summary()
    assert "Layers: 12" in text and f"parameters: {N_PARAMS:,}" in text
