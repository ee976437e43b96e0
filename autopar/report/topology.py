"""The device mesh drawn over the cluster: nodes, the devices in each, and where each
mesh axis runs (inside a node over NVLink / ICI, across nodes over the network).

Devices are numbered as the cost model places them (:mod:`cost_models.cluster`): row-major
over the mesh axes, outer first, so inner axes are packed into a node first.

Example:
    >>> mesh_coords({"data": 2, "tensor": 2})
    [(0, 0), (0, 1), (1, 0), (1, 1)]
    >>> p = axis_placement({"data": 4, "tensor": 2}, devices_per_node=4)
    >>> p["tensor"].nodes, p["data"].nodes, p["data"].per_node
    (1, 2, 2)
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from autopar.report.svg import (
    GRID,
    INK,
    MUTED,
    axis_color,
    esc,
    ink_on,
    rect,
    svg,
    text,
    tint,
)
from autopar.report.words import LINK_WORDS, axis_words
from cost_models.cluster import group_members

MAX_NODES_DRAWN = 16
"""Nodes drawn in full; a bigger cluster shows its first ones and says how many more."""


def mesh_coords(mesh: Mapping[str, int]) -> list[tuple[int, ...]]:
    """Each device's coordinates on the mesh, device ``i`` at position ``i`` (row-major)."""
    return list(itertools.product(*(range(n) for n in mesh.values())))


@dataclass(frozen=True)
class AxisPlacement:
    """Where the collective groups of one mesh axis sit.

    Attributes:
        axis: the axis.
        size: devices per group (the axis's size).
        nodes: nodes one group touches.
        per_node: most members of one group on one node.
        links: the link levels its collectives cross (``intra``, ``inter`` or both).
    """

    axis: str
    size: int
    nodes: int
    per_node: int
    links: tuple[str, ...]


def axis_placement(
    mesh: Mapping[str, int],
    devices_per_node: int,
    intra: str = "nvlink",
    inter: str = "infiniband",
) -> dict[str, AxisPlacement]:
    """For each axis, how the group holding device 0 sits on nodes of
    ``devices_per_node`` (every group alike when the sizes are powers of two)."""
    out = {}
    for a in mesh:
        counts: dict[int, int] = {}
        for i in group_members(mesh, (a,)):
            counts[i // devices_per_node] = counts.get(i // devices_per_node, 0) + 1
        nodes, per = len(counts), max(counts.values())
        if nodes == 1:
            links: tuple[str, ...] = (intra,)
        elif per == 1:
            links = (inter,)
        else:
            links = (intra, inter)
        out[a] = AxisPlacement(a, mesh[a], nodes, per, links)
    return out


@dataclass(frozen=True)
class _Topo:
    nodes: int
    per_node: int
    intra: str
    inter: str
    device: str
    memory: float


def _topology(plan_mesh: Mapping[str, int], cluster: Mapping[str, Any]) -> _Topo:
    n = math.prod(plan_mesh.values()) if plan_mesh else 1
    per = int(cluster.get("devices_per_node") or n)
    nodes = int(cluster.get("num_nodes") or max(1, math.ceil(n / per)))
    nodes = max(nodes, math.ceil(n / per))
    device = cluster.get("device") or {}
    return _Topo(
        nodes=nodes,
        per_node=per,
        intra=str((cluster.get("intra") or {}).get("name", "nvlink")),
        inter=str((cluster.get("inter") or {}).get("name", "infiniband")),
        device=str(device.get("name", "device")),
        memory=float(device.get("hbm_bytes", 0.0)),
    )


def link_text(links: Sequence[str]) -> str:
    return " + ".join(LINK_WORDS.get(x, x) for x in links)


def mesh_figure(mesh: Mapping[str, int], cluster: Mapping[str, Any]) -> str:
    """The cluster's nodes with their devices; each device of the mesh shows its
    coordinate on every axis in the axis's colour (class ``device``; devices of the
    cluster outside the mesh: class ``spare``). Past 4 nodes the cells shrink to coloured
    stripes (hover for the coordinates); past :data:`MAX_NODES_DRAWN` nodes the first
    ones are drawn."""
    axes = list(mesh)
    topo = _topology(mesh, cluster)
    n = math.prod(mesh.values()) if mesh else 1
    coords = mesh_coords(mesh)
    compact = topo.nodes > 4 or topo.per_node > 12
    if compact:
        cell_w, band_h, head, gap, pad = 26.0, 6.0, 15.0, 3.0, 8.0
    else:
        cell_w, band_h, head, gap, pad = 84.0, 17.0, 24.0, 8.0, 12.0
    cell_h = head + 2 + band_h * max(len(axes), 1)
    node_w = pad * 2 + topo.per_node * cell_w + (topo.per_node - 1) * gap
    node_h = 28 + cell_h + pad
    width_budget = 1080
    per_row = max(1, min(topo.nodes, int((width_budget + 16) // (node_w + 16))))
    drawn = min(topo.nodes, MAX_NODES_DRAWN)
    rows = math.ceil(drawn / per_row)
    width = max(per_row * node_w + (per_row - 1) * 16, 360)
    height = rows * (node_h + 16) + (22 if drawn < topo.nodes else 0)
    intra = LINK_WORDS.get(topo.intra, topo.intra)
    body: list[str] = []
    for k in range(drawn):
        nx = (k % per_row) * (node_w + 16)
        ny = (k // per_row) * (node_h + 16)
        body.append(rect(nx, ny, node_w, node_h, "#f4f6f8", rx=10, stroke=GRID, cls="node", node=k))
        label = (
            f"node {k}"
            if compact
            else f"node {k}  ·  {topo.per_node} x {topo.device}  ·  {intra} inside"
        )
        body.append(text(nx + pad, ny + 14, label, size=11.5, weight="600", fill=INK))
        for j in range(topo.per_node):
            dev = k * topo.per_node + j
            x = nx + pad + j * (cell_w + gap)
            y = ny + 26
            if dev >= n:
                body.append(
                    rect(x, y, cell_w, cell_h, "#eceff2", rx=4, stroke=GRID, cls="spare",
                         title=f"device {dev}: in the cluster, not in the mesh (idle)", device=dev)
                )  # fmt: skip
                body.append(text(x + cell_w / 2, y + head / 2 + 1, f"#{dev}", size=9 if compact else 11,
                                 anchor="middle", fill=MUTED))  # fmt: skip
                continue
            c = coords[dev]
            where = ", ".join(f"{a}={v}" for a, v in zip(axes, c, strict=True))
            body.append(
                rect(x, y, cell_w, cell_h, "#ffffff", rx=4 if compact else 6, stroke="#9aa5b1",
                     cls="device", title=f"device {dev} (node {k}): {where}", device=dev,
                     coords=where)
            )  # fmt: skip
            body.append(text(x + cell_w / 2, y + head / 2 + 1, f"#{dev}" if not compact else dev,
                             size=9 if compact else 11.5, anchor="middle", weight="600"))  # fmt: skip
            for b, (a, v) in enumerate(zip(axes, c, strict=True)):
                col = axis_color(a, axes)
                shade = tint(col, 0.72 - 0.72 * (v / max(mesh[a] - 1, 1)))
                by = y + head + b * band_h
                inset = 3 if compact else 5
                body.append(rect(x + inset, by, cell_w - 2 * inset, band_h - (1 if compact else 3),
                                 shade, rx=1 if compact else 3))  # fmt: skip
                if not compact:
                    body.append(text(x + cell_w / 2, by + (band_h - 3) / 2 + 0.5, f"{a} {v}", size=10,
                                     anchor="middle", fill=ink_on(shade)))  # fmt: skip
    if drawn < topo.nodes:
        body.append(
            text(0, height - 8, f"... and {topo.nodes - drawn} more nodes like these", size=12,
                 fill=MUTED)
        )  # fmt: skip
    return svg(width, height, body, label=f"mesh of {n} devices over {topo.nodes} nodes",
               cls="fig mesh-fig")  # fmt: skip


def axis_maps(mesh: Mapping[str, int], cluster: Mapping[str, Any], idle: Sequence[str] = ()) -> str:
    """One small map per axis: every device shaded by its coordinate on that axis (the
    devices of one shade row make a collective group together), with the links its
    collectives cross. Axes in ``idle`` split nothing (:func:`autopar.plan.idle_axes`)."""
    axes = list(mesh)
    topo = _topology(mesh, cluster)
    coords = mesh_coords(mesh)
    n = len(coords)
    places = axis_placement(mesh, topo.per_node, topo.intra, topo.inter)
    drawn_nodes = min(topo.nodes, MAX_NODES_DRAWN)
    cell, gap, node_gap = 15, 2, 8
    out = []
    for i, a in enumerate(axes):
        col = axis_color(a, axes)
        pl = places[a]
        body = []
        x = 0.0
        for k in range(drawn_nodes):
            for j in range(topo.per_node):
                dev = k * topo.per_node + j
                if dev >= n:
                    body.append(rect(x, 0, cell, cell, "#eceff2", rx=2))
                else:
                    v = coords[dev][i]
                    shade = tint(col, 0.8 - 0.8 * (v / max(mesh[a] - 1, 1)))
                    body.append(rect(x, 0, cell, cell, shade, rx=2, title=f"device {dev}: {a}={v}",
                                     cls="mini"))  # fmt: skip
                x += cell + gap
            x += node_gap
        fig = svg(x, cell, body, label=f"devices by {a} coordinate", cls="axis-map")
        if mesh[a] == 1:
            where = "size 1: no collectives"
        elif pl.nodes == 1:
            where = f"groups of {pl.size} inside one node over {link_text(pl.links)}"
        elif pl.per_node == 1:
            where = f"groups of {pl.size}, one device per node, across {pl.nodes} nodes over {link_text(pl.links)}"
        else:
            where = (
                f"groups of {pl.size}: {pl.per_node} per node over {pl.nodes} nodes "
                f"({link_text(pl.links)})"
            )
        if a in idle:
            where += "; splits nothing: its devices repeat the same work"
        out.append(
            f'<div class="axis-row" data-axis="{esc(a)}" data-links="{esc(" ".join(pl.links))}">'
            f'<span class="swatch" style="background:{col}"></span>'
            f'<span class="axis-name">{esc(a)} = {mesh[a]}</span>'
            f'<span class="axis-what">{esc(axis_words(a))}; {esc(where)}</span>{fig}</div>'
        )
    return "".join(out)


def topology_summary(mesh: Mapping[str, int], cluster: Mapping[str, Any]) -> str:
    """A sentence: the cluster, and how much of it the mesh uses."""
    topo = _topology(mesh, cluster)
    n = math.prod(mesh.values()) if mesh else 1
    total = topo.nodes * topo.per_node
    name = cluster.get("name", "cluster")
    text_ = (
        f"{name}: {topo.nodes} node{'s' if topo.nodes != 1 else ''} x {topo.per_node} "
        f"{topo.device}, {LINK_WORDS.get(topo.intra, topo.intra)} inside a node, "
        f"{LINK_WORDS.get(topo.inter, topo.inter)} between nodes. The mesh "
        + " x ".join(f"{a}={s}" for a, s in mesh.items())
        + f" uses {n} of its {total} devices."
    )
    return text_
