"""parse_collectives on hand-written HLO: every replica-group spelling, loop trip counts,
the all-reduce + dynamic-slice reduce-scatter pattern; bytes counted by hand."""

from __future__ import annotations

import pytest

from autopar.verify import group_axes, parse_collectives, parse_replica_groups, shape_bytes
from autopar.verify.hlo import ParseHloError

ADD = """%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %s = f32[] add(%x, %y)
}
"""


def _entry(body: str, params: str = "p: f32[16,64]", header: str = "num_partitions=8") -> str:
    return f"HloModule m, {header}\n\n{ADD}\nENTRY %main ({params}) -> f32[] {{\n{body}\n}}\n"


@pytest.mark.parametrize(
    "attr,groups",
    [
        ("replica_groups={{0,1},{2,3},{4,5},{6,7}}", [[0, 1], [2, 3], [4, 5], [6, 7]]),
        ("replica_groups=[2,4]<=[8]", [[0, 1, 2, 3], [4, 5, 6, 7]]),
        ("replica_groups=[4,2]<=[2,4]T(1,0)", [[0, 4], [1, 5], [2, 6], [3, 7]]),
        ("replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_1'}", [[0, 1, 2, 3], [4, 5, 6, 7]]),
        ("replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_0'}", [[0, 4], [1, 5], [2, 6], [3, 7]]),
        ("replica_groups=mesh['x'=2,'y'=2,'z'=2] {'x','z'}", [[0, 1, 4, 5], [2, 3, 6, 7]]),
        # device order [2,4]T(1,0) = 0,4,1,5,2,6,3,7 laid out as a (4,1,2) mesh.
        (
            "replica_groups=mesh['axis_0'=4,'axis_1'=1,'axis_2'=2], device_ids=([2,4]T(1,0)) "
            "{'axis_0'}",
            [[0, 1, 2, 3], [4, 5, 6, 7]],
        ),
        # Shardy sub-axis "x":(1)2 = the major factor 2 of x (pre-size 1).
        ("replica_groups=mesh['x'=8] {'x':(1)2}", [[0, 4], [1, 5], [2, 6], [3, 7]]),
        ("replica_groups=mesh['x'=8] {'x':(2)4}", [[0, 1, 2, 3], [4, 5, 6, 7]]),
        ("replica_groups={}", [[0, 1, 2, 3, 4, 5, 6, 7]]),
    ],
)
def test_replica_group_spellings(attr: str, groups: list[list[int]]) -> None:
    got = parse_replica_groups(attr + ", to_apply=%add", num_devices=8)
    assert sorted(map(sorted, got)) == sorted(map(sorted, groups))


def test_group_axes_maps_groups_to_mesh_axes() -> None:
    mesh = {"data": 2, "tensor": 4}
    assert group_axes([[0, 4], [1, 5], [2, 6], [3, 7]], mesh) == ("data",)
    assert group_axes([[0, 1, 2, 3], [4, 5, 6, 7]], mesh) == ("tensor",)
    assert group_axes([list(range(8))], mesh) == ("data", "tensor")


def test_shape_bytes_by_hand() -> None:
    assert shape_bytes("f32[16,64]{1,0}") == 16 * 64 * 4
    assert shape_bytes("(bf16[8], s8[3], pred[2])") == 16 + 3 + 2
    assert shape_bytes("f32[]") == 4


def test_kinds_and_bytes_of_each_collective() -> None:
    body = """  %p = f32[16,64]{1,0} parameter(0)
  %ar = f32[16,64]{1,0} all-reduce(%p), channel_id=1, replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=%add
  %ag = f32[64,64]{1,0} all-gather(%p), channel_id=2, replica_groups=[2,4]<=[8], dimensions={0}
  %rs = f32[4,64]{1,0} reduce-scatter(%p), channel_id=3, replica_groups=[2,4]<=[8], dimensions={0}, to_apply=%add
  %a2a = f32[16,64]{1,0} all-to-all(%p), channel_id=4, replica_groups=[4,2]<=[8], dimensions={0}
  %cp = f32[16,64]{1,0} collective-permute(%p), channel_id=5, source_target_pairs={{0,1},{1,2},{2,3},{3,0}}
  %tup = (f32[4]{0}, bf16[8]{0}) all-reduce(%x, %y), replica_groups={}, to_apply=%add
  %ags = (f32[16,64]{1,0}, f32[32,64]{1,0}) all-gather-start(%p), replica_groups=[4,2]<=[8], dimensions={0}
  ROOT %r = f32[] constant(0)"""
    got = {c.name: c for c in parse_collectives(_entry(body))}
    full = 16 * 64 * 4  # 4096 bytes
    expect = {
        "ar": ("all-reduce", full, 8),
        "ag": ("all-gather", 64 * 64 * 4, 4),  # the gathered output
        "rs": ("reduce-scatter", 4 * 64 * 4 * 4, 4),  # the full input: result x group
        "a2a": ("all-to-all", full, 2),
        "cp": ("collective-permute", full, 2),
        "tup": ("all-reduce", 4 * 4 + 8 * 2, 8),  # tuple: elements summed
        "ags": ("all-gather", 32 * 64 * 4, 2),  # async start: the output element
    }
    assert set(got) == set(expect)
    for name, (kind, nbytes, gsize) in expect.items():
        c = got[name]
        assert (c.kind, c.bytes, c.group_size, c.count) == (kind, nbytes, gsize, 1), name


def test_all_reduce_then_dynamic_slice_is_a_reduce_scatter() -> None:
    body = """  %p = f32[16,64]{1,0} parameter(0)
  %ar = f32[16,64]{1,0} all-reduce(%p), channel_id=1, replica_groups=[4,2]<=[2,4]T(1,0), to_apply=%add
  %off = s32[] constant(0)
  %ds = f32[16,32]{1,0} dynamic-slice(%ar, %off, %off), dynamic_slice_sizes={16,32}
  %ar2 = f32[16,64]{1,0} all-reduce(%p), channel_id=2, replica_groups=[4,2]<=[2,4]T(1,0), to_apply=%add
  %ds2 = f32[16,32]{1,0} dynamic-slice(%ar2, %off, %off), dynamic_slice_sizes={16,32}
  %use = f32[16,64]{1,0} negate(%ar2)
  %ar3 = f32[16,64]{1,0} all-reduce(%p), channel_id=3, replica_groups=[2,4]<=[8], to_apply=%add
  %ds3 = f32[16,32]{1,0} dynamic-slice(%ar3, %off, %off), dynamic_slice_sizes={16,32}
  ROOT %r = f32[] constant(0)"""
    got = {c.name: c for c in parse_collectives(_entry(body))}
    # ar: every user keeps 1/2 of it, over groups of 2 -> reduce-scatter of the full input.
    assert (got["ar"].kind, got["ar"].bytes) == ("reduce-scatter", 4096)
    # ar2: one user needs the whole sum -> a real all-reduce.
    assert got["ar2"].kind == "all-reduce"
    # ar3: groups of 4 but the slice keeps 1/2 -> not a reduce-scatter over the group.
    assert got["ar3"].kind == "all-reduce"


def test_all_reduce_of_a_slice_sent_to_its_owner_is_a_reduce_scatter() -> None:
    # As XLA emits for a [4, 64] weight gradient summed over "data" (2 devices) and
    # scattered over it on dim 1, with the operands replicated over another axis: each
    # device reduces the [4, 32] half that axis picks, then sends it to the device owning
    # that half. Result and wire bytes of a reduce-scatter of the [4, 64] sum: 1024 bytes.
    body = """  %p = f32[4,32]{1,0} parameter(0)
  %ar = f32[4,32]{1,0} all-reduce(%p), channel_id=1, replica_groups=[4,2]<=[8], to_apply=%add
  %cp = f32[4,32]{1,0} collective-permute(%ar), channel_id=2, source_target_pairs={{0,0},{1,2},{2,1},{3,3}}
  %ar2 = f32[4,32]{1,0} all-reduce(%p), channel_id=3, replica_groups=[4,2]<=[8], to_apply=%add
  %cp2 = f32[4,32]{1,0} collective-permute(%ar2), channel_id=4, source_target_pairs={{0,1},{1,0}}
  %use = f32[4,32]{1,0} negate(%ar2)
  ROOT %r = f32[] constant(0)"""
    got = {c.name: c for c in parse_collectives(_entry(body))}
    assert (got["ar"].kind, got["ar"].bytes) == ("reduce-scatter", 4 * 64 * 4)
    assert "cp" not in got  # its second leg, counted with it
    assert got["cp2"].kind == "collective-permute"  # sends a real all-reduce's result
    # ar2: another user reads the sum itself -> a real all-reduce.
    assert (got["ar2"].kind, got["ar2"].bytes) == ("all-reduce", 4 * 32 * 4)


LOOPS = """HloModule loops, num_partitions=4

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %s = f32[] add(%x, %y)
}

%inner_body (p: (s32[], f32[8])) -> (s32[], f32[8]) {
  %p = (s32[], f32[8]{0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  %v = f32[8]{0} get-tuple-element(%p), index=1
  %inner_ar = f32[8]{0} all-reduce(%v), channel_id=1, replica_groups={{0,1,2,3}}, to_apply=%add
  ROOT %t = (s32[], f32[8]{0}) tuple(%next, %inner_ar)
}

%inner_cond (p.1: (s32[], f32[8])) -> pred[] {
  %p.1 = (s32[], f32[8]{0}) parameter(0)
  %i.1 = s32[] get-tuple-element(%p.1), index=0
  %n = s32[] constant(5)
  ROOT %lt = pred[] compare(%i.1, %n), direction=LT
}

%outer_body (q: (s32[], f32[8])) -> (s32[], f32[8]) {
  %q = (s32[], f32[8]{0}) parameter(0)
  %j = s32[] get-tuple-element(%q), index=0
  %v.2 = f32[8]{0} get-tuple-element(%q), index=1
  %start = s32[] constant(1)
  %init = (s32[], f32[8]{0}) tuple(%start, %v.2)
  %w = (s32[], f32[8]{0}) while(%init), condition=%inner_cond, body=%inner_body
  %outer_ag = f32[32]{0} all-gather(%v.2), channel_id=2, replica_groups=[1,4]<=[4], dimensions={0}
  %one.2 = s32[] constant(1)
  %j2 = s32[] add(%j, %one.2)
  %res = f32[8]{0} get-tuple-element(%w), index=1
  ROOT %t.2 = (s32[], f32[8]{0}) tuple(%j2, %res)
}

%outer_cond (q.1: (s32[], f32[8])) -> pred[] {
  %q.1 = (s32[], f32[8]{0}) parameter(0)
  %j.1 = s32[] get-tuple-element(%q.1), index=0
  %m = s32[] parameter(1)
  ROOT %lt.1 = pred[] compare(%j.1, %m), direction=LT
}

%opaque_cond (r.1: (s32[], f32[8])) -> pred[] {
  %r.1 = (s32[], f32[8]{0}) parameter(0)
  ROOT %c = pred[] custom-call(%r.1), custom_call_target="stop"
}

%opaque_body (r: (s32[], f32[8])) -> (s32[], f32[8]) {
  %r = (s32[], f32[8]{0}) parameter(0)
  %k = s32[] get-tuple-element(%r), index=0
  %v.3 = f32[8]{0} get-tuple-element(%r), index=1
  %opaque_cp = f32[8]{0} collective-permute(%v.3), channel_id=3, source_target_pairs={{0,1},{1,0}}
  ROOT %t.3 = (s32[], f32[8]{0}) tuple(%k, %opaque_cp)
}

ENTRY %main (a: f32[8]) -> f32[8] {
  %a = f32[8]{0} parameter(0)
  %zero = s32[] constant(0)
  %init.0 = (s32[], f32[8]{0}) tuple(%zero, %a)
  %outer = (s32[], f32[8]{0}) while(%init.0), condition=%outer_cond, body=%outer_body, backend_config={"known_trip_count":{"n":"3"}}
  %init.1 = (s32[], f32[8]{0}) tuple(%zero, %a)
  %opaque = (s32[], f32[8]{0}) while(%init.1), condition=%opaque_cond, body=%opaque_body
  %top_ar = f32[8]{0} all-reduce(%a), channel_id=4, replica_groups={{0,1},{2,3}}, to_apply=%add
  ROOT %out = f32[8]{0} get-tuple-element(%outer), index=1
}
"""


def test_loop_trip_counts_multiply() -> None:
    got = {c.name: c for c in parse_collectives(LOOPS)}
    # outer: known_trip_count 3; inner: i from 1 while i < 5 step 1 -> 4 trips.
    assert got["inner_ar"].count == 3 * 4
    assert got["inner_ar"].total_bytes == 12 * 32
    assert got["outer_ag"].count == 3
    assert got["outer_ag"].bytes == 128
    assert got["top_ar"].count == 1
    assert got["inner_ar"].trip_count_known and got["outer_ag"].trip_count_known
    # A loop whose bound cannot be read counts once and says so.
    assert got["opaque_cp"].count == 1
    assert not got["opaque_cp"].trip_count_known


def test_garbage_is_refused() -> None:
    with pytest.raises(ParseHloError):
        parse_collectives("this is not HLO")
    with pytest.raises(ParseHloError):
        parse_replica_groups("replica_groups=mesh[oops", num_devices=8)
