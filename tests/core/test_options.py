"""SearchOptions / LoweringOptions validate at construction with actionable messages."""

import pytest

from autopar.errors import InvalidOptionError
from autopar.options import LoweringOptions, SearchOptions


def test_mesh_is_ordered_and_copied():
    user = {"tensor": 4, "data": 2}
    o = SearchOptions(mesh=user)
    assert o.mesh_axes == ("tensor", "data")
    user["data"] = 3  # the options keep their own copy
    assert o.mesh["data"] == 2


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"mesh": {"dp": 2}}, "unknown"),
        ({"mesh": {"data": 0}}, "sizes must be integers"),
        ({"mesh": {}}, "non-empty"),
        ({"schedule": "pipedream"}, "schedule='pipedream' is not allowed"),
        ({"remat": "some"}, "remat"),
        ({"zero_stage": 4}, "zero_stage"),
        ({"memory_limit_bytes": -1}, "positive"),
        ({"microbatches": 0}, "integer >= 1"),
        ({"axes": ("data", "model")}, "names from"),
        ({"axes": ()}, "non-empty"),
    ],
)
def test_bad_options_are_refused(kwargs, message):
    with pytest.raises(InvalidOptionError, match=message):
        SearchOptions(**kwargs)


def test_cache_key_changes_with_options():
    a = SearchOptions(mesh={"data": 8})
    assert a.cache_key() == SearchOptions(mesh={"data": 8}).cache_key()
    assert a.cache_key() != SearchOptions(mesh={"data": 8}, memory_limit_bytes=2**30).cache_key()


def test_lowering_options():
    assert LoweringOptions(donate_argnums=0).donate_argnums == (0,)
    with pytest.raises(InvalidOptionError, match="both donated and static"):
        LoweringOptions(donate_argnums=(1,), static_argnums=(1,))
