"""Pricing a pipeline plan: stage work, the schedule's bubble, stage-to-stage sends, memory.

A pipeline plan (``plan.pipeline`` with ``p > 1`` stages over the ``pipe`` axis) is
priced in four steps, each from a model the rest of the search already uses:

1. **Inside a stage** the other mesh axes are intra-op parallel: the step on one
   microbatch is completed on the sub-mesh without ``pipe`` with the plan's layouts
   (``pipe`` struck out), by the same problem :func:`evaluate_plan` solves, and every op
   is priced by :mod:`autopar.search.pricing` (compute and its own collectives, reshards).
2. **Stages.** Each op's seconds go to a stage: an op of a layer to the stage holding that
   layer (``plan.pipeline.stages``), a scan over layers split by each stage's share of
   its iterations, unlabelled forward work to the stage of the layer before it (the
   embedding to the first stage), unlabelled backward work to the stage of the layer
   after it (the head's backward to the last stage). That gives per-stage forward and
   backward seconds of one microbatch. An interleaved plan (``plan.pipeline.chunks = v
   > 1``, Megatron-LM's interleaved 1F1B) cuts the model into ``p v`` chunks (virtual
   stages; chunk ``k`` runs on device ``k % p``), so the seconds go to chunks.
3. **Schedule.** ``cost_models.simulate_schedule`` runs the schedule (GPipe, 1F1B,
   interleaved 1F1B with its ``v`` chunks of unequal work) op by op with those times and the time of one direction's sends between neighbours
   (``p2p`` over the ``pipe`` axis): its makespan is the pipeline's time and
   ``makespan - busiest stage's work`` its bubble. The sends are the runtime's
   (:mod:`autopar.lower.pipeline`): every tick of the schedule's table, one ``ppermute``
   per buffer of the padded forward and backward layouts (idle ticks send zeros), so the
   predicted ``collective-permute`` count and bytes are ticks x buffers and ticks x their
   bytes per device, which is what the compiled program runs. The update runs once
   after the flush (its ops priced as in 1); parameters replicated over ``pipe``
   (everything but a scanned layer stack) have their gradients all-reduced over ``pipe``
   first. The stages' own collectives (over the other axes) are reported as the
   intra-op pricing emits them, per microbatch times ``m``, summed over the stages.
4. **Memory** per device: the stage's share of parameters and optimizer state (a
   scanned stack is split over ``pipe``, the rest replicated), the accumulators, and
   what the runtime carries from tick to tick on every device: its stash of in-flight
   microbatches (the most any stage keeps: GPipe ``m``, 1F1B ``p``; interleaved, the
   chunk activations Megatron-LM's warm-up keeps on device 0, ``2(p-1) + (v-1)p + 1``
   chunks of ``1/v`` of a stage each, bounded by ``m v``), the spare stash slot, the
   receive buffers, and one tick's working set (:func:`_stage_memory`). A scanned stack
   run interleaved is relaid out by chunk: the program's ``relayout_sends`` (chunks in,
   gradients back, one ``ppermute`` each over ``pipe`` per step) are priced as sends and
   its ``relayout_copy_bytes`` (the stack in chunk order) held beside the stack.

The step time reported is the makespan plus the update, the exposed gradient all-reduce,
the stack's relayout and the compute of the update; its parts are in
``Evaluation.extra`` (per device, and per chunk when interleaved). That is the linear
price the search ranks by: inside the stages each overlappable second (``dp_grad``,
``fsdp_gather``) counts at ``1 - overlap_efficiency`` however little compute there is.
``Evaluation.overlap_step_time_s`` is the same program with hiding bounded by the
compute (:func:`cost_models.overlap.bound_linear_overlap`, gathers first), and
``extra["after_flush_step_s"]`` the step of a program that reduces the stages'
data-parallel gradients once after the flush instead of in every microbatch (Megatron-LM
2021, the DeepSpeed pipeline engine; the lowered program here reduces them inside each
stage's backward piece, per microbatch: ``tests/lower/test_verify_pipeline.py``): the
schedule simulated again on the stage work without those reductions, then each device's
reduction of its accumulated gradients (one microbatch's bytes), exposed, the devices at
once. ``reduce_after_flush=True`` also completes the layouts the plan leaves free for
that program (a microbatch's reduction weighs ``1 / m`` in the completion).

Example:
    >>> from benchmarks.models.gpt import GPTConfig, make_train_step
    >>> gstep, gargs = make_train_step(GPTConfig.preset("tiny"), 8)
    >>> plan = autopar.baselines.pipeline(gstep, {"pipe": 2, "data": 4}, *gargs, microbatches=4)
    >>> ev = autopar.evaluate(gstep, plan, cluster, *gargs)  # the program read off the runtime
    >>> ev.extra["bubble_s"] > 0, ev.step_time_s > ev.compute_s
    (True, True)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import cost_models
from autopar.errors import LoadPlanError
from autopar.plan import (
    ActivationConstraint,
    PipelinePlan,
    Plan,
    PredictedCollective,
    TensorSharding,
)
from autopar.search.evaluate import Evaluation, complete_layouts, pinned_activations
from autopar.search.pricing import (
    price_choice,
    price_reshard,
    price_strategy,
    reshard_linear_s,
)
from autopar.trace.graph import Graph
from cost_models.overlap import bound_linear_overlap


def _strip(rec: TensorSharding, axis: str) -> TensorSharding:
    spec = []
    for e in rec.spec:
        axes = () if e is None else ((e,) if isinstance(e, str) else tuple(e))
        keep = tuple(a for a in axes if a != axis)
        spec.append(None if not keep else (keep[0] if len(keep) == 1 else keep))
    return dataclasses.replace(rec, spec=tuple(spec))


def _on_pipe(rec: TensorSharding, axis: str) -> bool:
    return any(
        e == axis or (isinstance(e, tuple | list) and axis in e) for e in rec.spec if e is not None
    )


def node_stages(graph: Graph, stages: Sequence[tuple[int, int]]) -> dict[int, list[float]]:
    """Top-level node id -> share of its work per stage (lists of ``len(stages)``)."""
    p = len(stages)
    stage_of_layer = {}
    for s, (a, b) in enumerate(stages):
        for layer in range(a, b):
            stage_of_layer[layer] = s
    # A scan over layers: its iterations are graph layers sharing the loop's nodes.
    scan_share: dict[int, list[float]] = {}
    for layer in graph.layers:
        if layer.kind == "scan":
            for nid in layer.nodes:
                share = scan_share.setdefault(nid, [0.0] * p)
                share[stage_of_layer.get(layer.index, 0)] += 1.0
    out: dict[int, list[float]] = {}
    # Forward: unlabelled work goes with the layer before it (the embedding to the first
    # stage); backward, walked in program order too, with the layer after it (the
    # head's backward to the last stage).
    for backward, start, edge in ((False, 0, max), (True, p - 1, min)):
        current = start
        for n in graph.nodes:
            if (n.phase == "backward") != backward:
                continue
            if n.id in scan_share:
                tot = sum(scan_share[n.id])
                out[n.id] = [x / tot for x in scan_share[n.id]]
                current = edge(s for s, x in enumerate(out[n.id]) if x)
                continue
            if n.layer is not None and n.layer in stage_of_layer:
                current = stage_of_layer[n.layer]
            share = [0.0] * p
            share[current] = 1.0
            out[n.id] = share
    return out


def node_layers(graph: Graph) -> dict[int, dict[int, float]]:
    """Top-level node id -> ``{layer: share}``: :func:`node_stages` with one stage per layer
    (``graph.layers`` indices), kept sparse. Unlabelled forward work before the first layer
    (the embedding) goes to layer 0, after the last one (the head, the loss) to the last
    layer; a scan over layers is shared evenly by its iterations.

    Example:
        >>> shares = node_layers(graph)
        >>> sorted({k for d in shares.values() for k in d}) == list(range(len(graph.layers)))
        True
    """
    n_layers = len(graph.layers)
    scan_share: dict[int, dict[int, float]] = {}
    for layer in graph.layers:
        if layer.kind == "scan":
            for nid in layer.nodes:
                d = scan_share.setdefault(nid, {})
                d[layer.index] = d.get(layer.index, 0.0) + 1.0
    out: dict[int, dict[int, float]] = {}
    for backward, start, edge in ((False, 0, max), (True, max(0, n_layers - 1), min)):
        current = start
        for n in graph.nodes:
            if (n.phase == "backward") != backward:
                continue
            if n.id in scan_share:
                tot = sum(scan_share[n.id].values())
                out[n.id] = {k: x / tot for k, x in scan_share[n.id].items()}
                current = edge(out[n.id])
                continue
            if n.layer is not None and 0 <= n.layer < n_layers:
                current = n.layer
            out[n.id] = {current: 1.0}
    return out


def _flat_plan(graph: Graph, plan: Plan, pipe_axis: str, *, keep_pins: bool) -> Plan:
    """The stages' plan: the mesh without ``pipe_axis``, the layouts with it struck out,
    one microbatched stage; the plan's activation pins kept (``keep_pins``) or not."""
    pp = plan.pipeline
    for c in plan.activations if keep_pins else ():
        for e in c.spec:
            if e == pipe_axis or (isinstance(e, tuple | list) and pipe_axis in e):
                raise LoadPlanError(
                    f"activation constraint {c.name!r} (node {c.node}, scope {c.scope}) of "
                    f"the pipeline plan splits over {pipe_axis!r}; a pipeline plan pins the "
                    "layouts inside its stages, on the mesh without the pipe axis "
                    "(autopar.search.stages.pipeline_activations)."
                )
    return dataclasses.replace(
        plan,
        mesh={a: s for a, s in plan.mesh.items() if a != pipe_axis} or {"data": 1},
        inputs=tuple(_strip(r, pipe_axis) for r in plan.inputs),
        outputs=tuple(_strip(r, pipe_axis) for r in plan.outputs),
        activations=plan.activations if keep_pins else (),
        pipeline=PipelinePlan(((0, len(graph.layers)),), "gpipe", pp.microbatches),
    )


def pipeline_activations(
    graph: Graph,
    plan: Plan,
    cluster: Any,
    accumulation: Any,
    *,
    time_limit_s: float = 60.0,
    pipe_axis: str = "pipe",
    pins: Sequence[ActivationConstraint] = (),
    reduce_after_flush: bool = False,
) -> tuple[ActivationConstraint, ...]:
    """The activation pins that make a pipeline's stages run what was priced.

    The plan's layouts, ``pipe`` struck out, are completed on the step traced on one
    microbatch (``accumulation.micro``) and the sub-mesh without ``pipe`` (the
    completion :func:`evaluate_pipeline` prices a plan without pins by), and the result
    is pinned as for any plan (:func:`autopar.search.evaluate.pinned_activations`), less
    what the pipeline runtime does not run as traced (``pins``: the stages' plan's own
    pins on the sub-mesh, e.g. the intra-op search's, completed from instead of the
    inputs alone):

    * pins on the update's equations: the update runs once, outside the stages, on the
      whole mesh, where a stack's parameters are split over ``pipe``;
    * pins on a scan over layers itself (its results or operands at top level): the
      pipeline splits that scan over the stages (each runs its own layers' slice of the
      stacked values), so the whole stacked value never exists. Pins inside its body
      (one layer's values) apply in every stage.

    With ``reduce_after_flush`` the completion is the one
    :func:`evaluate_pipeline` makes for a program that reduces gradients after the flush.

    The node ids and scopes are those of ``accumulation.micro`` (equal to the whole
    batch's trace, equation by equation); no spec mentions ``pipe``. Store them in
    ``plan.activations``: the lowering applies them inside the stage programs
    (:func:`autopar.lower.split.gradient_function`) and :func:`evaluate_pipeline` prices
    with them.

    Example:
        >>> from benchmarks.models.gpt import GPTConfig, make_train_step
        >>> from autopar.lower.split import plan_accumulation
        >>> gstep, gargs = make_train_step(GPTConfig.preset("tiny"), 8)
        >>> mesh = {"pipe": 2, "data": 2, "tensor": 2}
        >>> plan = autopar.baselines.pipeline(gstep, mesh, *gargs, microbatches=2,
        ...                                   inner=autopar.baselines.megatron)
        >>> acc = plan_accumulation(gstep, gargs, 2)
        >>> pins = pipeline_activations(autopar.trace(gstep, *gargs), plan, cluster, acc)
        >>> len(pins) > 0, any("pipe" in str(c.spec) for c in pins)
        (True, False)
    """
    if accumulation is None or accumulation.microbatches != plan.pipeline.microbatches:
        raise LoadPlanError(
            f"a pipeline of {plan.pipeline.microbatches} microbatches is pinned from the "
            "step analysed for them (autopar.lower.split.plan_accumulation)."
        )
    flat = _flat_plan(graph, plan, pipe_axis, keep_pins=False)
    if pins:
        # The stages' layouts as the intra-op search already solved them (its plan's pins
        # on the sub-mesh, for this accumulation): completed from them rather than from
        # the inputs alone, which re-solves the whole step (a minute on an encoder-decoder).
        flat = dataclasses.replace(flat, activations=tuple(pins))
    bp, sol = complete_layouts(
        graph, flat, cluster, time_limit_s=time_limit_s, accumulation=accumulation,
        dp_grad_weight=_after_flush_weight(accumulation.microbatches, reduce_after_flush),
    )  # fmt: skip
    micro = accumulation.micro
    grads = set(accumulation.gradient_eqns)

    def applied(c: ActivationConstraint) -> bool:
        top = c.scope[0][0] if c.scope else c.node
        if top not in grads:
            return False
        return bool(c.scope) or not _layer_scan(micro, c.node)

    return tuple(c for c in pinned_activations(bp, sol.choice) if applied(c))


def _after_flush_weight(m: int, reduce_after_flush: bool) -> float | None:
    """The completion's weight of one microbatch's gradient reduction in a program that
    reduces the ``m`` microbatches' gradients once after the flush, exposed: ``1 / m``
    (``None``: the lowered program's, reduced in every microbatch at ``1 - eta``)."""
    return 1.0 / m if reduce_after_flush else None


def _layer_scan(graph: Graph, nid: int) -> bool:
    """Whether top-level node ``nid`` is a scan over layers (the pipeline splits it)."""
    n = graph.nodes[nid]
    if n.primitive != "scan" or n.layer is None or n.layer >= len(graph.layers):
        return False
    return graph.layers[n.layer].kind == "scan"


def evaluate_pipeline(
    graph: Graph,
    plan: Plan,
    cluster: Any,
    accumulation: Any,
    *,
    time_limit_s: float = 60.0,
    memory_limit_bytes: float | None = None,
    pipe_axis: str = "pipe",
    program: Any = None,
    per_layer: bool = False,
    completed: tuple[Any, Any] | None = None,
    reduce_after_flush: bool = False,
) -> Evaluation:
    """Price a pipeline plan (see the module docstring).

    Args:
        graph: the step traced on its whole batch.
        plan: a plan with ``plan.pipeline.num_stages > 1`` over ``pipe_axis`` (with
            ``chunks = v > 1``, ``p v`` chunk ranges run as interleaved 1F1B).
        cluster: a ``cost_models.Cluster``.
        accumulation: the step analysed for the plan's microbatches
            (:func:`autopar.lower.split.plan_accumulation`).
        program: what the lowered pipeline runs
            (:func:`autopar.lower.program.pipeline_program`: ticks, sends, buffers); without
            it the sends are estimated from the boundary activation.
        per_layer: also report one microbatch's forward and backward seconds per layer
            (``extra["layer_forward_s"]`` / ``["layer_backward_s"]``, work placed as
            :func:`node_layers` places it: the embedding with the first layer, the head
            with the last): what the inter-op split (:mod:`autopar.search.interop`) sums
            over a stage's layers.
        completed: the stages' problem already built and solved, ``(built, solution)``
            (the outer loop's profiles: the intra-op search's own solution on the
            sub-mesh, not solved again from the plan's pins).
        reduce_after_flush: complete the layouts the plan leaves free for the program
            ``extra["after_flush_step_s"]`` prices (data-parallel gradients reduced once
            after the flush: one microbatch's reduction weighs ``1 / m``, exposed) rather
            than for the lowered program (reduced in every microbatch, ``1 - eta``
            each). Without it the after-flush step keeps layouts chosen for the other
            program. For a published run's program (``benchmarks.bench_published``); the
            other fields still price the lowered program, with these layouts.

    Raises:
        LoadPlanError: the plan's mesh has no ``pipe`` axis of the plan's stage count, or
            it interleaves chunks with another schedule or a microbatch count that is
            not a multiple of ``p``.
    """
    pp = plan.pipeline
    p, m, v = pp.num_stages, pp.microbatches, pp.chunks
    n = len(pp.stages)  # virtual stages: chunk k on device k % p
    if plan.mesh.get(pipe_axis, 1) != p:
        raise LoadPlanError(
            f"the plan has {p} stages but its mesh {dict(plan.mesh)} has no {pipe_axis!r} "
            f"axis of {p} devices."
        )
    if v > 1 and (pp.schedule != "interleaved-1f1b" or m % p):
        raise LoadPlanError(
            f"the plan interleaves {v} chunks per device with schedule {pp.schedule!r} and "
            f"{m} microbatches: chunks need 'interleaved-1f1b' and a multiple of the {p} "
            "pipe devices (microbatches go through the chunks in groups of p)."
        )
    if accumulation is None or accumulation.microbatches != m:
        raise LoadPlanError(
            f"a pipeline of {m} microbatches is scored from the step function "
            "(autopar.evaluate(fn, plan, cluster, *args))."
        )
    sub = {a: s for a, s in plan.mesh.items() if a != pipe_axis} or {"data": 1}
    stacked_in = {i for i, r in enumerate(plan.inputs) if _on_pipe(r, pipe_axis)}
    # With the plan's pins (pipeline_activations) the stages are priced as the program
    # runs them; without, completed the way XLA's propagation would.
    if completed is None:
        flat = _flat_plan(graph, plan, pipe_axis, keep_pins=True)
        completed = complete_layouts(
            graph, flat, cluster, time_limit_s=time_limit_s, accumulation=accumulation,
            dp_grad_weight=_after_flush_weight(m, reduce_after_flush),
        )  # fmt: skip
    bp, sol = completed
    choice = sol.choice
    ctx, eta = bp.ctx, float(cluster.overlap_efficiency)
    micro = accumulation.micro
    shares = node_stages(micro, pp.stages)
    update = set(accumulation.update_eqns)
    fwd, bwd = [0.0] * n, [0.0] * n  # per chunk (per device when not interleaved)
    fwd_flops = [0.0] * n  # per chunk, one microbatch's forward
    fwd_redo = [0.0] * n  # per chunk, what re-running one microbatch's forward costs
    # per chunk, one microbatch's data-parallel gradient reductions: their seconds, and
    # what of them (1 - eta each) is in fwd / bwd; the after-flush program takes them out
    grad_s, grad_in_f, grad_in_b = [0.0] * n, [0.0] * n, [0.0] * n
    feeds_backward = _feeds_backward(micro) if any(r != "none" for r in pp.stage_remat) else set()
    upd = flops = 0.0
    n_layers = len(micro.layers)
    by_layer = node_layers(micro) if per_layer else {}
    lay_f, lay_b = [0.0] * n_layers, [0.0] * n_layers

    def top(op: Any) -> int:
        return op.scope[0][0] if op.scope else op.node.id

    def charge(
        op: Any, secs: float, op_flops: float = 0.0, redo_s: float = 0.0, grad: float = 0.0
    ) -> None:
        nonlocal upd
        nid = top(op)
        if nid in update or op.kind in ("input", "output"):
            # The update runs once per step; a pipe-split stack's is split too.
            upd += secs / (p if op.kind == "node" and _reads_stacked(bp, op, stacked_in) else 1)
            return
        per_micro = secs / m
        share = shares.get(nid, [1.0 / n] * n)
        backward = op.phase == "backward"
        target = bwd if backward else fwd
        if per_layer:
            lay = lay_b if backward else lay_f
            for k, x in by_layer.get(nid, {0: 1.0}).items():
                lay[k] += per_micro * x
        inside = grad_in_b if backward else grad_in_f
        for s in range(n):
            target[s] += per_micro * share[s]
            if grad:
                grad_s[s] += grad / m * share[s]
                inside[s] += (1.0 - eta) * grad / m * share[s]
            if not backward:
                fwd_flops[s] += op_flops / m * share[s]
                fwd_redo[s] += redo_s / m * share[s]

    def grads(colls: Sequence[Any]) -> float:
        return sum(c.own_s for c in colls if c.cls == "dp_grad")

    for g, group in enumerate(bp.groups):
        strats = group.strategies[choice[g]]
        for pos, oi in enumerate(group.ops):
            op = bp.ops[oi]
            st = strats[pos]
            price = price_strategy(ctx, op, st, gradient=bp.is_gradient_op(op))
            flops += op.weight * price.flops
            # Re-running a stage's forward repeats the work the backward reads from
            # (autopar.lower.stage_remat.recomputed_equations), collectives included.
            redo = price.linear_s(eta) if top(op) in feeds_backward else 0.0
            charge(
                op, op.weight * price.linear_s(eta), op.weight * price.flops, op.weight * redo,
                op.weight * grads(price.collectives),
            )  # fmt: skip
    for e in bp.edges:
        op = bp.ops[e.op]
        st = bp.strategy(e.op, choice)
        need = st.ins[e.operand] if e.operand < len(st.ins) else None
        have = bp.spec(e.ref, choice)
        if need is None or have == need:
            continue
        t = op.node.in_tensors[e.operand]
        w = min(op.weight, bp.ops[e.ref.op].weight)
        colls = price_reshard(ctx, t, have, need, source=bp.leader(e.ref.op))
        charge(op, w * reshard_linear_s(colls, eta), grad=w * grads(colls))
    # A rematerialised stage runs its forward again in its backward, per microbatch.
    for s, policy in enumerate(pp.stage_remat):
        if policy == "full":
            bwd[s] += fwd_redo[s]
            flops += fwd_flops[s] * m
    # Stage-to-stage sends: what the runtime sends (autopar.lower.pipeline): every tick,
    # one ppermute per slot of the padded forward and backward layouts.
    pipe_ctx = type(ctx)(cluster, {**{pipe_axis: p}, **sub})
    prog = program
    if prog is not None:
        ticks, psums = prog.ticks, prog.psums

        def send_s(sends: Sequence[float]) -> float:
            return sum(pipe_ctx.collective("p2p", b, (pipe_axis,)).time_s for b in sends if b)

        p2p_s, p2p_bytes = ticks * send_s(prog.sends), ticks * sum(prog.sends)
        p2p_count = ticks * len(prog.sends)
        # A dependency between stages waits for one direction's sends.
        sim_p2p = max(send_s(prog.forward_sends), send_s(prog.backward_sends))
    else:  # a schedule or cut the runtime does not run: the boundary activation, estimated
        boundary = _boundary_bytes(micro, pp.stages, bp, choice)
        sim_p2p = pipe_ctx.collective("p2p", boundary, (pipe_axis,)).time_s if boundary else 0.0
        p2p_count = 2 * m * (n - 1)  # every microbatch crosses each cut both ways
        p2p_s, p2p_bytes, psums = sim_p2p * p2p_count / p, boundary * p2p_count / p, 1
    sim = cost_models.simulate_schedule(
        pp.schedule, fwd, bwd, m, p2p=sim_p2p, chunks=v, per_chunk=True
    )
    dev_fwd = [sum(fwd[d::p]) for d in range(p)]  # chunk k runs on device k % p
    dev_bwd = [sum(bwd[d::p]) for d in range(p)]
    # Gradients of parameters replicated over pipe are summed over it after the flush.
    replicated = sum(
        bp.value_bytes(v, choice)
        for i, v in enumerate(bp.persistent[: len(graph.inputs)])
        if graph.inputs[i].role == "param" and i not in stacked_in
    )
    ar = pipe_ctx.collective("all-reduce", replicated, (pipe_axis,)) if replicated else None
    ar_s = ar.time_s if ar is not None else 0.0
    # A scanned stack run interleaved is relaid out by chunk (device d holds chunks d,
    # p + d, ...): the runtime's program says how many bytes per device that moves.
    relayout_sends = tuple(getattr(prog, "relayout_sends", ()) or ())
    relayout = float(sum(relayout_sends))
    relayout_s = send_s(relayout_sends) if relayout_sends else 0.0
    step = sim.makespan + upd + ar_s + relayout_s
    compute = sum(fwd) / p * m + sum(bwd) / p * m  # mean stage work per device
    collectives = [
        PredictedCollective(
            "collective-permute", (pipe_axis,), p2p_bytes, p2p_count, p2p_s, "pipeline_p2p"
        )
    ]
    # The stages' own collectives (over the other mesh axes), as the intra-op pricing
    # emits them for one microbatch times m (their seconds are in the stage times); the
    # forward and backward pieces each make the reshards they read (no CSE across them).
    intra: dict[tuple[str, tuple[str, ...], str], list[float]] = {}
    for c in price_choice(bp, choice, pieces=True).emitted:
        tot = intra.setdefault((c.kind, c.axes, c.cls), [0.0, 0.0, 0.0])
        tot[0] += c.executions * c.nbytes
        tot[1] += c.executions
        tot[2] += c.executions * c.own_s
    collectives += [
        PredictedCollective(kind, axes, b, max(1, round(n)), t, cls)
        for (kind, axes, cls), (b, n, t) in sorted(intra.items())
    ]
    # Overlap bounded by the compute there is (cost_models.overlap.bound_linear_overlap):
    # the stages' own gradient reductions and parameter gathers, per device, were charged
    # into the stage work at 1 - eta; the schedule's sends are priced by the schedule.
    hide = {"dp_grad": 0.0, "fsdp_gather": 0.0}
    exposed = 0.0
    for (_, _, cls), (_, _, t) in intra.items():
        if cls in hide:
            hide[cls] += t / p
        else:
            exposed += t / p
    bounded = bound_linear_overlap(step, compute, hide, exposed, eta)
    after_flush = bounded
    if any(grad_s):
        # The program that reduces the stages' data-parallel gradients once after the
        # flush: its schedule runs the stage work without them, then each device reduces
        # its chunks' accumulated gradients (one microbatch's bytes), exposed, the
        # devices at once; only the parameter gathers hide behind its compute.
        fwd_af = [f - g for f, g in zip(fwd, grad_in_f, strict=True)]
        bwd_af = [b - g for b, g in zip(bwd, grad_in_b, strict=True)]
        sim_af = cost_models.simulate_schedule(
            pp.schedule, fwd_af, bwd_af, m, p2p=sim_p2p, chunks=v, per_chunk=True
        )
        flush = max(sum(grad_s[d::p]) for d in range(p))
        after_flush = bound_linear_overlap(
            sim_af.makespan + upd + ar_s + relayout_s + flush,
            (sum(fwd_af) + sum(bwd_af)) / p * m,
            {"fsdp_gather": hide["fsdp_gather"]},
            exposed,
            eta,
        )
    if relayout_sends:
        # Each ppermute of the stack's relayout (chunks in, gradients back), as the
        # program sends them (autopar.lower.pipeline.stack_relayout).
        collectives.append(
            PredictedCollective(
                "collective-permute", (pipe_axis,), relayout, len(relayout_sends),
                relayout_s, "pipeline_relayout",
            )
        )  # fmt: skip
    if ar is not None:
        # One psum per output of G not split over pipe (replicated gradients, the loss).
        collectives.append(
            PredictedCollective(
                "all-reduce", (pipe_axis,), replicated, max(1, psums), ar_s, "dp_grad"
            )
        )
    mem, breakdown = _stage_memory(
        bp, choice, graph, stacked_in, p, sim.peak_inflight, m, prog, accumulation, v
    )
    copy = float(getattr(prog, "relayout_copy_bytes", 0.0) or 0.0)
    if copy:
        breakdown["pipeline_relayout"] = copy  # the stack in chunk order beside the original
        mem += copy
    return Evaluation(
        mesh=dict(plan.mesh),
        objective_s=step,
        step_time_s=step,
        compute_s=compute,
        backward_compute_s=sum(bwd) / p * m,
        communication_s=ar_s + p2p_s + relayout_s,
        exposed_communication_s=step - compute - sim.bubble_s,
        communication_by_class={
            "pipeline_p2p": p2p_s,
            "dp_grad": ar_s,
            **({"pipeline_relayout": relayout_s} if relayout else {}),
        },
        collectives=tuple(collectives),
        memory_bytes_per_device=mem,
        memory_breakdown=breakdown,
        flops_per_device=flops / p,
        memory_limit_bytes=memory_limit_bytes,
        solve_status=sol.status,
        overlap_step_time_s=bounded,
        extra={
            "bubble_s": sim.bubble_s,
            "bubble_fraction": sim.bubble_fraction,
            "makespan_s": sim.makespan,
            "stage_forward_s": tuple(dev_fwd),
            "stage_backward_s": tuple(dev_bwd),
            "chunk_forward_s": tuple(fwd),
            "chunk_backward_s": tuple(bwd),
            "chunks": v,
            "update_s": upd,
            # the step if the stages' data-parallel gradients were reduced once after the
            # flush (Megatron-LM, the DeepSpeed pipeline engine) rather than in every
            # microbatch as the lowered program does; overlap bounded as above
            "after_flush_step_s": after_flush,
            # per chunk, one microbatch's data-parallel gradient reductions (seconds in
            # full; the stage work above carries 1 - eta of each)
            "chunk_dp_grad_s": tuple(grad_s),
            "dp_grad_per_device_s": hide["dp_grad"],
            "fsdp_gather_per_device_s": hide["fsdp_gather"],
            # the stages' other collectives per device (charged in full), and the stage
            # work without any collective in it: what the overlap bound hides behind
            "stage_exposed_collectives_s": exposed,
            "raw_compute_s": max(compute - exposed - (1.0 - eta) * sum(hide.values()), 0.0),
            "p2p_s": sim_p2p,
            "p2p_from": "program" if prog is not None else "estimate",
            "peak_inflight": sim.peak_inflight,
            **(
                {"layer_forward_s": tuple(lay_f), "layer_backward_s": tuple(lay_b)}
                if per_layer
                else {}
            ),
            # what a cut between the middle layers would send (the outer loop's screen)
            "boundary_bytes": _boundary_bytes(micro, _halves(len(micro.layers)), bp, choice),
        },
    )


def _feeds_backward(graph: Graph) -> set[int]:
    """Forward nodes (top level) whose results the backward pass reads, directly or
    through other forward nodes: what a rematerialised stage re-runs."""
    producer = {v: n.id for n in graph.nodes for v in n.outputs}
    todo = [
        producer[v]
        for n in graph.nodes
        if n.phase == "backward"
        for v in n.inputs
        if v in producer and graph.nodes[producer[v]].phase == "forward"
    ]
    seen: set[int] = set()
    while todo:
        k = todo.pop()
        if k in seen:
            continue
        seen.add(k)
        todo.extend(
            producer[v]
            for v in graph.nodes[k].inputs
            if v in producer and graph.nodes[producer[v]].phase == "forward"
        )
    return seen


def _reads_stacked(bp: Any, op: Any, stacked_in: set[int]) -> bool:
    lead = bp.leader(op.index)
    return lead.kind == "input" and lead.input is not None and lead.input.index in stacked_in


def _halves(layers: int) -> tuple[tuple[int, int], ...]:
    half = max(1, layers // 2)
    return ((0, half), (half, layers)) if layers >= 2 else ((0, layers),)


def _boundary_bytes(micro: Graph, stages: Sequence[tuple[int, int]], bp: Any, choice: Any) -> float:
    """Bytes per device of the activation entering the second stage's first layer: the
    largest value its nodes read from earlier work (a transformer's residual stream)."""
    if len(stages) < 2:
        return 0.0
    first = stages[1][0]
    layer = micro.layers[first] if first < len(micro.layers) else None
    if layer is None:
        return 0.0
    inside = set(layer.nodes)
    producer = {v: n.id for n in micro.nodes for v in n.outputs}
    inputs = {gi.value for gi in micro.inputs}
    best = 0.0
    for nid in layer.nodes:
        n = micro.nodes[nid]
        if n.phase != "forward":
            continue
        carried = range(len(n.inputs))
        if n.primitive == "scan":  # a scanned stack: the carry enters each layer
            first_carry = int(n.params.get("num_consts", 0))
            carried = range(first_carry, first_carry + int(n.params.get("num_carry", 0)))
        for i in carried:
            v, t = n.inputs[i], n.in_tensors[i]
            if v < 0 or v in inputs or producer.get(v) in inside or v not in producer:
                continue
            ref = bp.value_refs.get(v)
            grouped = ref is not None and ref.op in bp.op_group
            nbytes = t.nbytes / _shards(bp, ref, choice) if grouped else t.nbytes
            best = max(best, nbytes)
    return best


def _shards(bp: Any, ref: Any, choice: Any) -> int:
    from autopar.search.sharding import shards

    return shards(bp.spec(ref, choice), bp.ctx.mesh)


def _stage_memory(
    bp: Any,
    choice: Any,
    graph: Graph,
    stacked_in: set[int],
    p: int,
    inflight: Sequence[int],
    m: int,
    prog: Any = None,
    accumulation: Any = None,
    chunks: int = 1,
) -> tuple[float, dict[str, float]]:
    """Bytes per device: state (a stacked leaf's 1/p), accumulators, and activations.

    With the runtime's program (``prog``), the activations are what it holds on every
    device (the SPMD program is the same on all stages): the stash buffer, ``K + 1``
    slots of the padded stash layout (``"activations"``: ``K``, the most microbatches, or
    interleaved (microbatch, chunk) pairs, any device keeps; ``"pipeline_buffers"``: the
    spare slot idle ticks write to and the receive buffers), and what one tick adds
    (``"pipeline_tick"``), while the accumulators of a stacked leaf are split over
    ``pipe``. The tick's working set is where XLA decides most; measured on the zoo GPT
    (tiny, fp32, 4 layers, microbatches of 4, ``memory_analysis`` temp minus the
    accumulators and the carried buffers): a scanned stack's piece returns its residuals
    and its layers' gradients out of the inner loop before they are copied into the
    buffers (a stash slot plus the gradients; measured 1.8 MiB at {pipe: 2, data: 4}
    against 1.2 MiB counted), while with unrolled layers XLA moves the buffer updates into
    the switch's branches, which write in place, and a tick adds little more than the
    piece's own gradients (measured 385 KiB at {pipe: 2, data: 4}, 340 KiB at {pipe: 4,
    data: 2}; counted: a mean chunk's share of the gradients, 427 and 213 KiB, plus the
    sends). The buffers carried across ticks are exact. Without ``prog``: the busiest
    device's share of one microbatch's activations times its in-flight microbatches
    (interleaved: chunks of ``1 / (p v)`` of them), accumulators whole."""
    _, _, breakdown = bp.peak(choice)
    n_in = len(graph.inputs)
    state: dict[str, float] = {}
    summed = []
    if prog is not None and accumulation is not None:
        # Accumulators follow the gradient handoffs that are summed or averaged.
        summed = [h for h, rule in enumerate(accumulation.rules) if rule in ("mean", "sum")]
    for i, v in enumerate(bp.persistent):
        b = bp.value_bytes(v, choice)
        if i < n_in and i in stacked_in:
            b /= p  # a scanned stack: each stage holds its layers
        elif prog is not None and n_in <= i < n_in + len(summed):
            if summed[i - n_in] in prog.stacked_outputs:
                b /= p  # the gradient of a scanned stack: each stage sums its layers'
        state[v.category] = state.get(v.category, 0.0) + b
    out = dict(state)
    if prog is None:
        act = sum(b for k, b in breakdown.items() if k not in state)
        # inflight counts (microbatch, chunk) pairs; a chunk holds 1 / (p v) of the model.
        worst = max(inflight) if inflight else m * chunks
        out["activations"] = act / (p * chunks) * worst
        return sum(out.values()), out
    stash_slots, stash = prog.buffers["stash"]
    out["activations"] = (stash_slots - 1) * stash  # the microbatches in flight
    out["pipeline_buffers"] = stash + sum(  # the spare stash slot, the receive buffers
        n * b for name, (n, b) in prog.buffers.items() if name != "stash"
    )
    if prog.stacked_outputs:
        # A scanned stack's piece returns its residuals and its layers' gradients out of
        # the inner loop, then copies them into the stash and the accumulators.
        out["pipeline_tick"] = stash + state.get("grads", 0.0) + sum(prog.sends)
    else:
        # Unrolled layers: XLA moves the accumulation into the switch's branches, which
        # update the carried accumulators in place; what a tick adds is the piece's fresh
        # gradients of its own chunk's parameters (a mean chunk's share) and the sends,
        # and the slot it writes: in place at one example per device and microbatch
        # ({pipe: 2, data: 4}, batch 16, m = 4: a tick measured 385 KiB), a copy at two
        # or more (bench_pipeline, batch 32, m = 4: memory -9% to -23% without it, -9%
        # with it; m = 16: +1% without, +10% with). One slot is charged, as for a
        # scanned stack: the model errs on the side of the copy.
        grads = state.get("grads", 0.0) / (p * chunks)
        out["pipeline_tick"] = stash + grads + sum(prog.sends)
    # A rematerialised stage re-creates its residuals of one microbatch in a backward
    # tick: they live until that tick's backward has read them.
    recomputed = float(getattr(prog, "recomputed_bytes", 0.0) or 0.0)
    if recomputed:
        out["pipeline_recompute"] = recomputed
    return sum(out.values()), out


__all__ = ["evaluate_pipeline", "node_layers", "node_stages", "pipeline_activations"]
