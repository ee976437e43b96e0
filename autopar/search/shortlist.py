"""The ranked shortlist a plan carries: the candidates the search priced and why each lost.

:func:`candidate` turns one priced candidate (an ``Evaluation``) into a
:class:`~autopar.plan.Candidate`; :func:`rank` orders them (plans that fit first, by
step time; then those over the memory bound; then those never solved) and writes each
loser's verdict against the winner: how much slower and the part of the step that grew
most (compute, the bubble, or a collective class), or how far over the memory bound.

Example:
    >>> fast = Candidate("a", {"data": 8}, 1.0e-3, 1e9, 8e-4, 0.0, {"dp_grad": 2e-4})
    >>> slow = Candidate("b", {"tensor": 8}, 1.5e-3, 1e9, 8e-4, 0.0, {"tp_ar": 7e-4})
    >>> [c.verdict for c in rank(fast, [slow], memory_limit_bytes=2e9)]
    ['chosen', '+50.0% step time: tp_ar +700 us']
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import replace
from typing import Any

from autopar.plan import Candidate

__all__ = ["candidate", "rank", "unsolved"]


def candidate(label: str, mesh: Mapping[str, int], ev: Any) -> Candidate:
    """A priced candidate (``ev``: an ``autopar.search.evaluate.Evaluation``)."""
    return Candidate(
        label=label,
        mesh=dict(mesh),
        step_time_s=float(ev.step_time_s),
        memory_bytes_per_device=float(ev.memory_bytes_per_device),
        compute_s=float(ev.compute_s),
        bubble_s=float(ev.extra.get("bubble_s", 0.0)) if getattr(ev, "extra", None) else 0.0,
        communication_by_class={k: float(v) for k, v in ev.communication_by_class.items() if v},
    )


def unsolved(label: str, mesh: Mapping[str, int], why: str) -> Candidate:
    """A candidate the search did not price, and why."""
    return Candidate(label, dict(mesh), None, None, verdict=f"not solved: {why}")


def rank(
    chosen: Candidate, others: Iterable[Candidate], memory_limit_bytes: float
) -> tuple[Candidate, ...]:
    """``chosen`` (verdict ``"chosen"``), then ``others`` best first (plans that fit by
    step time, then those over the memory bound, then those never solved), each with its
    verdict against ``chosen``."""

    def key(c: Candidate) -> tuple:
        if c.step_time_s is None:
            return (2, 0.0)
        over = (c.memory_bytes_per_device or 0.0) > memory_limit_bytes
        return (1, c.memory_bytes_per_device) if over else (0, c.step_time_s)

    out = [replace(chosen, verdict="chosen")]
    for c in sorted(others, key=key):
        out.append(c if c.verdict else replace(c, verdict=_why(c, chosen, memory_limit_bytes)))
    return tuple(out)


def _why(c: Candidate, best: Candidate, limit: float) -> str:
    mem = c.memory_bytes_per_device or 0.0
    if mem > limit:
        return f"over the memory bound by {(mem - limit) / 2**30:.3g} GiB ({mem / limit - 1:+.1%})"
    assert c.step_time_s is not None and best.step_time_s is not None
    slower = c.step_time_s / best.step_time_s - 1 if best.step_time_s else 0.0
    parts = {"compute": c.compute_s - best.compute_s, "bubble": c.bubble_s - best.bubble_s}
    for k in set(c.communication_by_class) | set(best.communication_by_class):
        parts[k] = c.communication_by_class.get(k, 0.0) - best.communication_by_class.get(k, 0.0)
    what, grew = max(parts.items(), key=lambda kv: kv[1])
    if abs(slower) < 1e-4:
        return "tied on step time (the chosen mesh has fewer axes or the conventional order)"
    detail = f": {what} +{_us(grew)}" if grew > 0 else ""
    return f"{slower:+.1%} step time{detail}"


def _us(s: float) -> str:
    return f"{s * 1e6:.0f} us" if s < 1e-2 else f"{s * 1e3:.1f} ms"
