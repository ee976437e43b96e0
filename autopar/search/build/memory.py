"""Build stage 4, memory: what is live when, and its bytes per device under a choice.

Inputs are live throughout (outputs that replace an input reuse its buffer: the step
updates its state in place); every other value from its producer to its last consumer,
following the traced program order with XLA's fusion applied
(``fusion.materialised_values``: fused values are never stored; the fusion runs when its
consumer does); inside a scan the body's largest live set rides on top. A value read in
another layout than it is made in occupies a second buffer when the reshard moves data
(:func:`copies`). A few peak moments of the replicated profile become the ILP's linear
constraints (:func:`memory_constraint`, :func:`pick_moments`); :func:`peak` checks every
moment exactly, copies included, and the planner adds any moment that breaks the bound.

Under a remat policy (``liveness(coarse, remat)``, ``ilp.build(..., remat=...)``),
:mod:`~autopar.search.build.residuals` decides which forward values the step stores for
its backward pass (``"selective"``: not the attention core; ``"full"``: only each layer's
inputs); a forward value it rebuilds is live in the forward pass only while the forward
reads it and in the backward pass only around its recompute (:func:`_apply_remat`), so
:func:`peak` and the ILP's constraints reflect the policy. ``"none"`` keeps what XLA keeps.

:func:`peak` also counts a reduction's result beside its operand
(:func:`reduction_buffers`: XLA's all-reduce is out of place and its combiner runs every
gradient reduction at once, when the last gradient is ready). How XLA's heap packs the
buffers needs no model: its temp allocation is within 0.3-1.7% of the most bytes live at
once (measured: ``--xla_dump_to`` buffer offsets against live ranges, bench_verify's
scanned ZeRO-1/ZeRO-3/Megatron GPT and MoE, the replicated Wide-ResNet of
bench_fidelity; in the ZeRO-3 GPT dump the live-range file's "peak usage" line, 1.22 MB,
is 0.3 MB below the bytes live at its combined gradient all-reduce).

Two kinds of buffers depend on the compiler (``DeviceSpec.compiler``; a preset's prices
with another compiler's buffers: ``Cluster.compiled_on``, which bench_fidelity uses to
check a DGX plan against the program XLA:CPU builds):

* convolution layout copies (:func:`layout_copies`): XLA:CPU copies the operands of the
  backward convolutions into ``NHWC/HWIO/NHWC`` form (the images and each kernel from the
  start of the step, an output gradient from when it is made, each to its convolution; a
  forward activation's copy replaces it, at the size of the slice the convolution reads).
  XLA:GPU hands those convolutions to cuDNN as they are where its layout assignment keeps
  NHWC (``GpuConvRewriter``, ``HeuristicLayoutAssignment``: Hopper and later, 16-bit
  types from Volta on), so a GPU plan has none. Float32 convolutions before Hopper run
  NCHW, and there XLA:GPU copies much as XLA:CPU does: not modelled (not measured, no
  GPU here).
* a max-pool's gradient (:func:`select_and_scatter_buffers`): XLA:CPU expands
  ``select_and_scatter`` into window indices kept from the forward pool and a padded
  result; XLA:GPU runs it as one kernel.

Measured (``--xla_dump_to`` live ranges, jaxlib 0.10.2) on the Wide-ResNet of
bench_fidelity (tiny): replicated at batch 64 (``memory_analysis`` 14.82 MiB) the model
predicts 15.54 MiB (+4.8%; 12.75 MiB, -14.0%, without either kind); the plan the search
makes for 8 simulated CPU devices at batch 1024 (mesh {data: 8}; the kernel gradients
split the batch) 119.06 MiB against 114.95 (+3.6%; +17.9% with the copies held whole, 135.50
MiB); ``tests/search/test_memory_conv.py`` and ``tests/search/test_memory_pool.py`` count
both by hand.

Not modelled, on purpose: a copy of a donated kernel that its input gradient reads. That
read is not ordered by data dependence before the kernel's in-place update, so copy
insertion keeps a copy. XLA:CPU runs copy insertion before scheduling only; XLA:GPU runs
it again on the schedule (``RunPostSchedulingCopyInsertion`` in
``xla/service/gpu/gpu_compiler.cc``: "the sequential ordering from the HLO schedule
potentially allows for more copies to be eliminated"), where the update is the kernel's
last reader. On CPU the vacated parameter buffer is reused (for the reversed kernel, a
gradient), so a copy costs memory only when nothing of its size fills that buffer: in the
MLP zoo step the 4 MiB copy of ``layer_1/w`` costs nothing (its gradient takes the
parameter's buffer); in the two-convolution step of ``tests/search/test_memory_conv.py``
the reversed kernel the model counts takes it, and the model's peak is XLA's to the byte
but for the output tuple's 24 bytes. (That holds at the test's batch of 8; at batch 64
XLA's schedule runs ``w2``'s input gradient while the forward's ``2 y`` is still live,
one activation more than the model's peak holds: -14%. The model keeps program order.)

This is the planner's one memory model: ``plan.predicted.memory_bytes_per_device``, the
ILP's memory constraints and the activation bytes per layer under each remat policy
(``tests/search/test_residuals.py``, against Korthikanti et al. 2022) all come from it.

Example:
    >>> persistent, timeline = liveness(coarse)              # doctest: +SKIP
    >>> len(timeline) == len(coarse.graph.nodes)             # doctest: +SKIP
    True
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from autopar.search.build.coarsen import Coarse
from autopar.search.build.flatten import scan_ok
from autopar.search.build.records import MemValue, Op, Ref, Scope, pad
from autopar.search.build.residuals import Residuals, residuals
from autopar.search.fusion import materialised_values
from autopar.search.problem import MemoryConstraint
from autopar.search.sharding import shards
from autopar.trace.graph import Graph, TensorInfo

Span = tuple[int, int, MemValue, int]
"""A value's life on a timeline: (born, dies, the value, its value id)."""

if TYPE_CHECKING:
    from autopar.search.ilp import BuiltProblem

ROLE_CATEGORY = {
    "param": "params",
    "opt_state": "optimizer",
    "model_state": "model_state",
    "batch": "inputs",
    "other": "inputs",
}
"""Memory breakdown category of each input role."""


@dataclass(frozen=True)
class Timeline:
    """Live values over one graph's program order, as events per moment: values born,
    values whose last use it is, and a scan body's transient peak set riding on top."""

    born: tuple[tuple[MemValue, ...], ...]
    dies: tuple[tuple[MemValue, ...], ...]
    extra: tuple[tuple[MemValue, ...], ...]

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
        return list(live.values()) + list(self.extra[t])

    def totals(self, size: Callable[[MemValue], float]) -> list[float]:
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


def liveness(coarse: Coarse, remat: str = "none") -> tuple[tuple[MemValue, ...], Timeline]:
    """The persistent values (inputs) and the timeline of everything else.

    ``remat="selective"`` / ``"full"`` applies that policy's stored set
    (:func:`~autopar.search.build.residuals.residuals`) to the top-level timeline
    (:func:`_apply_remat`); ``"none"`` keeps what XLA keeps.
    """
    g = coarse.graph
    persistent = tuple(
        MemValue(
            Ref(coarse.flat.input_ops[gi.index], 0), gi.tensor, ROLE_CATEGORY[gi.role], gi.path
        )
        for gi in g.inputs
    )
    donated = {
        g.outputs[gi.output_index].value
        for gi in g.inputs
        if gi.output_index is not None and gi.output_index < len(g.outputs)
    }
    inputs = {gi.value for gi in g.inputs}
    if remat == "none":
        return persistent, _timeline(coarse, g, (), skip=donated | inputs)
    return persistent, _timeline(
        coarse,
        g,
        (),
        skip=donated | inputs,
        policy=residuals(g, remat),  # type: ignore[arg-type]
    )


def run_moments(graph: Graph) -> tuple[set[int], list[int]]:
    """``(stored, runs)``: the values XLA keeps (``fusion.materialised_values``) and, per
    node, the position at which its work happens. A value fused into its consumer never
    occupies memory; the fusion runs when its consumer does, so the inputs it reads stay
    live until then. Memoised on the graph.

    Example:
        >>> stored, runs = run_moments(graph)  # doctest: +SKIP
        >>> all(r >= i for i, r in enumerate(runs))  # doctest: +SKIP
        True
    """
    hit = graph.__dict__.get("_run_moments")
    if hit is not None:
        return hit
    nodes = graph.nodes
    pos = {node.id: i for i, node in enumerate(nodes)}
    stored = materialised_values(graph)
    runs = list(range(len(nodes)))
    for i in range(len(nodes) - 1, -1, -1):
        node = nodes[i]
        if node.outputs and not any(v in stored for v in node.outputs):
            runs[i] = max(
                (runs[pos[c]] for v in node.outputs for c in graph.consumers.get(v, ())),
                default=i,
            )
    graph.__dict__["_run_moments"] = (stored, runs)
    return stored, runs


def _timeline(
    coarse: Coarse,
    graph: Graph,
    scope: Scope,
    *,
    skip: set[int],
    policy: Residuals | None = None,
) -> Timeline:
    env = coarse.envs.get(scope, {})
    nodes = graph.nodes
    n = len(nodes)
    pos = {node.id: i for i, node in enumerate(nodes)}
    out_values = {o.value for o in graph.outputs}
    born: list[list[MemValue]] = [[] for _ in range(n)]
    dies: list[list[MemValue]] = [[] for _ in range(n)]
    extra: list[tuple[MemValue, ...]] = [() for _ in range(n)]
    stored, runs = run_moments(graph)
    spans: list[Span] = []
    for i, node in enumerate(nodes):
        for port, v in enumerate(node.outputs):
            if v in skip or v not in stored:
                continue
            users = graph.consumers.get(v, ())  # nodes of this graph
            end = n - 1 if v in out_values else max((runs[pos[c]] for c in users), default=i)
            cat = "activations"
            if node.phase == "backward" and any(nodes[pos[c]].phase == "optimizer" for c in users):
                cat = "grads"
            mv = MemValue(env.get(v), node.out_tensors[port], cat, f"{node.name_stack}:{port}")
            spans.append((i, end, mv, v))
        if node.primitive == "scan" and scan_ok(node):
            body = node.body[0]
            inner = _timeline(
                coarse, body, scope + ((node.id, 0),), skip={b.value for b in body.inputs}
            )
            extra[i] = tuple(inner.peak_set())
    if policy is not None:
        spans = _apply_remat(coarse, graph, spans, policy, runs, stored | skip)
    for start, end, mv, _ in spans:
        born[start].append(mv)
        dies[end].append(mv)
    return Timeline(tuple(map(tuple, born)), tuple(map(tuple, dies)), tuple(extra))


def _apply_remat(
    coarse: Coarse,
    graph: Graph,
    spans: list[Span],
    policy: Residuals,
    runs: list[int],
    tracked: set[int],
) -> list[Span]:
    """The top-level live spans under a remat policy (``policy``, from
    :func:`~autopar.search.build.residuals.residuals`); ``tracked``: the values ``spans``
    already decided on (XLA keeps them, or they are inputs).

    * A forward activation the policy rebuilds lives in the forward pass only until its
      last forward reader (not at all if none reads it), and again from its first backward
      reader to its last: around its recompute. A scan's stacked output is rebuilt one
      iteration at a time inside the backward loop (one slice, at the backward scan).
    * A stored value lives until the last recompute that reads it (``policy.sources``).
    * A stored value XLA's fusion would not keep (a dropout mask fused into its readers)
      is kept from its producer to its last reader; a stored value of a forward loop body
      that is not a loop output (a layer's input under ``"full"``) is kept ``copies``
      times stacked, from the forward loop to the last backward reader of its outputs.
    """
    env = coarse.envs.get((), {})
    nodes = graph.nodes
    pos = {node.id: i for i, node in enumerate(nodes)}
    out_values = {o.value for o in graph.outputs}

    def reads(v: int) -> tuple[list[int], list[int]]:
        """Moments at which ``v`` is read: (in the forward, in the backward)."""
        fw, bw = [], []
        for c in graph.consumers.get(v, ()):
            t = runs[pos[c]]
            (bw if nodes[t].phase == "backward" else fw).append(t)
        return fw, bw

    def rebuilt(i: int, v: int) -> bool:
        return nodes[i].phase == "forward" and v not in out_values and policy.rebuilt(((), v))

    hold: dict[int, int] = {}  # stored value -> the last recompute that reads it
    for i, node in enumerate(nodes):
        for v in node.outputs:
            bw = reads(v)[1] if rebuilt(i, v) else ()
            for sc, s in policy.sources.get(((), v), ()) if bw else ():
                if not sc:
                    hold[s] = max(hold.get(s, -1), min(bw))
    out: list[Span] = []
    for start, end, mv, v in spans:
        if not rebuilt(start, v):
            out.append((start, max(end, hold.get(v, end)), mv, v))
            continue
        fw, bw = reads(v)
        if fw:
            out.append((start, max(fw), mv, v))
        if bw:
            node = nodes[start]
            if (
                node.primitive == "scan"
                and scan_ok(node)
                and node.outputs.index(v) >= int(node.params["num_carry"])
            ):  # a stacked output: rebuilt one iteration at a time
                t = mv.tensor
                mv = replace(mv, tensor=TensorInfo((1, *t.shape[1:]), t.dtype))
            out.append((min(bw), max(bw), mv, v))
        if not fw and not bw:
            out.append((start, end, mv, v))
    # Stored values the timeline does not hold yet.
    for i, node in enumerate(nodes):
        for port, v in enumerate(node.outputs):
            if v in tracked or ((), v) not in policy.stored or node.phase != "forward":
                continue
            fw, bw = reads(v)
            end = max([i, *fw, *bw, hold.get(v, i)])
            mv = MemValue(
                env.get(v), node.out_tensors[port], "activations", f"{node.name_stack}:{port}"
            )
            out.append((i, end, mv, v))
    for sv in policy.saved:
        if not sv.scope or any(not sc for sc, _ in sv.aliases):
            continue  # a top-level value (above)
        loop = sv.scope[0][0]
        ref = coarse.envs.get(sv.scope, {}).get(sv.value)
        if loop not in pos or ref is None:
            continue
        start = pos[loop]
        bw = [t for v in nodes[start].outputs for t in reads(v)[1]]
        if not bw:
            continue
        mv = MemValue(
            Ref(ref.op, ref.port, ref.delta + 1),
            TensorInfo((sv.copies, *sv.tensor.shape), sv.tensor.dtype),
            "activations",
            f"{sv.name_stack}:stored",
        )
        out.append((start, max(bw), mv, -1))
    return out


def pick_moments(timeline: Timeline, k: int) -> list[int]:
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


def memory_constraint(bp: BuiltProblem, moment: int) -> MemoryConstraint:
    """The linear memory constraint of one moment (persistent + live values)."""
    constant = 0.0
    terms: dict[int, list[float]] = {}
    values = list(bp.persistent) + (bp.timeline.live_at(moment) if len(bp.timeline) else [])
    cache: dict[tuple, list[float]] = {}
    mesh = bp.ctx.mesh
    for v in values:
        if v.ref is None or v.ref.op not in bp.op_group:
            continue  # constants: see value_bytes
        g, pos = bp.op_group[v.ref.op]
        group = bp.groups[g]
        key = (id(group.strategies), pos, v.ref.port, v.ref.delta, v.tensor.nbytes)
        per = cache.get(key)
        if per is None:
            per = cache[key] = [
                v.tensor.nbytes / shards(pad(st[pos].outs[v.ref.port], v.ref.delta), mesh)
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


def value_bytes(bp: BuiltProblem, v: MemValue, choice: Sequence[int]) -> float:
    """Bytes per device of one value under ``choice``."""
    if v.ref is None or v.ref.op not in bp.op_group:
        return 0.0  # constants: fused into their consumers, never materialised
    return v.tensor.nbytes / shards(bp.spec(v.ref, choice), bp.ctx.mesh)


def copies(bp: BuiltProblem, choice: Sequence[int]) -> list[float]:
    """Bytes per device of resharded copies live at each top-level moment.

    A value read in another layout is copied into it by a collective (all-gather,
    all-to-all, permute: local slices are fused into the reader and copy nothing).
    Readers of the same value in the same layout share one copy (XLA's CSE; the lowering
    reuses it, :mod:`autopar.lower.order`), live from its first reader's moment to its
    last's. Copies made inside loop bodies are left to the body's peak.
    """
    pos = {node.id: i for i, node in enumerate(bp.graph.nodes)}
    spans: dict[tuple, list[float]] = {}  # key -> [first, last, bytes]
    for op, k, ref, have, need in bp.resharded_reads(choice):
        if op.kind != "node":
            continue
        top = op.node.id if not op.scope else op.scope[0][0]
        if op.scope and ref.op in bp.op_group and bp.ops[ref.op].scope:
            continue  # made and read inside a loop body
        t = pos.get(top)
        tensor = op.node.in_tensors[k]
        if t is None or not bp.ctx.reshard(tensor.shape, tensor.dtype, have, need)[1]:
            continue
        nbytes = tensor.nbytes / shards(need, bp.ctx.mesh)
        span = spans.setdefault((ref, have, need), [t, t, nbytes])
        span[0], span[1] = min(span[0], t), max(span[1], t)
    live = [0.0] * (len(bp.timeline) + 1)
    for first, last, nbytes in spans.values():
        live[int(first)] += nbytes
        live[int(last) + 1] -= nbytes
    return _running(live)


_LAYOUT_OPS = frozenset({"rev", "transpose", "copy", "convert_element_type"})
"""Unary ops a layout copy reads through to find where its operand comes from."""


def _running(deltas: Sequence[float]) -> list[float]:
    """Per moment, the running sum of ``deltas`` (its last entry, past the end, dropped)."""
    running, out = 0.0, []
    for d in deltas[:-1]:
        running += d
        out.append(running)
    return out


def _xla_cpu_ops(bp: BuiltProblem, primitive: str) -> list[tuple[Op, int]]:
    """The top-level ``primitive`` ops with their moments, when XLA:CPU builds the
    program (``DeviceSpec.compiler``); none for any other compiler."""
    if getattr(bp.ctx.cluster.device, "compiler", "") != "xla:cpu":
        return []
    pos = {node.id: i for i, node in enumerate(bp.graph.nodes)}
    return [
        (op, pos[op.node.id])
        for op in bp.ops
        if op.kind == "node"
        and not op.scope
        and op.node.primitive == primitive
        and op.node.id in pos
        and op.index in bp.op_group
    ]


def canonical_conv_specs(ndim: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(lhs/out spec, rhs spec)`` of the ``NHWC/HWIO/NHWC`` form, in the order of
    ``conv_general_dilated``'s ``dimension_numbers`` (batch or out-feature, feature or
    in-feature, spatial...).

    Example:
        >>> canonical_conv_specs(4)  # NHWC: N=0, C=3, H=1, W=2; HWIO: O=3, I=2, H=0, W=1
        ((0, 3, 1, 2), (3, 2, 0, 1))
    """
    spatial = tuple(range(1, ndim - 1))
    return (0, ndim - 1, *spatial), (ndim - 1, ndim - 2, *(d - 1 for d in spatial))


def layout_copies(bp: BuiltProblem, choice: Sequence[int]) -> list[float]:
    """Bytes per device that convolution layout copies add at each top-level moment, on
    a device whose compiler makes them (``DeviceSpec.compiler`` ``"xla:cpu"``);
    zeros elsewhere. Negative where a copy held in a smaller layout replaces its value.

    XLA:CPU (``xla/service/cpu/conv_canonicalization.cc``) copies each operand of a
    convolution that is not in ``NHWC/HWIO/NHWC`` form into that form: in a train step,
    the activation and output gradient a kernel gradient reads (the batch is their
    contracted dimension) and the kernel an input gradient reads (reversed, its feature
    dimensions swapped). The copy is in the layout the convolution reads (a slice of
    the value where the convolution splits what the value keeps whole). Where it lives
    (measured with ``--xla_dump_to`` live ranges, jaxlib 0.10.2, on
    ``tests/search/test_memory_conv.py``'s step and the Wide-ResNet of bench_fidelity):

    * an operand made from a step argument alone (the images; a kernel, through its
      ``rev``) is copied at the start of the step, beside the argument, and held until
      its convolution;
    * a backward value (the output gradient) is copied when it is made (its producing
      fusion writes both) and held until its convolution, beside the original, which
      other readers take as it is;
    * a forward activation is copied after its last other reader and the copy replaces
      it: nothing is added, and where the convolution reads a slice (the batch split
      over the devices while the activation is whole) the value is held at the slice's
      size from then until its convolution (without remat: a remat policy decides
      itself when a forward value is held);
    * a read that moves data (an all-gather) is copied beside the moved copy, at the
      convolution.

    Copies inside loop bodies are left to the body's peak, as :func:`copies` does.

    Example:
        >>> extra = layout_copies(bp, choice)  # a convolution step on CPU  # doctest: +SKIP
        >>> extra[0] >= images_bytes  # the images' copy, from the start  # doctest: +SKIP
        True
    """
    live = [0.0] * (len(bp.timeline) + 1)
    convs = _xla_cpu_ops(bp, "conv_general_dilated")
    if not convs:
        return live[:-1]
    graph = bp.graph
    pos = {node.id: i for i, node in enumerate(graph.nodes)}
    stored, runs = run_moments(graph)
    mesh = bp.ctx.mesh

    def source(ref: Ref) -> Op:
        op = bp.ops[ref.op]
        while (
            op.kind == "node"
            and op.node.primitive in _LAYOUT_OPS
            and len(op.operands) == 1
            and op.operands[0] is not None
        ):
            op = bp.ops[op.operands[0].op]
        return op

    def add(first: int, last: int, nbytes: float) -> None:
        if first <= last:
            live[first] += nbytes
            live[last + 1] -= nbytes

    # Forward activations read by layout-copying convolutions: value -> (the value's
    # bytes, {the copy's bytes}, the convolutions' node ids).
    sliced: dict[int, tuple[float, set[float], set[int]]] = {}
    for op, t in convs:
        dn = op.node.params.get("dimension_numbers") or {}
        wanted = canonical_conv_specs(len(op.node.out_tensors[0].shape))
        st = bp.strategy(op.index, choice)
        for k, key in enumerate(("lhs_spec", "rhs_spec")):
            ref = op.operands[k] if k < len(op.operands) else None
            if ref is None or tuple(dn.get(key, wanted[k])) == wanted[k]:
                continue
            tensor = op.node.in_tensors[k]
            have = bp.spec(ref, choice)
            need = st.ins[k] if k < len(st.ins) and st.ins[k] is not None else have
            nbytes = tensor.nbytes / shards(need, mesh)
            src = source(ref)
            if src.kind in ("input", "body_input"):
                add(0, t, nbytes)
            elif have != need and bp.ctx.reshard(tensor.shape, tensor.dtype, have, need)[1]:
                add(t, t, nbytes)  # beside the moved copy (:func:`copies`)
            elif src.phase == "backward":
                made = bp.ops[ref.op]
                first = pos.get(made.node.id, t) if made.kind == "node" and not made.scope else t
                add(min(first, t), t, nbytes)
            elif op.node.inputs[k] in stored and bp.remat == "none":
                whole = tensor.nbytes / shards(have, mesh)
                entry = sliced.setdefault(op.node.inputs[k], (whole, set(), set()))
                entry[1].add(nbytes)
                entry[2].add(op.node.id)
    born = {v: i for i, node in enumerate(graph.nodes) for v in node.outputs} if sliced else {}
    for v, (whole, parts, readers) in sliced.items():
        if len(parts) != 1 or (part := next(iter(parts))) >= whole or v not in born:
            continue  # the copy is the value's size (or readers differ): nothing changes
        others = [runs[pos[c]] for c in graph.consumers.get(v, ()) if c in pos and c not in readers]
        last = max(runs[pos[c]] for c in readers)
        add(max(others, default=born[v] - 1) + 1, last, part - whole)
    return _running(live)


def select_and_scatter_buffers(bp: BuiltProblem, choice: Sequence[int]) -> list[float]:
    """Bytes per device that XLA:CPU's expansion of a max-pool's gradient adds at each
    top-level moment (``DeviceSpec.compiler`` ``"xla:cpu"``; zeros elsewhere).

    XLA:CPU rewrites ``select_and_scatter`` (``xla/service/select_and_scatter_expander``)
    into a reduce-window over the padded operand and one ``s32`` iota of it per dimension,
    which finds each window's argmax (its index per dimension), and a scatter of the
    output gradient into a zero-filled padded result. Measured (``--xla_dump_to`` live
    ranges, jaxlib 0.10.2, the Wide-ResNet of bench_fidelity at batch 64 and 1024): the
    argmax reduce-window runs beside the forward pool, so the window indices
    (``s32[windows, rank]``) and the zero-filled padded result are held from the forward
    pool to the scatter, and the iotas (``rank`` padded ``s32`` arrays) live at the
    forward pool only. XLA:GPU emits ``select_and_scatter`` as one kernel: none there.

    Example:
        >>> extra = select_and_scatter_buffers(bp, choice)  # doctest: +SKIP
    """
    live = [0.0] * (len(bp.timeline) + 1)
    pools = _xla_cpu_ops(bp, "select_and_scatter_add")
    if not pools:
        return live[:-1]
    graph = bp.graph
    pos = {node.id: i for i, node in enumerate(graph.nodes)}
    _, runs = run_moments(graph)
    mesh = bp.ctx.mesh
    for op, t in pools:
        if len(op.node.in_tensors) < 2:
            continue
        source, operand = op.node.in_tensors[0], op.node.in_tensors[1]
        rank = len(operand.shape)
        pads = op.node.params.get("padding") or [(0, 0)] * rank
        padded = math.prod(
            d + int(lo) + int(hi) for d, (lo, hi) in zip(operand.shape, pads, strict=True)
        )
        st = bp.strategy(op.index, choice)
        ins = [st.ins[k] if k < len(st.ins) and st.ins[k] is not None else None for k in (0, 1)]
        src_shards = shards(ins[0], mesh) if ins[0] is not None else 1
        opd_shards = shards(ins[1], mesh) if ins[1] is not None else 1
        pool = [
            runs[pos[c]]
            for c in graph.consumers.get(op.node.inputs[1], ())
            if c in pos and graph.nodes[pos[c]].primitive == "reduce_window_max"
        ]
        first = min(min(pool, default=t), t)
        indices = math.prod(source.shape) * rank * 4 / src_shards
        result = padded * operand.itemsize / opd_shards
        live[first] += indices + result
        live[t + 1] -= indices + result
        iotas = padded * rank * 4 / opd_shards
        live[first] += iotas
        live[first + 1] -= iotas
    return _running(live)


REDUCTION_KINDS = ("all-reduce", "reduce-scatter")
"""Collectives whose result XLA writes beside their operand (:func:`reduction_buffers`)."""


def reduction_buffers(bp: BuiltProblem, choice: Sequence[int]) -> list[float]:
    """Bytes per device of reduction results held beside their operands, per moment.

    XLA runs an all-reduce out of place: its operand (the partial sums) and its result
    are both live while it runs; the timeline counts one of the two. The CPU backend
    (measured: ``--xla_dump_to`` live ranges of the Llama-like and GPT-Neo-like steps,
    ``tests/lower/test_memory_fidelity.py``) also turns a reduce-scatter into an
    all-reduce of the whole operand followed by a slice, so its result is as large as
    its operand (``Collective.nbytes``, the full input). Inside a loop body the whole
    operand of a reduce-scatter is held too, and the timeline does not have it (the
    body's value is held in the scattered output layout): there it counts twice
    ``nbytes`` (measured: in the ZeRO-3 scanned GPT's backward loop body, the combined
    all-reduce at the body's end keeps every layer gradient whole beside its reduced
    copy, ``--xla_dump_to`` buffer assignment; at the top level of the ZeRO-3 MLP the
    partitioner makes the scattered gradient without a whole one, and twice would
    overshoot by 20%). XLA's all-reduce combiner
    merges the gradient reductions (independent of one another) into one that runs when
    the last gradient is ready, so their results all sit beside their operands at that
    one moment; any other reduction (a tensor-parallel activation's) holds its extra
    buffer only at its own operation. Inside a loop body the same holds per iteration,
    at the loop's moment.

    Backend-specific: on GPU XLA runs the all-reduce asynchronously and NCCL allows it
    in place (send buffer = receive buffer), and the combiner stops at
    ``xla_gpu_all_reduce_combine_threshold_bytes``, so there this is an upper bound
    (not measured here: no GPU in CI).

    Example:
        >>> extra = reduction_buffers(bp, choice)  # data parallel  # doctest: +SKIP
        >>> max(extra) == param_bytes  # every gradient, at one moment  # doctest: +SKIP
        True
    """
    pos = {node.id: i for i, node in enumerate(bp.graph.nodes)}
    n = len(bp.timeline)
    out = [0.0] * n
    grads: dict[int | None, float] = {}  # loop moment (None: top level) -> bytes
    last_grad = -1
    for g, group in enumerate(bp.groups):
        strats = group.strategies[choice[g]]
        for k, oi in enumerate(group.ops):
            op = bp.ops[oi]
            if op.kind != "node" or k >= len(strats):
                continue
            # Inside a loop body a reduce-scatter also holds its operand (see above).
            held = 2 if op.scope else 1
            nbytes = sum(
                c.nbytes * (held if c.kind == "reduce-scatter" else 1)
                for c in strats[k].comm
                if c.kind in REDUCTION_KINDS
            )
            if not nbytes:
                continue
            t = pos.get(op.scope[0][0] if op.scope else op.node.id)
            if t is None:
                continue
            if bp.is_gradient_op(op):
                key = t if op.scope else None
                grads[key] = grads.get(key, 0.0) + nbytes
                if not op.scope:
                    last_grad = max(last_grad, t)
            elif op.scope:
                out[t] = max(out[t], nbytes)
            else:
                out[t] += nbytes
    for t, nbytes in grads.items():
        at = last_grad if t is None else t
        if 0 <= at < n:
            out[at] += nbytes
    return out


def peak(bp: BuiltProblem, choice: Sequence[int]) -> tuple[float, int, dict[str, float]]:
    """Exact peak bytes per device over every moment: (bytes, moment, breakdown).

    Resharded copies (:func:`copies`) count as ``"resharded"``, convolution layout
    copies (:func:`layout_copies`) as ``"layout_copies"`` and an expanded max-pool
    gradient (:func:`select_and_scatter_buffers`) as ``"select_and_scatter"``; the ILP's
    memory constraints leave them out (they depend on two layouts at once); the planner re-solves
    under a lower bound when they push a solution over
    (:func:`autopar.search.intra_op.solve_within_memory`)."""
    cache: dict[int, float] = {}

    def size(v: MemValue) -> float:
        b = cache.get(id(v))
        if b is None:
            b = cache[id(v)] = value_bytes(bp, v, choice)
        return b

    base: dict[str, float] = {}
    for v in bp.persistent:
        base[v.category] = base.get(v.category, 0.0) + size(v)
    totals = bp.timeline.totals(size)
    if not totals:
        return sum(base.values()), 0, base
    extra = copies(bp, choice)
    reduced = reduction_buffers(bp, choice)
    relaid = layout_copies(bp, choice)
    expanded = select_and_scatter_buffers(bp, choice)
    totals = [
        a + b + c + d + e
        for a, b, c, d, e in zip(totals, extra, reduced, relaid, expanded, strict=True)
    ]
    t = max(range(len(totals)), key=totals.__getitem__)
    bd = dict(base)
    for v in bp.timeline.live_at(t):
        bd[v.category] = bd.get(v.category, 0.0) + size(v)
    if extra[t]:
        bd["resharded"] = extra[t]
    if reduced[t]:
        bd["reduction_buffers"] = reduced[t]
    if relaid[t]:
        bd["layout_copies"] = relaid[t]
    if expanded[t]:
        bd["select_and_scatter"] = expanded[t]
    return sum(base.values()) + totals[t], t, bd


__all__ = [
    "ROLE_CATEGORY",
    "Timeline",
    "REDUCTION_KINDS",
    "canonical_conv_specs",
    "copies",
    "layout_copies",
    "liveness",
    "memory_constraint",
    "peak",
    "pick_moments",
    "reduction_buffers",
    "run_moments",
    "select_and_scatter_buffers",
    "value_bytes",
]
