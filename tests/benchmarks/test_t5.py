"""The T5 encoder-decoder of the zoo: published parameter counts, Hugging Face's layout,
relative position buckets, causality, the args/step contract, and training.

Expected numbers come from outside the code under test: Hugging Face's ``t5-small``,
``t5-base``, ``t5-large`` and ``google/t5-v1_1-large`` checkpoints hold 60,506,624,
222,903,552, 737,668,096 and 783,150,080 parameters; the buckets are Mesh TensorFlow's
``_relative_position_bucket`` re-written below in plain Python floats; ZeRO's mixed-precision
Adam keeps 2 + 2 + 12 = 16 bytes per parameter (14 of them in ``params`` + ``opt_state``).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from autopar.registry import model_names, model_step
from benchmarks.models import t5
from benchmarks.models.t5 import T5Config
from tests.benchmarks._trees import count, nbytes


@pytest.mark.parametrize(
    "name,published",
    [
        ("t5-small", 60_506_624),
        ("t5-base", 222_903_552),
        ("t5-large", 737_668_096),
        ("t5-v1_1-large", 783_150_080),
    ],
)
def test_parameter_counts_match_hugging_face(name, published):
    cfg = T5Config.preset(name)
    _, (state, _) = t5.make_train_step(cfg, 2)
    assert count(state["params"]) == published
    assert cfg.num_params() == published


def test_t5_1b_is_abstract_and_mixed_precision():
    cfg = T5Config.preset("t5-1b")
    _, (state, batch) = t5.make_train_step(cfg, 32)
    n = count(state["params"])
    assert 0.9e9 < n < 1.1e9
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves((state, batch)))
    assert {k: v.shape for k, v in batch.items()} == {
        "inputs": (32, 2048), "decoder_inputs": (32, 2048), "targets": (32, 2048),
    }  # fmt: skip
    # bf16 params (2) + fp32 master, mu, nu (12) per parameter, plus Adam's step counter
    assert nbytes(state) == 14 * n + 4


def test_hugging_face_parameter_paths():
    cfg = T5Config.preset("tiny", feed_forward="gated-gelu", tie_embeddings=False)
    _, (state, _) = t5.make_train_step(cfg, 2)
    paths = {"/".join(str(k.key) for k in p) for p, _ in jax.tree_util.tree_leaves_with_path(state["params"])}  # fmt: skip
    for want in (
        "shared/embedding",
        "lm_head/kernel",
        "encoder/block/0/layer/0/SelfAttention/relative_attention_bias/embedding",
        "encoder/block/1/layer/0/SelfAttention/q/kernel",
        "encoder/block/1/layer/1/DenseReluDense/wi_0/kernel",
        "encoder/final_layer_norm/weight",
        "decoder/block/0/layer/0/SelfAttention/relative_attention_bias/embedding",
        "decoder/block/1/layer/1/EncDecAttention/k/kernel",
        "decoder/block/1/layer/2/DenseReluDense/wo/kernel",
        "decoder/block/1/layer/2/layer_norm/weight",
    ):
        assert want in paths, want
    # only block 0 of each stack owns a bias table; T5's projections have no biases
    assert sum("relative_attention_bias" in p for p in paths) == 2
    assert not any(p.endswith("/bias") for p in paths)


def _reference_bucket(rel: int, bidirectional: bool, num_buckets: int, max_distance: int) -> int:
    # Mesh TensorFlow's _relative_position_bucket, one offset at a time.
    ret, n = 0, -rel
    if bidirectional:
        num_buckets //= 2
        ret += (n < 0) * num_buckets
        n = abs(n)
    else:
        n = max(n, 0)
    max_exact = num_buckets // 2
    if n < max_exact:
        return ret + n
    large = max_exact + int(
        math.log(n / max_exact) / math.log(max_distance / max_exact) * (num_buckets - max_exact)
    )
    return ret + min(large, num_buckets - 1)


@pytest.mark.parametrize("bidirectional", [True, False])
def test_relative_position_buckets(bidirectional):
    rel = np.arange(-300, 301)
    got = t5.relative_position_bucket(jnp.asarray(rel), bidirectional, 32, 128)
    want = [_reference_bucket(int(r), bidirectional, 32, 128) for r in rel]
    np.testing.assert_array_equal(np.asarray(got), want)


@pytest.fixture(scope="module")
def tiny_fp32():
    """The fp32 tiny T5 (tied embeddings, its default) with its step and concrete arguments
    at batch 4, built once for the tests below: its init compiles for seconds on 2 cores."""
    cfg = T5Config.preset("tiny", precision="fp32")
    assert cfg.tie_embeddings
    return cfg, t5.make_train_step(cfg, 4, abstract=False, learning_rate=3e-3)


def test_decoder_is_causal_and_encoder_is_not(tiny_fp32):
    cfg, (_, (state, batch)) = tiny_fp32
    assert cfg.target_len > 5 and cfg.seq_len > 1  # the perturbations below fit
    model = t5.T5(cfg)
    apply = jax.jit(model.apply)  # one compile, not ~1000 eager ops for each of 3 calls

    def logits(inputs, decoder_inputs):
        return np.asarray(apply({"params": state["params"]}, inputs, decoder_inputs))

    base = logits(batch["inputs"], batch["decoder_inputs"])
    future = batch["decoder_inputs"].at[:, 5:].set((batch["decoder_inputs"][:, 5:] + 1) % 256)
    changed = logits(batch["inputs"], future)
    np.testing.assert_array_equal(changed[:, :5], base[:, :5])  # positions < 5 never see 5+
    assert np.abs(changed[:, 5:] - base[:, 5:]).max() > 1e-4
    last_input = batch["inputs"].at[:, -1].set((batch["inputs"][:, -1] + 1) % 256)
    # every decoder position attends to every encoder position, the last one too
    assert np.abs(logits(last_input, batch["decoder_inputs"])[:, 0] - base[:, 0]).min() > 0


def test_random_batch_shifts_targets_right():
    cfg = T5Config.preset("tiny")
    b = t5.random_batch(cfg, 3, jax.random.PRNGKey(0))
    np.testing.assert_array_equal(b["decoder_inputs"][:, 0], 0)
    np.testing.assert_array_equal(b["decoder_inputs"][:, 1:], b["targets"][:, :-1])


@pytest.mark.parametrize("tie", [True, False])
def test_step_trains(tie, tiny_fp32):
    if tie:
        cfg, (step, (state, batch)) = tiny_fp32
    else:
        cfg = T5Config.preset("tiny", precision="fp32", tie_embeddings=False)
        step, (state, batch) = t5.make_train_step(cfg, 4, abstract=False, learning_rate=3e-3)
    assert cfg.tie_embeddings == tie
    # Compiled without XLA's backend optimisation (as tests/benchmarks/test_models.py
    # runs its steps): compile time dominates this tiny program; the values are the same.
    jitted = jax.jit(step).lower(state, batch).compile({"xla_backend_optimization_level": 0})
    losses = []
    for _ in range(4):
        new_state, loss = jitted(state, batch)
        assert jax.tree.structure(new_state) == jax.tree.structure(state)
        state = new_state
        losses.append(float(loss))
    # a fresh model's logits are ~N(0, 1) (RMS-normed h times N(0, 1) or N(0, 1/d) rows):
    # cross-entropy about log V + 1/2, at least log V less the noise
    assert math.log(cfg.vocab_size) - 0.1 < losses[0] < math.log(cfg.vocab_size) + 1.5
    assert all(b < a for a, b in zip(losses[:-1], losses[1:], strict=True))


def test_registered_in_the_model_registry():
    assert "t5" in model_names()
    m = model_step("t5", "tiny", batch_size=2)
    assert m.args[1]["inputs"].shape == (2, T5Config.preset("tiny").seq_len)


def test_preset_overrides_carry_to_the_decoder():
    cfg = T5Config.preset("tiny", layers=3, seq_len=16)
    assert (cfg.decoder_layers, cfg.target_len) == (3, 16)
    cfg = T5Config.preset("tiny", layers=3, decoder_layers=1)
    assert (cfg.layers, cfg.decoder_layers) == (3, 1)
    with pytest.raises(ValueError, match="unknown T5 preset"):
        T5Config.preset("t5-xxxl")
    with pytest.raises(ValueError, match="feed_forward"):
        T5Config.preset("tiny", feed_forward="swiglu")


@pytest.mark.slow  # ~20 s of CPU: plan, compile for 8 devices, 3 + 3 steps against jax.jit
def test_autoparallel_matches_single_device_and_splits_the_batch():
    import autopar
    from tests.lower._zoo import check_against_single_device

    cfg = T5Config.preset("tiny", precision="fp32")
    step, args = t5.make_train_step(cfg, 32, abstract=False)
    # one DGX node's 8 GPUs, planned for and run on the 8 simulated CPU devices
    fast = autopar.autoparallel(step, cluster="dgx-a100-80gb", cache=False)
    plan = fast.plan_for(*args)
    check_against_single_device(step, args, fast)
    # 32 sequence pairs are worth splitting: every batch input's batch dim goes over data
    assert plan.mesh["data"] > 1
    specs = {r.path: tuple(r.spec) for r in plan.inputs}
    for name in ("inputs", "decoder_inputs", "targets"):
        assert specs[f"batch/{name}"] == ("data", None), name
    # the plan's per-layer table names every block of both stacks
    named = {s.layer for s in plan.layers}
    assert {f"{s}/block/{i}" for s in ("encoder", "decoder") for i in range(2)} <= named


def test_repeated_blocks_of_both_stacks_are_solved_once():
    # Encoder and decoder blocks between the first (which owns the relative position
    # bias) and the last are identical: each stack's middle blocks are tied, so one more
    # block per stack (a second middle one) adds nodes to the sharding problem but no
    # choice to the solver.
    import autopar
    from autopar.options import SearchOptions
    from autopar.search import solver
    from autopar.search.intra_op import build_problem
    from cost_models import Cluster

    cluster = Cluster.preset("dgx-a100-80gb")
    mesh = {"data": 2, "tensor": 4}
    sizes = {}
    for layers in (3, 4):
        step, args = t5.make_train_step(T5Config.preset("tiny", layers=layers), 8)
        graph = autopar.trace(step, *args)
        names = [layer.name for layer in graph.layers]
        assert names == [f"{s}/block/{i}" for s in ("encoder", "decoder") for i in range(layers)]
        sig = {layer.name: layer.signature for layer in graph.layers}
        for s in ("encoder", "decoder"):
            middle = {sig[f"{s}/block/{i}"] for i in range(1, layers - 1)}
            assert len(middle) == 1, s
        problem = build_problem(graph, cluster, mesh, SearchOptions(mesh=mesh), 80e9).problem
        sizes[layers] = (len(problem.nodes), len(solver._presolve(problem, "cost").unary))
    assert sizes[4][0] > sizes[3][0]  # more ops ...
    assert sizes[4][1] == sizes[3][1]  # ... the same choices
