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
