"""``Graph.summary()``: a plain-text report rendered with ``rich`` (no terminal needed)."""

from __future__ import annotations

import io
from collections import Counter

from rich.console import Console
from rich.table import Table

from autopar.trace.flops import is_counted
from autopar.trace.graph import Graph


def human(x: float, unit: str = "") -> str:
    """``1.23 T``-style number.

    Example:
        >>> human(7.0e12, "FLOP"), human(512, "B")
        ('7.00 TFLOP', '512 B')
    """
    for factor, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= factor:
            return f"{x / factor:.2f} {prefix}{unit}"
    return f"{x:.0f} {unit}" if unit else f"{x:.0f}"


def render_summary(graph: Graph, width: int = 110, max_layers: int = 40) -> str:
    """The text of :meth:`Graph.summary`: totals, phases, inputs by role, layers."""
    console = Console(
        record=True, width=width, file=io.StringIO(), force_terminal=False, color_system=None
    )
    prims = Counter(n.primitive for n in graph.nodes)
    loops = sum(1 for n in graph.nodes if n.body)
    console.print(
        f"Graph: {len(graph.nodes)} nodes ({loops} loops/conditionals), "
        f"{len(graph.values)} values, {len(graph.inputs)} inputs, {len(graph.outputs)} outputs; "
        f"total {human(graph.total_flops, 'FLOP')}"
    )
    console.print("top primitives: " + ", ".join(f"{p} x{c}" for p, c in prims.most_common(8)))
    unknown = sorted(p for p in prims if not is_counted(p))
    if unknown:
        console.print("counted as 0 FLOPs (unknown to the tracer): " + ", ".join(unknown))

    phases = Table(title="Phases", title_justify="left")
    for col in ("phase", "nodes", "FLOPs", "share", "bytes (r+w)"):
        phases.add_column(col, justify="right" if col != "phase" else "left")
    flops = graph.flops_by_phase()
    bytes_ = graph.bytes_by_phase()
    count = Counter(n.phase for n in graph.nodes)
    total = graph.total_flops or 1.0
    for ph in ("forward", "backward", "optimizer", "other"):
        if count[ph] == 0 and flops[ph] == 0:
            continue
        phases.add_row(
            ph, str(count[ph]), human(flops[ph], "FLOP"), f"{100 * flops[ph] / total:.1f}%",
            human(bytes_[ph], "B"),
        )  # fmt: skip
    console.print(phases)

    roles = Table(title="Inputs by role", title_justify="left")
    for col in ("role", "leaves", "elements", "bytes"):
        roles.add_column(col, justify="right" if col != "role" else "left")
    for role in ("param", "opt_state", "model_state", "batch", "other"):
        ins = graph.inputs_by_role(role)  # type: ignore[arg-type]
        if ins:
            roles.add_row(
                role, str(len(ins)), human(sum(i.tensor.size for i in ins)),
                human(sum(i.tensor.nbytes for i in ins), "B"),
            )  # fmt: skip
    console.print(roles)
    console.print(f"parameters: {graph.parameter_count:,} ({human(graph.parameter_bytes, 'B')})")

    if graph.layers:
        kinds = Counter(layer.kind for layer in graph.layers)
        sigs = len({layer.signature for layer in graph.layers})
        layers = Table(
            title=f"Layers: {len(graph.layers)} ({', '.join(f'{k} x{c}' for k, c in kinds.items())}; "
            f"{sigs} distinct)",
            title_justify="left",
        )
        for col in (
            "#",
            "name",
            "kind",
            "nodes",
            "forward",
            "backward",
            "optimizer",
            "total",
            "sig",
        ):
            layers.add_column(col, justify="left" if col in ("name", "kind", "sig") else "right")
        shown = graph.layers[:max_layers]
        for layer in shown:
            layers.add_row(
                str(layer.index), layer.name, layer.kind, str(len(layer.nodes)),
                human(layer.forward_flops, "FLOP"), human(layer.backward_flops, "FLOP"),
                human(layer.optimizer_flops, "FLOP"), human(layer.flops, "FLOP"),
                layer.signature[:8],
            )  # fmt: skip
        console.print(layers)
        if len(graph.layers) > len(shown):
            console.print(f"... {len(graph.layers) - len(shown)} more layers")
        in_layers = sum(layer.flops for layer in graph.layers)
        console.print(f"FLOPs in layers: {100 * in_layers / total:.1f}% of the total")
    else:
        console.print("Layers: none found")
    return console.export_text()
