"""The traced computation graph: nodes are jaxpr equations, edges are tensors.

A :class:`Graph` is what :func:`autopar.trace` returns and what the search consumes. It is a
small typed wrapper over a ``networkx.DiGraph`` whose node keys are :attr:`Node.id`. Tensors
("values") have integer ids; ``graph.values[vid]`` gives their shape and dtype, and
``graph.producer[vid]`` the node that makes them (absent for graph inputs and literals).

Node ids equal the index of the equation in ``graph.jaxpr.eqns``: ``graph.jaxpr`` is the
*inlined* closed jaxpr (``pjit``/``closed_call``/custom-derivative/remat calls flattened),
so the lowering stage can re-interpret exactly the equations the search saw.

Imports run one way: :mod:`autopar.trace.tensor` (``TensorInfo``, re-exported here) <-
:mod:`autopar.trace.flops` (per-equation costs) <- this module, which also renders
:meth:`Graph.summary`.
"""

from __future__ import annotations

import io
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import networkx as nx
from rich.console import Console
from rich.table import Table

from autopar.trace.flops import is_counted
from autopar.trace.tensor import TensorInfo

Phase = Literal["forward", "backward", "optimizer", "other"]
InputRole = Literal["param", "opt_state", "model_state", "batch", "other"]


@dataclass(frozen=True)
class GraphInput:
    """One flat input leaf of the traced function, tied back to the user's pytree.

    Attributes:
        index: position among the flattened arguments (``jax.tree.leaves(args)`` order).
        value: the value id of this input inside the graph.
        path: ``/``-joined keys, e.g. ``"state/params/h_3/attn/q/kernel"``.
        tensor: shape and dtype.
        role: parameter, optimizer state, other model state (e.g. batch norm statistics),
            batch data, or other.
        output_index: index of the flat output that is this input's updated value (a
            parameter's new value after the optimizer step), or ``None``.
    """

    index: int
    value: int
    path: str
    tensor: TensorInfo
    role: InputRole
    output_index: int | None = None


@dataclass(frozen=True)
class GraphOutput:
    """One flat output leaf of the traced function."""

    index: int
    value: int
    path: str
    tensor: TensorInfo


@dataclass(frozen=True)
class Node:
    """One equation of the (inlined) jaxpr.

    Attributes:
        id: index of the equation in ``Graph.jaxpr.eqns``.
        primitive: primitive name, e.g. ``"dot_general"``, ``"add"``, ``"scan"``.
        inputs: value ids of the operands (``-1`` for literals).
        outputs: value ids of the results.
        in_tensors / out_tensors: their shapes and dtypes.
        params: the primitive's parameters that matter for cost and sharding
            (``dimension_numbers``, ``axes``, ``permutation``, ...), JSON-friendly values.
        flops: floating point operations of one execution (scan: the whole loop).
        bytes_in / bytes_out: bytes read and written (scan: the whole loop).
        name_stack: the Flax/JAX name stack, e.g. ``"transpose(jvp(GPT))/h_3/attn/q"``.
        phase: forward, backward, optimizer, or other.
        layer: index of the layer this node belongs to (``Graph.layers``), or ``None``.
        body: for ``scan``/``while``/``cond`` the traced body graph(s), else empty.
        length: trip count for ``scan`` (1 for everything else).
        scope: where the node sits: ``()`` at top level, else the ``(node_id, body_index)``
            pairs of the enclosing composite nodes, outermost first (body ``b`` of a node is
            ``node.body[b]``, the ``b``-th jaxpr of ``jaxprs_in_params(eqn.params)``).
    """

    id: int
    primitive: str
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    in_tensors: tuple[TensorInfo, ...]
    out_tensors: tuple[TensorInfo, ...]
    params: Mapping[str, Any] = field(default_factory=dict)
    flops: float = 0.0
    bytes_in: int = 0
    bytes_out: int = 0
    name_stack: str = ""
    phase: Phase = "other"
    layer: int | None = None
    body: tuple[Graph, ...] = ()
    length: int = 1
    scope: tuple[tuple[int, int], ...] = ()


@dataclass(frozen=True)
class Layer:
    """One layer instance, in program order.

    Attributes:
        index: position in ``Graph.layers``.
        name: e.g. ``"h_3"`` (Flax name), ``"h[3]"`` (scan iteration) or ``"block_3"``
            (found by structural repetition).
        kind: ``"named"``, ``"scan"`` or ``"repeat"`` (how it was found).
        nodes: ids of the nodes that belong to it (all phases).
        flops: FLOPs of the layer (forward + backward + its share of the optimizer).
        forward_flops / backward_flops: the same split by phase.
        signature: nodes with equal signatures are structurally identical layers (the
            search solves one and tiles the rest).
        iteration: for ``kind == "scan"``, which iteration of the loop this layer is (its
            ``nodes`` are the loop nodes, shared by all ``length`` iterations); else ``None``.
        optimizer_flops: the optimizer's share (included in ``flops``).
    """

    index: int
    name: str
    kind: Literal["named", "scan", "repeat"]
    nodes: tuple[int, ...]
    flops: float
    forward_flops: float
    backward_flops: float
    signature: str = ""
    iteration: int | None = None
    optimizer_flops: float = 0.0


class Graph:
    """A traced computation graph. Build it with :func:`autopar.trace`.

    Example:
        >>> g = autopar.trace(step, state, batch)
        >>> len(g.nodes), len(g.layers), f"{g.total_flops:.3g}"
        (111, 2, '1.78e+08')
        >>> print(g.summary())
        Graph: 111 nodes (0 loops/conditionals), 126 values, 15 inputs, 14 outputs; ...
    """

    def __init__(
        self,
        nodes: Sequence[Node],
        values: Mapping[int, TensorInfo],
        inputs: Sequence[GraphInput],
        outputs: Sequence[GraphOutput],
        layers: Sequence[Layer] = (),
        jaxpr: Any = None,
        in_tree: Any = None,
        out_tree: Any = None,
        consts: Sequence[int] = (),
        scope: tuple[tuple[int, int], ...] = (),
        accumulations: Sequence[Any] = (),
    ) -> None:
        self.nodes: tuple[Node, ...] = tuple(nodes)
        self.values: dict[int, TensorInfo] = dict(values)
        self.inputs: tuple[GraphInput, ...] = tuple(inputs)
        self.outputs: tuple[GraphOutput, ...] = tuple(outputs)
        self.layers: tuple[Layer, ...] = tuple(layers)
        self.jaxpr = jaxpr  # the inlined ClosedJaxpr; node.id indexes jaxpr.jaxpr.eqns
        self.in_tree = in_tree  # PyTreeDef of the (args, kwargs) the function was traced with
        self.out_tree = out_tree
        # value ids of the closed-over constants (``jaxpr.jaxpr.constvars`` order)
        self.consts: tuple[int, ...] = tuple(consts)
        # ``()`` for the traced function; for a loop body, the ``(node_id, body_index)``
        # path from the top-level graph (same convention as ``Node.scope``)
        self.scope: tuple[tuple[int, int], ...] = tuple(scope)
        # gradient-accumulation loops the user wrote (``lax.scan`` over microbatches), as
        # :class:`autopar.trace.accumulate.AccumulationScan` records; their bodies hold
        # the layers (``self.nodes[a.node].body[0].layers``)
        self.accumulations: tuple[Any, ...] = tuple(accumulations)
        self.producer: dict[int, int] = {}
        self.consumers: dict[int, list[int]] = {}
        edges: list[tuple[int, int, dict[str, int]]] = []
        for node in self.nodes:
            for v in node.outputs:
                self.producer[v] = node.id
        for node in self.nodes:
            for v in node.inputs:
                if v < 0:
                    continue
                self.consumers.setdefault(v, []).append(node.id)
                src = self.producer.get(v)
                if src is not None:
                    edges.append((src, node.id, {"value": v}))
        self.dag = nx.DiGraph()
        self.dag.add_nodes_from(node.id for node in self.nodes)
        self.dag.add_edges_from(edges)

    # -- access -----------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.nodes)

    def __iter__(self) -> Iterator[Node]:
        return iter(self.nodes)

    def node(self, node_id: int) -> Node:
        return self.nodes[node_id]

    @property
    def total_flops(self) -> float:
        """FLOPs of one call of the function (scan bodies counted ``length`` times)."""
        return float(sum(n.flops for n in self.nodes))

    def flops_by_phase(self) -> dict[str, float]:
        """FLOPs per phase. A loop whose body mixes phases (a gradient-accumulation scan)
        is split by its body nodes' phases, scaled like the loop."""
        out: dict[str, float] = {"forward": 0.0, "backward": 0.0, "optimizer": 0.0, "other": 0.0}
        for n in self.nodes:
            if n.body and n.primitive == "scan":
                for phase, f in n.body[0].flops_by_phase().items():
                    out[phase] += n.length * f
            else:
                out[n.phase] += n.flops
        return out

    def bytes_by_phase(self) -> dict[str, int]:
        """Bytes read plus written per phase (loops scaled like their FLOPs)."""
        out: dict[str, int] = {"forward": 0, "backward": 0, "optimizer": 0, "other": 0}
        for n in self.nodes:
            out[n.phase] += n.bytes_in + n.bytes_out
        return out

    def input(self, path: str) -> GraphInput:
        """The input whose ``path`` is ``path``.

        Raises:
            KeyError: no such input (the message lists a few similar paths).
        """
        for i in self.inputs:
            if i.path == path:
                return i
        close = [i.path for i in self.inputs if path.split("/")[-1] in i.path][:5]
        raise KeyError(f"no input with path {path!r}; similar: {close}")

    def layer_of(self, node_id: int) -> Layer | None:
        """The layer node ``node_id`` belongs to, or ``None``."""
        idx = self.nodes[node_id].layer
        return None if idx is None else self.layers[idx]

    def summary(self, width: int = 110, max_layers: int = 40) -> str:
        """A text report: node counts, FLOPs and bytes per phase, parameters, layers.

        Example:
            >>> print(autopar.trace(step, state, batch).summary())
            Graph: 111 nodes ...
            parameters: 525,568 (2.10 MB)
            ...
        """
        return _render_summary(self, width=width, max_layers=max_layers)

    def __repr__(self) -> str:
        return (
            f"Graph(nodes={len(self.nodes)}, inputs={len(self.inputs)}, "
            f"layers={len(self.layers)}, flops={self.total_flops:.4g})"
        )

    def inputs_by_role(self, role: InputRole) -> tuple[GraphInput, ...]:
        return tuple(i for i in self.inputs if i.role == role)

    @property
    def parameter_bytes(self) -> int:
        return sum(i.tensor.nbytes for i in self.inputs if i.role == "param")

    @property
    def parameter_count(self) -> int:
        return sum(i.tensor.size for i in self.inputs if i.role == "param")


# -- Graph.summary() -------------------------------------------------------------------


def _human(x: float, unit: str = "") -> str:
    """``1.23 T``-style number.

    Example:
        >>> _human(7.0e12, "FLOP"), _human(512, "B")
        ('7.00 TFLOP', '512 B')
    """
    for factor, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= factor:
            return f"{x / factor:.2f} {prefix}{unit}"
    return f"{x:.0f} {unit}" if unit else f"{x:.0f}"


def _render_summary(graph: Graph, width: int = 110, max_layers: int = 40) -> str:
    """The text of :meth:`Graph.summary`: totals, phases, inputs by role, layers."""
    console = Console(
        record=True, width=width, file=io.StringIO(), force_terminal=False, color_system=None
    )
    prims = Counter(n.primitive for n in graph.nodes)
    loops = sum(1 for n in graph.nodes if n.body)
    console.print(
        f"Graph: {len(graph.nodes)} nodes ({loops} loops/conditionals), "
        f"{len(graph.values)} values, {len(graph.inputs)} inputs, {len(graph.outputs)} outputs; "
        f"total {_human(graph.total_flops, 'FLOP')}"
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
            ph, str(count[ph]), _human(flops[ph], "FLOP"), f"{100 * flops[ph] / total:.1f}%",
            _human(bytes_[ph], "B"),
        )  # fmt: skip
    console.print(phases)

    roles = Table(title="Inputs by role", title_justify="left")
    for col in ("role", "leaves", "elements", "bytes"):
        roles.add_column(col, justify="right" if col != "role" else "left")
    for role in ("param", "opt_state", "model_state", "batch", "other"):
        ins = graph.inputs_by_role(role)  # type: ignore[arg-type]
        if ins:
            roles.add_row(
                role, str(len(ins)), _human(sum(i.tensor.size for i in ins)),
                _human(sum(i.tensor.nbytes for i in ins), "B"),
            )  # fmt: skip
    console.print(roles)
    console.print(f"parameters: {graph.parameter_count:,} ({_human(graph.parameter_bytes, 'B')})")

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
                _human(layer.forward_flops, "FLOP"), _human(layer.backward_flops, "FLOP"),
                _human(layer.optimizer_flops, "FLOP"), _human(layer.flops, "FLOP"),
                layer.signature[:8],
            )  # fmt: skip
        console.print(layers)
        if len(graph.layers) > len(shown):
            console.print(f"... {len(graph.layers) - len(shown)} more layers")
        in_layers = sum(layer.flops for layer in graph.layers)
        console.print(f"FLOPs in layers: {100 * in_layers / total:.1f}% of the total")
    elif not graph.accumulations:
        console.print("Layers: none found")
    for acc in graph.accumulations:
        body = graph.nodes[acc.node].body[0]
        names = ", ".join(layer.name for layer in body.layers) or "none"
        console.print(
            f"Gradient accumulation: scan node {acc.node} over {acc.microbatches} microbatches, "
            f"{len(acc.params)} parameters, {len(acc.accumulators)} accumulators; layers in "
            f"its body: {names}"
        )
    return console.export_text()
