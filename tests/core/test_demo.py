"""`autopar demo`, the README's main job, end to end through the CLI: the GPT-3 1.3B plan
for two DGX nodes, then the small GPT run on 8 simulated devices (about a minute on 2
cores: the 1.3B search is ~15 s of it, the small GPT's plan, compile and verify the rest).
"""

import os
import re

import autopar.demo
from autopar.cli import main


def test_demo_plans_runs_and_checks_itself(tmp_path, monkeypatch, capsys):
    results = []
    run_demo = autopar.demo.run_demo

    def recording(**kwargs):
        results.append(run_demo(**kwargs))
        return results[-1]

    monkeypatch.setattr(autopar.demo, "run_demo", recording)
    monkeypatch.setenv("AUTOPAR_CACHE_DIR", str(tmp_path / "cache"))  # a cold plan cache
    assert main(["demo", "--steps", "2", "--out", str(tmp_path / "report")]) == 0
    (result,) = results
    text = capsys.readouterr().out

    # 1. The plan that matters: GPT-3 XL, 1.3B parameters (Brown et al. 2020 table 2.1:
    # 24 layers of 12 h^2 = 1.208e9 weights, 50257 x 2048 + 2048 x 2048 embeddings =
    # 0.107e9, plus biases and norms), on 2 nodes x 8 GPUs, every axis of its mesh used.
    big = result.big
    assert big is not None and big.preset == "gpt3-1.3b"
    assert abs(big.parameters - (24 * 12 * 2048**2 + 50257 * 2048 + 2048**2)) < 0.01e9
    assert big.devices == 16 and big.idle_axes == ()
    assert not big.cache_hit
    assert "1.32B parameters" in text and "2 nodes x 8 a100-80gb = 16 devices" in text
    assert "Every mesh axis splits something." in text
    mesh = " x ".join(f"{a}={n}" for a, n in big.mesh)
    assert f"Plan 'autopar': mesh {mesh} (16 devices)" in text
    # It fits an 80 GB A100.
    assert 0 < big.memory_bytes_per_device < 80e9

    # 2. The run that checks: losses against single-device jax.jit, 1e-5 relative in f32
    # (DESIGN.md), with the batch's tokens split over data (a replicated plan would pass
    # the loss check too).
    assert len(result.losses_parallel) == 2
    assert result.max_rel_error <= 1e-5
    assert result.ok
    tokens = dict(result.splits).get("batch/tokens", ())
    assert "data" in tokens, result.splits
    assert "The plan splits" in text
    assert re.search(r"Numerics: max relative loss error \S+ \(tolerance 1e-05\): OK", text)
    # verify compared collectives and memory with what XLA compiled, and found them within
    # the acceptance bounds; the state was donated, so memory is compared in place.
    assert "ok: True" in text
    assert "new state beside the old" not in text
    assert os.path.isfile(result.report_path)
    # The big plan comes first.
    assert text.index("Every mesh axis") < text.index("Numerics:")
