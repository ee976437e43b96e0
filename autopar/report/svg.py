"""Inline SVG, written as text: a few element helpers, the report's colours, and units.

The HTML report (:mod:`autopar.report.page`) draws every figure with these helpers, so
the page needs no plotting library, no script and no network. Every value is escaped.

Example:
    >>> rect(0, 0, 10, 5, "#4c78a8", cls="seg", title="compute", seconds=0.5)
    '<rect x="0" y="0" width="10" height="5" rx="3" fill="#4c78a8" class="seg" data-seconds="0.5"><title>compute</title></rect>'
    >>> axis_color("tensor")
    '#f58518'
"""

from __future__ import annotations

import html
import math
from collections.abc import Iterable, Mapping, Sequence

# Colours: Tableau 10 (Vega's "tableau10" scheme), a palette designed to be told apart.
TABLEAU10: tuple[str, ...] = (
    "#4c78a8",
    "#f58518",
    "#e45756",
    "#72b7b2",
    "#54a24b",
    "#eeca3b",
    "#b279a2",
    "#ff9da6",
    "#9d755d",
    "#bab0ac",
)

AXIS_COLORS: Mapping[str, str] = {
    "data": "#4c78a8",
    "fsdp": "#72b7b2",
    "tensor": "#f58518",
    "seq": "#54a24b",
    "expert": "#b279a2",
    "pipe": "#e45756",
}
"""One colour per mesh axis autopar knows; other names take the rest of Tableau 10."""

INK = "#1f2933"
MUTED = "#6b7785"
GRID = "#d9dee4"


def esc(value: object) -> str:
    """``value`` as text safe inside HTML or SVG, quotes included."""
    return html.escape(str(value), quote=True)


def fmt_num(x: float) -> str:
    """A coordinate: at most two decimals, no trailing zeros (``12.5``, ``3``)."""
    text = f"{x:.2f}".rstrip("0").rstrip(".")
    return "0" if text in ("-0", "") else text


def axis_color(axis: str, mesh_axes: Sequence[str] = ()) -> str:
    """The colour of mesh axis ``axis`` (a known axis keeps its colour in every report;
    another takes a spare Tableau colour by its position in ``mesh_axes``)."""
    if axis in AXIS_COLORS:
        return AXIS_COLORS[axis]
    spare = [c for c in TABLEAU10 if c not in AXIS_COLORS.values()]
    others = [a for a in mesh_axes if a not in AXIS_COLORS]
    i = others.index(axis) if axis in others else sum(map(ord, axis))
    return spare[i % len(spare)]


def tint(color: str, t: float) -> str:
    """``color`` mixed with white: ``t = 0`` the colour, ``t = 1`` white.

    Example:
        >>> tint("#000000", 0.5)
        '#808080'
    """
    r, g, b = (int(color[i : i + 2], 16) for i in (1, 3, 5))
    mix = [round(c + (255 - c) * t) for c in (r, g, b)]
    return "#" + "".join(f"{c:02x}" for c in mix)


def ink_on(color: str) -> str:
    """Dark or white text, whichever reads better on ``color`` (WCAG relative luminance)."""
    r, g, b = (int(color[i : i + 2], 16) / 255 for i in (1, 3, 5))

    def lin(c: float) -> float:
        return c / 12.92 if c <= 0.03928 else ((c + 0.055) / 1.055) ** 2.4

    lum = 0.2126 * lin(r) + 0.7152 * lin(g) + 0.0722 * lin(b)
    return INK if lum > 0.4 else "#ffffff"


def _attrs(pairs: Iterable[tuple[str, object]]) -> str:
    return " ".join(f'{k}="{esc(v)}"' for k, v in pairs if v is not None)


def _data(data: Mapping[str, object]) -> list[tuple[str, object]]:
    return [(f"data-{k.replace('_', '-')}", v) for k, v in data.items()]


def rect(
    x: float,
    y: float,
    w: float,
    h: float,
    fill: str,
    *,
    rx: float = 3,
    cls: str | None = None,
    title: str | None = None,
    stroke: str | None = None,
    opacity: float | None = None,
    **data: object,
) -> str:
    """A ``<rect>``; ``title`` becomes its hover tooltip, ``data`` its ``data-*`` attributes."""
    a = _attrs(
        [
            ("x", fmt_num(x)),
            ("y", fmt_num(y)),
            ("width", fmt_num(max(w, 0.0))),
            ("height", fmt_num(max(h, 0.0))),
            ("rx", fmt_num(rx)),
            ("fill", fill),
            ("stroke", stroke),
            ("fill-opacity", None if opacity is None else fmt_num(opacity)),
            ("class", cls),
            *_data(data),
        ]
    )
    if title is None:
        return f"<rect {a}/>"
    return f"<rect {a}><title>{esc(title)}</title></rect>"


def text(
    x: float,
    y: float,
    s: object,
    *,
    size: float = 11,
    anchor: str = "start",
    fill: str = INK,
    weight: str | None = None,
    cls: str | None = None,
    baseline: str | None = "middle",
) -> str:
    """A ``<text>`` at ``(x, y)`` (vertically centred on ``y`` by default)."""
    a = _attrs(
        [
            ("x", fmt_num(x)),
            ("y", fmt_num(y)),
            ("font-size", fmt_num(size)),
            ("text-anchor", anchor),
            ("dominant-baseline", baseline),
            ("fill", fill),
            ("font-weight", weight),
            ("class", cls),
        ]
    )
    return f"<text {a}>{esc(s)}</text>"


def line(
    x1: float,
    y1: float,
    x2: float,
    y2: float,
    stroke: str = INK,
    *,
    width: float = 1,
    dash: str | None = None,
    cls: str | None = None,
    **data: object,
) -> str:
    """A ``<line>``."""
    a = _attrs(
        [
            ("x1", fmt_num(x1)),
            ("y1", fmt_num(y1)),
            ("x2", fmt_num(x2)),
            ("y2", fmt_num(y2)),
            ("stroke", stroke),
            ("stroke-width", fmt_num(width)),
            ("stroke-dasharray", dash),
            ("class", cls),
            *_data(data),
        ]
    )
    return f"<line {a}/>"


def svg(width: float, height: float, body: Iterable[str], *, label: str, cls: str = "") -> str:
    """An inline ``<svg>`` of the given size (it scales down with the page, never up)."""
    w, h = fmt_num(math.ceil(width)), fmt_num(math.ceil(height))
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" class="{esc(cls)}" viewBox="0 0 {w} {h}" '
        f'width="{w}" height="{h}" role="img" aria-label="{esc(label)}">' + "".join(body) + "</svg>"
    )


def clip_label(s: str, width_px: float, size: float = 11) -> str:
    """``s`` shortened with an ellipsis to fit ``width_px`` (about 0.6 em per character),
    or ``""`` when not even three characters fit."""
    fits = int(width_px / (0.6 * size))
    if len(s) <= fits:
        return s
    return s[: fits - 1] + "…" if fits >= 3 else ""


def fit_label(s: str, width_px: float, size: float = 11) -> str:
    """``s`` when it fits ``width_px`` whole, else ``""`` (numbers are never cut)."""
    return s if len(s) * 0.6 * size <= width_px else ""


def legend_html(items: Sequence[tuple[str, str]]) -> str:
    """Colour swatches with labels as an HTML row that wraps with the page (class
    ``legend``)."""
    return (
        '<div class="legend">'
        + "".join(
            f'<span><i style="background:{esc(color)}"></i>{esc(label)}</span>'
            for label, color in items
        )
        + "</div>"
    )
