"""Build stage 1, flatten: a graph -> a list of :class:`~.records.Op`.

Every equation becomes an op (``node``); so does every graph input (``input``), every
value entering a scan body (``body_input``: the slice of an ``xs`` operand, a loop
constant, or a carry, whose second operand is the body's carry-out, the loop's back
edge), every activation a plan pins (``constraint``) and every output that must come back
in its input's layout (``output``: a parameter's new value). Scan bodies are flattened
once with their costs weighted by the trip count: the body is solved once for all
iterations. Values read across a scan boundary carry a rank ``delta`` (a stacked ``ys``
seen outside has one more, unsharded, leading dim).

A pinned value gets a ``constraint`` op after its producer; the next stage
(:mod:`~autopar.search.build.coarsen`) folds it into the producer's choice when the
producer leads a group that can make that layout.

Example: the MLP train step (no scan, no pins): one op per equation and per input, and
an output sink per new state value (the loss, its 14th output, needs none).

    >>> from collections import Counter
    >>> flat = flatten(graph)
    >>> Counter(op.kind for op in flat.ops)
    Counter({'node': 111, 'input': 15, 'output': 13})
    >>> len(graph.nodes), len(graph.inputs), len(graph.outputs)
    (111, 15, 14)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from autopar.primitives import LEADS_GROUP
from autopar.search.build.records import Op, Ref, Scope
from autopar.search.fusion import hbm_io
from autopar.search.sharding import Sharding
from autopar.search.strategies import FOLLOWABLE
from autopar.trace.graph import Graph, Node, TensorInfo


@dataclass(frozen=True)
class Flat:
    """What flattening hands on.

    Attributes:
        graph: the graph flattened.
        ops: every op, in program order (a scan's body after its inputs).
        envs: per scope, graph value id -> where the value comes from.
        input_ops: graph input index -> its ``input`` op.
        output_refs: graph output index -> where it comes from.
        node_ops: ``(scope, node id)`` -> the op of that equation (every scope; layers
            name their nodes by id within the graph that holds them).
        whole_dims: graph input index -> dims it must keep whole (a stack of layer
            parameters scanned over keeps its layer dim).
        unsupported: primitives no strategy rule knows (priced as replicated).
    """

    graph: Graph
    ops: tuple[Op, ...]
    envs: Mapping[Scope, Mapping[int, Ref]]
    input_ops: Mapping[int, int]
    output_refs: Mapping[int, Ref | None]
    node_ops: Mapping[tuple[Scope, int], int] = field(default_factory=dict)
    whole_dims: Mapping[int, frozenset[int]] = field(default_factory=dict)
    unsupported: frozenset[str] = frozenset()


def synthetic(
    primitive: str, ins: Sequence[TensorInfo], outs: Sequence[TensorInfo], **params: Any
) -> Node:
    """A node for an op that is not an equation (input, output, constraint, ...)."""
    return Node(-1, primitive, (), (), tuple(ins), tuple(outs), params)


def scan_ok(node: Node) -> bool:
    """Whether a ``scan`` node's body can be flattened (its signature is complete)."""
    if not node.body:
        return False
    body = node.body[0]
    p = node.params
    return (
        "num_consts" in p
        and "num_carry" in p
        and len(body.inputs) == len(node.inputs)
        and len(body.outputs) == len(node.outputs)
    )


def flatten(
    graph: Graph,
    constraints: Mapping[tuple[Scope, int, int], Sharding] | None = None,
    repeat: Mapping[int, float] | None = None,
) -> Flat:
    """Flatten ``graph`` (``constraints``: ``(scope, node id, output)`` -> pinned layout;
    ``repeat``: top-level node id -> how many times it runs per step, e.g. the gradient
    computation once per microbatch).

    Memoised per graph (the search flattens one graph for every mesh and completion it
    builds, ~3 s each on a 48-block encoder-decoder): equal constraints and repeats give
    the same :class:`Flat`, which nothing downstream mutates."""
    constraints, repeat = dict(constraints or {}), dict(repeat or {})
    key = repr((sorted(constraints.items(), key=repr), sorted(repeat.items())))
    # Held by the graph itself (a Flat refers back to its graph: a weak-keyed table would
    # keep every graph alive), so it goes when the graph does.
    memo = graph.__dict__.setdefault("_flattened", {})
    if key not in memo:
        if len(memo) >= _FLATTENED_PER_GRAPH:
            memo.pop(next(iter(memo)))
        memo[key] = _Flattener(graph, constraints, repeat).run()
    return memo[key]


_FLATTENED_PER_GRAPH = 8  # flattenings memoised per graph (oldest dropped first)


class _Flattener:
    def __init__(self, graph: Graph, constraints: dict, repeat: dict) -> None:
        self.graph = graph
        self.constraints = constraints
        self.repeat = repeat
        self.ops: list[Op] = []
        self.envs: dict[Scope, dict[int, Ref]] = {}
        self.input_ops: dict[int, int] = {}
        self.output_refs: dict[int, Ref | None] = {}
        self.node_ops: dict[tuple[Scope, int], int] = {}
        self.whole: dict[int, set[int]] = {}
        self.unsupported: set[str] = set()

    def run(self) -> Flat:
        g = self.graph
        env: dict[int, Ref] = {}
        for gi in g.inputs:
            syn = synthetic("input", (), (gi.tensor,))
            op = self._new("input", syn, (), 1.0, [], gi.path, input=gi, root_role=gi.role)
            env[gi.value] = Ref(op.index, 0)
            self.input_ops[gi.index] = op.index
        self._walk(g, (), 1.0, env)
        self.envs[()] = env
        aliased = {gi.output_index: gi for gi in g.inputs if gi.output_index is not None}
        for go in g.outputs:
            ref = env.get(go.value)
            self.output_refs[go.index] = ref
            gi = aliased.get(go.index)
            if gi is not None and ref is not None:
                syn = synthetic("output", (go.tensor,), ())
                self._new("output", syn, (), 1.0, [ref], go.path, input=gi)
        return Flat(
            g,
            tuple(self.ops),
            self.envs,
            self.input_ops,
            self.output_refs,
            self.node_ops,
            {i: frozenset(d) for i, d in self.whole.items()},
            frozenset(self.unsupported),
        )

    def _new(self, kind, node: Node, scope: Scope, weight: float, operands, name: str, **kw) -> Op:
        op = Op(len(self.ops), kind, node, scope, weight, tuple(operands), name, **kw)
        self.ops.append(op)
        return op

    def _walk(self, graph: Graph, scope: Scope, weight: float, env: dict[int, Ref]) -> None:
        io = hbm_io(graph)
        for node in graph.nodes:
            if not scope and self.repeat:
                weight = self.repeat.get(node.id, 1.0)
            if node.primitive == "scan" and scan_ok(node):
                self._scan(node, scope, weight, env)
                continue
            operands = [env.get(v) if v >= 0 else None for v in node.inputs]
            depends = any(r is not None and self.ops[r.op].depends for r in operands)
            op = self._new(
                "node",
                node,
                scope,
                weight,
                operands,
                node.name_stack or node.primitive,
                phase=node.phase,
                depends=depends,
                io=io.get(node.id),
            )
            self.node_ops[(scope, node.id)] = op.index
            if node.primitive not in FOLLOWABLE and node.primitive not in LEADS_GROUP:
                self.unsupported.add(node.primitive)
            for port, v in enumerate(node.outputs):
                env[v] = self._pin(Ref(op.index, port), scope, node.id, port, node, weight, op)

    def _pin(
        self, ref: Ref, scope: Scope, node_id: int, port: int, node: Node, weight: float, src: Op
    ) -> Ref:
        """A ``constraint`` op after ``ref`` if the plan pins that value, else ``ref``."""
        spec = self.constraints.get((scope, node_id, port))
        if spec is None:
            return ref
        tensor = node.out_tensors[port]
        syn = synthetic("constraint", (tensor,), (tensor,), spec=spec)
        c = self._new(
            "constraint",
            syn,
            scope,
            weight,
            [ref],
            f"{src.name}:constraint",
            phase=src.phase,
            depends=src.depends,
        )
        return Ref(c.index, 0)

    def _scan(self, node: Node, scope: Scope, weight: float, env: dict[int, Ref]) -> None:
        body = node.body[0]
        length = int(node.params.get("length") or node.length or 1)
        nc, ncar = int(node.params["num_consts"]), int(node.params["num_carry"])
        bscope = scope + ((node.id, 0),)
        bweight = weight * length
        benv: dict[int, Ref] = {}
        carry_ops: list[int] = []
        for i, bi in enumerate(sorted(body.inputs, key=lambda x: x.index)):
            v = node.inputs[i]
            outer = env.get(v) if v >= 0 else None
            lead = 1 if i >= nc + ncar else 0
            if lead and outer is not None and self.ops[outer.op].kind == "input":
                # Stacked layer parameters: a layer-sharded stack would be all-gathered
                # whole before the loop; keep the scanned dim whole from the start.
                self.whole.setdefault(self.ops[outer.op].input.index, set()).add(0)
            ins = [node.in_tensors[i]]
            operands: list[Ref | None] = [outer]
            if nc <= i < nc + ncar:
                ins.append(bi.tensor)
                operands.append(None)  # the carry-out, filled once the body is walked
            syn = synthetic("body_input", ins, (bi.tensor,), lead=lead)
            root = self.ops[outer.op] if outer is not None else None
            op = self._new(
                "body_input",
                syn,
                bscope,
                bweight,
                operands,
                f"{node.name_stack or 'scan'}[in {i}]",
                phase=node.phase,
                root_role=root.root_role if root is not None else None,
                # A carry changes every iteration: never a constant.
                depends=(root.depends if root is not None else False) or nc <= i < nc + ncar,
            )
            if nc <= i < nc + ncar:
                carry_ops.append(op.index)
            benv[bi.value] = Ref(op.index, 0)
        self._walk(body, bscope, bweight, benv)
        self.envs[bscope] = benv
        for j, bo in enumerate(sorted(body.outputs, key=lambda x: x.index)):
            r = benv.get(bo.value)
            if j < ncar:
                carry = self.ops[carry_ops[j]]
                self.ops[carry.index] = replace(carry, operands=(carry.operands[0], r))
            if r is None:
                continue
            ref = Ref(r.op, r.port, r.delta + (0 if j < ncar else 1))
            env[node.outputs[j]] = self._pin(ref, scope, node.id, j, node, weight, self.ops[r.op])


__all__ = ["Flat", "flatten", "scan_ok", "synthetic"]
