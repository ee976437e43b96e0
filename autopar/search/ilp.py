"""Graph -> :class:`BuiltProblem`: assemble the ILP from the build stages.

``flatten -> coarsen -> price -> memory`` (:mod:`autopar.search.build`), each a module
handing a frozen record to the next; this module only assembles them into a
:class:`~autopar.search.problem.ShardingProblem` plus what is needed to read a solution
back (:class:`BuiltProblem`). Every cost in the problem comes from
:mod:`autopar.search.pricing`, so ``problem.objective(choice)`` is the step time that
:func:`autopar.search.pricing.price_choice` reports for ``choice``.

Example:
    >>> import math
    >>> from autopar.search.pricing import price_choice
    >>> bp = build(graph, CostContext(cluster, {"data": 8}))
    >>> len(bp.ops), bp.problem.size["nodes"] == len(bp.groups) < len(bp.ops)
    (139, True)
    >>> choice = [0] * len(bp.groups)   # the first strategy of every group
    >>> math.isclose(bp.problem.objective(choice), price_choice(bp, choice).step_time_s)
    True
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from autopar.gc_pause import gc_paused
from autopar.search.batch_ties import batch_ties
from autopar.search.build import memory
from autopar.search.build.catalog import StrategyCatalog, struct_key
from autopar.search.build.coarsen import (
    coarsen,
    match_optimizer_state,
    merge_sets,
    state_aliases,
    tie_layers,
)
from autopar.search.build.flatten import flatten
from autopar.search.build.memory import Timeline
from autopar.search.build.price import price
from autopar.search.build.records import EdgeRef, Group, MemValue, Op, Ref, Scope, pad
from autopar.search.costs import CostContext
from autopar.search.pricing import is_gradient_op
from autopar.search.problem import MemoryConstraint, ProblemNode, ShardingProblem
from autopar.search.sharding import Sharding, replicated
from autopar.search.strategies import OpStrategy
from autopar.trace.graph import Graph


@dataclass(frozen=True)
class BuiltProblem:
    """A graph's sharding problem on one mesh plus what is needed to read a solution.

    Attributes:
        graph: the traced step.
        ctx: prices on the mesh.
        ops: every op (:class:`~autopar.search.build.records.Op`).
        groups: the priced groups; ``problem.nodes[g]`` is ``groups[g]``.
        op_group: op -> (group, position).
        edges: the reads across groups; ``problem.edges[i]`` is ``edges[i]``.
        problem: the ILP.
        input_ops: graph input index -> its op.
        output_refs: graph output index -> where it comes from.
        persistent: values live throughout (the inputs).
        timeline: every other value over the top-level program order.
        moments: the moments the problem's memory constraints describe.
        param_shapes: shapes of parameters (gradient reductions have them).
        unsupported: primitives no strategy rule knows.
        coarse_stats: sizes (ops, graph nodes, groups).
        value_refs: top-level graph value id -> where the problem makes it.
        remat: the remat policy the timeline applies.
    """

    graph: Graph
    ctx: CostContext
    ops: tuple[Op, ...]
    groups: tuple[Group, ...]
    op_group: Mapping[int, tuple[int, int]]
    edges: tuple[EdgeRef, ...]
    problem: ShardingProblem
    input_ops: Mapping[int, int]
    output_refs: Mapping[int, Ref | None]
    persistent: tuple[MemValue, ...]
    timeline: Timeline
    moments: tuple[int, ...]
    param_shapes: frozenset[tuple[int, ...]]
    unsupported: tuple[str, ...] = ()
    coarse_stats: Mapping[str, int] = field(default_factory=dict)
    value_refs: Mapping[int, Ref] = field(default_factory=dict)
    remat: str = "none"
    # choice -> its exact peak: a solution's peak is read when the solve checks it against
    # the bound and again when it is decoded (a 48-block step: about 0.1 s each). A problem
    # made by ``replace`` starts its own (init=False fields are not copied).
    _peaks: dict[tuple[int, ...], tuple[float, int, dict[str, float]]] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )

    # -- reading a choice -------------------------------------------------------------
    def strategy(self, op: int, choice: Sequence[int]) -> OpStrategy:
        g, pos = self.op_group[op]
        return self.groups[g].strategies[choice[g]][pos]

    def spec(self, ref: Ref, choice: Sequence[int]) -> Sharding:
        return pad(self.strategy(ref.op, choice).outs[ref.port], ref.delta)

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

    def is_gradient_op(self, op: Op) -> bool:
        """Whether ``op``'s partial sums are gradient reductions."""
        return is_gradient_op(op, self.param_shapes)

    def leader(self, op_index: int) -> Op:
        """The op leading ``op_index``'s group."""
        g, _ = self.op_group[op_index]
        return self.ops[self.groups[g].ops[0]]

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

    # -- memory (build.memory) ------------------------------------------------------------
    def value_bytes(self, v: MemValue, choice: Sequence[int]) -> float:
        return memory.value_bytes(self, v, choice)

    def copies(self, choice: Sequence[int]) -> list[float]:
        """Bytes per device of resharded copies per moment (:func:`.memory.copies`)."""
        return memory.copies(self, choice)

    def peak(self, choice: Sequence[int]) -> tuple[float, int, dict[str, float]]:
        """Exact peak bytes per device: (bytes, moment, breakdown) (:func:`.memory.peak`)."""
        key = tuple(choice)
        hit = self._peaks.get(key)
        if hit is None:
            hit = self._peaks[key] = memory.peak(self, choice)
        return hit[0], hit[1], dict(hit[2])

    def memory_constraint(self, moment: int) -> MemoryConstraint:
        """The linear memory constraint of one moment (persistent + live values)."""
        return memory.memory_constraint(self, moment)

    def with_memory_limit(self, limit: float | None) -> BuiltProblem:
        """The same problem with another bound on its memory constraints."""
        return replace(self, problem=replace(self.problem, memory_limit=limit))

    def with_moments(self, moments: Sequence[int]) -> BuiltProblem:
        """The same problem with memory constraints at ``moments`` (added lazily)."""
        cons = tuple(memory.memory_constraint(self, t) for t in moments)
        return replace(self, problem=replace(self.problem, memory=cons), moments=tuple(moments))


def build(
    graph: Graph,
    ctx: CostContext,
    *,
    fixed_inputs: Mapping[int, Sharding] | None = None,
    constraints: Mapping[tuple[Scope, int, int], Sharding] | None = None,
    input_axes: Mapping[int, Sequence[str]] | None = None,
    required_axes: Mapping[int, Sequence[str]] | None = None,
    tie_optimizer_state: bool = True,
    coarsen_groups: bool = True,
    memory_limit: float | None = None,
    num_moments: int = 4,
    replication_penalty_s: float = 0.0,
    remat: str = "none",
    repeat: Mapping[int, float] | None = None,
    operand_constraints: Mapping[tuple[Scope, int, int], Sharding] | None = None,
) -> BuiltProblem:
    """Build the :class:`BuiltProblem` of one graph on one mesh.

    Args:
        graph: the traced step.
        ctx: prices on the mesh.
        fixed_inputs: graph input index -> the only sharding it may take.
        constraints: ``(scope, node id, output)`` -> pinned sharding of that value.
        input_axes: graph input index -> the axes its sharding may use.
        required_axes: graph input index -> axes its sharding must use where it can
            (:class:`~autopar.search.build.catalog.StrategyCatalog`).
        tie_optimizer_state: a parameter and its optimizer state take one sharding.
        coarsen_groups: merge followers into groups and tie identical layers.
        memory_limit: bytes per device for the problem's constraints.
        num_moments: memory constraints to start with (the planner adds more lazily).
        replication_penalty_s: objective seconds charged to a forward or backward op per
            unit of the fraction of its work each device does (1 replicated, 1/n split n
            ways). :func:`~autopar.search.evaluate.evaluate_plan` sets it to complete a
            partial plan the way XLA's sharding propagation does. Reported times never
            include it; without it the objective is the step time.
        operand_constraints: ``(scope, node id, operand)`` -> the layout a plan reads that
            operand in (restricts the reading group leader's strategies).
        repeat: top-level node id -> executions per step (the gradient computation of a
            microbatched step runs once per microbatch).
        remat: the remat policy the memory model applies (``"none"``, ``"selective"``,
            ``"full"``; :func:`autopar.search.build.memory.liveness`).
    """
    # Building allocates hundreds of thousands of small objects that stay alive; the
    # cyclic GC would rescan them over and over (a third of the build time at 96
    # layers). They hold no cycles that need collecting mid-build.
    with gc_paused():
        catalog = StrategyCatalog(
            ctx, fixed_inputs=fixed_inputs, input_axes=input_axes, required_axes=required_axes
        )
        flat = flatten(graph, constraints, repeat)
        coarse = coarsen(
            flat,
            catalog,
            enabled=coarsen_groups,
            tie_optimizer_state=tie_optimizer_state,
            operand_pins=operand_constraints,
            split_update=repeat is not None,
        )
        priced = price(coarse, catalog, replication_penalty_s=replication_penalty_s)
        aliases = (
            state_aliases(coarse, flat.input_ops)
            + tie_layers(coarse, priced.groups, catalog, coarsen=coarsen_groups)
            + batch_ties(coarse, flat.input_ops, priced.groups)
        )
        persistent, timeline = memory.liveness(coarse, remat)
        nodes = tuple(
            ProblemNode(
                coarse.ops[g.ops[0]].name or coarse.ops[g.ops[0]].node.primitive,
                g.costs,
                tuple(s[0].name for s in g.strategies),
            )
            for g in priced.groups
        )
        problem = ShardingProblem(
            nodes,
            priced.edges,
            (),
            memory_limit,
            tuple(merge_sets(aliases)),
            {"mesh": ctx.mesh_dict},
            priced.shared,
        )
        bp = BuiltProblem(
            graph,
            ctx,
            coarse.ops,
            priced.groups,
            coarse.where,
            priced.edge_refs,
            problem,
            flat.input_ops,
            coarse.output_refs,
            persistent,
            timeline,
            (),
            priced.param_shapes,
            tuple(sorted(flat.unsupported)),
            {
                "ops": len(coarse.ops),
                "graph_nodes": _count_nodes(graph),
                "groups": len(priced.groups),
            },
            coarse.envs.get((), {}),
            remat,
        )
        return bp.with_moments(memory.pick_moments(timeline, num_moments))


class ProblemBuilder:
    """:func:`build` with its arguments held (kept for callers of the class form).

    Example:
        >>> ctx = CostContext(cluster, {"data": 8})
        >>> ProblemBuilder(graph, ctx).build().problem.size == build(graph, ctx).problem.size
        True
    """

    def __init__(self, graph: Graph, ctx: CostContext, *, coarsen: bool = True, **kw) -> None:
        self.graph, self.ctx, self.kw = graph, ctx, dict(kw, coarsen_groups=coarsen)

    def build(self) -> BuiltProblem:
        return build(self.graph, self.ctx, **self.kw)


def with_accumulators(bp: BuiltProblem, acc: Any) -> BuiltProblem:
    """``bp`` (built on one microbatch of a step, ``acc``: an
    :class:`autopar.lower.split.Accumulation`) with the memory the microbatch loop adds:
    the whole batch stays resident (the step's input), and every summed or averaged
    value the gradient computation hands the update has an accumulator (float32 for
    narrower floats) live across all microbatches, laid out as the value is."""
    from autopar.search.build.memory import ROLE_CATEGORY
    from autopar.trace.graph import TensorInfo

    full = {gi.index: gi for gi in acc.full.inputs}
    # The first graph input of each input op (a value's input, found in one lookup).
    input_of_op: dict[Any, Any] = {}
    for g in bp.graph.inputs:
        op = bp.input_ops.get(g.index)
        if op is not None:
            input_of_op.setdefault(op, g)
    persistent = []
    for v in bp.persistent:
        gi = input_of_op.get(getattr(v.ref, "op", None))
        if gi is not None and gi.index in acc.batch_inputs:
            v = replace(v, tensor=full[gi.index].tensor, category=ROLE_CATEGORY[gi.role])
        persistent.append(v)
    for (k, j), rule in zip(acc.handoff, acc.rules, strict=True):
        if rule not in ("mean", "sum"):
            continue
        node = bp.graph.nodes[k]
        ref = bp.value_refs.get(node.outputs[j])
        t = node.out_tensors[j]
        dtype = "float32" if t.dtype in ("bfloat16", "float16") else t.dtype
        persistent.append(
            MemValue(ref, TensorInfo(t.shape, dtype), "grads", f"accumulator {node.name_stack}:{j}")
        )
    out = replace(bp, persistent=tuple(persistent))
    return out.with_moments(out.moments)


def _count_nodes(graph: Graph) -> int:
    total = 0
    for n in graph.nodes:
        total += 1
        for b in n.body:
            total += _count_nodes(b)
    return total


__all__ = [
    "BuiltProblem",
    "with_accumulators",
    "ProblemBuilder",
    "Ref",
    "build",
    "match_optimizer_state",
    "struct_key",
]
