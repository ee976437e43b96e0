"""Bar charts of predicted cost: step time (compute, each collective, bubble) and memory
per device against the device's capacity.

The step bar splits the predicted step time into compute, the *exposed* communication
and the bubble (``Predicted.step_time_s = compute_s + exposed_communication_s +
bubble_s``). The exposed seconds are shared among the collectives in proportion to their
predicted seconds: the cost model prices hiding per class, not per collective, so the
split is an attribution (each collective's own seconds, hidden or not, are in the table
beside it). Collectives of one kind (all-reduce, all-gather, ...) make one segment.

Example:
    >>> from autopar.plan import Predicted, PredictedCollective
    >>> p = Predicted(1.0, compute_s=0.6, communication_s=0.5, exposed_communication_s=0.3,
    ...               bubble_s=0.1, collectives=(PredictedCollective("all-reduce", ("data",),
    ...               8.0, 1, 0.5, "dp_grad"),))
    >>> [(s.key, round(s.seconds, 3)) for s in time_segments(p)]
    [('compute', 0.6), ('all-reduce', 0.3), ('bubble', 0.1)]
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from autopar.plan import Candidate, Predicted
from autopar.report.svg import (
    GRID,
    INK,
    MUTED,
    TABLEAU10,
    clip_label,
    fit_label,
    ink_on,
    legend_html,
    line,
    rect,
    svg,
    text,
)
from autopar.report.text import format_bytes, format_seconds
from autopar.report.words import class_words

COMPUTE_COLOR = "#4c78a8"
BUBBLE_COLOR = "#bab0ac"
OTHER_COLOR = "#d4d8dd"
CLASS_COLORS: Mapping[str, str] = {
    "dp_grad": "#72b7b2",
    "fsdp_gather": "#54a24b",
    "tensor": "#f58518",
    "pipeline_p2p": "#e45756",
    "pipeline_relayout": "#d6616b",
    "seq": "#eeca3b",
    "expert": "#b279a2",
    "reshard": "#9d755d",
    "batch_reduce": "#ff9da6",
}
KIND_COLORS: Mapping[str, str] = {
    "all-reduce": "#72b7b2",
    "all-gather": "#54a24b",
    "reduce-scatter": "#eeca3b",
    "all-to-all": "#b279a2",
    "collective-permute": "#e45756",
    "p2p": "#e45756",
}
MEMORY_COLORS: Mapping[str, str] = {
    "params": "#4c78a8",
    "grads": "#72b7b2",
    "optimizer": "#54a24b",
    "activations": "#f58518",
    "temporaries": "#eeca3b",
    "inputs": "#9d755d",
    "pipeline_buffers": "#e45756",
    "pipeline_tick": "#ff9da6",
}

BAR_W = 880.0
"""Width of a full bar, px."""


@dataclass(frozen=True)
class Segment:
    """One part of a stacked bar."""

    key: str
    label: str
    seconds: float
    color: str
    detail: str = ""


def time_segments(p: Predicted) -> list[Segment]:
    """Compute, each collective kind's share of the exposed communication, the bubble,
    and whatever of the step time those leave (``other``)."""
    segs = [Segment("compute", "compute", p.compute_s, COMPUTE_COLOR)]
    total = sum(c.time_s for c in p.collectives)
    exposed = p.exposed_communication_s
    if p.collectives and total > 0:
        kinds: dict[str, list] = {}
        for c in p.collectives:
            kinds.setdefault(c.kind, []).append(c)
        for i, (kind, cs) in enumerate(
            sorted(kinds.items(), key=lambda kv: -sum(c.time_s for c in kv[1]))
        ):
            secs = sum(c.time_s for c in cs)
            what = ", ".join(dict.fromkeys(class_words(c.where) for c in cs))
            segs.append(
                Segment(
                    kind,
                    kind,
                    exposed * secs / total,
                    KIND_COLORS.get(kind, TABLEAU10[(i + 5) % len(TABLEAU10)]),
                    f"{sum(c.count for c in cs)} x, {format_bytes(sum(c.bytes for c in cs))}, "
                    f"{format_seconds(secs)} in all: {what}",
                )
            )
    elif exposed > 0:
        segs.append(Segment("communication", "exposed communication", exposed, "#9d755d"))
    if p.bubble_s > 0:
        segs.append(Segment("bubble", "pipeline bubble", p.bubble_s, BUBBLE_COLOR))
    rest = p.step_time_s - sum(s.seconds for s in segs)
    if rest > 0.005 * p.step_time_s:
        segs.append(Segment("other", "other (not broken down)", rest, OTHER_COLOR))
    return segs


def candidate_segments(c: Candidate) -> list[Segment]:
    """A shortlisted candidate's step time as compute, each communication class's share
    of what compute and bubble leave, and bubble (``[]`` when it was not priced)."""
    if c.step_time_s is None:
        return []
    segs = [Segment("compute", "compute", c.compute_s, COMPUTE_COLOR)]
    exposed = max(c.step_time_s - c.compute_s - c.bubble_s, 0.0)
    total = sum(c.communication_by_class.values())
    if total > 0 and exposed > 0:
        for k, v in c.communication_by_class.items():
            segs.append(
                Segment(k, class_words(k), exposed * v / total, CLASS_COLORS.get(k, "#9d755d"),
                        f"{format_seconds(v)} in all")
            )  # fmt: skip
    if c.bubble_s > 0:
        segs.append(Segment("bubble", "pipeline bubble", c.bubble_s, BUBBLE_COLOR))
    return segs


def stacked_rows(
    rows: Sequence[tuple[str, Sequence[Segment], str]],
    *,
    label_w: float = 210,
    unit: str = "s",
    cls: str = "fig time-bars",
    caption: str = "",
) -> str:
    """Horizontal stacked bars on one scale, one per ``(name, segments, note)``; segments
    have class ``seg``, ``data-key`` and ``data-seconds``; a legend below."""
    longest = max((sum(s.seconds for s in segs) for _, segs, _ in rows), default=0.0) or 1.0
    scale = BAR_W / longest
    bar_h, gap = 30, 12
    body: list[str] = []
    legend_items: dict[str, tuple[str, str]] = {}
    for i, (name, segs, note) in enumerate(rows):
        y = i * (bar_h + gap)
        body.append(text(label_w - 10, y + bar_h / 2, clip_label(name, label_w - 14, 12), size=12,
                         anchor="end", weight="600" if i == 0 else None))  # fmt: skip
        x = label_w
        for s in segs:
            w = s.seconds * scale
            tip = f"{s.label}: {format_seconds(s.seconds)}" + (f" ({s.detail})" if s.detail else "")
            body.append(rect(x, y, w, bar_h, s.color, rx=2, cls="seg", title=tip, key=s.key,
                             seconds=repr(float(s.seconds))))  # fmt: skip
            short = fit_label(format_seconds(s.seconds), w - 6, 10.5)
            if short:
                body.append(text(x + w / 2, y + bar_h / 2, short, size=10.5, anchor="middle",
                                 fill=ink_on(s.color)))  # fmt: skip
            x += w
            legend_items.setdefault(s.label, (s.label, s.color))
        total = sum(s.seconds for s in segs)
        body.append(text(x + 8, y + bar_h / 2, format_seconds(total) + (f"  {note}" if note else ""),
                         size=11.5, fill=INK))  # fmt: skip
    y0 = len(rows) * (bar_h + gap)
    body.append(line(label_w, y0 - gap / 2, label_w + BAR_W, y0 - gap / 2, GRID))
    width = label_w + BAR_W + 150
    fig = svg(width, y0, body, label=caption or "stacked bars", cls=cls)
    return fig + legend_html(list(legend_items.values()))


def memory_figure(breakdown: Mapping[str, float], total: float, capacity: float) -> str:
    """Memory per device: the breakdown stacked on a bar against the device's capacity
    (a line, class ``capacity``, ``data-bytes``); when the bar is under 5 % of it, a
    second bar zooms into the breakdown. Segments: class ``mem-seg``, ``data-bytes``."""
    label_w = 150.0
    scale_max = max(capacity, total, 1.0) * 1.04
    scale = BAR_W / scale_max
    bar_h = 32
    body: list[str] = []
    parts = [(k, float(v)) for k, v in breakdown.items() if v > 0]
    rest = total - sum(v for _, v in parts)
    if rest > 0.005 * max(total, 1.0):
        parts.append(("other", rest))
    colors = {
        k: MEMORY_COLORS.get(k, TABLEAU10[(i + 3) % len(TABLEAU10)])
        for i, (k, _) in enumerate(parts)
    }

    def bar(y: float, sc: float, cls: str) -> None:
        x = label_w
        for k, v in parts:
            w = v * sc
            body.append(rect(x, y, w, bar_h, colors[k], rx=1, cls=cls, title=f"{k}: {format_bytes(v)}",
                             key=k, bytes=repr(float(v))))  # fmt: skip
            short = clip_label(f"{k} {format_bytes(v)}", w - 6, 10.5)
            if short:
                body.append(text(x + w / 2, y + bar_h / 2, short, size=10.5, anchor="middle",
                                 fill=ink_on(colors[k])))  # fmt: skip
            x += w

    body.append(text(label_w - 10, bar_h / 2, "per device", size=12, anchor="end", weight="600"))
    body.append(rect(label_w, 0, capacity * scale, bar_h, "#f1f3f5", rx=2))
    bar(0, scale, "mem-seg")
    cx = label_w + capacity * scale
    share = total / capacity if capacity else 0.0
    if capacity > 0:
        body.append(line(cx, -6, cx, bar_h + 6, "#c0392b", width=2.5, cls="capacity",
                         bytes=repr(float(capacity))))  # fmt: skip
        body.append(text(cx, bar_h + 16, f"capacity {format_bytes(capacity)} ({capacity / 1e9:.0f} GB)",
                         size=11.5, anchor="end", fill="#c0392b", weight="600"))  # fmt: skip
    body.append(text(label_w, bar_h + 16, f"{format_bytes(total)} = {share:.2%} of capacity" if capacity
                     else format_bytes(total), size=11.5, fill=INK))  # fmt: skip
    height = bar_h + 26
    if capacity and total < 0.05 * capacity and total > 0:
        y = height + 10
        body.append(
            text(label_w - 10, y + bar_h / 2, "zoomed: 100% =", size=11, anchor="end", fill=MUTED)
        )
        body.append(text(label_w - 10, y + bar_h / 2 + 13, format_bytes(total), size=11, anchor="end",
                         fill=MUTED))  # fmt: skip
        bar(y, BAR_W / total, "mem-zoom")
        height = y + bar_h + 8
    fig = svg(label_w + BAR_W + 40, height + 4, body, label="memory per device", cls="fig memory")
    return fig + legend_html([(k, colors[k]) for k, _ in parts])


def pair_bars(predicted: float | None, compiled: float, width: float = 220) -> str:
    """Two thin bars, predicted over compiled, on the larger's scale (verify table)."""
    top = max(predicted or 0.0, compiled, 1.0)
    w_p = (predicted or 0.0) / top * width
    w_c = compiled / top * width
    body = [
        rect(0, 1, w_p, 9, COMPUTE_COLOR, rx=1, cls="pred-bar"),
        rect(0, 13, w_c, 9, "#f58518", rx=1, cls="hlo-bar"),
    ]
    return svg(width, 23, body, label="predicted vs compiled", cls="pair")
