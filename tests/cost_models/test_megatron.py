"""The analytic Megatron-LM estimate vs the published Tables 1 and 2 (Narayanan et al. SC'21).

Tolerance: every row within 15% of the published TFLOP/s per GPU, with the one set of
constants in cost_models/megatron.py (matmul peak_fraction fitted once on Table 1, overlap
efficiency on Table 2's ZeRO-3 rows). The default run checks the fast rows; ``-m slow``
checks every row and re-derives the fitted constant.
"""

import csv
from pathlib import Path

import pytest

from cost_models import CostModelError
from cost_models.megatron import (
    GPT,
    MEGATRON_2021_PEAK_FRACTION,
    TABLE1,
    TABLE2,
    Parallel,
    default_chunks,
    estimate_iteration,
    fit_peak_fraction,
    selene,
    table1,
    table2,
)

TOLERANCE = 0.15
REFERENCE = Path(__file__).resolve().parents[3] / "shared" / "reference"

FAST_T1 = ["1.7B", "7.5B", "18.4B", "145.6B", "310.1B"]
FAST_T2 = [
    "zero3 174.6B x384",
    "zero3 174.6B x768",
    "zero3 174.6B x1536",
    "zero3 529.6B x640",
    "zero3 529.6B x2240",
    "ptdp 174.6B x384",
    "ptdp 174.6B x1536",
]


@pytest.mark.parametrize("row", table1(labels=FAST_T1), ids=lambda r: r.label)
def test_table1_rows_within_tolerance(row):
    assert abs(row.error) < TOLERANCE, (
        f"{row.label}: {row.estimate.tflops_per_gpu:.1f} vs {row.published}"
    )


@pytest.mark.parametrize("row", table2(labels=FAST_T2), ids=lambda r: r.label)
def test_table2_rows_within_tolerance(row):
    assert abs(row.error) < TOLERANCE, (
        f"{row.label}: {row.estimate.tflops_per_gpu:.1f} vs {row.published}"
    )


def test_zero3_collapses_while_ptdp_holds():
    gpt3 = GPT(l=96, h=12288, a=96)
    z = {
        g: estimate_iteration(
            gpt3, Parallel(d=g, B=1536, b=1536 // g, scheme="zero3")
        ).tflops_per_gpu
        for g in (384, 1536)
    }
    ptdp = estimate_iteration(gpt3, Parallel(t=8, p=12, d=16, B=1536)).tflops_per_gpu
    assert z[1536] < 0.5 * z[384]  # published: 144 -> 44
    assert ptdp > 2.5 * z[1536]  # published: 141 vs 44


def test_breakdown_is_consistent():
    est = estimate_iteration(GPT(l=96, h=12288, a=96), Parallel(t=8, p=12, d=16, B=1536))
    bd = est.breakdown
    parts = bd["compute"] + bd["tensor"] + bd["bubble"] + bd["dp_grad"]
    assert est.time_s == pytest.approx(parts)
    assert bd["compute"] > bd["tensor"] > 0 and bd["bubble"] > 0
    assert est.chunks == 2 and est.microbatches == 96


def test_default_chunks_rule():
    assert default_chunks(24, 1, 16) == 1
    assert default_chunks(48, 2, 48) == 2
    assert default_chunks(60, 4, 56) == 3
    assert default_chunks(105, 35, 280) == 3
    assert default_chunks(96, 12, 100) == 1  # m not a multiple of p


def test_inputs_validated():
    with pytest.raises(CostModelError, match="t and p must be 1"):
        Parallel(t=8, d=4, B=64, scheme="zero3")
    with pytest.raises(CostModelError, match="does not split"):
        Parallel(d=3, B=64)
    with pytest.raises(CostModelError, match="heads"):
        GPT(l=2, h=100, a=3)
    with pytest.raises(CostModelError, match="8 GPUs"):
        selene(12)


@pytest.mark.skipif(not REFERENCE.is_dir(), reason="../shared/reference not present")
def test_published_rows_match_reference_csv():
    with open(REFERENCE / "megatron2021_table1.csv") as f:
        rows1 = [
            (
                float(r["params_b"]),
                int(r["heads"]),
                int(r["hidden"]),
                int(r["layers"]),
                int(r["tensor"]),
                int(r["pipeline"]),
                int(r["gpus"]),
                int(r["global_batch"]),
                float(r["tflops_per_gpu"]),
            )
            for r in csv.DictReader(f)
        ]
    assert tuple(rows1) == TABLE1
    with open(REFERENCE / "megatron2021_table2.csv") as f:
        rows2 = [
            (
                r["scheme"],
                float(r["params_b"]),
                int(r["tensor"]),
                int(r["pipeline"]),
                int(r["global_batch"]),
                int(r["gpus"]),
                int(r["microbatch"]),
                float(r["tflops_per_gpu"]),
            )
            for r in csv.DictReader(f)
        ]
    assert tuple(rows2) == TABLE2


@pytest.mark.slow
def test_every_row_within_tolerance():
    for row in table1() + table2():
        assert abs(row.error) < TOLERANCE, (
            f"{row.label}: {row.estimate.tflops_per_gpu:.1f} vs {row.published}"
        )


@pytest.mark.slow
def test_fitted_constant_is_reproducible():
    assert fit_peak_fraction() == pytest.approx(MEGATRON_2021_PEAK_FRACTION, abs=0.005)
