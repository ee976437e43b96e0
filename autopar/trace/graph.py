"""The traced computation graph: nodes are jaxpr equations, edges are tensors.

A :class:`Graph` is what :func:`autopar.trace` returns and what the search consumes. It is a
small typed wrapper over a ``networkx.DiGraph`` whose node keys are :attr:`Node.id`. Tensors
("values") have integer ids; ``graph.values[vid]`` gives their shape and dtype, and
``graph.producer[vid]`` the node that makes them (absent for graph inputs and literals).

Node ids equal the index of the equation in ``graph.jaxpr.eqns``: ``graph.jaxpr`` is the
*inlined* closed jaxpr (``pjit``/``closed_call``/custom-derivative/remat calls flattened),
so the lowering stage can re-interpret exactly the equations the search saw.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import networkx as nx
import numpy as np

Phase = Literal["forward", "backward", "optimizer", "other"]
InputRole = Literal["param", "opt_state", "model_state", "batch", "other"]


@dataclass(frozen=True)
class TensorInfo:
    """Shape and dtype of one tensor (an abstract value).

    Example:
        >>> TensorInfo((8, 1024), "bfloat16").nbytes
        16384
    """

    shape: tuple[int, ...]
    dtype: str

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def itemsize(self) -> int:
        if self.dtype in ("bool", "float0"):
            return 1
        return np.dtype(self.dtype).itemsize

    @property
    def nbytes(self) -> int:
        return self.size * self.itemsize

    @property
    def ndim(self) -> int:
        return len(self.shape)


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
    """

    index: int
    name: str
    kind: Literal["named", "scan", "repeat"]
    nodes: tuple[int, ...]
    flops: float
    forward_flops: float
    backward_flops: float
    signature: str = ""


class Graph:
    """A traced computation graph. Build it with :func:`autopar.trace`.

    Example:
        >>> g = autopar.trace(step_fn, *args)            # doctest: +SKIP
        >>> g.total_flops, len(g.layers)                 # doctest: +SKIP
        (7.0e12, 12)
        >>> print(g.summary())                           # doctest: +SKIP
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
    ) -> None:
        self.nodes: tuple[Node, ...] = tuple(nodes)
        self.values: dict[int, TensorInfo] = dict(values)
        self.inputs: tuple[GraphInput, ...] = tuple(inputs)
        self.outputs: tuple[GraphOutput, ...] = tuple(outputs)
        self.layers: tuple[Layer, ...] = tuple(layers)
        self.jaxpr = jaxpr  # the inlined ClosedJaxpr; node.id indexes jaxpr.jaxpr.eqns
        self.in_tree = in_tree  # PyTreeDef of the (args, kwargs) the function was traced with
        self.out_tree = out_tree
        self.producer: dict[int, int] = {}
        self.consumers: dict[int, list[int]] = {}
        self.dag = nx.DiGraph()
        for node in self.nodes:
            self.dag.add_node(node.id)
            for v in node.outputs:
                self.producer[v] = node.id
        for node in self.nodes:
            for v in node.inputs:
                if v < 0:
                    continue
                self.consumers.setdefault(v, []).append(node.id)
                src = self.producer.get(v)
                if src is not None:
                    self.dag.add_edge(src, node.id, value=v)

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
        out: dict[str, float] = {"forward": 0.0, "backward": 0.0, "optimizer": 0.0, "other": 0.0}
        for n in self.nodes:
            out[n.phase] += n.flops
        return out

    def inputs_by_role(self, role: InputRole) -> tuple[GraphInput, ...]:
        return tuple(i for i in self.inputs if i.role == role)

    @property
    def parameter_bytes(self) -> int:
        return sum(i.tensor.nbytes for i in self.inputs if i.role == "param")

    @property
    def parameter_count(self) -> int:
        return sum(i.tensor.size for i in self.inputs if i.role == "param")
