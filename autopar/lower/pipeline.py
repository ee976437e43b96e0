"""Pipeline parallelism at run time: cut a gradient step into stages, run a schedule.

Two halves:

1. :func:`cut_stages` cuts the traced jaxpr of ``G`` ("compute gradients" of one
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
     split: each stage runs the same body over its own ``L/p`` slice of the stacked inputs
     (``xs``), the carry flows to the next stage, and the stacked outputs (``ys``: the
     forward scan's residuals, the backward scan's stacked gradients) stay on the stage
     that made their slice.

   Values then travel along the chain: a value made at position ``a`` and read at ``b``
   rides in every boundary between them (a forward value read by the backward piece of
   the same or a later stage goes forward, then into that stage's *stash*; one read by an
   earlier stage's backward piece is stashed where it was made and rides the backward
   boundaries). So any cross-stage read works; the cost is the bytes that ride along
   (``StageCut.describe()`` lists them).

2. :func:`pipelined_gradients` runs the cut as one SPMD program: ``jax.shard_map`` over
   the ``pipe`` mesh axis (other mesh axes stay automatic, so the intra-op shardings of
   the partitioner apply to them), a ``lax.scan`` over the schedule's ticks, and per tick
   a ``lax.switch`` on the device's action (idle, its forward, its backward) followed by
   two ``ppermute``\\ s (activations to ``s + 1``, cotangents to ``s - 1``). Received values
   and stashes live in slot buffers whose slots a static table assigns (so 1F1B keeps at
   most ``p - s`` stashes on stage ``s``, GPipe ``M``). Outputs of ``G`` (loss, gradients,
   aux) are **summed** over microbatches; the caller scales.

Parameters: a scanned layer stack's inputs are sharded over ``pipe`` on their layer axis,
so each device holds only its stage's layers. Other parameters (unrolled layers,
embeddings) are replicated over ``pipe`` in this version; their gradients are summed over
``pipe`` at the end (only the owning stage's contribution is non-zero).

Example:
    >>> import jax, jax.numpy as jnp
    >>> def loss(ws, x):
    ...     for w in ws:
    ...         x = jnp.tanh(x @ w)
    ...     return jnp.mean(x ** 2)
    >>> ws = [jnp.eye(4) * (k + 1) / 4 for k in range(4)]
    >>> g = autopar.trace(jax.value_and_grad(loss), ws, jnp.ones((8, 4)))
    >>> cut = cut_stages(g, [(0, 2), (2, 4)], batch_inputs=[4])
    >>> mesh = autopar.lower.make_mesh({"pipe": 2, "data": 4})
    >>> run = pipelined_gradients(cut, "1f1b", 4, mesh)
    >>> loss_sum, grads_sum = jax.jit(run)(ws, jnp.ones((8, 4)))
    >>> round(float(loss_sum) / 4, 4) == round(float(loss(ws, jnp.ones((8, 4)))), 4)
    True
"""

from __future__ import annotations

import functools
import math
from collections import Counter, defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import ClosedJaxpr, DropVar, Var, new_jaxpr_eqn
from jax.extend.core import Literal as JaxLiteral
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from autopar._compat import eqn_context
from autopar.errors import LowerPlanError

ScheduleName = Literal["gpipe", "1f1b"]
SCHEDULES: tuple[str, ...] = ("gpipe", "1f1b")
_SPLIT = -1  # position marker of a split (per-stage) scan equation


# ------------------------------------------------------------------------------ records


@dataclass(frozen=True, eq=False)
class Piece:
    """One stage's forward or backward program: a list of equations and its wiring.

    Attributes:
        kind: ``"forward"`` or ``"backward"``.
        stage: the stage (= device index along ``pipe``) that runs it.
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
        num_stages: ``p``.
        stage_layers: ``[start, stop)`` layer ranges per stage (``graph.layers`` indices).
        pieces: ``2p`` pieces in chain order ``F_0 .. F_{p-1}, B_{p-1} .. B_0``.
        jaxpr: the inlined closed jaxpr of ``G``.
        batch_inputs: indices of ``G``'s flat inputs that are per-microbatch data.
        stacked_inputs: indices of ``G``'s flat inputs sharded over ``pipe`` on axis 0
            (the stacked parameters of scanned layers).
        stacked_outputs: indices of ``G``'s flat outputs that are stacked per stage.
        local_avals: per-device shape of each stacked value (layer axis ``L/p``).
        in_tree / out_tree: pytree structures of ``G``'s ``(args, kwargs)`` and outputs.
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


@dataclass(frozen=True)
class Schedule:
    """A pipeline schedule as a static table of ticks (from :func:`make_schedule`).

    Each tick every stage runs at most one piece (its forward or backward of one
    microbatch); sends happen at the end of the tick.

    Attributes:
        name: ``"gpipe"`` or ``"1f1b"``.
        num_stages: ``p``.
        microbatches: ``M``.
        ticks: ``ticks[t][s]`` is ``None`` (idle), ``("F", m)`` or ``("B", m)``.

    Example:
        >>> s = make_schedule("1f1b", 2, 3)
        >>> [row[0] for row in s.ticks]
        [('F', 0), ('F', 1), None, ('B', 0), ('F', 2), ('B', 1), None, ('B', 2)]
    """

    name: str
    num_stages: int
    microbatches: int
    ticks: tuple[tuple[tuple[str, int] | None, ...], ...]

    @property
    def bubble_fraction(self) -> float:
        """Share of stage-ticks that are idle."""
        idle = sum(op is None for row in self.ticks for op in row)
        return idle / max(1, len(self.ticks) * self.num_stages)


# ------------------------------------------------------------------------------ schedule


def make_schedule(name: str, num_stages: int, microbatches: int) -> Schedule:
    """The tick table of a schedule: per-stage op order, then earliest-start placement.

    ``"gpipe"``: every stage runs all ``M`` forwards, then all backwards. ``"1f1b"``: stage
    ``s`` runs ``min(p-1-s, M)`` warm-up forwards, then alternates one forward and one
    backward, then the remaining backwards (at most ``p - s`` microbatches in flight).

    Raises:
        LowerPlanError: unknown schedule, or sizes < 1.

    Example:
        >>> make_schedule("gpipe", 2, 2).ticks[0]
        (('F', 0), None)
    """
    p, m_count = num_stages, microbatches
    if name not in SCHEDULES:
        raise LowerPlanError(f"pipeline schedule {name!r} is not supported; use one of {SCHEDULES}")
    if p < 1 or m_count < 1:
        raise LowerPlanError(f"stages={p} and microbatches={m_count} must both be >= 1")
    orders: list[list[tuple[str, int]]] = []
    for s in range(p):
        if name == "gpipe":
            order = [("F", m) for m in range(m_count)] + [("B", m) for m in range(m_count)]
        else:
            warm = min(p - 1 - s, m_count)
            order = [("F", m) for m in range(warm)]
            for i in range(m_count - warm):
                order += [("F", warm + i), ("B", i)]
            order += [("B", m) for m in range(m_count - warm, m_count)]
        orders.append(order)
    done: dict[tuple[str, int, int], int] = {}
    nxt = [0] * p
    ticks: list[tuple[tuple[str, int] | None, ...]] = []
    t = 0
    while any(nxt[s] < len(orders[s]) for s in range(p)):
        row: list[tuple[str, int] | None] = [None] * p
        for s in range(p):
            if nxt[s] >= len(orders[s]):
                continue
            kind, m = orders[s][nxt[s]]
            if kind == "F":
                deps = [("F", m, s - 1)] if s > 0 else []
            else:
                deps = [("F", m, s)] + ([("B", m, s + 1)] if s < p - 1 else [])
            if all(d in done and done[d] < t for d in deps):
                row[s] = (kind, m)
        if all(op is None for op in row):  # pragma: no cover - the orders above never stall
            raise LowerPlanError(f"schedule {name!r} stalls at tick {t}")
        for s, op in enumerate(row):
            if op is not None:
                done[(op[0], op[1], s)] = t
                nxt[s] += 1
        ticks.append(tuple(row))
        t += 1
    return Schedule(name, p, m_count, tuple(ticks))


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
            contiguous, in order, covering every layer. A scanned layer stack must split
            evenly (each stage ``L/p`` of its ``L`` layers).
        batch_inputs: indices of ``G``'s flat inputs that are microbatch data (default:
            the inputs the tracer gave role ``"batch"``).

    Returns:
        The :class:`StageCut`.

    Raises:
        LowerPlanError: bad ranges, no layers, a scanned stack that does not split evenly,
            or a value that cannot reach its reader (the message names it).

    Example:
        >>> g = autopar.trace(jax.value_and_grad(loss), ws, jnp.ones((8, 4)))
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
        for k, (g0, length) in split.items():
            per = [
                max(0, min(b, g0 + length) - max(a, g0)) for (a, b) in self.ranges
            ]  # layers of the stack per stage
            if any(c != length // p for c in per) or length % p:
                raise LowerPlanError(
                    f"the scanned layer stack of equation {k} (layers {g0}..{g0 + length - 1}) "
                    f"splits {per} over the {p} stages; a scanned stack must split evenly "
                    f"(each stage {length}/{p} layers): choose stage ranges that cut it into "
                    f"equal parts, or unroll the layers"
                )
            e = self.eqns[k]
            if e.params.get("reverse", False) != (nodes[k].phase == "backward"):
                raise LowerPlanError(
                    f"scan equation {k} ({nodes[k].phase}) runs over its layers "
                    f"{'backwards' if e.params.get('reverse') else 'forwards'}; a pipeline "
                    f"needs forward scans in the forward pass and reverse scans in the backward"
                )
        self.n_local = {k: length // p for k, (_, length) in split.items()}

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

    def _parts(self, v: Any, uses: Counter) -> list[Any]:
        k = self.producer.get(v) if isinstance(v, Var) else None
        if k is None or k in self.free or uses[v] != 1:
            return [v]
        e = self.eqns[k]
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
                new = new_jaxpr_eqn(
                    list(e.invars[:nc]) + carry + list(xs),
                    outs + list(ys),
                    e.primitive,
                    dict(e.params, length=n),
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
        for v, k in stacked.items():
            if v in self.invar_index:
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
            if made_at[v] == _SPLIT:
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
            in_tree=getattr(self.graph, "in_tree", None),
            out_tree=getattr(self.graph, "out_tree", None),
        )


def _piece_name(q: int, p: int) -> str:
    return f"F{q} (stage {q})" if q < p else f"B{2 * p - 1 - q} (stage {2 * p - 1 - q})"


def _nbytes(aval: Any) -> int:
    return int(math.prod(aval.shape)) * np.dtype(aval.dtype).itemsize


# ------------------------------------------------------------------------------ runtime


class _Layout:
    """One padded layout shared by several groups of values (so ``lax.switch`` branches and
    ``ppermute`` see one type): slots keyed by (shape, dtype), as many of each as the
    group that needs the most."""

    def __init__(self, groups: Sequence[Sequence[Any]]) -> None:
        need: Counter = Counter()
        order: list[tuple] = []
        for avals in groups:
            c = Counter(_key(a) for a in avals)
            for key, n in c.items():
                if key not in need:
                    order.append(key)
                need[key] = max(need[key], n)
        self.slots: list[tuple] = [key for key in order for _ in range(need[key])]
        first = {}
        for j, key in enumerate(self.slots):
            first.setdefault(key, j)
        self.index: list[list[int]] = []
        for avals in groups:
            used: Counter = Counter()
            idx = []
            for a in avals:
                key = _key(a)
                idx.append(first[key] + used[key])
                used[key] += 1
            self.index.append(idx)

    def zeros(self, lead: tuple[int, ...] = ()) -> tuple[jax.Array, ...]:
        return tuple(jnp.zeros(lead + shape, dtype) for shape, dtype in self.slots)

    def pack(self, group: int, values: Sequence[Any]) -> tuple[jax.Array, ...]:
        out = list(self.zeros())
        for j, v in zip(self.index[group], values, strict=True):
            out[j] = jnp.asarray(v, self.slots[j][1]).reshape(self.slots[j][0])
        return tuple(out)

    def unpack(self, group: int, slots: Sequence[Any]) -> list[Any]:
        return [slots[j] for j in self.index[group]]


def _key(aval: Any) -> tuple:
    return (tuple(aval.shape), np.dtype(aval.dtype))


def _allocate(intervals: Sequence[tuple[int, int, Any]]) -> tuple[dict[Any, int], int]:
    """Slots for values written at the end of tick ``w`` and read at tick ``r > w``: a slot
    is free again from its reader's tick (the read comes before that tick's writes)."""
    free_at: list[int] = []
    slot: dict[Any, int] = {}
    for w, r, key in sorted(intervals, key=lambda t: (t[0], t[1])):
        for j, f in enumerate(free_at):
            if f <= w:
                slot[key] = j
                free_at[j] = r
                break
        else:
            slot[key] = len(free_at)
            free_at.append(r)
    return slot, len(free_at)


@dataclass(frozen=True)
class _Tables:
    """Per tick ``t`` and stage ``s`` (arrays ``[T, p]``): the branch to run, its
    microbatch, and the buffer slots it reads and writes (``K`` = the trash slot)."""

    branch: np.ndarray
    micro: np.ndarray
    f_read: np.ndarray
    b_read: np.ndarray
    s_read: np.ndarray
    s_write: np.ndarray
    f_write: np.ndarray
    b_write: np.ndarray
    f_slots: int
    b_slots: int
    s_slots: int


def _tables(schedule: Schedule) -> _Tables:
    p, ticks = schedule.num_stages, schedule.ticks
    at: dict[tuple[str, int, int], int] = {}
    for t, row in enumerate(ticks):
        for s, op in enumerate(row):
            if op is not None:
                at[(op[0], op[1], s)] = t
    m_count = schedule.microbatches
    f_iv: dict[int, list] = defaultdict(list)  # receiving stage -> intervals
    b_iv: dict[int, list] = defaultdict(list)
    s_iv: dict[int, list] = defaultdict(list)
    for m in range(m_count):
        for s in range(p):
            if s > 0:
                f_iv[s].append((at[("F", m, s - 1)], at[("F", m, s)], m))
            if s < p - 1:
                b_iv[s].append((at[("B", m, s + 1)], at[("B", m, s)], m))
            s_iv[s].append((at[("F", m, s)], at[("B", m, s)], m))
    f_slot = {s: _allocate(iv) for s, iv in f_iv.items()}
    b_slot = {s: _allocate(iv) for s, iv in b_iv.items()}
    s_slot = {s: _allocate(iv) for s, iv in s_iv.items()}
    kf = max([n for _, n in f_slot.values()], default=0)
    kb = max([n for _, n in b_slot.values()], default=0)
    ks = max([n for _, n in s_slot.values()], default=0)
    shape = (len(ticks), p)
    tab = {
        "branch": np.zeros(shape, np.int32),
        "micro": np.zeros(shape, np.int32),
        "f_read": np.full(shape, kf, np.int32),
        "b_read": np.full(shape, kb, np.int32),
        "s_read": np.full(shape, ks, np.int32),
        "s_write": np.full(shape, ks, np.int32),
        "f_write": np.full(shape, kf, np.int32),
        "b_write": np.full(shape, kb, np.int32),
    }
    for t, row in enumerate(ticks):
        for s, op in enumerate(row):
            if op is None:
                continue
            kind, m = op
            tab["micro"][t, s] = m
            if kind == "F":
                tab["branch"][t, s] = 1 + s
                tab["s_write"][t, s] = s_slot[s][0][m]
                if s > 0:
                    tab["f_read"][t, s] = f_slot[s][0][m]
                if s < p - 1:
                    tab["f_write"][t, s + 1] = f_slot[s + 1][0][m]
            else:
                tab["branch"][t, s] = 1 + p + s
                tab["s_read"][t, s] = s_slot[s][0][m]
                if s < p - 1:
                    tab["b_read"][t, s] = b_slot[s][0][m]
                if s > 0:
                    tab["b_write"][t, s - 1] = b_slot[s - 1][0][m]
    return _Tables(**tab, f_slots=kf, b_slots=kb, s_slots=ks)


@dataclass(frozen=True, eq=False)
class PipelinedGradients:
    """``G`` summed over microbatches, run as a pipeline (from :func:`pipelined_gradients`).

    Call it with ``G``'s arguments, the microbatch inputs holding the whole batch
    (``M`` microbatches along axis 0): it returns ``G``'s outputs (same pytree) summed
    over the microbatches. Microbatch ``m`` is rows ``m, m + M, m + 2M, ...`` (strided, so
    a batch sharded over ``data`` in contiguous blocks gives every data shard an equal
    part of every microbatch).

    Attributes:
        cut: the stages.
        schedule: the tick table.
        mesh: the device mesh (must have ``pipe_axis`` of size ``cut.num_stages``).
        pipe_axis: the mesh axis the stages run along.
        in_specs: per flat input, its ``PartitionSpec`` over ``pipe_axis`` (stacked layer
            parameters ``P(pipe)``, everything else ``P()``; other axes are left to the
            partitioner).
    """

    cut: StageCut
    schedule: Schedule
    mesh: Mesh
    pipe_axis: str
    in_specs: tuple[Any, ...]
    out_specs: tuple[Any, ...]
    _fn: Callable[..., Any]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        flat, tree = jax.tree_util.tree_flatten((args, kwargs))
        if self.cut.in_tree is not None and tree != self.cut.in_tree:
            raise LowerPlanError(
                f"arguments have structure {tree}, but G was traced with {self.cut.in_tree}"
            )
        n_in = len(self.cut.jaxpr.jaxpr.invars)
        if len(flat) != n_in:
            raise LowerPlanError(f"G takes {n_in} flat arguments, got {len(flat)}")
        m_count = self.schedule.microbatches
        for i in self.cut.batch_inputs:
            rows = jnp.shape(flat[i])[0] if jnp.ndim(flat[i]) else 0
            if rows % m_count or rows == 0:
                raise LowerPlanError(
                    f"batch input {i} has {rows} rows, not a positive multiple of the "
                    f"{m_count} microbatches"
                )
        outs = self._fn(*flat)
        if self.cut.out_tree is not None:
            return jax.tree_util.tree_unflatten(self.cut.out_tree, outs)
        return outs

    def input_shardings(self) -> list[jax.sharding.NamedSharding]:
        """``NamedSharding`` per flat input: where the pipeline wants each input."""
        return [jax.sharding.NamedSharding(self.mesh, s) for s in self.in_specs]


def pipelined_gradients(
    cut: StageCut,
    schedule: str | Schedule,
    microbatches: int,
    mesh: Mesh,
    virtual_stages: int = 1,
    *,
    pipe_axis: str = "pipe",
) -> PipelinedGradients:
    """Run ``cut`` as a pipeline over ``mesh``'s ``pipe_axis``: outputs of ``G`` summed.

    Args:
        cut: from :func:`cut_stages`, with ``num_stages`` equal to the pipe axis size.
        schedule: ``"gpipe"``, ``"1f1b"`` or a :class:`Schedule`.
        microbatches: ``M``; the batch inputs' leading dimension must be a multiple of it.
        mesh: a mesh with ``pipe_axis``; other axes (``data``, ``tensor``, ...) stay
            automatic inside the pipeline (the partitioner shards the stage programs over
            them, e.g. the batch over ``data``).
        virtual_stages: stage chunks per device (interleaved schedules); only 1 is
            supported in this version.
        pipe_axis: the mesh axis name.

    Returns:
        A :class:`PipelinedGradients`; ``jax.jit`` it.

    Raises:
        LowerPlanError: mesh/stage mismatch, unsupported schedule or virtual stages.

    Example:
        >>> run = pipelined_gradients(cut, "gpipe", 4, autopar.lower.make_mesh({"pipe": 2,
        ...                           "data": 4}))
        >>> loss_sum, grads_sum = jax.jit(run)(ws, jnp.ones((8, 4)))
    """
    p = cut.num_stages
    if pipe_axis not in mesh.shape:
        raise LowerPlanError(
            f"the mesh {dict(mesh.shape)} has no {pipe_axis!r} axis; build it with one of "
            f"size {p} (autopar.lower.make_mesh({{{pipe_axis!r}: {p}, ...}}))"
        )
    if mesh.shape[pipe_axis] != p:
        raise LowerPlanError(
            f"the cut has {p} stages but the mesh's {pipe_axis!r} axis has "
            f"{mesh.shape[pipe_axis]} devices; cut into {mesh.shape[pipe_axis]} stages"
        )
    if virtual_stages != 1:
        raise LowerPlanError(
            f"virtual_stages={virtual_stages}: interleaved schedules are not supported yet; "
            f"use virtual_stages=1 with 'gpipe' or '1f1b'"
        )
    sched = schedule if isinstance(schedule, Schedule) else make_schedule(schedule, p, microbatches)
    if sched.num_stages != p or sched.microbatches != microbatches:
        raise LowerPlanError(
            f"schedule is for {sched.num_stages} stages x {sched.microbatches} microbatches, "
            f"not {p} x {microbatches}"
        )
    n_in = len(cut.jaxpr.jaxpr.invars)
    in_specs = tuple(P(pipe_axis) if i in cut.stacked_inputs else P() for i in range(n_in))
    n_out = len(cut.jaxpr.jaxpr.outvars)
    out_specs = tuple(P(pipe_axis) if i in cut.stacked_outputs else P() for i in range(n_out))
    body = _pipeline_body(cut, sched, microbatches, pipe_axis)
    fn = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=in_specs,
        out_specs=out_specs,
        axis_names={pipe_axis},
        check_vma=False,
    )
    return PipelinedGradients(cut, sched, mesh, pipe_axis, in_specs, out_specs, fn)


def _pipeline_body(
    cut: StageCut, sched: Schedule, m_count: int, axis: str
) -> Callable[..., tuple[Any, ...]]:
    p = cut.num_stages
    tabs = _tables(sched)
    jaxpr = cut.jaxpr.jaxpr
    consts = dict(zip(jaxpr.constvars, cut.jaxpr.consts, strict=True))
    batch = set(cut.batch_inputs)
    fwd_groups = [cut.forward(s).send for s in range(p - 1)]
    bwd_groups = [cut.backward(s).send for s in range(1, p)]
    f_layout = _Layout([[cut.aval(v) for v in g] for g in fwd_groups])
    b_layout = _Layout([[cut.aval(v) for v in g] for g in bwd_groups])
    s_layout = _Layout([[cut.aval(v) for v in cut.forward(s).stash] for s in range(p)])
    out_avals = [cut.aval(v) for v in jaxpr.outvars]

    def branch_of(pc: Piece | None) -> Callable[..., Any]:
        def run(recv_f, recv_b, stash_in, fixed):
            if pc is None:
                return (f_layout.zeros(), b_layout.zeros(), s_layout.zeros(),
                        tuple(jnp.zeros(a.shape, a.dtype) for a in out_avals))  # fmt: skip
            env: dict[Any, Any] = dict(consts)
            for i in pc.inputs:
                env[jaxpr.invars[i]] = fixed[i]
            s = pc.stage
            if pc.kind == "forward":
                if s > 0:
                    env.update(zip(pc.recv, f_layout.unpack(s - 1, recv_f), strict=True))
            else:
                if s < p - 1:
                    env.update(zip(pc.recv, b_layout.unpack(s, recv_b), strict=True))
                env.update(zip(pc.stash, s_layout.unpack(s, stash_in), strict=True))
            _run_eqns(pc.eqns, env)
            fsend, bsend, sout = f_layout.zeros(), b_layout.zeros(), s_layout.zeros()
            if pc.kind == "forward":
                if s < p - 1:
                    fsend = f_layout.pack(s, [env[v] for v in pc.send])
                sout = s_layout.pack(s, [env[v] for v in pc.stash])
            elif s > 0:
                bsend = b_layout.pack(s - 1, [env[v] for v in pc.send])
            parts: dict[int, list[Any]] = defaultdict(list)
            for i, v in pc.outputs:
                parts[i].append(jnp.asarray(env[v], out_avals[i].dtype))
            contrib = tuple(
                functools.reduce(jnp.add, parts[i]).reshape(a.shape)
                if parts.get(i)
                else jnp.zeros(a.shape, a.dtype)
                for i, a in enumerate(out_avals)
            )
            return fsend, bsend, sout, contrib

        return run

    branches = [branch_of(None)]
    branches += [branch_of(cut.forward(s)) for s in range(p)]
    branches += [branch_of(cut.backward(s)) for s in range(p)]
    fwd_perm = [(i, i + 1) for i in range(p - 1)]
    bwd_perm = [(i + 1, i) for i in range(p - 1)]
    xs = tuple(
        jnp.asarray(a)
        for a in (tabs.branch, tabs.micro, tabs.f_read, tabs.b_read, tabs.s_read,
                  tabs.s_write, tabs.f_write, tabs.b_write)
    )  # fmt: skip

    def body(*flat: Any) -> tuple[Any, ...]:
        d = jax.lax.axis_index(axis)
        fixed = list(flat)
        micro_views = {}
        for i in batch:
            x = flat[i]
            micro_views[i] = x.reshape(x.shape[0] // m_count, m_count, *x.shape[1:])
        fbuf = f_layout.zeros((tabs.f_slots + 1,))
        bbuf = b_layout.zeros((tabs.b_slots + 1,))
        sbuf = s_layout.zeros((tabs.s_slots + 1,))
        accs = tuple(jnp.zeros(a.shape, a.dtype) for a in out_avals)

        def tick(carry, row):
            fbuf, bbuf, sbuf, accs = carry
            br, m, fr, brd, sr, sw, fw, bw = (r[d] for r in row)
            fx = list(fixed)
            for i, x in micro_views.items():
                fx[i] = jax.lax.dynamic_index_in_dim(x, m, axis=1, keepdims=False)
            recv_f = tuple(jax.lax.dynamic_index_in_dim(b, fr, keepdims=False) for b in fbuf)
            recv_b = tuple(jax.lax.dynamic_index_in_dim(b, brd, keepdims=False) for b in bbuf)
            st = tuple(jax.lax.dynamic_index_in_dim(b, sr, keepdims=False) for b in sbuf)
            fsend, bsend, sout, contrib = jax.lax.switch(
                br, branches, recv_f, recv_b, st, tuple(fx)
            )
            sbuf = tuple(
                jax.lax.dynamic_update_index_in_dim(b, v, sw, 0)
                for b, v in zip(sbuf, sout, strict=True)
            )
            accs = tuple(a + c for a, c in zip(accs, contrib, strict=True))
            if p > 1:
                fin = tuple(jax.lax.ppermute(v, axis, fwd_perm) for v in fsend)
                bin_ = tuple(jax.lax.ppermute(v, axis, bwd_perm) for v in bsend)
                fbuf = tuple(
                    jax.lax.dynamic_update_index_in_dim(b, v, fw, 0)
                    for b, v in zip(fbuf, fin, strict=True)
                )
                bbuf = tuple(
                    jax.lax.dynamic_update_index_in_dim(b, v, bw, 0)
                    for b, v in zip(bbuf, bin_, strict=True)
                )
            return (fbuf, bbuf, sbuf, accs), None

        (_, _, _, accs), _ = jax.lax.scan(tick, (fbuf, bbuf, sbuf, accs), xs)
        return tuple(
            a if i in cut.stacked_outputs else jax.lax.psum(a, axis) for i, a in enumerate(accs)
        )

    return body


def _run_eqns(eqns: Sequence[Any], env: dict[Any, Any]) -> None:
    """Evaluate equations in order (as ``jax.core.eval_jaxpr`` does), filling ``env``."""
    for eqn in eqns:
        invals = [a.val if isinstance(a, JaxLiteral) else env[a] for a in eqn.invars]
        with eqn_context(eqn):
            out = eqn.primitive.bind(*invals, **eqn.primitive.get_bind_params(eqn.params))
        outs = out if eqn.primitive.multiple_results else [out]
        for v, o in zip(eqn.outvars, outs, strict=True):
            if not isinstance(v, DropVar):
                env[v] = o
