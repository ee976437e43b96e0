"""Score a plan with the cost model: compute, every collective, overlap, memory.

:func:`evaluate_plan` scores *any* plan, hand-written baselines included: it fixes the
plan's input layouts and pinned activations and lets everything else take its cheapest
consistent layout, the way XLA's sharding propagation completes a partially annotated
program (it solves the same ILP with those choices fixed). For a plan the planner made,
the result equals the planner's own prediction (``Predicted.objective``).

Example:
    >>> ev = evaluate_plan(graph, plan, Cluster.preset("dgx-a100-80gb"))
    >>> ev.step_time_s == plan.predicted.step_time_s
    True
    >>> print(ev.summary())
    mesh {'data': 2, 'tensor': 4}: step 0.015 ms (compute 0.004 ms, exposed comm 0.011 ms of 0.011 ms; with overlap bounded by compute 0.015 ms)
    memory 0.002 GiB/device activations 0.001, grads 0.000, inputs 0.000, optimizer 0.001, params 0.000
      all-reduce      over tensor       tensor       x1            0.06 MiB     0.011 ms
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from autopar.errors import InvalidOptionError, LoadPlanError
from autopar.plan import ActivationConstraint, Plan, Predicted, PredictedCollective
from autopar.primitives import MATMULS
from autopar.search.costs import CostContext
from autopar.search.ilp import BuiltProblem, build, with_accumulators
from autopar.search.pricing import price_choice
from autopar.search.sharding import (
    Sharding,
    from_plan_spec,
    reshard_steps,
    to_plan_spec,
    uneven_plan,
)
from autopar.search.solver import solve
from autopar.trace.graph import Graph


@dataclass(frozen=True)
class Evaluation:
    """The cost model's verdict on one plan, per device and per training step.

    Attributes:
        mesh: the plan's mesh.
        step_time_s: the linear step time (:mod:`autopar.search.pricing`): compute plus
            every collective, the overlappable classes (gradient reductions, parameter
            gathers) counted at ``1 - overlap_efficiency``. For a planner's plan, exactly
            the objective its ILP minimised.
        objective_s: the same number (kept for callers that read it under this name).
        compute_s: compute time.
        backward_compute_s: the backward pass's part of it.
        communication_s: all collective time the program runs (hidden or not).
        exposed_communication_s: ``step_time_s - compute_s``.
        hidden_communication_s: the overlappable seconds the linear form hides.
        overlap_step_time_s: the overlap refinement: ``cost_models.compose_step_time`` of
            the same parts, with hiding bounded by the compute available.
        merged_reshard_s: seconds in ``step_time_s`` for reshards XLA's CSE merges.
        communication_by_class: seconds per ``cost_models.COMM_CLASSES`` class.
        collectives: per (kind, axes, class): total bytes, count and time per step.
        memory_bytes_per_device: peak bytes per device.
        memory_breakdown: params / grads / optimizer / activations / inputs at the peak.
        flops_per_device: FLOPs each device executes per step.
        memory_limit_bytes: the bound the plan was made under (if any).
        fits: whether the peak is within that bound.
        solve_status: status of the completion solve.
    """

    mesh: Mapping[str, int]
    objective_s: float
    step_time_s: float
    compute_s: float
    backward_compute_s: float
    communication_s: float
    exposed_communication_s: float
    communication_by_class: Mapping[str, float]
    collectives: tuple[PredictedCollective, ...]
    memory_bytes_per_device: float
    memory_breakdown: Mapping[str, float]
    flops_per_device: float
    memory_limit_bytes: float | None = None
    solve_status: str = "optimal"
    hidden_communication_s: float = 0.0
    overlap_step_time_s: float = 0.0
    merged_reshard_s: float = 0.0
    extra: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("mesh", "communication_by_class", "memory_breakdown", "extra"):
            object.__setattr__(self, name, MappingProxyType(dict(getattr(self, name))))
        object.__setattr__(self, "collectives", tuple(self.collectives))

    @property
    def fits(self) -> bool:
        return (
            self.memory_limit_bytes is None
            or self.memory_bytes_per_device <= self.memory_limit_bytes
        )

    def to_predicted(self) -> Predicted:
        """The plan's ``Predicted`` record."""
        return Predicted(
            step_time_s=self.step_time_s,
            compute_s=self.compute_s,
            communication_s=self.communication_s,
            exposed_communication_s=self.exposed_communication_s,
            bubble_s=float(self.extra.get("bubble_s", 0.0)),
            memory_bytes_per_device=self.memory_bytes_per_device,
            memory_breakdown=dict(self.memory_breakdown),
            flops_per_device=self.flops_per_device,
            collectives=self.collectives,
            objective=self.objective_s,
            overlap_step_time_s=self.overlap_step_time_s,
            merged_reshard_s=self.merged_reshard_s,
        )

    def summary(self) -> str:
        """A few lines for humans."""
        lines = [
            f"mesh {dict(self.mesh)}: step {self.step_time_s * 1e3:.3f} ms "
            f"(compute {self.compute_s * 1e3:.3f} ms, exposed comm "
            f"{self.exposed_communication_s * 1e3:.3f} ms of {self.communication_s * 1e3:.3f} ms; "
            f"with overlap bounded by compute {self.overlap_step_time_s * 1e3:.3f} ms)",
            f"memory {self.memory_bytes_per_device / 2**30:.3f} GiB/device "
            + ", ".join(f"{k} {v / 2**30:.3f}" for k, v in sorted(self.memory_breakdown.items())),
        ]
        for c in sorted(self.collectives, key=lambda c: -c.time_s):
            lines.append(
                f"  {c.kind:<15} over {','.join(c.axes):<12} {c.where:<12} x{c.count:<6} "
                f"{c.bytes / 2**20:10.2f} MiB {c.time_s * 1e3:9.3f} ms"
            )
        return "\n".join(lines)


def decode(
    bp: BuiltProblem,
    choice: Sequence[int],
    rename: Mapping[str, str] | None = None,
    *,
    status: str = "optimal",
    memory_limit: float | None = None,
    sources: list[CollectiveSource] | None = None,
) -> Evaluation:
    """Turn a choice for a built problem into an :class:`Evaluation`, priced by
    :func:`autopar.search.pricing.price_choice` (the door the ILP's costs came through).

    ``rename`` maps the problem's mesh axis names to the names the plan reports. If
    ``sources`` is a list, one :class:`CollectiveSource` per predicted collective is
    appended to it (which operation or value it comes from).
    """
    rename = dict(rename or {})
    priced = price_choice(bp, choice, rename)
    colls: dict[tuple[str, tuple[str, ...], str], list[float]] = {}
    for c in priced.emitted:
        if sources is not None:
            sources.append(CollectiveSource(c.kind, c.axes, c.nbytes, c.executions, c.cls, c.where))
        acc = colls.setdefault((c.kind, c.axes, c.cls), [0.0, 0.0, 0.0])
        acc[0] += c.executions * c.nbytes
        acc[1] += c.executions
        acc[2] += c.executions * c.own_s
    for r in priced.combined:
        acc = colls[(r.kind, tuple(rename.get(a, a) for a in r.axes), "dp_grad")]
        acc[2] += r.executions * r.latency_s
    collectives = tuple(
        PredictedCollective(kind, axes, b, max(1, round(n)), t, cls)
        for (kind, axes, cls), (b, n, t) in sorted(colls.items())
    )
    by_class: dict[str, float] = {}
    for c in collectives:
        by_class[c.where] = by_class.get(c.where, 0.0) + c.time_s
    comm = sum(by_class.values())
    step = priced.step_time_s
    exposed = step - priced.compute_s
    peak, moment, breakdown = bp.peak(choice)
    return Evaluation(
        mesh={rename.get(a, a): s for a, s in bp.ctx.mesh_dict.items()},
        objective_s=step,
        step_time_s=step,
        compute_s=priced.compute_s,
        backward_compute_s=priced.backward_compute_s,
        communication_s=comm,
        exposed_communication_s=exposed,
        communication_by_class=by_class,
        collectives=collectives,
        memory_bytes_per_device=peak,
        memory_breakdown=breakdown,
        flops_per_device=priced.flops,
        memory_limit_bytes=memory_limit,
        solve_status=status,
        hidden_communication_s=max(0.0, comm + priced.merged_reshard_s - exposed),
        overlap_step_time_s=priced.overlap_step_time().total_s,
        merged_reshard_s=priced.merged_reshard_s,
        extra={"peak_moment": moment, "problem_objective": bp.problem.objective(choice)},
    )


@dataclass(frozen=True)
class CollectiveSource:
    """Where one predicted collective comes from (``decode(..., sources=[])``).

    ``where`` names the operation that runs it (its strategy's own collective) or reads
    the value resharded (with the layouts before and after and the value's shape).
    """

    kind: str
    axes: tuple[str, ...]
    bytes: float
    count: float
    where_class: str
    where: str


def rename_spec(spec: Sharding, rename: Mapping[str, str]) -> Sharding:
    """``spec`` with its mesh axes renamed (problem axis names -> the plan's)."""
    return tuple(tuple(rename.get(a, a) for a in dim) for dim in spec)


def pinned_activations(
    bp: BuiltProblem,
    choice: Sequence[int],
    rename: Mapping[str, str] | None = None,
    *,
    resharded: bool = True,
) -> tuple[ActivationConstraint, ...]:
    """Pin every group leader's results, every value that work on a state input reads,
    and (``resharded``) every operand the plan reads in another layout than its
    producer's.

    Inside a group the followers take the layout their leader implies, which is also
    what XLA's propagation infers from the leader. Work led by a state input (a running
    statistic's update, an optimizer step) is where propagation arrives from the other
    direction: a state leaf sharded to save memory would push its layout back into the
    activations it combines with (a batch-norm mean sharded over channels, and with it
    the convolution before it). Pinned, XLA keeps the layout the ILP priced. (Pinning
    every value read across groups was tried: it perturbs XLA's fusion of GPT's
    followers and costs more collectives than it saves.) A resharded operand is pinned
    as that consumer reads it (``ActivationConstraint.operand``): XLA's dot partitioner
    otherwise picks its own way to move it (a partial sum and an all-reduce for a
    contracted dimension both operands split, where the plan gathers one operand once for
    the forward and the backward).
    """
    rename = dict(rename or {})
    crossing = {
        (e.ref.op, e.ref.port)
        for e in bp.edges
        if bp.ops[bp.groups[bp.op_group[e.op][0]].ops[0]].kind == "input"
    }
    out = []
    for group in bp.groups:
        for pos, oi in enumerate(group.ops):
            op = bp.ops[oi]
            if op.kind != "node" or op.node.id < 0:
                continue
            st = bp.strategy(op.index, choice)
            for port, spec in enumerate(st.outs):
                if not op.node.out_tensors[port].ndim:
                    continue
                if pos and (oi, port) not in crossing:
                    continue
                out.append(_pin(op, spec, rename, port))
    if resharded:
        out.extend(_resharded_operands(bp, choice, rename))
    return tuple(out)


def _pin(
    op: Any,
    spec: Sharding,
    rename: Mapping[str, str],
    port: int = 0,
    operand: int | None = None,
) -> ActivationConstraint:
    """The constraint laying out ``op``'s result ``port`` (or, with ``operand``, its
    input as it reads it) as ``spec``, in the plan's axis names."""
    return ActivationConstraint(
        op.node.id,
        port,
        to_plan_spec(rename_spec(spec, rename)),
        op.scope,
        op.node.name_stack,
        operand=operand,
    )


def _reads_several(op: Any) -> bool:
    return sum(1 for t in op.node.in_tensors if t.ndim) > 1


def _resharded_operands(
    bp: BuiltProblem, choice: Sequence[int], rename: Mapping[str, str]
) -> list[ActivationConstraint]:
    """An operand constraint wherever the plan reads a value in another layout than it
    was made in (with the value pinned where it is made), and on every contraction's
    operands (``autopar.primitives.MATMULS``): XLA partitions a contraction by its
    operands' layouts, and picks its own way (a partial sum and an all-reduce, a gather
    of both operands) when those are left to propagation."""
    out = []
    seen: set[tuple] = set()
    sources: set[tuple[int, int]] = {
        (oi, port)
        for g in bp.groups
        for oi in g.ops[:1]
        for port in range(len(bp.ops[oi].node.out_tensors))
    }  # group leaders: pinned already
    for oi, op in enumerate(bp.ops):
        if op.kind != "node" or op.node.id < 0 or oi not in bp.op_group:
            continue
        st = bp.strategy(oi, choice)
        for k, ref in enumerate(op.operands):
            if ref is None or ref.op not in bp.op_group or k >= len(st.ins):
                continue
            need = st.ins[k]
            if need is None or not op.node.in_tensors[k].ndim:
                continue
            have = bp.spec(ref, choice)
            contraction = op.node.primitive in MATMULS
            if (have == need and not contraction) or (op.node.id, k, op.scope) in seen:
                continue
            seen.add((op.node.id, k, op.scope))
            # Step by step, as priced (applied in order by the lowering).
            t = op.node.in_tensors[k]
            steps = reshard_steps(t.shape, have, need, bp.ctx.mesh) if have != need else (need,)
            out.extend(_pin(op, step, rename, operand=k) for step in steps)
            if have != need and (oi, 0) not in sources and _reads_several(op):
                # The consumer's results too: propagation would otherwise lay out an
                # n-ary consumer like its other operands and reshard again after. (Not
                # for unary ones: a pinned reshape or transpose right after a reshard
                # leaves XLA two layouts it cannot convert between efficiently.)
                sources.update((oi, port) for port in range(len(st.outs)))
                out.extend(
                    _pin(op, spec, rename, port)
                    for port, spec in enumerate(st.outs)
                    if op.node.out_tensors[port].ndim
                )
            # And the value where it is made: a consumer's constraint alone propagates
            # back into an unpinned producer, moving the reshard elsewhere. Not when the
            # producer's layout follows a loop body's input (its group leader): the
            # lowering cannot pin what enters a loop, so XLA may bring it in another
            # layout, and a pin on the producer would reshard it on every iteration.
            src = bp.ops[ref.op]
            lead = bp.ops[bp.groups[bp.op_group[ref.op][0]].ops[0]]
            if (
                have != need
                and src.kind == "node"
                and src.node.id >= 0
                and src.scope == op.scope
                and lead.scope == op.scope
                and lead.kind != "body_input"
                and (ref.op, ref.port) not in sources
                and not ref.delta
            ):
                sources.add((ref.op, ref.port))
                out.append(_pin(src, have, rename, ref.port))
    return out


def plan_constraints(graph: Graph, plan: Plan) -> tuple[dict[int, Sharding], dict]:
    """The plan's input layouts (by graph input index) and pinned activations."""
    if len(plan.inputs) != len(graph.inputs):
        raise LoadPlanError(
            f"the plan has {len(plan.inputs)} inputs but the graph has {len(graph.inputs)}; "
            "it was made for another function signature."
        )
    fixed: dict[int, Sharding] = {}
    for gi, rec in zip(graph.inputs, plan.inputs, strict=True):
        if tuple(rec.shape) != gi.tensor.shape:
            raise LoadPlanError(
                f"plan input {rec.path!r} has shape {tuple(rec.shape)} but the graph's input "
                f"{gi.path!r} has {gi.tensor.shape}; the plan is for another signature."
            )
        _check_axes(rec.spec, plan.mesh, rec.path)
        fixed[gi.index] = from_plan_spec(rec.spec, gi.tensor.ndim)
    constraints = {}
    for a in plan.activations:
        _check_axes(a.spec, plan.mesh, f"activation {a.name or a.node}")
        if a.operand is not None:
            continue  # a consumer's view of a value: implied by the consumer's strategy
        constraints[(tuple(tuple(s) for s in a.scope), a.node, a.output)] = a.spec
    return fixed, constraints


def _operand_constraints(graph: Graph, plan: Plan) -> dict:
    """How the plan reads operands: ``(scope, node, operand)`` -> the layout the equation
    reads it in (the last of a reshard's steps), as internal shardings."""
    out = {}
    for a in plan.activations:
        if a.operand is None:
            continue
        scope = tuple(tuple(s) for s in a.scope)
        g = graph
        for scan_id, body_index in scope:
            g = g.node(scan_id).body[body_index]
        rank = g.node(a.node).in_tensors[a.operand].ndim
        out[(scope, a.node, a.operand)] = from_plan_spec(a.spec, rank)
    return out


def _check_axes(spec, mesh: Mapping[str, int], where: str) -> None:
    for e in spec:
        for a in (e,) if isinstance(e, str) else (e or ()):
            if a not in mesh:
                raise LoadPlanError(
                    f"{where}: spec {spec} names axis {a!r}, not in mesh {dict(mesh)}"
                )


def _resolve_constraints(graph: Graph, raw: dict) -> dict:
    """Plan specs -> internal shardings (needs the pinned values' ranks)."""
    out = {}
    for (scope, node_id, port), spec in raw.items():
        g = graph
        for scan_id, body_index in scope:
            g = g.node(scan_id).body[body_index]
        rank = g.node(node_id).out_tensors[port].ndim
        out[(scope, node_id, port)] = from_plan_spec(spec, rank)
    return out


PROPAGATION_PENALTY = 1.0
"""How the completion solve mimics XLA's sharding propagation, in units of one
all-reduce's latency over the whole mesh: a forward or backward op doing all its work on
every device costs this much more in the objective than one split over all devices
(proportionally in between). So a value keeps the partitioning it inherits rather than
being gathered to save a small collective (what propagation does), while no op is
resharded with a collective of its own just to split it further. Reported times never
include it."""


# Completions already solved are memoised on the graph (``graph._completed``, dropped with
# it; a weak-keyed table would be kept alive by the results, which refer to the graph):
# the search completes the same plan more than once (the planner's polish, then the
# outer loop's pricing of that plan as one pipeline stage), and each completion rebuilds
# the whole problem (on a 48-block encoder-decoder, ~30 s a build). Entries:
# (accumulation, key, time limit, result), the newest last.
_COMPLETED_PER_GRAPH = 8


def _completion_key(
    plan: Plan,
    cluster: Any,
    coarsen: bool,
    as_propagation: bool,
    dp_grad_weight: float | None = None,
) -> str:
    """What a completion depends on besides the graph and the accumulation: the mesh, the
    inputs' and pins' layouts, the microbatch count, the cluster and the flags."""
    m = plan.pipeline.microbatches if plan.pipeline is not None else 1
    return repr(
        (
            tuple(plan.mesh.items()),
            tuple((r.path, tuple(r.spec)) for r in plan.inputs),
            plan.activations,
            m,
            bool(plan.pipeline is not None and plan.pipeline.num_stages > 1),
            plan.remat,
            cluster,
            coarsen,
            as_propagation,
            dp_grad_weight,
        )
    )


def _complete(
    graph: Graph,
    plan: Plan,
    cluster: Any,
    time_limit_s: float,
    coarsen: bool,
    accumulation: Any = None,
    as_propagation: bool = True,
    dp_grad_weight: float | None = None,
) -> tuple[BuiltProblem, Any]:
    """:func:`_solve_completion`, memoised per graph: an equal plan completed again (by
    the same accumulation, under a time limit no longer than the one solved, or solved
    to optimality) returns the first result."""
    memo = graph.__dict__.setdefault("_completed", [])
    key = _completion_key(plan, cluster, coarsen, as_propagation, dp_grad_weight)
    for acc, k, limit, result in memo:
        if acc is accumulation and k == key:
            if result[1].status == "optimal" or limit >= time_limit_s:
                return result
    result = _solve_completion(
        graph, plan, cluster, time_limit_s, coarsen, accumulation, as_propagation, dp_grad_weight
    )
    memo.append((accumulation, key, time_limit_s, result))
    del memo[:-_COMPLETED_PER_GRAPH]
    return result


def _solve_completion(
    graph: Graph,
    plan: Plan,
    cluster: Any,
    time_limit_s: float,
    coarsen: bool,
    accumulation: Any = None,
    as_propagation: bool = True,
    dp_grad_weight: float | None = None,
) -> tuple[BuiltProblem, Any]:
    if plan.pipeline is not None and plan.pipeline.num_stages > 1:
        raise InvalidOptionError(
            "pipelined plans cannot be evaluated yet (pipelining is a later stage)."
        )
    if plan.num_devices > cluster.num_devices:
        raise LoadPlanError(
            f"the plan's mesh {dict(plan.mesh)} needs {plan.num_devices} devices; the cluster has "
            f"{cluster.num_devices}."
        )
    fixed, raw = plan_constraints(graph, plan)
    # Uneven input / output splits (ZeRO-3's padded partitions) are priced as padded.
    ctx = CostContext(cluster, plan.mesh, padded=uneven_plan(plan), dp_grad_weight=dp_grad_weight)
    # A plan with pinned activations (the planner's, or complete_plan's) is complete: its
    # remaining freedom (loop-body inputs) is resolved at the cheapest, as planned. Only
    # a plan that pins nothing is completed the way propagation would (unless the caller
    # asks for the planner's own objective: ``as_propagation=False``).
    penalty = (
        0.0
        if plan.activations or not as_propagation
        else PROPAGATION_PENALTY * ctx.latency("all-reduce", tuple(plan.mesh))
    )
    m = plan.pipeline.microbatches if plan.pipeline is not None else 1
    repeat = None
    if m > 1:
        if accumulation is None or accumulation.microbatches != m:
            raise LoadPlanError(
                f"the plan splits the batch into {m} microbatches: score it with the step "
                "function (autopar.evaluate(fn, plan, cluster, *args)), which is re-traced "
                "on one microbatch."
            )
        graph = accumulation.micro
        repeat = dict.fromkeys(accumulation.gradient_eqns, float(m))
    if plan.remat != "none":
        repeat = remat_repeats(graph, plan.remat, repeat)
    bp = build(
        graph,
        ctx,
        fixed_inputs=fixed,
        constraints=_resolve_constraints(graph, raw),
        coarsen_groups=coarsen,
        replication_penalty_s=penalty,
        repeat=repeat,
        operand_constraints=_operand_constraints(graph, plan),
        remat=plan.remat,
    )
    if m > 1:
        bp = with_accumulators(bp, accumulation)
    # One worker: CP-SAT is deterministic then, so scoring a plan twice (the planner's
    # polish, a user's evaluate) gives the same completion. A planner's plan leaves
    # almost nothing free, so this solve is small.
    sol = solve(bp.problem, time_limit_s, num_workers=1)
    if not sol.ok:
        raise LoadPlanError(f"could not complete the plan's layouts (solver status {sol.status}).")
    return bp, sol


def remat_repeats(
    graph: Graph, policy: str, repeat: Mapping[int, float] | None = None
) -> dict[int, float]:
    """``repeat`` (top-level node id -> runs per step) with the forward nodes that
    ``policy`` recomputes in the backward pass run once more: the nodes the lowering
    re-runs (:func:`autopar.lower.remat.plan_remat`), so their FLOPs and the collectives
    of their layouts are priced twice, as the lowered program runs them. The memory side
    is the build's ``remat`` (:func:`autopar.search.build.memory.liveness`).

    Raises:
        LowerPlanError: what ``plan_remat`` refuses (layers inside a scan over layers, no
            layers, an unknown policy).

    Example:
        >>> from benchmarks.models.gpt import GPTConfig, make_train_step
        >>> step, args = make_train_step(GPTConfig.preset("tiny", scan_layers=False), 2)
        >>> g = autopar.trace(step, *args)
        >>> again = remat_repeats(g, "full")
        >>> set(again.values()), all(g.nodes[n].phase == "forward" for n in again)
        ({2.0}, True)
    """
    from autopar.lower.remat import plan_remat

    out = dict(repeat or {})
    for block in plan_remat(graph, policy).blocks:
        for nid in block.nodes:
            out[nid] = 2.0 * out.get(nid, 1.0)  # once more per microbatch
    return out


def complete_layouts(
    graph: Graph,
    plan: Plan,
    cluster: Any,
    *,
    time_limit_s: float = 60.0,
    coarsen: bool = True,
    accumulation: Any = None,
    dp_grad_weight: float | None = None,
) -> tuple[BuiltProblem, Any]:
    """The plan's problem with everything it pins fixed, solved: ``(built, solution)``.

    This is the problem :func:`evaluate_plan` scores; the planner solves it once more for
    the plan it writes (what the plan pins may be made more cheaply than the first
    solve, stopped by its time limit, found), so its prediction is what
    ``evaluate_plan`` reports for it. ``dp_grad_weight`` completes it for another
    program's gradient reductions instead (:class:`CostContext`)."""
    return _complete(
        graph, plan, cluster, time_limit_s, coarsen, accumulation, dp_grad_weight=dp_grad_weight
    )


def evaluate_plan(
    graph: Graph,
    plan: Plan,
    cluster: Any,
    *,
    time_limit_s: float = 60.0,
    coarsen: bool = True,
    memory_limit_bytes: float | None = None,
    sources: list[CollectiveSource] | None = None,
    accumulation: Any = None,
) -> Evaluation:
    """Score ``plan`` for ``graph`` on ``cluster`` with the planner's cost model.

    Input layouts and pinned activations come from the plan. A plan that pins no
    activation (a hand-written baseline) is completed the way XLA's sharding propagation
    would (:data:`PROPAGATION_PENALTY`): the cheapest layouts that keep the forward and
    backward compute partitioned. A plan with pins (the planner's) leaves only loop-body
    inputs free, which take their cheapest layouts, as planned.

    Args:
        graph: the traced step the plan is for.
        plan: any plan (from :func:`plan_graph` or written by hand).
        cluster: a ``cost_models.Cluster``.
        time_limit_s: limit of the completion solve.
        coarsen: as in ``SearchOptions.coarsen`` (keep it equal to the planner's).
        memory_limit_bytes: report whether the plan fits this bound (``Evaluation.fits``).
        sources: if a list, filled with one :class:`CollectiveSource` per predicted
            collective: which operation runs it or which value it reshards (the first
            place to look when ``autopar.verify`` disagrees).
        accumulation: the step analysed for microbatching
            (:func:`autopar.lower.split.plan_accumulation`), for a plan with microbatches.

    Returns:
        The breakdown. For a plan the planner made (every layout pinned), the layouts are
        the planner's and so is the prediction.

    Raises:
        LoadPlanError: the plan does not match the graph's inputs or mesh.
        InvalidOptionError: the plan pipelines (not supported yet).

    Example:
        >>> import autopar
        >>> dp = autopar.baselines.data_parallel(graph, {"data": 8})
        >>> ev = evaluate_plan(graph, dp, cluster)
        >>> dict(ev.mesh), f"{ev.step_time_s * 1e6:.1f} us", ev.fits
        ({'data': 8}, '55.7 us', True)
        >>> sorted(ev.communication_by_class)   # gradients, and the loss's mean over data
        ['batch_reduce', 'dp_grad']
    """
    bp, sol = _complete(graph, plan, cluster, time_limit_s, coarsen, accumulation)
    return decode(
        bp, sol.choice, status=sol.status, memory_limit=memory_limit_bytes, sources=sources
    )


def complete_plan(
    graph: Graph,
    plan: Plan,
    cluster: Any,
    *,
    time_limit_s: float = 60.0,
    coarsen: bool = True,
    memory_limit_bytes: float | None = None,
    as_propagation: bool = True,
) -> Plan:
    """``plan`` with every activation layout pinned and its prediction filled in.

    ``as_propagation``: complete a plan that pins nothing the way XLA's propagation would
    (right for a hand-written baseline); ``False``: by the planner's own objective (right
    for layouts exported from a searched plan, :func:`autopar.export.plan_from_specs`).

    A hand-written plan (``autopar.baselines``) fixes only the inputs' and outputs'
    layouts; XLA decides the rest when it compiles. Completing it first (as
    :func:`evaluate_plan` does) and pinning the result makes the compiled program the
    one that was scored, so ``autopar.verify`` compares like with like.

    Example:
        >>> from autopar import baselines
        >>> hand = baselines.data_parallel(graph, {"data": 8})
        >>> dp = complete_plan(graph, hand, Cluster.preset("dgx-a100-80gb"))
        >>> len(hand.activations), len(dp.activations) > 0, dp.predicted is not None
        (0, True, True)
    """
    import dataclasses

    bp, sol = _complete(graph, plan, cluster, time_limit_s, coarsen, as_propagation=as_propagation)
    ev = decode(bp, sol.choice, status=sol.status, memory_limit=memory_limit_bytes)
    return dataclasses.replace(
        plan,
        activations=pinned_activations(bp, sol.choice),
        predicted=ev.to_predicted(),
        cluster=plan.cluster if plan.cluster is not None else cluster.to_json(),
    )


__all__ = [
    "PROPAGATION_PENALTY",
    "complete_layouts",
    "CollectiveSource",
    "Evaluation",
    "complete_plan",
    "decode",
    "evaluate_plan",
    "pinned_activations",
    "rename_spec",
]
