"""Benchmark pipeline plans: the predicted bubble against the closed forms, predicted
against compiled memory, and numerics against one device.

For the zoo GPT (``GPTConfig.preset("tiny", precision="fp32")``, 4 layers, scanned and
unrolled, batch 32) on one 8-GPU DGX A100 node, per mesh (``{"pipe": 2, "data": 4}``,
``{"pipe": 4, "data": 2}``, ``{"pipe": 8}`` with 8 layers), schedule (GPipe, 1F1B) and
number of microbatches m (4, 8, 16; a microbatch keeps >= 2 examples, as one example
changes JAX's equations and is refused), one row of:

* ``bub/mk``: the cost model's bubble over its makespan (``autopar.evaluate`` of
  ``autopar.baselines.pipeline``), beside the closed form ``(p-1)/(m+p-1)`` of a pipeline
  with equal stages and the interleaved ``(p-1)/(v*m+p-1)`` (v = 2, for reference only:
  no plan here interleaves).
* ``bub/ideal``: the cost model's ``extra["bubble_fraction"]``, (makespan - ideal) /
  ideal, beside its closed form ``(p-1)/m``. The tiny GPT's stages are not equal (the
  embedding sits on the first stage, the head and loss on the last), so both figures
  can sit away from the closed forms.
* ``stage fwd+bwd us``: the cost model's forward + backward seconds of one microbatch
  per stage, which say how unequal the stages are, and ``p2p us``, the stage-to-stage
  send time the schedule simulation charges between them (``extra["p2p_s"]``): for a
  model this small it is as long as a stage's work, so latency, not the closed forms'
  idle ticks, sets much of the bubble. At ``{"pipe": 2, "data": 4}``, m = 16 a
  microbatch's 2 examples do not split over ``data`` = 4, and the stages' reshards show.
* predicted peak memory per device and its activations; the compiled program's
  ``memory_analysis()`` per device (temp, and arguments + outputs + temp - aliases).
  On CPU, XLA hides fusion scratch unless ``--xla_cpu_experimental_ynn_fusion_type=``
  is set, so the step is compiled (once, for memory and the run) with
  ``autopar.lower.CPU_MEMORY_COMPILER_OPTIONS``, which sets it.
* numerics: the lowered step run once on concrete arguments against single-device
  ``jax.jit(step)``: ``ok`` when the losses agree to rel 1e-5, else ``DIFF <rel>``.
* how long the row took (plan, price, lower, compile, run) on this machine.

CPU wall time on simulated devices says nothing about pipeline speed (the 8 devices
share the host's cores); the times only show what the benchmark costs.

Usage:
    python -m benchmarks.bench_pipeline            # every row (36; ~10 min on 2 busy cores)
    python -m benchmarks.bench_pipeline --quick    # {"pipe": 2, "data": 4}, 1F1B, m = 4, 8
"""

from __future__ import annotations

import argparse
import functools
import os
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

BATCH = 32
LOSS_RTOL = 1e-5
V_INTERLEAVED = 2
# (mesh, layers): pipe 8 needs one layer per stage.
MESHES = (({"pipe": 2, "data": 4}, 4), ({"pipe": 4, "data": 2}, 4), ({"pipe": 8}, 8))
SCHEDULES = ("gpipe", "1f1b")
MICROBATCHES = (4, 8, 16)


@functools.cache
def model(scan: bool, layers: int):
    """The zoo GPT's step and concrete ``(state, batch)``, and single-device jit's loss."""
    import jax

    from benchmarks.models.gpt import GPTConfig, make_train_step

    cfg = GPTConfig.preset("tiny", precision="fp32", layers=layers, scan_layers=scan)
    step, args = make_train_step(cfg, BATCH, abstract=False)
    args = jax.device_put(args, jax.devices()[0])
    return step, args, float(jax.jit(step)(*args)[1])


def row(mesh: dict[str, int], schedule: str, m: int, scan: bool, layers: int = 4) -> dict:
    """Plan, price, lower, compile and run one pipeline; the table's row as a dict."""
    import jax

    import autopar
    from autopar.lower import CPU_MEMORY_COMPILER_OPTIONS, lower_plan
    from cost_models import Cluster

    step, (state, batch), want = model(scan, layers)
    p = mesh["pipe"]
    t0 = time.perf_counter()
    plan = autopar.baselines.pipeline(step, mesh, state, batch, microbatches=m, schedule=schedule)
    ev = autopar.evaluate(step, plan, Cluster.preset("dgx-a100-80gb"), state, batch)
    lowered = lower_plan(step, plan, (state, batch))
    opts = CPU_MEMORY_COMPILER_OPTIONS if jax.default_backend() == "cpu" else None
    compiled = lowered.compile(state, batch, compiler_options=opts)
    stats = compiled.memory_analysis()
    got = float(compiled(*lowered.place_inputs((state, batch)))[1])
    rel = abs(got - want) / abs(want)
    return {
        "model": "scan" if scan else "unrolled",
        "layers": layers,
        "mesh": dict(mesh),
        "schedule": schedule,
        "m": m,
        "bubble_over_makespan": ev.extra["bubble_s"] / ev.extra["makespan_s"],
        "closed_gpipe": (p - 1) / (m + p - 1),
        "closed_interleaved": (p - 1) / (V_INTERLEAVED * m + p - 1),
        "bubble_fraction": ev.extra["bubble_fraction"],
        "closed_over_ideal": (p - 1) / m,
        "stage_us": tuple(
            (f + b) * 1e6
            for f, b in zip(ev.extra["stage_forward_s"], ev.extra["stage_backward_s"], strict=True)
        ),
        "p2p_us": ev.extra["p2p_s"] * 1e6,
        "predicted_bytes": ev.memory_bytes_per_device,
        "predicted_activation_bytes": ev.memory_breakdown["activations"],
        "compiled_temp_bytes": stats.temp_size_in_bytes,
        "compiled_bytes": stats.argument_size_in_bytes
        + stats.output_size_in_bytes
        + stats.temp_size_in_bytes
        - stats.alias_size_in_bytes,
        "loss": got,
        "reference_loss": want,
        "numerics": "ok" if rel <= LOSS_RTOL else f"DIFF {rel:.1e}",
        "seconds": time.perf_counter() - t0,
    }


COLUMNS = (
    ("model", "model", "{}"),
    ("mesh", "mesh", "{}"),
    ("schedule", "sched", "{}"),
    ("m", "m", "{}"),
    ("bubble_over_makespan", "bub/mk", "{:.3f}"),
    ("closed_gpipe", "(p-1)/(m+p-1)", "{:.3f}"),
    ("closed_interleaved", "v=2", "{:.3f}"),
    ("bubble_fraction", "bub/ideal", "{:.3f}"),
    ("closed_over_ideal", "(p-1)/m", "{:.3f}"),
    ("stage_us", "stage fwd+bwd us", "{}"),
    ("p2p_us", "p2p us", "{:.1f}"),
    ("predicted_bytes", "pred MB", "{:.2f}"),
    ("predicted_activation_bytes", "pred act MB", "{:.2f}"),
    ("compiled_temp_bytes", "XLA temp MB", "{:.2f}"),
    ("compiled_bytes", "XLA MB", "{:.2f}"),
    ("numerics", "numerics", "{}"),
    ("seconds", "row s", "{:.1f}"),
)
_MB = {"predicted_bytes", "predicted_activation_bytes", "compiled_temp_bytes", "compiled_bytes"}


def format_row(r: dict) -> list[str]:
    """The row's cells in :data:`COLUMNS` order (bytes shown in MB, 1e6 bytes)."""
    cells = []
    for key, _, fmt in COLUMNS:
        v = r[key]
        if key == "mesh":
            v = ",".join(f"{a}{n}" for a, n in v.items())
        elif key == "stage_us":
            v = "/".join(f"{x:.0f}" for x in v)
        cells.append(fmt.format(v / 1e6 if key in _MB else v))
    return cells


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="one mesh, 1F1B, m = 4 and 8")
    quick = parser.parse_args().quick
    meshes = MESHES[:1] if quick else MESHES
    schedules = ("1f1b",) if quick else SCHEDULES
    micro = (4, 8) if quick else MICROBATCHES
    wide = {"model": 8, "mesh": 13, "m": 2, "stage_us": 31 if not quick else 0}
    widths = [max(len(h), wide.get(k, 0)) for k, h, _ in COLUMNS]
    print("  ".join(h.rjust(w) for (_, h, _), w in zip(COLUMNS, widths, strict=True)))
    built: set = set()
    for scan in (True, False):
        for mesh, layers in meshes:
            if (scan, layers) not in built:
                built.add((scan, layers))
                t0 = time.perf_counter()
                model(scan, layers)
                name = "scanned" if scan else "unrolled"
                took = time.perf_counter() - t0
                print(f"# {name} GPT, {layers} layers: built, one-device reference {took:.1f} s")
            for schedule in schedules:
                for m in micro:
                    try:
                        cells = format_row(row(mesh, schedule, m, scan, layers))
                    except Exception as e:  # one failing case should not end the table
                        print(f"FAILED {mesh} {schedule} m={m}: {type(e).__name__}: {e}")
                        continue
                    print(
                        "  ".join(c.rjust(w) for c, w in zip(cells, widths, strict=True)),
                        flush=True,
                    )


if __name__ == "__main__":
    main()
