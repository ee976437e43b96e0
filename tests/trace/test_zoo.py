"""The other zoo models trace with sensible layers and roles; the 175B budget (slow)."""

from __future__ import annotations

import pytest

from autopar.trace import trace


def _roles(g):
    out: dict[str, set[str]] = {}
    for i in g.inputs:
        out.setdefault(i.role, set()).add(i.path.split("/")[1])
    return out


@pytest.mark.parametrize("scan_layers", [False, True])
def test_moe(scan_layers):
    from benchmarks.models.moe import MoEConfig, make_train_step

    cfg = MoEConfig.preset("tiny", scan_layers=scan_layers)
    step, args = make_train_step(cfg, 4)
    g = trace(step, *args)
    assert _roles(g) == {
        "param": {"params"}, "opt_state": {"opt_state"}, "batch": {"tokens", "targets"},
    }  # fmt: skip
    assert g.flops_by_phase()["backward"] == pytest.approx(
        2 * g.flops_by_phase()["forward"], rel=0.1
    )
    if scan_layers:
        # one nn.scan over groups of moe_every blocks (a dense block, then a MoE block)
        assert len(g.layers) == cfg.layers // cfg.moe_every
        assert {layer.kind for layer in g.layers} == {"scan"}
        assert len({layer.signature for layer in g.layers}) == 1
    else:
        assert [layer.name for layer in g.layers] == [f"h_{i}" for i in range(cfg.layers)]
        moe = [cfg.is_moe_layer(i) for i in range(cfg.layers)]
        sig = {}
        for layer, is_moe in zip(g.layers, moe, strict=True):
            sig.setdefault(is_moe, set()).add(layer.signature)
        # dense blocks are identical to each other, MoE blocks too, and the two differ
        assert all(len(s) == 1 for s in sig.values()) and sig[True] != sig[False]


def test_wide_resnet_blocks_and_batch_stats():
    from benchmarks.models.wide_resnet import WideResNetConfig, make_train_step

    cfg = WideResNetConfig.preset("tiny")
    step, args = make_train_step(cfg, 2)
    g = trace(step, *args)
    assert len(g.layers) == sum(cfg.stage_blocks)
    assert [layer.name for layer in g.layers] == [f"block_{k}" for k in range(len(g.layers))]
    roles = _roles(g)
    assert roles["model_state"] == {"batch_stats"}
    assert roles["param"] == {"params"} and roles["opt_state"] == {"opt_state"}
    assert roles["batch"] == {"images", "labels"}
    for i in g.inputs_by_role("model_state"):
        assert g.outputs[i.output_index].path == "out/0/" + i.path[len("state/") :]
    convs = [n for n in g if n.primitive == "conv_general_dilated"]
    assert convs and all(n.flops > 0 for n in convs)


@pytest.mark.slow
def test_gpt3_175b_traces_within_budget():
    from benchmarks.bench_trace import run_in_subprocess

    r = run_in_subprocess("gpt3-175b-scan")
    assert r["layers"] == 96
    assert r["params"] == pytest.approx(174.6e9, rel=0.01)
    assert r["seconds"] < 5.0, r
    assert r["rss_mb"] < 2048, r
