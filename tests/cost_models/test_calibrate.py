"""Calibration: fitting on synthetic timings, profile files, and the --quick CLI run."""

import json
import time

import pytest

from cost_models import (
    Cluster,
    CollectiveSample,
    Efficiency,
    MatmulSample,
    Profile,
    apply_profile,
    fit_matmul_efficiency,
    load_profile,
    save_profile,
)
from cost_models.profile import fit_alpha_beta, profile_filename


def synthetic(peak, pf, d0, shapes):
    eff = Efficiency(peak_fraction=pf, half_dim=d0)
    return [
        MatmulSample(m, n, k, "bfloat16", 2 * m * n * k / (peak * eff.matmul(m, n, k)))
        for m, n, k in shapes
    ]


def test_fit_recovers_the_curve():
    shapes = [(d, d, d) for d in (128, 256, 512, 1024, 4096)] + [
        (4096, 4096, 128),
        (8192, 256, 4096),
    ]
    d0 = 2 ** (26 / 4)  # on the fit's grid
    eff = fit_matmul_efficiency(synthetic(1e12, 0.7, d0, shapes), 1e12)
    assert eff.half_dim == pytest.approx(d0)
    assert eff.peak_fraction == pytest.approx(0.7)


def test_alpha_beta_fit():
    n, bw, alpha = 4, 50e9, 5e-6
    samples = [
        CollectiveSample("all-reduce", b, n, 2 * (n - 1) / n * b / bw + 2 * (n - 1) * alpha)
        for b in (1e6, 1e7, 1e8)
    ]
    got_bw, got_alpha = fit_alpha_beta(samples)
    assert got_bw == pytest.approx(bw) and got_alpha == pytest.approx(alpha)
    assert samples[0].bus_bandwidth == pytest.approx(2 * 3 / 4 * 1e6 / samples[0].seconds)
    assert fit_alpha_beta(samples[:1]) is None


def test_save_load_round_trip(tmp_path):
    prof = Profile(
        device_kind="NVIDIA H200",
        platform="gpu",
        jax_version="0.10.2",
        date="2025-01-01",
        num_devices=1,
        matmul=tuple(synthetic(989e12, 0.8, 64.0, [(8192, 8192, 8192)])),
        hbm_bandwidth=4.2e12,
        efficiency=Efficiency(peak_fraction=0.8),
        catalog_device="h200-sxm",
    )
    path = save_profile(prof, tmp_path)
    assert path.name == "nvidia-h200-0.10.2.json"
    assert json.loads(path.read_text())["matmul"][0]["flops_per_s"] == pytest.approx(
        prof.matmul[0].flops_per_s
    )
    assert load_profile("NVIDIA H200", directory=tmp_path) == prof
    assert load_profile("NVIDIA H100", directory=tmp_path) is None
    # newest JAX version wins without an explicit one
    newer = Profile(**{**prof.__dict__, "jax_version": "0.10.10"})
    save_profile(newer, tmp_path)
    assert load_profile("NVIDIA H200", directory=tmp_path).jax_version == "0.10.10"
    assert load_profile("NVIDIA H200", "0.10.2", directory=tmp_path).jax_version == "0.10.2"
    assert not list(tmp_path.glob(".profile-*"))  # temporary files replaced atomically


def test_apply_profile_to_gpu_cluster_not_cpu():
    samples = tuple(
        CollectiveSample("all-reduce", b, 8, 2 * 7 / 8 * b / 200e9 + 14 * 2e-6) for b in (1e6, 1e8)
    )
    prof = Profile(
        "NVIDIA A100-SXM4-80GB",
        "gpu",
        "0.10.2",
        "2025-01-01",
        8,
        (),
        1.8e12,
        samples,
        Efficiency(peak_fraction=0.7),
        "a100-80gb",
    )
    c = apply_profile(Cluster.preset("dgx-a100-80gb", nodes=2), prof)
    assert c.device.efficiency.peak_fraction == 0.7
    assert c.intra.bandwidth == pytest.approx(200e9) and c.intra.latency == pytest.approx(2e-6)
    assert c.inter.bandwidth == 25e9  # the network is not measured by a one-node calibration
    cpu = Cluster.preset("cpu-sim")
    assert apply_profile(cpu, prof) is cpu


def test_profile_filename():
    assert profile_filename("TPU v5 lite", "0.10.2") == "tpu-v5-lite-0.10.2.json"


def test_calibrate_quick_on_cpu(tmp_path):
    from cost_models.calibrate import main

    t0 = time.perf_counter()
    assert main(["--quick", "--out", str(tmp_path)]) == 0  # an exit status, for the CLI
    elapsed = time.perf_counter() - t0
    assert elapsed < 60
    prof = load_profile("cpu", directory=tmp_path)
    assert prof is not None and len(list(tmp_path.glob("cpu-*.json"))) == 1
    assert prof.platform == "cpu" and prof.num_devices == 8
    assert len(prof.matmul) >= 4 and all(s.seconds > 0 for s in prof.matmul)
    assert prof.hbm_bandwidth > 0
    kinds = {c.kind for c in prof.collectives}
    assert kinds == {"all-reduce", "all-gather"}
    assert 0 < prof.efficiency.peak_fraction <= 1
