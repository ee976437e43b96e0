"""The CLIP two-tower model of the zoo: published parameter counts, Hugging Face's layout,
the contrastive loss, causality and end-of-text pooling, training, and a plan that splits
a batch whose loss couples every pair.

Expected numbers come from outside the code under test: Hugging Face's
``openai/clip-vit-base-patch32`` and ``openai/clip-vit-large-patch14`` checkpoints hold
151,277,313 and 427,616,513 parameters; the loss is re-computed below in NumPy from the
model's logits; cosine similarities are at most 1, so every logit is at most
``exp(logit_scale) = 1 / 0.07`` at initialisation.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from autopar.registry import model_names, model_step
from benchmarks.models import clip
from benchmarks.models.clip import CLIP, CLIPConfig
from tests.benchmarks._trees import count, nbytes


@pytest.mark.parametrize(
    "name,published",
    [("clip-vit-base-patch32", 151_277_313), ("clip-vit-large-patch14", 427_616_513)],
)
def test_parameter_counts_match_hugging_face(name, published):
    cfg = CLIPConfig.preset(name)
    _, (state, _) = clip.make_train_step(cfg, 2)
    assert count(state["params"]) == published
    assert cfg.num_params() == published


def test_vit_h_14_is_the_1b_two_tower_model_and_abstract():
    cfg = CLIPConfig.preset("clip-vit-h-14")
    _, (state, batch) = clip.make_train_step(cfg, 1024)
    n = count(state["params"])
    assert 0.9e9 < n < 1.1e9
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves((state, batch)))
    assert batch["pixel_values"].shape == (1024, 224, 224, 3)
    assert batch["input_ids"].shape == (1024, 77)
    # bf16 params (2) + fp32 master, mu, nu (12) per parameter, plus Adam's step counter
    assert nbytes(state) == 14 * n + 4


def test_hugging_face_parameter_paths():
    _, (state, _) = clip.make_train_step(CLIPConfig.preset("tiny"), 2)
    paths = {"/".join(str(k.key) for k in p) for p, _ in jax.tree_util.tree_leaves_with_path(state["params"])}  # fmt: skip
    for want in (
        "logit_scale",
        "visual_projection/kernel",
        "text_projection/kernel",
        "text_model/embeddings/token_embedding/embedding",
        "text_model/embeddings/position_embedding/embedding",
        "text_model/encoder/layers/1/self_attn/q_proj/bias",
        "text_model/encoder/layers/1/mlp/fc1/kernel",
        "text_model/final_layer_norm/scale",
        "vision_model/embeddings/class_embedding",
        "vision_model/embeddings/patch_embedding/kernel",
        "vision_model/embeddings/position_embedding/embedding",
        "vision_model/pre_layrnorm/bias",
        "vision_model/encoder/layers/1/self_attn/out_proj/kernel",
        "vision_model/encoder/layers/1/layer_norm2/scale",
        "vision_model/post_layernorm/scale",
    ):
        assert want in paths, want
    # the projections and the patch convolution have no bias
    for bias_free in ("visual_projection", "text_projection", "embeddings/patch_embedding"):
        assert not any(p.startswith(bias_free) and p.endswith("/bias") for p in paths)


@pytest.fixture(scope="module")
def tiny_fp32():
    cfg = CLIPConfig.preset("tiny", precision="fp32")
    _, (state, batch) = clip.make_train_step(cfg, 6, abstract=False)
    return cfg, state, batch


@functools.partial(jax.jit, static_argnums=0)
def _logits(cfg, params, pixels, ids):
    return CLIP(cfg).apply({"params": params}, pixels, ids)


def test_loss_is_the_symmetric_contrastive_loss(tiny_fp32):
    cfg, state, batch = tiny_fp32
    per_text, per_image = _logits(cfg, state["params"], batch["pixel_values"], batch["input_ids"])
    per_text = np.asarray(per_text, np.float64)
    np.testing.assert_array_equal(np.asarray(per_image), np.asarray(per_text).T)
    assert np.abs(per_text).max() <= 1 / 0.07 * (1 + 1e-6)  # cosines scaled by 1 / 0.07

    def ce(logits):  # rows are predictions, the match is on the diagonal
        z = logits - logits.max(axis=1, keepdims=True)
        logp = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
        return -np.mean(np.diag(logp))

    want = (ce(per_text) + ce(per_text.T)) / 2
    got = float(jax.jit(clip.loss_fn, static_argnums=0)(cfg, state["params"], batch))
    assert got == pytest.approx(want, rel=1e-5)


def test_text_is_causal_and_pooled_at_end_of_text(tiny_fp32):
    cfg, state, batch = tiny_fp32
    pixels, ids = batch["pixel_values"], np.asarray(batch["input_ids"])
    eot = int(np.argmax(ids[0]))
    assert ids[0, eot] == cfg.vocab_size - 1 and 0 < eot < cfg.seq_len - 1
    base = np.asarray(_logits(cfg, state["params"], pixels, ids)[0])
    # padding after the end-of-text token is invisible to it (causal attention)
    after = ids.copy()
    after[0, eot + 1 :] = 7
    np.testing.assert_array_equal(np.asarray(_logits(cfg, state["params"], pixels, after)[0]), base)
    # a token before it changes caption 0's row and no other
    before = ids.copy()
    before[0, eot - 1] = (before[0, eot - 1] % (cfg.vocab_size - 2)) + 1
    changed = np.asarray(_logits(cfg, state["params"], pixels, before)[0])
    assert np.abs(changed[0] - base[0]).max() > 1e-4
    np.testing.assert_array_equal(changed[1:], base[1:])


def test_each_image_is_one_column(tiny_fp32):
    cfg, state, batch = tiny_fp32
    pixels = np.asarray(batch["pixel_values"])
    base = np.asarray(_logits(cfg, state["params"], pixels, batch["input_ids"])[0])
    moved = pixels.copy()
    moved[2] = -moved[2]
    changed = np.asarray(_logits(cfg, state["params"], moved, batch["input_ids"])[0])
    assert np.abs(changed[:, 2] - base[:, 2]).max() > 1e-4
    np.testing.assert_array_equal(np.delete(changed, 2, axis=1), np.delete(base, 2, axis=1))


def test_step_trains(tiny_fp32):
    cfg, state, batch = tiny_fp32
    step = jax.jit(clip.make_train_step(cfg, 6, abstract=False)[0])
    losses = []
    for _ in range(4):
        new_state, loss = step(state, batch)
        assert jax.tree.structure(new_state) == jax.tree.structure(state)
        state = new_state
        losses.append(float(loss))
    assert all(b < a for a, b in zip(losses[:-1], losses[1:], strict=True))


def test_registered_and_refuses_bad_configs():
    assert "clip" in model_names()
    m = model_step("clip", "tiny", batch_size=2)
    assert m.args[1]["input_ids"].shape == (2, CLIPConfig.preset("tiny").seq_len)
    with pytest.raises(ValueError, match="unknown CLIP preset"):
        CLIPConfig.preset("clip-vit-g")
    with pytest.raises(ValueError, match="not a multiple of patch"):
        CLIPConfig.preset("tiny", image_size=30)
    with pytest.raises(ValueError, match="heads"):
        CLIPConfig.preset("tiny", vision_heads=5)
    with pytest.raises(ValueError, match="pairs"):
        clip.make_train_step(CLIPConfig.preset("tiny"), 1)


def test_autoparallel_splits_the_contrastive_batch_and_matches_single_device():
    # Every image is contrasted with every caption of the global batch: a plan that
    # splits the batch must gather the other devices' embeddings to get the same loss.
    import autopar
    from tests.lower._zoo import check_against_single_device

    cfg = CLIPConfig.preset("tiny", precision="fp32")
    step, args = clip.make_train_step(cfg, 64, abstract=False)
    # one DGX node's 8 GPUs, planned for and run on the 8 simulated CPU devices
    fast = autopar.autoparallel(step, cluster="dgx-a100-80gb", cache=False)
    plan = fast.plan_for(*args)
    check_against_single_device(step, args, fast)
    specs = {r.path: tuple(r.spec) for r in plan.inputs}
    assert specs["batch/pixel_values"][0] is not None, specs["batch/pixel_values"]
    # The token ids (8 KiB) may stay whole on every device, each slicing its share for
    # free; the blocks of both towers must work on a share of the batch. The per-layer
    # table names every block of both towers and says how each op is split.
    towers = ("vision_model", "text_model")
    by_layer = {s.layer: dict(s.ops) for s in plan.layers}
    for name in (f"{t}/encoder/layers/{i}" for t in towers for i in range(2)):
        ops = by_layer[name]
        for proj in ("self_attn/q_proj", "mlp/fc1", "mlp/fc2"):
            assert "data" in ops[f"CLIP/{name}/{proj}"], (name, proj, ops)


def test_the_blocks_of_both_towers_are_layers_and_solved_once():
    # Each tower's blocks are identical: one more block per tower adds nodes to the
    # sharding problem but no choice to the solver.
    import autopar
    from autopar.options import SearchOptions
    from autopar.search import solver
    from autopar.search.intra_op import build_problem
    from cost_models import Cluster

    cluster = Cluster.preset("dgx-a100-80gb")
    mesh = {"data": 2, "tensor": 4}
    sizes = {}
    for layers in (2, 3):
        cfg = CLIPConfig.preset("tiny", vision_layers=layers, text_layers=layers)
        step, args = clip.make_train_step(cfg, 8)
        graph = autopar.trace(step, *args)
        names = [layer.name for layer in graph.layers]
        towers = ("vision_model", "text_model")
        assert names == [f"{t}/encoder/layers/{i}" for t in towers for i in range(layers)]
        for t in towers:
            assert len({la.signature for la in graph.layers if la.name.startswith(t)}) == 1, t
        problem = build_problem(graph, cluster, mesh, SearchOptions(mesh=mesh), 80e9).problem
        sizes[layers] = (len(problem.nodes), len(solver._presolve(problem, "cost").unary))
    assert sizes[3][0] > sizes[2][0]  # more ops ...
    assert sizes[3][1] == sizes[2][1]  # ... the same choices


@pytest.mark.parametrize("activation", ["quick_gelu", "gelu"])
def test_mlp_activations_are_openai_and_laion_ones(activation):
    # OpenAI's checkpoints: x * sigmoid(1.702 x); LAION's: the exact GELU, x * Phi(x),
    # written here with math.erf.
    mlp = clip.CLIPMLP(clip.Tower(3, 1, 5, 1, False, activation))
    x = jnp.linspace(-2.0, 2.0, 6).reshape(2, 3)
    params = mlp.init(jax.random.PRNGKey(0), x)
    p = jax.tree.map(np.asarray, params["params"])
    h = np.asarray(x) @ p["fc1"]["kernel"] + p["fc1"]["bias"]
    if activation == "quick_gelu":
        act = h / (1 + np.exp(-1.702 * h))
    else:
        act = h * 0.5 * (1 + np.vectorize(math.erf)(h / math.sqrt(2)))
    want = act @ p["fc2"]["kernel"] + p["fc2"]["bias"]
    np.testing.assert_allclose(np.asarray(mlp.apply(params, x)), want, rtol=1e-5, atol=1e-6)
