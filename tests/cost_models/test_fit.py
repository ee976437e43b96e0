"""cost_models.fit.golden_section: the minimiser behind the fitted constants."""

from __future__ import annotations

import math

import pytest

from cost_models import CostModelError
from cost_models.fit import golden_section


def test_finds_the_minimum_of_a_log_error_loss():
    # Squared log errors of predictions x * k against targets k: zero at x = 1, so the
    # minimiser over [0.3, 2] is 1 (a fit of a multiplicative constant).
    targets = [44.0, 88.0, 144.0]

    def loss(x: float) -> float:
        return sum(math.log(x * t / t) ** 2 for t in targets)

    assert golden_section(loss, 0.3, 2.0) == pytest.approx(1.0, abs=1e-5)


def test_an_empty_interval_is_refused():
    with pytest.raises(CostModelError, match="lo < hi"):
        golden_section(lambda x: x, 1.0, 1.0)
