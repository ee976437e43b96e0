"""Build stage 2, coarsen: ops -> groups that choose one strategy together.

* **Pins.** A ``constraint`` op on the result of an op that leads its group folds into
  that leader as a restriction of its strategies (the model the planner solved), unless
  none of them makes the pinned layout; then it stays, a group of its own.
* **Groups.** An op that can take its layout from one operand (elementwise, reshape,
  transpose, broadcast, reduction, slicing, ...; ``strategies.FOLLOWABLE``) joins the group
  of that operand's producer and gets no choice of its own; so does a scan body's input
  (it takes the layout of the value entering the loop, as XLA gives a loop's operand, body
  parameter and result one sharding). Ops that read no graph input (iota, broadcast
  constants, masks) get no group at all: XLA materialises constants in whatever layout
  their consumer wants, and reads of them are dropped. Leaders are matmuls, convolutions,
  gathers, scatters, inputs, loop carries that start from a constant, and pinned
  constraints.
* **Families.** A parameter and its optimizer state take one layout (unless ZeRO 1/2
  shards the state alone): :func:`match_optimizer_state` pairs them, and their groups
  become one alias set. :func:`tie_layers` (run on priced groups) ties structurally
  identical unrolled layers, at the top level and inside a gradient-accumulation loop's
  body (:func:`layer_scopes`), so the solver decides one layer.

Example: the MLP train step on 8 devices; ``state/params/layer_0/w`` (input 10) and its
Adam moments ``mu`` and ``nu`` (inputs 2 and 6) take one layout.

    >>> from autopar.search.build.flatten import flatten
    >>> from autopar.search.costs import CostContext
    >>> coarse = coarsen(flatten(graph), StrategyCatalog(CostContext(cluster, {"data": 8})))
    >>> len(coarse.ops), len(coarse.groups)
    (139, 43)
    >>> graph.inputs[10].path, match_optimizer_state(graph)[10]
    ('state/params/layer_0/w', [2, 6])
    >>> coarse.family[2] == coarse.family[6] == 10
    True
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from autopar.primitives import select
from autopar.search.build.catalog import StrategyCatalog
from autopar.search.build.flatten import Flat, scan_ok
from autopar.search.build.records import Group, GroupShape, Op, Ref, Scope
from autopar.search.sharding import Sharding
from autopar.search.strategies import FOLLOWABLE, can_follow
from autopar.trace.graph import Graph, Layer


@dataclass(frozen=True)
class Coarse:
    """What coarsening hands on.

    Attributes:
        flat: the flattened graph (its ``ops`` before coarsening).
        ops: the ops with reads redirected past folded pins, reads of constants dropped
            and every scan-body input's ``root_role`` traced back to a graph input.
        groups: the groups; ``groups[g].ops[0]`` leads.
        where: op -> (group, position) (constants and folded pins have none).
        envs: per scope, value id -> where it comes from (pins folded).
        output_refs: graph output index -> where it comes from (pins folded).
        restrict: leader op -> (result port -> pinned layout).
        reads: leader op -> (operand -> the layout the plan reads it in).
        family: graph input index -> the input whose layout it shares.
        whole_dims: graph input index -> dims kept whole (unioned over a family).
    """

    flat: Flat
    ops: tuple[Op, ...]
    groups: tuple[GroupShape, ...]
    where: Mapping[int, tuple[int, int]]
    envs: Mapping[Scope, Mapping[int, Ref]]
    output_refs: Mapping[int, Ref | None]
    restrict: Mapping[int, Mapping[int, Sharding]]
    family: Mapping[int, int]
    whole_dims: Mapping[int, frozenset[int]]
    reads: Mapping[int, Mapping[int, Sharding]] = field(default_factory=dict)

    @property
    def graph(self) -> Graph:
        return self.flat.graph

    def whole(self, input_index: int) -> frozenset[int]:
        return self.whole_dims.get(input_index, frozenset())


def match_optimizer_state(graph: Graph) -> dict[int, list[int]]:
    """Optimizer-state inputs of each parameter input, by path suffix and shape.

    A leaf ``opt_state/adam/0/mu/h_0/attn/q/kernel`` belongs to the parameter
    ``params/h_0/attn/q/kernel``: the path after the parameter tree's root is a suffix of
    the state's path and the shapes agree.

    Returns:
        parameter input index -> indices of its optimizer-state inputs.
    """
    params = graph.inputs_by_role("param")
    states = graph.inputs_by_role("opt_state")
    out: dict[int, list[int]] = {p.index: [] for p in params}
    by_rel: dict[tuple[str, tuple[int, ...]], int] = {}
    for p in params:
        parts = p.path.split("/")
        rel = "/".join(parts[parts.index("params") + 1 :]) if "params" in parts else p.path
        by_rel.setdefault((rel, p.tensor.shape), p.index)
    for o in states:
        parts = o.path.split("/")
        # The longest suffix of the state's path that names a parameter of its shape.
        for start in range(len(parts)):
            hit = by_rel.get(("/".join(parts[start:]), o.tensor.shape))
            if hit is not None:
                out[hit].append(o.index)
                break
    return out


# Operands whose layout says little about an op's (:func:`main_operand` prefers any other):
# constants, and the results of the families the primitives table shards by the
# ``broadcast`` and ``source`` rules (``broadcast_in_dim``, ``iota``).
_WEAK_PRIMITIVES: frozenset[str] = select(sharding=("broadcast", "source"))


def _weak(ops: Sequence[Op], ref: Ref) -> bool:
    op = ops[ref.op]
    if not op.depends:
        return True
    return op.kind == "node" and op.node.primitive in _WEAK_PRIMITIVES


def main_operand(ops: Sequence[Op], op: Op, coarsen: bool = True) -> int | None:
    """The operand ``op`` takes its layout from, or ``None`` (``op`` leads a group).

    Constants (ops that read no graph input) are never followed: they get no group. Of
    the others it prefers, in this order, one that is not a broadcast or a generated
    value (``iota``), the highest rank, the largest size, a non-boolean one, the first.

    Example:
        >>> sorted(_WEAK_PRIMITIVES)   # the primitives whose results it follows last
        ['broadcast_in_dim', 'iota']
    """
    if not coarsen:
        return None
    if op.kind == "body_input":
        # A loop input takes the layout of what enters the loop (XLA gives a while
        # loop's operand, body parameter and result one sharding).
        ref = op.operands[0]
        return 0 if ref is not None and ops[ref.op].depends else None
    if op.kind != "node" or op.node.primitive not in FOLLOWABLE:
        return None
    best, best_key = None, None
    for k, ref in enumerate(op.operands):
        if ref is None or not ops[ref.op].depends:
            continue
        t = op.node.in_tensors[k]
        if t.ndim == 0 or not can_follow(op.node, k):
            continue
        # Prefer a real (not constant) operand of full rank and of the result's size
        # (``x`` over ``mean`` in ``x - mean``: its layout carries more).
        key = (not _weak(ops, ref), t.ndim, t.size, t.dtype != "bool", -k)
        if best_key is None or key > best_key:
            best, best_key = k, key
    return best


def coarsen(
    flat: Flat,
    catalog: StrategyCatalog,
    *,
    enabled: bool = True,
    tie_optimizer_state: bool = True,
    operand_pins: Mapping[tuple[Scope, int, int], Sharding] | None = None,
    split_update: bool = False,
) -> Coarse:
    """Fold pins, group the ops and pair parameters with their optimizer state
    (``enabled=False``: every op leads a group of its own). With ``split_update`` (a
    microbatched step, whose update runs once, apart from the gradient computation), an
    update op never follows a gradient-computation op: the update takes its own layout
    (XLA lays the separately run update out by the state it updates) and reads the
    gradient through a reshard."""
    ops, restrict, folded = _fold_pins(flat.ops, catalog, enabled)
    members: list[list[int]] = []
    follows: list[dict[int, int]] = []
    where: dict[int, tuple[int, int]] = {}
    for op in ops:
        if op.index in folded:
            continue
        if not op.depends and op.kind in ("node", "body_input"):
            continue
        main = main_operand(ops, op, enabled)
        if (
            split_update
            and main is not None
            and op.phase == "optimizer"
            and ops[op.operands[main].op].phase in ("forward", "backward")
        ):
            main = None
        if main is not None:
            gi, _ = where[op.operands[main].op]
            follows[gi][op.index] = main
            where[op.index] = (gi, len(members[gi]))
            members[gi].append(op.index)
        else:
            where[op.index] = (len(members), 0)
            members.append([op.index])
            follows.append({})
    groups = [
        GroupShape(i, tuple(m), f) for i, (m, f) in enumerate(zip(members, follows, strict=True))
    ]
    # Reads of constants are free: drop them; a scan-body input's (or a pin's) role is the
    # role of the graph input the group it reads starts from (a pinned parameter is still
    # a parameter: gathering it is an FSDP gather).
    out: list[Op] = []
    for op in ops:
        operands = tuple(r if r is None or r.op in where else None for r in op.operands)
        if operands != op.operands:
            op = replace(op, operands=operands)
        out.append(op)
    for i, op in enumerate(out):
        if op.kind in ("body_input", "constraint") and op.operands[0] is not None:
            lead = out[groups[where[op.operands[0].op][0]].ops[0]]
            if lead.root_role != op.root_role:
                out[i] = replace(op, root_role=lead.root_role)
    reads = _fold_reads(out, where, restrict, catalog, operand_pins or {}, enabled)
    family, whole = _families(flat, catalog, tie_optimizer_state)
    return Coarse(
        flat,
        tuple(out),
        tuple(groups),
        where,
        {s: {v: _redirect(r, folded) for v, r in env.items()} for s, env in flat.envs.items()},
        {i: (None if r is None else _redirect(r, folded)) for i, r in flat.output_refs.items()},
        restrict,
        family,
        whole,
        reads,
    )


def _fold_pins(
    flat_ops: Sequence[Op], catalog: StrategyCatalog, coarsen_on: bool
) -> tuple[list[Op], dict[int, dict[int, Sharding]], dict[int, Ref]]:
    """Fold each pin on a leader's result into the leader's choice when one of its
    strategies makes the pinned layout: the ops with reads redirected past folded pins,
    the leaders' restrictions, and folded pin -> the producer's ref."""
    restrict: dict[int, dict[int, Sharding]] = {}
    folded: dict[int, Ref] = {}
    ops: list[Op] = []
    for op in flat_ops:
        op = _redirected(op, folded)
        ops.append(op)
        if op.kind != "constraint":
            continue
        ref = op.operands[0]
        src = ops[ref.op]
        spec = op.node.params["spec"]
        if ref.delta or src.kind != "node" or main_operand(ops, src, coarsen_on) is not None:
            continue
        allowed = catalog.leader_strategies(src, restrict.get(src.index))
        if any(st.outs[ref.port] == spec for st in allowed):
            restrict.setdefault(src.index, {})[ref.port] = spec
            folded[op.index] = ref
    return ops, restrict, folded


def _fold_reads(
    ops: Sequence[Op],
    where: Mapping[int, tuple[int, int]],
    restrict: Mapping[int, Mapping[int, Sharding]],
    catalog: StrategyCatalog,
    pins: Mapping[tuple[Scope, int, int], Sharding],
    coarsen_on: bool,
) -> dict[int, dict[int, Sharding]]:
    """A plan's operand pins (how an equation reads a value) restrict the strategies of
    the group leader that reads it, when one of them reads it that way: a result layout
    alone may be made several ways (gather the operand, or split the work and reduce)."""
    if not pins:
        return {}
    out: dict[int, dict[int, Sharding]] = {}
    for op in ops:
        if op.kind != "node" or op.index not in where or where[op.index][1] != 0:
            continue
        mine = {
            k: pins[(op.scope, op.node.id, k)]
            for k in range(len(op.node.inputs))
            if (op.scope, op.node.id, k) in pins
        }
        if mine and catalog.leader_strategies(op, restrict.get(op.index), reads=mine):
            out[op.index] = mine
    return out


def _redirect(r: Ref, folded: Mapping[int, Ref]) -> Ref:
    hit = folded.get(r.op)
    return r if hit is None else Ref(hit.op, hit.port, hit.delta + r.delta)


def _redirected(op: Op, folded: Mapping[int, Ref]) -> Op:
    if not folded:
        return op
    operands = tuple(None if r is None else _redirect(r, folded) for r in op.operands)
    return op if operands == op.operands else replace(op, operands=operands)


def _families(
    flat: Flat, catalog: StrategyCatalog, tie: bool
) -> tuple[dict[int, int], dict[int, frozenset[int]]]:
    """Graph input index -> the input whose layout it shares (a parameter and its
    optimizer state), and the union of their dims kept whole."""
    g = flat.graph
    family = {gi.index: gi.index for gi in g.inputs}
    if tie:
        for p, states in match_optimizer_state(g).items():
            for s in states:
                same_fix = catalog.fixed_inputs.get(s) == catalog.fixed_inputs.get(p)
                same_axes = catalog.input_axes.get(s) == catalog.input_axes.get(p)
                if same_fix and same_axes:
                    family[s] = p
    members: dict[int, list[int]] = {}
    for i, root in family.items():
        members.setdefault(root, []).append(i)
    whole: dict[int, frozenset[int]] = {}
    for group in members.values():
        union = frozenset().union(*(flat.whole_dims.get(i, frozenset()) for i in group))
        if union:
            for i in group:
                whole[i] = union
    return family, whole


def state_aliases(coarse: Coarse, input_ops: Mapping[int, int]) -> list[tuple[int, ...]]:
    """Groups that must choose one layout: a family's inputs and their output sinks."""
    sets: dict[int, set[int]] = {}
    for gi in coarse.graph.inputs:
        sets.setdefault(coarse.family[gi.index], set()).add(coarse.where[input_ops[gi.index]][0])
    for op in coarse.ops:
        if op.kind == "output" and op.index in coarse.where:
            sets.setdefault(coarse.family[op.input.index], set()).add(coarse.where[op.index][0])
    return [tuple(sorted(s)) for s in sets.values() if len(s) > 1]


def same_layouts(a: Group, b: Group) -> bool:
    """Whether two priced groups' strategy lists line up index by index (safe to alias)."""
    if len(a.strategies) != len(b.strategies):
        return False
    return all(
        x[0].outs == y[0].outs and x[0].ins == y[0].ins
        for x, y in zip(a.strategies, b.strategies, strict=True)
    )


def layer_scopes(graph: Graph, scope: Scope = ()) -> list[tuple[Scope, tuple[Layer, ...]]]:
    """Every scope that has layers, with them: the top level's ``graph.layers``, and the
    body layers of each scan flattened into a scope of its own (a user's
    gradient-accumulation loop: its body runs the whole model once per microbatch and
    its layers are found on the body graph).

    Example: the MLP train step has its layers at the top level and no loops.

        >>> [(s, len(layers)) for s, layers in layer_scopes(graph)]
        [((), 2)]
    """
    out: list[tuple[Scope, tuple[Layer, ...]]] = []
    if graph.layers:
        out.append((scope, tuple(graph.layers)))
    for node in graph.nodes:
        if node.primitive == "scan" and scan_ok(node):
            out += layer_scopes(node.body[0], scope + ((node.id, 0),))
    return out


def tie_layers(
    coarse: Coarse, groups: Sequence[Group], catalog: StrategyCatalog, *, coarsen: bool = True
) -> list[tuple[int, ...]]:
    """Alias the groups of structurally identical layers to one representative: leaders at
    the same position, and the inputs (parameters) the layers read.

    Layers are matched within each scope of :func:`layer_scopes` (the top level, and the
    body of a gradient-accumulation loop), their ops by ``(scope, node id)``. Inside a
    loop body a layer reads its parameters through loop inputs (``body_input`` ops, which
    follow the parameter entering the loop): their groups are tied like a top-level
    layer's graph inputs.
    """
    if not coarsen:
        return []
    node_ops = coarse.flat.node_ops
    ops, where = coarse.ops, coarse.where
    ties: list[tuple[int, ...]] = []
    for scope, layers in layer_scopes(coarse.graph):
        by_sig: dict[str, list[Layer]] = {}
        for layer in layers:
            if layer.signature and layer.kind != "scan":
                by_sig.setdefault(layer.signature, []).append(layer)
        for same in by_sig.values():
            rep = same[0]
            for other in same[1:]:
                if len(other.nodes) != len(rep.nodes):
                    continue
                for a, b in zip(rep.nodes, other.nodes, strict=True):
                    oa, ob = node_ops.get((scope, a)), node_ops.get((scope, b))
                    if oa is None or ob is None or oa not in where or ob not in where:
                        continue
                    if catalog.key(ops[oa]) != catalog.key(ops[ob]):
                        continue
                    ties += _tie_ops(ops, where, groups, ops[oa], ops[ob])
    return ties


# Ops a layer reads its parameters through: graph inputs, and loop inputs in a loop body.
_INPUT_KINDS: frozenset[str] = frozenset({"input", "body_input"})


def _tie_ops(
    ops: Sequence[Op],
    where: Mapping[int, tuple[int, int]],
    groups: Sequence[Group],
    a: Op,
    b: Op,
) -> list[tuple[int, int]]:
    """Ties of two matching layer ops: their groups when both lead one, and the groups of
    the inputs (graph or loop inputs, of one kind) they read at the same operand."""
    out: list[tuple[int, int]] = []
    ga, pa = where[a.index]
    gb, pb = where[b.index]
    if pa == 0 and pb == 0 and ga != gb and same_layouts(groups[ga], groups[gb]):
        out.append((ga, gb))
    for ra, rb in zip(a.operands, b.operands, strict=True):
        if ra is None or rb is None:
            continue
        ia, ib = ops[ra.op], ops[rb.op]
        if ia.kind not in _INPUT_KINDS or ib.kind != ia.kind:
            continue
        if ia.index not in where or ib.index not in where:
            continue
        gia, gib = where[ia.index][0], where[ib.index][0]
        if gia != gib and same_layouts(groups[gia], groups[gib]):
            out.append((gia, gib))
    return out


def merge_sets(sets: list[tuple[int, ...]]) -> list[tuple[int, ...]]:
    """Union overlapping alias sets (union-find)."""
    parent: dict[int, int] = {}

    def find(a: int) -> int:
        parent.setdefault(a, a)
        while parent[a] != a:
            parent[a] = parent[parent[a]]
            a = parent[a]
        return a

    for s in sets:
        for x in s[1:]:
            ra, rb = find(s[0]), find(x)
            if ra != rb:
                parent[max(ra, rb)] = min(ra, rb)
    out: dict[int, list[int]] = {}
    for x in parent:
        out.setdefault(find(x), []).append(x)
    return [tuple(sorted(v)) for v in out.values() if len(v) > 1]


__all__ = [
    "Coarse",
    "coarsen",
    "layer_scopes",
    "main_operand",
    "match_optimizer_state",
    "merge_sets",
    "same_layouts",
    "state_aliases",
    "tie_layers",
]
