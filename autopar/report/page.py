"""The report as one self-contained HTML page: inline CSS and inline SVG, no script, no
network. Sections, each an element with a stable ``id``:

``mesh`` (the mesh over the topology), ``stages`` (pipeline stages and the schedule's
Gantt chart), ``strategies`` (per-layer strategies in words), ``sharding`` (which device
holds which block of the largest parameters), ``time`` (step time: compute, each
collective, bubble), ``memory`` (per device against capacity), ``shortlist`` (the
runner-up plans and why each lost), ``verify`` (predicted vs compiled, or "not run").

Example:
    >>> page = build_page(plan)
    >>> all(f'id="{s}"' in page for s in SECTION_IDS)
    True
    >>> "http://" in page.replace('xmlns="http://www.w3.org/2000/svg"', "")
    False
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from autopar.plan import LayerStrategy, Plan, idle_axes
from autopar.report.bars import (
    candidate_segments,
    memory_figure,
    pair_bars,
    stacked_rows,
    time_segments,
)
from autopar.report.blocks import sharding_section_body
from autopar.report.schedule import bubble_fraction, gantt_figure, stages_table
from autopar.report.svg import axis_color, esc
from autopar.report.text import format_bytes, format_seconds, format_spec, summary
from autopar.report.topology import MAX_NODES_DRAWN, axis_maps, mesh_figure, topology_summary
from autopar.report.words import (
    class_words,
    headline,
    layout_words,
    param_bytes,
    pipeline_words,
    strategy_words,
    zero_words,
)

if TYPE_CHECKING:
    from autopar.verify.report import VerifyReport

SECTION_IDS: tuple[str, ...] = (
    "mesh",
    "stages",
    "strategies",
    "sharding",
    "time",
    "memory",
    "shortlist",
    "verify",
)
"""The report's sections, in page order."""

_TITLES = {
    "mesh": "Device mesh on the cluster",
    "stages": "Pipeline stages and schedule",
    "strategies": "Per-layer strategies",
    "sharding": "Who holds which block",
    "time": "Step time",
    "memory": "Memory per device",
    "shortlist": "Runner-up plans",
    "verify": "Predicted vs compiled",
}

CSS = """
:root{--ink:#1f2933;--muted:#6b7785;--line:#d9dee4;--bg:#f6f7f9;--card:#fff;--accent:#4c78a8}
*{box-sizing:border-box}
body{margin:0;font:14px/1.5 system-ui,-apple-system,"Segoe UI",Roboto,"Helvetica Neue",Arial,sans-serif;
 color:var(--ink);background:var(--bg)}
header{background:linear-gradient(120deg,#20354f,#3a5f8a);color:#fff;padding:26px 40px 22px}
header h1{margin:0 0 4px;font-size:24px;font-weight:650;letter-spacing:.2px}
header .sub{opacity:.85;font-size:14px}
.chips{margin-top:12px;display:flex;flex-wrap:wrap;gap:8px}
.chip{background:rgba(255,255,255,.14);border:1px solid rgba(255,255,255,.28);border-radius:14px;
 padding:2px 11px;font-size:12.5px}
.kpis{display:flex;flex-wrap:wrap;gap:14px;margin-top:16px}
.kpi{background:rgba(255,255,255,.1);border-radius:10px;padding:8px 14px;min-width:150px}
.kpi b{display:block;font-size:20px;font-weight:650}
.kpi span{font-size:12px;opacity:.85}
nav{position:sticky;top:0;z-index:2;background:#fff;border-bottom:1px solid var(--line);
 padding:8px 40px;display:flex;flex-wrap:wrap;gap:4px 18px;font-size:13px}
nav a{color:var(--accent);text-decoration:none}
nav a:hover{text-decoration:underline}
main{padding:18px 40px 40px;max-width:1320px}
section{background:var(--card);border:1px solid var(--line);border-radius:12px;padding:18px 22px;
 margin:16px 0;overflow-x:auto}
section h2{margin:0 0 8px;font-size:18px;font-weight:650}
section h2 .num{color:var(--muted);font-weight:500;margin-right:6px}
p{margin:6px 0 10px}
.muted{color:var(--muted)}
.small{font-size:12.5px}
code{font:12.5px ui-monospace,SFMono-Regular,Menlo,Consolas,monospace;background:#eef1f4;
 padding:1px 4px;border-radius:4px}
table.data{border-collapse:collapse;margin:8px 0 4px;font-size:13px}
table.data th{white-space:nowrap;text-align:left;font-weight:600;color:var(--muted);border-bottom:2px solid var(--line);
 padding:5px 12px 5px 0}
table.data td{border-bottom:1px solid #eef0f3;padding:5px 12px 5px 0;vertical-align:top}
table.data td.num{text-align:right;font-variant-numeric:tabular-nums;white-space:nowrap}
table.data tr.chosen td{background:#eef5ec}
.badge{display:inline-block;border-radius:9px;padding:0 8px;font-size:12px;font-weight:600}
.ok{background:#e3f1df;color:#2f6b26}.bad{background:#fbe3e1;color:#a3271c}
.warn{background:#fdf1d6;color:#7a5600}.na{background:#eceff2;color:#55606c}
.axis-row{display:flex;align-items:center;gap:10px;margin:6px 0;flex-wrap:wrap}
.swatch{width:14px;height:14px;border-radius:3px;display:inline-block}
.axis-name{font-weight:650;min-width:86px}
.axis-what{color:var(--muted);font-size:13px;min-width:420px;max-width:560px}
.leaves{display:grid;grid-template-columns:repeat(auto-fill,minmax(520px,1fr));gap:18px}
figure.leaf{margin:0}
figure.leaf figcaption{margin-bottom:6px;font-size:13px}
svg{max-width:100%;height:auto;font-family:inherit}
svg.fig{display:block;margin:12px 0 6px}
details summary{cursor:pointer;color:var(--accent)}
.legend{display:flex;flex-wrap:wrap;gap:4px 16px;margin:6px 0 4px;font-size:12px;color:var(--ink)}
.legend i{display:inline-block;width:11px;height:11px;border-radius:2px;margin-right:5px;vertical-align:-1px}
pre{background:#f3f5f7;padding:12px;border-radius:8px;overflow-x:auto;font-size:12px;line-height:1.35}
footer{color:var(--muted);font-size:12px;padding:0 40px 30px}
"""


def _section(sid: str, body: str, index: int) -> str:
    return (
        f'<section id="{sid}" data-section="{sid}"><h2><span class="num">{index}.</span>'
        f"{esc(_TITLES[sid])}</h2>{body}</section>"
    )


def _cluster_capacity(plan: Plan) -> float:
    device = plan.cluster.get("device") or {}
    return float(device.get("hbm_bytes", 0.0))


def _header(plan: Plan, title: str) -> str:
    p = plan.predicted
    cap = _cluster_capacity(plan)
    mesh = " x ".join(f"{a}={n}" for a, n in plan.mesh.items())
    device = (plan.cluster.get("device") or {}).get("name", "")
    sub = f"mesh {mesh} · {plan.num_devices} devices"
    if plan.cluster.get("name"):
        sub += f" · planned for {plan.cluster['name']}"
    kpis = [
        (format_seconds(p.step_time_s), "predicted step time"),
        (format_bytes(p.memory_bytes_per_device), "memory per device"
         + (f" ({p.memory_bytes_per_device / cap:.1%} of {cap / 1e9:.0f} GB)" if cap else "")),
        (str(plan.num_devices), f"devices{' (' + device + ')' if device else ''}"),
    ]  # fmt: skip
    if p.step_time_s > 0 and p.flops_per_device:
        kpis.append((f"{p.flops_per_device / p.step_time_s / 1e12:.1f} TFLOP/s", "per device"))
    chips = [*headline(plan), zero_words(plan.zero_stage).split(":")[0]]
    if plan.pipeline is not None:
        chips.append(pipeline_words(plan))
    chips = list(dict.fromkeys(chips))
    return (
        f'<header><h1>{esc(title)}</h1><div class="sub">{esc(sub)}</div>'
        '<div class="chips">'
        + "".join(f'<span class="chip">{esc(c)}</span>' for c in chips)
        + '</div><div class="kpis">'
        + "".join(f'<div class="kpi"><b>{esc(v)}</b><span>{esc(k)}</span></div>' for v, k in kpis)
        + "</div></header>"
    )


def _nodes(plan: Plan) -> int:
    per = int(plan.cluster.get("devices_per_node") or plan.num_devices)
    return max(int(plan.cluster.get("num_nodes") or 1), math.ceil(plan.num_devices / per))


def _mesh_body(plan: Plan) -> str:
    idle = idle_axes(plan)
    note = ""
    if idle:
        n = math.prod(plan.mesh[a] for a in idle)
        note = (
            f'<p class="idle-note"><span class="badge warn">idle axis</span> '
            f"{esc(', '.join(idle))} splits nothing: its devices repeat the same work (the plan "
            f"on {plan.num_devices // n} devices, {n} times over); the cost model found that "
            "faster than splitting over them.</p>"
        )
    return (
        f"<p>{esc(topology_summary(plan.mesh, plan.cluster))}</p>"
        + note
        + mesh_figure(plan.mesh, plan.cluster)
        + '<h3 class="small muted">Where each axis runs (devices shaded by their coordinate on it'
        + (f"; the first {MAX_NODES_DRAWN} nodes" if _nodes(plan) > MAX_NODES_DRAWN else "")
        + ")</h3>"
        + axis_maps(plan.mesh, plan.cluster, idle)
    )


def _stages_body(plan: Plan) -> str:
    pp = plan.pipeline
    if pp is None or pp.num_stages <= 1:
        n_layers = max((stop for _, stop in pp.stages), default=0) if pp else len(plan.layers)
        acc = (
            f", gradients accumulated over {pp.microbatches} microbatches"
            if pp and pp.microbatches > 1
            else ""
        )
        what = f" all {n_layers} layers" if n_layers else " the whole step"
        return (
            f'<p class="one-stage">No pipeline: the plan has <b>one stage</b>; every device runs'
            f"{esc(what)}{esc(acc)}.</p>"
        )
    frac = bubble_fraction(pp)
    pred = plan.predicted
    bubble = (
        f"predicted bubble {format_seconds(pred.bubble_s)} of {format_seconds(pred.step_time_s)}"
    )
    drawn = "" if frac is None else f"; the drawn schedule idles {frac:.0%} of the time"
    chart = gantt_figure(plan)
    if not chart:
        chart = '<p class="muted">The schedule could not be simulated for drawing.</p>'
    return (
        f"<p><b>{esc(pipeline_words(plan))}</b> ({esc(bubble)}{esc(drawn)}).</p>"
        + stages_table(plan)
        + '<p class="small muted">Chart: each chunk takes time in proportion to its layers, a '
        "backward twice its forward (the schedule's shape, not predicted seconds).</p>" + chart
    )


def _strategies_body(plan: Plan) -> str:
    axes = "".join(
        f'<tr><td><span class="swatch" style="background:{axis_color(a, list(plan.mesh))}"></span> '
        f'<b>{esc(a)}</b></td><td class="num">{n}</td><td>{esc(w)}</td></tr>'
        for a, n, w in _axis_rows(plan)
    )
    parts = [
        f"<p>{esc(zero_words(plan.zero_stage))}; activation recomputation (remat): "
        f"{esc(plan.remat)}.</p>",
        '<table class="data axes"><thead><tr><th>axis</th><th>size</th><th>does</th></tr></thead>'
        f"<tbody>{axes}</tbody></table>",
    ]
    if plan.layers:
        rows = []
        for name, ls in _layer_runs(plan):
            for i, (op, tags) in enumerate(ls.ops):
                rows.append(
                    f'<tr class="op-row"><td>{esc(name) if i == 0 else ""}</td><td><code>{esc(op)}</code></td>'
                    f'<td>{esc(strategy_words(tags))}</td><td class="muted small">{esc(tags)}</td></tr>'
                )
        parts.append(
            '<table class="data layers"><thead><tr><th>layer</th><th>op</th><th>strategy</th>'
            f"<th>planner's tag</th></tr></thead><tbody>{''.join(rows)}</tbody></table>"
        )
    else:
        parts.append('<p class="muted small">The plan records no per-op strategies (a pipeline '
                     "or hand-written plan); the parameter layouts below say what it splits.</p>")  # fmt: skip
    params = sorted((r for r in plan.inputs if r.role == "param"), key=lambda r: -param_bytes(r))
    if params:
        shown = params[:14]
        rows = [
            f"<tr><td><code>{esc(r.path)}</code></td><td>{esc(' x '.join(map(str, r.shape)) or 'scalar')}</td>"
            f"<td><code>{esc(format_spec(r.spec))}</code></td>"
            f"<td>{esc(layout_words(r, bool(r.spec) and r.spec[0] is not None and 'pipe' in str(r.spec[0])))}</td></tr>"
            for r in shown
        ]
        more = len(params) - len(shown)
        if more:
            rows.append(
                f'<tr><td colspan="4" class="muted">... {more} smaller parameters</td></tr>'
            )
        parts.append(
            '<h3 class="small muted">Largest parameters</h3><table class="data params"><thead><tr>'
            "<th>parameter</th><th>shape</th><th>spec</th><th>layout</th></tr></thead>"
            f"<tbody>{''.join(rows)}</tbody></table>"
        )
    return "".join(parts)


def _layer_runs(plan: Plan) -> list[tuple[str, LayerStrategy]]:
    """Consecutive layers with the same strategies, once each: ``("h_0 ... h_95 (96
    layers)", first layer)``."""
    runs: list[list[LayerStrategy]] = []
    for ls in plan.layers:
        if runs and runs[-1][0].ops == ls.ops:
            runs[-1].append(ls)
        else:
            runs.append([ls])
    out = []
    for run in runs:
        name = run[0].layer
        if len(run) > 1:
            name += f" ... {run[-1].layer} ({len(run)} layers alike)"
        out.append((name, run[0]))
    return out


def _axis_rows(plan: Plan) -> list[tuple[str, int, str]]:
    from autopar.report.words import axis_words

    out = []
    for a, n in plan.mesh.items():
        w = axis_words(a)
        if n == 1:
            w += " (size 1: unused)"
        out.append((a, n, w))
    return out


def _time_body(plan: Plan, compare: Sequence[Plan]) -> str:
    p = plan.predicted
    rows = [(f"{plan.name} (this plan)" if compare else "this plan", time_segments(p), "")]
    rows += [(c.name, time_segments(c.predicted), "") for c in compare]
    fig = stacked_rows(rows, caption="predicted step time")
    colls = sorted(p.collectives, key=lambda c: -c.time_s)
    total = sum(c.time_s for c in colls)
    trs = "".join(
        f"<tr><td>{esc(c.kind)}</td><td>{esc(','.join(c.axes))}</td><td>{esc(class_words(c.where))}</td>"
        f'<td class="num">{c.count}</td><td class="num">{esc(format_bytes(c.bytes))}</td>'
        f'<td class="num">{esc(format_seconds(c.time_s))}</td>'
        f'<td class="num">{esc(format_seconds(p.exposed_communication_s * c.time_s / total) if total else "-")}</td></tr>'
        for c in colls
    )
    table = (
        '<table class="data colls"><thead><tr><th>collective</th><th>axes</th><th>what for</th>'
        "<th>count</th><th>bytes / device</th><th>seconds</th><th>exposed share</th></tr></thead>"
        f"<tbody>{trs}</tbody></table>"
        if colls
        else '<p class="muted">The plan predicts no collective.</p>'
    )
    return (
        f"<p>Predicted {esc(format_seconds(p.step_time_s))} per step = compute "
        f"{esc(format_seconds(p.compute_s))} + exposed communication "
        f"{esc(format_seconds(p.exposed_communication_s))} (of {esc(format_seconds(p.communication_s))} "
        f"in all; the rest hides behind compute) + bubble {esc(format_seconds(p.bubble_s))}.</p>"
        + fig
        + '<p class="small muted">Exposed communication is shared among the collectives in '
        "proportion to their seconds (the cost model prices hiding per class).</p>" + table
    )


def _memory_body(plan: Plan) -> str:
    p = plan.predicted
    cap = _cluster_capacity(plan)
    head = (
        f"<p>Predicted peak {esc(format_bytes(p.memory_bytes_per_device))} per device"
        + (f" of {esc(format_bytes(cap))} ({esc(f'{cap / 1e9:.0f}')} GB) on each "
           f"{esc((plan.cluster.get('device') or {}).get('name', 'device'))}" if cap else
           " (the plan records no device capacity)")
        + ".</p>"
    )  # fmt: skip
    return head + memory_figure(p.memory_breakdown, p.memory_bytes_per_device, cap)


def _shortlist_body(plan: Plan) -> str:
    if len(plan.shortlist) <= 1:
        return ('<p class="muted">The plan carries no runner-up: it was not searched (a '
                "hand-written or baseline plan) or the search priced one candidate.</p>")  # fmt: skip
    cap = _cluster_capacity(plan)
    rows = []
    bars = []
    for i, c in enumerate(plan.shortlist):
        cls = "chosen" if c.verdict == "chosen" else "loser"
        step = "-" if c.step_time_s is None else format_seconds(c.step_time_s)
        mem = "-" if c.memory_bytes_per_device is None else format_bytes(c.memory_bytes_per_device)
        if cap and c.memory_bytes_per_device is not None:
            mem += f" ({c.memory_bytes_per_device / cap:.1%})"
        verdict = c.verdict or "-"
        badge = "ok" if c.verdict == "chosen" else ("na" if c.step_time_s is None else "warn")
        rows.append(
            f'<tr class="cand {cls}" data-rank="{i}"><td class="num">{i + 1}</td><td>{esc(c.label)}</td>'
            f'<td class="num">{esc(step)}</td><td class="num">{esc(mem)}</td>'
            f'<td><span class="badge {badge}">{esc(verdict)}</span></td></tr>'
        )
        segs = candidate_segments(c)
        if segs:
            bars.append((f"#{i + 1}" + (" chosen" if c.verdict == "chosen" else ""), segs, ""))
    table = (
        '<table class="data shortlist"><thead><tr><th>#</th><th>candidate</th><th>step time</th>'
        f"<th>memory / device</th><th>verdict</th></tr></thead><tbody>{''.join(rows)}</tbody></table>"
    )
    fig = (
        stacked_rows(bars, label_w=110, caption="candidates' step time", cls="fig cand-bars")
        if bars
        else ""
    )
    return (
        "<p>The candidates the search priced, best first, and why each lost against the chosen "
        "plan.</p>" + table + fig
    )


def _verify_body(verify: VerifyReport | None) -> str:
    if verify is None:
        return ('<p class="not-run"><span class="badge na">not run</span> The plan was not '
                "compiled and checked: run <code>autopar.verify</code> (or the function's "
                "<code>.verify(...)</code>) and pass its result to <code>write_report(..., "
                "verify=...)</code>.</p>")  # fmt: skip
    rows = []
    for r in verify.rows:
        err = r.bytes_error
        badge = "ok" if r.ok else "bad"
        rows.append(
            f'<tr class="vrow" data-kind="{esc(r.kind)}" data-status="{esc(r.status)}"><td>{esc(r.kind)}</td>'
            f'<td class="num">{"-" if r.predicted_count is None else r.predicted_count} / {r.hlo_count}</td>'
            f'<td class="num">{esc("-" if r.predicted_bytes is None else format_bytes(r.predicted_bytes))}</td>'
            f'<td class="num">{esc(format_bytes(r.hlo_bytes))}</td>'
            f'<td class="num">{esc("-" if err is None else f"{err:+.1%}")}</td>'
            f"<td>{pair_bars(r.predicted_bytes, r.hlo_bytes)}</td>"
            f'<td><span class="badge {badge}">{esc(r.status)}</span></td></tr>'
        )
    m = verify.memory
    if m is not None:
        err = m.error
        badge = ("ok" if m.ok else "bad") if m.checked else "na"
        rows.append(
            f'<tr class="vrow" data-kind="peak memory" data-status="{"ok" if m.ok else "memory"}">'
            f"<td><b>peak memory</b></td><td></td>"
            f'<td class="num">{esc(format_bytes(m.predicted_bytes) if m.checked else "-")}</td>'
            f'<td class="num">{esc(format_bytes(m.compiled_bytes))}</td>'
            f'<td class="num">{esc("-" if err is None else f"{err:+.1%}")}</td>'
            f"<td>{pair_bars(m.predicted_bytes if m.checked else None, m.compiled_bytes)}</td>"
            f'<td><span class="badge {badge}">{"ok" if m.ok else "memory"}</span></td></tr>'
        )
    verdict = "ok" if verify.ok else "bad"
    notes = "".join(f"<li>{esc(n)}</li>" for n in verify.notes)
    return (
        f'<p>Compiled and checked: <span class="badge {verdict}" data-ok="{str(verify.ok).lower()}">'
        f"{'matches' if verify.ok else 'does not match'}</span> (collective bytes per step and "
        "device from the HLO after SPMD partitioning; memory from <code>memory_analysis()</code>).</p>"
        '<table class="data verify"><thead><tr><th>collective</th><th>count pred / HLO</th>'
        "<th>bytes predicted</th><th>bytes compiled</th><th>error</th>"
        '<th><span style="color:#4c78a8">■</span> predicted <span style="color:#f58518">■</span> '
        f"compiled</th><th>status</th></tr></thead><tbody>{''.join(rows)}</tbody></table>"
        + (f'<ul class="small muted">{notes}</ul>' if notes else "")
    )


def build_page(
    plan: Plan,
    *,
    verify: VerifyReport | None = None,
    sections: Mapping[str, str] | None = None,
    compare: Sequence[Plan] = (),
    title: str | None = None,
) -> str:
    """The report of ``plan`` as one self-contained HTML document.

    Args:
        plan: the plan.
        verify: what :func:`autopar.verify.verify` found for it, if it was compiled.
        sections: extra titled text blocks shown as preformatted text at the end.
        compare: other plans (baselines) whose step time is drawn beside this one's.
        title: the page title (default: ``autopar report: <plan name>``).

    Returns:
        The HTML text.
    """
    title = title or f"autopar report: {plan.name}"
    bodies = {
        "mesh": _mesh_body(plan),
        "stages": _stages_body(plan),
        "strategies": _strategies_body(plan),
        "sharding": sharding_section_body(plan),
        "time": _time_body(plan, list(compare)),
        "memory": _memory_body(plan),
        "shortlist": _shortlist_body(plan),
        "verify": _verify_body(verify),
    }
    nav = "".join(f'<a href="#{s}">{esc(_TITLES[s])}</a>' for s in SECTION_IDS)
    extra = ""
    for i, (name, content) in enumerate((sections or {}).items()):
        extra += f'<section id="extra-{i}" class="extra"><h2>{esc(name)}</h2><pre>{esc(content)}</pre></section>'
    text_summary = (
        '<section id="summary"><details><summary>The plan as text (<code>autopar show</code>)'
        f"</summary><pre>{esc(summary(plan, max_layers=min(len(plan.layers), 64) or 4))}</pre>"
        "</details></section>"
    )
    return (
        "<!doctype html>\n"
        f'<html lang="en"><head><meta charset="utf-8"><meta name="viewport" '
        f'content="width=device-width, initial-scale=1"><title>{esc(title)}</title>'
        f"<style>{CSS}</style></head><body>"
        + _header(plan, title)
        + f"<nav>{nav}</nav><main>"
        + "".join(_section(s, bodies[s], i + 1) for i, s in enumerate(SECTION_IDS))
        + extra
        + text_summary
        + "</main>"
        f"<footer>autopar · cost model {esc(plan.cost_model_version or '?')} · "
        f"plan fingerprint {esc(plan.fingerprint or '-')}. "
        "Load the plan with <code>autopar.Plan.load</code>; replay it with "
        "<code>@autopar.autoparallel(plan=...)</code>.</footer></body></html>\n"
    )
