"""The one pricing door: what a strategy, a reshard and a whole choice cost.

Everything the search reports or minimises is priced here:

* :func:`price_strategy` and :func:`price_reshard` price one op's strategy and one
  change of layout; the ILP build (:mod:`autopar.search.build.price`) turns them into
  the problem's node, edge and shared costs;
* :func:`price_choice` walks a solved problem with the same two functions and returns
  the :class:`Pricing` that ``plan.predicted`` and ``autopar.evaluate`` report.

So the number the solver minimises *is* the reported step time
(``Pricing.step_time_s == problem.objective(choice)``, tested for every zoo model): the
**linear step time**

    step_time_s = compute_s + sum over collectives of weight(class) * seconds

where ``weight`` is ``1 - overlap_efficiency`` for the communication classes that hide
behind compute (``cost_models.HIDEABLE_CLASSES``: gradient reductions, parameter
gathers) and 1 for the rest, and combined gradient reductions pay their latency once per
scope. Two refinements the pairwise ILP cannot express are reported beside it, never
instead of it:

* ``overlap_step_time_s``: ``cost_models.compose_step_time`` of the same parts, whose
  overlap is bounded by the compute actually available (a ``min``, not a weight);
* ``merged_reshard_s``: the part of ``step_time_s`` spent on a value resharded the same
  way for several readers in different groups. The ILP charges each reader; XLA's CSE
  emits the collective once, so ``collectives`` (what ``autopar.verify`` compares with
  the compiled program) lists it once.

Example:
    >>> class_weight("dp_grad", 0.6), class_weight("tensor", 0.6)
    (0.4, 1.0)
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, Any

from autopar.axes import exposed_class
from autopar.search.build.records import CombinedReduction, Op
from autopar.search.costs import CostContext
from autopar.search.sharding import Collective, Sharding
from autopar.search.strategies import OpStrategy
from autopar.trace.graph import TensorInfo
from cost_models import HIDEABLE_CLASSES, compose_step_time

if TYPE_CHECKING:
    from autopar.search.ilp import BuiltProblem

STATE_ROLES = ("param", "opt_state")
"""Input roles stored across steps whose layout ZeRO / FSDP chooses."""


def class_weight(cls: str, overlap_efficiency: float, dp_grad_weight: float | None = None) -> float:
    """How much one second of a communication class counts in the step time: classes
    that overlap with compute (``cost_models.HIDEABLE_CLASSES``) count
    ``1 - overlap_efficiency``, everything else in full. ``dp_grad_weight``, if given,
    is the weight of a gradient reduction instead (a completion for a program that
    reduces gradients elsewhere: :attr:`CostContext.dp_grad_weight`).

    Example:
        >>> class_weight("dp_grad", 0.6, dp_grad_weight=0.25), class_weight("fsdp_gather", 0.6, 0.25)
        (0.25, 0.4)
    """
    if dp_grad_weight is not None and cls == "dp_grad":
        return dp_grad_weight
    return 1.0 - overlap_efficiency if cls in HIDEABLE_CLASSES else 1.0


_MAX_GRADIENT_DIMS = 6
"""Parameters of more dimensions match their gradients by exact shape only
(the set partitions of 7 dimensions are 877; no model here has such a parameter)."""


def _partitions(dims: tuple[int, ...]) -> list[list[list[int]]]:
    """Every set partition of ``dims`` (as lists of the dimensions' sizes)."""
    if not dims:
        return [[]]
    first, rest = dims[0], dims[1:]
    out = []
    for part in _partitions(rest):
        out.append([[first], *part])
        for i in range(len(part)):
            out.append([*part[:i], [first, *part[i]], *part[i + 1 :]])
    return out


def _layout_free(shape: tuple[int, ...]) -> tuple[int, ...]:
    """``shape`` sorted: what a transpose keeps. Unit dimensions count: an activation
    gradient ``[1, S, H]`` of a batch of one (a pipeline's microbatch) is no gradient of
    a ``[S, H]`` position embedding."""
    return tuple(sorted(shape))


@lru_cache(maxsize=64)
def gradient_shapes(param_shapes: frozenset[tuple[int, ...]]) -> frozenset[tuple[int, ...]]:
    """The shapes (as :func:`_layout_free` keys) a parameter's gradient may have while it
    is computed: the parameter's dimensions in any order (``x @ w`` gives ``dW^T`` as
    ``dy^T . x``, transposed afterwards) and merged in any groups (a ``[d, h, k]``
    kernel's gradient computed as ``[d, h*k]`` and reshaped).

    Example:
        >>> sorted(gradient_shapes(frozenset({(8, 64)})))
        [(8, 64), (512,)]
    """
    out: set[tuple[int, ...]] = set()
    for dims in param_shapes:
        if len(dims) > _MAX_GRADIENT_DIMS:
            out.add(_layout_free(dims))
            continue
        for part in _partitions(dims):
            out.add(_layout_free(tuple(math.prod(group) for group in part)))
    return frozenset(out)


def is_gradient_op(op: Op, param_shapes: frozenset[tuple[int, ...]]) -> bool:
    """A backward op whose result holds a parameter's elements (its shape, or its dims
    transposed or merged, see :func:`gradient_shapes`): its partial sums are gradient
    reductions (class ``dp_grad``), whichever layout the transpose rule computed them in.

    Example:
        >>> from types import SimpleNamespace as NS
        >>> dw_t = NS(phase="backward", node=NS(out_tensors=(NS(shape=(8, 64)),)))
        >>> is_gradient_op(dw_t, frozenset({(64, 8)}))     # dW of x @ w, before its transpose
        True
        >>> is_gradient_op(dw_t, frozenset({(64, 64)}))
        False
    """
    if op.phase != "backward":
        return False
    if any(t.shape in param_shapes for t in op.node.out_tensors):
        return True
    keys = gradient_shapes(param_shapes)
    # A scalar (or all-unit) result matches only by its exact shape, above.
    return any((key := _layout_free(t.shape)) and key in keys for t in op.node.out_tensors)


def feeds_state_update(op: Op, consumer_leader: Op) -> bool:
    """Whether ``op`` is optimizer work on a parameter or optimizer-state input (its
    group is led by that input): a value resharded into it is the update's way into the
    stored layout (ZeRO's gather of the updated parameters)."""
    return op.phase == "optimizer" and consumer_leader.root_role in STATE_ROLES


def collective_class(
    coll: Collective,
    *,
    gradient: bool = False,
    scalar: bool = False,
    source: Op | None = None,
    into_state: bool = False,
    rename: Mapping[str, str] | None = None,
    state_split: bool | None = None,
) -> str:
    """Which ``cost_models.COMM_CLASSES`` class a collective belongs to.

    A strategy's own collective (``source is None``) of a gradient op is a gradient
    reduction (``dp_grad``); a reshard that moves a parameter or optimizer state out of
    its stored layout, or an update into it (``into_state``), is an FSDP gather
    (``fsdp_gather``), unless ``state_split`` is ``False``: the state is stored whole
    over the collective's axes (a plain data-parallel plan), so what moves is a value
    computed from it, not the state out of a sharded store (:func:`price_reshard`
    decides it with :func:`reshard_state_split`, for the ILP and the report alike); the
    rest is named after the mesh axes it runs over
    (:func:`autopar.axes.exposed_class`): ``seq``, ``expert``, ``tensor``, except a
    forward op's own reduction to a scalar (``scalar``: the loss, a metric), which is
    ``batch_reduce`` over whatever axes split the batch; else any other strategy's
    collective is ``tensor``, and a reshard ``reshard``.

    Example:
        >>> collective_class(Collective("all-reduce", ("tensor",), 8.0, 1e-6))
        'tensor'
    """
    rename = rename or {}
    if source is None:
        if gradient:
            return "dp_grad"
        if scalar:
            # The loss's mean over the batch, over whichever axes split the batch
            # (('data', 'tensor') when the planner splits the batch over both).
            return "batch_reduce"
    else:
        return _class_of_reshard(
            coll, source.root_role in STATE_ROLES or into_state, state_split, rename
        )
    named = exposed_class(rename.get(a, a) for a in coll.axes)
    return "tensor" if named is None else named


def _class_of_reshard(
    coll: Collective, state: bool, state_split: bool | None, rename: Mapping[str, str]
) -> str:
    """:func:`collective_class` of a reshard (``state``: it moves state out of, or an
    update into, a stored layout)."""
    if state and state_split is not False:
        return "fsdp_gather"
    named = exposed_class(rename.get(a, a) for a in coll.axes)
    return "reshard" if named is None else named


@dataclass(frozen=True)
class PricedCollective:
    """One collective with its class; ``combined``: the gradient reduction it merges
    into (its latency is paid there, once)."""

    collective: Collective
    cls: str
    combined: CombinedReduction | None = None

    @property
    def own_s(self) -> float:
        """The seconds this collective pays itself (its latency goes to ``combined``)."""
        lat = self.combined.latency_s if self.combined is not None else 0.0
        return self.collective.time_s - lat


@dataclass(frozen=True)
class StrategyPrice:
    """One op under one strategy, per execution."""

    compute_s: float
    flops: float
    collectives: tuple[PricedCollective, ...] = ()

    def linear_s(self, overlap_efficiency: float, dp_grad_weight: float | None = None) -> float:
        """Its part of the linear step time (without the combined latencies)."""
        return self.compute_s + sum(
            class_weight(c.cls, overlap_efficiency, dp_grad_weight) * c.own_s
            for c in self.collectives
        )

    @property
    def combined(self) -> tuple[CombinedReduction, ...]:
        return tuple(c.combined for c in self.collectives if c.combined is not None)


def scalar_result(op: Op) -> bool:
    """A forward op whose results are scalars (the loss, a metric): its reduction is over
    the batch, whatever axes the batch is split on."""
    outs = op.node.out_tensors
    return op.phase == "forward" and bool(outs) and all(t.ndim == 0 for t in outs)


def price_strategy(
    ctx: CostContext,
    op: Op,
    st: OpStrategy,
    *,
    gradient: bool,
    rename: Mapping[str, str] | None = None,
) -> StrategyPrice:
    """Price ``op`` run as ``st`` (one execution; ``gradient``: :func:`is_gradient_op`;
    ``rename``: the plan's axis names, which name exposed classes and never change a
    class's weight)."""
    if not st.comm:
        return StrategyPrice(st.compute_s, st.flops)
    out = []
    scalar = scalar_result(op)
    for c in st.comm:
        cls = collective_class(c, gradient=gradient, scalar=scalar, rename=rename)
        combined = None
        if cls == "dp_grad":
            combined = CombinedReduction(
                op.scope, c.kind, c.axes, op.weight, ctx.latency(c.kind, c.axes)
            )
        out.append(PricedCollective(c, cls, combined))
    return StrategyPrice(st.compute_s, st.flops, tuple(out))


def price_reshard(
    ctx: CostContext,
    t: TensorInfo,
    have: Sharding,
    need: Sharding,
    *,
    source: Op,
    into_state: bool = False,
    rename: Mapping[str, str] | None = None,
) -> tuple[PricedCollective, ...]:
    """The collectives that turn ``t`` laid out as ``have`` into ``need`` (one
    execution), each classed by :func:`reshard_state_split` and
    :func:`collective_class`: the ILP's costs and the plan's collectives table both
    come from here, so what the search minimises is what the table reports.
    ``source`` is the leader of the group that makes the value; ``into_state``: the
    value is an update on its way into a state's stored layout
    (:func:`feeds_state_update`); ``rename``: the plan's axis names (they name exposed
    classes, never change a weight)."""
    state = source.root_role in STATE_ROLES
    colls = ctx.reshard(t.shape, t.dtype, have, need)[1]
    if rename:
        return tuple(
            PricedCollective(
                c,
                collective_class(
                    c,
                    source=source,
                    into_state=into_state,
                    rename=rename,
                    state_split=reshard_state_split(c, need, state=state, into_state=into_state),
                ),
            )
            for c in colls
        )
    return tuple(
        PricedCollective(c, _reshard_class(c.axes, need, state, into_state)) for c in colls
    )


@lru_cache(maxsize=1 << 16)
def _reshard_class(axes: tuple[str, ...], need: Sharding, state: bool, into_state: bool) -> str:
    """:func:`collective_class` of a reshard's collective over ``axes`` into ``need``
    (axis names as the search's), memoised: it depends on nothing else, and the search
    asks it for every pair of layouts of every value (a 3-axis GPT-2 mesh: 84k)."""
    c = Collective("reshard", axes, 0.0, 0.0)
    split = reshard_state_split(c, need, state=state, into_state=into_state)
    return _class_of_reshard(c, state or into_state, split, {})


def reshard_state_split(c: Collective, need: Sharding, *, state: bool, into_state: bool) -> bool:
    """Whether a reshard's collective ``c`` moves state that is stored split over its
    axes (so it is an FSDP gather, prefetchable and hidden behind compute).

    * Read out of a state's store (``state``: the value's group is led by a parameter or
      optimizer-state input): the state is gathered from its split store before its use
      -- ZeRO-3 / FSDP's prefetchable gather: ``True``.
    * An update on its way into a state's store (``into_state``): the store's layout is
      ``need``. Only when ``need`` is itself split over ``c``'s axes does ``c`` move
      sharded state (a relayout within the split store); a gather into a store kept
      whole over ``c``'s axes (a data-parallel plan computing the update split after a
      reduce-scatter and gathering it back, ZeRO-1/2's all-gather) runs after the
      update, at the step's end, with nothing left to hide it: ``False``.

    Example:
        >>> gather = Collective("all-gather", ("data",), 4096.0, 1e-6)
        >>> reshard_state_split(gather, ((), ()), state=False, into_state=True)
        False
        >>> reshard_state_split(gather, ((), ()), state=True, into_state=False)
        True
    """
    if state:
        return True
    if into_state:
        return any(a in c.axes for dim in need for a in dim)
    return False


def reshard_linear_s(
    colls: Sequence[PricedCollective],
    overlap_efficiency: float,
    dp_grad_weight: float | None = None,
) -> float:
    """A reshard's part of the linear step time."""
    return sum(class_weight(c.cls, overlap_efficiency, dp_grad_weight) * c.own_s for c in colls)


def combined_linear_s(
    r: CombinedReduction, overlap_efficiency: float, dp_grad_weight: float | None = None
) -> float:
    """A combined gradient reduction's latency, weighted as a gradient reduction."""
    return r.executions * class_weight("dp_grad", overlap_efficiency, dp_grad_weight) * r.latency_s


# ----------------------------------------------------------------------------- a choice


@dataclass(frozen=True)
class EmittedCollective:
    """One collective the program runs, ``executions`` times per step.

    ``own_s`` is its seconds per execution without the latency of the combined
    reduction it merges into (:attr:`Pricing.combined` pays that once)."""

    kind: str
    axes: tuple[str, ...]
    nbytes: float
    executions: float
    own_s: float
    cls: str
    where: str


@dataclass(frozen=True)
class Pricing:
    """A choice priced (per device, per step).

    Attributes:
        step_time_s: the linear step time (module docstring): exactly the objective the
            ILP minimises for this choice.
        compute_s: compute seconds.
        backward_compute_s: the backward part of it.
        flops: FLOPs each device executes.
        emitted: the collectives the program runs (identical reshards of one value
            merged, as XLA's CSE does), axes in the plan's names.
        combined: the combined gradient reductions (their latency, paid once each).
        merged_reshard_s: linear seconds the ILP charges for reshards XLA merges
            (included in ``step_time_s``, absent from ``emitted``).
        overlap_efficiency: the cluster's.
    """

    step_time_s: float
    compute_s: float
    backward_compute_s: float
    flops: float
    emitted: tuple[EmittedCollective, ...]
    combined: tuple[CombinedReduction, ...]
    merged_reshard_s: float
    overlap_efficiency: float

    def by_class(self, rename: Mapping[str, str] | None = None) -> dict[str, float]:
        """Seconds per communication class of what the program runs (hidden or not)."""
        out: dict[str, float] = {}
        for c in self.emitted:
            out[c.cls] = out.get(c.cls, 0.0) + c.executions * c.own_s
        for r in self.combined:
            out["dp_grad"] = out.get("dp_grad", 0.0) + r.executions * r.latency_s
        return out

    def overlap_step_time(self) -> Any:
        """``cost_models.compose_step_time`` of the same parts: the overlap refinement,
        where hiding is bounded by the compute available rather than weighted."""
        return compose_step_time(
            self.compute_s,
            self.by_class(),
            min(self.backward_compute_s, self.compute_s),
            self.overlap_efficiency,
        )


def price_choice(
    bp: BuiltProblem,
    choice: Sequence[int],
    rename: Mapping[str, str] | None = None,
    *,
    pieces: bool = False,
) -> Pricing:
    """Price ``choice`` for the built problem ``bp`` with :func:`price_strategy` and
    :func:`price_reshard`, op by op and read by read, as the ILP's costs were built.

    ``rename`` maps the problem's axis names to the plan's (it names the classes of
    exposed collectives; it never changes seconds).

    Each emitted collective is labelled with the class it was priced as
    (:func:`price_reshard`, :func:`reshard_state_split`): a state read out of its split
    store is an ``fsdp_gather``; an update gathered back into a store kept whole over
    the gather's axes (a pure data-parallel plan computing the update split) is named
    by its axes or ``reshard`` and priced exposed, in the ILP as here. So
    ``step_time_s == compute_s + sum(weight(cls) * seconds)`` over ``emitted`` and
    ``combined`` plus ``merged_reshard_s``.

    ``pieces``: the forward and the backward run as separate programs (a pipeline
    stage's pieces, one per tick), so a reshard of a value computed per microbatch read
    by both is made once in each: only readers of the same phase share it (a step
    input's reshard is hoisted out of the pieces and made once).
    """
    rename = dict(rename or {})
    ctx, eta = bp.ctx, float(bp.ctx.cluster.overlap_efficiency)
    compute = backward = flops = linear = merged = 0.0
    emitted: list[EmittedCollective] = []
    combined: dict[CombinedReduction, None] = {}

    def emit(pc: PricedCollective, weight: float, where: str) -> None:
        # The label is the class the collective was priced as (one function decides
        # both): the table's rows, weighted by their classes, sum to ``step_time_s``.
        c = pc.collective
        if c.time_s == 0.0 and c.nbytes == 0.0:
            return
        axes = tuple(rename.get(a, a) for a in c.axes)
        emitted.append(EmittedCollective(c.kind, axes, c.nbytes, weight, pc.own_s, pc.cls, where))

    def leader(op_index: int) -> Op:
        g, _ = bp.op_group[op_index]
        return bp.ops[bp.groups[g].ops[0]]

    for g, group in enumerate(bp.groups):
        strats = group.strategies[choice[g]]
        for pos, oi in enumerate(group.ops):
            op = bp.ops[oi]
            st = strats[pos]
            gradient = bp.is_gradient_op(op)
            price = price_strategy(ctx, op, st, gradient=gradient, rename=rename)
            compute += op.weight * price.compute_s
            flops += op.weight * price.flops
            if op.phase == "backward":
                backward += op.weight * price.compute_s
            linear += op.weight * price.linear_s(eta)
            for pc in price.collectives:
                if pc.combined is not None:
                    combined[pc.combined] = None
                emit(pc, op.weight, f"{op.name} (op)")
            # Reads inside the group.
            for k, ref in enumerate(op.operands):
                if ref is None or bp.op_group.get(ref.op, (-1,))[0] != g or k >= len(st.ins):
                    continue
                need = st.ins[k]
                have = bp.spec(ref, choice)
                if need is None or have == need:
                    continue
                t = op.node.in_tensors[k]
                w = min(op.weight, bp.ops[ref.op].weight)
                src = leader(ref.op)
                colls = price_reshard(ctx, t, have, need, source=src, rename=rename)
                linear += w * reshard_linear_s(colls, eta)
                for pc in colls:
                    emit(pc, w, f"{op.name} operand {k} {have}->{need} {t.shape}")
    # Reads across groups. The same value resharded the same way for several readers is
    # one collective in the program (XLA's CSE: an FSDP parameter gathered for the
    # forward and again for the backward is gathered once and kept); the ILP, pairwise,
    # charges every reader.
    done: set[tuple] = set()
    for e in bp.edges:
        op = bp.ops[e.op]
        st = bp.strategy(e.op, choice)
        need = st.ins[e.operand] if e.operand < len(st.ins) else None
        if need is None:
            continue
        have = bp.spec(e.ref, choice)
        if have == need:
            continue
        t = op.node.in_tensors[e.operand]
        w = min(op.weight, bp.ops[e.ref.op].weight)
        src, into = leader(e.ref.op), feeds_state_update(op, leader(e.op))
        colls = price_reshard(ctx, t, have, need, source=src, into_state=into, rename=rename)
        secs = w * reshard_linear_s(colls, eta)
        linear += secs
        # In pieces, a step input's reshard is still made once (the lowering hoists it
        # out of the tick loop); a value computed per microbatch is made in each piece.
        piece = op.phase if pieces and bp.ops[e.ref.op].kind != "input" else None
        key = (e.ref, have, need, w, op.scope, piece)
        if key in done:
            merged += secs
            continue
        done.add(key)
        where = f"{op.name} operand {e.operand} {have}->{need} {t.shape}"
        for pc in colls:
            emit(pc, w, where)
    for r in combined:
        linear += combined_linear_s(r, eta)
    return Pricing(
        step_time_s=linear,
        compute_s=compute,
        backward_compute_s=backward,
        flops=flops,
        emitted=tuple(emitted),
        combined=tuple(combined),
        merged_reshard_s=merged,
        overlap_efficiency=eta,
    )


__all__ = [
    "STATE_ROLES",
    "CombinedReduction",
    "EmittedCollective",
    "PricedCollective",
    "Pricing",
    "StrategyPrice",
    "class_weight",
    "collective_class",
    "combined_linear_s",
    "feeds_state_update",
    "gradient_shapes",
    "is_gradient_op",
    "price_choice",
    "price_reshard",
    "price_strategy",
    "reshard_linear_s",
    "reshard_state_split",
]
