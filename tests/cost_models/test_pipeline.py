"""Schedule simulator vs the papers' closed forms (Narayanan et al. 2021, ZB-H1)."""

import random

import pytest

from cost_models import CostModelError, simulate_schedule

F, B = 1.0, 2.0


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize(("p", "m"), [(4, 8), (4, 4), (8, 16), (2, 6), (1, 5), (8, 3)])
def test_bubble_gpipe_1f1b(schedule, p, m):
    r = simulate_schedule(schedule, [F] * p, [B] * p, m)
    assert r.bubble_fraction == pytest.approx((p - 1) / m, abs=1e-9)
    assert r.makespan == pytest.approx((m + p - 1) * (F + B), abs=1e-9)


@pytest.mark.parametrize(("p", "m", "v"), [(4, 8, 2), (4, 8, 4), (8, 16, 2), (2, 6, 3), (4, 4, 2)])
def test_bubble_interleaved(p, m, v):
    r = simulate_schedule("interleaved-1f1b", [F] * p, [B] * p, m, chunks=v)
    assert r.bubble_fraction == pytest.approx((p - 1) / (v * m), abs=1e-9)


def test_inflight_activations():
    p, m = 4, 8
    gpipe = simulate_schedule("gpipe", [F] * p, [B] * p, m)
    one = simulate_schedule("1f1b", [F] * p, [B] * p, m)
    assert gpipe.peak_inflight[0] == m
    assert one.peak_inflight == (4, 3, 2, 1)  # p - i on stage i, never more than p
    assert max(simulate_schedule("1f1b", [F] * 8, [B] * 8, 3).peak_inflight) == 3
    # interleaved, v = 2: p v + p - 1 chunk activations on stage 0 (Megatron warm-up)
    inter = simulate_schedule("interleaved-1f1b", [F] * p, [B] * p, m, chunks=2)
    assert inter.peak_inflight[0] == 4 * 2 + 4 - 1


def test_gpipe_with_p2p_by_hand():
    p, m, c = 4, 6, 0.25
    r = simulate_schedule("gpipe", [F] * p, [B] * p, m, p2p=c)
    # forward fill (p-1)(F+c), m F + m B on the last stage, backward drain (p-1)(B+c)
    assert r.makespan == pytest.approx((m + p - 1) * (F + B) + 2 * (p - 1) * c)


def test_zero_bubble_h1_closed_form():
    # F = B_input = W = 1: ZB-H1 makespan m (F+B+W) + (p-1)(F + B - W)
    for p, m in [(4, 8), (4, 12), (8, 16)]:
        r = simulate_schedule("zero-bubble", [1.0] * p, [2.0] * p, m, bwd_weight_fraction=0.5)
        assert r.makespan == pytest.approx(3 * m + (p - 1) * 1.0)
        assert max(r.peak_inflight) <= p  # 1F1B's activation budget


def test_zero_bubble_never_worse_than_1f1b():
    rng = random.Random(0)
    for _ in range(6):
        p = rng.choice([2, 3, 4, 6])
        m = rng.choice([p, 2 * p, 13])
        fwd = [rng.uniform(0.5, 1.5) for _ in range(p)]
        bwd = [2 * f * rng.uniform(0.8, 1.2) for f in fwd]
        zb = simulate_schedule("zero-bubble", fwd, bwd, m, p2p=0.1)
        ob = simulate_schedule("1f1b", fwd, bwd, m, p2p=0.1)
        assert zb.makespan <= ob.makespan + 1e-9
        assert zb.makespan >= max(zb.busy) - 1e-9


def test_uneven_stages_bound_by_slowest():
    fwd, bwd = [1.0, 3.0, 1.0], [2.0, 6.0, 2.0]
    r = simulate_schedule("1f1b", fwd, bwd, 10)
    assert r.makespan >= 10 * 9.0  # the slow stage's own work
    assert r.busy == (30.0, 90.0, 30.0)
    assert r.bubble_s == pytest.approx(r.makespan - 90.0)
    assert r.timeline == ()
    full = simulate_schedule("1f1b", fwd, bwd, 10, timeline=True)
    assert len(full.timeline) == 2 * 3 * 10 and full.makespan == r.makespan
    assert max(e.end for e in full.timeline) == r.makespan


def test_errors():
    with pytest.raises(CostModelError, match="same length"):
        simulate_schedule("1f1b", [1.0, 1.0], [1.0], 4)
    with pytest.raises(CostModelError, match="divisible"):
        simulate_schedule("interleaved-1f1b", [1.0] * 4, [1.0] * 4, 6, chunks=2)
    with pytest.raises(CostModelError, match="interleaved"):
        simulate_schedule("1f1b", [1.0] * 4, [1.0] * 4, 8, chunks=2)
    with pytest.raises(CostModelError, match="schedule"):
        simulate_schedule("pipedream", [1.0], [1.0], 4)
    with pytest.raises(CostModelError, match="microbatches"):
        simulate_schedule("gpipe", [1.0], [1.0], 0)
