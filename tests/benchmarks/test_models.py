"""The model zoo: parameter counts, the args/step contract, precision, scan layout, MoE routing.

Expected numbers come from hand formulas or published counts, never from the code under
test: GPT-2 small has 124,439,808 parameters with tied embeddings, GPT-3 175B follows
Megatron-LM's P = 12 l h^2 (1 + 13/(12h) + (V+s)/(12 l h)), torchvision's
``wide_resnet50_2`` / ``resnet50`` have 68,883,240 / 25,557,032 parameters, and ZeRO's
mixed-precision Adam keeps 2 + 2 + 12 = 16 bytes per parameter.
"""

from __future__ import annotations

import math
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks.models import gpt, mlp, moe, wide_resnet
from benchmarks.models.gpt import GPTConfig
from benchmarks.models.mlp import MLPConfig
from benchmarks.models.moe import MoEConfig
from benchmarks.models.wide_resnet import WideResNetConfig
from tests.benchmarks._trees import count, nbytes


def _gpt_formula(v: int, s: int, h: int, l: int) -> int:  # noqa: E741
    # Per block: q, k, v, out = 4h^2 + 4h; fc_in h*4h + 4h, fc_out 4h*h + h; two LNs 4h.
    # Plus token and position tables (output tied to wte) and the final LN.
    return v * h + s * h + l * (12 * h * h + 13 * h) + 2 * h


def _decreasing(losses: list[float]) -> bool:
    return all(later < earlier for earlier, later in zip(losses[:-1], losses[1:], strict=True))


def _trees_equal(a, b) -> bool:
    # numpy, not jnp: eager jnp ops would compile one small program per leaf shape.
    leaves_a, leaves_b = jax.tree.leaves(a), jax.tree.leaves(b)
    return all(
        np.array_equal(np.asarray(x), np.asarray(y))
        for x, y in zip(leaves_a, leaves_b, strict=True)
    )


def _same_layout(a, b) -> bool:
    leaves_a, leaves_b = jax.tree.leaves(a), jax.tree.leaves(b)
    return jax.tree.structure(a) == jax.tree.structure(b) and all(
        x.shape == y.shape and x.dtype == y.dtype for x, y in zip(leaves_a, leaves_b, strict=True)
    )


# --------------------------------------------------------------------------- parameter counts


@pytest.mark.parametrize(
    ("preset", "dims"),
    [("tiny", (256, 32, 64, 2)), ("gpt2-small", (50257, 1024, 768, 12))],
)
def test_gpt_param_count_matches_hand_formula(preset, dims):
    config = GPTConfig.preset(preset)
    _, (state, _) = gpt.make_train_step(config, 1)
    expected = _gpt_formula(*dims)
    if preset == "gpt2-small":
        assert expected == 124_439_808  # the published GPT-2 small count
    assert count(state["params"]) == expected
    assert config.num_params() == expected


def test_gqa_swiglu_param_count():
    # h = 64, 4 heads of 16, 2 kv heads -> k, v project to 32; swiglu with f = 256.
    config = GPTConfig.preset("tiny", kv_heads=2, activation="swiglu", ffn_hidden=256)
    attn = 2 * (64 * 64 + 64) + 2 * (64 * 32 + 32)  # q, out; k, v
    mlp_ = 2 * (64 * 256 + 256) + (256 * 64 + 64)  # fc_gate, fc_in; fc_out
    block = attn + mlp_ + 4 * 64
    expected = 256 * 64 + 32 * 64 + 2 * block + 2 * 64
    _, (state, _) = gpt.make_train_step(config, 1)
    assert count(state["params"]) == expected == 143_488
    assert state["params"]["h"]["attn"]["k"]["kernel"].shape == (2, 64, 32)


def test_gpt3_175b_abstract_is_fast_and_matches_megatron_formula():
    t0 = time.perf_counter()
    step, (state, batch) = gpt.make_train_step(GPTConfig.preset("gpt3-175b"), 8)
    elapsed = time.perf_counter() - t0
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves((state, batch)))
    v, s, h, l = 50257, 2048, 12288, 96  # noqa: E741
    megatron = 12 * l * h**2 * (1 + 13 / (12 * h) + (v + s) / (12 * l * h))
    n = count(state["params"])
    assert abs(n - megatron) / megatron < 1e-3
    assert n == _gpt_formula(v, s, h, l)
    assert 174.5e9 < n < 174.7e9
    assert elapsed < 30, f"abstract 175B args took {elapsed:.1f} s"


@pytest.mark.parametrize(
    ("preset", "published"), [("wrn-50-2", 68_883_240), ("resnet-50", 25_557_032)]
)
def test_wide_resnet_param_count_matches_torchvision(preset, published):
    _, (state, _) = wide_resnet.make_train_step(WideResNetConfig.preset(preset), 2)
    assert count(state["params"]) == published


# --------------------------------------------------------------------------- the contract

_ABSTRACT_CASES = {
    "gpt": (gpt, GPTConfig.preset("tiny")),
    "gpt-scan-dropout-fp32": (gpt, GPTConfig.preset("tiny", dropout=0.1, precision="fp32")),
    "gpt-unrolled-gqa-swiglu-dropout": (
        gpt,
        GPTConfig.preset("tiny", scan_layers=False, kv_heads=2, activation="swiglu", dropout=0.1),
    ),
    "moe": (moe, MoEConfig.preset("tiny")),
    "moe-scan-fp32": (moe, MoEConfig.preset("tiny", scan_layers=True, precision="fp32")),
    "wide_resnet": (wide_resnet, WideResNetConfig.preset("tiny")),
    "mlp": (mlp, MLPConfig.preset("tiny")),
}

_BATCH_LAYOUT = {
    gpt: {"tokens": ((4, 32), jnp.int32), "targets": ((4, 32), jnp.int32)},
    moe: {"tokens": ((4, 32), jnp.int32), "targets": ((4, 32), jnp.int32)},
    wide_resnet: {"images": ((4, 32, 32, 3), jnp.float32), "labels": ((4,), jnp.int32)},
    mlp: {"x": ((4, 16), jnp.float32), "y": ((4, 8), jnp.float32)},
}


@pytest.mark.parametrize("case", sorted(_ABSTRACT_CASES))
def test_abstract_args_and_step_signature(case):
    module, config = _ABSTRACT_CASES[case]
    step, args = module.make_train_step(config, 4)
    state, batch = args
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(args))
    expected_keys = {"params", "opt_state"} | ({"batch_stats"} if module is wide_resnet else set())
    assert set(state) == expected_keys
    layout = {k: (v.shape, v.dtype) for k, v in batch.items()}
    assert layout == {k: (s, jnp.dtype(d)) for k, (s, d) in _BATCH_LAYOUT[module].items()}
    assert not hasattr(step, "lower"), "step_fn must be a plain function, not a jitted one"
    new_state, loss = jax.eval_shape(step, state, batch)
    assert _same_layout(new_state, state)
    assert (loss.shape, loss.dtype) == ((), jnp.float32)


def test_gpt_name_stacks_and_scan_param_layout():
    config = GPTConfig.preset("tiny", scan_layers=False)
    step, (state, batch) = gpt.make_train_step(config, 2)
    stacks = {str(e.source_info.name_stack) for e in jax.make_jaxpr(step)(state, batch).eqns}
    for name in (
        "jvp(GPT)/h_0/attn/q",
        "jvp(GPT)/h_1/mlp/fc_out",
        "transpose(jvp(GPT))/h_1/attn/k",
    ):
        assert name in stacks
    _, (scanned, _) = gpt.make_train_step(GPTConfig.preset("tiny"), 2)
    assert scanned["params"]["h"]["attn"]["q"]["kernel"].shape == (2, 64, 64)
    assert scanned["params"]["h"]["mlp"]["fc_in"]["kernel"].shape == (2, 64, 256)


def test_moe_expert_weights_have_leading_expert_axis():
    config = MoEConfig.preset("tiny")  # 4 layers, MoE in blocks 1 and 3
    _, (state, _) = moe.make_train_step(config, 4)
    params = state["params"]
    assert set(params["h_1"]["moe"]) == {"router", "wi", "wo"}
    assert params["h_1"]["moe"]["wi"].shape == (4, 64, 256)
    assert params["h_3"]["moe"]["wo"].shape == (4, 256, 64)
    assert "mlp" in params["h_0"] and "moe" not in params["h_0"]
    assert config.capacity == math.ceil(2 * 1.25 * 32 / 4)


# --------------------------------------------------------------------------- precision


def test_mixed_precision_is_16_bytes_per_param():
    config = GPTConfig.preset("tiny")  # mixed by default
    _, (state, batch) = gpt.make_train_step(config, 2)
    n = count(state["params"])
    assert {x.dtype for x in jax.tree.leaves(state["params"])} == {jnp.dtype(jnp.bfloat16)}
    opt = state["opt_state"]
    assert {x.dtype for x in jax.tree.leaves(opt["master"])} == {jnp.dtype(jnp.float32)}
    adam = opt["adam"][0]
    assert {x.dtype for x in jax.tree.leaves((adam.mu, adam.nu))} == {jnp.dtype(jnp.float32)}
    # bf16 params (2) + fp32 master, momentum, variance (12); plus optax's int32 count.
    assert nbytes(state["params"]) + nbytes(opt) == 14 * n + 4
    grad_fn = jax.grad(lambda p, b: gpt.loss_fn(config, p, b))
    grads = jax.eval_shape(grad_fn, state["params"], batch)
    assert nbytes(grads) == 2 * n  # bf16 gradients: 16 bytes/param in all


def test_fp32_is_plain_adamw():
    config = GPTConfig.preset("tiny", precision="fp32")
    _, (state, _) = gpt.make_train_step(config, 2)
    n = count(state["params"])
    assert nbytes(state["params"]) == 4 * n
    assert nbytes(state["opt_state"]) == 8 * n + 4  # mu, nu, count


# --------------------------------------------------------------------------- running steps


def _jit(fn, *args):
    # jax.jit as users run it, compiled unoptimised: CPU compile time dominates these tiny
    # programs, and the option changes XLA's code generation, not the computation.
    return jax.jit(fn).lower(*args).compile({"xla_backend_optimization_level": 0})


def _run(step, state, batch, steps):
    compiled = _jit(step, state, batch)
    losses = []
    for _ in range(steps):
        new_state, loss = compiled(state, batch)
        assert _same_layout(new_state, state)
        assert loss.dtype == jnp.float32
        losses.append(float(loss))
        state = new_state
    return state, losses


@pytest.fixture(scope="module")
def gpt_run():
    """GPT tiny (mixed precision, scanned) initial state, batch and 4 steps of losses."""
    step, (state, batch) = gpt.make_train_step(GPTConfig.preset("tiny"), 4, abstract=False)
    final, losses = _run(step, state, batch, 4)
    return state, batch, final, losses


def test_gpt_mixed_step_reduces_loss(gpt_run):
    state, _, final, losses = gpt_run
    assert _decreasing(losses), losses
    # Random tokens over 256 symbols start near the uniform cross-entropy ln(256).
    assert abs(losses[0] - math.log(256)) < 0.1
    # bf16 params track the fp32 master copy they are cast from.
    params, master = final["params"], final["opt_state"]["master"]
    cast = jax.tree.map(lambda m: np.asarray(m).astype(jnp.bfloat16), master)
    assert _trees_equal(cast, params)
    assert int(final["opt_state"]["adam"][0].count) == 4
    moved = jax.tree.map(
        lambda a, b: bool(np.any(np.asarray(a) != np.asarray(b))),
        master,
        state["opt_state"]["master"],
    )
    assert all(jax.tree.leaves(moved))


def test_scan_and_unrolled_give_the_same_loss(gpt_run):
    state, batch, _, _ = gpt_run
    scanned = state["opt_state"]["master"]  # fp32 weights in the scanned layout
    scanned = jax.tree.map(np.asarray, scanned)
    unrolled = {k: v for k, v in scanned.items() if k != "h"}
    for i in range(2):
        unrolled[f"h_{i}"] = jax.tree.map(lambda x, i=i: x[i], scanned["h"])
    scan_cfg = GPTConfig.preset("tiny", precision="fp32")
    unroll_cfg = GPTConfig.preset("tiny", precision="fp32", scan_layers=False)
    _, (unrolled_state, _) = gpt.make_train_step(unroll_cfg, 4)
    assert _same_layout(unrolled, unrolled_state["params"])
    # Restacking the per-layer trees gives back the scanned parameters exactly.
    restacked = jax.tree.map(lambda *xs: np.stack(xs), unrolled["h_0"], unrolled["h_1"])
    assert _trees_equal(restacked, scanned["h"])
    loss_scan = _jit(lambda p: gpt.loss_fn(scan_cfg, p, batch), scanned)(scanned)
    loss_unrolled = _jit(lambda p: gpt.loss_fn(unroll_cfg, p, batch), unrolled)(unrolled)
    np.testing.assert_allclose(float(loss_scan), float(loss_unrolled), rtol=0, atol=1e-5)


@pytest.mark.parametrize(
    ("module", "config"),
    [
        (moe, MoEConfig.preset("tiny", layers=2, precision="fp32")),
        (wide_resnet, WideResNetConfig.preset("tiny", precision="fp32")),
        (mlp, MLPConfig.preset("tiny")),
    ],
    ids=["moe", "wide_resnet", "mlp"],
)
def test_step_reduces_loss(module, config):
    step, (state, batch) = module.make_train_step(config, 4, abstract=False)
    final, losses = _run(step, state, batch, 4)
    assert _decreasing(losses), losses
    if module is wide_resnet:
        # Running statistics moved from their (0, 1) init towards the batch statistics.
        before = np.asarray(state["batch_stats"]["stem_bn"]["mean"])
        after = np.asarray(final["batch_stats"]["stem_bn"]["mean"])
        assert np.max(np.abs(after - before)) > 0


def test_concrete_args_are_deterministic():
    config = MLPConfig.preset("tiny")
    _, (s0, b0) = mlp.make_train_step(config, 4, abstract=False, seed=0)
    _, (s0b, b0b) = mlp.make_train_step(config, 4, abstract=False, seed=0)
    assert _trees_equal((s0, b0), (s0b, b0b))


# --------------------------------------------------------------------------- MoE routing

# One compiled program per case instead of dozens of eagerly compiled small ops.
_route = jax.jit(moe.route, static_argnums=(1, 2))


def test_route_top1_respects_capacity_and_drops_overflow():
    # One group of 3 tokens, 2 experts: all prefer expert 0, which holds 2.
    probs = jnp.array([[[0.9, 0.1], [0.8, 0.2], [0.7, 0.3]]])
    dispatch, combine, aux = _route(probs, 1, 2)
    expected = np.zeros((1, 3, 2, 2))
    expected[0, 0, 0, 0] = 1  # token 0 -> expert 0, slot 0
    expected[0, 1, 0, 1] = 1  # token 1 -> expert 0, slot 1; token 2 is dropped
    np.testing.assert_array_equal(dispatch, expected)
    np.testing.assert_allclose(combine, expected * probs[..., :1, None].repeat(2, 2), atol=1e-7)
    # f = (1, 0), P = (0.8, 0.2): E * sum f P = 2 * 0.8.
    np.testing.assert_allclose(float(aux), 1.6, rtol=1e-6)


def test_route_top2_queues_second_choices_after_first_and_normalises_gates():
    probs = jnp.array([[[0.6, 0.3, 0.1], [0.5, 0.1, 0.4]]])
    dispatch, combine, _ = _route(probs, 2, 4)
    # First choices: both tokens -> expert 0 (slots 0, 1). Second: token 0 -> expert 1
    # (slot 0), token 1 -> expert 2 (slot 0); experts 1, 2 had no first-choice tokens.
    assert dispatch[0, 0, 0, 0] == 1 and dispatch[0, 1, 0, 1] == 1
    assert dispatch[0, 0, 1, 0] == 1 and dispatch[0, 1, 2, 0] == 1
    assert float(dispatch.sum()) == 4
    np.testing.assert_allclose(combine[0, 0, 0, 0], 0.6 / 0.9, rtol=1e-6)
    np.testing.assert_allclose(combine[0, 1, 2, 0], 0.4 / 0.9, rtol=1e-6)


# --------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    ("make", "fragment"),
    [
        (lambda: GPTConfig.preset("tiny", heads=5), "heads=5"),
        (lambda: GPTConfig.preset("tiny", kv_heads=3), "kv_heads=3"),
        (lambda: GPTConfig.preset("tiny", activation="relu"), "'gelu', 'swiglu'"),
        (lambda: GPTConfig.preset("tiny", precision="fp16"), "'mixed', 'fp32'"),
        (lambda: GPTConfig.preset("gpt-5"), "gpt3-175b"),
        (lambda: MoEConfig.preset("tiny", top_k=5), "top_k=5"),
        (lambda: WideResNetConfig(depth=20), "depth=20"),
        (lambda: MLPConfig(4, 8, 2, activation="swish"), "'relu'"),
    ],
)
def test_invalid_configs_raise_value_error_naming_the_value(make, fragment):
    with pytest.raises(ValueError, match=fragment.replace("(", r"\(")):
        make()


def test_llama3_8b_preset():
    config = GPTConfig.preset("llama3-8b")
    assert (config.vocab_size, config.hidden, config.layers, config.heads) == (128256, 4096, 32, 32)
    assert (config.kv_heads, config.ffn_hidden, config.activation) == (8, 14336, "swiglu")
    assert config.seq_len == 8192 and config.head_dim == 128


def _naive_causal_attention(q, k, v):
    # The textbook formula, written out: softmax(q k^T / sqrt(d) + causal mask) v.
    d = q.shape[-1]
    s = q.shape[1]
    scores = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(d)
    scores = np.where(np.tril(np.ones((s, s), bool)), scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    return np.einsum("bhqk,bkhd->bqhd", probs, v)


@pytest.mark.parametrize("chunk", [1, 4, 16])
def test_chunked_attention_equals_the_textbook_formula(chunk):
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((2, 16, 3, 8)).astype(np.float32) for _ in range(3))
    got = gpt.chunked_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), chunk)
    np.testing.assert_allclose(np.asarray(got), _naive_causal_attention(q, k, v), atol=1e-5)


def test_chunked_attention_gpt_trains_like_full_attention():
    full = GPTConfig.preset("tiny", precision="fp32")
    chunked = GPTConfig.preset("tiny", precision="fp32", attention_chunk=8)
    step, args = gpt.make_train_step(full, 4, abstract=False)
    step_c, _ = gpt.make_train_step(chunked, 4)  # the step only: its arguments are `args`
    (new, loss), (new_c, loss_c) = (_jit(f, *args)(*args) for f in (step, step_c))
    np.testing.assert_allclose(loss_c, loss, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(new_c), strict=True):
        np.testing.assert_allclose(b, a, atol=1e-5)


def test_chunked_attention_holds_one_chunk_of_scores():
    # No [heads, s, s] scores anywhere in the traced step: the largest float32 value
    # inside the attention is one chunk's [b, heads, s, chunk].
    cfg = GPTConfig.preset("tiny", seq_len=64, attention_chunk=16, scan_layers=False)
    step, args = gpt.make_train_step(cfg, 2)
    text = str(jax.make_jaxpr(step)(*args))
    assert "f32[2,4,64,64]" not in text and "f32[2,4,64,16]" in text


@pytest.mark.parametrize(
    "overrides", [{"attention_chunk": 5}, {"attention_chunk": 8, "dropout": 0.1}]
)
def test_bad_attention_chunk_is_refused(overrides):
    with pytest.raises(ValueError, match="attention_chunk"):
        GPTConfig.preset("tiny", **overrides)


def test_chunked_attention_gradients_equal_full_attention_gradients():
    # The custom backward pass (FlashAttention-2's) against autodiff of the plain formula.
    def full(q, k, v):
        d, s = q.shape[-1], q.shape[1]
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(d)
        scores = jnp.where(jnp.tril(jnp.ones((s, s), bool)), scores, -jnp.inf)
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v)

    rng = np.random.default_rng(1)
    q, k, v, w = (jnp.asarray(rng.standard_normal((2, 16, 3, 8)), jnp.float32) for _ in range(4))
    want = jax.grad(lambda *a: (full(*a) * w).sum(), argnums=(0, 1, 2))(q, k, v)
    got = jax.grad(lambda *a: (gpt.chunked_attention(*a, 4) * w).sum(), argnums=(0, 1, 2))(q, k, v)
    for g, e in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(e), atol=1e-5)
