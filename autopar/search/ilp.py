"""Graph -> :class:`ShardingProblem`: flatten, coarsen, price, and account for memory.

Steps (one :class:`ProblemBuilder` per graph and mesh):

1. **Flatten.** Every equation becomes an *op*; so does every graph input (``input``),
   every value entering a scan body (``body_input``: the slice of an ``xs`` operand, a
   loop constant, or a carry, whose second operand is the body's carry-out, the loop's
   back edge), every activation constraint a plan pins (``constraint``) and every output
   that must come back in its input's layout (``output``: a parameter's new value). Scan
   bodies are flattened once with their costs weighted by the trip count: the body is
   solved once for all iterations. Values read across a scan boundary carry a rank
   ``delta`` (a stacked ``ys`` seen outside has one more, unsharded, leading dim).
2. **Coarsen.** An op that can take its layout from one operand (elementwise, reshape,
   transpose, broadcast, reduction, slicing, ...; see ``strategies.FOLLOWABLE``) joins
   the *group* of that operand's producer and gets no choice of its own; so does a scan
   body's input (it takes the layout of the value entering the loop, as XLA gives a
   loop's operand, body parameter and result one sharding). Ops that read no graph input
   (iota, broadcast constants, masks) get no group at all: XLA materialises constants in
   whatever layout their consumer wants. Groups are the ILP's nodes; their leaders are
   matmuls, convolutions, gathers, scatters, inputs, loop carries that start from a
   constant, and pinned constraints. Identical unrolled layers (``Layer.signature``) are
   tied by alias groups (leaders at the same position, and the inputs the layers read),
   so the solver decides one layer; groups with equal signatures are priced once.
3. **Price.** A group's strategy = its leader's strategy plus what each follower does
   with the layout it receives: cost = sum of (compute + collectives) x trip count, plus
   resharding between ops inside the group. Reads across groups become edges with a
   resharding cost per (producer layout, consumer layout) class pair. Memory-bound ops
   count only the bytes XLA's fusion leaves in HBM (``fusion.hbm_io``). Gradient
   reductions pay their bandwidth in the strategy and their latency once per scope and
   device group (a :class:`~autopar.search.problem.SharedCost`: XLA combines them).
4. **Memory.** Inputs are live throughout (outputs that replace an input reuse its
   buffer, i.e. the step donates its state); every other value from its producer to its
   last consumer; inside a scan the body's largest live set rides on top. A few peak
   moments of the replicated profile become linear constraints; :meth:`BuiltProblem.peak`
   checks every moment exactly and the planner adds any moment that breaks the bound.
"""

from __future__ import annotations

import gc
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from autopar.search.costs import CostContext
from autopar.search.fusion import IO, hbm_io, materialised_values
from autopar.search.problem import (
    MemoryConstraint,
    ProblemEdge,
    ProblemNode,
    ShardingProblem,
    SharedCost,
)
from autopar.search.sharding import (
    Collective,
    Sharding,
    enumerate_shardings,
    format_sharding,
    replicated,
    shards,
)
from autopar.search.strategies import (
    FOLLOWABLE,
    OpStrategy,
    can_follow,
    enumerate_strategies,
    follow_strategy,
)
from autopar.trace.graph import Graph, GraphInput, Node, TensorInfo

Scope = tuple[tuple[int, int], ...]

_ROLE_CATEGORY = {
    "param": "params",
    "opt_state": "optimizer",
    "model_state": "model_state",
    "batch": "inputs",
    "other": "inputs",
}


@dataclass(frozen=True)
class Ref:
    """Where a value comes from: op ``op``'s result ``port``, seen with ``delta`` extra
    (unsharded) leading dims."""

    op: int
    port: int
    delta: int = 0


@dataclass
class Op:
    index: int
    kind: str  # node | input | body_input | constraint | output
    node: Node
    scope: Scope
    weight: float
    operands: list[Ref | None]
    name: str
    phase: str = "other"
    input: GraphInput | None = None  # input op / output sink: the graph input
    root_role: str | None = None  # body_input: role of the graph input it reads, if any
    depends: bool = True  # depends on some graph input (else: a constant)
    io: IO | None = None  # fusible ops: which operands/results touch HBM (fusion.py)


@dataclass
class Group:
    index: int
    ops: list[int]
    follow: dict[int, int] = field(default_factory=dict)  # follower op -> main operand
    strategies: list[list[OpStrategy]] = field(default_factory=list)  # [s][position]
    costs: list[float] = field(default_factory=list)
    compute: list[float] = field(default_factory=list)  # the compute part of each cost
    # per strategy: the combined collectives it takes part in (see ``Charge``)
    charges: list[tuple[Charge, ...]] = field(default_factory=list)


Charge = tuple[tuple[tuple[int, int], ...], str, tuple[str, ...], float, float]
"""A combined gradient reduction: (scope, kind, axes, executions, latency seconds).

XLA's collective combiners merge the independent gradient all-reduces (reduce-scatters)
of one computation over the same devices into one collective, so their latency is paid
once per execution of the scope; each strategy pays only the bandwidth part itself."""


@dataclass(frozen=True)
class EdgeRef:
    """A read across groups: op ``op`` operand ``operand`` reads ``ref``."""

    op: int
    operand: int
    ref: Ref
    problem_edge: int


@dataclass(frozen=True)
class MemValue:
    """One value the memory model tracks."""

    ref: Ref | None
    tensor: TensorInfo
    category: str
    name: str


@dataclass
class Timeline:
    """Live values over one graph's program order, as events per moment: values born,
    values whose last use it is, and a scan body's transient peak set riding on top."""

    born: list[list[MemValue]]
    dies: list[list[MemValue]]
    extra: list[list[MemValue]]

    def __len__(self) -> int:
        return len(self.born)

    def live_at(self, t: int) -> list[MemValue]:
        live: dict[int, MemValue] = {}
        for i in range(t + 1):
            for mv in self.born[i]:
                live[id(mv)] = mv
            if i < t:
                for mv in self.dies[i]:
                    live.pop(id(mv), None)
        return list(live.values()) + self.extra[t]

    def totals(self, size) -> list[float]:
        """``sum(size(v))`` over the live values at every moment."""
        out = []
        running = 0.0
        for i in range(len(self.born)):
            running += sum(size(v) for v in self.born[i])
            out.append(running + sum(size(v) for v in self.extra[i]))
            running -= sum(size(v) for v in self.dies[i])
        return out

    def peak_set(self) -> list[MemValue]:
        if not self.born:
            return []
        totals = self.totals(lambda v: v.tensor.nbytes)
        return self.live_at(max(range(len(totals)), key=totals.__getitem__))


def _pad(spec: Sharding, delta: int) -> Sharding:
    return ((),) * delta + spec if delta else spec


def _synthetic(
    primitive: str, ins: Sequence[TensorInfo], outs: Sequence[TensorInfo], **params: Any
) -> Node:
    return Node(-1, primitive, (), (), tuple(ins), tuple(outs), params)


def _struct_key(node: Node) -> tuple:
    params = tuple(
        (k, repr(v)) for k, v in sorted(node.params.items()) if "jaxpr" not in k and k != "body"
    )
    return (node.primitive, node.in_tensors, node.out_tensors, node.flops, params)


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


@dataclass
class BuiltProblem:
    """A graph's sharding problem on one mesh plus what is needed to read a solution."""

    graph: Graph
    ctx: CostContext
    ops: list[Op]
    groups: list[Group]
    op_group: dict[int, tuple[int, int]]  # op -> (group, position)
    edges: list[EdgeRef]
    problem: ShardingProblem
    input_ops: dict[int, int]  # graph input index -> op
    output_refs: dict[int, Ref | None]  # graph output index -> where it comes from
    persistent: list[MemValue]
    timeline: Timeline  # live (non-persistent) values over the top-level program order
    moments: list[int]  # the moments the problem's memory constraints describe
    param_shapes: frozenset[tuple[int, ...]]
    unsupported: tuple[str, ...] = ()
    coarse_stats: dict[str, int] = field(default_factory=dict)

    # -- reading a choice -------------------------------------------------------------
    def strategy(self, op: int, choice: Sequence[int]) -> OpStrategy:
        g, pos = self.op_group[op]
        return self.groups[g].strategies[choice[g]][pos]

    def spec(self, ref: Ref, choice: Sequence[int]) -> Sharding:
        return _pad(self.strategy(ref.op, choice).outs[ref.port], ref.delta)

    def spec_of_input(self, index: int, choice: Sequence[int]) -> Sharding:
        """The layout graph input ``index`` takes."""
        return self.strategy(self.input_ops[index], choice).outs[0]

    def spec_of_output(self, index: int, choice: Sequence[int]) -> Sharding:
        """The layout graph output ``index`` comes out in: its input's, if it replaces an
        input (the step's state keeps its layout), else what its producer gives."""
        for gi in self.graph.inputs:
            if gi.output_index == index:
                return self.spec_of_input(gi.index, choice)
        ref = self.output_refs.get(index)
        if ref is None or ref.op not in self.op_group:
            return replicated(self.graph.outputs[index].tensor.ndim)
        return self.spec(ref, choice)

    def value_bytes(self, v: MemValue, choice: Sequence[int]) -> float:
        if v.ref is None or v.ref.op not in self.op_group:
            return 0.0  # constants: fused into their consumers, never materialised
        return v.tensor.nbytes / shards(self.spec(v.ref, choice), self.ctx.mesh)

    def resharded_reads(
        self, choice: Sequence[int]
    ) -> list[tuple[Op, int, Ref, Sharding, Sharding]]:
        """Every read of a value in another layout than it is made in: ``(reader op,
        operand, value, have, need)``, within groups and across them."""
        out = []
        for g, group in enumerate(self.groups):
            strats = group.strategies[choice[g]]
            for pos, oi in enumerate(group.ops):
                op = self.ops[oi]
                st = strats[pos]
                for k, ref in enumerate(op.operands):
                    if ref is None or self.op_group.get(ref.op, (-1,))[0] != g:
                        continue
                    need = st.ins[k] if k < len(st.ins) else None
                    if need is None:
                        continue
                    have = self.spec(ref, choice)
                    if have != need:
                        out.append((op, k, ref, have, need))
        for e in self.edges:
            st = self.strategy(e.op, choice)
            need = st.ins[e.operand] if e.operand < len(st.ins) else None
            if need is None:
                continue
            have = self.spec(e.ref, choice)
            if have != need:
                out.append((self.ops[e.op], e.operand, e.ref, have, need))
        return out

    def copies(self, choice: Sequence[int]) -> list[float]:
        """Bytes per device of resharded copies live at each top-level moment.

        A value read in another layout is copied into it by a collective (all-gather,
        all-to-all, permute: local slices are fused into the reader and copy nothing).
        Readers of the same value in the same layout share one copy (XLA's CSE; the
        lowering reuses it, :mod:`autopar.lower.order`), live from its first reader's
        moment to its last's. Copies made inside loop bodies are left to the body's peak.
        """
        pos = {node.id: i for i, node in enumerate(self.graph.nodes)}
        spans: dict[tuple, list[float]] = {}  # key -> [first, last, bytes]
        for op, k, ref, have, need in self.resharded_reads(choice):
            if op.kind != "node":
                continue
            top = op.node.id if not op.scope else op.scope[0][0]
            if op.scope and ref.op in self.op_group and self.ops[ref.op].scope:
                continue  # made and read inside a loop body
            t = pos.get(top)
            tensor = op.node.in_tensors[k]
            if t is None or not self.ctx.reshard(tensor.shape, tensor.dtype, have, need)[1]:
                continue
            nbytes = tensor.nbytes / shards(need, self.ctx.mesh)
            span = spans.setdefault((ref, have, need), [t, t, nbytes])
            span[0], span[1] = min(span[0], t), max(span[1], t)
        live = [0.0] * (len(self.timeline) + 1)
        for first, last, nbytes in spans.values():
            live[int(first)] += nbytes
            live[int(last) + 1] -= nbytes
        running, out = 0.0, []
        for d in live[:-1]:
            running += d
            out.append(running)
        return out

    def peak(self, choice: Sequence[int]) -> tuple[float, int, dict[str, float]]:
        """Exact peak bytes per device over every moment: (bytes, moment, breakdown).

        Resharded copies (:meth:`copies`) count as ``"resharded"``; the ILP's memory
        constraints leave them out (they depend on two layouts at once); the planner
        re-solves under a lower bound when they push a solution over
        (:func:`autopar.search.planner.solve_within_memory`)."""
        cache: dict[int, float] = {}

        def size(v: MemValue) -> float:
            b = cache.get(id(v))
            if b is None:
                b = cache[id(v)] = self.value_bytes(v, choice)
            return b

        base: dict[str, float] = {}
        for v in self.persistent:
            base[v.category] = base.get(v.category, 0.0) + size(v)
        totals = self.timeline.totals(size)
        if not totals:
            return sum(base.values()), 0, base
        copies = self.copies(choice)
        totals = [a + b for a, b in zip(totals, copies, strict=True)]
        t = max(range(len(totals)), key=totals.__getitem__)
        bd = dict(base)
        for v in self.timeline.live_at(t):
            bd[v.category] = bd.get(v.category, 0.0) + size(v)
        if copies[t]:
            bd["resharded"] = copies[t]
        return sum(base.values()) + totals[t], t, bd

    def memory_constraint(self, moment: int) -> MemoryConstraint:
        """The linear memory constraint of one moment (persistent + live values)."""
        return _constraint(self, moment)

    def with_memory_limit(self, limit: float | None) -> BuiltProblem:
        """The same problem with another bound on its memory constraints."""
        p = self.problem
        problem = ShardingProblem(p.nodes, p.edges, p.memory, limit, p.aliases, p.meta, p.shared)
        return BuiltProblem(**{**self.__dict__, "problem": problem})

    def with_moments(self, moments: Sequence[int]) -> BuiltProblem:
        """The same problem with memory constraints at ``moments`` (added lazily)."""
        cons = tuple(_constraint(self, t) for t in moments)
        p = self.problem
        problem = ShardingProblem(
            p.nodes, p.edges, cons, p.memory_limit, p.aliases, p.meta, p.shared
        )
        out = BuiltProblem(**{**self.__dict__, "problem": problem, "moments": list(moments)})
        return out


def _constraint(bp: BuiltProblem, moment: int) -> MemoryConstraint:
    constant = 0.0
    terms: dict[int, list[float]] = {}
    values = list(bp.persistent) + (bp.timeline.live_at(moment) if len(bp.timeline) else [])
    cache: dict[tuple, list[float]] = {}
    mesh = bp.ctx.mesh
    for v in values:
        if v.ref is None or v.ref.op not in bp.op_group:
            continue  # constants: see BuiltProblem.value_bytes
        g, pos = bp.op_group[v.ref.op]
        group = bp.groups[g]
        key = (id(group.strategies), pos, v.ref.port, v.ref.delta, v.tensor.nbytes)
        per = cache.get(key)
        if per is None:
            per = cache[key] = [
                v.tensor.nbytes / shards(_pad(st[pos].outs[v.ref.port], v.ref.delta), mesh)
                for st in group.strategies
            ]
        vec = terms.get(g)
        if vec is None:
            terms[g] = list(per)
        else:
            for s, b in enumerate(per):
                vec[s] += b
    # A term equal for every strategy is a constant.
    out_terms = []
    for g, vec in sorted(terms.items()):
        lo = min(vec)
        constant += lo
        if max(vec) - lo > 0:
            out_terms.append((g, tuple(b - lo for b in vec)))
    return MemoryConstraint(f"moment {moment}", constant, tuple(out_terms))


_PROPAGATED = frozenset({"forward", "backward"})


class ProblemBuilder:
    """Builds the :class:`BuiltProblem` of one graph on one mesh.

    Args:
        graph: the traced step.
        ctx: prices on the mesh.
        fixed_inputs: graph input index -> the only sharding it may take.
        constraints: ``(scope, node id, output)`` -> pinned sharding of that value.
        input_axes: graph input index -> the axes its sharding may use.
        tie_optimizer_state: a parameter and its optimizer state take one sharding.
        coarsen: merge followers into groups and tie identical layers.
        memory_limit: bytes per device for the problem's constraints.
        replication_penalty_s: objective seconds charged to a forward or backward op per
            unit of the fraction of its work each device does (1 replicated, 1/n split n
            ways). :func:`~autopar.search.evaluate.evaluate_plan` sets it to complete a
            partial plan the way XLA's sharding propagation does: a value keeps the
            partitioning it inherits rather than being gathered to save a collective.
            Reported times never include it.
    """

    def __init__(
        self,
        graph: Graph,
        ctx: CostContext,
        *,
        fixed_inputs: Mapping[int, Sharding] | None = None,
        constraints: Mapping[tuple[Scope, int, int], Sharding] | None = None,
        input_axes: Mapping[int, Sequence[str]] | None = None,
        tie_optimizer_state: bool = True,
        coarsen: bool = True,
        memory_limit: float | None = None,
        num_moments: int = 4,
        replication_penalty_s: float = 0.0,
    ) -> None:
        self.graph = graph
        self.replication_penalty_s = float(replication_penalty_s)
        self.ctx = ctx
        self.fixed_inputs = dict(fixed_inputs or {})
        self.constraints = dict(constraints or {})
        self.input_axes = dict(input_axes or {})
        self.tie = tie_optimizer_state
        self.coarsen = coarsen
        self.memory_limit = memory_limit
        self.num_moments = num_moments
        self.ops: list[Op] = []
        self.envs: dict[Scope, dict[int, Ref]] = {}
        self.input_ops: dict[int, int] = {}
        self.output_refs: dict[int, Ref | None] = {}
        self.unsupported: set[str] = set()
        self._enum_cache: dict[tuple, list[OpStrategy]] = {}
        self._follow_cache: dict[tuple, OpStrategy] = {}
        self._keys: dict[int, tuple] = {}
        self._layer_of_op: dict[int, tuple[int, int]] = {}
        self._restrict: dict[int, dict[int, Sharding]] = {}  # leader op -> pinned results
        self.param_shapes = frozenset(
            shape
            for gi in graph.inputs
            if gi.role in ("param", "model_state")
            for shape in (gi.tensor.shape, gi.tensor.shape[1:])
        )
        self.eta = float(ctx.cluster.overlap_efficiency)
        self._grad_cache: dict[int, bool] = {}
        self._spec_cache: dict[int, list[Sharding]] = {}
        self._class_cache: dict[tuple, tuple[tuple[int, ...], tuple]] = {}
        self._matrix_cache: dict[tuple, tuple] = {}
        self._no_shard: dict[int, set[int]] = {}  # graph input -> dims kept whole

    # -- 1. flatten -----------------------------------------------------------------------
    def _new_op(
        self, kind: str, node: Node, scope: Scope, weight: float, operands, name: str, **kw
    ) -> Op:
        op = Op(len(self.ops), kind, node, scope, weight, list(operands), name, **kw)
        self.ops.append(op)
        return op

    def _flatten(self) -> None:
        g = self.graph
        env: dict[int, Ref] = {}
        for gi in g.inputs:
            syn = _synthetic("input", (), (gi.tensor,))
            op = self._new_op("input", syn, (), 1.0, [], gi.path, input=gi, root_role=gi.role)
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
                syn = _synthetic("output", (go.tensor,), ())
                self._new_op("output", syn, (), 1.0, [ref], go.path, input=gi)

    def _walk(self, graph: Graph, scope: Scope, weight: float, env: dict[int, Ref]) -> None:
        io = hbm_io(graph)
        for node in graph.nodes:
            if node.primitive == "scan" and self._scan_ok(node):
                self._scan(node, scope, weight, env)
                continue
            operands = [env.get(v) if v >= 0 else None for v in node.inputs]
            depends = any(r is not None and self.ops[r.op].depends for r in operands)
            op = self._new_op(
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
            if node.layer is not None and not scope:
                self._layer_of_op[op.index] = (node.layer, node.id)
            if node.primitive not in FOLLOWABLE and node.primitive not in _KNOWN:
                self.unsupported.add(node.primitive)
            for port, v in enumerate(node.outputs):
                env[v] = self._constrain(
                    Ref(op.index, port), scope, node.id, port, node.out_tensors[port], weight, op
                )

    def _constrain(
        self,
        ref: Ref,
        scope: Scope,
        node_id: int,
        port: int,
        tensor: TensorInfo,
        weight: float,
        src: Op,
    ) -> Ref:
        spec = self.constraints.get((scope, node_id, port))
        if spec is None:
            return ref
        if ref.delta == 0 and src.kind == "node" and self._main_operand(src) is None:
            # A group leader: pinning its result restricts its strategies (the same model
            # the planner solved), unless none of them produces that layout.
            if any(st.outs[port] == spec for st in self._leader_strategies(src)):
                self._restrict.setdefault(src.index, {})[port] = spec
                return ref
        syn = _synthetic("constraint", (tensor,), (tensor,), spec=spec)
        c = self._new_op(
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

    @staticmethod
    def _scan_ok(node: Node) -> bool:
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

    def _scan(self, node: Node, scope: Scope, weight: float, env: dict[int, Ref]) -> None:
        body = node.body[0]
        length = int(node.params.get("length") or node.length or 1)
        nc, ncar = int(node.params["num_consts"]), int(node.params["num_carry"])
        bscope = scope + ((node.id, 0),)
        bweight = weight * length
        benv: dict[int, Ref] = {}
        carry_ops: list[Op] = []
        for i, bi in enumerate(sorted(body.inputs, key=lambda x: x.index)):
            v = node.inputs[i]
            outer = env.get(v) if v >= 0 else None
            lead = 1 if i >= nc + ncar else 0
            if lead and outer is not None and self.ops[outer.op].kind == "input":
                # Stacked layer parameters: a layer-sharded stack would be all-gathered
                # whole before the loop; keep the scanned dim whole from the start.
                self._no_shard.setdefault(self.ops[outer.op].input.index, set()).add(0)
            ins = [node.in_tensors[i]]
            operands: list[Ref | None] = [outer]
            if nc <= i < nc + ncar:
                ins.append(bi.tensor)
                operands.append(None)  # the carry-out, filled once the body is walked
            syn = _synthetic("body_input", ins, (bi.tensor,), lead=lead)
            root = self.ops[outer.op] if outer is not None else None
            op = self._new_op(
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
                carry_ops.append(op)
            benv[bi.value] = Ref(op.index, 0)
        self._walk(body, bscope, bweight, benv)
        self.envs[bscope] = benv
        for j, bo in enumerate(sorted(body.outputs, key=lambda x: x.index)):
            r = benv.get(bo.value)
            if j < ncar:
                carry_ops[j].operands[1] = r
            if r is None:
                continue
            ref = Ref(r.op, r.port, r.delta + (0 if j < ncar else 1))
            env[node.outputs[j]] = self._constrain(
                ref, scope, node.id, j, node.out_tensors[j], weight, self.ops[r.op]
            )

    # -- 2. coarsen ---------------------------------------------------------------------
    def _weak(self, ref: Ref) -> bool:
        op = self.ops[ref.op]
        if not op.depends:
            return True
        return op.kind == "node" and op.node.primitive in ("broadcast_in_dim", "iota")

    def _main_operand(self, op: Op) -> int | None:
        """The operand ``op`` takes its layout from, or ``None`` (``op`` leads a group)."""
        if not self.coarsen:
            return None
        if op.kind == "body_input":
            # A loop input takes the layout of what enters the loop (XLA gives a while
            # loop's operand, body parameter and result one sharding).
            ref = op.operands[0]
            return 0 if ref is not None and self._grouped(ref) else None
        if op.kind != "node" or op.node.primitive not in FOLLOWABLE:
            return None
        best, best_key = None, None
        for k, ref in enumerate(op.operands):
            if ref is None or not self._grouped(ref):
                continue
            t = op.node.in_tensors[k]
            if t.ndim == 0 or not can_follow(op.node, k):
                continue
            # Prefer a real (not constant) operand of full rank and of the result's size
            # (``x`` over ``mean`` in ``x - mean``: its layout carries more).
            key = (not self._weak(ref), t.ndim, t.size, t.dtype != "bool", -k)
            if best_key is None or key > best_key:
                best, best_key = k, key
        return best

    def _grouped(self, ref: Ref) -> bool:
        """Constants (ops that read no graph input) get no group: XLA materialises them in
        whatever layout their consumer wants, for free."""
        return self.ops[ref.op].depends

    def _group(self) -> tuple[list[Group], dict[int, tuple[int, int]]]:
        groups: list[Group] = []
        where: dict[int, tuple[int, int]] = {}
        for op in self.ops:
            if not op.depends and op.kind in ("node", "body_input"):
                continue
            main = self._main_operand(op)
            if main is not None:
                gi, _ = where[op.operands[main].op]
                g = groups[gi]
                g.follow[op.index] = main
                where[op.index] = (gi, len(g.ops))
                g.ops.append(op.index)
            else:
                where[op.index] = (len(groups), 0)
                groups.append(Group(len(groups), [op.index]))
        # Reads of constants are free: drop them.
        for op in self.ops:
            op.operands = [r if r is None or r.op in where else None for r in op.operands]
        return groups, where

    # -- 3. strategies --------------------------------------------------------------------
    def _key(self, op: Op) -> tuple:
        k = self._keys.get(op.index)
        if k is None:
            k = self._keys[op.index] = (_struct_key(op.node), op.io)
        return k

    def _input_specs(self, gi: GraphInput) -> list[Sharding]:
        hit = self._spec_cache.get(gi.index)
        if hit is None:
            hit = self._spec_cache[gi.index] = self._compute_input_specs(gi)
        return hit

    def _compute_input_specs(self, gi: GraphInput) -> list[Sharding]:
        fixed = self.fixed_inputs.get(gi.index)
        if fixed is not None:
            return [fixed]
        axes = self.input_axes.get(gi.index)
        whole = self._no_shard.get(gi.index, set())
        dims = [d for d in range(gi.tensor.ndim) if d not in whole]
        return enumerate_shardings(gi.tensor.shape, self.ctx.mesh, axes, dims)

    def _leader_strategies(self, op: Op) -> list[OpStrategy]:
        if op.kind == "node":
            key = self._key(op)
            hit = self._enum_cache.get(key)
            if hit is None:
                hit = self._enum_cache[key] = enumerate_strategies(op.node, self.ctx, op.io)
            pinned = self._restrict.get(op.index)
            if pinned:
                hit = [st for st in hit if all(st.outs[p] == s for p, s in pinned.items())]
            return hit
        if op.kind == "input":
            out = []
            for s in self._input_specs(op.input):
                # Batch data is written into device memory every step: sharding it
                # writes less (and breaks ties towards sharded inputs).
                cost = 0.0
                if op.input.role in ("batch", "other"):
                    t = op.input.tensor
                    cost = self.ctx.compute(
                        0.0, t.nbytes / shards(s, self.ctx.mesh), t.dtype, "other"
                    )
                out.append(OpStrategy(format_sharding(s), (), (s,), cost))
            return out
        if op.kind == "output":
            return [
                OpStrategy(format_sharding(s), (s,), (), 0.0) for s in self._input_specs(op.input)
            ]
        if op.kind == "constraint":
            s = op.node.params["spec"]
            return [OpStrategy("pinned " + format_sharding(s), (s,), (s,), 0.0)]
        if op.kind == "body_input":
            lead = op.node.params["lead"]
            carry = len(op.node.in_tensors) == 2
            out = []
            for s in enumerate_shardings(op.node.out_tensors[0].shape, self.ctx.mesh):
                ins = (_pad(s, lead), s) if carry else (_pad(s, lead),)
                out.append(OpStrategy(format_sharding(s), ins, (s,), 0.0))
            return out
        raise AssertionError(op.kind)

    def _follow(self, op: Op, k: int, spec: Sharding) -> OpStrategy:
        if op.kind == "body_input":
            lead = op.node.params["lead"]
            kept = ((),) * lead + spec[lead:]  # the scanned dim is sliced: never sharded
            body = spec[lead:]
            ins = (kept, body) if len(op.node.in_tensors) == 2 else (kept,)
            return OpStrategy(format_sharding(body), ins, (body,), 0.0)
        key = (self._key(op), k, spec)
        hit = self._follow_cache.get(key)
        if hit is None:
            hit = self._follow_cache[key] = follow_strategy(op.node, k, spec, self.ctx, op.io)
        return hit

    def _grad_op(self, op: Op) -> bool:
        """A backward op whose result has a parameter's shape: its partial sums are
        gradient reductions (class ``dp_grad``, see :func:`collective_class`)."""
        hit = self._grad_cache.get(op.index)
        if hit is None:
            hit = op.phase == "backward" and any(
                t.shape in self.param_shapes for t in op.node.out_tensors
            )
            self._grad_cache[op.index] = hit
        return hit

    def _strategy_cost(self, op: Op, st: OpStrategy) -> tuple[float, tuple[Charge, ...]]:
        """Compute plus the strategy's collectives, weighted as the objective counts them
        (:func:`objective_weight` of :func:`collective_class`), and the combined
        collectives it joins: a gradient reduction pays its bandwidth part here and its
        latency once per scope, as a shared cost (:data:`Charge`)."""
        compute = st.compute_s + self._replication_penalty(op, st)
        if not st.comm:
            return compute, ()
        if not self._grad_op(op):
            return compute + st.comm_s, ()
        cost = compute
        charges = []
        for c in st.comm:
            lat = self.ctx.latency(c.kind, c.axes)
            cost += (1.0 - self.eta) * (c.time_s - lat)
            charges.append((op.scope, c.kind, c.axes, op.weight, lat))
        return cost, tuple(charges)

    def _replication_penalty(self, op: Op, st: OpStrategy) -> float:
        if not self.replication_penalty_s or op.kind != "node" or op.phase not in _PROPAGATED:
            return 0.0
        node = op.node
        if any(t.shape in self.param_shapes for t in node.out_tensors):
            return 0.0  # parameter-shaped work (casts, gradients) follows the state's layout
        if node.flops > 0:
            fraction = st.flops / node.flops
        elif st.outs and node.out_tensors and node.out_tensors[0].ndim:
            fraction = 1.0 / shards(st.outs[0], self.ctx.mesh)
        else:
            return 0.0
        return self.replication_penalty_s * fraction

    def _reshard_cost(
        self, t: TensorInfo, have: Sharding, need: Sharding, source: Op, into_state: bool = False
    ) -> float:
        """Resharding time, weighted: moving a parameter or optimizer state out of its
        stored layout, or an update into it (``into_state``: ZeRO's parameter all-gather),
        is an overlappable FSDP gather; anything else is exposed."""
        overlappable = into_state or source.root_role in _STATE_ROLES
        factor = 1.0 - self.eta if overlappable else 1.0
        return factor * self.ctx.reshard(t.shape, t.dtype, have, need)[0]

    def _op_signature(self, op: Op) -> tuple:
        if op.kind == "node":
            return (self._key(op), tuple(sorted(self._restrict.get(op.index, {}).items())))
        if op.kind in ("input", "output"):
            return (op.kind, op.input.tensor, op.input.role, tuple(self._input_specs(op.input)))
        if op.kind == "constraint":
            return (op.kind, op.node.in_tensors, op.node.params["spec"])
        return (op.kind, op.node.in_tensors, op.node.out_tensors, op.node.params["lead"])

    def _group_signature(self, g: Group, where: dict[int, tuple[int, int]]) -> tuple:
        """Everything pricing a group depends on: equal signatures (the same block in
        another layer) price identically, so they are priced once."""
        sig: list = [self.ops[g.ops[0]].root_role, self.ops[g.ops[0]].scope]
        for oi in g.ops:
            op = self.ops[oi]
            internal = tuple(
                (k, where[ref.op][1], ref.port, ref.delta, self.ops[ref.op].weight)
                for k, ref in enumerate(op.operands)
                if ref is not None and where[ref.op][0] == g.index
            )
            sig.append(
                (
                    self._op_signature(op),
                    op.weight,
                    self._grad_op(op),
                    g.follow.get(oi),
                    internal,
                    op.phase if self.replication_penalty_s else None,
                )
            )
        return tuple(sig)

    def _price_groups(self, groups: list[Group], where: dict[int, tuple[int, int]]) -> None:
        cache: dict[tuple, tuple[list, list]] = {}
        for g in groups:
            sig = self._group_signature(g, where)
            hit = cache.get(sig)
            if hit is not None:
                g.strategies, g.costs, g.compute, g.charges = hit
                continue
            self._price_group(g, where)
            cache[sig] = (g.strategies, g.costs, g.compute, g.charges)

    def _price_group(self, g: Group, where: dict[int, tuple[int, int]]) -> None:
        leader = self.ops[g.ops[0]]
        ops = [self.ops[oi] for oi in g.ops]
        pos_of = {oi: pos for pos, oi in enumerate(g.ops)}
        # Per op: (operand k, producer position, port, delta, weight) of reads in the group.
        internal = [
            [
                (k, pos_of[ref.op], ref.port, ref.delta, min(op.weight, self.ops[ref.op].weight))
                for k, ref in enumerate(op.operands)
                if ref is not None and where[ref.op][0] == g.index
            ]
            for op in ops
        ]
        mains = [None] + [
            (g.follow[oi], pos_of[ops[p].operands[g.follow[oi]].op], ops[p].operands[g.follow[oi]])
            for p, oi in enumerate(g.ops)
            if p > 0
        ]
        memo: list[dict] = [{} for _ in ops]  # per follower: main layout -> (strategy, cost)
        for lead in self._leader_strategies(leader):
            strats: list[OpStrategy] = [lead]
            lead_cost, charges = self._strategy_cost(leader, lead)
            cost = leader.weight * lead_cost
            compute = leader.weight * lead.compute_s
            for pos in range(1, len(ops)):
                k, ppos, ref = mains[pos]
                spec = strats[ppos].outs[ref.port]
                hit = memo[pos].get(spec)
                if hit is None:
                    op = ops[pos]
                    st = self._follow(op, k, _pad(spec, ref.delta))
                    op_cost, op_charges = self._strategy_cost(op, st)
                    hit = memo[pos][spec] = (
                        st,
                        op.weight * op_cost,
                        op.weight * st.compute_s,
                        op_charges,
                    )
                strats.append(hit[0])
                cost += hit[1]
                compute += hit[2]
                charges += hit[3]
            # Reads inside the group: free when layouts agree, else a resharding.
            for pos, reads in enumerate(internal):
                st = strats[pos]
                for k, ppos, port, delta, w in reads:
                    need = st.ins[k] if k < len(st.ins) else None
                    if need is None:
                        continue
                    have = _pad(strats[ppos].outs[port], delta)
                    if have != need:
                        t = ops[pos].node.in_tensors[k]
                        cost += w * self._reshard_cost(t, have, need, leader)
            g.strategies.append(strats)
            g.costs.append(cost)
            g.compute.append(compute)
            g.charges.append(tuple(dict.fromkeys(charges)))

    # -- edges --------------------------------------------------------------------------
    def _edges(
        self, groups: list[Group], where: dict[int, tuple[int, int]]
    ) -> tuple[list[ProblemEdge], list[EdgeRef]]:
        edges: list[ProblemEdge] = []
        refs: list[EdgeRef] = []
        for op in self.ops:
            if op.index not in where:
                continue  # a constant
            gc, pc = where[op.index]
            cons = groups[gc]
            for k, ref in enumerate(op.operands):
                if ref is None:
                    continue
                gp, pp = where[ref.op]
                if gp == gc:
                    continue
                prod = groups[gp]
                dst_cls, dst_keys = self._classes(
                    ("in", id(cons.strategies), pc, k),
                    [s[pc].ins[k] if k < len(s[pc].ins) else None for s in cons.strategies]
                    if ("in", id(cons.strategies), pc, k) not in self._class_cache
                    else None,
                )
                if all(n is None for n in dst_keys):
                    continue
                src_cls, src_keys = self._classes(
                    ("out", id(prod.strategies), pp, ref.port, ref.delta),
                    [_pad(s[pp].outs[ref.port], ref.delta) for s in prod.strategies]
                    if ("out", id(prod.strategies), pp, ref.port, ref.delta)
                    not in self._class_cache
                    else None,
                )
                t = op.node.in_tensors[k]
                w = min(op.weight, self.ops[ref.op].weight)
                source = self.ops[prod.ops[0]]
                into_state = feeds_state_update(op, self.ops[cons.ops[0]])
                fsdp = source.root_role in _STATE_ROLES or into_state
                mkey = (t.shape, t.dtype, src_keys, dst_keys, w, fsdp)
                mat = self._matrix_cache.get(mkey)
                if mat is None:
                    mat = tuple(
                        tuple(
                            0.0
                            if n is None
                            else w * self._reshard_cost(t, h, n, source, into_state)
                            for n in dst_keys
                        )
                        for h in src_keys
                    )
                    self._matrix_cache[mkey] = mat
                refs.append(EdgeRef(op.index, k, ref, len(edges)))
                edges.append(
                    ProblemEdge(
                        gp,
                        gc,
                        src_cls,
                        dst_cls,
                        mat,
                        f"{self.ops[ref.op].name} -> {op.name}",
                    )
                )
        return edges, refs

    def _classes(self, key: tuple, layouts: list | None) -> tuple[tuple[int, ...], tuple]:
        """Distinct layouts of one port over a group's strategies: (class per strategy,
        the layouts). Groups priced once share strategy lists, hence the cache by id."""
        hit = self._class_cache.get(key)
        if hit is None:
            index: dict = {}
            cls = tuple(index.setdefault(h, len(index)) for h in layouts)
            hit = self._class_cache[key] = (cls, tuple(index))
        return hit

    # -- aliases ------------------------------------------------------------------------
    def _families(self) -> dict[int, int]:
        """Graph input index -> the input whose sharding it shares (a parameter and its
        optimizer state), and the union of their layout restrictions."""
        g = self.graph
        family = {gi.index: gi.index for gi in g.inputs}
        if self.tie:
            for p, states in match_optimizer_state(g).items():
                for s in states:
                    same_fix = self.fixed_inputs.get(s) == self.fixed_inputs.get(p)
                    same_axes = self.input_axes.get(s) == self.input_axes.get(p)
                    if same_fix and same_axes:
                        family[s] = p
        members: dict[int, list[int]] = {}
        for i, root in family.items():
            members.setdefault(root, []).append(i)
        for group in members.values():
            whole = set().union(*(self._no_shard.get(i, set()) for i in group))
            for i in group:
                self._no_shard[i] = whole
        return family

    def _aliases(self, where: dict[int, tuple[int, int]]) -> list[tuple[int, ...]]:
        sets: dict[int, set[int]] = {}  # family root -> its groups (inputs and output sinks)
        for gi in self.graph.inputs:
            sets.setdefault(self._family[gi.index], set()).add(where[self.input_ops[gi.index]][0])
        for op in self.ops:
            if op.kind == "output":
                sets.setdefault(self._family[op.input.index], set()).add(where[op.index][0])
        return [tuple(sorted(s)) for s in sets.values() if len(s) > 1]

    def _layer_ties(
        self, groups: list[Group], where: dict[int, tuple[int, int]]
    ) -> list[tuple[int, ...]]:
        """Alias the groups of structurally identical unrolled layers to one representative."""
        if not self.coarsen or not self.graph.layers:
            return []
        by_sig: dict[str, list] = {}
        for layer in self.graph.layers:
            if layer.signature and layer.kind != "scan":
                by_sig.setdefault(layer.signature, []).append(layer)
        node_op = {nid: oi for oi, (_, nid) in self._layer_of_op.items()}
        ties: list[tuple[int, ...]] = []
        for layers in by_sig.values():
            if len(layers) < 2:
                continue
            rep = layers[0]
            for other in layers[1:]:
                if len(other.nodes) != len(rep.nodes):
                    continue
                for a, b in zip(rep.nodes, other.nodes, strict=True):
                    oa, ob = node_op.get(a), node_op.get(b)
                    if oa is None or ob is None or oa not in where or ob not in where:
                        continue
                    if self._key(self.ops[oa]) != self._key(self.ops[ob]):
                        continue
                    ga, pa = where[oa]
                    gb, pb = where[ob]
                    # Tie leaders (followers come along) ...
                    if pa == 0 and pb == 0 and ga != gb and _same_layouts(groups[ga], groups[gb]):
                        ties.append((ga, gb))
                    # ... and the inputs any op of the layer reads (its parameters).
                    for ra, rb in zip(self.ops[oa].operands, self.ops[ob].operands, strict=True):
                        if ra is None or rb is None:
                            continue
                        ia, ib = self.ops[ra.op], self.ops[rb.op]
                        if (
                            ia.kind == "input"
                            and ib.kind == "input"
                            and ia.index in where
                            and ib.index in where
                        ):
                            gia, gib = where[ia.index][0], where[ib.index][0]
                            if gia != gib and _same_layouts(groups[gia], groups[gib]):
                                ties.append((gia, gib))
        return ties

    # -- 4. memory --------------------------------------------------------------------------
    def _memory(self) -> tuple[list[MemValue], Timeline]:
        g = self.graph
        persistent = []
        for gi in g.inputs:
            ref = Ref(self.input_ops[gi.index], 0)
            persistent.append(MemValue(ref, gi.tensor, _ROLE_CATEGORY[gi.role], gi.path))
        donated = {
            g.outputs[gi.output_index].value
            for gi in g.inputs
            if gi.output_index is not None and gi.output_index < len(g.outputs)
        }
        inputs = {gi.value for gi in g.inputs}
        return persistent, self._liveness(g, (), skip=donated | inputs)

    def _liveness(self, graph: Graph, scope: Scope, *, skip: set[int]) -> Timeline:
        env = self.envs.get(scope, {})
        nodes = graph.nodes
        n = len(nodes)
        pos = {node.id: i for i, node in enumerate(nodes)}
        out_values = {o.value for o in graph.outputs}
        born: list[list[MemValue]] = [[] for _ in range(n)]
        dies: list[list[MemValue]] = [[] for _ in range(n)]
        extra: list[list[MemValue]] = [[] for _ in range(n)]
        # A value fused into its consumer (fusion.materialised_values) never occupies
        # memory; the fusion runs when its consumer does, so the inputs it reads stay live
        # until then. ``runs[i]``: the position at which node i's work happens.
        stored = materialised_values(graph)
        runs = list(range(n))
        for i in range(n - 1, -1, -1):
            node = nodes[i]
            if node.outputs and not any(v in stored for v in node.outputs):
                runs[i] = max(
                    (runs[pos[c]] for v in node.outputs for c in graph.consumers.get(v, ())),
                    default=i,
                )
        for i, node in enumerate(nodes):
            for port, v in enumerate(node.outputs):
                if v in skip or v not in stored:
                    continue
                users = graph.consumers.get(v, ())  # nodes of this graph
                end = n - 1 if v in out_values else max((runs[pos[c]] for c in users), default=i)
                cat = "activations"
                if node.phase == "backward" and any(
                    nodes[pos[c]].phase == "optimizer" for c in users
                ):
                    cat = "grads"
                mv = MemValue(env.get(v), node.out_tensors[port], cat, f"{node.name_stack}:{port}")
                born[i].append(mv)
                dies[end].append(mv)
            if node.primitive == "scan" and self._scan_ok(node):
                body = node.body[0]
                inner = self._liveness(
                    body, scope + ((node.id, 0),), skip={b.value for b in body.inputs}
                )
                extra[i] = inner.peak_set()
        return Timeline(born, dies, extra)

    # -- build --------------------------------------------------------------------------
    def build(self) -> BuiltProblem:
        # Building allocates hundreds of thousands of small objects that stay alive; the
        # cyclic GC would rescan them over and over (a third of the build time at 96
        # layers). They hold no cycles that need collecting mid-build.
        enabled = gc.isenabled()
        gc.disable()
        try:
            return self._build()
        finally:
            if enabled:
                gc.enable()

    def _build(self) -> BuiltProblem:
        self._flatten()
        self._family = self._families()
        groups, where = self._group()
        for op in self.ops:  # what a scan-body input reads, traced back to a graph input
            if op.kind == "body_input" and op.operands[0] is not None:
                leader = self.ops[groups[where[op.operands[0].op][0]].ops[0]]
                op.root_role = leader.root_role
        self._price_groups(groups, where)
        edges, edge_refs = self._edges(groups, where)
        aliases = self._aliases(where) + self._layer_ties(groups, where)
        aliases = _merge_sets(aliases)
        persistent, timeline = self._memory()
        nodes = tuple(
            ProblemNode(
                self.ops[g.ops[0]].name or self.ops[g.ops[0]].node.primitive,
                tuple(g.costs),
                tuple(s[0].name for s in g.strategies),
            )
            for g in groups
        )
        problem = ShardingProblem(
            nodes,
            tuple(edges),
            (),
            self.memory_limit,
            tuple(aliases),
            {"mesh": self.ctx.mesh_dict},
            _shared_costs(groups, self.eta),
        )
        stats = {
            "ops": len(self.ops),
            "graph_nodes": _count_nodes(self.graph),
            "groups": len(groups),
        }
        bp = BuiltProblem(
            self.graph,
            self.ctx,
            self.ops,
            groups,
            where,
            edge_refs,
            problem,
            self.input_ops,
            self.output_refs,
            persistent,
            timeline,
            [],
            self.param_shapes,
            tuple(sorted(self.unsupported)),
            stats,
        )
        return bp.with_moments(_pick_moments(timeline, self.num_moments))


_KNOWN = frozenset(
    [
        "dot_general",
        "conv_general_dilated",
        "gather",
        "iota",
        "scan",
        "scatter-add",
        "scatter_add",
        "scatter",
        "scatter-mul",
        "scatter_mul",
    ]
)


def _shared_costs(groups: list[Group], eta: float) -> tuple[SharedCost, ...]:
    """One shared cost per combined gradient reduction (:data:`Charge`): its latency,
    weighted like the gradient reductions it merges, paid once if any member strategy is
    chosen."""
    members: dict[Charge, dict[int, list[int]]] = {}
    for gi, g in enumerate(groups):
        for s, charges in enumerate(g.charges):
            for ch in charges:
                members.setdefault(ch, {}).setdefault(gi, []).append(s)
    out = []
    for (scope, kind, axes, weight, lat), by_group in members.items():
        where = f" in scan {scope[-1][0]}" if scope else ""
        out.append(
            SharedCost(
                f"combined {kind} over {','.join(axes)}{where}",
                weight * (1.0 - eta) * lat,
                tuple((gi, tuple(ss)) for gi, ss in sorted(by_group.items())),
            )
        )
    return tuple(out)


def _same_layouts(a: Group, b: Group) -> bool:
    """Whether two groups' strategy lists line up index by index (safe to alias)."""
    if len(a.strategies) != len(b.strategies):
        return False
    return all(
        x[0].outs == y[0].outs and x[0].ins == y[0].ins
        for x, y in zip(a.strategies, b.strategies, strict=True)
    )


def _count_nodes(graph: Graph) -> int:
    total = 0
    for n in graph.nodes:
        total += 1
        for b in n.body:
            total += _count_nodes(b)
    return total


def _merge_sets(sets: list[tuple[int, ...]]) -> list[tuple[int, ...]]:
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


def _pick_moments(timeline: Timeline, k: int) -> list[int]:
    """The ``k`` largest moments of the replicated profile, spread apart."""
    if not len(timeline):
        return []
    totals = timeline.totals(lambda v: v.tensor.nbytes)
    gap = max(1, len(totals) // 20)
    picked: list[int] = []
    for i in sorted(range(len(totals)), key=lambda i: -totals[i]):
        if all(abs(i - j) >= gap for j in picked):
            picked.append(i)
        if len(picked) >= k:
            break
    return sorted(picked)


HIDEABLE = ("dp_grad", "fsdp_gather")
"""Communication classes that overlap with compute (``cost_models.overlap``)."""


_STATE_ROLES = ("param", "opt_state")


def feeds_state_update(op: Op, consumer_leader: Op) -> bool:
    """Whether ``op`` is optimizer work on a parameter or optimizer-state input (its
    group is led by that input): a value resharded into it is the update's way into the
    stored layout (ZeRO's gather of the updated parameters)."""
    return op.phase == "optimizer" and consumer_leader.root_role in _STATE_ROLES


def collective_class(
    param_shapes: frozenset[tuple[int, ...]],
    coll: Collective,
    *,
    op: Op,
    source: Op | None,
    rename: Mapping[str, str] | None = None,
    dest: Op | None = None,
) -> str:
    """Which ``compose_step_time`` class a collective belongs to.

    Partial sums of a backward op whose result has a parameter's shape are gradient
    reductions (``dp_grad``); moving a parameter or optimizer state out of its stored
    layout, or an update into it (``dest``: the consumer's group leader, see
    :func:`feeds_state_update`), is an FSDP gather (``fsdp_gather``); the rest is named
    after the mesh axes it runs over (``seq``, ``expert``, ``tensor``), strategy
    collectives default to ``tensor`` and edge reshardings to ``reshard``.
    """
    rename = rename or {}
    names = {rename.get(a, a) for a in coll.axes}
    if source is None:  # a strategy's own collective
        if op.phase == "backward" and any(t.shape in param_shapes for t in op.node.out_tensors):
            return "dp_grad"
    elif source.root_role in _STATE_ROLES or (dest is not None and feeds_state_update(op, dest)):
        return "fsdp_gather"
    for cls in ("seq", "expert", "tensor"):
        if cls in names:
            return cls
    return "tensor" if source is None else "reshard"


def objective_weight(cls: str, overlap_efficiency: float) -> float:
    """How much one second of a class counts in the ILP objective: gradient reductions
    and parameter gathers overlap with compute, so only ``1 - overlap_efficiency`` of
    them is expected on the critical path; everything else counts in full."""
    return 1.0 - overlap_efficiency if cls in HIDEABLE else 1.0


__all__ = [
    "BuiltProblem",
    "ProblemBuilder",
    "Ref",
    "collective_class",
    "match_optimizer_state",
    "objective_weight",
]
