"""From an inlined closed jaxpr to nodes, values and (for loops) body graphs.

Two steps, because phases and layers are decided on the whole top-level graph before
nodes are frozen:

1. :func:`scan_jaxpr` numbers values (``Var`` -> int; literals ``-1``) and records, per
   equation, its operands, results, shapes, name stack, JSON parameters, FLOPs and bytes
   (:class:`RawEqn`). Loop and conditional bodies are not entered yet.
2. :func:`make_node` freezes one :class:`RawEqn` into a :class:`Node`, building the body
   graphs of ``scan``/``while``/``cond`` with :func:`body_graph` (recursively) and scaling
   their cost: ``scan`` = ``length`` x body; ``while`` = one trip of cond + body (the trip
   count is unknown when tracing); ``cond`` = the most expensive branch.

Value ids of one graph: inputs first (``0..n-1`` in ``jaxpr.invars`` order), then
constants, then equation results in program order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import jax.numpy as jnp
from jax.extend.core import ClosedJaxpr, Literal, jaxprs_in_params

from autopar.trace.flops import eqn_bytes, eqn_flops
from autopar.trace.graph import Graph, GraphInput, GraphOutput, Node, Phase, TensorInfo
from autopar.trace.params import json_params

COMPOSITES: frozenset[str] = frozenset({"scan", "while", "cond"})


def is_float_dtype(dtype: str) -> bool:
    """Whether a dtype name is floating point (``bfloat16`` and ``float8_*`` included).

    Example:
        >>> is_float_dtype("bfloat16"), is_float_dtype("int32"), is_float_dtype("key<fry>")
        (True, False, False)
    """
    try:
        return bool(jnp.issubdtype(jnp.dtype(dtype), jnp.inexact))
    except TypeError:
        return False


def tensor_info(aval: Any) -> TensorInfo:
    """The :class:`TensorInfo` of an abstract value (tokens and odd avals get shape ``()``).

    Example:
        >>> import jax.numpy as jnp
        >>> from jax.core import ShapedArray
        >>> tensor_info(ShapedArray((2, 3), jnp.bfloat16))
        TensorInfo(shape=(2, 3), dtype='bfloat16')
    """
    shape = getattr(aval, "shape", None)
    dtype = getattr(aval, "dtype", None)
    if shape is None or dtype is None:
        return TensorInfo((), type(aval).__name__)
    key = (shape, dtype)
    try:
        hit = _INFO_CACHE.get(key)
    except TypeError:  # unhashable (symbolic) shapes
        return TensorInfo(tuple(int(d) for d in shape), str(dtype))
    if hit is None:
        hit = TensorInfo(tuple(int(d) for d in shape), str(dtype))
        if len(_INFO_CACHE) < 100_000:
            _INFO_CACHE[key] = hit
    return hit


# (shape, dtype) -> TensorInfo: str(numpy dtype) is slow and a step has few distinct shapes.
_INFO_CACHE: dict[tuple[Any, Any], TensorInfo] = {}


@dataclass
class RawEqn:
    """One equation before phases and layers are known (internal to the tracer)."""

    index: int
    eqn: Any
    primitive: str
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    in_tensors: tuple[TensorInfo, ...]
    out_tensors: tuple[TensorInfo, ...]
    name_stack: str
    rel_name_stack: str
    flops: float = 0.0
    bytes_in: int = 0
    bytes_out: int = 0


@dataclass
class RawGraph:
    """A numbered jaxpr: values, equations, and which values are inputs/consts/outputs."""

    closed: ClosedJaxpr
    eqns: list[RawEqn]
    values: dict[int, TensorInfo]
    invars: list[int]
    constvars: list[int]
    outvars: list[int]  # -1 for a literal output
    out_tensors: list[TensorInfo] = field(default_factory=list)


def join_stack(prefix: str, rel: str) -> str:
    """``prefix/rel`` without empty parts.

    Example:
        >>> join_stack("jvp(GPT)", "h/attn"), join_stack("", "h"), join_stack("a", "")
        ('jvp(GPT)/h/attn', 'h', 'a')
    """
    if not prefix:
        return rel
    if not rel:
        return prefix
    return f"{prefix}/{rel}"


def scan_jaxpr(closed: ClosedJaxpr, stack_prefix: str = "") -> RawGraph:
    """Number the values of ``closed`` and record every equation (bodies not entered).

    Args:
        closed: an inlined closed jaxpr (:func:`autopar.trace.inline.inline_jaxpr`).
        stack_prefix: name stack of the enclosing loop equation (``""`` at top level).
    """
    jaxpr = closed.jaxpr
    ids: dict[Any, int] = {}
    values: dict[int, TensorInfo] = {}

    def define(v: Any) -> int:
        vid = len(values)
        ids[v] = vid
        values[vid] = tensor_info(v.aval)
        return vid

    invars = [define(v) for v in jaxpr.invars]
    constvars = [define(v) for v in jaxpr.constvars]
    eqns: list[RawEqn] = []
    for k, eqn in enumerate(jaxpr.eqns):
        inputs = []
        in_tensors = []
        literal = []
        for a in eqn.invars:
            if isinstance(a, Literal):
                inputs.append(-1)
                in_tensors.append(tensor_info(a.aval))
                literal.append(True)
            else:
                vid = ids[a]
                inputs.append(vid)
                in_tensors.append(values[vid])
                literal.append(False)
        outputs = tuple(define(v) for v in eqn.outvars)
        out_tensors = tuple(values[v] for v in outputs)
        rel = str(eqn.source_info.name_stack)
        prim = eqn.primitive.name
        raw = RawEqn(
            k, eqn, prim, tuple(inputs), outputs, tuple(in_tensors), out_tensors,
            join_stack(stack_prefix, rel), rel,
        )  # fmt: skip
        if prim not in COMPOSITES:
            if any(True for _ in jaxprs_in_params(eqn.params)) and prim not in _KNOWN_WITH_BODY:
                raw.flops, raw.bytes_in, raw.bytes_out = _opaque_cost(eqn)
            else:
                raw.flops = eqn_flops(prim, eqn.params, in_tensors, out_tensors)
                raw.bytes_in, raw.bytes_out = eqn_bytes(prim, in_tensors, out_tensors, literal)
        eqns.append(raw)
    outvars = [-1 if isinstance(v, Literal) else ids[v] for v in jaxpr.outvars]
    out_tensors = [tensor_info(v.aval) for v in jaxpr.outvars]
    return RawGraph(closed, eqns, values, invars, constvars, outvars, out_tensors)


# Primitives whose jaxpr parameters are scalar combiners, not bodies (cost counted normally).
_KNOWN_WITH_BODY = frozenset(
    {
        "scatter",
        "scatter-add",
        "scatter_add",
        "scatter-mul",
        "scatter_mul",
        "scatter-min",
        "scatter_min",
        "scatter-max",
        "scatter_max",
        "reduce",
        "reduce_window",
        "sort",
        "select_and_scatter",
        "select_and_gather_add",
    }
)


def _opaque_cost(eqn: Any) -> tuple[float, int, int]:
    """Cost of an equation with a body we neither inline nor keep composite (``shard_map``,
    ``custom_transpose``, ...): its body's equations, once each (per-shard shapes for
    ``shard_map``)."""
    flops = 0.0
    b_in = b_out = 0
    for sub in jaxprs_in_params(eqn.params):
        closed = sub if isinstance(sub, ClosedJaxpr) else ClosedJaxpr(sub, [])
        raw = scan_jaxpr(closed)
        for e in raw.eqns:
            f, i, o = _raw_cost(e)
            flops += f
            b_in += i
            b_out += o
    return flops, b_in, b_out


def _raw_cost(raw: RawEqn) -> tuple[float, int, int]:
    if raw.primitive in COMPOSITES:
        n = make_node(raw, "other", None, ())
        return n.flops, n.bytes_in, n.bytes_out
    return raw.flops, raw.bytes_in, raw.bytes_out


def body_phase(parent: Phase, rel_stack: str) -> Phase:
    """Phase of an equation inside a loop body: a backward loop's body is backward
    (recomputation included); elsewhere a transposed equation is backward (a gradient
    accumulation loop holds forward and backward), everything else inherits the loop's.

    Example:
        >>> body_phase("forward", "transpose(jvp(MLP))/fc"), body_phase("backward", "jvp(h)")
        ('backward', 'backward')
    """
    if parent == "backward":
        return "backward"
    if "transpose(" in rel_stack:
        return "backward"
    if parent in ("other", "optimizer") and "jvp(" in rel_stack:
        return "forward"
    return parent


def _body_io_paths(primitive: str, params: dict[str, Any], b: int, n_in: int, n_out: int):
    """Names of a body's inputs and outputs: ``consts/i``, ``carry/i``, ``xs/i``, ``ys/i``."""

    def split(n: int, parts: Sequence[tuple[str, int]]) -> list[str]:
        names = [f"{label}/{i}" for label, count in parts for i in range(max(count, 0))]
        names += [f"in/{i}" for i in range(len(names), n)]
        return names[:n]

    if primitive == "scan":
        nc, nk = params["num_consts"], params["num_carry"]
        ins = split(n_in, [("consts", nc), ("carry", nk), ("xs", n_in - nc - nk)])
        outs = split(n_out, [("carry", nk), ("ys", n_out - nk)])
    elif primitive == "while":
        nc = params["cond_nconsts"] if b == 0 else params["body_nconsts"]
        ins = split(n_in, [("consts", nc), ("carry", n_in - nc)])
        outs = ["pred"] if b == 0 else [f"carry/{i}" for i in range(n_out)]
    else:
        ins = [f"operands/{i}" for i in range(n_in)]
        outs = [f"out/{i}" for i in range(n_out)]
    return ins, outs


def body_graph(
    closed: ClosedJaxpr,
    *,
    primitive: str,
    params: dict[str, Any],
    body_index: int,
    stack_prefix: str,
    phase: Phase,
    scope: tuple[tuple[int, int], ...],
) -> Graph:
    """The :class:`Graph` of one body of a composite equation (no layers, roles ``other``).

    Node name stacks are absolute (the loop's stack prepended); ``graph.jaxpr`` is the body
    exactly as it sits in the loop equation's parameters. ``graph.scope`` is where it sits.
    """
    raw = scan_jaxpr(closed, stack_prefix)
    nodes = [make_node(r, body_phase(phase, r.rel_name_stack), None, scope) for r in raw.eqns]
    in_names, out_names = _body_io_paths(
        primitive, params, body_index, len(raw.invars), len(raw.outvars)
    )
    inputs = [
        GraphInput(i, vid, in_names[i], raw.values[vid], "other")
        for i, vid in enumerate(raw.invars)
    ]
    outputs = [
        GraphOutput(i, vid, out_names[i], raw.out_tensors[i]) for i, vid in enumerate(raw.outvars)
    ]
    return Graph(
        nodes, raw.values, inputs, outputs, (), jaxpr=closed,
        consts=tuple(raw.constvars), scope=scope,
    )  # fmt: skip


def _bodies_of(eqn: Any) -> list[ClosedJaxpr]:
    out = []
    for j in jaxprs_in_params(eqn.params):
        out.append(j if isinstance(j, ClosedJaxpr) else ClosedJaxpr(j, []))
    return out


def make_node(
    raw: RawEqn,
    phase: Phase,
    layer: int | None,
    scope: tuple[tuple[int, int], ...],
) -> Node:
    """Freeze one equation into a :class:`Node` (building and costing loop bodies)."""
    eqn = raw.eqn
    params = json_params(raw.primitive, eqn.params)
    bodies: tuple[Graph, ...] = ()
    length = 1
    flops, b_in, b_out = raw.flops, raw.bytes_in, raw.bytes_out
    if raw.primitive in COMPOSITES:
        bodies = tuple(
            body_graph(
                closed,
                primitive=raw.primitive,
                params=eqn.params,
                body_index=b,
                stack_prefix=raw.name_stack,
                phase=phase,
                scope=(*scope, (raw.index, b)),
            )
            for b, closed in enumerate(_bodies_of(eqn))
        )
        totals = [
            (g.total_flops, sum(n.bytes_in for n in g), sum(n.bytes_out for n in g)) for g in bodies
        ]
        if raw.primitive == "scan":
            length = int(eqn.params["length"])
            flops, b_in, b_out = (length * t for t in totals[0])
            b_in, b_out = int(b_in), int(b_out)
        elif raw.primitive == "while":
            flops = sum(t[0] for t in totals)
            b_in = sum(t[1] for t in totals)
            b_out = sum(t[2] for t in totals)
        else:  # cond: the most expensive branch
            flops, b_in, b_out = max(totals) if totals else (0.0, 0, 0)
    return Node(
        id=raw.index,
        primitive=raw.primitive,
        inputs=raw.inputs,
        outputs=raw.outputs,
        in_tensors=raw.in_tensors,
        out_tensors=raw.out_tensors,
        params=params,
        flops=float(flops),
        bytes_in=int(b_in),
        bytes_out=int(b_out),
        name_stack=raw.name_stack,
        phase=phase,
        layer=layer,
        body=bodies,
        length=length,
        scope=scope,
    )
