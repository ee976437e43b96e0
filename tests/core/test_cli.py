"""CLI: every verb runs and prints what it should (issue 15 acceptance), and bad input is a
clear error (exit 2). Expected numbers come from the models' shapes and the hand-written
plan of ``tests.core.test_plan``, not from the program's own output. ``autopar demo`` is
run through the CLI by ``tests/core/test_demo.py``; ``sweep`` by its own tests."""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path

import jax

from autopar.cli import build_parser, main, parse_mesh
from autopar.plan import Plan, spec_axes
from tests.core.test_plan import _plan


def test_parse_mesh():
    assert parse_mesh("data=2,tensor=4") == {"data": 2, "tensor": 4}
    assert parse_mesh(None) is None


def test_bad_input_exits_2_with_a_message(capsys):
    assert main(["trace", "gpt", "--preset", "bogus"]) == 2
    assert "unknown GPT preset 'bogus'" in capsys.readouterr().err
    assert main(["plan", "gpt", "--mesh", "data=x"]) == 2
    assert "axis=size" in capsys.readouterr().err
    assert main(["show", "/nonexistent/plan.json"]) == 2
    assert "no plan file" in capsys.readouterr().err


def test_every_verb_is_tested_here_or_in_test_demo():
    verbs = set(build_parser()._subparsers._group_actions[0].choices)  # noqa: SLF001
    tested = {"demo", "trace", "plan", "show", "explain", "report", "diff", "calibrate"}
    assert verbs - {"sweep"} <= tested, verbs - tested


def test_show_prints_the_plans_numbers(tmp_path, capsys):
    a = tmp_path / "a.json"
    _plan().save(a)
    assert main(["show", str(a)]) == 0
    out = capsys.readouterr().out
    # The hand-written plan: mesh 2 x 4, ZeRO 1, selective remat, 2 pipeline stages of
    # 1F1B over 8 microbatches, 0.25 s per step of which 0.2 s compute, 1.5e9 bytes per
    # device (1.5e9 / 2**30 = 1.40 GiB; 1e9 bytes of parameters = 953.67 MiB), one
    # all-reduce row over tensor, 24 times 4096 bytes (4.00 KiB), 1 ms.
    assert "mesh data=2 x tensor=4 (8 devices), ZeRO stage 1, remat selective" in out
    assert "2 stages 1f1b x 8" in out
    assert re.search(r"step time\s*│\s*250\.00 ms", out)
    assert re.search(r"compute\s*│\s*200\.00 ms", out)
    assert re.search(r"memory per device\s*│\s*1\.40 GiB", out)
    assert re.search(r"params\s*│\s*953\.67 MiB", out)
    assert re.search(r"all-reduce\s*│\s*tensor\s*│\s*24\s*│\s*4\.00 KiB\s*│\s*1\.00 ms", out)
    assert re.search(r"h_0\s*│\s*q\s*│\s*column\(tensor\)", out)
    assert re.search(r"state/params/w\s*│\s*\(16, 32\)\s*│\s*float32\s*│\s*param", out)


def test_diff_names_each_difference(tmp_path, capsys):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    plan = _plan()
    plan.save(a)
    mu = dataclasses.replace(plan.inputs[1], spec=("data", None))
    dataclasses.replace(
        plan,
        mesh={"data": 4, "tensor": 2},
        zero_stage=3,
        inputs=(plan.inputs[0], mu, plan.inputs[2]),
        predicted=dataclasses.replace(plan.predicted, step_time_s=0.125),
    ).save(b)
    assert main(["diff", str(a), str(a)]) == 0
    assert "plans are identical" in capsys.readouterr().out
    assert main(["diff", str(a), str(b)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "mesh: data=2 x tensor=4  ->  data=4 x tensor=2" in lines
    assert "zero_stage: 1  ->  3" in lines
    assert "state/opt_state/mu/w: P(('data'), 'tensor')  ->  P('data', None)" in lines
    assert "predicted step time: 250.00 ms  ->  125.00 ms" in lines
    # Nothing else differs: the parameter and the batch keep their layouts.
    assert not [line for line in lines if line.startswith(("state/params/w", "batch/x"))]


def test_explain_gives_the_block_each_device_holds(tmp_path, capsys):
    a = tmp_path / "a.json"
    _plan().save(a)
    assert main(["explain", str(a), "state/params/w"]) == 0
    out = capsys.readouterr().out
    # w is [16, 32] float32 over P(None, 'tensor') on data=2 x tensor=4: dim 1 split 4
    # ways -> (16, 8) per device = 512 B of 2048 B, each block on the 2 data replicas.
    assert out.splitlines()[0].startswith("state/params/w  (param, float32, shape (16, 32))")
    assert "dim 1 (32): split over tensor (4 ways) -> 8 per device" in out
    assert "per device: (16, 8) float32 = 512 B of 2.00 KiB (1/4)" in out
    assert "held by 2 devices (replicated over data)" in out
    assert main(["explain", str(a), "params/nope"]) == 2
    assert "state/params/w" in capsys.readouterr().err  # the close match it suggests


def test_report_writes_a_page_about_the_plan(tmp_path, capsys):
    a = tmp_path / "a.json"
    _plan().save(a)
    assert main(["report", str(a), "--out", str(tmp_path / "report")]) == 0
    path = Path(capsys.readouterr().out.strip().splitlines()[-1])
    assert path.is_file() and path.suffix == ".html"
    html = path.read_text()
    assert html.lstrip().lower().startswith("<!doctype html")
    # The plan's leaves and axes are on the page, and nothing is fetched from the network.
    for word in ("state/params/w", "batch/x", "tensor", "data", "250.00 ms"):
        assert word in html, word
    assert not re.search(r"""(src|href)=["']https?://""", html)


def test_trace_counts_the_mlp(capsys):
    assert main(["trace", "mlp", "--preset", "tiny", "--batch", "4"]) == 0
    out = capsys.readouterr().out
    # MLP tiny: 16 -> 64 -> 64 -> 8 with biases: 16*64+64 + 64*64+64 + 64*8+8 = 5768
    # parameters (23,072 bytes in float32); 3 forward dots, 3 weight-gradient dots and 2
    # input-gradient dots (the first layer's input needs none); batch x [4, 16] and
    # y [4, 8] float32 = 96 elements, 384 bytes.
    assert "parameters: 5,768 (23.07 kB)" in out
    assert "dot_general x8" in out
    assert re.search(r"batch\s*│\s*2\s*│\s*96\s*│\s*384 B", out)
    assert re.search(r"Layers: 3\b", out)
    assert re.search(r"traced in \d+\.\d\d s", out)


def _param_bytes_per_device(plan: Plan) -> float:
    total = 0.0
    for r in plan.inputs:
        if r.role == "param":
            ways = math.prod(plan.mesh[a] for a in spec_axes(r.spec))
            total += math.prod(r.shape) * 4 / ways  # float32
    return total


def test_plan_prints_and_saves_the_searched_plan(tmp_path, capsys):
    out_path = tmp_path / "plan.json"
    argv = ["plan", "mlp", "--preset", "small", "--batch", "64", "--mesh", "data=8"]
    assert main([*argv, "--out", str(out_path)]) == 0
    out = capsys.readouterr().out
    assert "mesh data=8 (8 devices)" in out
    assert f"plan written to {out_path}" in out
    plan = Plan.load(out_path)
    # MLP small: 256 -> 1024 -> 1024 -> 256, batch 64.
    shapes = {r.path: r.shape for r in plan.inputs}
    assert shapes["state/params/layer_0/w"] == (256, 1024)
    assert shapes["state/params/layer_1/w"] == (1024, 1024)
    assert shapes["state/params/layer_2/w"] == (1024, 256)
    assert shapes["batch/x"] == (64, 256)
    assert plan.mesh == {"data": 8}
    # The memory table's parameter row is the parameters' bytes over the ways each is
    # split, summed from the saved layouts here.
    from autopar.report.text import format_bytes

    expected = format_bytes(_param_bytes_per_device(plan))
    assert re.search(rf"params\s*│\s*{re.escape(expected)}", out), expected


def test_calibrate_measures_and_writes_a_profile(tmp_path, capsys):
    assert main(["calibrate", "--quick", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    # A profile per backend and JAX version: here the 8 simulated CPU devices.
    path = tmp_path / f"cpu-{jax.__version__}.json"
    assert f"wrote {path}" in " ".join(out.split())  # (rich wraps the long path)
    profile = json.loads(path.read_text())
    assert profile["device_kind"] == "cpu" and profile["jax_version"] == jax.__version__
    assert profile["matmul"] and profile["collectives"]
    for s in profile["matmul"]:
        # Rate = 2 m n k FLOPs / time.
        assert s["seconds"] > 0
        assert math.isclose(s["flops_per_s"], 2 * s["m"] * s["n"] * s["k"] / s["seconds"])
        assert f"{s['m']}x{s['n']}x{s['k']}" in out
    for c in profile["collectives"]:
        # NCCL's bus bandwidth: bytes / time x 2(n-1)/n for an all-reduce, (n-1)/n for an
        # all-gather (nccl-tests' PERFORMANCE.md).
        n = c["num_devices"]
        factor = {"all-reduce": 2 * (n - 1) / n, "all-gather": (n - 1) / n}[c["kind"]]
        assert math.isclose(c["bus_bandwidth"], c["nbytes"] / c["seconds"] * factor)


def test_show_into_a_closed_pipe_is_not_an_error(tmp_path):
    """`autopar show plan.json | head -1`: the reader leaves early; no traceback, status 0."""
    import subprocess
    import sys

    a = tmp_path / "a.json"
    _plan().save(a)
    p = subprocess.Popen(
        [sys.executable, "-m", "autopar.cli", "show", str(a)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    p.stdout.close()  # the reader is gone before the plan is printed
    err = p.stderr.read().decode()
    assert p.wait(timeout=120) == 0, err
    assert "Traceback" not in err and "BrokenPipeError" not in err, err
