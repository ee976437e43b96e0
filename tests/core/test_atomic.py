"""Atomic writes: the old file survives a failed write, and files get open()'s permissions."""

from __future__ import annotations

import os
import stat

import pytest

from autopar.atomic import atomic_path, atomic_write


def test_mode_is_what_open_would_give(tmp_path):
    old = os.umask(0o022)
    try:
        atomic_write(tmp_path / "a.json", "{}")
        with open(tmp_path / "b.json", "w") as f:
            f.write("{}")
    finally:
        os.umask(old)
    mode_a = stat.S_IMODE(os.stat(tmp_path / "a.json").st_mode)
    mode_b = stat.S_IMODE(os.stat(tmp_path / "b.json").st_mode)
    assert mode_a == mode_b == 0o644


def test_failed_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path):
    target = tmp_path / "plan.json"
    atomic_write(target, "old")
    with pytest.raises(RuntimeError), atomic_path(target) as tmp:
        with open(tmp, "w") as f:
            f.write("half a pla")
        raise RuntimeError("crash mid-write")
    assert target.read_text() == "old"
    assert os.listdir(tmp_path) == ["plan.json"]


def test_saved_plan_is_readable_by_others(tmp_path):
    from autopar.plan import Plan

    plan = Plan.from_json(Plan(name="p", mesh={"data": 2}).to_json())
    old = os.umask(0o022)
    try:
        plan.save(tmp_path / "plan.json")
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(tmp_path / "plan.json").st_mode) == 0o644
    assert Plan.load(tmp_path / "plan.json").mesh == {"data": 2}
