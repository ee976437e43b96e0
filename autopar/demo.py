"""``autopar demo``: plan a model for which parallelism matters, then run a small one.

1. *The plan that matters.* A GPT-3 1.3B train step (the ``"gpt3-1.3b"`` preset, bf16
   with an fp32 AdamW master copy, global batch 32 of 2048 tokens) is traced on abstract
   arguments (``jax.ShapeDtypeStruct``: nothing is allocated) and planned for two DGX
   A100 nodes (16 GPUs). Its summary is printed, and the demo checks that every axis of
   the plan's mesh splits something (:func:`autopar.plan.idle_axes`).
2. *The run that checks.* The ``"demo"`` GPT (4 layers, hidden 128) is planned for one
   DGX A100 node (8 GPUs, the same device count as the 8 simulated CPU devices it runs
   on), run for a few steps with ``@autoparallel``, and its losses are checked against
   single-device ``jax.jit``. What XLA compiled is compared with the prediction
   (``verify``), and a report directory is written.

Both models come from the model registry (:mod:`autopar.registry`): presets of the family
registered as ``"gpt"`` (the zoo's ``benchmarks.models.gpt``), so the library itself
imports no model package.
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
from autopar.plan import Plan, idle_axes, spec_axes
from autopar.registry import model_step
from autopar.report import summary, write_report
from autopar.report.text import render

DEMO_MODEL = "gpt"
"""Registered name of the demo's model family (see :mod:`autopar.registry`)."""
DEMO_PRESET = "demo"
"""Its preset: 4 layers, hidden 128, 4 heads, sequence 64, vocabulary 512, fp32."""
DEMO_BATCH = 16

BIG_PRESET = "gpt3-1.3b"
"""The planned model: GPT-3 XL (Brown et al. 2020, table 2.1: 24 layers, hidden 2048,
16 heads, sequence 2048), 1.3B parameters."""
BIG_BATCH = 32
"""Its global batch (sequences of 2048 tokens): two per GPU."""
BIG_NODES = 2
"""DGX nodes it is planned for (8 GPUs each)."""

LOSS_RTOL = 1e-5
"""Loss agreement with single-device f32 (DESIGN.md: 'loss to 1e-5 in f32')."""


@dataclass(frozen=True)
class BigPlan:
    """The plan the demo searched for the 1.3B GPT (nothing of it ran).

    Attributes:
        preset: the model preset (``"gpt3-1.3b"``).
        parameters: its parameter count.
        batch: its global batch.
        cluster: the hardware, in words.
        mesh: ``(axis, size)`` of the plan's mesh.
        zero_stage: the plan's ZeRO stage.
        step_time_s: predicted step time.
        memory_bytes_per_device: predicted peak bytes per device.
        idle_axes: mesh axes (size > 1) that split nothing (:func:`autopar.plan.idle_axes`).
        search_seconds: trace and search wall time (0 work when read from the plan cache).
        cache_hit: the plan came from the plan cache.
    """

    preset: str
    parameters: int
    batch: int
    cluster: str
    mesh: tuple[tuple[str, int], ...]
    zero_stage: int
    step_time_s: float
    memory_bytes_per_device: float
    idle_axes: tuple[str, ...]
    search_seconds: float
    cache_hit: bool = False

    @property
    def devices(self) -> int:
        """Devices of its mesh."""
        n = 1
        for _, size in self.mesh:
            n *= size
        return n


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
    big: BigPlan | None = None
    """The 1.3B GPT's plan for two DGX nodes (``None`` when ``run_demo(big=False)``)."""

    @property
    def ok(self) -> bool:
        """Losses agree and the plan splits something (a replicated plan would pass the
        numerics check without exercising any sharding)."""
        return self.max_rel_error <= LOSS_RTOL and bool(self.splits)


def plan_big(
    cluster: str = "dgx-a100-80gb",
    nodes: int = BIG_NODES,
    cache: bool | str = True,
    echo: Callable[[str], None] = print,
) -> tuple[Plan, BigPlan]:
    """Plan the 1.3B GPT (:data:`BIG_PRESET`, batch :data:`BIG_BATCH`) for ``nodes``
    nodes of ``cluster`` on abstract arguments, print its summary, and say whether every
    mesh axis splits something.

    ``cache`` is the plan cache as for ``@autoparallel`` (``True``: the default
    directory, a path, or ``False``): a repeated demo reads the plan back.

    Example:
        >>> plan, big = plan_big(echo=lambda line: None)                  # doctest: +SKIP
        >>> big.devices, big.idle_axes                                    # doctest: +SKIP
        (16, ())
    """
    from autopar.api import plan as search_plan
    from autopar.api import trace
    from autopar.cache import PlanCache, plan_key
    from cost_models import Cluster

    target = Cluster.preset(cluster, nodes=nodes)
    model = model_step(DEMO_MODEL, BIG_PRESET, BIG_BATCH, abstract=True)
    config = model.config
    params = int(config.num_params()) if hasattr(config, "num_params") else 0
    echo(
        f"Model: GPT {BIG_PRESET}, {params / 1e9:.2f}B parameters ({config.layers} layers, "
        f"hidden {config.hidden}, {config.heads} heads, seq {config.seq_len}), global batch "
        f"{BIG_BATCH}; abstract arguments (jax.ShapeDtypeStruct): nothing is allocated"
    )
    echo(f"Planning for: {target.describe()}")
    t0 = time.perf_counter()
    graph = trace(model.step_fn, *model.args)
    options = SearchOptions()
    store = None if cache is False else PlanCache(None if cache is True else cache)
    key = plan_key(graph, target, options) if store is not None else None
    plan = store.get(key) if store is not None else None
    hit = plan is not None
    if plan is None:
        plan = search_plan(graph, cluster=target, options=options)
        if store is not None:
            store.put(key, plan)
    seconds = time.perf_counter() - t0
    echo(summary(plan))
    idle = idle_axes(plan)
    big = BigPlan(
        preset=BIG_PRESET,
        parameters=params,
        batch=BIG_BATCH,
        cluster=target.describe(),
        mesh=tuple(plan.mesh.items()),
        zero_stage=plan.zero_stage,
        step_time_s=plan.predicted.step_time_s,
        memory_bytes_per_device=plan.predicted.memory_bytes_per_device,
        idle_axes=idle,
        search_seconds=seconds,
        cache_hit=hit,
    )
    mesh_text = " x ".join(f"{a}={n}" for a, n in big.mesh)
    echo(
        f"Searched in {seconds:.1f} s" + (" (plan cache hit)" if hit else "") + f": mesh "
        f"{mesh_text} on {big.devices} GPUs, ZeRO stage {big.zero_stage}, predicted "
        f"{big.step_time_s * 1e3:.1f} ms per step, {big.memory_bytes_per_device / 2**30:.1f} "
        "GiB per device. "
        + (
            "Every mesh axis splits something."
            if not idle
            else f"Mesh axes {', '.join(idle)} split nothing: their devices repeat the work."
        )
    )
    return plan, big


def run_demo(
    steps: int = 3,
    out_dir: str = "autopar-report",
    cluster: str = "dgx-a100-80gb",
    mesh: dict[str, int] | None = None,
    cache: bool | str = True,
    echo: Callable[[str], None] = print,
    big: bool = True,
) -> DemoResult:
    """Plan the 1.3B GPT for two nodes (:func:`plan_big`, unless ``big=False``), then plan,
    run and check the small demo GPT step; returns the measured numbers.

    Example:
        >>> result = run_demo(steps=2, out_dir="/tmp/autopar-demo")     # doctest: +SKIP
        >>> result.ok, result.big.devices                               # doctest: +SKIP
        (True, 16)
    """
    from cost_models import Cluster

    n = jax.device_count()
    if n != 8:
        raise AutoparError(
            f"the demo needs 8 devices and JAX sees {n}; run it through `autopar demo`, which "
            "sets XLA_FLAGS=--xla_force_host_platform_device_count=8 before JAX starts."
        )
    big_plan = None
    if big:
        echo("== 1. A plan for which parallelism matters ==")
        _, big_plan = plan_big(cluster, BIG_NODES, cache, echo)
        echo("")
        echo("== 2. A small GPT, planned and run on the local devices ==")
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
        big=big_plan,
    )
