"""``autopar demo``: a small GPT train step planned and run on 8 simulated devices.

The step is planned for a described cluster (one DGX A100 node by default: 8 GPUs, the
same device count as the 8 simulated CPU devices it runs on), run for a few steps with
``@autoparallel``, and its losses are checked against single-device ``jax.jit``. The plan
and what XLA compiled (``verify``) are printed, and a report directory is written.

The model comes from the model registry (:mod:`autopar.registry`): the ``"demo"`` preset
of the family registered as ``"gpt"`` (the zoo's ``benchmarks.models.gpt``), so the
library itself imports no model package.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import jax
import numpy as np

from autopar.api import autoparallel
from autopar.errors import AutoparError
from autopar.options import SearchOptions
from autopar.plan import spec_axes
from autopar.registry import model_step
from autopar.report import summary, write_report
from autopar.report.text import render

DEMO_MODEL = "gpt"
"""Registered name of the demo's model family (see :mod:`autopar.registry`)."""
DEMO_PRESET = "demo"
"""Its preset: 4 layers, hidden 128, 4 heads, sequence 64, vocabulary 512, fp32."""
DEMO_BATCH = 16

LOSS_RTOL = 1e-5
"""Loss agreement with single-device f32 (DESIGN.md: 'loss to 1e-5 in f32')."""


@dataclass(frozen=True)
class DemoResult:
    """What the demo measured."""

    losses_single: tuple[float, ...]
    losses_parallel: tuple[float, ...]
    max_rel_error: float
    report_path: str
    plan_seconds: float
    first_call_seconds: float
    splits: tuple[tuple[str, tuple[str, ...]], ...] = ()
    """``(input path, mesh axes)`` for every argument leaf the plan splits."""

    @property
    def ok(self) -> bool:
        """Losses agree and the plan splits something (a replicated plan would pass the
        numerics check without exercising any sharding)."""
        return self.max_rel_error <= LOSS_RTOL and bool(self.splits)


def run_demo(
    steps: int = 3,
    out_dir: str = "autopar-report",
    cluster: str = "dgx-a100-80gb",
    mesh: dict[str, int] | None = None,
    cache: bool | str = True,
    echo: Callable[[str], None] = print,
) -> DemoResult:
    """Plan, run and check the demo GPT step; returns the measured numbers.

    Example:
        >>> result = run_demo(steps=2, out_dir="/tmp/autopar-demo")     # doctest: +SKIP
        >>> result.ok                                                   # doctest: +SKIP
        True
    """
    from cost_models import Cluster

    n = jax.device_count()
    if n != 8:
        raise AutoparError(
            f"the demo needs 8 devices and JAX sees {n}; run it through `autopar demo`, which "
            "sets XLA_FLAGS=--xla_force_host_platform_device_count=8 before JAX starts."
        )
    model = model_step(DEMO_MODEL, DEMO_PRESET, DEMO_BATCH, abstract=False)
    config, batch_size = model.config, DEMO_BATCH
    step_fn, (state, batch) = model.step_fn, model.args
    target = Cluster.preset(cluster)
    echo(
        f"Model: GPT {config.layers} layers, hidden {config.hidden}, {config.heads} heads, "
        f"seq {config.seq_len}, vocab {config.vocab_size}, batch {batch_size} (fp32, AdamW)"
    )
    echo(f"Planning for: {target.describe()}; running on {n} x {jax.devices()[0].platform}")

    # Single-device reference.
    ref = jax.jit(step_fn)
    ref_losses = []
    s = jax.device_put(state, jax.devices()[0])
    batch_1 = jax.device_put(batch, jax.devices()[0])
    for _ in range(steps):
        s, loss = ref(s, batch_1)
        ref_losses.append(float(loss))

    options = SearchOptions(mesh=mesh) if mesh else SearchOptions()
    # The loop replaces its state every step: donate it (autopar donates only what is
    # asked, and never a buffer the caller still holds: `state` is placed by copy).
    f = autoparallel(step_fn, cluster=target, options=options, cache=cache, donate_argnums=(0,))
    t0 = time.perf_counter()
    plan = f.plan_for(state, batch)
    plan_s = time.perf_counter() - t0
    timings = f.last_timings
    echo(
        f"Traced in {timings.get('trace_s', 0):.2f} s, planned in {timings.get('plan_s', 0):.2f} s"
        + (" (plan cache hit)" if timings.get("cache_hit") else "")
        + f", lowered in {timings.get('lower_s', 0):.2f} s"
    )
    echo(summary(plan))
    splits = tuple((r.path, spec_axes(r.spec)) for r in plan.inputs if spec_axes(r.spec))
    by_axis: dict[str, int] = {}
    for _, axes in splits:
        for a in axes:
            by_axis[a] = by_axis.get(a, 0) + 1
    if splits:
        echo(
            f"The plan splits {len(splits)} of {len(plan.inputs)} argument leaves: "
            + ", ".join(f"{n} over {a}" for a, n in by_axis.items())
            + f" (e.g. {splits[0][0]} over {', '.join(splits[0][1])})"
        )
    else:
        echo("The plan splits no argument: every device runs the whole step (NOT sharded).")

    par_losses = []
    s = state
    t0 = time.perf_counter()
    for i in range(steps):
        s, loss = f(s, batch)
        par_losses.append(float(loss))
        if i == 0:
            first_s = time.perf_counter() - t0
    rel = [abs(a - b) / max(abs(a), 1e-12) for a, b in zip(ref_losses, par_losses, strict=True)]
    max_rel = float(np.max(rel))

    from rich.table import Table

    table = Table(title=f"Loss: autopar on mesh {dict(plan.mesh)} vs single-device jax.jit")
    for c in ("step", "single device", "autopar", "rel. error"):
        table.add_column(c, justify="right")
    for i, (a, b, r) in enumerate(zip(ref_losses, par_losses, rel, strict=True)):
        table.add_row(str(i), f"{a:.6f}", f"{b:.6f}", f"{r:.1e}")
    loss_text = render(table)
    echo(loss_text)
    verdict = "OK" if max_rel <= LOSS_RTOL else "MISMATCH"
    echo(f"Numerics: max relative loss error {max_rel:.2e} (tolerance {LOSS_RTOL:g}): {verdict}")

    verify_report = f.verify(state, batch)
    verify_text = str(verify_report)
    echo(verify_text)
    path = write_report(
        plan,
        out_dir,
        sections={"Loss check": loss_text + verdict, "Predicted vs compiled": verify_text},
        verify=verify_report,
    )
    echo(f"Report written to {path}")
    return DemoResult(
        losses_single=tuple(ref_losses),
        losses_parallel=tuple(par_losses),
        max_rel_error=max_rel,
        report_path=path,
        plan_seconds=plan_s,
        first_call_seconds=first_s,
        splits=splits,
    )
