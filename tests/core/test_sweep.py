"""``autopar sweep``: the smoke suite through the CLI, its CSV checked against sums done by
hand, resumability, atomic writes, and bad suite files.

Hand-derived values: the zoo's ``tiny`` GPT (V=256, s=32, h=64, 2 layers, 4 heads, MLP
4h) has N = 256*64 + 32*64 + 2*(4*(64*64+64) + (64*256+256) + (256*64+64) + 4*64) + 2*64
= 118,528 parameters; its mixed-precision AdamW state is bf16 parameters (2 B each), an
fp32 master copy and fp32 Adam mu and nu (12 B each) and one int32 step count (4 B); its
gradients are bf16 (2 B each). Model FLOPs by Megatron-LM's count (Narayanan et al.
2021, eq. 3 without recomputation): 72 B s l h^2 (1 + s/(6h) + V/(12 l h)).
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from autopar.cli import main
from autopar.sweep import CSV_COLUMNS, LoadSuiteError, atomic_write, load_suite, run_sweep

SMOKE = Path(__file__).resolve().parents[2] / "benchmarks/suites/smoke.toml"
ALPA = SMOKE.parent / "alpa_gpt.toml"
N = 256 * 64 + 32 * 64 + 2 * (4 * (64 * 64 + 64) + (64 * 256 + 256) + (256 * 64 + 64) + 4 * 64)
N += 2 * 64
PLANS = ["autopar", "data_parallel", "zero3", "megatron_3d", "fsdp_tensor"]


@pytest.fixture(scope="module")
def smoke_out(tmp_path_factory):
    """The smoke suite's 2-device point through the CLI (no compiled check: see the slow
    test below for the compiled point)."""
    out = tmp_path_factory.mktemp("sweep")
    code = main(["sweep", str(SMOKE), "-o", str(out), "--points", "tiny-2", "--no-compile"])
    assert code == 0
    return out


def _csv(out: Path) -> list[dict[str, str]]:
    with open(out / "results.csv", newline="") as f:
        return list(csv.DictReader(f))


def test_hand_count_of_tiny_gpt():
    from benchmarks.models.gpt import GPTConfig

    assert N == 118_528 == GPTConfig.preset("tiny").num_params()


def test_smoke_suite_outputs(smoke_out, capsys):
    rows = _csv(smoke_out)
    assert list(rows[0]) == list(CSV_COLUMNS)
    assert [r["plan"] for r in rows] == PLANS  # every baseline reported, none dropped
    assert {r["point"] for r in rows} == {"tiny-2"}
    assert (smoke_out / "throughput.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    by = {r["plan"]: r for r in rows}
    assert by["data_parallel"]["mesh"] == "data 2"
    assert by["zero3"]["mesh"] == "data 2"
    # FSDP + tensor with the suite's tensor = 2 on 2 devices; Megatron: tensor = the devices.
    assert by["fsdp_tensor"]["mesh"] == "data 1 x tensor 2"
    assert by["megatron_3d"]["mesh"] == "data 1 x tensor 2"
    assert by["megatron_3d"]["remat"] == "full"
    for r in rows:
        assert r["status"] == "ok" and r["fits"] == "True", r
        step = float(r["step_time_s"])
        # samples/s and TFLOP/s per device from the step time, by hand.
        assert float(r["samples_per_s"]) == pytest.approx(8 / step, rel=1e-5)
        flops = 72 * 8 * 32 * 2 * 64**2 * (1 + 32 / (6 * 64) + 256 / (12 * 2 * 64))
        # the traced count also has the layer norms, softmax and loss: within 5%
        assert float(r["tflops_per_device"]) * 1e12 * step * 2 == pytest.approx(flops, rel=0.05)
        assert float(r["mfu"]) == pytest.approx(float(r["tflops_per_device"]) / 312, rel=1e-4)
        assert float(r["limit_gib"]) == pytest.approx(80e9 / 2**30, rel=1e-5)
    # The printed table names every plan.
    assert main(["sweep", str(SMOKE), "-o", str(smoke_out), "--points", "tiny-2"]) == 0
    out = capsys.readouterr().out
    assert all(p in out for p in PLANS)
    assert "autopar >= every baseline that fits, at every point" in out


def test_baseline_memory_by_hand(smoke_out):
    data = json.loads((smoke_out / "results.json").read_text())
    (record,) = data["points"].values()
    rows = {r["plan"]: r for r in record["rows"]}
    dp, z3 = rows["data_parallel"], rows["zero3"]
    # Data parallel: everything replicated on each of the 2 devices.
    assert dp["memory_breakdown"]["params"] == 2 * N
    assert dp["memory_breakdown"]["optimizer"] == 12 * N + 4
    assert dp["memory_bytes"] >= 2 * N + 2 * N + 12 * N + 4  # + bf16 grads, at least
    # ZeRO-3 over 2 devices: parameters and optimizer state halved (the count replicated).
    assert z3["memory_breakdown"]["params"] == 2 * N / 2
    assert z3["memory_breakdown"]["optimizer"] == 12 * N / 2 + 4
    csv_dp = next(r for r in _csv(smoke_out) if r["plan"] == "data_parallel")
    assert float(csv_dp["memory_gib"]) == pytest.approx(dp["memory_bytes"] / 2**30, rel=1e-5)


def test_baseline_matches_public_evaluate(smoke_out):
    """The data-parallel row is what ``autopar.evaluate`` says of ``baselines.data_parallel``
    on the same cluster (one node of 2 A100s)."""
    import autopar
    from autopar import baselines
    from benchmarks.models.gpt import GPTConfig, make_train_step
    from cost_models import Cluster

    step, args = make_train_step(GPTConfig.preset("tiny"), 8)
    graph = autopar.trace(step, *args)
    ev = autopar.evaluate(
        graph,
        baselines.data_parallel(graph, {"data": 2}),
        Cluster.preset("dgx-a100-80gb", devices_per_node=2),
    )
    row = next(r for r in _csv(smoke_out) if r["plan"] == "data_parallel")
    assert float(row["step_time_s"]) == pytest.approx(ev.step_time_s, rel=1e-5)
    assert row["microbatches"] == "1"


def test_rerun_does_no_work(smoke_out, monkeypatch):
    import autopar.sweep.run as run

    before = (smoke_out / "results.json").read_text()
    calls = []
    monkeypatch.setattr(run, "run_point", lambda *a, **k: calls.append(a) or {})
    store = run_sweep(SMOKE, smoke_out, only=["tiny-2"])
    assert calls == []
    assert len(store.records()) == 1
    assert (smoke_out / "results.json").read_text() == before


def test_atomic_write_keeps_the_old_file(tmp_path, monkeypatch):
    import os

    path = tmp_path / "results.json"
    atomic_write(path, "old")

    def fail(*_):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", fail)
    with pytest.raises(OSError, match="disk full"):
        atomic_write(path, "new")
    assert path.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["results.json"]  # no temporary left


def _suite(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "bad.toml"
    path.write_text(text)
    return path


GOOD_HEAD = 'name = "x"\ncluster = "dgx-a100-80gb"\n'


def test_bad_suite_files(tmp_path, capsys):
    missing = _suite(
        tmp_path, GOOD_HEAD + '[[points]]\nname = "a"\nmodel = "gpt"\npreset = "tiny"\nbatch = 8\n'
    )
    with pytest.raises(LoadSuiteError, match=r"bad\.toml.*'points\[0\]\.devices'.*missing"):
        load_suite(missing)
    unknown = _suite(
        tmp_path,
        GOOD_HEAD + '[[points]]\nname = "a"\nmodel = "nosuchmodel"\npreset = "tiny"\nbatch = 8\ndevices = 8\n',
    )  # fmt: skip
    with pytest.raises(LoadSuiteError, match=r"bad\.toml.*'points\[0\]\.model'.*nosuchmodel"):
        load_suite(unknown)
    assert main(["sweep", str(unknown)]) == 2
    assert "points[0].model" in capsys.readouterr().err
    with pytest.raises(LoadSuiteError, match="'cluster'"):
        load_suite(_suite(tmp_path, 'name = "x"\n[[points]]\nname = "a"\n'))
    bad_baseline = GOOD_HEAD + 'baselines = ["alpa"]\n[[points]]\nname = "a"\n'
    with pytest.raises(LoadSuiteError, match="'baselines'.*'alpa'"):
        load_suite(_suite(tmp_path, bad_baseline))
    nodes = GOOD_HEAD + '[[points]]\nname="a"\nmodel="gpt"\npreset="tiny"\nbatch=8\ndevices=12\n'
    with pytest.raises(LoadSuiteError, match="'points\\[0\\]\\.devices'.*whole nodes"):
        load_suite(_suite(tmp_path, nodes))


def test_alpa_suite_is_alpas_table():
    suite = load_suite(ALPA)
    got = [
        (p.devices, p.config["hidden"], p.config["layers"], p.config["heads"], p.batch)
        for p in suite.points
    ]
    assert got == [
        (1, 1024, 24, 16, 1024),
        (2, 1536, 24, 16, 1024),
        (4, 2048, 24, 32, 1024),
        (8, 2560, 32, 32, 1024),
        (16, 4096, 32, 32, 1024),
        (32, 5120, 48, 40, 1024),
        (64, 8192, 48, 64, 1024),
    ]
    assert all(p.config["ffn_hidden"] == 4 * p.config["hidden"] for p in suite.points)
    c = suite.cluster_for(suite.points[2])
    assert (c.num_nodes, c.devices_per_node) == (1, 4)
    c = suite.cluster_for(suite.points[-1])
    assert (c.num_nodes, c.devices_per_node) == (8, 8)


@pytest.mark.slow
def test_smoke_suite_compiled_point(tmp_path):
    """The whole smoke suite with its compiled point: the data-parallel plan's compiled
    collective bytes equal the predicted ones (its gradient all-reduce over 8 devices)."""
    assert main(["sweep", str(SMOKE), "-o", str(tmp_path)]) == 0
    rows = {(r["point"], r["plan"]): r for r in _csv(tmp_path)}
    dp = rows[("tiny-8", "data_parallel")]
    assert float(dp["compiled_collective_bytes"]) == float(dp["predicted_collective_bytes"]) > 0
    assert float(dp["compiled_memory_gib"]) > 0
    assert rows[("tiny-2", "data_parallel")]["compiled_collective_bytes"] == ""


def test_store_keeps_mesh_order(tmp_path):
    """A mesh is ordered outer -> inner: the store must not sort its axes."""
    from autopar.sweep import ResultStore

    suite = load_suite(SMOKE)
    store = ResultStore(tmp_path / "results.json", suite)
    store.put("k", {"rows": [{"mesh": {"pipe": 2, "data": 4, "tensor": 8}}]})
    again = ResultStore(tmp_path / "results.json", suite)
    assert list(again.points["k"]["rows"][0]["mesh"]) == ["pipe", "data", "tensor"]


def test_losses_names_a_faster_fitting_baseline(tmp_path):
    """The acceptance check: a baseline that fits and is faster is a loss; one that is
    faster but does not fit is not."""
    from autopar.sweep import ResultStore
    from autopar.sweep.results import losses

    suite = load_suite(SMOKE)
    store = ResultStore(tmp_path / "results.json", suite)

    def row(plan, status, step):
        return {"plan": plan, "status": status, "step_time_s": step}

    rows = [
        row("autopar", "ok", 2.0),
        row("zero3", "ok", 1.0),
        row("data_parallel", "does_not_fit", 0.5),
    ]
    store.put(suite.points[0].key(), {"point": {"name": "tiny-8"}, "rows": rows})
    store.put(
        suite.points[1].key(),
        {"point": {"name": "tiny-2"}, "rows": [row("autopar", "ok", 1.0), row("zero3", "ok", 1.0)]},
    )
    assert losses(store) == [("tiny-8", "zero3", 2.0)]
