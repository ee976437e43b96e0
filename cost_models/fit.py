"""Fitting one constant: the 1-D minimiser the cost model's fitted constants come from.

``cost_models.megatron.fit_peak_fraction`` (the closed form's matmul efficiency) and
``benchmarks.bench_published.fit_overlap_efficiency`` (the 2021 overlap efficiency) each
minimise a loss over published rows with it.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from cost_models.errors import CostModelError


def golden_section(loss: Callable[[float], float], lo: float, hi: float, steps: int = 30) -> float:
    """The ``x`` in ``[lo, hi]`` minimising a unimodal ``loss``, by golden-section search:
    each of ``steps`` narrowings keeps 0.618 of the interval and evaluates ``loss`` once.

    Example:
        >>> round(golden_section(lambda x: (x - 0.27) ** 2, 0.0, 1.0), 6)
        0.27
    """
    if not lo < hi:
        raise CostModelError(f"golden_section needs lo < hi; got [{lo}, {hi}]")
    g = (math.sqrt(5) - 1) / 2
    a, b = lo, hi
    c, d = b - g * (b - a), a + g * (b - a)
    fc, fd = loss(c), loss(d)
    for _ in range(steps):
        if fc < fd:
            b, d, fd = d, c, fc
            c = b - g * (b - a)
            fc = loss(c)
        else:
            a, c, fc = c, d, fd
            d = a + g * (b - a)
            fd = loss(d)
    return (a + b) / 2


__all__ = ["golden_section"]
