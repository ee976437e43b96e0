"""The outer loop stops pricing finalists that cannot beat the best plan that fits:
the screen scaled by the least priced / screened ratio seen (finalists of the kind, and
the whole cluster's meshes the intra-op search priced). Values by hand."""

from __future__ import annotations

import pytest

from autopar.plan import Candidate
from autopar.search.outer import (
    PipelineConfig,
    Profile,
    Screened,
    _cannot_win,
    _plain_ratios,
    _Priced,
    _screen_floor,
)
from cost_models import Cluster

TWO_NODES = Cluster.preset("dgx-a100-80gb", nodes=2)


def _priced(mesh: dict[str, int], step: float | None) -> _Priced:
    label = " x ".join(f"{a} {n}" for a, n in mesh.items())
    return _Priced(label, None, None, Candidate(label, mesh, step, 1e9))


def test_plain_meshes_teach_the_screens_excess_per_group():
    # One example: forward 1 s, backward 2 s, update 0.5 s, no gradient bytes (so no
    # data-parallel reduction in the screen). A batch of 8 over data 2 is one microbatch
    # of 4 examples: 4 x (1 + 2) + 0.5 = 12.5 s screened; priced 25 s: ratio 2.
    prof = Profile({}, 1, 1.0, 2.0, 0.5, 4e9, 0.0, 1e9, 0.0)
    # The same on tensor 2 (half the seconds per device): data 4 x 2 examples = 2 x 1.5
    # + 0.25 = 3.25 s screened, priced 4.875 s: 1.5.
    half = Profile({"tensor": 2}, 1, 0.5, 1.0, 0.25, 2e9, 0.0, 5e8, 0.0)
    priced = [
        _priced({"data": 2}, 25.0),
        _priced({"data": 4, "tensor": 2}, 4.875),
        _priced({"data": 2, "seq": 4}, 30.0),  # its group was not profiled: left out
        _priced({"data": 8}, None),  # not solved (over the bound): left out
    ]
    got = _plain_ratios(priced, {(): prof, (("tensor", 2),): half}, TWO_NODES, 8)
    assert got == {(): pytest.approx(2.0), (("tensor", 2),): pytest.approx(1.5)}


def test_floor_is_the_least_ratio_known_for_the_configuration():
    piped = Screened(PipelineConfig(2, {"tensor": 2}, 4, 8, 1), 0.3, 5e10)
    flat = Screened(PipelineConfig(1, {}, 16, 2, 1), 0.312, 3e10)
    plain = {(("tensor", 2),): 1.5, (): 2.5}
    assert _screen_floor(piped, {}, {}) == 1.0
    # Its group's whole-cluster mesh, and its kind's finalists, whichever is less.
    assert _screen_floor(piped, {True: [3.2], False: [1.1]}, plain) == 1.5
    assert _screen_floor(flat, {True: [1.2], False: [1.9]}, plain) == 1.9
    assert _screen_floor(flat, {True: [1.2]}, {}) == 1.0


def test_a_finalist_that_cannot_beat_the_best_price_is_skipped():
    piped = Screened(PipelineConfig(2, {}, 8, 4, 1, "1f1b"), 0.335, 5e10)
    flat = Screened(PipelineConfig(1, {}, 16, 2, 1), 0.312, 3e10)
    # 0.312 x 1.4 = 0.437 and 0.335 x 1.4 = 0.469, both over a 0.404 s plan.
    assert _cannot_win(flat, 1.4, 0.404) and _cannot_win(piped, 1.4, 0.404)
    # Against a 0.45 s plan the unpipelined one may still win; at ratio 1 neither is
    # ruled out by a 0.40 s plan.
    assert not _cannot_win(flat, 1.4, 0.45) and _cannot_win(piped, 1.4, 0.45)
    assert not _cannot_win(flat, 1.0, 0.40) and not _cannot_win(piped, 1.0, 0.40)
