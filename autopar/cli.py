"""``autopar demo | trace | plan | show | explain | report | diff | calibrate | sweep``.

Verbs that run JAX programs on simulated devices set ``XLA_FLAGS`` before JAX starts its
backend (``--devices N``, default 8), so they work on a machine without accelerators.

Example:
    $ autopar demo
    $ autopar plan gpt --preset gpt3-175b --batch 1536 --cluster dgx-a100-80gb --nodes 48 \
          --mesh data=48,tensor=8 --out plan.json
    $ autopar show plan.json
    $ autopar explain plan.json params/h/attn/q/kernel
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

__all__ = ["build_parser", "main", "parse_mesh"]


def _simulate_devices(n: int) -> None:
    """Ask XLA for ``n`` host devices; must run before JAX initialises its backend."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()


def parse_mesh(text: str | None) -> dict[str, int] | None:
    """The ``--mesh`` value ``"data=2,tensor=4"`` as ``{"data": 2, "tensor": 4}``.

    ``None`` or ``""`` gives ``None`` (no fixed mesh: the search picks one). The result is
    what :class:`autopar.SearchOptions` takes as ``mesh``.

    Raises:
        InvalidOptionError: a part is not ``axis=size`` with a whole-number size.

    Example:
        >>> parse_mesh("data=2,tensor=4")
        {'data': 2, 'tensor': 4}
    """
    if not text:
        return None
    from autopar.errors import InvalidOptionError

    mesh: dict[str, int] = {}
    for part in text.split(","):
        name, _, size = part.partition("=")
        if not size.strip().isdigit():
            raise InvalidOptionError(
                f"--mesh {text!r}: write axis=size pairs separated by commas, e.g. data=2,tensor=4."
            )
        mesh[name.strip()] = int(size)
    return mesh


def _model_step(a: argparse.Namespace):
    """The registered model's (step_fn, args) for the ``trace`` / ``plan`` arguments."""
    from autopar.registry import model_step

    m = model_step(a.model, a.preset or "tiny", a.batch, abstract=True)
    return m.step_fn, m.args


def _cmd_demo(a: argparse.Namespace) -> int:
    from autopar.demo import run_demo

    result = run_demo(
        steps=a.steps,
        out_dir=a.out,
        cluster=a.cluster,
        mesh=parse_mesh(a.mesh),
        cache=not a.no_cache,
    )
    return 0 if result.ok else 1


def _cmd_trace(a: argparse.Namespace) -> int:
    import time

    import autopar

    step, args = _model_step(a)
    t0 = time.perf_counter()
    graph = autopar.trace(step, *args)
    print(graph.summary())
    print(f"traced in {time.perf_counter() - t0:.2f} s")
    return 0


def _cluster(a: argparse.Namespace):
    from cost_models import Cluster

    return Cluster.preset(a.cluster, nodes=a.nodes) if a.cluster != "local" else Cluster.local()


def _cmd_plan(a: argparse.Namespace) -> int:
    import autopar
    from autopar.options import SearchOptions
    from autopar.report import summary

    step, args = _model_step(a)
    opts = SearchOptions(
        mesh=parse_mesh(a.mesh),
        memory_limit_bytes=int(a.memory_limit_gb * 2**30) if a.memory_limit_gb else None,
    )
    plan = autopar.plan(step, *args, cluster=_cluster(a), options=opts)
    print(summary(plan))
    if a.out:
        plan.save(a.out)
        print(f"plan written to {a.out}")
    return 0


def _cmd_show(a: argparse.Namespace) -> int:
    from autopar.plan import Plan
    from autopar.report import summary

    print(summary(Plan.load(a.plan), max_layers=a.layers))
    return 0


def _cmd_explain(a: argparse.Namespace) -> int:
    from autopar.explain import explain
    from autopar.plan import Plan

    plan = Plan.load(a.plan)
    step, args = (None, ())
    if a.model:
        step, args = _model_step(a)
    print(explain(plan, a.path, step=step, args=args))
    return 0


def _cmd_report(a: argparse.Namespace) -> int:
    from autopar.plan import Plan
    from autopar.report import write_html, write_report

    plan = Plan.load(a.plan)
    if a.out.lower().endswith((".html", ".htm")):
        print(write_html(plan, a.out))
    else:
        print(write_report(plan, a.out))
    return 0


def _cmd_diff(a: argparse.Namespace) -> int:
    from autopar.plan import Plan
    from autopar.report import diff

    print(diff(Plan.load(a.a), Plan.load(a.b)))
    return 0


def _cmd_calibrate(a: argparse.Namespace) -> int:
    from cost_models import calibrate

    argv = ["--quick"] if a.quick else []
    if a.out:
        argv += ["--out", a.out]
    return calibrate.main(argv) or 0


def _cmd_sweep(a: argparse.Namespace) -> int:
    """Run a sweep suite; print each point's plans (issue 15 item 2)."""
    from autopar.sweep import load_suite, run_sweep
    from autopar.sweep.results import losses, rows

    suite = load_suite(a.suite)
    out = a.out or f"sweep-{suite.name}"
    store = run_sweep(suite, out, only=a.points or None, compile=not a.no_compile)
    print(f"{'point':<12} {'plan':<14} {'status':<13} {'mesh':<30} {'TFLOP/s':>8} {'MFU':>6} "
          f"{'GiB':>7} {'search s':>9}")  # fmt: skip
    for r in rows(store):
        tf = f"{r['tflops_per_device']:.1f}" if r["tflops_per_device"] else "-"
        mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "-"
        gib = f"{r['memory_gib']:.1f}" if r["memory_gib"] is not None else "-"
        print(f"{r['point']:<12} {r['plan']:<14} {r['status']:<13} {r['mesh'][:30]:<30} "
              f"{tf:>8} {mfu:>6} {gib:>7} {r['search_s'] or 0:>9.1f}")  # fmt: skip
    lost = losses(store)
    if lost:
        for point, plan, ratio in lost:
            print(f"autopar loses to {plan} at {point}: {ratio:.4f}x its step time")
    else:
        print("autopar >= every baseline that fits, at every point")
    print(f"wrote {out}/results.json, {out}/results.csv, {out}/throughput.png")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="autopar",
        description="autopar: plan, run, inspect and compare parallel plans for JAX train steps.",
    )
    p.add_argument("--devices", type=int, default=8, help="simulated CPU devices (default 8)")
    sub = p.add_subparsers(dest="verb", required=True)

    d = sub.add_parser(
        "demo",
        help="plan a 1.3B GPT for two DGX nodes, then run a small GPT on 8 simulated devices",
    )
    d.add_argument("--steps", type=int, default=3)
    d.add_argument("--out", default="autopar-report")
    d.add_argument("--cluster", default="dgx-a100-80gb", help="hardware to plan for")
    d.add_argument("--mesh", help="fix the mesh, e.g. data=2,tensor=4")
    d.add_argument("--no-cache", action="store_true", help="always search, ignore the plan cache")
    d.set_defaults(run=_cmd_demo)

    for verb, fn, helptext in (
        ("trace", _cmd_trace, "trace a model-zoo step and print its graph summary"),
        ("plan", _cmd_plan, "plan a model-zoo step for a cluster and print/save the plan"),
    ):
        s = sub.add_parser(verb, help=helptext)
        s.add_argument(
            "model",
            metavar="MODEL",
            help="a model registered under the 'autopar.models' entry points (the zoo's: "
            "gpt, moe, wide_resnet, mlp, t5, clip) or an import path, e.g. mypkg.models.bert",
        )
        s.add_argument("--preset", help="model preset, e.g. gpt2-small, gpt3-175b (default tiny)")
        s.add_argument("--batch", type=int, default=8)
        if verb == "plan":
            s.add_argument("--cluster", default="dgx-a100-80gb", help="preset name or 'local'")
            s.add_argument("--nodes", type=int, default=1)
            s.add_argument("--mesh", help="fix the mesh, e.g. data=2,tensor=4")
            s.add_argument("--memory-limit-gb", type=float)
            s.add_argument("--out", help="write the plan JSON here")
        s.set_defaults(run=fn)

    s = sub.add_parser("show", help="print a saved plan")
    s.add_argument("plan")
    s.add_argument("--layers", type=int, default=4, help="layers to list")
    s.set_defaults(run=_cmd_show)
    s = sub.add_parser(
        "explain", help="one parameter or op of a saved plan: sharding, collectives, next best"
    )
    s.add_argument("plan")
    s.add_argument("path", help="a leaf path (params/h/attn/q/kernel) or an op (h/attn/q)")
    s.add_argument(
        "--model",
        help="the plan's model (as for `autopar plan`): price this leaf's alternatives",
    )
    s.add_argument("--preset", help="model preset (default tiny)")
    s.add_argument("--batch", type=int, default=8)
    s.set_defaults(run=_cmd_explain)
    s = sub.add_parser(
        "report", help="write a self-contained HTML report for a saved plan (no network)"
    )
    s.add_argument("plan")
    s.add_argument(
        "-o",
        "--out",
        default="autopar-report",
        help="a file ending in .html: the report alone; else a directory (plan.json, "
        "summary.txt, PNG plots, index.html). Default autopar-report/",
    )
    s.set_defaults(run=_cmd_report)
    s = sub.add_parser("diff", help="what differs between two saved plans")
    s.add_argument("a")
    s.add_argument("b")
    s.set_defaults(run=_cmd_diff)
    s = sub.add_parser("calibrate", help="measure this backend and write a cost profile")
    s.add_argument("--quick", action="store_true")
    s.add_argument("--out")
    s.set_defaults(run=_cmd_calibrate)
    s = sub.add_parser("sweep", help="autopar's plans against baselines over a suite (TOML)")
    s.add_argument("suite", help="a suite file, e.g. benchmarks/suites/alpa_gpt.toml")
    s.add_argument("-o", "--out", help="output folder (default sweep-<suite name>)")
    s.add_argument("--points", nargs="*", help="run only these points (by name)")
    s.add_argument("--no-compile", action="store_true", help="skip the compiled checks")
    s.set_defaults(run=_cmd_sweep)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _simulate_devices(args.devices)
    from autopar.errors import AutoparError

    try:
        status = args.run(args)
        sys.stdout.flush()  # a closed pipe shows here, inside the try, not at exit
        return status
    except AutoparError as e:
        print(f"autopar: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `autopar show plan.json | head`: the reader left, not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
