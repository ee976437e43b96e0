"""Reference formulas: ZeRO model states, Korthikanti activations, Megatron sizes and FLOPs."""

import pytest

from cost_models import (
    CostModelError,
    activation_bytes_per_layer_korthikanti,
    gpt_num_params,
    megatron_flops_per_iteration,
    model_state_breakdown,
    model_state_bytes,
    pipeline_activation_multiplier,
    pipeline_p2p_bytes,
    tensor_parallel_bytes_per_layer,
)


def test_zero_paper_example_7_5b_at_64():
    # ZeRO paper: 7.5B parameters, N_d = 64 -> 120 / 31.4 / 16.6 / 1.9 GB
    psi, nd = 7.5e9, 64
    assert model_state_bytes(psi, 0, nd) == pytest.approx(16 * psi)
    assert model_state_bytes(psi, 1, nd) == pytest.approx(4 * psi + 12 * psi / nd)
    assert model_state_bytes(psi, 2, nd) == pytest.approx(2 * psi + 14 * psi / nd)
    assert model_state_bytes(psi, 3, nd) == pytest.approx(16 * psi / nd)
    rounded = [round(model_state_bytes(psi, z, nd) / 1e9, 1) for z in (0, 1, 2, 3)]
    assert rounded == [120.0, 31.4, 16.6, 1.9]


def test_breakdown_and_fp32():
    b = model_state_breakdown(1e9, 2, 4)
    assert (b.params, b.grads, b.optimizer) == (2e9, 0.5e9, 3e9)
    # fp32 Adam: 4 param + 4 grad + 8 moments
    f = model_state_breakdown(1e9, 1, 4, precision="fp32")
    assert (f.params, f.grads, f.optimizer) == (4e9, 4e9, 2e9)
    with pytest.raises(CostModelError, match="zero_stage"):
        model_state_bytes(1e9, 4, 8)
    with pytest.raises(CostModelError, match="precision"):
        model_state_bytes(1e9, 1, 8, precision="fp8")


def test_korthikanti_table_values():
    # s=2048, b=1, h=12288, a=96 (GPT-3 175B); sbh = 25,165,824 and 5as/h = 80
    s, b, h, a = 2048, 1, 12288, 96
    sbh = 2048 * 12288
    assert activation_bytes_per_layer_korthikanti(s, b, h, a) == sbh * (34 + 80)
    assert activation_bytes_per_layer_korthikanti(s, b, h, a, t=8) == sbh * (10 + 3 + 10)
    assert activation_bytes_per_layer_korthikanti(s, b, h, a, t=8, sp=True) == sbh * (34 / 8 + 10)
    assert (
        activation_bytes_per_layer_korthikanti(s, b, h, a, t=8, recompute="selective") == sbh * 13
    )
    assert (
        activation_bytes_per_layer_korthikanti(s, b, h, a, t=8, sp=True, recompute="selective")
        == sbh * 34 / 8
    )
    assert activation_bytes_per_layer_korthikanti(s, b, h, a, t=8, recompute="full") == 2 * sbh
    assert activation_bytes_per_layer_korthikanti(s, b, h, a) == 2_868_903_936


# Megatron-LM 2021 Table 1: (params_b, heads, hidden, layers)
TABLE1 = [
    (1.7, 24, 2304, 24),
    (3.6, 32, 3072, 30),
    (7.5, 32, 4096, 36),
    (18.4, 48, 6144, 40),
    (39.1, 64, 8192, 48),
    (76.1, 80, 10240, 60),
    (145.6, 96, 12288, 80),
    (310.1, 128, 16384, 96),
    (529.6, 128, 20480, 105),
    (1008.0, 160, 25600, 128),
]


@pytest.mark.parametrize(("params_b", "a", "h", "l"), TABLE1)
def test_gpt_params_match_table1(params_b, a, h, l):  # noqa: E741
    # within 1%, or within the table's rounding to 0.1B (1.65B prints as 1.7, 3.56B as 3.6)
    got = gpt_num_params(l, h, 51200, 2048) / 1e9
    assert abs(got - params_b) <= max(0.01 * params_b, 0.05)


def test_flops_formula_by_hand():
    # s/(6h) = 1 and V/(16 l h) = 1 -> 96 B s l h^2 * 3
    assert megatron_flops_per_iteration(2, 6, 1, 1, 16) == 96 * 2 * 6 * 3
    # no recompute: V/(12 l h) = 1 -> 72 B s l h^2 * 3
    assert megatron_flops_per_iteration(2, 6, 1, 1, 12, recompute=False) == 72 * 2 * 6 * 3


def test_tensor_parallel_and_p2p_bytes():
    b, s, h, t = 1, 2048, 12288, 8
    assert tensor_parallel_bytes_per_layer(b, s, h, t) == 8 * b * s * h * 7 / 8 * 2
    assert tensor_parallel_bytes_per_layer(b, s, h, 1) == 0.0
    assert tensor_parallel_bytes_per_layer(b, s, h, t, bytes_per_elem=1) == 8 * b * s * h * 7 / 8
    assert pipeline_p2p_bytes(b, s, h) == b * s * h * 2
    assert pipeline_p2p_bytes(b, s, h, t=8, scatter_gather=True) == b * s * h * 2 / 8


def test_pipeline_activation_multiplier():
    assert pipeline_activation_multiplier("gpipe", 4, 16) == 16
    assert pipeline_activation_multiplier("1f1b", 4, 16) == 4
    assert pipeline_activation_multiplier("1f1b", 8, 4) == 4
    assert pipeline_activation_multiplier("zero-bubble", 4, 16) == 4
    # Korthikanti: p (1 + (p-1)/(p v)) with v interleaved chunks
    assert pipeline_activation_multiplier("interleaved-1f1b", 4, 16, v=2) == pytest.approx(
        4 * (1 + 3 / 8)
    )
    assert pipeline_activation_multiplier("interleaved-1f1b", 8, 64, v=4) == pytest.approx(
        8 * (1 + 7 / 32)
    )
    assert pipeline_activation_multiplier("interleaved-1f1b", 4, 16, v=1) == 4
    with pytest.raises(CostModelError, match="schedule"):
        pipeline_activation_multiplier("pipedream", 4, 16)
