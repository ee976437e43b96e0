"""Build stage 3, price: every group strategy and every read across groups in seconds.

A group's strategy is its leader's strategy plus what each follower does with the layout
it receives: its cost is the sum over its ops of the linear step time of the op's
strategy (:func:`autopar.search.pricing.price_strategy`) times the op's executions, plus
the reshards between ops inside the group. Reads across groups become
``ProblemEdge``\\ s with a reshard cost (:func:`autopar.search.pricing.price_reshard`) per
(producer layout, consumer layout) class pair. Gradient reductions pay their bandwidth in
the strategy and their latency once per scope and device group, as a ``SharedCost``
(XLA combines them). Every second comes from :mod:`autopar.search.pricing`, the same
functions that price a solved choice, so the ILP's objective is the reported step time.

The one term that is not a step time: ``replication_penalty_s``, which
``evaluate_plan`` uses to complete a hand-written plan the way XLA's sharding
propagation would; it is kept apart (``Priced.penalties``) and reported nowhere.

Example: the group of the MLP's first matmul on 8 devices (the matmul leads; its bias
add, its ReLU and the ReLU's mask follow it), one cost per strategy.

    >>> from autopar.search.build.coarsen import coarsen
    >>> from autopar.search.build.flatten import flatten
    >>> from autopar.search.costs import CostContext
    >>> catalog = StrategyCatalog(CostContext(cluster, {"data": 8}))
    >>> coarse = coarsen(flatten(graph), catalog)
    >>> priced = price(coarse, catalog)
    >>> len(priced.groups) == len(coarse.groups), len(priced.edges)
    (True, 62)
    >>> matmul = next(op for op in coarse.ops if op.kind == "node" and op.node.primitive == "dot_general")
    >>> group = priced.groups[coarse.where[matmul.index][0]]
    >>> [coarse.ops[i].node.primitive for i in group.ops]
    ['dot_general', 'add', 'max', 'gt']
    >>> [(s[0].name, f"{c * 1e6:.2f} us") for s, c in zip(group.strategies, group.costs)][:4]
    [('R', '1.50 us'), ('m0=data', '0.70 us'), ('n1=data', '0.22 us'), ('k1=data AR(data)', '50.55 us')]
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from autopar.search.build.catalog import StrategyCatalog
from autopar.search.build.coarsen import Coarse
from autopar.search.build.records import CombinedReduction, EdgeRef, Group, GroupShape, Op, pad
from autopar.search.pricing import (
    STATE_ROLES,
    combined_linear_s,
    feeds_state_update,
    is_gradient_op,
    price_reshard,
    price_strategy,
    reshard_linear_s,
)
from autopar.search.problem import ProblemEdge, SharedCost
from autopar.search.sharding import Sharding, shards
from autopar.search.strategies import OpStrategy

_PROPAGATED = frozenset({"forward", "backward"})


@dataclass(frozen=True)
class Priced:
    """What pricing hands on: the priced groups, the edges (``edges[i]`` is problem
    edge ``i``; ``edge_refs[i]`` says which read it is), the shared costs, and which
    input shapes count as parameters (gradient reductions are ops with those shapes)."""

    groups: tuple[Group, ...]
    edges: tuple[ProblemEdge, ...]
    edge_refs: tuple[EdgeRef, ...]
    shared: tuple[SharedCost, ...]
    param_shapes: frozenset[tuple[int, ...]]


def _from_replicated(coarse: Coarse, catalog: StrategyCatalog) -> set[int]:
    """Ops computed from graph inputs that can only be replicated (and constants) alone:
    sharding propagation starts from sharded values, so none reaches them.

    A graph input qualifies when every layout it may take is whole on every device (a
    plan's replicated parameter); a node when each operand qualifies or is a constant
    and one qualifies; a loop input when what enters it does (a carry never: it changes
    every iteration)."""
    mesh = catalog.ctx.mesh
    ops = coarse.ops
    out: set[int] = set()
    for op in ops:  # in program order: operands come first (carries are excluded below)
        if op.kind == "input":
            specs = catalog.input_specs(op.input, coarse.whole(op.input.index))
            if specs and all(shards(s, mesh) == 1 for s in specs):
                out.add(op.index)
        elif op.kind == "node" or (op.kind == "body_input" and len(op.operands) == 1):
            live = [r for r in op.operands if r is not None and ops[r.op].depends]
            if live and all(r.op in out for r in live):
                out.add(op.index)
    return out


def param_shapes(coarse: Coarse) -> frozenset[tuple[int, ...]]:
    """Shapes of parameters and model state (and of one layer of a stacked one)."""
    return frozenset(
        shape
        for gi in coarse.graph.inputs
        if gi.role in ("param", "model_state")
        for shape in (gi.tensor.shape, gi.tensor.shape[1:])
    )


def price(
    coarse: Coarse, catalog: StrategyCatalog, *, replication_penalty_s: float = 0.0
) -> Priced:
    """Price every group and every read across groups (see the module docstring)."""
    return _Pricer(coarse, catalog, replication_penalty_s).run()


class _Pricer:
    def __init__(self, coarse: Coarse, catalog: StrategyCatalog, penalty: float) -> None:
        self.coarse = coarse
        self.ops = coarse.ops
        self.where = coarse.where
        self.catalog = catalog
        self.ctx = catalog.ctx
        self.eta = float(self.ctx.cluster.overlap_efficiency)
        self.grad_w = self.ctx.dp_grad_weight  # None: gradient reductions at 1 - eta
        self.penalty = float(penalty)
        self.param_shapes = param_shapes(coarse)
        self._grad: dict[int, bool] = {}
        self._from_replicated = _from_replicated(coarse, catalog) if self.penalty else set()
        self._class_cache: dict[tuple, tuple[tuple[int, ...], tuple]] = {}
        self._matrix_cache: dict[tuple, tuple] = {}
        self._matrix_by_id: dict[tuple, tuple] = {}  # the same, keyed by the layouts' ids
        self._reshard_cache: dict[tuple, float] = {}

    def run(self) -> Priced:
        groups = self._price_groups()
        edges, refs = self._edges(groups)
        return Priced(
            tuple(groups),
            tuple(edges),
            tuple(refs),
            _shared_costs(groups, self.eta, self.grad_w),
            self.param_shapes,
        )

    # -- strategies ---------------------------------------------------------------------
    def gradient(self, op: Op) -> bool:
        hit = self._grad.get(op.index)
        if hit is None:
            hit = self._grad[op.index] = is_gradient_op(op, self.param_shapes)
        return hit

    def _leader_strategies(self, op: Op) -> list[OpStrategy]:
        whole = self.coarse.whole(op.input.index) if op.input is not None else frozenset()
        return self.catalog.leader_strategies(
            op, self.coarse.restrict.get(op.index), whole, self.coarse.reads.get(op.index)
        )

    def _strategy_cost(self, op: Op, st: OpStrategy) -> tuple[float, tuple[CombinedReduction, ...]]:
        """One execution's objective seconds (linear step time plus the completion
        penalty, if any) and the combined reductions it joins."""
        p = price_strategy(self.ctx, op, st, gradient=self.gradient(op))
        return p.linear_s(self.eta, self.grad_w) + self._penalty(op, st), p.combined

    def _penalty(self, op: Op, st: OpStrategy) -> float:
        if not self.penalty or op.kind != "node" or op.phase not in _PROPAGATED:
            return 0.0
        node = op.node
        if any(t.shape in self.param_shapes for t in node.out_tensors):
            return 0.0  # parameter-shaped work (casts, gradients) follows the state's layout
        if op.index in self._from_replicated:
            # Work on replicated state alone (a position-embedding slice broadcast to the
            # batch's rank): no sharded value reaches it, so propagation leaves it
            # replicated, not split for free and gathered again for its reader.
            return 0.0
        if node.flops > 0:
            fraction = st.flops / node.flops
        elif st.outs and node.out_tensors and node.out_tensors[0].ndim:
            fraction = 1.0 / shards(st.outs[0], self.ctx.mesh)
        else:
            return 0.0
        return self.penalty * fraction

    def _reshard_s(
        self, op: Op, k: int, have: Sharding, need: Sharding, source: Op, into: bool
    ) -> float:
        t = op.node.in_tensors[k]
        # The price depends on the source only through whether it is stored state.
        key = (t.shape, t.dtype, have, need, into, source.root_role in STATE_ROLES)
        hit = self._reshard_cache.get(key)
        if hit is None:
            colls = price_reshard(self.ctx, t, have, need, source=source, into_state=into)
            hit = self._reshard_cache[key] = reshard_linear_s(colls, self.eta, self.grad_w)
        return hit

    # -- groups -------------------------------------------------------------------------
    def _op_signature(self, op: Op) -> tuple:
        if op.kind == "node":
            return (
                self.catalog.key(op),
                tuple(sorted(self.coarse.restrict.get(op.index, {}).items())),
                tuple(sorted(self.coarse.reads.get(op.index, {}).items())),
            )
        if op.kind in ("input", "output"):
            specs = self.catalog.input_specs(op.input, self.coarse.whole(op.input.index))
            return (op.kind, op.input.tensor, op.input.role, tuple(specs))
        if op.kind == "constraint":
            return (op.kind, op.node.in_tensors, op.node.params["spec"])
        return (op.kind, op.node.in_tensors, op.node.out_tensors, op.node.params["lead"])

    def _signature(self, g: GroupShape) -> tuple:
        """Everything pricing a group depends on: equal signatures (the same block in
        another layer) price identically, so they are priced once."""
        sig: list = [self.ops[g.ops[0]].root_role, self.ops[g.ops[0]].scope]
        for oi in g.ops:
            op = self.ops[oi]
            internal = tuple(
                (k, self.where[ref.op][1], ref.port, ref.delta, self.ops[ref.op].weight)
                for k, ref in enumerate(op.operands)
                if ref is not None and self.where[ref.op][0] == g.index
            )
            sig.append(
                (
                    self._op_signature(op),
                    op.weight,
                    self.gradient(op),
                    g.follow.get(oi),
                    internal,
                    (op.phase, oi in self._from_replicated) if self.penalty else None,
                )
            )
        return tuple(sig)

    def _price_groups(self) -> list[Group]:
        cache: dict[tuple, tuple] = {}
        out = []
        for g in self.coarse.groups:
            sig = self._signature(g)
            hit = cache.get(sig)
            if hit is None:
                hit = cache[sig] = self._price_group(g)
            out.append(Group(g.index, g.ops, g.follow, *hit))
        return out

    def _price_group(self, g: GroupShape) -> tuple:
        ops = [self.ops[oi] for oi in g.ops]
        leader = ops[0]
        pos_of = {oi: pos for pos, oi in enumerate(g.ops)}
        # Per op: (operand k, producer position, port, delta, executions) of reads in the group.
        internal = [
            [
                (k, pos_of[ref.op], ref.port, ref.delta, min(op.weight, self.ops[ref.op].weight))
                for k, ref in enumerate(op.operands)
                if ref is not None and self.where[ref.op][0] == g.index
            ]
            for op in ops
        ]
        mains = [None] + [
            (g.follow[oi], pos_of[ops[p].operands[g.follow[oi]].op], ops[p].operands[g.follow[oi]])
            for p, oi in enumerate(g.ops)
            if p > 0
        ]
        memo: list[dict] = [{} for _ in ops]  # per follower: main layout -> (strategy, cost)
        # Followers see the leader only through its output layouts: leader strategies
        # with equal outputs (differing in what they read, or how they reduce) share the
        # followers' strategies, costs and internal reads, priced once (``chains``).
        chains: dict[tuple, tuple] = {}
        strategies, costs, computes, charges_all = [], [], [], []
        for lead in self._leader_strategies(leader):
            lead_cost, lead_charges = self._strategy_cost(leader, lead)
            chain = chains.get(lead.outs)
            if chain is None:
                chain = chains[lead.outs] = self._follow_chain(ops, lead, mains, memo, internal)
            rest, rest_cost, rest_compute, rest_charges = chain
            strats = (lead, *rest)
            cost = leader.weight * lead_cost + rest_cost
            # The leader's own reads inside the group (of a value made later in a loop).
            for k, ppos, port, delta, w in internal[0]:
                need = lead.ins[k] if k < len(lead.ins) else None
                if need is None:
                    continue
                have = pad(strats[ppos].outs[port], delta)
                if have != need:
                    cost += w * self._reshard_s(leader, k, have, need, leader, False)
            strategies.append(strats)
            costs.append(cost)
            computes.append(leader.weight * lead.compute_s + rest_compute)
            charges_all.append(tuple(dict.fromkeys((*lead_charges, *rest_charges))))
        return tuple(strategies), tuple(costs), tuple(computes), tuple(charges_all)

    def _follow_chain(
        self, ops: list[Op], lead: OpStrategy, mains: list, memo: list[dict],
        internal: list[list[tuple]],
    ) -> tuple[tuple[OpStrategy, ...], float, float, tuple]:  # fmt: skip
        """The followers' strategies given the leader's ``lead``, their summed cost and
        compute (reads inside the group by followers included) and their reductions."""
        strats: list[OpStrategy] = [lead]
        cost = compute = 0.0
        charges: list = []
        for pos in range(1, len(ops)):
            k, ppos, ref = mains[pos]
            spec = strats[ppos].outs[ref.port]
            hit = memo[pos].get(spec)
            if hit is None:
                op = ops[pos]
                st = self.catalog.follow(op, k, pad(spec, ref.delta))
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
        # Reads inside the group: free when layouts agree, else a reshard.
        for pos in range(1, len(ops)):
            st = strats[pos]
            for k, ppos, port, delta, w in internal[pos]:
                need = st.ins[k] if k < len(st.ins) else None
                if need is None:
                    continue
                have = pad(strats[ppos].outs[port], delta)
                if have != need:
                    cost += w * self._reshard_s(ops[pos], k, have, need, ops[0], False)
        return tuple(strats[1:]), cost, compute, tuple(charges)

    # -- edges --------------------------------------------------------------------------
    def _classes(self, key: tuple, layouts) -> tuple[tuple[int, ...], tuple]:
        """Distinct layouts of one port over a group's strategies: (class per strategy,
        the layouts). Groups priced once share strategy tuples, hence the cache by id."""
        hit = self._class_cache.get(key)
        if hit is None:
            index: dict = {}
            cls = tuple(index.setdefault(h, len(index)) for h in layouts())
            hit = self._class_cache[key] = (cls, tuple(index))
        return hit

    def _edges(self, groups: Sequence[Group]) -> tuple[list[ProblemEdge], list[EdgeRef]]:
        edges: list[ProblemEdge] = []
        refs: list[EdgeRef] = []
        where = self.where
        for op in self.ops:
            if op.index not in where:
                continue  # a constant or a folded pin
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
                    lambda cons=cons, pc=pc, k=k: [
                        s[pc].ins[k] if k < len(s[pc].ins) else None for s in cons.strategies
                    ],
                )
                if all(n is None for n in dst_keys):
                    continue
                src_cls, src_keys = self._classes(
                    ("out", id(prod.strategies), pp, ref.port, ref.delta),
                    lambda prod=prod, pp=pp, ref=ref: [
                        pad(s[pp].outs[ref.port], ref.delta) for s in prod.strategies
                    ],
                )
                t = op.node.in_tensors[k]
                w = min(op.weight, self.ops[ref.op].weight)
                source = self.ops[prod.ops[0]]
                into = feeds_state_update(op, self.ops[cons.ops[0]])
                # Looked up by the layout tuples' identity first (the class cache hands
                # every tied copy the same tuples; hashing them by value is most of this
                # loop's time), then by value, so equal matrices stay one object.
                fast = (t.shape, t.dtype, id(src_keys), id(dst_keys), w, source.root_role, into)
                mat = self._matrix_by_id.get(fast)
                if mat is None:
                    mkey = (t.shape, t.dtype, src_keys, dst_keys, w, source.root_role, into)
                    mat = self._matrix_cache.get(mkey)
                    if mat is None:
                        mat = tuple(
                            tuple(
                                0.0 if n is None else w * self._reshard_s(op, k, h, n, source, into)
                                for n in dst_keys
                            )
                            for h in src_keys
                        )
                        self._matrix_cache[mkey] = mat
                    self._matrix_by_id[fast] = mat
                refs.append(EdgeRef(op.index, k, ref, len(edges)))
                edges.append(
                    ProblemEdge(
                        gp, gc, src_cls, dst_cls, mat, f"{self.ops[ref.op].name} -> {op.name}"
                    )
                )
        return edges, refs


def _shared_costs(
    groups: Sequence[Group], eta: float, grad_w: float | None = None
) -> tuple[SharedCost, ...]:
    """One shared cost per combined gradient reduction: its latency, weighted like the
    gradient reductions it merges, paid once if any member strategy is chosen."""
    members: dict[CombinedReduction, dict[int, list[int]]] = {}
    for gi, g in enumerate(groups):
        for s, charges in enumerate(g.charges):
            for ch in charges:
                members.setdefault(ch, {}).setdefault(gi, []).append(s)
    out = []
    for r, by_group in members.items():
        where = f" in scan {r.scope[-1][0]}" if r.scope else ""
        out.append(
            SharedCost(
                f"combined {r.kind} over {','.join(r.axes)}{where}",
                combined_linear_s(r, eta, grad_w),
                tuple((gi, tuple(ss)) for gi, ss in sorted(by_group.items())),
            )
        )
    return tuple(out)


__all__ = ["Priced", "param_shapes", "price"]
