"""The inter-op split (``autopar.search.interop``).

Expected values: optimal splits by brute force over every way of cutting the layers
(``itertools.combinations`` of the cut points, priced by Alpa's formula written out here),
memory from the schedules' in-flight counts worked by hand; the heavy-head GPT's split
from its FLOP counts (``tests/search/test_outer.py``).
"""

from __future__ import annotations

import itertools
import random

import pytest

from autopar.errors import InvalidOptionError
from autopar.search.interop import (
    LayerBytes,
    inflight,
    pipeline_time,
    split_stages,
    stage_memory,
)


def _alpa(costs, stages, m):
    t = [sum(costs[a:b]) for a, b in stages]
    return sum(t) + (m - 1) * max(t)


def _brute(costs, p, m, fits=lambda s, a, b: True):
    n = len(costs)
    best = None
    for cuts in itertools.combinations(range(1, n), p - 1):
        bounds = (0, *cuts, n)
        stages = tuple(zip(bounds[:-1], bounds[1:], strict=True))
        if not all(fits(s, a, b) for s, (a, b) in enumerate(stages)):
            continue
        t = _alpa(costs, stages, m)
        best = t if best is None else min(best, t)
    return best


def test_the_split_is_optimal_against_every_split():
    rng = random.Random(0)
    for _ in range(60):
        n = rng.randint(2, 9)
        p = rng.randint(1, n)
        m = rng.randint(1, 8)
        costs = [rng.choice([0.5, 1.0, 1.0, 2.0, 7.0]) * rng.uniform(0.9, 1.1) for _ in range(n)]
        stages = split_stages(costs, p)
        assert len(stages) == p and stages[0][0] == 0 and stages[-1][1] == n
        assert all(b > a for a, b in stages)
        assert all(stages[i][1] == stages[i + 1][0] for i in range(p - 1))
        assert pipeline_time(costs, stages, m) == pytest.approx(_brute(costs, p, m), rel=1e-9)


def test_a_heavy_last_layer_gets_a_stage_of_its_own():
    # Five 1 s layers and a last one carrying a 9 s head: even (3, 3) has a 12 s
    # bottleneck; (5, 1) has 10 s, the least any split can have (the last layer alone).
    costs = [1, 1, 1, 1, 1, 10]
    assert split_stages(costs, 2) == ((0, 5), (5, 6))
    assert pipeline_time(costs, ((0, 5), (5, 6)), 8) == 15 + 7 * 10
    assert pipeline_time(costs, ((0, 3), (3, 6)), 8) == 15 + 7 * 12


def test_uniform_layers_split_evenly():
    assert split_stages([2.0] * 12, 4) == ((0, 3), (3, 6), (6, 9), (9, 12))


def test_the_first_stage_holds_more_microbatches_under_1f1b():
    # 1F1B, p = 2, m = 4: stage 0 holds 2 microbatches, stage 1 one (GPipe: all 4).
    assert [inflight("1f1b", 2, 4, s) for s in range(2)] == [2, 1]
    assert [inflight("gpipe", 2, 4, s) for s in range(2)] == [4, 4]
    # Four equal layers, 1 byte of state and 1 of activations each (whole model: 4 and
    # 4): stage s running k layers holds k + k * inflight(s) bytes. Bound 5: stage 0 can
    # hold one layer (1 + 2 = 3; two would be 6), stage 1 three (3 + 3 = 6 > 5: no) ...
    shares = LayerBytes((0.25,) * 4, (0.25,) * 4)
    mem = stage_memory(4.0, 4.0, shares, "1f1b", 2, 4)
    assert (mem(0, 0, 1), mem(0, 0, 2), mem(1, 1, 4), mem(1, 2, 4)) == (3.0, 6.0, 6.0, 4.0)
    assert split_stages([1.0] * 4, 2, memory=mem, limit=5.0) is None
    # ... bound 6: the even split fits (6 and 4 bytes), and is the fastest.
    assert split_stages([1.0] * 4, 2, memory=mem, limit=6.0) == ((0, 2), (2, 4))
    # With the time pulling layers to stage 0 (a heavy last layer) the bound still holds.
    costs = [1.0, 1.0, 1.0, 4.0]
    got = split_stages(costs, 2, memory=mem, limit=6.0)
    assert got == ((0, 2), (2, 4))  # (0, 3) would be faster but holds 3 + 6 = 9 bytes
    fits = lambda s, a, b: mem(s, a, b) <= 6.0  # noqa: E731
    assert _alpa(costs, got, 4) == _brute(costs, 2, 4, fits)
    # Under remat a stage keeps its input per microbatch (0.5 bytes) and re-creates one
    # microbatch's activations: stage 0 with three layers holds 3 + 2 x 0.5 + 3 = 7.
    lean = stage_memory(4.0, 4.0, shares, "1f1b", 2, 4, remat=True, boundary_bytes=0.5)
    assert lean(0, 0, 3) == 7.0
    assert split_stages(costs, 2, memory=lean, limit=7.0) == ((0, 3), (3, 4))


def test_bad_stage_counts_are_refused():
    with pytest.raises(InvalidOptionError, match="cannot be split into 5 pipeline stages"):
        split_stages([1.0] * 4, 5)
    with pytest.raises(InvalidOptionError, match="cannot be split into 0"):
        split_stages([1.0] * 4, 0)
