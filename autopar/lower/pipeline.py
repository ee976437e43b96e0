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
caller scales. Schedules: :func:`make_schedule` (``"gpipe"``, ``"1f1b"``,
``"interleaved-1f1b"``).

Interleaved 1F1B (``virtual_stages = v > 1``): the cut has ``p v`` stages (model chunks)
and device ``d`` runs chunks ``d, p + d, 2p + d, ...``; the ``ppermute`` sends become a ring
(the forward from device ``p - 1`` feeds device 0's next chunk, backward the reverse).
A scanned stack comes in split over ``pipe`` in contiguous blocks like any other (device
``d`` holds chunks ``d v .. d v + v - 1``); once per step the program moves each chunk to
the device that runs it with a few ``ppermute`` rounds (:func:`stack_relayout`: every device
sends only the chunks it must, at most ``v``) and the stack's gradients back the same way.

Parameters: a scanned layer stack's inputs are sharded over ``pipe`` on their layer axis,
so each device holds only its stage's layers. A stack the stages split unevenly
(:attr:`~autopar.lower.stages.StageCut.uneven_stacks`: 5 layers as 3 + 2) comes whole
instead; every device takes ``v`` chunks of ``n`` slots from it (``n`` the largest
stage's count; a shorter stage's last slots are zero padding its scan never reads), and
the stack's gradients go back scattered to their layers and summed over ``pipe``.
A plan's pins that reshard a step input (a weight gathered for its matmul) are applied
once per step before the ticks, as the cost model prices them, not in every forward and
backward piece (:func:`_hoisted_layouts`). Other parameters (unrolled layers,
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
from jax.extend.core import DropVar, Var
from jax.extend.core import Literal as JaxLiteral
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from autopar._compat import COMPOSITE_BODY_PARAMS, eqn_context
from autopar.errors import LowerPlanError
from autopar.lower.stages import Piece, StageCut, cut_stages
from autopar.lower.workarounds import guard_gather, guard_scatter_result
from autopar.trace.tensor import KEY_IMPLS

__all__ = [
    "SCHEDULES",
    "Piece",
    "PipelinedGradients",
    "Schedule",
    "StackRelayout",
    "StageCut",
    "buffer_slots",
    "cut_stages",
    "key_impl_name",
    "make_schedule",
    "pipelined_gradients",
    "send_slots",
    "slot_key",
    "slot_values",
    "stack_relayout",
]

ScheduleName = Literal["gpipe", "1f1b", "interleaved-1f1b"]
SCHEDULES: tuple[str, ...] = ("gpipe", "1f1b", "interleaved-1f1b")

Op = tuple  # ("F" | "B", microbatch) or, with virtual stages, ("F" | "B", microbatch, stage)


@dataclass(frozen=True)
class Schedule:
    """A pipeline schedule as a static table of ticks (from :func:`make_schedule`).

    Each tick every device runs at most one piece (the forward or backward of one
    microbatch through one of its stages); sends happen at the end of the tick.

    Attributes:
        name: ``"gpipe"``, ``"1f1b"`` or ``"interleaved-1f1b"``.
        num_stages: ``p``, devices along ``pipe``.
        microbatches: ``M``.
        ticks: ``ticks[t][d]`` is ``None`` (idle), ``("F", m)`` or ``("B", m)`` (device
            ``d``'s own stage); with ``virtual_stages > 1``, ``("F", m, k)`` or
            ``("B", m, k)``: virtual stage ``k`` (model chunk ``k``, on device ``k % p``).
        virtual_stages: ``v``, model chunks per device (device ``d`` holds chunks
            ``d, p + d, 2p + d, ...``).

    Example:
        >>> s = make_schedule("1f1b", 2, 3)
        >>> [row[0] for row in s.ticks]
        [('F', 0), ('F', 1), None, ('B', 0), ('F', 2), ('B', 1), None, ('B', 2)]
        >>> [row[0] for row in make_schedule("interleaved-1f1b", 2, 2, 2).ticks][:4]
        [('F', 0, 0), ('F', 1, 0), ('F', 0, 2), ('F', 1, 2)]
    """

    name: str
    num_stages: int
    microbatches: int
    ticks: tuple[tuple[Op | None, ...], ...]
    virtual_stages: int = 1

    @property
    def bubble_fraction(self) -> float:
        """Share of device-ticks that are idle."""
        idle = sum(op is None for row in self.ticks for op in row)
        return idle / max(1, len(self.ticks) * self.num_stages)

    def ops(self) -> list[tuple[int, int, str, int, int]]:
        """Every op as ``(tick, device, kind, microbatch, virtual stage)``.

        Example:
            >>> make_schedule("gpipe", 2, 1).ops()[:2]
            [(0, 0, 'F', 0, 0), (1, 1, 'F', 0, 1)]
        """
        return [
            (t, d, op[0], op[1], op[2] if len(op) == 3 else d)
            for t, row in enumerate(self.ticks)
            for d, op in enumerate(row)
            if op is not None
        ]


# ------------------------------------------------------------------------------ schedule


def _device_order(name: str, d: int, p: int, m_count: int, v: int) -> list[tuple[str, int, int]]:
    """Device ``d``'s ops ``(kind, microbatch, virtual stage)`` in run order. The same
    orders as ``cost_models.pipeline`` simulates (its ``_order``), so the tick table and
    the predicted bubble agree."""
    if name == "gpipe":
        return [("F", m, d) for m in range(m_count)] + [("B", m, d) for m in range(m_count)]
    if name == "1f1b" or v == 1:
        warm = min(p - 1 - d, m_count)
        order = [("F", m, d) for m in range(warm)]
        for i in range(m_count - warm):
            order += [("F", warm + i, d), ("B", i, d)]
        return order + [("B", m, d) for m in range(m_count - warm, m_count)]
    # Megatron-LM's interleaved schedule (forward_backward_pipelining_with_interleaving):
    # the k-th chunk-forward of a device is chunk (k // p) % v of microbatch
    # (k // pv) p + k % p (microbatches go through the chunks in groups of p); backwards
    # run the chunks in reverse.
    total = m_count * v

    def fwd(k: int) -> tuple[str, int, int]:
        return ("F", (k // (p * v)) * p + k % p, ((k // p) % v) * p + d)

    def bwd(k: int) -> tuple[str, int, int]:
        return ("B", (k // (p * v)) * p + k % p, (v - 1 - (k // p) % v) * p + d)

    warm = total if m_count == p else min(2 * (p - d - 1) + (v - 1) * p, total)
    order = [fwd(k) for k in range(warm)]
    for k in range(total - warm):
        order += [fwd(warm + k), bwd(k)]
    return order + [bwd(k) for k in range(total - warm, total)]


def make_schedule(
    name: str, num_stages: int, microbatches: int, virtual_stages: int = 1
) -> Schedule:
    """The tick table of a schedule: per-device op order, then earliest-start placement.

    ``"gpipe"``: every stage runs all ``M`` forwards, then all backwards. ``"1f1b"``: stage
    ``s`` runs ``min(p-1-s, M)`` warm-up forwards, then alternates one forward and one
    backward, then the remaining backwards (at most ``p - s`` microbatches in flight).
    ``"interleaved-1f1b"`` (Narayanan et al. 2021) with ``v = virtual_stages`` chunks per
    device: the model is ``p v`` virtual stages, device ``d`` runs stages ``d, p + d, ...``;
    microbatches go through the chunks in groups of ``p``; device ``d`` warms up with
    ``2(p-d-1) + (v-1)p`` chunk-forwards (all of them when ``M == p``), then alternates,
    then drains. It needs ``M % p == 0``; with ``v = 1`` it is ``"1f1b"``.

    An op runs at the first tick after its inputs' ops (forward of the previous virtual
    stage; backward of the next one and its own forward) on its device's turn, so with
    equal forward and backward times the table is ``cost_models.simulate_schedule``'s
    timeline, tick for tick.

    Raises:
        LowerPlanError: unknown schedule, sizes < 1, ``virtual_stages > 1`` with a
            schedule other than ``"interleaved-1f1b"``, or ``M`` not a multiple of ``p``.

    Example:
        >>> make_schedule("gpipe", 2, 2).ticks[0]
        (('F', 0), None)
        >>> len(make_schedule("interleaved-1f1b", 2, 4, 2).ticks)  # ticks of half a 1F1B tick: 18 vs 1F1B's 2 * 10
        18
    """
    p, m_count, v = num_stages, microbatches, virtual_stages
    if name not in SCHEDULES:
        raise LowerPlanError(f"pipeline schedule {name!r} is not supported; use one of {SCHEDULES}")
    if p < 1 or m_count < 1 or v < 1:
        raise LowerPlanError(
            f"stages={p}, microbatches={m_count} and virtual_stages={v} must all be >= 1"
        )
    if v > 1 and name != "interleaved-1f1b":
        raise LowerPlanError(
            f"virtual_stages={v} needs the 'interleaved-1f1b' schedule, not {name!r}; use "
            f"virtual_stages=1 with {name!r}"
        )
    if v > 1 and m_count % p:
        raise LowerPlanError(
            f"interleaved-1f1b needs the microbatches to be a multiple of the pipeline size "
            f"(microbatches go through the chunks in groups of p): got microbatches={m_count}, "
            f"p={p}; use {max(p, m_count // p * p)} or {(m_count // p + 1) * p}"
        )
    n_stages = p * v
    orders = [_device_order(name, d, p, m_count, v) for d in range(p)]
    done: dict[tuple[str, int, int], int] = {}
    nxt = [0] * p
    ticks: list[tuple[Op | None, ...]] = []
    t = 0
    while any(nxt[d] < len(orders[d]) for d in range(p)):
        row: list[tuple[str, int, int] | None] = [None] * p
        for d in range(p):
            if nxt[d] >= len(orders[d]):
                continue
            kind, m, k = orders[d][nxt[d]]
            if kind == "F":
                deps = [("F", m, k - 1)] if k > 0 else []
            else:
                deps = [("F", m, k)] + ([("B", m, k + 1)] if k < n_stages - 1 else [])
            if all(dep in done and done[dep] < t for dep in deps):
                row[d] = (kind, m, k)
        if all(op is None for op in row):  # pragma: no cover - the orders above never stall
            raise LowerPlanError(f"schedule {name!r} stalls at tick {t}")
        for d, op in enumerate(row):
            if op is not None:
                done[op] = t
                nxt[d] += 1
        ticks.append(tuple(None if op is None else op if v > 1 else op[:2] for op in row))
        t += 1
    return Schedule(name, p, m_count, tuple(ticks), v)


# ------------------------------------------------------------------------------ runtime


class _Layout:
    """One padded layout shared by several groups of values (so ``lax.switch`` branches and
    ``ppermute`` see one type): slots keyed by (shape, dtype), as many of each as the
    group that needs the most."""

    def __init__(self, groups: Sequence[Sequence[Any]]) -> None:
        need: Counter = Counter()
        order: list[tuple] = []
        for avals in groups:
            c = Counter(slot_key(a) for a in avals)
            for key, n in c.items():
                if key not in need:
                    order.append(key)
                need[key] = max(need[key], n)
        self.slots: list[tuple] = [key for key in order for _ in range(need[key])]
        first = {}
        for j, key in enumerate(self.slots):
            first.setdefault(key, j)
        self.index: list[list[int]] = []
        # Per group and value: the PRNG implementation of a typed key (sent as its raw
        # data, wrapped again on arrival), else None.
        self.impls: list[list[str | None]] = []
        for avals in groups:
            used: Counter = Counter()
            idx = []
            for a in avals:
                key = slot_key(a)
                idx.append(first[key] + used[key])
                used[key] += 1
            self.index.append(idx)
            self.impls.append([key_impl_name(a.dtype) for a in avals])

    def zeros(self, lead: tuple[int, ...] = ()) -> tuple[jax.Array, ...]:
        return tuple(jnp.zeros(lead + shape, dtype) for shape, dtype in self.slots)

    def pack(self, group: int, values: Sequence[Any]) -> tuple[jax.Array, ...]:
        out = list(self.zeros())
        for j, v, impl in zip(self.index[group], values, self.impls[group], strict=True):
            if impl is not None:
                v = jax.random.key_data(v)
            out[j] = jnp.asarray(v, self.slots[j][1]).reshape(self.slots[j][0])
        return tuple(out)

    def unpack(self, group: int, slots: Sequence[Any]) -> list[Any]:
        return [
            slots[j] if impl is None else jax.random.wrap_key_data(slots[j], impl=impl)
            for j, impl in zip(self.index[group], self.impls[group], strict=True)
        ]


def _is_key(dtype: Any) -> bool:
    return jnp.issubdtype(dtype, jax.dtypes.prng_key)


@functools.cache
def key_impl_name(dtype: Any) -> str | None:
    """The name of the PRNG implementation of a typed key dtype (``None`` for any
    other dtype), among JAX's built-in ones.

    Raises:
        LowerPlanError: a key of an implementation registered outside JAX.

    Example:
        >>> key_impl_name(jax.random.key(0).dtype), key_impl_name(jnp.dtype("uint32"))
        ('threefry2x32', None)
    """
    if not _is_key(dtype):
        return None
    known = KEY_IMPLS.get(str(dtype))
    if known is not None:
        return known[0]
    raise LowerPlanError(
        f"a pipeline cannot send a PRNG key of dtype {dtype}: unknown implementation."
    )


def slot_key(aval: Any) -> tuple[tuple[int, ...], np.dtype]:
    """The (shape, dtype) a value takes in a pipeline's buffers: a typed PRNG key's is
    its raw data's (``jax.random.key_data``).

    Example:
        >>> slot_key(jax.ShapeDtypeStruct((3,), jax.random.key(0).dtype))
        ((3, 2), dtype('uint32'))
    """
    if _is_key(aval.dtype):
        aval = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(aval.shape, aval.dtype))
    return (tuple(aval.shape), np.dtype(aval.dtype))


def _send_layouts(cut: StageCut) -> tuple[_Layout, _Layout]:
    """The padded layouts every tick sends forward (to the next stage) and backward."""
    p = cut.num_stages
    fwd = _Layout([[cut.aval(v) for v in cut.forward(s).send] for s in range(p - 1)])
    bwd = _Layout([[cut.aval(v) for v in cut.backward(s).send] for s in range(1, p)])
    return fwd, bwd


def _stash_layout(cut: StageCut) -> _Layout:
    """The padded layout of what a stage keeps from its forward to its backward piece."""
    return _Layout([[cut.aval(v) for v in cut.forward(s).stash] for s in range(cut.num_stages)])


def buffer_slots(
    cut: StageCut, schedule: Schedule
) -> dict[str, tuple[int, tuple[tuple[tuple[int, ...], np.dtype], ...]]]:
    """The slot buffers the pipeline carries from tick to tick, on every device:
    ``{"forward" | "backward" | "stash": (slots, layout)}``, ``slots`` counting the spare
    one idle ticks write to, ``layout`` the ``(shape, dtype)`` of one slot's arrays (as
    :func:`send_slots`: per ``pipe`` device, other mesh axes left to the partitioner).
    "forward" / "backward" hold received activations / cotangents, "stash" what a
    stage keeps from a microbatch's forward for its backward (1F1B: the most microbatches
    any stage holds, ``p``; GPipe: ``M``).

    Example:
        >>> loss = lambda ws, x: jnp.mean(functools.reduce(lambda h, w: jnp.tanh(h @ w), ws, x))
        >>> g = autopar.trace(jax.value_and_grad(loss), [jnp.eye(4)] * 4, jnp.ones((2, 4)))
        >>> cut = cut_stages(g, [(0, 2), (2, 4)], batch_inputs=[4])
        >>> {k: n for k, (n, _) in buffer_slots(cut, make_schedule("gpipe", 2, 4)).items()}
        {'forward': 2, 'backward': 2, 'stash': 5}
    """
    tabs = _tables(schedule)
    fwd, bwd = _send_layouts(cut)
    return {
        "forward": (tabs.f_slots + 1, tuple(fwd.slots)),
        "backward": (tabs.b_slots + 1, tuple(bwd.slots)),
        "stash": (tabs.s_slots + 1, tuple(_stash_layout(cut).slots)),
    }


def send_slots(cut: StageCut) -> tuple[tuple[tuple[int, ...], np.dtype], ...]:
    """``(shape, dtype)`` of each buffer one tick of the pipeline sends: the forward
    layout's slots, then the backward layout's (one ``ppermute`` each, every tick, idle
    ticks included; none with one stage). Shapes are as laid out inside the program
    (per ``pipe`` device; other mesh axes are left to the partitioner).

    Example:
        >>> loss = lambda ws, x: jnp.mean(functools.reduce(lambda h, w: jnp.tanh(h @ w), ws, x))
        >>> g = autopar.trace(jax.value_and_grad(loss), [jnp.eye(4)] * 4, jnp.ones((2, 4)))
        >>> cut = cut_stages(g, [(0, 2), (2, 4)], batch_inputs=[4])
        >>> [(shape, str(dtype)) for shape, dtype in send_slots(cut)]  # [microbatch, 4]
        [((2, 4), 'float32'), ((2, 4), 'float32')]
    """
    if cut.num_stages < 2:
        return ()
    fwd, bwd = _send_layouts(cut)
    return tuple(fwd.slots) + tuple(bwd.slots)


def slot_values(cut: StageCut) -> dict[str, tuple[tuple[Var, ...], ...]]:
    """The values each slot of :func:`buffer_slots`' layouts holds, over the stages
    (``"forward"``, ``"backward"``, ``"stash"``; slots in the layouts' order): what a
    slot's bytes per device depend on when the stages' layouts are pinned.

    Example:
        >>> loss = lambda ws, x: jnp.mean(functools.reduce(lambda h, w: jnp.tanh(h @ w), ws, x))
        >>> g = autopar.trace(jax.value_and_grad(loss), [jnp.eye(4)] * 4, jnp.ones((2, 4)))
        >>> cut = cut_stages(g, [(0, 2), (2, 4)], batch_inputs=[4])
        >>> [len(vs) for vs in slot_values(cut)["forward"]]  # one slot, stage 0's value
        [1]
    """
    p = cut.num_stages
    fwd, bwd = _send_layouts(cut)
    groups = {
        "forward": (fwd, [cut.forward(s).send for s in range(p - 1)]),
        "backward": (bwd, [cut.backward(s).send for s in range(1, p)]),
        "stash": (_stash_layout(cut), [cut.forward(s).stash for s in range(p)]),
    }
    out = {}
    for name, (layout, values) in groups.items():
        per: list[list[Var]] = [[] for _ in layout.slots]
        for g, vs in enumerate(values):
            for j, v in zip(layout.index[g], vs, strict=True):
                per[j].append(v)
        out[name] = tuple(tuple(x) for x in per)
    return out


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
    microbatch, the buffer slots it reads and writes (``K`` = the trash slot), and the
    device's chunk it runs (``k // p`` for virtual stage ``k``; 0 when idle)."""

    branch: np.ndarray
    micro: np.ndarray
    f_read: np.ndarray
    b_read: np.ndarray
    s_read: np.ndarray
    s_write: np.ndarray
    f_write: np.ndarray
    b_write: np.ndarray
    chunk: np.ndarray
    f_slots: int
    b_slots: int
    s_slots: int


def _tables(schedule: Schedule) -> _Tables:
    """Branches and slots of every (tick, device). Virtual stage ``k`` runs on device
    ``k % p``; its forward sends to stage ``k + 1`` (device ``d + 1``, or device 0 from
    device ``p - 1`` for the next chunk group), its backward to stage ``k - 1``. Buffers
    are per receiving device, keyed by (virtual stage, microbatch)."""
    p, v, ticks = schedule.num_stages, schedule.virtual_stages, schedule.ticks
    n_st = p * v
    ops = schedule.ops()
    at = {(kind, m, k): t for t, _, kind, m, k in ops}
    f_iv: dict[int, list] = defaultdict(list)  # receiving device -> intervals
    b_iv: dict[int, list] = defaultdict(list)
    s_iv: dict[int, list] = defaultdict(list)
    for m in range(schedule.microbatches):
        for k in range(n_st):
            if k > 0:
                f_iv[k % p].append((at[("F", m, k - 1)], at[("F", m, k)], (k, m)))
            if k < n_st - 1:
                b_iv[k % p].append((at[("B", m, k + 1)], at[("B", m, k)], (k, m)))
            s_iv[k % p].append((at[("F", m, k)], at[("B", m, k)], (k, m)))
    f_slot = {d: _allocate(iv)[0] for d, iv in f_iv.items()}
    b_slot = {d: _allocate(iv)[0] for d, iv in b_iv.items()}
    s_slot = {d: _allocate(iv)[0] for d, iv in s_iv.items()}
    kf = max([len(set(sl.values())) for sl in f_slot.values()], default=0)
    kb = max([len(set(sl.values())) for sl in b_slot.values()], default=0)
    ks = max([len(set(sl.values())) for sl in s_slot.values()], default=0)
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
        "chunk": np.zeros(shape, np.int32),
    }
    for t, d, kind, m, k in ops:
        tab["micro"][t, d] = m
        tab["chunk"][t, d] = k // p
        if kind == "F":
            tab["branch"][t, d] = 1 + k
            tab["s_write"][t, d] = s_slot[d][(k, m)]
            if k > 0:
                tab["f_read"][t, d] = f_slot[d][(k, m)]
            if k < n_st - 1:
                tab["f_write"][t, (k + 1) % p] = f_slot[(k + 1) % p][(k + 1, m)]
        else:
            tab["branch"][t, d] = 1 + n_st + k
            tab["s_read"][t, d] = s_slot[d][(k, m)]
            if k < n_st - 1:
                tab["b_read"][t, d] = b_slot[d][(k, m)]
            if k > 0:
                tab["b_write"][t, (k - 1) % p] = b_slot[(k - 1) % p][(k - 1, m)]
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
            partitioner). Interleaved too: the program itself moves the chunks
            (:func:`stack_relayout`).
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

    @property
    def sends_per_step(self) -> int:
        """``ppermute`` s one step runs: ticks x buffers sent per tick
        (:func:`send_slots`)."""
        return len(self.schedule.ticks) * len(send_slots(self.cut))

    @property
    def send_bytes(self) -> int:
        """Bytes one ``pipe`` device sends in one step: ticks x the padded buffers of a
        tick, as the program lays them out (a partitioner that splits a buffer over other
        mesh axes sends that share of it per device).

        Example:
            >>> loss = lambda ws, x: jnp.mean(functools.reduce(lambda h, w: h @ w, ws, x))
            >>> g = autopar.trace(jax.value_and_grad(loss), [jnp.eye(4)] * 4, jnp.ones((2, 4)))
            >>> cut = cut_stages(g, [(0, 2), (2, 4)], batch_inputs=[4])
            >>> mesh = autopar.lower.make_mesh({"pipe": 2, "data": 4})
            >>> run = pipelined_gradients(cut, "1f1b", 4, mesh)
            >>> len(run.schedule.ticks), run.sends_per_step, run.send_bytes  # [2, 4] f32 each
            (10, 20, 640)
        """
        per_tick = sum(
            int(np.prod(shape)) * dtype.itemsize for shape, dtype in send_slots(self.cut)
        )
        return len(self.schedule.ticks) * per_tick


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
        virtual_stages: ``v``, model chunks per device (``"interleaved-1f1b"``): the cut
            then has ``p v`` stages (one per chunk, in model order) for a ``pipe`` axis of
            ``p`` devices, and device ``d`` runs chunks ``d, p + d, ...``. Needs
            ``microbatches % p == 0``. A scanned stack's chunks are moved to the devices
            that run them and its gradients back inside the program
            (:func:`stack_relayout`); its layout outside stays ``P(pipe)``.
        pipe_axis: the mesh axis name.

    Returns:
        A :class:`PipelinedGradients`; ``jax.jit`` it.

    Raises:
        LowerPlanError: mesh/stage mismatch, unsupported schedule, a microbatch count
            the interleaved schedule cannot use.

    Example:
        >>> mesh = autopar.lower.make_mesh({"pipe": 2, "data": 4})
        >>> ws = [jnp.eye(4)] * 4
        >>> loss = lambda ws, x: jnp.mean(functools.reduce(lambda h, w: jnp.tanh(h @ w), ws, x))
        >>> g = autopar.trace(jax.value_and_grad(loss), ws, jnp.ones((2, 4)))
        >>> cut = cut_stages(g, [(0, 2), (2, 4)], batch_inputs=[4])
        >>> run = pipelined_gradients(cut, "gpipe", 4, mesh)
        >>> loss_sum, grads_sum = jax.jit(run)(ws, jnp.ones((8, 4)))  # doctest: +SKIP
    """
    v = virtual_stages
    if not isinstance(v, int) or v < 1:
        raise LowerPlanError(f"virtual_stages={v!r} must be an integer >= 1")
    n_st = cut.num_stages
    p = n_st // v
    if pipe_axis not in mesh.shape:
        raise LowerPlanError(
            f"the mesh {dict(mesh.shape)} has no {pipe_axis!r} axis; build it with one of "
            f"size {p} (autopar.lower.make_mesh({{{pipe_axis!r}: {p}, ...}}))"
        )
    if v == 1 and mesh.shape[pipe_axis] != n_st:
        raise LowerPlanError(
            f"the cut has {n_st} stages but the mesh's {pipe_axis!r} axis has "
            f"{mesh.shape[pipe_axis]} devices; cut into {mesh.shape[pipe_axis]} stages"
        )
    if v > 1 and mesh.shape[pipe_axis] * v != n_st:
        raise LowerPlanError(
            f"the cut has {n_st} stages, but virtual_stages={v} on the mesh's {pipe_axis!r} "
            f"axis of {mesh.shape[pipe_axis]} devices needs {mesh.shape[pipe_axis] * v} "
            f"(p * v chunks: device d runs chunks d, p + d, ...); cut into that many"
        )
    if isinstance(schedule, Schedule):
        sched = schedule
    else:
        sched = make_schedule(schedule, p, microbatches, v)
    if (sched.num_stages, sched.microbatches, sched.virtual_stages) != (p, microbatches, v):
        raise LowerPlanError(
            f"schedule is for {sched.num_stages} stages x {sched.microbatches} microbatches "
            f"x {sched.virtual_stages} virtual stages, not {p} x {microbatches} x {v}"
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


@dataclass(frozen=True)
class StackRelayout:
    """How an interleaved pipeline moves a scanned stack's chunks between the caller's
    layout and the one its chunks run in (from :func:`stack_relayout`).

    The caller's stack ``(L, ...)`` is split over ``pipe`` in contiguous blocks
    (``P(pipe)`` on the layer axis): device ``d`` holds chunks ``d v .. d v + v - 1``
    (``n = L / (p v)`` layers each). Interleaving runs chunk ``c`` on device ``c % p``,
    so device ``d`` needs chunks ``d, p + d, ...``. Chunk ``c`` moves from slot ``c % v``
    of device ``c // v`` to slot ``c // p`` of device ``c % p``; the moves between
    different devices are grouped into ``rounds``, each a partial permutation of ``pipe``
    (every device sends and receives at most one chunk), as few as the busiest device's
    moves (a bipartite edge colouring), so a device sends at most the chunks it has to.
    Each round is one ``ppermute`` of one chunk per stacked array, going in (parameters)
    and coming back (their gradients, by the reverse rounds).

    Attributes:
        num_stages: ``p``.
        virtual_stages: ``v``.
        rounds: per round, its ``(source device, target device)`` pairs.
        send_slot: ``[rounds, p]``: the caller-layout slot device ``d`` sends in a round
            (0 where it sends nothing).
        recv_slot: ``[rounds, p]``: the chunk-layout slot device ``d`` receives into
            (0 where it receives nothing).
        gather: ``[p, v]``: where device ``d``'s chunk slot ``j`` comes from: ``i < v``
            its own caller-layout slot ``i``, ``v + r`` what round ``r`` delivered.

    Example:
        >>> r = stack_relayout(2, 2)  # device 0: chunks 0, 1 -> 0, 2; device 1: 2, 3 -> 1, 3
        >>> r.rounds, r.gather.tolist()
        ((((0, 1), (1, 0)),), [[0, 2], [2, 1]])
        >>> len(stack_relayout(4, 2).rounds), len(stack_relayout(2, 4).rounds)
        (2, 2)
    """

    num_stages: int
    virtual_stages: int
    rounds: tuple[tuple[tuple[int, int], ...], ...]
    send_slot: np.ndarray
    recv_slot: np.ndarray
    gather: np.ndarray

    def to_chunks(self, x: jax.Array, axis: str) -> jax.Array:
        """Inside ``shard_map`` over ``axis``: this device's caller-layout block
        ``(v n, ...)`` -> its chunks ``(v, n, ...)`` (slot ``j``: chunk ``j p + d``)."""
        v = self.virtual_stages
        d = jax.lax.axis_index(axis)
        own = x.reshape(v, x.shape[0] // v, *x.shape[1:])
        got = [
            jax.lax.ppermute(
                jax.lax.dynamic_index_in_dim(own, jnp.asarray(self.send_slot[r])[d], 0, False),
                axis,
                list(pairs),
            )
            for r, pairs in enumerate(self.rounds)
        ]
        pool = jnp.concatenate([own, *(g[None] for g in got)]) if got else own
        return jnp.take(pool, jnp.asarray(self.gather)[d], axis=0)

    def from_chunks(self, y: jax.Array, axis: str) -> jax.Array:
        """The reverse of :meth:`to_chunks`: chunks ``(v, n, ...)`` -> the caller-layout
        block ``(v n, ...)`` (the reverse rounds carry each chunk home)."""
        v, p = self.virtual_stages, self.num_stages
        d = jax.lax.axis_index(axis)
        got = [
            jax.lax.ppermute(
                jax.lax.dynamic_index_in_dim(y, jnp.asarray(self.recv_slot[r])[d], 0, False),
                axis,
                [(b, a) for a, b in pairs],
            )
            for r, pairs in enumerate(self.rounds)
        ]
        # slot i of device d is chunk c = d v + i, held at chunk slot c // p of c % p
        back = np.zeros((p, v), np.int32)
        for dev in range(p):
            for i in range(v):
                c = dev * v + i
                src = self.gather[c % p, c // p]
                back[dev, i] = c // p if src < v else v + (src - v)
        pool = jnp.concatenate([y, *(g[None] for g in got)]) if got else y
        out = jnp.take(pool, jnp.asarray(back)[d], axis=0)
        return out.reshape(v * out.shape[1], *out.shape[2:])


def stack_relayout(num_stages: int, virtual_stages: int) -> StackRelayout:
    """The chunk moves of an interleaved pipeline's scanned stack (:class:`StackRelayout`).

    Example:
        >>> [len(stack_relayout(p, v).rounds) for p, v in ((2, 1), (2, 2), (4, 2), (2, 4))]
        [0, 1, 2, 2]
    """
    p, v = num_stages, virtual_stages
    moves = []  # (source device, source slot, target device, target slot)
    for c in range(p * v):
        moves.append((c // v, c % v, c % p, c // p))
    remote = [mv for mv in moves if mv[0] != mv[2]]
    colors = _edge_colors([(s, t) for s, _, t, _ in remote])
    n_rounds = max(colors, default=-1) + 1
    send_slot = np.zeros((n_rounds, p), np.int32)
    recv_slot = np.zeros((n_rounds, p), np.int32)
    gather = np.zeros((p, v), np.int32)
    rounds: list[list[tuple[int, int]]] = [[] for _ in range(n_rounds)]
    for (s, i, t, j), r in zip(remote, colors, strict=True):
        rounds[r].append((s, t))
        send_slot[r, s] = i
        recv_slot[r, t] = j
        gather[t, j] = v + r
    for s, i, t, j in moves:
        if s == t:
            gather[t, j] = i
    return StackRelayout(
        p, v, tuple(tuple(sorted(pairs)) for pairs in rounds), send_slot, recv_slot, gather
    )


def _edge_colors(edges: Sequence[tuple[int, int]]) -> list[int]:
    """A proper edge colouring of a bipartite multigraph (sources, targets) with as many
    colours as its largest degree (Konig): each new edge takes a colour free at both ends,
    after swapping two colours along an alternating path if needed."""
    at: dict[tuple[str, int], dict[int, int]] = defaultdict(dict)  # node -> colour -> edge
    color: list[int] = [-1] * len(edges)
    ends = [(("s", s), ("t", t)) for s, t in edges]

    def free(node: tuple[str, int]) -> int:
        c = 0
        while c in at[node]:
            c += 1
        return c

    for e, (u, w) in enumerate(ends):
        a, b = free(u), free(w)
        if a in at[w]:  # swap a and b along the path from w that starts with colour a
            path, node, c = [], w, a
            while c in at[node]:
                f = at[node][c]
                path.append(f)
                node = ends[f][0] if ends[f][1] == node else ends[f][1]
                c = b if c == a else a
            for f in path:
                for end in ends[f]:
                    del at[end][color[f]]
            for f in path:
                color[f] = b if color[f] == a else a
                for end in ends[f]:
                    at[end][color[f]] = f
        color[e] = a
        at[u][a] = e
        at[w][a] = e
    return color


def _pipeline_body(
    cut: StageCut, sched: Schedule, m_count: int, axis: str
) -> Callable[..., tuple[Any, ...]]:
    p = cut.num_stages  # virtual stages: p_dev * v
    p_dev, v = sched.num_stages, sched.virtual_stages
    # An unevenly split stack comes whole: this device takes its slots (row take[d]),
    # and its gradient goes back scattered to the whole stack, summed over pipe.
    take = _uneven_slots(cut, p_dev, v)
    uneven_in = {i for (kind, i) in take if kind == "in"}
    uneven_out = {i for (kind, i) in take if kind == "out"}
    # v > 1: a stacked input arrives as (v, 1, n, ...), chunk j of this device at [j];
    # a stacked output's accumulator is (v, n, ...), chunk j's sum at [j]
    chunked_in = set(cut.stacked_inputs) | uneven_in if v > 1 else set()
    chunked_out = set(cut.stacked_outputs) | uneven_out if v > 1 else set()
    relayout = stack_relayout(p_dev, v)
    hoisted, hoisted_at = _hoisted_layouts(
        cut, set(cut.batch_inputs) | set(cut.stacked_inputs) | uneven_in
    )
    n_in = len(cut.jaxpr.jaxpr.invars)
    tabs = _tables(sched)
    jaxpr = cut.jaxpr.jaxpr
    consts = dict(zip(jaxpr.constvars, cut.jaxpr.consts, strict=True))
    batch = set(cut.batch_inputs)
    f_layout, b_layout = _send_layouts(cut)
    s_layout = _stash_layout(cut)
    # Outputs accumulate over the ticks; a typed PRNG key as its raw data (wrapped again
    # after the ticks).
    out_impls = [key_impl_name(cut.aval(v).dtype) for v in jaxpr.outvars]
    out_avals = [jax.ShapeDtypeStruct(*slot_key(cut.aval(v))) for v in jaxpr.outvars]

    def branch_of(pc: Piece | None) -> Callable[..., Any]:
        def run(recv_f, recv_b, stash_in, fixed):
            if pc is None:
                return (f_layout.zeros(), b_layout.zeros(), s_layout.zeros(),
                        tuple(jnp.zeros(a.shape, a.dtype) for a in out_avals))  # fmt: skip
            env: dict[Any, Any] = dict(consts)
            s = pc.stage
            for i in pc.inputs:
                env[jaxpr.invars[i]] = fixed[i][s // p_dev] if i in chunked_in else fixed[i]
            for eqn in pc.eqns:  # reshards made once before the ticks
                if eqn.outvars and eqn.outvars[0] in hoisted_at:
                    env[eqn.outvars[0]] = fixed[n_in + hoisted_at[eqn.outvars[0]]]
            if pc.kind == "forward":
                if s > 0:
                    env.update(zip(pc.recv, f_layout.unpack(s - 1, recv_f), strict=True))
            else:
                if s < p - 1:
                    env.update(zip(pc.recv, b_layout.unpack(s, recv_b), strict=True))
                env.update(zip(pc.stash, s_layout.unpack(s, stash_in), strict=True))
            _run_eqns([e for e in pc.eqns if not (e.outvars and e.outvars[0] in hoisted_at)], env)
            fsend, bsend, sout = f_layout.zeros(), b_layout.zeros(), s_layout.zeros()
            if pc.kind == "forward":
                if s < p - 1:
                    fsend = f_layout.pack(s, [env[v] for v in pc.send])
                sout = s_layout.pack(s, [env[v] for v in pc.stash])
            elif s > 0:
                bsend = b_layout.pack(s - 1, [env[v] for v in pc.send])
            parts: dict[int, list[Any]] = defaultdict(list)
            for i, v in pc.outputs:
                x = env[v] if out_impls[i] is None else jax.random.key_data(env[v])
                parts[i].append(jnp.asarray(x, out_avals[i].dtype))
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
    if sched.virtual_stages > 1:  # a ring: device p - 1 feeds device 0's next chunk
        fwd_perm = [(i, (i + 1) % p_dev) for i in range(p_dev)]
        bwd_perm = [((i + 1) % p_dev, i) for i in range(p_dev)]
    else:
        fwd_perm = [(i, i + 1) for i in range(p_dev - 1)]
        bwd_perm = [(i + 1, i) for i in range(p_dev - 1)]
    rows = [tabs.branch, tabs.micro, tabs.f_read, tabs.b_read, tabs.s_read, tabs.s_write,
            tabs.f_write, tabs.b_write] + ([tabs.chunk] if chunked_out else [])  # fmt: skip
    xs = tuple(jnp.asarray(a) for a in rows)

    def body(*flat: Any) -> tuple[Any, ...]:
        d = jax.lax.axis_index(axis)
        fixed = list(flat)
        micro_views = {}
        for i in batch:
            x = flat[i]
            micro_views[i] = x.reshape(x.shape[0] // m_count, m_count, *x.shape[1:])
        fixed += [_constrain_in_context(eqn, flat[i]) for i, eqn in hoisted]
        for i in chunked_in - uneven_in:
            fixed[i] = relayout.to_chunks(flat[i], axis)
        for i in uneven_in:
            x = jnp.take(flat[i], jnp.asarray(take["in", i])[d], axis=0, mode="fill",
                         fill_value=0)  # fmt: skip
            fixed[i] = x.reshape(v, x.shape[0] // v, *x.shape[1:]) if v > 1 else x
        fbuf = f_layout.zeros((tabs.f_slots + 1,))
        bbuf = b_layout.zeros((tabs.b_slots + 1,))
        sbuf = s_layout.zeros((tabs.s_slots + 1,))
        accs = tuple(
            jnp.zeros(((v,) if i in chunked_out else ()) + a.shape, a.dtype)
            for i, a in enumerate(out_avals)
        )

        def tick(carry, row):
            fbuf, bbuf, sbuf, accs = carry
            br, m, fr, brd, sr, sw, fw, bw = (r[d] for r in row[:8])
            j = row[8][d] if chunked_out else None
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
            accs = tuple(
                jax.lax.dynamic_update_index_in_dim(
                    a, jax.lax.dynamic_index_in_dim(a, j, keepdims=False) + c, j, 0
                )
                if i in chunked_out
                else a + c
                for i, (a, c) in enumerate(zip(accs, contrib, strict=True))
            )
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

        def back(i: int, a: Any) -> Any:
            if i in uneven_out:
                a = a.reshape(-1, *a.shape[2:]) if v > 1 else a
                whole = cut.jaxpr.jaxpr.outvars[i].aval
                z = jnp.zeros(whole.shape, a.dtype)
                # padding slots index past the stack: dropped
                a = z.at[jnp.asarray(take["out", i])[d]].add(a, mode="drop")
                return jax.lax.psum(a, axis)
            if i in chunked_out:
                return relayout.from_chunks(a, axis)
            return a if i in cut.stacked_outputs else jax.lax.psum(a, axis)

        outs = [back(i, a) for i, a in enumerate(accs)]
        return tuple(
            a if impl is None else jax.random.wrap_key_data(a, impl=impl)
            for a, impl in zip(outs, out_impls, strict=True)
        )

    return body


def _hoisted_layouts(cut: StageCut, skip: set[int]) -> tuple[list[tuple[int, Any]], dict[Any, int]]:
    """The reshards of ``G``'s inputs (parameters replicated over ``pipe``) that the pieces
    make with a ``sharding_constraint`` (a plan's pin: an FSDP-style weight gathered for
    its matmul): the pipeline makes each once per step, before the ticks, as the cost
    model prices a reshard of a step input (XLA hoists it out of a microbatch loop, but
    not out of the tick loop's switch, where the forward and the backward piece of every
    microbatch would each gather the weight again: ``2 m`` gathers per step, not 1).

    Returns:
        ``(input index, constraint equation)`` per distinct layout of an input, and for
        every constraint equation it stands for, its result -> its index in that list.
    """
    jaxpr = cut.jaxpr.jaxpr
    index = {v: i for i, v in enumerate(jaxpr.invars)}
    hoisted: list[tuple[int, Any]] = []
    slot: dict[tuple[int, Any], int] = {}
    by_out: dict[Any, int] = {}
    for pc in cut.pieces:
        for eqn in pc.eqns:
            if eqn.primitive.name != "sharding_constraint" or len(eqn.invars) != 1:
                continue
            a = eqn.invars[0]
            spec = getattr(eqn.params["sharding"], "spec", None)
            if not isinstance(a, Var) or a not in index or index[a] in skip or spec is None:
                continue
            key = (index[a], spec)
            if key not in slot:
                slot[key] = len(hoisted)
                hoisted.append((index[a], eqn))
            by_out[eqn.outvars[0]] = slot[key]
    return hoisted, by_out


def _uneven_slots(cut: StageCut, p: int, v: int) -> dict[tuple[str, int], np.ndarray]:
    """Per unevenly split stack input or output (:attr:`StageCut.uneven_stacks`), the
    ``[p, v n]`` layer each device's slot holds: chunk ``j`` of device ``d`` (virtual
    stage ``j p + d``) in slots ``j n .. j n + n - 1``, its layers first, then the stack's
    length (a padding slot: out of range, filled with zeros on the way in and dropped on
    the way out).

    Example: 5 layers on 2 stages as (0, 3), (3, 5): 3 slots each.

        >>> _uneven_slots(cut, 2, 1)[("in", 0)].tolist()  # doctest: +SKIP
        [[0, 1, 2], [3, 4, 5]]
    """
    invars, outvars = cut.jaxpr.jaxpr.invars, cut.jaxpr.jaxpr.outvars
    out = {}
    for (kind, i), layout in cut.uneven_stacks.items():
        var = invars[i] if kind == "in" else outvars[i]
        whole, n = var.aval.shape[0], cut.aval(var).shape[0]
        table = np.full((p, v * n), whole, np.int32)
        for k, (first, count) in enumerate(layout):
            d, j = k % p, k // p
            table[d, j * n : j * n + count] = np.arange(first, first + count)
        out[kind, i] = table
    return out


def _run_eqns(eqns: Sequence[Any], env: dict[Any, Any]) -> None:
    """Evaluate equations in order (as ``jax.core.eval_jaxpr`` does), filling ``env``.

    A ``sharding_constraint`` (a plan's activation pin, traced into G on the concrete
    mesh, whose axes are all automatic) is bound again against the context's mesh, where
    ``pipe`` is manual (:func:`_constrain_in_context`); so are those inside loop bodies
    (:func:`_bodies_in_context`)."""
    for eqn in eqns:
        invals = [a.val if isinstance(a, JaxLiteral) else env[a] for a in eqn.invars]
        invals = guard_gather(eqn, invals)  # an XLA fault: autopar.lower.workarounds
        slots = _scan_slots(eqn, invals)
        if slots is not None:
            # A stage's part of an unevenly split layer scan: its own count of the slots.
            nc, nk, n = eqn.params["num_consts"], eqn.params["num_carry"], eqn.params["length"]
            invals = invals[: nc + nk] + [x[:n] for x in invals[nc + nk :]]
        if eqn.primitive.name == "sharding_constraint":
            # Outside eqn_context: the equation's own context holds the mesh it was traced
            # under (none), not the shard_map's.
            out = _constrain_in_context(eqn, invals[0])
        else:
            params = _bodies_in_context(eqn)
            with eqn_context(eqn):
                out = eqn.primitive.bind(*invals, **eqn.primitive.get_bind_params(params))
        outs = guard_scatter_result(eqn, out if eqn.primitive.multiple_results else [out])
        if slots is not None:
            nk = eqn.params["num_carry"]
            outs = list(outs[:nk]) + [_pad_slots(y, slots) for y in outs[nk:]]
        for v, o in zip(eqn.outvars, outs, strict=True):
            if not isinstance(v, DropVar):
                env[v] = o


def _scan_slots(eqn: Any, invals: Sequence[Any]) -> int | None:
    """The slots of a layer scan whose stacked operands hold more layers than it runs
    (a stage of an uneven split: :attr:`autopar.lower.stages.StageCut.uneven_stacks`),
    else ``None`` (a scan's ``xs`` are otherwise exactly ``length`` long)."""
    if eqn.primitive.name != "scan":
        return None
    first = eqn.params["num_consts"] + eqn.params["num_carry"]
    xs = invals[first:]
    if not xs or jnp.shape(xs[0])[0] == eqn.params["length"]:
        return None
    return int(jnp.shape(xs[0])[0])


def _pad_slots(y: Any, slots: int) -> Any:
    """A stage's stacked result over its own layers, padded with zeros to ``slots``."""
    pad = slots - y.shape[0]
    return jnp.concatenate([y, jnp.zeros((pad, *y.shape[1:]), y.dtype)]) if pad else y


def _constrain_in_context(eqn: Any, x: Any) -> Any:
    """``with_sharding_constraint(x, spec)`` of a traced ``sharding_constraint``'s
    ``NamedSharding``, on the context's mesh.

    Inside the pipeline's ``shard_map`` the mesh is abstract with ``pipe`` manual; the
    constraint as traced names the concrete mesh (every axis automatic), and JAX refuses
    to combine its result with the stage's other values ("Mesh for all inputs should be
    equal"). The spec never names ``pipe`` (a pipeline plan's pins are for the mesh
    without it), so the same spec on the context's mesh constrains the automatic axes
    only. Outside a ``shard_map`` (no context mesh) the equation is bound as traced."""
    spec = getattr(eqn.params["sharding"], "spec", None)
    if spec is None or jax.sharding.get_abstract_mesh().empty:
        with eqn_context(eqn):
            return eqn.primitive.bind(x, **eqn.primitive.get_bind_params(eqn.params))
    return jax.lax.with_sharding_constraint(x, spec)


def _has_constraint(jaxpr: Any) -> bool:
    """Whether ``jaxpr`` (open or closed) holds a ``sharding_constraint``, at any depth."""
    from jax.extend.core import jaxprs_in_params

    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    return any(
        e.primitive.name == "sharding_constraint"
        or any(_has_constraint(j) for j in jaxprs_in_params(e.params))
        for e in jaxpr.eqns
    )


def _bodies_in_context(eqn: Any) -> Any:
    """``eqn.params`` with every loop/branch body that holds a ``sharding_constraint``
    re-traced on the context's mesh through :func:`_run_eqns` (the body's result types
    carry the mesh of its constraints, which must be the ``shard_map``'s); other
    equations' params unchanged."""
    keys = COMPOSITE_BODY_PARAMS.get(eqn.primitive.name, ())
    if not keys or jax.sharding.get_abstract_mesh().empty:
        return eqn.params
    params = dict(eqn.params)
    for key in keys:
        value = params[key]
        bodies = list(value) if isinstance(value, tuple | list) else [value]
        if not any(_has_constraint(b) for b in bodies):
            continue
        new = [_retraced(b) if _has_constraint(b) else b for b in bodies]
        params[key] = type(value)(new) if isinstance(value, tuple | list) else new[0]
    return params


def _retraced(body: Any) -> Any:
    """``body`` (a ``ClosedJaxpr``; an open ``Jaxpr`` stays open) traced again through
    :func:`_run_eqns` in the current context."""
    from jax.extend.core import ClosedJaxpr

    closed = body if isinstance(body, ClosedJaxpr) else ClosedJaxpr(body, [])
    jaxpr = closed.jaxpr

    def run(*xs: Any) -> list[Any]:
        env: dict[Any, Any] = dict(zip(jaxpr.constvars, closed.consts, strict=True))
        env.update(zip(jaxpr.invars, xs, strict=True))
        _run_eqns(jaxpr.eqns, env)
        return [a.val if isinstance(a, JaxLiteral) else env[a] for a in jaxpr.outvars]

    avals = [
        jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype, weak_type=v.aval.weak_type)
        for v in jaxpr.invars
    ]
    new = jax.make_jaxpr(run)(*avals)
    if isinstance(body, ClosedJaxpr):
        return new
    if new.consts:
        raise LowerPlanError(
            "a loop body re-traced for its sharding constraints closed over constants; "
            "the pipeline cannot run it."
        )
    return new.jaxpr
