"""Pipeline stages and their schedule as a Gantt chart.

The chart replays the plan's schedule (GPipe, 1F1B, interleaved 1F1B, zero-bubble) with
:func:`cost_models.simulate_schedule`, one row per stage (``pipe`` device), one box per
forward (F) and backward (B; zero-bubble also W) of each microbatch and chunk. A plan does
not store per-stage seconds, so the chart gives each chunk time in proportion to its
layers, a backward twice its forward (the usual 2:1 of a matmul's backward to forward):
the shape of the schedule and its bubble, not the predicted seconds.

Example:
    >>> from autopar.plan import PipelinePlan
    >>> ops = schedule_ops(PipelinePlan(((0, 2), (2, 4)), "gpipe", 3))
    >>> len(ops), sorted({op.op for op in ops})
    (12, ['B', 'F'])
"""

from __future__ import annotations

from collections.abc import Sequence

from autopar.plan import PipelinePlan, Plan
from autopar.report.svg import GRID, MUTED, esc, ink_on, legend_html, rect, svg, text, tint
from autopar.report.topology import mesh_coords
from autopar.report.words import device_ranges, schedule_words
from cost_models import CostModelError, TimelineEntry, simulate_schedule

BACKWARD_OVER_FORWARD = 2.0
"""Backward seconds per forward second in the drawing: a matmul's backward computes two
products (input and weight gradients) for the forward's one (Narayanan et al. 2021, §3.2)."""

OP_COLORS = {"F": "#4c78a8", "B": "#f58518", "W": "#54a24b"}


def schedule_ops(pp: PipelinePlan) -> tuple[TimelineEntry, ...]:
    """Every op of the plan's schedule, simulated with chunk times in proportion to their
    layers (at least one each)."""
    layers = [max(stop - start, 1) for start, stop in pp.stages]
    fwd = [float(n) for n in layers]
    bwd = [BACKWARD_OVER_FORWARD * f for f in fwd]
    result = simulate_schedule(
        pp.schedule, fwd, bwd, pp.microbatches, chunks=pp.chunks, timeline=True, per_chunk=True
    )
    return result.timeline


def stage_devices(plan: Plan, stage: int) -> list[int]:
    """The devices of pipeline stage ``stage`` (its coordinate on ``pipe``)."""
    if "pipe" not in plan.mesh:
        return list(range(plan.num_devices))
    i = list(plan.mesh).index("pipe")
    return [d for d, c in enumerate(mesh_coords(plan.mesh)) if c[i] == stage]


def stages_table(plan: Plan) -> str:
    """An HTML table: each stage, its devices and its layers (chunks when interleaved)."""
    pp = plan.pipeline
    assert pp is not None
    p = pp.num_stages
    rows = []
    for s in range(p):
        chunks = [pp.stages[c * p + s] for c in range(pp.chunks)]
        if len(chunks) == 1:
            layer_text = _layers_text(plan, chunks[0])
        else:
            layer_text = "; ".join(
                f"chunk {c}: {_layers_text(plan, r)}" for c, r in enumerate(chunks)
            )
        remat = (
            sorted({pp.stage_remat[c * p + s] for c in range(pp.chunks)})
            if pp.stage_remat
            else ["none"]
        )
        rows.append(
            f'<tr class="stage-row" data-stage="{s}"><td>stage {s}</td>'
            f"<td>{esc(device_ranges(stage_devices(plan, s)))}</td>"
            f"<td>{esc(layer_text)}</td><td>{esc(', '.join(remat))}</td></tr>"
        )
    head = "<tr><th>stage</th><th>devices</th><th>layers</th><th>stage remat</th></tr>"
    return f'<table class="data stages"><thead>{head}</thead><tbody>{"".join(rows)}</tbody></table>'


def _layers_text(plan: Plan, r: Sequence[int]) -> str:
    start, stop = r
    names = [ls.layer for ls in plan.layers]
    count = stop - start
    what = f"layer {start}" if count == 1 else f"layers {start}-{stop - 1}"
    total = max(s for _, s in plan.pipeline.stages) if plan.pipeline else 0
    # plan.layers names the graph's layers only when it lists each one (no scan, no extra
    # "(other)" row); the stage ranges index the graph's layers.
    plain = all("[x" not in n and not n.startswith("(") for n in names)
    if len(names) == total and plain and count <= 4:
        what += " (" + ", ".join(names[start:stop]) + ")"
    return what


def gantt_figure(plan: Plan) -> str:
    """The schedule as a Gantt chart (``""`` when the plan has no pipeline or the schedule
    cannot be simulated). Boxes have class ``op`` and ``data-op``, ``data-stage``,
    ``data-mb`` and ``data-chunk`` attributes."""
    pp = plan.pipeline
    if pp is None:
        return ""
    try:
        ops = schedule_ops(pp)
    except CostModelError:
        return ""
    p = pp.num_stages
    end = max(op.end for op in ops)
    label_w, row_h, top = 70, 30, 8
    width = 1060
    scale = (width - label_w - 10) / end
    body: list[str] = []
    for s in range(p):
        y = top + s * (row_h + 6)
        body.append(rect(label_w, y, end * scale, row_h, "#f1f3f5", rx=3, cls="lane"))
        body.append(text(label_w - 8, y + row_h / 2, f"stage {s}", size=11.5, anchor="end"))
    for op in ops:
        y = top + op.device * (row_h + 6)
        x, w = label_w + op.start * scale, (op.end - op.start) * scale
        color = tint(OP_COLORS.get(op.op, "#9d755d"), 0.45 * op.chunk / max(pp.chunks - 1, 1))
        title = f"stage {op.device}: {op.op} of microbatch {op.microbatch}"
        if pp.chunks > 1:
            title += f", chunk {op.chunk}"
        body.append(
            rect(x + 0.5, y + 1, w - 1, row_h - 2, color, rx=3, cls="op", title=title,
                 op=op.op, stage=op.device, mb=op.microbatch, chunk=op.chunk)
        )  # fmt: skip
        label = f"{op.op}{op.microbatch}"
        if w >= 7 * len(label) + 4:
            body.append(text(x + w / 2, y + row_h / 2, label, size=10.5, anchor="middle",
                             fill=ink_on(color)))  # fmt: skip
    y = top + p * (row_h + 6) + 4
    body.append(
        f'<line x1="{label_w}" y1="{y}" x2="{label_w + end * scale:.1f}" y2="{y}" stroke="{GRID}"/>'
    )
    body.append(text(label_w, y + 12, "0", size=10, fill=MUTED))
    body.append(
        text(label_w + end * scale, y + 12, "time (relative) →", size=10, anchor="end", fill=MUTED)
    )
    items = [("forward (F)", OP_COLORS["F"]), ("backward (B)", OP_COLORS["B"])]
    if any(op.op == "W" for op in ops):
        items = [("forward (F)", OP_COLORS["F"]), ("input grad (B)", OP_COLORS["B"]),
                 ("weight grad (W)", OP_COLORS["W"])]  # fmt: skip
    if pp.chunks > 1:  # later chunks lighter
        items = [
            (f"{name}, chunk {c}", tint(color, 0.45 * c / (pp.chunks - 1)))
            for name, color in items
            for c in range(pp.chunks)
        ]
    items.append(("idle (bubble)", "#f1f3f5"))
    title = f"{schedule_words(pp.schedule)} schedule, {p} stages x {pp.microbatches} microbatches"
    return svg(width, y + 18, body, label=title, cls="fig gantt") + legend_html(items)


def bubble_fraction(pp: PipelinePlan) -> float | None:
    """Idle share of the drawn schedule: (makespan - busiest stage's work) / makespan."""
    try:
        ops = schedule_ops(pp)
    except CostModelError:
        return None
    end = max(op.end for op in ops)
    busy = [0.0] * pp.num_stages
    for op in ops:
        busy[op.device] += op.end - op.start
    return (end - max(busy)) / end if end else 0.0
