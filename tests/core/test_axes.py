"""The mesh-axes table: one place says what each axis means, and every user agrees."""

import dataclasses

import pytest

from autopar.axes import (
    AUTO_AXES,
    AXES,
    AXIS_NAMES,
    axes_splitting,
    axis_order,
    batch_axes,
    exposed_class,
)
from autopar.options import SearchOptions
from cost_models import COMM_CLASSES, HIDEABLE_CLASSES


def test_order_is_outer_to_inner_with_tensor_innermost():
    # Tensor parallelism talks most: it must land on the fastest (innermost) links.
    assert AXIS_NAMES[0] == "pipe" and AXIS_NAMES[-1] == "tensor"
    assert axis_order(["tensor", "seq", "data"]) == ("data", "seq", "tensor")
    assert axis_order(["tensor", "mine"]) == ("tensor", "mine")


def test_classes_are_cost_model_classes_and_hideable_where_expected():
    assert {a.comm_class for a in AXES.values()} <= set(COMM_CLASSES)
    # Data-parallel gradient reductions and FSDP gathers overlap with compute;
    # tensor / sequence / expert traffic is on the critical path.
    assert AXES["data"].comm_class in HIDEABLE_CLASSES
    assert AXES["fsdp"].comm_class in HIDEABLE_CLASSES
    for name in ("tensor", "seq", "expert"):
        assert AXES[name].comm_class not in HIDEABLE_CLASSES


def test_exposed_class_prefers_sequence_then_expert_then_tensor():
    assert exposed_class(["tensor", "seq"]) == "seq"
    assert exposed_class(["tensor", "expert"]) == "expert"
    assert exposed_class(["data", "tensor"]) == "tensor"
    assert exposed_class(["data", "fsdp"]) is None


def test_batch_axes_and_splits():
    assert batch_axes({"data": 2, "fsdp": 2, "tensor": 2}) == ("data", "fsdp")
    assert batch_axes(["pipe", "replica", "expert"]) == ("replica",)  # unknown: data parallel
    assert axes_splitting("sequence") == ("seq",)
    assert "pipe" not in AUTO_AXES and set(AUTO_AXES) < set(AXIS_NAMES)


def test_options_validate_against_the_table():
    SearchOptions(mesh={"pipe": 2, "data": 4})
    with pytest.raises(Exception, match="unknown"):
        SearchOptions(mesh={"model": 8})


def test_rows_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        AXES["data"].zero = False
