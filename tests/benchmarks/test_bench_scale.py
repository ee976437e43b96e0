"""``benchmarks.bench_scale``'s table arithmetic, without the slow search: model FLOPs,
TFLOP/s per device, the paper's configurations of Megatron-LM 2021 Table 1, the cells and
the atomic JSON write."""

from __future__ import annotations

import json

import pytest

from benchmarks import bench_scale
from cost_models.memory import megatron_flops_per_iteration


def test_tflops_per_device_by_hand():
    # GPT-3 175B, batch 1536, no recomputation: 72 B s l h^2 (1 + s/(6h) + V/(12 l h)) =
    # 3.2831e18 x (1 + 0.027778 + 0.0036169) = 3.3862e18 FLOPs; 20 s a step on 1024 GPUs:
    # 3.3862e18 / 20 / 1024 = 165.34 TFLOP/s each.
    f = megatron_flops_per_iteration(1536, 2048, 96, 12288, 51200, recompute=False)
    assert f == pytest.approx(3.3862e18, rel=1e-4)
    assert bench_scale.tflops_per_device(f, 20.0, 1024) == pytest.approx(165.34, rel=1e-4)
    assert bench_scale.tflops_per_device(2e12, 0.5, 4) == pytest.approx(1.0)
    with pytest.raises(ValueError):
        bench_scale.tflops_per_device(1.0, 0.0, 8)


def test_model_flops_of_the_traced_gpt_match_megatrons_formula():
    import autopar
    from benchmarks.models.gpt import GPTConfig, make_train_step

    cfg = GPTConfig.preset("gpt2-small")
    step, args = make_train_step(cfg, 8)
    graph = autopar.trace(step, *args)
    flops = bench_scale.model_flops(graph)
    by = graph.flops_by_phase()
    assert flops == by["forward"] + by["backward"] < graph.total_flops
    want = megatron_flops_per_iteration(
        8, cfg.seq_len, cfg.layers, cfg.hidden, cfg.vocab_size, recompute=False
    )
    assert flops == pytest.approx(want, rel=0.01)


def test_paper_configurations_of_table_1():
    if not bench_scale.MEGATRON_CSV.is_file():
        pytest.skip("../shared/reference not present")
    refs = {bench_scale.preset_of(r): r for r in bench_scale.read_megatron_table()}
    assert len(refs) == 10 and "megatron-1.7b" in refs and "megatron-1t" in refs
    c = bench_scale.megatron_config(refs["megatron-1.7b"])
    assert c == {"mesh": {"data": 32, "tensor": 1}, "m": 16, "schedule": "1f1b", "v": 1}
    # 175B-class row: t 8, p 8, 1536 GPUs -> d 24; 80 layers / 8 = 10, even: interleaved.
    c = bench_scale.megatron_config(refs["megatron-145.6b"])
    assert c == {
        "mesh": {"pipe": 8, "data": 24, "tensor": 8},
        "m": 96,
        "schedule": "interleaved-1f1b",
        "v": 2,
    }
    # 530B: 105 layers / 35 = 3, odd: plain 1F1B.
    c = bench_scale.megatron_config(refs["megatron-529.6b"])
    assert c["mesh"] == {"pipe": 35, "data": 9, "tensor": 8} and c["schedule"] == "1f1b"
    for name in refs:
        from benchmarks.models.gpt import GPTConfig

        cfg = GPTConfig.preset(name)
        assert (cfg.hidden, cfg.layers) == (int(refs[name]["hidden"]), int(refs[name]["layers"]))


def test_cells_and_atomic_json(tmp_path):
    ok = {
        "row": "tiny",
        "params": 118528,
        "devices": 8,
        "target_s": 3.0,
        "limit_bytes": 80e9,
        "search_s": 1.5,
        "mesh": {"data": 8},
        "schedule": "-",
        "microbatches": 1,
        "stage_remat": "-",
        "tflops": 1.25,
        "memory_bytes": 2**30,
        "fits": True,
    }
    cells = bench_scale.scale_cells(ok)
    assert len(cells) == len(bench_scale.SCALE_COLUMNS)
    assert cells[3:6] == ["1.5", "3 pass", "data8"] and cells[-4:] == [
        "1.2",
        "1.0 / 74.5",
        "yes",
        "-",
    ]
    # A row that must use an axis says whether its plan did.
    seq = bench_scale.scale_cells({**ok, "uses": "seq", "used": False})
    assert seq[-1] == "seq NO"
    bad = {k: ok[k] for k in ("row", "params", "devices", "target_s", "limit_bytes")}
    bad.update(search_s=4.0, error="InfeasiblePlanError: nothing fits")
    cells = bench_scale.scale_cells(bad)
    assert len(cells) == len(bench_scale.SCALE_COLUMNS) and "3 FAIL" in cells
    assert "InfeasiblePlanError: nothing fits" in cells
    path = tmp_path / "rows.json"
    bench_scale.write_json([ok, bad], str(path))
    assert json.loads(path.read_text())[1]["error"].startswith("InfeasiblePlanError")
    assert [p.name for p in tmp_path.iterdir()] == ["rows.json"]  # no temporary left behind


def test_accumulating_step_equals_one_full_batch_update():
    """The accumulate-scan row's step (a user's lax.scan over microbatches) makes the same
    update as plain optax on the whole batch: the mean of equal-sized microbatches' mean
    losses is the whole batch's mean loss, and so are its gradients."""
    import functools

    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    from benchmarks.models.gpt import (
        GPT,
        GPTConfig,
        loss_fn,
        make_accumulating_step,
        random_batch,
    )

    cfg = GPTConfig.preset("tiny", precision="fp32", layers=1, seq_len=16)
    step, (params_s, state_s, _) = make_accumulating_step(cfg, 8, microbatches=4)
    tokens = jnp.zeros((1, cfg.seq_len), jnp.int32)
    params = jax.jit(lambda k: GPT(cfg).init(k, tokens))(jax.random.key(1))["params"]
    tx = optax.adamw(1e-3)
    opt_state = jax.jit(tx.init)(params)
    assert jax.tree.structure(opt_state) == jax.tree.structure(state_s)
    batch = random_batch(cfg, 8, jax.random.key(2))
    new_params, new_state, loss = jax.jit(step)(params, opt_state, batch)

    @jax.jit
    def reference(params, opt_state, batch):
        loss, grads = jax.value_and_grad(functools.partial(loss_fn, cfg))(params, batch)
        updates, state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), state, loss

    want, want_state, want_loss = reference(params, opt_state, batch)
    np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-5)

    # Adam's moments hold the gradients' scale (its first update hardly does): a sum over
    # microbatches not averaged would be 4x in mu and 16x in nu. Some gradients are zero
    # in exact arithmetic (a key projection's bias: softmax ignores a constant per row)
    # and only rounding noise of the other terms in float32, summed in another order
    # here: so each kind of value (parameters, mu, nu) is compared as one vector, to
    # within 1e-4 of its own largest entry.
    def kinds(tree) -> dict[str, np.ndarray]:
        out: dict[str, list] = {}
        for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
            keys = jax.tree_util.keystr(path)
            kind = "mu" if ".mu" in keys else "nu" if ".nu" in keys else "other"
            out.setdefault(kind, []).append(np.ravel(np.asarray(leaf, np.float64)))
        return {k: np.concatenate(v) for k, v in out.items()}

    got = {"params": kinds(new_params)["other"], **kinds(new_state)}
    ref = {"params": kinds(want)["other"], **kinds(want_state)}
    assert set(got) == {"params", "mu", "nu", "other"}  # "other": Adam's step count
    for kind, b in ref.items():
        scale = float(np.max(np.abs(b)))
        np.testing.assert_allclose(got[kind], b, rtol=1e-4, atol=1e-4 * scale, err_msg=kind)
