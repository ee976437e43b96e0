"""Find the repeated layers of a traced step (named, scanned, or structurally repeated).

Three sources, tried on the top-level nodes:

1. **Named** (Flax linen): a name-stack component with an index (``h_3``, ``layers_3``,
   ``block_2``, ``Dense_1``; ``layer3`` too) that occurs with at least two indices. Among
   such ``(depth, prefix)`` candidates holding at least 5% of the FLOPs, the one covering
   the most FLOPs wins (ties: the shallower), so ``GPT/h_3`` beats ``GPT/h_3/mlp/Dense_0``
   and GPT-2's ``ln_1``/``ln_2`` are never layers. Forward and backward nodes
   carry the names; the optimizer's nodes are placed by data flow (below).
2. **Scan** (``nn.scan``/``lax.scan`` over layers): a ``scan`` whose scanned-over operands
   (``xs``) include parameters (directly or through casts/reshapes). It gives ``length``
   layers of kind ``"scan"``; a forward scan is paired with the backward scan that reads the
   most of the same parameters, and each layer gets ``1/length`` of both (and of the
   optimizer nodes that update those stacked parameters). All iterations share ``nodes``
   (the loop nodes) and ``signature``; ``Layer.iteration`` tells them apart.
3. **Repetition** (Flax nnx, plain JAX; used when 1 and 2 find nothing): parameters in
   order of first forward use, each labelled by how it is used (consuming primitive,
   operand position, shape, dtype). The longest run of a repeating unit of parameters
   (at least two repeats; ties: the shorter unit) gives the layers; the run is then extended
   by whole units that match without shapes (an MLP's first and last layer differ only in
   width). Layer ``k``'s forward nodes are those from the first use of its first parameter
   up to the next layer's; the last layer gets at most the longest other layer's span.
   Backward nodes: the layer of a weight they read (``dx = ct @ W^T``), else that of the
   backward nodes consuming them (the cotangent chain into that ``dx``), else that of the
   forward values they read (``dW = x^T ct``); see :func:`_assign_backward`.

**Optimizer nodes** (all three): in program order, a node joins the one layer among the
layers of the inputs it reads (a parameter's or its optimizer state's layer: by name for
named layers, ``.../h_3/...`` in the path) and of the nodes that produced its operands;
nodes reading only optimizer state join the layer all their consumers agree on. Global
reductions (a gradient norm) stay unassigned.

``Layer.signature`` hashes the layer's nodes (phase, primitive, shapes, dtypes, parameters,
loop bodies) in program order, so structurally identical layers have equal signatures.
"""

from __future__ import annotations

import functools
import hashlib
import math
import re
from collections import defaultdict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from autopar.trace.build import is_float_dtype
from autopar.trace.graph import Graph, GraphInput, GraphOutput, Layer, Node

_TRANSFORM_PREFIX = re.compile(r"^(?:[\w.-]+\()+")
_INDEXED = re.compile(r"^(.*?[A-Za-z][A-Za-z_]*?)_?(\d+)$")
# Cheap ops through which a parameter stays "the parameter" (mixed-precision casts, views).
# Named candidates must hold this share of the FLOPs (GPT-2's ``ln_1``/``ln_2`` are indexed
# names too; with scanned blocks only their hoisted constants remain at top level).
_MIN_NAMED_SHARE = 0.05
_PARAM_VIEWS = frozenset({"convert_element_type", "reshape", "transpose", "copy", "copy_p"})


def components(name_stack: str) -> list[str]:
    """Module path of a name stack, transforms stripped.

    Example:
        >>> components("transpose(jvp(GPT))/h_3/attn/q")
        ['GPT', 'h_3', 'attn', 'q']
        >>> components("jvp()")
        []
    """
    return list(_components(name_stack))


@functools.lru_cache(maxsize=4096)
def _components(name_stack: str) -> tuple[str, ...]:
    # thousands of nodes share a few hundred distinct name stacks
    out = []
    for part in name_stack.split("/"):
        c = _TRANSFORM_PREFIX.sub("", part).rstrip(")")
        if c:
            out.append(c)
    return tuple(out)


@dataclass
class _Proto:
    """A layer (or, for ``kind == "scan"``, a group of ``count`` layers) being assembled."""

    name: str
    kind: str
    order: int  # program position of its first forward node
    nodes: set[int] = field(default_factory=set)
    count: int = 1


def find_layers(
    nodes: Sequence[Node], inputs: Sequence[GraphInput], outputs: Sequence[GraphOutput]
) -> tuple[list[Layer], dict[int, int]]:
    """Layers of the top-level ``nodes`` and the node -> layer index map.

    Args:
        nodes: top-level nodes with phases (``layer`` not yet set).
        inputs: the graph inputs with roles and ``output_index``.
        outputs: the graph outputs.

    Returns:
        ``(layers, node_layer)``; for scan groups every loop node maps to the group's first
        layer.
    """
    producer: dict[int, int] = {}
    consumers: dict[int, list[int]] = defaultdict(list)
    for n in nodes:
        for v in n.outputs:
            producer[v] = n.id
        for v in n.inputs:
            if v >= 0:
                consumers[v].append(n.id)
    params = [i for i in inputs if i.role == "param"]

    protos: list[_Proto] = []
    input_proto: dict[int, int] = {}  # input value id -> proto index
    node_proto: dict[int, int] = {}

    named = _named(nodes)
    for name, ids in named:
        node_set = set(ids)
        order = min(ids)
        protos.append(_Proto(name, "named", order, node_set))
    if named:
        # An input belongs to the first layer (in program order) whose name is a run of
        # its path's components: every run of the path looked up at once.
        first: dict[tuple[str, ...], int] = {}
        for k, (name, _) in enumerate(named):
            first.setdefault(tuple(name.split("/")), k)
        for i in inputs:
            hits = [first[run] for run in _runs(i.path.split("/")) if run in first]
            if hits:
                input_proto[i.value] = min(hits)
    for k, p in enumerate(protos):
        for nid in p.nodes:
            node_proto[nid] = k

    for fwd, bwd, length, stacked in _scan_groups(nodes, params):
        k = len(protos)
        ids = {fwd} | ({bwd} if bwd is not None else set())
        protos.append(_Proto(_scan_name(nodes[fwd], len(protos)), "scan", fwd, ids, length))
        for nid in ids:
            node_proto[nid] = k
        for v in stacked:
            input_proto.setdefault(v, k)

    if not protos:
        for ids, weights in _repeat_layers(nodes, inputs, outputs, producer, consumers):
            k = len(protos)
            protos.append(_Proto(f"block_{k}", "repeat", min(ids, default=0), set(ids)))
            for nid in ids:
                node_proto[nid] = k
            for v in weights:
                input_proto[v] = k

    if not protos:
        return [], {}
    _assign_optimizer(nodes, producer, consumers, node_proto, input_proto)
    for nid, k in node_proto.items():
        protos[k].nodes.add(nid)
    return _finish(nodes, protos)


# -- named ---------------------------------------------------------------------------------


def _runs(comps: Sequence[str]) -> Iterator[tuple[str, ...]]:
    """Every contiguous run of ``comps``.

    Example:
        >>> list(_runs(["a", "b", "c"]))
        [('a',), ('a', 'b'), ('a', 'b', 'c'), ('b',), ('b', 'c'), ('c',)]
    """
    for i in range(len(comps)):
        for j in range(i + 1, len(comps) + 1):
            yield tuple(comps[i:j])


def _named(nodes: Sequence[Node]) -> list[tuple[str, list[int]]]:
    """``[(layer name, node ids)]`` in program order from indexed name-stack components.

    A component is indexed when it ends in a number (``h_3``, ``layer3``) or *is* a number
    under a named parent (``block/3``, Hugging Face's Flax layout): its ``(depth, prefix)``
    is a candidate, its prefix ``"h"`` or ``"block/"`` (the parent's name). Candidates are
    taken greedily by FLOPs (ties: the shallower, then more members) while their nodes are
    disjoint from those taken, so two stacks under different names or depths
    (``encoder/block/N`` and ``decoder/block/N`` share a candidate; ``enc_N`` and
    ``dec_N`` do not) both become layers, and parts of a taken layer never do.
    """
    # (depth, prefix) -> identity (module path up to the indexed component) -> node ids
    cands: dict[tuple[int, str], dict[tuple[str, ...], list[int]]] = defaultdict(
        lambda: defaultdict(list)
    )
    for n in nodes:
        if not n.name_stack:
            continue
        comps = _components(n.name_stack)
        for d in range(len(comps)):
            prefix = _indexed_prefix(comps, d)
            if prefix is not None:
                cands[(d, prefix)][tuple(comps[: d + 1])].append(n.id)
    total = math.fsum(n.flops for n in nodes)
    scored = []
    for key, members in cands.items():
        if len(members) < 2:
            continue
        ids = {i for m in members.values() for i in m}
        # fsum over the set: equal node sets score exactly equal, whatever their order
        flops = math.fsum(nodes[i].flops for i in ids)
        if flops < _MIN_NAMED_SHARE * total:
            continue  # indexed names of small parts (``ln_1``, ``ln_2``), not layers
        scored.append(((flops, -key[0], len(members)), key, ids))
    scored.sort(key=lambda t: t[0], reverse=True)
    taken: set[int] = set()
    out = []
    for _, key, ids in scored:
        if ids & taken:
            continue  # a part (or a parent) of layers already taken
        taken |= ids
        for ident, members in cands[key].items():
            out.append((_layer_name(ident), members))
    out.sort(key=lambda t: min(t[1]))
    return out


def _indexed_prefix(comps: Sequence[str], d: int) -> str | None:
    """The candidate prefix of ``comps[d]`` if it is indexed, else ``None``.

    Example:
        >>> _indexed_prefix(["GPT", "h_3", "attn"], 1), _indexed_prefix(["T5", "block", "3"], 2)
        ('h', 'block/')
        >>> _indexed_prefix(["T5", "block"], 1) is None
        True
    """
    c = comps[d]
    if c.isdigit():
        return f"{comps[d - 1]}/" if d > 0 else None
    m = _INDEXED.match(c)
    return m.group(1) if m else None


def _layer_name(ident: tuple[str, ...]) -> str:
    """A layer's name: its module path without the root module, keeping a bare number's
    parent (``T5/encoder/block/3`` -> ``encoder/block/3``; ``layers/3`` stays)."""
    keep = 2 if ident[-1].isdigit() else 1
    return "/".join(ident[1:]) if len(ident) > keep else "/".join(ident)


# -- scan ----------------------------------------------------------------------------------


def _param_views(nodes: Sequence[Node], params: Sequence[GraphInput]) -> dict[int, int]:
    """Value id -> parameter input value id, for parameters and their casts/reshapes."""
    view = {p.value: p.value for p in params}
    for n in nodes:
        if n.primitive in _PARAM_VIEWS and n.inputs and n.inputs[0] in view:
            for v in n.outputs:
                view[v] = view[n.inputs[0]]
    return view


def _scan_groups(nodes: Sequence[Node], params: Sequence[GraphInput]):
    """``[(forward scan id, backward scan id | None, length, stacked param value ids)]``."""
    view = _param_views(nodes, params)
    fwd: list[tuple[int, set[int]]] = []
    bwd: list[tuple[int, set[int]]] = []
    for n in nodes:
        if n.primitive != "scan":
            continue
        nc, nk = n.params.get("num_consts", 0), n.params.get("num_carry", 0)
        xs = n.inputs[nc + nk :]
        stacked = {view[v] for v in xs if v in view}
        if not stacked:
            continue
        (bwd if n.phase == "backward" else fwd).append((n.id, stacked))
    groups = []
    free = list(bwd)
    for fid, fstack in fwd:
        length = nodes[fid].length
        best, best_overlap = None, 0
        for j, (bid, bstack) in enumerate(free):
            overlap = len(fstack & bstack)
            if nodes[bid].length == length and overlap > best_overlap:
                best, best_overlap = j, overlap
        bid = None
        stacked = set(fstack)
        if best is not None:
            bid, bstack = free.pop(best)
            stacked |= bstack
        groups.append((fid, bid, length, stacked))
    # backward scans with no forward partner (forward scanned elsewhere): layers of their own
    for bid, bstack in free:
        groups.append((bid, None, nodes[bid].length, set(bstack)))
    groups.sort(key=lambda g: g[0])
    return groups


def _scan_name(node: Node, k: int) -> str:
    """The module name the loop body runs (``h`` for ``nn.scan(..., name="h")``)."""
    counts: dict[str, int] = defaultdict(int)
    if node.body:
        prefix = len(components(node.name_stack))
        for n in node.body[0].nodes:
            comps = components(n.name_stack)[prefix:]
            if comps:
                counts[comps[0]] += 1
    if counts:
        return max(counts, key=lambda c: counts[c])
    return f"scan{k}"


# -- repetition ----------------------------------------------------------------------------


def _best_run(sig: Sequence[object]) -> tuple[int, int, int] | None:
    """``(start, period, repeats)`` of the longest periodic run with >= 2 repeats."""
    m = len(sig)
    best: tuple[int, int, int] | None = None
    best_cover = 0
    for p in range(1, m // 2 + 1):
        i = 0
        while i + p < m:
            if sig[i] != sig[i + p]:
                i += 1
                continue
            j = i
            while j + p < m and sig[j] == sig[j + p]:
                j += 1
            repeats = (j - i + p) // p
            if repeats >= 2 and repeats * p > best_cover:
                best, best_cover = (i, p, repeats), repeats * p
            i = j + 1
    return best


def _repeat_layers(
    nodes: Sequence[Node], inputs: Sequence[GraphInput], outputs, producer, consumers
):
    """``[(node ids, weight value ids)]`` per layer found by structural repetition."""
    weights = [i for i in inputs if i.role == "param"]
    if not weights:
        weights = [
            i
            for i in inputs
            if i.role == "other" and i.tensor.ndim >= 1 and is_float_dtype(i.tensor.dtype)
        ]
    uses = []
    for w in weights:
        fwd_uses = [c for c in consumers.get(w.value, ()) if nodes[c].phase == "forward"]
        if not fwd_uses:
            continue
        first = min(fwd_uses)
        n = nodes[first]
        if n.primitive in ("scan", "while", "cond"):
            continue
        pos = n.inputs.index(w.value)
        full = (n.primitive, pos, w.tensor.shape, w.tensor.dtype)
        loose = (n.primitive, pos, w.tensor.ndim, w.tensor.dtype)
        uses.append((first, w.index, w.value, full, loose))
    uses.sort()
    if len(uses) < 2:
        return []
    run = _best_run([u[3] for u in uses])
    loose = [u[4] for u in uses]
    if run is None:
        run = _best_run(loose)
        if run is None:
            return []
    start, p, repeats = run
    unit = loose[start : start + p]
    while start - p >= 0 and loose[start - p : start] == unit:
        start, repeats = start - p, repeats + 1
    while (
        start + (repeats + 1) * p <= len(uses)
        and loose[start + repeats * p : start + (repeats + 1) * p] == unit
    ):
        repeats += 1

    units = [uses[start + k * p : start + (k + 1) * p] for k in range(repeats)]
    starts = [min(u[0] for u in unit_) for unit_ in units]
    after = start + repeats * p
    spans = [starts[k + 1] - starts[k] for k in range(repeats - 1)]
    end = starts[-1] + (max(spans) if spans else len(nodes))
    if after < len(uses):
        end = min(end, uses[after][0])
    bounds = [*starts[1:], end]

    node_layer: dict[int, int] = {}
    weight_layer: dict[int, int] = {}
    for k, unit_ in enumerate(units):
        for u in unit_:
            weight_layer[u[2]] = k
        for nid in range(starts[k], bounds[k]):
            if nodes[nid].phase == "forward":
                node_layer[nid] = k
    _assign_backward(nodes, producer, consumers, node_layer, weight_layer, inputs, outputs)
    out = []
    for k, unit_ in enumerate(units):
        ids = [nid for nid, kk in node_layer.items() if kk == k]
        out.append((ids, [u[2] for u in unit_]))
    return out


_NONE = -1  # "belongs to no layer" (it reads a parameter outside every layer)
_GRAD_WALK_LIMIT = 400  # values visited from one gradient into the optimizer


def _gradient_ends(nodes, consumers, weight_layer, inputs, outputs) -> dict[int, int]:
    """Backward nodes whose results leave the backward pass, mapped to the one layer (or
    :data:`_NONE`) of the parameters whose updated values they reach through the
    optimizer (``dW``/``db`` of a layer; of the embedding: none)."""
    out_layer: dict[int, int] = {}
    for i in inputs:
        if i.role == "param" and i.output_index is not None:
            out_layer[outputs[i.output_index].value] = weight_layer.get(i.value, _NONE)
    if not out_layer:
        return {}
    result: dict[int, int] = {}
    for n in nodes:
        if n.phase != "backward":
            continue
        frontier = [v for v in n.outputs]
        if any(nodes[c].phase == "backward" for v in frontier for c in consumers.get(v, ())):
            continue
        reached: set[int] = set()
        seen: set[int] = set()
        while frontier and len(seen) < _GRAD_WALK_LIMIT:
            v = frontier.pop()
            if v in seen:
                continue
            seen.add(v)
            if v in out_layer:
                reached.add(out_layer[v])
            for c in consumers.get(v, ()):
                if nodes[c].phase == "optimizer":
                    frontier.extend(nodes[c].outputs)
        if len(reached) == 1 and not frontier:
            result[n.id] = reached.pop()
    return result


def _assign_backward(nodes, producer, consumers, node_layer, weight_layer, inputs, outputs) -> None:
    """Place backward nodes of repetition layers (``node_layer`` gets them).

    1. A node reading a layer's weight belongs to it (``dx = ct @ W^T``); one reading a
       parameter outside every layer (embedding, head) belongs to none.
    2. Walking backwards, other nodes join the layer their backward consumers are in (the
       cotangent chain feeding ``dx`` of that layer).
    3. A gradient end (``dW``, ``db``: no backward consumer) joins the layer of the
       parameters whose new values it reaches through the optimizer, or none (embedding);
       then step 2 runs again for the nodes feeding only gradient ends.
    4. What is left (the first layer's activation gradient, which no ``dx`` consumes, or a
       gradient reaching several layers) joins the layer of the forward values
       it reads: the layer whose weight-reading node reads that value directly (``x`` of
       ``dW = x^T ct``), else the layer that computed it; or, reading none, the layer of the
       backward nodes that produced its operands.
    """
    others = {i.value for i in inputs if i.role == "param" and i.value not in weight_layer}
    home: dict[int, int] = {}
    for nid in sorted(node_layer):
        n = nodes[nid]
        ks = [weight_layer[v] for v in n.inputs if v in weight_layer]
        if ks:
            for v in n.inputs:
                if v >= 0 and v not in weight_layer:
                    home.setdefault(v, ks[0])
    for nid, k in node_layer.items():
        for v in nodes[nid].outputs:
            home.setdefault(v, k)
    bwd = [n for n in nodes if n.phase == "backward"]
    assigned: dict[int, int] = {}

    def from_consumers(n: Node) -> int | None:
        cons = {
            assigned[c]
            for v in n.outputs
            for c in consumers.get(v, ())
            if c in assigned and nodes[c].phase == "backward"
        }
        if not cons:
            return None
        real = cons - {_NONE}
        return max(real) if real else _NONE

    for n in reversed(bwd):
        ws = {weight_layer[v] for v in n.inputs if v in weight_layer}
        if ws:
            assigned[n.id] = max(ws)
        elif any(v in others for v in n.inputs):
            assigned[n.id] = _NONE
        else:
            k = from_consumers(n)
            if k is not None:
                assigned[n.id] = k
    grad_layer = _gradient_ends(nodes, consumers, weight_layer, inputs, outputs)
    for nid, k in grad_layer.items():
        assigned.setdefault(nid, k)
    for n in reversed(bwd):
        if n.id not in assigned:
            k = from_consumers(n)
            if k is not None:
                assigned[n.id] = k
    for n in bwd:
        if n.id in assigned:
            continue
        if n.id in grad_layer:
            assigned[n.id] = grad_layer[n.id]
            continue
        homes = {home[v] for v in n.inputs if v in home}
        if homes:
            assigned[n.id] = max(homes)
            continue
        prods = {
            assigned[producer[v]] for v in n.inputs if v in producer and producer[v] in assigned
        }
        if prods:
            assigned[n.id] = max(prods)
    for nid, k in assigned.items():
        if k != _NONE:
            node_layer[nid] = k


# -- optimizer -----------------------------------------------------------------------------


def _assign_optimizer(nodes, producer, consumers, node_proto, input_proto) -> None:
    opt = [n for n in nodes if n.phase == "optimizer"]
    for n in opt:
        ks = set()
        for v in n.inputs:
            if v < 0:
                continue
            if v in input_proto:
                ks.add(input_proto[v])
            src = producer.get(v)
            if src is not None and src in node_proto:
                ks.add(node_proto[src])
        if len(ks) == 1:
            node_proto[n.id] = ks.pop()
    for n in reversed(opt):
        if n.id in node_proto:
            continue
        ks = {
            node_proto.get(c)
            for v in n.outputs
            for c in consumers.get(v, ())
            if nodes[c].phase == "optimizer"
        }
        if len(ks) == 1 and None not in ks:
            node_proto[n.id] = ks.pop()


# -- assembly ------------------------------------------------------------------------------


def node_signature(n: Node) -> tuple:
    """What makes two nodes structurally identical (no ids)."""
    sig = (
        n.phase,
        n.primitive,
        tuple((t.shape, t.dtype) for t in n.in_tensors),
        tuple((t.shape, t.dtype) for t in n.out_tensors),
        repr(sorted(n.params.items())),
        n.length,
    )
    if n.body:
        sig = (*sig, tuple(graph_signature(b) for b in n.body))
    return sig


def graph_signature(g: Graph) -> str:
    """A short hash of all nodes of ``g`` (structure, shapes, dtypes, parameters)."""
    return _hash([node_signature(n) for n in g.nodes])


def _hash(items: list) -> str:
    return hashlib.sha1(repr(items).encode()).hexdigest()[:16]


def _finish(nodes: Sequence[Node], protos: list[_Proto]) -> tuple[list[Layer], dict[int, int]]:
    protos = sorted(protos, key=lambda p: p.order)
    layers: list[Layer] = []
    node_layer: dict[int, int] = {}
    for p in protos:
        ids = tuple(sorted(p.nodes))
        by_phase = {"forward": 0.0, "backward": 0.0, "optimizer": 0.0, "other": 0.0}
        for i in ids:
            by_phase[nodes[i].phase] += nodes[i].flops
        sig = _hash([node_signature(nodes[i]) for i in ids])
        first = len(layers)
        for i in ids:
            node_layer[i] = first
        c = p.count
        for it in range(c):
            layers.append(
                Layer(
                    index=len(layers),
                    name=f"{p.name}[{it}]" if p.kind == "scan" else p.name,
                    kind=p.kind,  # type: ignore[arg-type]
                    nodes=ids,
                    flops=sum(by_phase.values()) / c,
                    forward_flops=by_phase["forward"] / c,
                    backward_flops=by_phase["backward"] / c,
                    signature=sig,
                    iteration=it if p.kind == "scan" else None,
                    optimizer_flops=by_phase["optimizer"] / c,
                )
            )
    return layers, node_layer
