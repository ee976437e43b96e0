"""Report: text summary, plan diff, HTML report files."""

import os

from autopar.report import diff, format_bytes, format_seconds, format_spec, summary, write_report
from tests.core.test_plan import _plan


def test_formatting():
    assert format_bytes(1536) == "1.50 KiB"
    assert format_bytes(12) == "12 B"
    assert format_seconds(2.5) == "2.500 s"
    assert format_seconds(2.5e-5) == "25.0 us"
    assert format_spec((("data", "fsdp"), None)) == "P(('data', 'fsdp'), None)"


def test_summary_mentions_the_plan():
    text = summary(_plan())
    assert "data=2 x tensor=4" in text
    assert "250.00 ms" in text  # step_time_s = 0.25
    assert "column(tensor)" in text
    assert "state/params/w" in text


def test_summary_names_an_axis_that_splits_nothing():
    from dataclasses import replace

    from autopar.plan import ActivationConstraint, Plan, PredictedCollective, TensorSharding

    plan = Plan(
        mesh={"data": 4, "tensor": 2},
        inputs=(TensorSharding("batch/x", (8, 16), "float32", ("data", None), "batch"),),
        outputs=(TensorSharding("loss", (), "float32", (), "other"),),
    )
    plan = replace(
        plan,
        predicted=replace(
            plan.predicted,
            collectives=(PredictedCollective("all-reduce", ("data",), 64.0, 1, 1e-5),),
        ),
    )
    assert "'tensor' splits nothing" in summary(plan)
    assert "(the plan on 4 devices, 2 times over)" in summary(plan)
    # An activation split over tensor uses it.
    used = replace(plan, activations=(ActivationConstraint(3, 0, (None, "tensor")),))
    assert "splits nothing" not in summary(used)
    assert "splits nothing" not in summary(_plan())


def test_diff_lists_changes():
    from dataclasses import replace

    a = _plan()
    assert diff(a, a) == "plans are identical"
    b = replace(a, mesh={"data": 8}, zero_stage=3)
    text = diff(a, b)
    assert "mesh: data=2 x tensor=4  ->  data=8" in text
    assert "zero_stage: 1  ->  3" in text


def test_write_report(tmp_path):
    out = tmp_path / "rep"
    index = write_report(_plan(), str(out), sections={"verify": "all good"})
    assert os.path.basename(index) == "index.html"
    assert sorted(os.listdir(out)) == [
        "index.html",
        "memory.png",
        "plan.json",
        "summary.txt",
        "time.png",
    ]
    assert "all good" in (out / "index.html").read_text()
