"""mkdocs hooks: the parts of ``docs/`` generated from the code at build time.

A page asks for a generated block with an HTML comment, ``<!-- autopar:NAME -->`` (on a
line of its own for a table, inline for a list of names); :func:`on_page_markdown`
replaces it with the Markdown that ``GENERATORS[NAME]`` returns, before the page is
converted (so ``:::`` directives it emits are rendered by mkdocstrings). An unknown name
fails the build. Nothing here is copied by hand from the code, so the pages cannot drift
from it:

* ``cli``: ``autopar.cli.build_parser()``'s help, the top level and every verb;
* ``api-autopar``: one mkdocstrings block per name of ``autopar.__all__``;
* ``axes``, ``schedules``, ``remats``, ``hideable``: the mesh-axes table
  (``autopar.axes``), the choices ``SearchOptions`` validates against
  (``autopar.options``) and the hideable communication classes (``cost_models``);
* ``clusters``, ``devices``: the cost model's cluster presets and device catalog;
* ``published``: every row of the published-runs CSVs in ``benchmarks/reference/``
  priced by ``cost_models.megatron.estimate_iteration`` (one table per CSV, one row per
  CSV row); ``megatron-constants``: the fitted constants it uses, with their sources.

Loaded by ``mkdocs.yml`` (``hooks:``); ``mkdocs build --strict`` runs in the test suite
(``tests/core/test_docs.py``).

Example:
    >>> print(markdown_table(["a", "b"], [[1, "x"]], align="r-"))
    | a | b |
    |--:|---|
    | 1 | x |
"""

from __future__ import annotations

import csv
import os
import re
import statistics
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from mkdocs.exceptions import PluginError

ROOT = Path(__file__).resolve().parents[2]
REFERENCE = ROOT / "benchmarks" / "reference"
MARKER = re.compile(r"<!--\s*autopar:([a-z-]+)\s*-->")
# argparse wraps help to $COLUMNS: fixed, so the page does not depend on the terminal, and
# narrow enough for the theme's code blocks.
CLI_COLUMNS = 80


class GenerateDocsError(PluginError):
    """A generated block could not be built (the message says which and why)."""


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[Any]], align: str = "") -> str:
    """A Markdown table; ``align`` has one character per column: ``r`` right, else left."""
    align = align.ljust(len(header), "-")
    rule = ["--:" if a == "r" else "---" for a in align]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(rule) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def _code(text: str) -> str:
    return f"`{text}`"


# ---------------------------------------------------------------------------- CLI


def _subcommands(parser: Any) -> list[tuple[str, str, Any]]:
    """``(verb, one-line help, subparser)`` for every verb of ``parser``, in order."""
    import argparse

    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help or "" for a in action._choices_actions}
            return [(verb, helps.get(verb, ""), sub) for verb, sub in action.choices.items()]
    raise GenerateDocsError("autopar.cli.build_parser() has no sub-commands")


def cli_reference() -> str:
    """Every verb of ``autopar``'s command line with its ``--help``."""
    from autopar.cli import build_parser

    saved = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = str(CLI_COLUMNS)
    try:
        parser = build_parser()
        verbs = _subcommands(parser)
        out = [
            "| command | what it does |",
            "|---|---|",
            *(f"| [`autopar {v}`](#autopar-{v}) | {h} |" for v, h, _ in verbs),
            "",
            "## `autopar`",
            "",
            "```text",
            parser.format_help().rstrip(),
            "```",
        ]
        for verb, helptext, sub in verbs:
            out += ["", f"## `autopar {verb}`", "", f"{helptext[:1].upper()}{helptext[1:]}."]
            out += ["", "```text", sub.format_help().rstrip(), "```"]
    finally:
        if saved is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = saved
    return "\n".join(out)


# ---------------------------------------------------------------------------- API


ENTRY_POINTS_FIRST = ("autoparallel", "plan", "trace", "evaluate", "verify")


def api_autopar() -> str:
    """One mkdocstrings block per public name of ``autopar`` (its ``__all__``), grouped.

    Blocks point at where each object is defined (``autopar.plan`` the function lives in
    ``autopar.api``; the module ``autopar/plan.py`` would shadow it under its public name).
    """
    import inspect

    import autopar

    groups: dict[str, list[tuple[str, str]]] = {
        "Entry points": [],
        "Options and plans": [],
        "Modules": [],
        "Errors and warnings": [],
    }
    for name in autopar.__all__:
        if name.startswith("__"):
            continue
        obj = getattr(autopar, name)
        if inspect.isfunction(obj):
            groups["Entry points"].append((name, f"{obj.__module__}.{obj.__qualname__}"))
        elif inspect.isclass(obj) and issubclass(obj, (Exception, Warning)):
            groups["Errors and warnings"].append((name, f"{obj.__module__}.{obj.__qualname__}"))
        elif inspect.isclass(obj):
            groups["Options and plans"].append((name, f"{obj.__module__}.{obj.__qualname__}"))
        elif inspect.ismodule(obj) and callable(getattr(obj, name, None)):
            # autopar.trace: a module that is also the function of the same name.
            fn = getattr(obj, name)
            groups["Entry points"].append((name, f"{fn.__module__}.{fn.__qualname__}"))
        elif inspect.ismodule(obj):
            groups["Modules"].append((name, obj.__name__))
        else:
            raise GenerateDocsError(f"autopar.__all__ names {name!r}, a {type(obj).__name__}")
    out = [f"`autopar.__version__` is `{autopar.__version__}`."]
    first = {name: i for i, name in enumerate(ENTRY_POINTS_FIRST)}
    groups["Entry points"].sort(key=lambda e: first.get(e[0], len(first)))
    for title, entries in groups.items():
        out += ["", f"## {title}", ""]
        for name, path in entries:
            out += [
                f"::: {path}",
                "    options:",
                "      show_root_heading: true",
                "      show_root_full_path: false",
                "      heading_level: 3",
                f"      toc_label: {name}",
                "",
            ]
    return "\n".join(out)


# ---------------------------------------------------------------------------- concepts


def axes_table() -> str:
    """The mesh-axes table of ``autopar.axes``, outer to inner."""
    from autopar.axes import AXES_TABLE

    yes = {True: "yes", False: ""}
    rows = [
        [
            _code(a.name),
            a.words,
            _code(a.splits),
            _code(a.comm_class),
            yes[a.batch],
            yes[a.zero],
            yes[a.auto],
        ]
        for a in AXES_TABLE
    ]
    header = ["axis", "in words", "splits", "its traffic", "batch", "ZeRO", "searched by default"]
    return markdown_table(header, rows)


def hideable_classes() -> str:
    """The communication classes the cost model lets compute hide."""
    from cost_models import HIDEABLE_CLASSES

    return ", ".join(_code(c) for c in HIDEABLE_CLASSES)


def schedules() -> str:
    """The pipeline schedules ``SearchOptions(schedule=...)`` accepts."""
    from autopar.options import SCHEDULES

    return ", ".join(_code(s) for s in SCHEDULES)


def remats() -> str:
    """The remat policies ``SearchOptions(remat=...)`` accepts."""
    from autopar.options import REMATS

    return ", ".join(_code(s) for s in REMATS)


# ---------------------------------------------------------------------------- cost model


def _si(value: float, unit: str) -> str:
    for factor, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= factor:
            return f"{value / factor:.4g} {prefix}{unit}"
    return f"{value:.4g} {unit}"


def clusters_table() -> str:
    """``cost_models``' cluster presets: devices, links (α-β) and their sources."""
    from cost_models import PRESETS, Cluster

    rows = []
    for name in PRESETS:
        c = Cluster.preset(name)
        rows.append(
            [
                _code(name),
                _code(c.device.name),
                c.devices_per_node,
                c.topology,
                f"{c.intra.name} {_si(c.intra.bandwidth, 'B/s')}, {c.intra.latency * 1e6:.3g} µs",
                f"{c.inter.name} {_si(c.inter.bandwidth, 'B/s')}, {c.inter.latency * 1e6:.3g} µs",
                f"{c.overlap_efficiency:g}",
                c.intra.source
                if c.intra.source == c.inter.source
                else f"intra: {c.intra.source}; inter: {c.inter.source}",
            ]
        )
    header = [
        "preset",
        "device",
        "per node",
        "topology",
        "intra-node link",
        "inter-node link",
        "overlap",
        "source",
    ]
    return markdown_table(header, rows, align="--r-----")


def devices_table() -> str:
    """``cost_models``' device catalog: peak FLOP/s, HBM and their sources."""
    from cost_models import DEVICES

    rows = []
    for name, d in DEVICES.items():
        flops = ", ".join(f"{k} {_si(v, 'FLOP/s')}" for k, v in d.peak_flops.items())
        rows.append(
            [
                _code(name),
                d.kind,
                flops,
                f"{d.hbm_bytes / 2**30:.0f} GiB",
                _si(d.hbm_bandwidth, "B/s"),
                d.source,
            ]
        )
    header = ["device", "kind", "dense matmul peak", "memory", "memory bandwidth", "source"]
    return markdown_table(header, rows)


# ---------------------------------------------------------------------------- published runs


def _reference_csvs() -> list[Path]:
    files = sorted(REFERENCE.glob("*.csv"))
    if not files:
        raise GenerateDocsError(
            f"no published-runs CSVs in {REFERENCE}: the validation page is generated from them"
        )
    return files


def _price(row: dict[str, str]) -> tuple[Any, Any, Any]:
    """``(GPT, Parallel, IterationEstimate)`` of one published run by the closed form."""
    from cost_models import megatron

    t, p, gpus = int(row["tensor"]), int(row["pipeline"]), int(row["gpus"])
    if "layers" in row:
        model = megatron.GPT(
            l=int(row["layers"]),
            h=int(row["hidden"]),
            a=int(row["heads"]),
            V=int(row.get("vocab") or 51200),
            s=int(row.get("seq") or 2048),
        )
    else:  # Table 2 names its two models by size only (GPT-3 175B and 530B shapes)
        model = megatron.TABLE2_MODELS[float(row["params_b"])]
    par = megatron.Parallel(
        t=t,
        p=p,
        d=int(row.get("data") or gpus // (t * p)),
        B=int(row["global_batch"]),
        b=int(row.get("microbatch") or 1),
        scheme=row.get("scheme") or "ptdp",
    )
    return model, par, megatron.estimate_iteration(model, par, megatron.selene(par.gpus))


PUBLISHED_HEADER = (
    "run",
    "GPUs",
    "t / p / d",
    "B / b",
    "v / m",
    "published TFLOP/s",
    "predicted",
    "error",
    "l / h / a",
)


def published_tables() -> str:
    """One table per CSV of ``benchmarks/reference/``, one row per CSV row."""
    out = []
    for path in _reference_csvs():
        with open(path, newline="") as f:
            records = list(csv.DictReader(f))
        rows, errors = [], []
        for r in records:
            label = r.get("name") or (
                f"{r['scheme']} {r['params_b']}B" if r.get("scheme") else f"{r['params_b']}B"
            )
            published = float(r["tflops_per_gpu"])
            try:
                model, par, est = _price(r)
            except Exception as e:  # shown in the row: the table keeps one row per CSV row
                why = f"not priced: {type(e).__name__}: {e}"
                rows.append([label, r["gpus"], "", "", "", f"{published:g}", "—", why, ""])
                continue
            err = est.tflops_per_gpu / published - 1.0
            errors.append(abs(err))
            rows.append(
                [
                    label,
                    par.gpus,
                    f"{par.t} / {par.p} / {par.d}",
                    f"{par.B} / {par.b}",
                    f"{est.chunks} / {est.microbatches}",
                    f"{published:g}",
                    f"{est.tflops_per_gpu:.1f}",
                    f"{err:+.1%}",
                    f"{model.l} / {model.h} / {model.a}",
                ]
            )
        summary = (
            f"{len(errors)} of {len(records)} rows priced; |error| mean "
            f"{statistics.fmean(errors):.1%}, max {max(errors):.1%}."
            if errors
            else f"none of {len(records)} rows priced."
        )
        out += [
            f"### `{path.name}`",
            "",
            f'<div class="autopar-published" data-csv="{path.name}" markdown>',
            "",
            markdown_table(PUBLISHED_HEADER, rows, align="-rrrrrrr-"),
            "",
            "</div>",
            "",
            summary,
            "",
        ]
    return "\n".join(out)


def megatron_constants() -> str:
    """The fitted constants the closed form uses, read from the code."""
    from cost_models import megatron

    c = megatron.selene(8)
    eff = c.device.efficiency
    return (
        f"matmul `peak_fraction` {eff.peak_fraction:g} ({eff.source}) and the cluster's "
        f"`overlap_efficiency` {c.overlap_efficiency:g}"
    )


GENERATORS: dict[str, Callable[[], str]] = {
    "cli": cli_reference,
    "api-autopar": api_autopar,
    "axes": axes_table,
    "hideable": hideable_classes,
    "schedules": schedules,
    "remats": remats,
    "clusters": clusters_table,
    "devices": devices_table,
    "published": published_tables,
    "megatron-constants": megatron_constants,
}


# ---------------------------------------------------------------------------- mkdocs events


def on_config(config: Any, **kwargs: Any) -> Any:
    """Make the repository importable and keep jax on the CPU (nothing runs on devices)."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    return config


def on_page_markdown(markdown: str, page: Any, **kwargs: Any) -> str:
    """Replace each ``<!-- autopar:NAME -->`` line of a page with its generated block."""

    def generate(m: re.Match[str]) -> str:
        name = m.group(1)
        if name not in GENERATORS:
            raise GenerateDocsError(
                f"{page.file.src_path}: unknown block <!-- autopar:{name} -->; "
                f"known: {', '.join(GENERATORS)}"
            )
        return GENERATORS[name]()

    return MARKER.sub(generate, markdown)


__all__ = ["GENERATORS", "markdown_table", "on_config", "on_page_markdown"]
