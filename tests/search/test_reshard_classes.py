"""The class of each collective a reshard makes (what weighs it in the step time), worked
out by hand from the rules of ``pricing.collective_class``, for the memoised path the
search takes (no renaming) and the report's path (a renaming)."""

from types import SimpleNamespace

import pytest

from autopar.search.costs import CostContext
from autopar.search.pricing import price_reshard
from autopar.trace.graph import TensorInfo
from cost_models import Cluster

CTX = CostContext(Cluster.preset("dgx-a100-80gb"), {"data": 2, "tensor": 2})
T = TensorInfo((64, 128), "float32")
VALUE, PARAM = SimpleNamespace(root_role="batch"), SimpleNamespace(root_role="param")

CASES = [
    # An activation gathered over data: named by no exposed axis -> "reshard".
    ((("data",), ()), ((), ()), VALUE, False, ["reshard"]),
    # An activation gathered over tensor: a tensor-parallel collective -> "tensor".
    ((("tensor",), ()), ((), ()), VALUE, False, ["tensor"]),
    # A parameter gathered out of its split store: FSDP's prefetchable gather.
    ((("data",), ()), ((), ()), PARAM, False, ["fsdp_gather"]),
    # An update gathered into a store kept whole over data (ZeRO-1/2's gather, at the
    # step's end): not a state split over the gather's axes -> "reshard".
    ((("data",), ()), ((), ()), VALUE, True, ["reshard"]),
    # Adding tensor to a dim already split over data: a local slice, nothing moves.
    ((("data",), ()), (("data", "tensor"), ()), VALUE, True, []),
    # An update whose two axes swap dims on its way into a store split over both: every
    # piece moves split state -> FSDP (classes checked as a set below).
    ((("tensor",), ("data",)), (("data",), ("tensor",)), VALUE, True, None),
]


@pytest.mark.parametrize("have, need, source, into, classes", CASES)
def test_reshard_classes_by_hand_and_under_renaming(have, need, source, into, classes):
    plain = price_reshard(CTX, T, have, need, source=source, into_state=into)
    named = price_reshard(
        CTX, T, have, need, source=source, into_state=into,
        rename={"data": "data", "tensor": "tensor"},
    )  # fmt: skip
    if classes is not None:
        assert [pc.cls for pc in plain] == classes
    else:
        assert plain and {pc.cls for pc in plain} == {"fsdp_gather"}
    assert [(pc.collective, pc.cls) for pc in plain] == [(pc.collective, pc.cls) for pc in named]
