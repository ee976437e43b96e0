"""Benchmark pipeline plans: the predicted bubble against the closed forms, predicted
against compiled memory, and numerics against one device.

For the zoo GPT (``GPTConfig.preset("tiny", precision="fp32")``, 4 layers, scanned and
unrolled) and the zoo MoE (``MoEConfig.preset("tiny", precision="fp32")``, 4 layers,
unrolled), batch 32, on one 8-GPU DGX A100 node, per mesh (``{"pipe": 2, "data": 4}``,
``{"pipe": 2, "data": 2, "tensor": 2}``, ``{"pipe": 4, "data": 2}``, ``{"pipe": 8}`` with 8
layers), schedule (GPipe, 1F1B, and for unrolled layers interleaved 1F1B with v = 2
chunks per device, the layers doubled where ``p v`` chunks need it and m a multiple of
p) and number of microbatches m (4, 8, 16; a microbatch keeps >= 2 examples, as one
example changes JAX's equations and is refused), one row of:

* ``bub/mk``: the cost model's bubble over its makespan (``autopar.evaluate`` of
  ``autopar.baselines.pipeline``), beside the closed forms of a pipeline with equal
  stages and free sends, ``(p-1)/(m+p-1)`` and interleaved ``(p-1)/(v*m+p-1)`` (v = 2).
* ``bub/ideal``: the cost model's ``extra["bubble_fraction"]``, (makespan - ideal) /
  ideal, beside its closed form for the row's schedule, ``(p-1)/m`` or ``(p-1)/(v m)``. The tiny GPT's stages are not equal (the
  embedding sits on the first stage, the head and loss on the last), so both figures
  can sit away from the closed forms.
* ``stage fwd+bwd us``: the cost model's forward + backward seconds of one microbatch
  per stage, which say how unequal the stages are, and ``p2p us``, the stage-to-stage
  send time the schedule simulation charges between them (``extra["p2p_s"]``): for a
  model this small it is as long as a stage's work, so latency, not the closed forms'
  idle ticks, sets much of the bubble. At ``{"pipe": 2, "data": 4}``, m = 16 a
  microbatch's 2 examples do not split over ``data`` = 4, and the stages' reshards show.
* predicted peak memory per device and its activations; the compiled program's
  ``memory_analysis()`` per device (temp, and arguments + outputs + temp - aliases), and
  the prediction's error against it (``mem err``, as ``autopar.verify`` computes it:
  the program is not donated, so the new state beside the old is added to the
  prediction; ``autopar.verify``'s tolerance is 20%).
  On CPU, XLA hides fusion scratch unless ``--xla_cpu_experimental_ynn_fusion_type=``
  is set, so the step is compiled (once, for memory and the run) with
  ``autopar.lower.CPU_MEMORY_COMPILER_OPTIONS``, which sets it.
* numerics: the lowered step run once on concrete arguments against single-device
  ``jax.jit(step)``: ``ok`` when the losses agree to rel 1e-5, else ``DIFF <rel>``.
* how long the row took (plan, price, lower, compile, run) on this machine.

CPU wall time on simulated devices says nothing about pipeline speed (the 8 devices
share the host's cores); the times only show what the benchmark costs.

Usage:
    python -m benchmarks.bench_pipeline            # every row (~130; an hour or more on 2 cores)
    python -m benchmarks.bench_pipeline --quick    # scanned GPT, {"pipe": 2, "data": 4}, 1F1B, m = 4, 8
    python -m benchmarks.bench_pipeline --model moe --schedule interleaved-1f1b --m 8
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
# (mesh, layers): pipe 8 needs one layer per stage.
MESHES = (
    ({"pipe": 2, "data": 4}, 4),
    ({"pipe": 2, "data": 2, "tensor": 2}, 4),
    ({"pipe": 4, "data": 2}, 4),
    ({"pipe": 8}, 8),
)
SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b")
MICROBATCHES = (4, 8, 16)
# (name, scanned layers): the models of the table.
MODELS = (("gpt", True), ("gpt", False), ("moe", False))


@functools.cache
def model(scan: bool, layers: int, name: str = "gpt"):
    """The zoo model's step and concrete ``(state, batch)``, and single-device jit's loss."""
    import jax

    if name == "gpt":
        from benchmarks.models.gpt import GPTConfig, make_train_step

        cfg = GPTConfig.preset("tiny", precision="fp32", layers=layers, scan_layers=scan)
    elif name == "moe":
        from benchmarks.models.moe import MoEConfig, make_train_step

        cfg = MoEConfig.preset("tiny", precision="fp32", layers=layers, scan_layers=scan)
    else:
        raise ValueError(f"model {name!r}: use 'gpt' or 'moe'")
    step, args = make_train_step(cfg, BATCH, abstract=False)
    args = jax.device_put(args, jax.devices()[0])
    return step, args, float(jax.jit(step)(*args)[1])


def cases(
    models=MODELS, meshes=MESHES, schedules=SCHEDULES, micro=MICROBATCHES
) -> list[tuple[str, bool, dict[str, int], int, str, int, int]]:
    """The table's rows as ``(model, scan, mesh, layers, schedule, m, v)``: interleaved
    1F1B only for unrolled layers (``v = 2``; the layers doubled where ``p v`` chunks
    need more, ``m`` a multiple of ``p``).

    Example:
        >>> [c[4:] for c in cases(MODELS[1:2], MESHES[:1], micro=(4,))]
        [('gpipe', 4, 1), ('1f1b', 4, 1), ('interleaved-1f1b', 4, 2)]
    """
    out = []
    for name, scan in models:
        for mesh, layers in meshes:
            for schedule in schedules:
                v = V_INTERLEAVED if schedule == "interleaved-1f1b" else 1
                if v > 1 and scan:
                    continue
                for m in micro:
                    if v > 1 and m % mesh["pipe"]:
                        continue
                    out.append((name, scan, mesh, max(layers, mesh["pipe"] * v), schedule, m, v))
    return out


def row(
    mesh: dict[str, int],
    schedule: str,
    m: int,
    scan: bool,
    layers: int = 4,
    name: str = "gpt",
    v: int = 1,
) -> dict:
    """Plan, price, lower, compile and run one pipeline; the table's row as a dict."""
    import jax

    import autopar
    from autopar.lower import CPU_MEMORY_COMPILER_OPTIONS, lower_plan
    from autopar.verify import memory_row
    from cost_models import Cluster

    step, (state, batch), want = model(scan, layers, name)
    p = mesh["pipe"]
    t0 = time.perf_counter()
    plan = autopar.baselines.pipeline(
        step, mesh, state, batch, microbatches=m, schedule=schedule, virtual_stages=v
    )
    ev = autopar.evaluate(step, plan, Cluster.preset("dgx-a100-80gb"), state, batch)
    lowered = lower_plan(step, plan, (state, batch))
    opts = CPU_MEMORY_COMPILER_OPTIONS if jax.default_backend() == "cpu" else None
    compiled = lowered.compile(state, batch, compiler_options=opts)
    stats = compiled.memory_analysis()
    got = float(compiled(*lowered.place_inputs((state, batch)))[1])
    rel = abs(got - want) / abs(want)
    # As autopar.verify: the step is not donated, so the new state sits beside the old.
    mem = memory_row(stats, plan, ev.memory_bytes_per_device)
    return {
        "model": f"{name}-{'scan' if scan else 'unrolled'}",
        "layers": layers,
        "mesh": dict(mesh),
        "schedule": schedule if v == 1 else f"{schedule} v={v}",
        "m": m,
        "bubble_over_makespan": ev.extra["bubble_s"] / ev.extra["makespan_s"],
        "closed_gpipe": (p - 1) / (m + p - 1),
        "closed_interleaved": (p - 1) / (V_INTERLEAVED * m + p - 1),
        "bubble_fraction": ev.extra["bubble_fraction"],
        "closed_over_ideal": (p - 1) / (v * m),
        "stage_us": tuple(
            (f + b) * 1e6
            for f, b in zip(ev.extra["stage_forward_s"], ev.extra["stage_backward_s"], strict=True)
        ),
        "p2p_us": ev.extra["p2p_s"] * 1e6,
        "predicted_bytes": ev.memory_bytes_per_device,
        "predicted_activation_bytes": ev.memory_breakdown["activations"],
        "compiled_temp_bytes": stats.temp_size_in_bytes,
        "compiled_bytes": mem.compiled_bytes,
        "memory_error": mem.error,
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
    ("closed_interleaved", "(p-1)/(2m+p-1)", "{:.3f}"),
    ("bubble_fraction", "bub/ideal", "{:.3f}"),
    ("closed_over_ideal", "(p-1)/(vm)", "{:.3f}"),
    ("stage_us", "stage fwd+bwd us", "{}"),
    ("p2p_us", "p2p us", "{:.1f}"),
    ("predicted_bytes", "pred MB", "{:.2f}"),
    ("predicted_activation_bytes", "pred act MB", "{:.2f}"),
    ("compiled_temp_bytes", "XLA temp MB", "{:.2f}"),
    ("compiled_bytes", "XLA MB", "{:.2f}"),
    ("memory_error", "mem err", "{:+.1%}"),
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
    parser.add_argument(
        "--quick", action="store_true", help="scanned GPT, one mesh, 1F1B, m = 4 and 8"
    )
    parser.add_argument("--model", choices=("gpt", "gpt-scan", "gpt-unrolled", "moe"))
    parser.add_argument("--schedule", choices=SCHEDULES)
    parser.add_argument("--m", type=int, choices=MICROBATCHES)
    parser.add_argument("--mesh", help='e.g. "pipe2,data4"')
    a = parser.parse_args()
    models, meshes, schedules, micro = MODELS, MESHES, SCHEDULES, MICROBATCHES
    if a.quick:
        models, meshes, schedules, micro = MODELS[:1], MESHES[:1], ("1f1b",), (4, 8)
    if a.model:
        models = tuple(
            (n, s) for n, s in models if a.model in (n, f"{n}-{'scan' if s else 'unrolled'}")
        )
    if a.schedule:
        schedules = (a.schedule,)
    if a.m:
        micro = (a.m,)
    if a.mesh:
        meshes = tuple(
            (mesh, layers)
            for mesh, layers in meshes
            if ",".join(f"{k}{n}" for k, n in mesh.items()) == a.mesh
        )
    wide = {"model": 12, "mesh": 19, "schedule": 20, "m": 2, "stage_us": 31}
    widths = [max(len(h), wide.get(k, 0)) for k, h, _ in COLUMNS]
    print("  ".join(h.rjust(w) for (_, h, _), w in zip(COLUMNS, widths, strict=True)))
    built: set = set()
    for name, scan, mesh, layers, schedule, m, v in cases(models, meshes, schedules, micro):
        if (name, scan, layers) not in built:
            built.add((name, scan, layers))
            t0 = time.perf_counter()
            model(scan, layers, name)
            kind = "scanned" if scan else "unrolled"
            took = time.perf_counter() - t0
            print(f"# {kind} {name}, {layers} layers: built, one-device reference {took:.1f} s")
        try:
            cells = format_row(row(mesh, schedule, m, scan, layers, name, v))
        except Exception as e:  # one failing case should not end the table
            print(f"FAILED {name} {mesh} {schedule} m={m} v={v}: {type(e).__name__}: {e}")
            continue
        print("  ".join(c.rjust(w) for c, w in zip(cells, widths, strict=True)), flush=True)


if __name__ == "__main__":
    main()
