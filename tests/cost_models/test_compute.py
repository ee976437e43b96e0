"""Compute roofline and the matmul efficiency curve."""

import pytest

from cost_models import (
    CostModelError,
    Efficiency,
    compute_time,
    dtype_bytes,
    get_device,
    matmul_time,
)


def test_h200_reference_matmul():
    # Reference README: an 8192^3 bf16 matmul on H200 runs at ~790 TFLOP/s.
    h200 = get_device("h200-sxm")
    t = matmul_time(8192, 8192, 8192, h200, "bfloat16")
    assert 2 * 8192**3 / t == pytest.approx(790e12, rel=1e-9)


def test_curve_shape():
    eff = Efficiency(peak_fraction=0.8, half_dim=64)
    assert eff.matmul(64, 64, 64) == pytest.approx(0.8 / 8)  # each dim halves it
    assert eff.matmul(1e9, 1e9, 1e9) == pytest.approx(0.8, rel=1e-6)
    assert eff.matmul(8192, 8192, 128) < eff.matmul(8192, 8192, 8192)  # skinny is worse


def test_roofline_memory_bound_side():
    a100 = get_device("a100-80gb")
    # an elementwise op over 1 GB in and out: memory bound at 88% of 2039 GB/s
    t = compute_time(1e9, 2e9, a100, kind="elementwise")
    assert t == pytest.approx(2e9 / (2039e9 * 0.88))
    # a matmul-vector product is memory bound too
    m, k = 8192, 8192
    t = compute_time(2 * m * k, (m * k + k + m) * 2, a100, shape_hint=(m, 1, k))
    assert t == pytest.approx((m * k + k + m) * 2 / (2039e9 * 0.88))


def test_roofline_compute_bound_side():
    a100 = get_device("a100-80gb")
    eff = Efficiency(peak_fraction=0.5, half_dim=0.0)
    t = compute_time(1e15, 1e6, a100, "bfloat16", "matmul", (4096, 4096, 4096), profile=eff)
    assert t == pytest.approx(1e15 / (312e12 * 0.5))
    # no shape hint: assumed large -> the curve's limit
    t = compute_time(1e15, 1e6, a100, profile=eff)
    assert t == pytest.approx(1e15 / (312e12 * 0.5))
    # float32 uses the TF32 peak
    t = compute_time(1e15, 1e6, a100, "float32", profile=eff)
    assert t == pytest.approx(1e15 / (156e12 * 0.5))


def test_errors_and_helpers():
    a100 = get_device("a100-80gb")
    with pytest.raises(CostModelError, match="op kind"):
        compute_time(1.0, 1.0, a100, kind="conv")
    with pytest.raises(CostModelError, match="shape_hint"):
        compute_time(1.0, 1.0, a100, shape_hint=(1, 2))
    with pytest.raises(CostModelError, match="flops"):
        compute_time(-1.0, 1.0, a100)
    with pytest.raises(CostModelError, match="profile"):
        compute_time(1.0, 1.0, a100, profile="fast")
    with pytest.raises(CostModelError, match="<= 1"):
        Efficiency(peak_fraction=1.2)
    assert dtype_bytes("bfloat16") == 2 and dtype_bytes("float32") == 4 and dtype_bytes("int8") == 1
