"""The search's progress bar: silent for quick searches, shown for long ones."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import pytest

import autopar
from autopar import SearchOptions
from autopar.progress import SearchProgress
from autopar.search import plan_graph
from cost_models import Cluster


def test_a_quick_search_shows_nothing(monkeypatch):
    monkeypatch.delenv("AUTOPAR_PROGRESS", raising=False)
    with SearchProgress(3, "meshes", show_after_s=60.0) as bar:
        for _ in range(3):
            bar.advance("step")
    assert (bar.done, bar.shown) == (3, False)


def test_a_search_past_the_threshold_shows_the_bar(monkeypatch):
    monkeypatch.delenv("AUTOPAR_PROGRESS", raising=False)
    with SearchProgress(2, "meshes", show_after_s=0.05) as bar:
        bar.advance("first")
        assert not bar.shown
        time.sleep(0.1)
        bar.advance("second")
        assert bar.shown
    assert bar.done == 2


def test_a_search_inside_a_search_shows_one_bar(monkeypatch):
    monkeypatch.setenv("AUTOPAR_PROGRESS", "1")
    with SearchProgress(1, "plan") as outer:
        with SearchProgress(2, "meshes") as inner:
            inner.advance("a")
            inner.advance("b")
        outer.advance("x")
        assert outer.shown and not inner.shown
    with SearchProgress(1, "again") as after:  # the count is released on exit
        after.advance("y")
        assert after.shown


@pytest.mark.parametrize(("setting", "shown"), [("0", False), ("1", True)])
def test_the_environment_turns_it_off_or_on(monkeypatch, setting, shown):
    monkeypatch.setenv("AUTOPAR_PROGRESS", setting)
    with SearchProgress(1, "meshes", show_after_s=0.0 if setting == "0" else 60.0) as bar:
        bar.advance("x")
    assert bar.shown is shown


def test_plan_graph_runs_with_the_bar_on(monkeypatch):
    monkeypatch.setenv("AUTOPAR_PROGRESS", "1")

    def step(w, x):
        return jnp.mean(jnp.tanh(x @ w) ** 2)

    g = autopar.trace(jax.grad(step), jnp.ones((64, 64)), jnp.ones((32, 64)))
    plan = plan_graph(g, Cluster.preset("dgx-a100-80gb"), SearchOptions(mesh={"data": 8}))
    assert plan.mesh == {"data": 8}
