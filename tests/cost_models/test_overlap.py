"""The overlap model: what hides behind compute, what stays exposed."""

import pytest

from cost_models import CostModelError, compose_step_time


def test_dp_grad_fully_hidden_when_short():
    st = compose_step_time(10.0, {"dp_grad": 3.0}, backward_compute_s=6.0, overlap_efficiency=0.8)
    assert st.total_s == 10.0
    assert st.hidden_comm_s == 3.0 and st.exposed_comm_s == 0.0


def test_dp_grad_remainder_exposed():
    # only backward compute hides gradients: 0.8 * 6 = 4.8 of 7 hidden
    st = compose_step_time(10.0, {"dp_grad": 7.0}, backward_compute_s=6.0, overlap_efficiency=0.8)
    assert st.hidden_comm_s == pytest.approx(4.8)
    assert st.exposed_comm_s == pytest.approx(2.2)
    assert st.total_s == pytest.approx(12.2)


def test_tensor_parallel_always_exposed():
    st = compose_step_time(
        10.0, {"tensor": 1.0, "seq": 0.5, "expert": 0.25, "reshard": 0.25}, 6.0, 1.0
    )
    assert st.exposed_comm_s == 2.0 and st.hidden_comm_s == 0.0
    assert st.total_s == 12.0


def test_budgets_are_shared_and_bubble_added():
    # budget 0.5 * 10 = 5: dp takes 2 (of backward 0.5 * 6 = 3), fsdp gets the other 3 of its 4
    st = compose_step_time(
        10.0, {"dp_grad": 2.0, "fsdp_gather": 4.0, "pipeline_p2p": 1.0}, 6.0, 0.5, bubble_s=1.5
    )
    assert st.hidden == {"dp_grad": 2.0, "fsdp_gather": 3.0, "pipeline_p2p": 0.0}
    assert st.breakdown["fsdp_gather"] == 1.0 and st.breakdown["pipeline_p2p"] == 1.0
    assert st.total_s == pytest.approx(10.0 + 2.0 + 1.5)
    assert st.bubble_s == 1.5


def test_errors():
    with pytest.raises(CostModelError, match="allowed"):
        compose_step_time(1.0, {"allreduce": 1.0}, 0.5, 0.5)
    with pytest.raises(CostModelError, match="cannot exceed"):
        compose_step_time(1.0, {}, 2.0, 0.5)
    with pytest.raises(CostModelError, match="overlap_efficiency"):
        compose_step_time(1.0, {}, 0.5, 1.5)
