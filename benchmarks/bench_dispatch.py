"""Steady-state call overhead of an ``@autoparallel`` step vs hand-written ``jax.jit``.

Both run the same compiled program with the same shardings; the difference is autopar's
dispatch (signature lookup, layout check). Target: median ratio <= 1.05 over >= 100 calls.

    .venv/bin/python -m benchmarks.bench_dispatch [--calls 200]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time


def main(argv=None) -> dict:
    p = argparse.ArgumentParser()
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--mesh", default="data=2,tensor=4")
    a = p.parse_args(argv)
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    import jax

    import autopar
    from autopar.cli import parse_mesh
    from autopar.report.text import render
    from benchmarks.models import gpt

    config = gpt.GPTConfig.preset("tiny")
    step, (state, batch) = gpt.make_train_step(config, 8, abstract=False)
    f = autopar.autoparallel(
        step,
        cluster="dgx-a100-80gb",
        options=autopar.SearchOptions(mesh=parse_mesh(a.mesh)),
        cache=False,
    )
    lowered = f.lower(state, batch)
    hand = jax.jit(step, in_shardings=lowered.in_shardings, out_shardings=lowered.out_shardings)

    # Warm both up; feed each its own outputs so every call sees planned layouts.
    s_auto, _ = f(state, batch)
    s_hand, _ = hand(*lowered.place_inputs((state, batch)))
    b_auto = lowered.place_inputs((state, batch))[1]
    jax.block_until_ready((s_auto, s_hand))

    inner = lowered.jitted  # the very jax.jit object @autoparallel dispatches to
    s_inner = s_auto
    t_auto, t_hand, t_inner = [], [], []
    for _ in range(a.calls):  # interleaved, so drifts in machine load hit all equally
        t0 = time.perf_counter()
        s_auto, loss = f(s_auto, b_auto)
        jax.block_until_ready(loss)
        t_auto.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        s_hand, loss = hand(s_hand, b_auto)
        jax.block_until_ready(loss)
        t_hand.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        s_inner, loss = inner(s_inner, b_auto)
        jax.block_until_ready(loss)
        t_inner.append(time.perf_counter() - t0)
    med_auto, med_hand = statistics.median(t_auto), statistics.median(t_hand)
    from rich.table import Table

    t = Table(title=f"Dispatch overhead, GPT tiny step, mesh {a.mesh}, {a.calls} calls each")
    for c in ("program", "median ms", "p90 ms"):
        t.add_column(c, justify="right")
    rows = (
        ("jax.jit (hand-written, same in/out shardings)", t_hand),
        ("the lowered jax.jit called directly", t_inner),
        ("@autoparallel", t_auto),
    )
    for name, xs in rows:
        xs = sorted(xs)
        t.add_row(name, f"{statistics.median(xs) * 1e3:.3f}", f"{xs[int(0.9 * len(xs))] * 1e3:.3f}")
    print(render(t))
    ratio = med_auto / med_hand
    med_inner = statistics.median(t_inner)
    print(f"ratio @autoparallel / hand-written jit = {ratio:.3f} (target <= 1.05)")
    print(f"ratio @autoparallel / its own jit      = {med_auto / med_inner:.3f} (pure dispatch)")
    return {"median_auto_s": med_auto, "median_jit_s": med_hand, "ratio": ratio}


if __name__ == "__main__":
    main()
