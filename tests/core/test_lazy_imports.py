"""``import autopar`` is lazy (PEP 562): every public name still resolves, the names that
are both a submodule and a function (``plan``, ``explain``, ``verify``) stay the function,
and reading a saved plan (``autopar show | explain | report | diff``) never imports JAX.

The JAX-free checks run in a fresh interpreter (this test process imported JAX long ago).
"""

from __future__ import annotations

import importlib
import inspect
import json
import subprocess
import sys
import textwrap
import types

import pytest

import autopar
from tests.core.test_plan import _plan

# Where each public name is defined, written out by hand from the package layout (not read
# from autopar's own lazy table): the name must be that very object.
_DEFINED_IN = {
    "autoparallel": "autopar.api",
    "AutoParallel": "autopar.api",
    "complete": "autopar.api",
    "evaluate": "autopar.api",
    "plan": "autopar.api",
    "verify": "autopar.api",
    "explain": "autopar.explain",
    "ExplainPathError": "autopar.explain",
    "Plan": "autopar.plan",
    "TensorSharding": "autopar.plan",
    "SearchOptions": "autopar.options",
    "LoadPlanError": "autopar.errors",
    "AutoparError": "autopar.errors",
    "Cluster": "cost_models",
    "Graph": "autopar.trace.graph",
    "ImportSpecsError": "autopar.export",
    "LoadSuiteError": "autopar.sweep.suite",
    "SaveCheckpointError": "autopar.checkpoint",
}
_MODULES = {"baselines", "checkpoint", "export", "report", "sweep", "trace"}


def test_every_name_in_all_resolves():
    assert len(autopar.__all__) == len(set(autopar.__all__))
    assert set(_DEFINED_IN) | _MODULES <= set(autopar.__all__)
    for name in autopar.__all__:
        value = getattr(autopar, name)
        assert value is not None, name
        assert name in dir(autopar), name
        if name in _MODULES:
            assert isinstance(value, types.ModuleType), name
            assert value is sys.modules[f"autopar.{name}"], name
        elif name in _DEFINED_IN:
            assert value is getattr(importlib.import_module(_DEFINED_IN[name]), name), name
    star: dict = {}
    exec("from autopar import *", star)  # noqa: S102  (what a user's star import gets)
    assert set(autopar.__all__) <= set(star)


def test_functions_named_like_submodules_stay_functions():
    import autopar.explain  # noqa: F401  (binds nothing over the function: the point)
    import autopar.plan  # noqa: F401
    import autopar.verify.report  # noqa: F401
    from autopar import explain, plan, verify

    for fn, module in (
        (plan, "autopar.api"),
        (explain, "autopar.explain"),
        (verify, "autopar.api"),
    ):
        assert inspect.isfunction(fn) and fn.__module__ == module, fn
    assert autopar.plan is plan and autopar.explain is explain and autopar.verify is verify
    # The modules stay importable by their dotted names.
    assert sys.modules["autopar.plan"].Plan is autopar.Plan
    assert sys.modules["autopar.explain"].explain is explain
    # autopar.trace is both: the package, and callable as trace(fn, *args).
    assert isinstance(autopar.trace, types.ModuleType) and callable(autopar.trace)
    # Submodules outside __all__ are reachable as attributes, as when imports were eager.
    assert autopar.lower is sys.modules["autopar.lower"]


def test_unknown_names_raise_attribute_error():
    assert not hasattr(autopar, "no_such_name")
    with pytest.raises(AttributeError, match="no attribute 'Planner'"):
        autopar.Planner  # noqa: B018
    assert not hasattr(autopar, "__wrapped__")


_NO_JAX = """
import contextlib, io, sys
import autopar
assert "jax" not in sys.modules, "import autopar imported jax"
from autopar import Plan, SearchOptions, Cluster, LoadPlanError
from autopar.cli import main
plan_path, out_html = sys.argv[1], sys.argv[2]
p = Plan.load(plan_path)
texts = []
for argv in (["show", plan_path], ["explain", plan_path, "state/params/w"],
             ["report", plan_path, "-o", out_html], ["diff", plan_path, plan_path]):
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(argv) == 0, argv
    texts.append(buf.getvalue())
loaded = sorted(m for m in ("jax", "jaxlib", "flax", "optax") if m in sys.modules)
print(loaded, p.num_devices, len(texts[0]) > 0, "column(tensor)" in texts[0],
      "plans are identical" in texts[3], sep="|")
"""


def test_reading_a_saved_plan_imports_no_jax(tmp_path):
    path = tmp_path / "plan.json"
    _plan().save(path)
    html = tmp_path / "report.html"
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_NO_JAX), str(path), str(html)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    # The hand-written plan of test_plan: mesh data=2 x tensor=4 (8 devices), its first
    # layer's q is column-split over tensor.
    assert proc.stdout.strip().splitlines()[-1] == "[]|8|True|True|True"
    assert html.read_text().lower().startswith("<!doctype html>")
    assert json.loads(path.read_text())["mesh"] == {"data": 2, "tensor": 4}
