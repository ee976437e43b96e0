"""Which device holds which block of a parameter, drawn as a grid (what
``jax.debug.visualize_array_sharding`` prints, as SVG).

A dimension split over mesh axes ``(a, b)`` (outer first) is cut into ``|a| * |b|``
blocks; device ``d`` holds block ``coord_a(d) * |b| + coord_b(d)`` of it (JAX's
``PartitionSpec`` order). Devices that differ only on axes the spec does not use hold
the same block: replicas.

Example:
    >>> from autopar.plan import TensorSharding
    >>> r = TensorSharding("w", (16, 32), "float32", (None, "tensor"), "param")
    >>> g = block_grid(r, {"data": 2, "tensor": 2})
    >>> g.dims, g.rows, g.cols, g.holders[(0, 1)]
    ((0, 1), 1, 2, (1, 3))
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from autopar.plan import Plan, TensorSharding
from autopar.report.svg import TABLEAU10, esc, fit_label, ink_on, rect, svg, text, tint
from autopar.report.topology import mesh_coords
from autopar.report.words import device_ranges, entry_axes, layout_words, param_bytes, spec_text


@dataclass(frozen=True)
class BlockGrid:
    """The blocks of one leaf along the two dimensions drawn.

    Attributes:
        dims: the dimensions drawn (rows, columns); one dimension: ``(None, d)``.
        rows / cols: blocks along each.
        holders: ``(row, col)`` -> the devices holding that block.
        hidden: split dimensions not drawn (their blocks fold into the drawn ones).
    """

    dims: tuple[int | None, int]
    rows: int
    cols: int
    holders: Mapping[tuple[int, int], tuple[int, ...]]
    hidden: tuple[int, ...] = ()


def _block_index(entry: object, mesh: Mapping[str, int], coord: Mapping[str, int]) -> int:
    idx = 0
    for a in entry_axes(entry):
        idx = idx * mesh[a] + coord[a]
    return idx


def _blocks(entry: object, mesh: Mapping[str, int]) -> int:
    return math.prod(mesh[a] for a in entry_axes(entry))


def _dims_to_draw(record: TensorSharding) -> tuple[tuple[int | None, int], tuple[int, ...]]:
    nd = len(record.shape)
    split = [d for d in range(nd) if entry_axes(record.spec[d])]
    if nd == 1:
        return (None, 0), ()
    if len(split) >= 2:
        return (split[0], split[1]), tuple(split[2:])
    if len(split) == 1:
        s = split[0]
        others = [d for d in range(nd) if d != s]
        other = max(others, key=lambda d: (record.shape[d], d))
        return (min(s, other), max(s, other)), ()
    return (nd - 2, nd - 1), ()


def block_grid(record: TensorSharding, mesh: Mapping[str, int]) -> BlockGrid:
    """The block grid of a leaf of rank >= 1 on ``mesh`` (see the module docstring)."""
    (rd, cd), hidden = _dims_to_draw(record)
    rows = 1 if rd is None else _blocks(record.spec[rd], mesh)
    cols = _blocks(record.spec[cd], mesh)
    holders: dict[tuple[int, int], list[int]] = {}
    names = list(mesh)
    for dev, c in enumerate(mesh_coords(mesh)):
        coord = dict(zip(names, c, strict=True))
        r = 0 if rd is None else _block_index(record.spec[rd], mesh, coord)
        k = _block_index(record.spec[cd], mesh, coord)
        holders.setdefault((r, k), []).append(dev)
    return BlockGrid((rd, cd), rows, cols, {k: tuple(v) for k, v in holders.items()}, hidden)


def pick_leaves(plan: Plan, limit: int = 4) -> list[TensorSharding]:
    """Up to ``limit`` parameters to draw (``role == "param"``; with the split inputs when
    no parameter is split; every input when there is no parameter): split ones before
    replicated ones, the largest of each distinct layout first."""
    leaves = [r for r in plan.inputs if r.role == "param" and r.shape]
    if not any(entry_axes(e) for r in leaves for e in r.spec):
        # No parameter is split (data parallel): the split inputs (the batch) show the plan.
        leaves += [r for r in plan.inputs if r.role != "param" and r.shape and any(r.spec)]
    if not leaves:
        leaves = [r for r in plan.inputs if r.shape]
    leaves.sort(key=lambda r: (not any(entry_axes(e) for e in r.spec), -param_bytes(r), r.path))
    # One leaf per distinct layout first (the largest of each), then the next largest.
    picked: list[TensorSharding] = []
    layouts: set[tuple] = set()
    for r in leaves:
        key = (len(r.shape), r.spec)
        if key not in layouts and len(picked) < limit:
            layouts.add(key)
            picked.append(r)
    rest = [r for r in leaves if r not in picked]
    return (picked + rest)[:limit]


def sharding_figure(record: TensorSharding, mesh: Mapping[str, int], width: float = 500) -> str:
    """One leaf as a grid of blocks, each labelled with the devices holding it (class
    ``block``, ``data-row``, ``data-col`` and ``data-devices``)."""
    g = block_grid(record, mesh)
    rd, cd = g.dims
    n_rows = 1 if rd is None else record.shape[rd]
    n_cols = record.shape[cd]
    # Aspect from the shape, kept readable: between 1:4 and 4:1.
    aspect = min(max(n_rows / max(n_cols, 1), 0.25), 1.0 if rd is None else 4.0)
    w = width
    h = max(min(w * aspect, 360.0), 44.0 * g.rows, 60.0)
    if rd is None or g.rows * g.cols == 1:
        h = 60.0  # one row, or one block: its shape says nothing more
    bw, bh = w / g.cols, h / g.rows
    body: list[str] = []
    ordered = sorted(g.holders)
    for i, key in enumerate(ordered):
        r, k = key
        devs = g.holders[key]
        color = tint(TABLEAU10[i % len(TABLEAU10)], 0.25 if (i // len(TABLEAU10)) % 2 else 0.0)
        title = (
            f"block ({r}, {k}) held by device{'s' if len(devs) > 1 else ''} {device_ranges(devs)}"
        )
        body.append(
            rect(k * bw + 1, r * bh + 1, bw - 2, bh - 2, color, rx=2, cls="block", title=title,
                 row=r, col=k, devices=" ".join(map(str, devs)))
        )  # fmt: skip
        label = (
            fit_label(device_ranges(devs), bw - 6, 11)
            or fit_label(f"{len(devs)} devices", bw - 6, 11)
            or fit_label(f"{len(devs)}", bw - 4, 11)
        )
        if label and bh >= 16:
            body.append(text(k * bw + bw / 2, r * bh + bh / 2, label, size=11, anchor="middle",
                             fill=ink_on(color)))  # fmt: skip
    fig = svg(w + 2, h + 2, body, label=f"sharding of {record.path}", cls="fig blocks")
    shape = " x ".join(map(str, record.shape))
    per_dev = []
    for d, n in enumerate(record.shape):
        per_dev.append(str(n // max(_blocks(record.spec[d], mesh), 1)))
    drawn = "dims " + (f"{rd} (rows) x {cd} (columns)" if rd is not None else f"{cd}")
    note = ""
    if g.hidden:
        note = f"; dims {', '.join(map(str, g.hidden))} are also split (not drawn)"
    stacked = bool(record.spec) and "pipe" in entry_axes(record.spec[0])
    return (
        f'<figure class="leaf" data-path="{esc(record.path)}">'
        f'<figcaption><code>{esc(record.path)}</code> <span class="muted">{esc(shape)} '
        f"{esc(record.dtype)} · {esc(spec_text(record.spec))}</span><br>"
        f'<span class="small">{esc(layout_words(record, stacked))}; each device holds '
        f"{esc(' x '.join(per_dev))} ({g.rows * g.cols} distinct block"
        f"{'s' if g.rows * g.cols != 1 else ''}); drawn: {esc(drawn)}{esc(note)}</span>"
        f"</figcaption>{fig}</figure>"
    )


def sharding_section_body(plan: Plan, limit: int = 4) -> str:
    """Grids for the plan's largest parameters, or a sentence when it has none."""
    leaves = pick_leaves(plan, limit)
    if not leaves:
        return '<p class="muted">The plan lists no parameter with a shape.</p>'
    figs = "".join(sharding_figure(r, plan.mesh) for r in leaves)
    return (
        f'<p class="small muted">Devices numbered row-major over the mesh '
        f"({esc(' x '.join(f'{a}={n}' for a, n in plan.mesh.items()))}); a block's label lists "
        "the devices holding it (replicas hold the same block).</p>"
        f'<div class="leaves">{figs}</div>'
    )


__all__: Sequence[str] = ("BlockGrid", "block_grid", "pick_leaves", "sharding_figure")
