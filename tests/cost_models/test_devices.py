"""Device catalog: the reference README's hardware table, dtype fallbacks, errors, JSON."""

import dataclasses

import pytest

from cost_models import DEVICES, CostModelError, DeviceSpec, device_for_jax_kind, get_device

# Reference README "Hardware" table: (device, dense 16-bit TFLOP/s, HBM GB/s).
REFERENCE = [
    ("a100-80gb", 312, 2039),
    ("h100-sxm", 989, 3350),
    ("h200-sxm", 989, 4800),
    ("tpu-v4", 275, 1200),
    ("tpu-v5e", 197, 819),
    ("tpu-v5p", 459, 2765),
]


@pytest.mark.parametrize(("name", "tflops", "gbps"), REFERENCE)
def test_catalog_matches_reference_table(name, tflops, gbps):
    dev = get_device(name)
    assert dev.flops_for("bfloat16") == tflops * 1e12
    assert dev.hbm_bandwidth == gbps * 1e9
    assert dev.source  # every constant carries its source


def test_memory_sizes_as_vendors_write_them():
    assert get_device("a100-80gb").hbm_bytes == 80 * 10**9
    assert get_device("h200-sxm").hbm_bytes == 141 * 10**9
    assert get_device("tpu-v4").hbm_bytes == 32 * 2**30  # "32 GiB"
    assert get_device("tpu-v5e").hbm_bytes == 16 * 10**9


def test_every_named_device_exists():
    names = {
        "a100-40gb",
        "a100-80gb",
        "h100-sxm",
        "h200-sxm",
        "tpu-v4",
        "tpu-v5e",
        "tpu-v5p",
        "cpu-sim",
    }
    assert names <= set(DEVICES)


def test_float32_fallbacks():
    a100 = get_device("a100-80gb")
    assert a100.flops_for("float32") == 156e12  # TF32 (XLA:GPU default precision)
    assert a100.flops_for("fp16") == 312e12
    assert get_device("tpu-v4").flops_for("float32") == 275e12  # one bf16 MXU pass
    assert a100.flops_for("float8") == 312e12  # no fp8 on A100: runs as 16-bit
    assert get_device("h100-sxm").flops_for("float8_e4m3fn") == 1979e12
    assert a100.flops_for("float64") == 19.5e12 / 2


def test_unknown_names_raise_with_choices():
    with pytest.raises(CostModelError, match="a100-80gb"):
        get_device("a100")
    with pytest.raises(CostModelError, match="known spellings"):
        get_device("a100-80gb").flops_for("complex64")


def test_validation():
    with pytest.raises(CostModelError, match="kind"):
        DeviceSpec("x", "fpga", {"bfloat16": 1.0}, 1, 1.0, "")
    with pytest.raises(CostModelError, match="hbm_bandwidth"):
        DeviceSpec("x", "gpu", {"bfloat16": 1.0}, 1, 0.0, "")


def test_json_round_trip_and_hashable():
    for dev in DEVICES.values():
        again = DeviceSpec.from_json(dev.to_json())
        assert again == dev
        assert hash(again) == hash(dev)
    changed = dataclasses.replace(get_device("a100-80gb"), hbm_bytes=1)
    assert changed != get_device("a100-80gb")


def test_jax_device_kind_matching():
    assert device_for_jax_kind("NVIDIA A100-SXM4-80GB").name == "a100-80gb"
    assert device_for_jax_kind("NVIDIA A100-SXM4-40GB").name == "a100-40gb"
    assert device_for_jax_kind("NVIDIA H100 80GB HBM3").name == "h100-sxm"
    assert device_for_jax_kind("NVIDIA H200").name == "h200-sxm"
    assert device_for_jax_kind("TPU v5 lite").name == "tpu-v5e"
    assert device_for_jax_kind("cpu", "cpu").name == "cpu-sim"
    assert device_for_jax_kind("Some Future GPU") is None
