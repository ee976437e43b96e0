"""Pipeline schedules, simulated op by op: GPipe, 1F1B, interleaved 1F1B, zero-bubble (ZB-H1).

Each device (pipeline stage) runs forward (F) and backward (B) ops of microbatches; with
``chunks = v`` (interleaved) device i holds model chunks i, p + i, 2p + i, ... ("virtual
stages"), each taking 1/v of the device's time. Dependencies: F of virtual stage k waits
for F of stage k-1 (plus ``p2p`` seconds when they sit on different devices); B of stage k
waits for B of stage k+1 (plus ``p2p``), and the last stage's B for its own F. Transfers
are asynchronous: ``p2p`` delays the consumer, it does not occupy either device.

The order of ops on each device is the schedule:

* ``gpipe``: all forwards, then all backwards.
* ``1f1b`` (PipeDream-flush, Megatron's non-interleaved schedule): stage i runs p-i-1
  warm-up forwards, then alternates one forward and one backward, then drains backwards.
* ``interleaved-1f1b`` (Megatron-LM 2021): microbatches go through the chunks in groups of
  p; stage i warms up with 2(p-i-1) + (v-1)p chunk-forwards. Needs m % p == 0, as Megatron.
* ``zero-bubble`` (ZB-H1, Qi et al. 2023): the backward splits into B (input gradient,
  ``1 - bwd_weight_fraction`` of it) and W (weight gradient), which nothing downstream
  waits for. Each device keeps 1F1B's order of F and B and runs its oldest pending W
  whenever the next F/B is not ready yet, so W ops fill what would be bubbles; at most p
  microbatches per device have F done and W not done (1F1B's peak). For uniform stages
  the makespan is m(F+B+W) + (p-1)(F+B-W), the ZB-H1 paper's bubble.

The simulation is event-driven (each op starts when its device is free and its inputs have
arrived), not a closed formula; the closed formulas are what the tests check it against.

``bubble_fraction`` is the paper's definition: (makespan - ideal) / ideal, where ideal is
the busiest device's own work, m (fwd_i + bwd_i). For uniform stages without p2p it is
(p-1)/m for GPipe and 1F1B and (p-1)/(v m) interleaved (Narayanan et al. 2021).

Example:
    >>> r = simulate_schedule("1f1b", [1.0] * 4, [2.0] * 4, microbatches=8)
    >>> r.bubble_fraction, r.peak_inflight
    (0.375, (4, 3, 2, 1))
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, NamedTuple

from cost_models.errors import CostModelError, check_choice, check_int, check_positive
from cost_models.memory import SCHEDULES

ScheduleName = Literal["gpipe", "1f1b", "interleaved-1f1b", "zero-bubble"]


class TimelineEntry(NamedTuple):
    """One op of the simulated schedule (for plots)."""

    device: int
    op: str  # "F", "B" or "W"
    chunk: int
    microbatch: int
    start: float
    end: float


@dataclass(frozen=True)
class ScheduleResult:
    """What a simulated pipeline schedule did.

    Attributes:
        makespan: seconds from the first op's start to the last op's end.
        bubble_fraction: (makespan - ideal) / ideal, ideal = busiest device's work.
        peak_inflight: per device, the most (microbatch, chunk) activations alive at once
            (F done, B not done; zero-bubble: W not done). Divide by ``chunks`` for
            microbatch-equivalents.
        busy: per device, seconds of work.
        timeline: every op, for plots (empty unless asked for).
    """

    makespan: float
    bubble_fraction: float
    peak_inflight: tuple[int, ...]
    busy: tuple[float, ...] = ()
    timeline: tuple[TimelineEntry, ...] = ()

    @property
    def bubble_s(self) -> float:
        """Idle seconds on the busiest device: makespan - its work."""
        return self.makespan - max(self.busy) if self.busy else 0.0


Op = tuple[str, int, int]  # (kind, virtual stage, microbatch)


def simulate_schedule(
    schedule: ScheduleName,
    fwd: Sequence[float],
    bwd: Sequence[float],
    microbatches: int,
    p2p: float = 0.0,
    chunks: int = 1,
    bwd_weight_fraction: float = 0.5,
    timeline: bool = False,
    per_chunk: bool = False,
) -> ScheduleResult:
    """Simulate one training iteration's pipeline (see the module docstring).

    Args:
        schedule: ``"gpipe"``, ``"1f1b"``, ``"interleaved-1f1b"`` or ``"zero-bubble"``.
        fwd: per device, seconds of forward for one microbatch (all its chunks together,
            each chunk taking ``1 / chunks`` of it); with ``per_chunk``, per virtual stage
            (``p * chunks`` entries in model order: chunk ``c`` of device ``d`` is entry
            ``c * p + d``), for chunks of unequal work.
        bwd: as ``fwd``, seconds of backward (input + weight gradients).
        microbatches: m, microbatches per iteration.
        p2p: seconds to move one activation (or its gradient) between devices.
        chunks: v, model chunks per device (interleaved only).
        bwd_weight_fraction: zero-bubble only: share of ``bwd`` that is weight gradient (W).
        timeline: also return every op's start and end (for plots; costs time and memory).
        per_chunk: ``fwd`` and ``bwd`` hold one time per virtual stage.

    Example:
        >>> r = simulate_schedule("interleaved-1f1b", [1.0] * 4, [2.0] * 4, 8, chunks=2)
        >>> r.bubble_fraction
        0.1875
        >>> simulate_schedule("interleaved-1f1b", [0.5] * 8, [1.0] * 8, 8, chunks=2,
        ...                   per_chunk=True).bubble_fraction  # the same chunks, given one by one
        0.1875
    """
    check_choice("schedule", schedule, SCHEDULES)
    v = check_int("chunks", chunks)
    n = len(fwd)
    if n == 0 or len(bwd) != n or (per_chunk and n % v):
        raise CostModelError(
            f"fwd and bwd need one time per {'virtual stage' if per_chunk else 'stage'} and "
            f"the same length{f' (a multiple of chunks={v})' if per_chunk else ''}; got "
            f"{len(fwd)} and {len(bwd)}"
        )
    p = n // v if per_chunk else n
    for i, (f, b) in enumerate(zip(fwd, bwd, strict=True)):
        check_positive(f"fwd[{i}]", f, allow_zero=True)
        check_positive(f"bwd[{i}]", b, allow_zero=True)
    m = check_int("microbatches", microbatches)
    check_positive("p2p", p2p, allow_zero=True)
    check_positive("bwd_weight_fraction", bwd_weight_fraction, allow_zero=True)
    if bwd_weight_fraction > 1:
        raise CostModelError(f"bwd_weight_fraction must be in [0, 1]; got {bwd_weight_fraction!r}")
    if v > 1 and schedule != "interleaved-1f1b":
        raise CostModelError(f"chunks > 1 needs schedule='interleaved-1f1b'; got {schedule!r}")
    if schedule == "interleaved-1f1b" and v > 1 and m % p:
        raise CostModelError(
            f"interleaved-1f1b needs microbatches divisible by the pipeline size "
            f"(Megatron's rule); got m={m}, p={p}"
        )

    if per_chunk:
        f_st, b_st = [float(x) for x in fwd], [float(x) for x in bwd]
    else:  # each chunk of device d takes 1/v of its time
        f_st = [float(fwd[k % p]) / v for k in range(p * v)]
        b_st = [float(bwd[k % p]) / v for k in range(p * v)]
    sim = _Sim(p, v, m, f_st, b_st, float(p2p), timeline)
    if schedule == "zero-bubble":
        sim.run_greedy_zb(bwd_weight_fraction, [_order("1f1b", d, p, m, 1) for d in range(p)])
    else:
        sim.run_fixed([_order(schedule, d, p, m, v) for d in range(p)])
    return sim.result()


def _order(schedule: str, d: int, p: int, m: int, v: int) -> list[Op]:
    """The op order of device d (virtual stage of chunk c on device d is c * p + d)."""
    if schedule == "gpipe":
        return [("F", d, j) for j in range(m)] + [("B", d, j) for j in range(m)]
    if schedule == "1f1b" or v == 1:
        warm = min(p - d - 1, m)
        order: list[Op] = [("F", d, j) for j in range(warm)]
        for j in range(m - warm):
            order += [("F", d, warm + j), ("B", d, j)]
        order += [("B", d, j) for j in range(m - warm, m)]
        return order
    # Megatron-LM interleaved schedule (schedules.py, forward_backward_pipelining_with_interleaving)
    total = m * v

    def fwd_op(k: int) -> Op:
        chunk = (k // p) % v
        return ("F", chunk * p + d, (k // (p * v)) * p + k % p)

    def bwd_op(k: int) -> Op:
        chunk = v - 1 - (k // p) % v
        return ("B", chunk * p + d, (k // (p * v)) * p + k % p)

    warm = total if m == p else min((p - d - 1) * 2 + (v - 1) * p, total)
    order = [fwd_op(k) for k in range(warm)]
    for k in range(total - warm):
        order += [fwd_op(warm + k), bwd_op(k)]
    order += [bwd_op(k) for k in range(total - warm, total)]
    return order


_F, _B, _W = 0, 1, 2
_KIND_NAME = ("F", "B", "W")


class _Sim:
    """Shared state of both policies. Ops are ints: (kind * stages + stage) * m + microbatch."""

    def __init__(
        self, p: int, v: int, m: int, fwd: list[float], bwd: list[float], p2p: float, record: bool
    ):
        # fwd / bwd: seconds of one microbatch per virtual stage (p * v entries).
        self.p, self.v, self.m = p, v, m
        self.stages = p * v
        self.record = record
        n_ops = 3 * self.stages * m
        self.finish: list[float | None] = [None] * n_ops
        self.dur = [0.0] * n_ops
        self.dep = [-1] * n_ops  # the op whose output this op waits for (-1: none)
        self.delay = [0.0] * n_ops  # p2p when that op ran on another device
        self.w_fraction = 0.0
        self._fwd, self._bwd, self._p2p = fwd, bwd, p2p
        self.free = [0.0] * p
        self.busy = [0.0] * p
        self.alive = [0] * p
        self.peak = [0] * p
        self.timeline: list[TimelineEntry] = []

    def op_id(self, op: Op) -> int:
        kind = {"F": _F, "B": _B, "W": _W}[op[0]]
        return (kind * self.stages + op[1]) * self.m + op[2]

    def prepare(self, w_fraction: float) -> None:
        """Durations and dependencies of every op."""
        self.w_fraction = w_fraction
        S, m, p = self.stages, self.m, self.p
        for stage in range(S):
            d = stage % p
            f = self._fwd[stage]
            b = self._bwd[stage]
            for j in range(m):
                fid = (_F * S + stage) * m + j
                bid = (_B * S + stage) * m + j
                wid = (_W * S + stage) * m + j
                self.dur[fid] = f
                self.dur[bid] = b * (1.0 - w_fraction)
                self.dur[wid] = b * w_fraction
                if stage > 0:
                    self.dep[fid] = (_F * S + stage - 1) * m + j
                    self.delay[fid] = self._p2p if (stage - 1) % p != d else 0.0
                if stage == S - 1:
                    self.dep[bid] = fid
                else:
                    self.dep[bid] = (_B * S + stage + 1) * m + j
                    self.delay[bid] = self._p2p if (stage + 1) % p != d else 0.0
                self.dep[wid] = bid

    def ready_time(self, oid: int) -> float | None:
        """When op's input is on its device, or None if its producer is not scheduled yet."""
        dep = self.dep[oid]
        if dep < 0:
            return 0.0
        end = self.finish[dep]
        return None if end is None else end + self.delay[oid]

    def start(self, oid: int, d: int, t: float, frees_memory: int) -> None:
        end = t + self.dur[oid]
        self.finish[oid] = end
        self.free[d] = end
        self.busy[d] += self.dur[oid]
        kind, rest = divmod(oid, self.stages * self.m)
        if kind == _F:
            self.alive[d] += 1
            if self.alive[d] > self.peak[d]:
                self.peak[d] = self.alive[d]
        elif kind == frees_memory:
            self.alive[d] -= 1
        if self.record:
            stage, j = divmod(rest, self.m)
            self.timeline.append(TimelineEntry(d, _KIND_NAME[kind], stage // self.p, j, t, end))

    def run_fixed(self, orders: list[list[Op]]) -> None:
        """Each device runs its ops in order, each as soon as the device and its input are ready.

        A device that waits for another device's op sleeps until that op is scheduled, so
        every op is visited once.
        """
        self.prepare(0.0)
        ids = [[self.op_id(op) for op in order] for order in orders]
        finish, dep, delay = self.finish, self.dep, self.delay
        ptr = [0] * self.p
        waiting: dict[int, int] = {}  # op id -> the device blocked on it
        runnable = list(range(self.p))
        while runnable:
            d = runnable.pop()
            order, k, free = ids[d], ptr[d], self.free[d]
            while k < len(order):
                oid = order[k]
                src = dep[oid]
                if src >= 0:
                    end = finish[src]
                    if end is None:
                        waiting[src] = d
                        break
                    ready = end + delay[oid]
                    if ready > free:
                        free = ready
                self.start(oid, d, free, frees_memory=_B)
                free = self.free[d]
                k += 1
                woken = waiting.pop(oid, None)
                if woken is not None:
                    runnable.append(woken)
            ptr[d] = k
        if any(k != len(o) for k, o in zip(ptr, ids, strict=True)):  # pragma: no cover
            raise CostModelError("pipeline schedule deadlocked (inconsistent op order)")

    def run_greedy_zb(self, w_fraction: float, orders: list[list[Op]]) -> None:
        """1F1B's F/B order per device; a pending W runs whenever the next F/B is not ready."""
        self.prepare(w_fraction)
        p = self.p
        ids = [[self.op_id(op) for op in order] for order in orders]
        w_offset = (_W - _B) * self.stages * self.m  # B id -> its W id
        ptr = [0] * p
        pending_w: list[list[int]] = [[] for _ in range(p)]
        f_done = [0] * p
        w_done = [0] * p
        remaining = sum(len(o) for o in ids) * 3 // 2
        inf = float("inf")
        while remaining:
            best: tuple[float, int, int] | None = None
            for d in range(p):
                t_ord = inf
                oid = ids[d][ptr[d]] if ptr[d] < len(ids[d]) else -1
                is_f = oid >= 0 and oid < self.stages * self.m
                if oid >= 0 and (not is_f or f_done[d] - w_done[d] < p):
                    r = self.ready_time(oid)
                    if r is not None:
                        t_ord = max(self.free[d], r)
                if oid >= 0 and t_ord <= self.free[d]:
                    choice = (self.free[d], d, oid)
                elif pending_w[d]:
                    choice = (self.free[d], d, pending_w[d][0])
                elif oid >= 0 and t_ord < inf:
                    choice = (t_ord, d, oid)
                else:
                    continue
                if best is None or choice[:2] < best[:2]:
                    best = choice
            if best is None:  # pragma: no cover - the order always leaves a W or a ready op
                raise CostModelError("zero-bubble schedule deadlocked")
            t, d, oid = best
            self.start(oid, d, t, frees_memory=_W)
            if pending_w[d] and oid == pending_w[d][0]:
                pending_w[d].pop(0)
                w_done[d] += 1
            else:
                ptr[d] += 1
                if oid < self.stages * self.m:
                    f_done[d] += 1
                else:
                    pending_w[d].append(oid + w_offset)
            remaining -= 1

    def result(self) -> ScheduleResult:
        makespan = max((f for f in self.finish if f is not None), default=0.0)
        ideal = max(self.busy)
        bubble = (makespan - ideal) / ideal if ideal > 0 else 0.0
        return ScheduleResult(
            makespan=makespan,
            bubble_fraction=bubble,
            peak_inflight=tuple(self.peak),
            busy=tuple(self.busy),
            timeline=tuple(self.timeline),
        )
