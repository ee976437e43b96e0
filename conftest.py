"""pytest setup for ``tests/`` and for the docstring examples of ``autopar`` and ``cost_models``.

8 simulated CPU devices, set before jax is imported anywhere: pytest imports this root
conftest before any test module or doctested module.

Docstring examples may use these names without defining them (built on first use, once per
session; a name the module itself defines is left alone):

* ``autopar``, ``jax``, ``jnp``, ``np``, ``Cluster``, ``SearchOptions``.
* ``step``, ``state``, ``batch``: a 2-layer MLP AdamW train step (``benchmarks.models.mlp``,
  256 -> 1024 -> 256 features) and its concrete arguments, a batch of 64.
* ``graph``: ``autopar.trace(step, state, batch)``.
* ``cluster``: ``Cluster.preset("dgx-a100-80gb")``, one node of 8 A100s.
* ``plan``: ``autopar.plan(graph, cluster=cluster, options=SearchOptions(memory_limit_bytes=4_000_000))``,
  the searched plan under 4 MB per device. The replicated step holds 6.3 MB of parameters and
  AdamW moments alone (525,568 float32 parameters x 3), so the bound makes the plan split the
  layers (data 2 x tensor 4); unbounded, the cost model replicates this latency-bound step
  (13.3 us, against 14.8 us with the split's 64 KiB tensor all-reduce of 11.1 us).
* ``tmp_dir``: a fresh temporary directory (pytest's ``tmp_path``) for examples that write.
"""

import ast
import doctest
import functools
import importlib
import os

import pytest

_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
    os.environ["XLA_FLAGS"] = (_flags + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")


@functools.cache
def _mlp():
    from benchmarks.models.mlp import MLPConfig, make_train_step

    step, (state, batch) = make_train_step(
        MLPConfig(d_in=256, hidden=1024, d_out=256, layers=2), 64, abstract=False
    )
    return step, state, batch


@functools.cache
def _graph():
    import autopar

    return autopar.trace(*_mlp())


@functools.cache
def _cluster():
    from cost_models import Cluster

    return Cluster.preset("dgx-a100-80gb")


@functools.cache
def _plan():
    import autopar

    options = autopar.SearchOptions(memory_limit_bytes=4_000_000)
    return autopar.plan(_graph(), cluster=_cluster(), options=options)


_EXAMPLE_NAMES = {
    "autopar": lambda: importlib.import_module("autopar"),
    "jax": lambda: importlib.import_module("jax"),
    "jnp": lambda: importlib.import_module("jax.numpy"),
    "np": lambda: importlib.import_module("numpy"),
    "Cluster": lambda: importlib.import_module("cost_models").Cluster,
    "SearchOptions": lambda: importlib.import_module("autopar").SearchOptions,
    "step": lambda: _mlp()[0],
    "state": lambda: _mlp()[1],
    "batch": lambda: _mlp()[2],
    "graph": _graph,
    "cluster": _cluster,
    "plan": _plan,
}


def _free_names(examples) -> set[str]:
    """Names the examples that run read before (or without) binding them themselves."""
    bound: set[str] = set()
    free: set[str] = set()
    for ex in examples:
        if ex.options.get(doctest.SKIP):
            continue
        try:
            nodes = list(ast.walk(ast.parse(ex.source)))
        except SyntaxError:
            continue
        free |= {
            n.id for n in nodes if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)
        } - bound
        for n in nodes:
            if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
                bound.add(n.id)
            elif isinstance(n, ast.FunctionDef | ast.ClassDef):
                bound.add(n.name)
            elif isinstance(n, ast.Import | ast.ImportFrom):
                bound |= {(a.asname or a.name).split(".")[0] for a in n.names}
    return free


@pytest.fixture(autouse=True)
def _docstring_example_names(request):
    """Give a doctest those of the names listed above that it uses and its module lacks."""
    dtest = getattr(request.node, "dtest", None)
    if dtest is None:  # not a doctest
        yield
        return
    doctest_namespace = request.getfixturevalue("doctest_namespace")
    added = {}
    for name in _free_names(dtest.examples) - set(dtest.globs):
        if name in _EXAMPLE_NAMES:
            added[name] = _EXAMPLE_NAMES[name]()
        elif name == "tmp_dir":
            added[name] = request.getfixturevalue("tmp_path")
    doctest_namespace.update(added)
    yield
    for name in added:
        doctest_namespace.pop(name, None)
