"""Cutting a traced gradient step into pipeline stages (:func:`cut_stages`).

The runtime that runs the cut is :mod:`autopar.lower.pipeline`.

:func:`cut_stages` cuts the traced jaxpr of ``G`` ("compute gradients" of one
   microbatch: ``jax.value_and_grad(loss)(params, microbatch)``, inlined, as
   :func:`autopar.trace` records it) into ``p`` stages. Every equation gets a place on the
   *chain* ``F_0, F_1, ..., F_{p-1}, B_{p-1}, ..., B_0`` (position ``s`` for stage ``s``'s
   forward piece, ``2p-1-s`` for its backward piece):

   * equations of a layer go to the stage whose layer range holds it (``Node.layer``; the
     tracer labels backward equations with their layer too: by name stack for Flax, by
     data flow for plain JAX);
   * unlabelled forward equations follow the last labelled forward equation before them
     in program order (embedding work before the first layer: stage 0; head and loss:
     the last stage); unlabelled backward equations likewise (the loss and head backward,
     before any layer's backward: the last stage; the embedding backward: stage 0);
   * equations that read only constants (iotas, masks, broadcast literals) are *recomputed*
     by every piece that needs them instead of being sent;
   * an equation reading a value made later on the chain moves later (never earlier);
   * a ``scan`` over layers (``nn.scan``/``lax.scan``: the tracer's ``"scan"`` layers) is
     split: each stage runs the same body over its own slice of the stacked inputs
     (``xs``: ``L/p`` layers when the stages split the stack evenly; otherwise each its
     own count, in ``max`` slots: :attr:`StageCut.uneven_stacks`), the carry flows to the
     next stage, and the stacked outputs (``ys``: the forward scan's residuals, the
     backward scan's stacked gradients) stay on the stage that made their slice.

   Values then travel along the chain: a value made at position ``a`` and read at ``b``
   rides in every boundary between them (a forward value read by the backward piece of
   the same or a later stage goes forward, then into that stage's *stash*; one read by an
   earlier stage's backward piece is stashed where it was made and rides the backward
   boundaries). So any cross-stage read works; the cost is the bytes that ride along
   (``StageCut.describe()`` lists them).

Example:
    >>> def loss(ws, x):
    ...     for w in ws:
    ...         x = jnp.tanh(x @ w)
    ...     return jnp.mean(x ** 2)
    >>> ws = [jnp.eye(4) * (k + 1) / 4 for k in range(4)]
    >>> g = autopar.trace(jax.value_and_grad(loss), ws, jnp.ones((2, 4)))
    >>> cut = cut_stages(g, [(0, 2), (2, 4)], batch_inputs=[4])
    >>> [(pc.kind, pc.stage) for pc in cut.pieces][1:3]
    [('forward', 1), ('backward', 1)]
"""

from __future__ import annotations

import functools  # noqa: F401 - used by the docstring examples
import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import jax
from jax.extend.core import ClosedJaxpr, DropVar, Var, new_jaxpr_eqn
from jax.extend.core import Literal as JaxLiteral

from autopar.errors import LowerPlanError
from autopar.trace.tensor import itemsize

_SPLIT = -1  # position marker of a split (per-stage) scan equation
_LAYOUT_ONLY = ("sharding_constraint",)  # equations that only pin their operand's layout

# ------------------------------------------------------------------------------ records


@dataclass(frozen=True, eq=False)
class Piece:
    """One stage's forward or backward program: a list of equations and its wiring.

    Attributes:
        kind: ``"forward"`` or ``"backward"``.
        stage: the stage that runs it: the device index along ``pipe``, or with
            interleaving (``v`` chunks per device) the virtual stage, run by device
            ``stage % p``.
        position: place on the chain ``F_0 .. F_{p-1}, B_{p-1} .. B_0``.
        eqns: the equations, in program order (split scans rewritten to ``L/p`` layers;
            constant-only equations it needs are included).
        recv: values received from the previous piece on the chain (none for ``F_0`` and
            for ``B_{p-1}``, whose forward half is on the same device: stash).
        send: values sent to the next piece on the chain.
        stash: values this stage keeps from its forward to its backward piece (written by
            the forward piece, read by the backward piece).
        inputs: indices of ``G``'s flat inputs it reads.
        outputs: ``(output index, value)`` pairs: the parts of ``G``'s flat outputs it
            produces (an output that is a sum of contributions made on several stages,
            like a tied embedding's gradient, has one part per contribution; the parts
            are accumulated where they are made and added at the end).
    """

    kind: Literal["forward", "backward"]
    stage: int
    position: int
    eqns: tuple[Any, ...]
    recv: tuple[Var, ...]
    send: tuple[Var, ...]
    stash: tuple[Var, ...]
    inputs: tuple[int, ...]
    outputs: tuple[tuple[int, Var], ...]


@dataclass(frozen=True, eq=False)
class StageCut:
    """``G`` cut into ``num_stages`` pipeline stages (from :func:`cut_stages`).

    Attributes:
        num_stages: ``p`` (with interleaved 1F1B: ``p v``, one stage per model chunk;
            :func:`autopar.lower.pipeline.pipelined_gradients` maps chunk ``k`` to device
            ``k % p``).
        stage_layers: ``[start, stop)`` layer ranges per stage (``graph.layers`` indices).
        pieces: ``2p`` pieces in chain order ``F_0 .. F_{p-1}, B_{p-1} .. B_0``.
        jaxpr: the inlined closed jaxpr of ``G``.
        batch_inputs: indices of ``G``'s flat inputs that are per-microbatch data.
        stacked_inputs: indices of ``G``'s flat inputs sharded over ``pipe`` on axis 0
            (the stacked parameters of scanned layers).
        stacked_outputs: indices of ``G``'s flat outputs that are stacked per stage.
        local_avals: per-device shape of each stacked value (layer axis ``L/p``).
        in_tree / out_tree: pytree structures of ``G``'s ``(args, kwargs)`` and outputs.
        uneven_stacks: the inputs (``("in", i)``) and outputs (``("out", i)``) of ``G``
            that are a scanned stack split unevenly over the stages, each with per stage
            its ``(first layer, count)`` within the stack. The stage program is SPMD, so
            each stage holds ``n = max count`` slots of such a stack (``local_avals``),
            the slots past its count empty (zeros, never read: its scan runs ``count``
            iterations). Such an input comes whole (replicated over ``pipe``; it cannot
            be split over ``pipe`` in equal blocks) and each device takes its slots; such
            an output (a stack's gradient) is scattered back to the whole stack and
            summed over ``pipe``. They are in neither ``stacked_inputs`` nor
            ``stacked_outputs``.
        layer_recomputed: after :func:`autopar.lower.stage_remat.remat_stages`, the
            stacked residuals of a layer scan that its stage's backward re-creates one
            layer at a time (value -> the stage's layers in it); ``None`` otherwise.
    """

    num_stages: int
    stage_layers: tuple[tuple[int, int], ...]
    pieces: tuple[Piece, ...]
    jaxpr: ClosedJaxpr
    batch_inputs: tuple[int, ...]
    stacked_inputs: tuple[int, ...]
    stacked_outputs: tuple[int, ...]
    local_avals: Mapping[Var, jax.core.ShapedArray]
    in_tree: Any = None
    out_tree: Any = None
    layer_recomputed: Mapping[Var, int] | None = None
    uneven_stacks: Mapping[tuple[str, int], tuple[tuple[int, int], ...]] = field(
        default_factory=dict
    )

    def forward(self, stage: int) -> Piece:
        """Stage ``stage``'s forward piece."""
        return self.pieces[stage]

    def backward(self, stage: int) -> Piece:
        """Stage ``stage``'s backward piece."""
        return self.pieces[2 * self.num_stages - 1 - stage]

    def aval(self, v: Var) -> Any:
        """The per-device abstract value of ``v`` (stacked values: the local slice)."""
        return self.local_avals.get(v, v.aval)

    def describe(self) -> str:
        """One line per piece: equations, values received/sent/stashed and their bytes.

        Example:
            >>> print(cut.describe())  # doctest: +SKIP
            F0 stage 0: 40 eqns, recv 0 (0 B), send 1 (8.2 kB), stash 9 (...)
        """
        lines = []
        for pc in self.pieces:
            name = f"{'F' if pc.kind == 'forward' else 'B'}{pc.stage}"
            parts = []
            for what, vs in (("recv", pc.recv), ("send", pc.send), ("stash", pc.stash)):
                nbytes = sum(_nbytes(self.aval(v)) for v in vs)
                parts.append(f"{what} {len(vs)} ({nbytes:,} B)")
            lines.append(f"{name} stage {pc.stage}: {len(pc.eqns)} eqns, " + ", ".join(parts))
        return "\n".join(lines)


# ------------------------------------------------------------------------------ cutting


def cut_stages(
    graph: Any,
    stage_layers: Sequence[tuple[int, int]],
    *,
    batch_inputs: Sequence[int] | None = None,
) -> StageCut:
    """Cut the traced gradient step ``graph`` into pipeline stages by layer ranges.

    Args:
        graph: :func:`autopar.trace` of ``G`` for one microbatch, e.g.
            ``autopar.trace(jax.value_and_grad(loss), params, microbatch)``. Its layers
            (``graph.layers``) say which equations belong to which layer.
        stage_layers: per stage, the ``[start, stop)`` range of ``graph.layers`` it runs;
            contiguous, in order, covering every layer. A scanned layer stack may split
            unevenly (:attr:`StageCut.uneven_stacks`).
        batch_inputs: indices of ``G``'s flat inputs that are microbatch data (default:
            the inputs the tracer gave role ``"batch"``).

    Returns:
        The :class:`StageCut`.

    Raises:
        LowerPlanError: bad ranges, no layers, or a value that cannot reach its reader (the message names it).

    Example:
        >>> ws = [jnp.eye(4)] * 4
        >>> loss = lambda ws, x: jnp.mean(functools.reduce(lambda h, w: jnp.tanh(h @ w), ws, x))
        >>> g = autopar.trace(jax.value_and_grad(loss), ws, jnp.ones((2, 4)))
        >>> cut = cut_stages(g, [(0, 2), (2, 4)], batch_inputs=[4])
        >>> [pc.stage for pc in cut.pieces], cut.num_stages
        ([0, 1, 1, 0], 2)
    """
    return _Cutter(graph, stage_layers, batch_inputs).cut()


class _Cutter:
    def __init__(self, graph: Any, stage_layers: Sequence[tuple[int, int]], batch_inputs) -> None:
        if graph.jaxpr is None:
            raise LowerPlanError("cut_stages needs a graph from autopar.trace (it has no jaxpr)")
        self.graph = graph
        self.closed: ClosedJaxpr = graph.jaxpr
        self.jaxpr = self.closed.jaxpr
        self.eqns = list(self.jaxpr.eqns)
        self.p = len(stage_layers)
        self.ranges = tuple((int(a), int(b)) for a, b in stage_layers)
        self._check_ranges()
        if batch_inputs is None:
            batch_inputs = [i.index for i in graph.inputs if i.role == "batch"]
        self.batch_inputs = tuple(int(i) for i in batch_inputs)
        self.layer_stage: dict[int, int] = {}
        for s, (a, b) in enumerate(self.ranges):
            for k in range(a, b):
                self.layer_stage[k] = s

    def _check_ranges(self) -> None:
        n = len(self.graph.layers)
        if n == 0:
            raise LowerPlanError(
                "the traced step has no layers, so there is nothing to cut into pipeline "
                "stages; name the repeated blocks (Flax module names, jax.named_scope) or "
                "use pipe = 1"
            )
        if self.p < 1:
            raise LowerPlanError("stage_layers is empty; give one [start, stop) per stage")
        prev = 0
        for s, (a, b) in enumerate(self.ranges):
            if a != prev or b <= a:
                raise LowerPlanError(
                    f"stage_layers {list(self.ranges)}: stage {s} is [{a}, {b}) but must "
                    f"start at {prev} and be non-empty (contiguous ranges over layers 0..{n})"
                )
            prev = b
        if prev != n:
            raise LowerPlanError(
                f"stage_layers {list(self.ranges)} end at layer {prev}, but the step has {n} "
                f"layers; the last range must stop at {n}"
            )

    # -- placement ---------------------------------------------------------------------
    def cut(self) -> StageCut:
        p = self.p
        nodes = self.graph.nodes
        producer: dict[Var, int] = {}
        for k, e in enumerate(self.eqns):
            for v in e.outvars:
                if not isinstance(v, DropVar):
                    producer[v] = k
        self.producer = producer
        invar_index = {v: i for i, v in enumerate(self.jaxpr.invars)}
        self.invar_index = invar_index
        constvars = set(self.jaxpr.constvars)

        # constant-only equations: recomputed where needed
        free: set[int] = set()
        for k, e in enumerate(self.eqns):
            if e.effects or e.primitive.name in ("scan", "while", "cond"):
                continue
            if all(
                isinstance(a, JaxLiteral) or a in constvars or producer.get(a, -1) in free
                for a in e.invars
            ):
                free.add(k)
        self.free = free

        # split scans: scans over layers (the tracer's "scan" layers)
        split: dict[int, tuple[int, int]] = {}  # eqn -> (first layer of group, length)
        for k, n in enumerate(nodes):
            if n.primitive == "scan" and n.layer is not None:
                lay = self.graph.layers[n.layer]
                if lay.kind == "scan":
                    split[k] = (n.layer, n.length)
        self.split = split
        # Layers of each stack per stage: a stage runs its own count; every stage's slice
        # of the stack has the largest count's slots (the stage program is SPMD), the
        # empty slots padding (:attr:`StageCut.uneven_stacks`).
        self.counts: dict[int, tuple[int, ...]] = {}
        self.firsts: dict[int, tuple[int, ...]] = {}
        for k, (g0, length) in split.items():
            self.counts[k] = tuple(
                max(0, min(b, g0 + length) - max(a, g0)) for (a, b) in self.ranges
            )
            self.firsts[k] = tuple(min(max(a, g0), g0 + length) - g0 for (a, _) in self.ranges)
            e = self.eqns[k]
            if e.params.get("reverse", False) != (nodes[k].phase == "backward"):
                raise LowerPlanError(
                    f"scan equation {k} ({nodes[k].phase}) runs over its layers "
                    f"{'backwards' if e.params.get('reverse') else 'forwards'}; a pipeline "
                    f"needs forward scans in the forward pass and reverse scans in the backward"
                )
        self.n_local = {k: max(c) for k, c in self.counts.items()}
        self.uneven = {k for k, c in self.counts.items() if len(set(c)) > 1}

        # An output that is a sum (``add_any`` of gradient contributions: a tied
        # embedding's input and output uses) is accumulated part by part where each part
        # is made; the final sum over ``pipe`` adds them. Sending a part along the chain
        # instead would move a whole gradient through every stage for every microbatch.
        uses = Counter(a for e in self.eqns for a in e.invars if isinstance(a, Var))
        uses.update(v for v in self.jaxpr.outvars if isinstance(v, Var))
        self.folded: set[int] = set()
        self.out_parts = [self._parts(v, uses) for v in self.jaxpr.outvars]

        # initial positions
        pos: dict[int, int] = {}
        last_f, last_b = 0, p - 1
        for k, n in enumerate(nodes):
            if k in free or k in self.folded:
                continue
            bwd = n.phase == "backward"
            if k in split:  # runs on every stage; what follows it is on its last one
                pos[k] = _SPLIT
                if bwd:
                    last_b = 0
                else:
                    last_f = p - 1
                continue
            if n.layer is not None and n.layer in self.layer_stage:
                s = self.layer_stage[n.layer]
                if bwd:
                    last_b = s
                else:
                    last_f = s
            else:
                s = last_b if bwd else last_f
            pos[k] = (2 * p - 1 - s) if bwd else s
        # a reader never runs before the writer: move readers later
        for k in range(len(self.eqns)):
            if k in free or k in self.folded or pos[k] == _SPLIT:
                continue
            for a in self.eqns[k].invars:
                src = producer.get(a) if isinstance(a, Var) else None
                if src is None or src in free:
                    continue
                pos[k] = max(pos[k], self._out_position(src, a, pos))
        self.pos = pos
        return self._build()

    def _layout(self, k: int) -> tuple[tuple[int, int], ...]:
        """Per stage, the first layer (within the stack) and the count of split scan
        ``k``'s layers it runs."""
        return tuple(zip(self.firsts[k], self.counts[k], strict=True))

    def _parts(self, v: Any, uses: Counter) -> list[Any]:
        k = self.producer.get(v) if isinstance(v, Var) else None
        if k is None or k in self.free or uses[v] != 1:
            return [v]
        e = self.eqns[k]
        if e.primitive.name in _LAYOUT_ONLY and len(e.invars) == 1:
            # A pinned layout on the sum (autopar.search.stages.pipeline_activations):
            # the parts are summed over pipe at the end, whatever their layout.
            inner = e.invars[0]
            parts = self._parts(inner, uses) if isinstance(inner, Var) else [v]
            if parts != [inner]:
                self.folded.add(k)
                return parts
            return [v]
        if e.primitive.name not in ("add_any", "add") or any(
            not isinstance(a, Var)
            or a.aval.shape != v.aval.shape
            or a.aval.dtype != v.aval.dtype
            or self.producer.get(a) is None
            or self.producer[a] in self.free
            or self.producer[a] in self.split
            for a in e.invars
        ):
            return [v]
        self.folded.add(k)
        return [w for a in e.invars for w in self._parts(a, uses)]

    def _scan_positions(self, k: int) -> list[int]:
        """Chain positions of the per-stage parts of split scan ``k`` in run order."""
        p = self.p
        if self.eqns[k].params.get("reverse", False):
            return [2 * p - 1 - s for s in range(p - 1, -1, -1)]
        return list(range(p))

    def _out_position(self, src: int, v: Var, pos: dict[int, int]) -> int:
        """Where value ``v`` made by equation ``src`` becomes available (split scans: carry
        out after the last part; stacked outputs: per stage, reported as the first)."""
        if pos[src] != _SPLIT:
            return pos[src]
        e = self.eqns[src]
        nk = e.params["num_carry"]
        idx = list(e.outvars).index(v)
        parts = self._scan_positions(src)
        return parts[-1] if idx < nk else parts[0]

    # -- building pieces ---------------------------------------------------------------
    def _build(self) -> StageCut:
        p = self.p
        eqns = self.eqns
        n_pos = 2 * p
        piece_eqns: list[list[Any]] = [[] for _ in range(n_pos)]
        # (value, consumer position) pairs; value made where?
        made_at: dict[Var, int] = {}
        stacked: dict[Var, int] = {}  # stacked value -> split-scan eqn that defines its layout
        local_avals: dict[Var, Any] = {}
        for k, e in enumerate(eqns):
            if k in self.free or k in self.folded:
                continue
            if self.pos[k] != _SPLIT:
                piece_eqns[self.pos[k]].append(e)
                for v in e.outvars:
                    if not isinstance(v, DropVar):
                        made_at[v] = self.pos[k]
                continue
            nc, nk = e.params["num_consts"], e.params["num_carry"]
            n = self.n_local[k]
            xs = e.invars[nc + nk :]
            ys = e.outvars[nk:]
            for v in list(xs) + list(ys):
                if isinstance(v, DropVar) or isinstance(v, JaxLiteral):
                    continue
                stacked[v] = k
                local_avals[v] = v.aval.update(shape=(n, *v.aval.shape[1:]))
            parts = self._scan_positions(k)
            carry = list(e.invars[nc : nc + nk])
            for j, q in enumerate(parts):
                last = j == len(parts) - 1
                outs = list(e.outvars[:nk]) if last else [Var(v.aval) for v in e.outvars[:nk]]
                # A stage with fewer layers than slots scans its own count: its xs are
                # sliced to it and its ys padded back to the slots (pipeline._run_eqns).
                new = new_jaxpr_eqn(
                    list(e.invars[:nc]) + carry + list(xs),
                    outs + list(ys),
                    e.primitive,
                    dict(e.params, length=self.counts[k][q if q < p else 2 * p - 1 - q]),
                    e.effects,
                    e.source_info,
                    e.ctx,
                )
                piece_eqns[q].append(new)
                for v in outs:
                    if not isinstance(v, DropVar):
                        made_at[v] = q
                carry = outs
            for v in ys:
                if not isinstance(v, DropVar):
                    made_at[v] = _SPLIT
        self.stacked = stacked

        stacked_inputs = set()
        uneven_stacks: dict[tuple[str, int], tuple[tuple[int, int], ...]] = {}
        for v, k in stacked.items():
            if v in self.invar_index and k in self.uneven:
                uneven_stacks[("in", self.invar_index[v])] = self._layout(k)
            elif v in self.invar_index:
                stacked_inputs.add(self.invar_index[v])
            elif v in self.producer and self.producer[v] not in self.split:
                src = self.producer[v]
                raise LowerPlanError(
                    f"value {v} ({v.aval.str_short()}), made by equation {src} "
                    f"({eqns[src].primitive}), is scanned over by the layer scan {k}; the "
                    f"pipeline splits a scanned stack only when its stacked inputs are step "
                    f"inputs (parameters) or another layer scan's stacked outputs"
                )

        # routes: boundary q carries values from position q to q + 1 (q != p - 1)
        boundary: list[dict[Var, None]] = [dict() for _ in range(n_pos)]
        stash: list[dict[Var, None]] = [dict() for _ in range(p)]
        piece_inputs: list[set[int]] = [set() for _ in range(n_pos)]
        needs_free: list[set[int]] = [set() for _ in range(n_pos)]

        def stage_of(q: int) -> int:
            return q if q < p else 2 * p - 1 - q

        def route(v: Var, a: int, b: int, reader: str) -> None:
            if a == b:
                return
            if a > b:
                raise LowerPlanError(
                    f"value {v} ({v.aval.str_short()}) is made by {_piece_name(a, p)} but read "
                    f"by {reader} in {_piece_name(b, p)}, which runs before it for the same "
                    f"microbatch; this cut cannot run as a pipeline (move the layer ranges or "
                    f"unroll the scan that reads it)"
                )
            sa, sb = stage_of(a), stage_of(b)
            if b < p or a >= p:  # forward -> forward, backward -> backward
                for q in range(a, b):
                    boundary[q][v] = None
            elif sb >= sa:  # forward -> backward of the same or a later stage
                for q in range(a, sb):
                    boundary[q][v] = None
                stash[sb][v] = None
            else:  # forward -> backward of an earlier stage: stash, then ride backward
                stash[sa][v] = None
                for q in range(2 * p - 1 - sa, b):
                    boundary[q][v] = None

        def need(v: Any, b: int, reader: str) -> None:
            if isinstance(v, JaxLiteral) or v in self.jaxpr.constvars:
                return
            if v in self.invar_index:
                piece_inputs[b].add(self.invar_index[v])
                return
            src = self.producer.get(v)
            if src is not None and src in self.free:
                needs_free[b].add(src)
                return
            if v in stacked and made_at.get(v) == _SPLIT:
                k = self.producer[v]
                sb = stage_of(b)
                made = [q for q in self._scan_positions(k) if stage_of(q) == sb][0]
                route(v, made, b, reader)
                return
            route(v, made_at[v], b, reader)

        for q in range(n_pos):
            for e in piece_eqns[q]:
                for a in e.invars:
                    need(a, q, f"{e.primitive}")
        out_pos: list[tuple[int, Var, int]] = []  # (output, part, position)
        stacked_outputs = []
        for i, v in ((i, v) for i, parts in enumerate(self.out_parts) for v in parts):
            if isinstance(v, JaxLiteral) or v in self.invar_index or v not in self.producer:
                raise LowerPlanError(
                    f"output {i} of the step is an input or a constant; the pipeline sums "
                    f"outputs over microbatches and needs each to be computed"
                )
            src = self.producer[v]
            if src in self.free:
                raise LowerPlanError(
                    f"output {i} of the step ({v.aval.str_short()}) depends on no input; "
                    f"return it outside the pipelined gradient function"
                )
            if made_at[v] == _SPLIT and src in self.uneven:
                uneven_stacks[("out", i)] = self._layout(src)
            elif made_at[v] == _SPLIT:
                stacked_outputs.append(i)
            out_pos.append((i, v, made_at[v]))
        for v in stacked:
            if made_at.get(v) == _SPLIT:
                # stacked outputs must stay stage-local: read by split scans or returned
                for k2, e2 in enumerate(eqns):
                    if v in e2.invars and k2 not in self.split:
                        raise LowerPlanError(
                            f"the stacked value {v} ({v.aval.str_short()}) of layer scan "
                            f"{self.producer[v]} is read whole by equation {k2} "
                            f"({e2.primitive}); the pipeline keeps each stage's layers on "
                            f"its device and cannot give it the whole stack"
                        )
        for v in stacked:
            if v in self.invar_index:
                for k2, e2 in enumerate(eqns):
                    if v in e2.invars and k2 not in self.split:
                        raise LowerPlanError(
                            f"step input {self.invar_index[v]} ({v.aval.str_short()}) is "
                            f"scanned over by a layer scan and also read whole by equation "
                            f"{k2} ({e2.primitive}); the pipeline shards it over stages"
                        )

        pieces = []
        for q in range(n_pos):
            s = stage_of(q)
            kind = "forward" if q < p else "backward"
            frees = set()
            todo = list(needs_free[q])
            while todo:
                k = todo.pop()
                if k in frees:
                    continue
                frees.add(k)
                for a in eqns[k].invars:
                    src = self.producer.get(a) if isinstance(a, Var) else None
                    if src is not None:
                        todo.append(src)
            body = [eqns[k] for k in sorted(frees)] + piece_eqns[q]
            recv = () if q in (0, p) else tuple(boundary[q - 1])
            send = () if q in (p - 1, n_pos - 1) else tuple(boundary[q])
            outs = tuple(
                (i, v)
                for i, v, oq in out_pos
                if oq == q or (oq == _SPLIT and q in self._scan_positions(self.producer[v]))
            )
            pieces.append(
                Piece(
                    kind=kind,  # type: ignore[arg-type]
                    stage=s,
                    position=q,
                    eqns=tuple(body),
                    recv=recv,
                    send=send,
                    stash=tuple(stash[s]),
                    inputs=tuple(sorted(piece_inputs[q])),
                    outputs=outs,
                )
            )
        return StageCut(
            num_stages=p,
            stage_layers=self.ranges,
            pieces=tuple(pieces),
            jaxpr=self.closed,
            batch_inputs=self.batch_inputs,
            stacked_inputs=tuple(sorted(stacked_inputs)),
            stacked_outputs=tuple(stacked_outputs),
            local_avals=local_avals,
            uneven_stacks=uneven_stacks,
            in_tree=getattr(self.graph, "in_tree", None),
            out_tree=getattr(self.graph, "out_tree", None),
        )


def _piece_name(q: int, p: int) -> str:
    return f"F{q} (stage {q})" if q < p else f"B{2 * p - 1 - q} (stage {2 * p - 1 - q})"


def _nbytes(aval: Any) -> int:
    return int(math.prod(aval.shape)) * itemsize(aval.dtype)
