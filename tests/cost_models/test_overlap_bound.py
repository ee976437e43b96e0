"""``cost_models.overlap.bound_linear_overlap``: a linearly priced step (each overlappable
second charged at ``1 - eta``) with its hiding bounded by the compute there is, and the
same step with gradients reduced once after the pipeline flush."""

import pytest

from cost_models import CostModelError
from cost_models.overlap import bound_linear_overlap

ETA = 0.6


def test_plenty_of_compute_hides_every_gather():
    # work 105 = raw 100 + 1 s of tensor all-reduce (in full) + 0.4 x 10 s of gathers;
    # 0.6 x 100 = 60 s of hiding covers all 10 s: 100 + 1
    assert bound_linear_overlap(105.0, 105.0, {"fsdp_gather": 10.0}, 1.0, ETA) == pytest.approx(
        101.0
    )


def test_little_compute_hides_only_its_share():
    # raw 7 - 1 - 0.4 x 10 = 2 s hides 0.6 x 2 = 1.2 s of 10: 2 + 1 + 10 - 1.2
    assert bound_linear_overlap(7.0, 7.0, {"fsdp_gather": 10.0}, 1.0, ETA) == pytest.approx(11.8)


def test_linear_step_beyond_the_work_is_kept():
    # A pipeline's step = work + bubble 3 s: the bubble stays, the hiding is the work's.
    # raw 10 - 0.4 x 5 = 8; hides min(5, 4.8): 13 + 0.6 x 5 - 4.8 = 11.2 = 8 + 3 + 5 - 4.8
    got = bound_linear_overlap(13.0, 10.0, {"dp_grad": 5.0}, 0.0, ETA)
    assert got == pytest.approx(8.0 + 3.0 + 5.0 - 4.8)


def test_gathers_take_the_budget_before_gradients():
    # raw 20 - 0.4 x (6 + 10) = 13.6 -> budget 8.16: all 6 s of gathers, 2.16 of the 10 s
    # of gradient reductions: 13.6 + 6 + 10 - 8.16
    got = bound_linear_overlap(20.0, 20.0, {"fsdp_gather": 6.0, "dp_grad": 10.0}, 0.0, ETA)
    assert got == pytest.approx(13.6 + 16.0 - 8.16)


def test_bad_inputs_say_what_is_allowed():
    with pytest.raises(CostModelError, match="only 'dp_grad' and 'fsdp_gather'"):
        bound_linear_overlap(1.0, 1.0, {"tensor": 1.0}, 0.0, ETA)
    with pytest.raises(CostModelError, match=r"\[0, 1\]"):
        bound_linear_overlap(1.0, 1.0, {}, 0.0, 1.5)
