"""Pipeline parallelism at run time: run a cut gradient step over a ``pipe`` mesh axis.

:func:`autopar.lower.stages.cut_stages` (re-exported here) cuts ``G``, the traced
``jax.value_and_grad(loss)`` of one microbatch, into per-stage forward and backward
pieces. :func:`pipelined_gradients` runs them as one SPMD program: ``jax.shard_map`` over
the ``pipe`` mesh axis (other mesh axes stay automatic, so the partitioner's intra-op
shardings apply to them: measured with ``data`` beside ``pipe``), a ``lax.scan`` over the
schedule's ticks, and per tick a ``lax.switch`` on the device's action (idle, its
forward, its backward) followed by two ``ppermute``\\ s (activations to ``s + 1``,
cotangents to ``s - 1``). Received values and stashes live in slot buffers whose slots a
static table assigns (so 1F1B keeps at most ``p - s`` stashes on stage ``s``, GPipe
``M``). Outputs of ``G`` (loss, gradients, aux) are **summed** over microbatches; the
caller scales. Schedules: :func:`make_schedule` (``"gpipe"``, ``"1f1b"``).

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
    >>> g = autopar.trace(jax.value_and_grad(loss), ws, jnp.ones((2, 4)))
    >>> cut = cut_stages(g, [(0, 2), (2, 4)], batch_inputs=[4])
    >>> mesh = autopar.lower.make_mesh({"pipe": 2, "data": 4})
    >>> run = pipelined_gradients(cut, "1f1b", 4, mesh)
    >>> loss_sum, grads_sum = jax.jit(run)(ws, jnp.ones((8, 4)))
    >>> round(float(loss_sum) / 4, 4) == round(float(loss(ws, jnp.ones((8, 4)))), 4)
    True
"""

from __future__ import annotations

import functools
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import DropVar
from jax.extend.core import Literal as JaxLiteral
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from autopar._compat import eqn_context
from autopar.errors import LowerPlanError
from autopar.lower.stages import Piece, StageCut, cut_stages

__all__ = [
    "SCHEDULES",
    "Piece",
    "PipelinedGradients",
    "Schedule",
    "StageCut",
    "cut_stages",
    "make_schedule",
    "pipelined_gradients",
]

ScheduleName = Literal["gpipe", "1f1b"]
SCHEDULES: tuple[str, ...] = ("gpipe", "1f1b")


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
            want = self.cut.jaxpr.jaxpr.invars[i].aval.shape[:1]
            if rows % m_count or rows == 0 or (rows // m_count,) != want:
                raise LowerPlanError(
                    f"batch input {i} has {rows} rows; with {m_count} microbatches of the "
                    f"{want[0] if want else '?'} rows G was traced with it needs "
                    f"{m_count * want[0] if want else '?'} (trace G on one microbatch)"
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
        >>> mesh = autopar.lower.make_mesh({"pipe": 2, "data": 4})
        >>> ws = [jnp.eye(4)] * 4
        >>> loss = lambda ws, x: jnp.mean(functools.reduce(lambda h, w: jnp.tanh(h @ w), ws, x))
        >>> g = autopar.trace(jax.value_and_grad(loss), ws, jnp.ones((2, 4)))
        >>> cut = cut_stages(g, [(0, 2), (2, 4)], batch_inputs=[4])
        >>> run = pipelined_gradients(cut, "gpipe", 4, mesh)
        >>> loss_sum, grads_sum = jax.jit(run)(ws, jnp.ones((8, 4)))  # doctest: +SKIP
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
