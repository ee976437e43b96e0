"""Read collectives out of HLO text, the way the cost model counts them.

The HLO worth reading is the one right after SPMD partitioning (:func:`dump_spmd_hlo`): the
final CPU HLO has merged collectives, bf16 upcast to f32 and no reduce-scatter (JAX-NOTES).

Byte convention (the cost model's, per device, per execution; ``HloCollective.bytes``):

=====================  ====================================================================
kind                   bytes
=====================  ====================================================================
``all-reduce``         the buffer: the result shape.
``all-gather``         the full gathered output: the result shape.
``reduce-scatter``     the full input: result shape x group size (an ``all-reduce`` whose
                       users are all ``dynamic-slice`` s cutting it ``group size`` ways is
                       counted as a reduce-scatter of the all-reduce's buffer; one whose
                       users are all ``collective-permute`` s, as a reduce-scatter of
                       buffer x group size, those permutes being part of it: XLA
                       reduces a slice picked by an axis the operands are replicated
                       over, then sends each slice to the device that owns it).
``all-to-all``         the buffer: the result shape (= the input's).
``collective-permute`` the buffer sent: the result shape.
=====================  ====================================================================

``count`` is executions per step: a collective inside a ``while`` body counts the loop's
trip count (``known_trip_count`` in its backend config, else read off the loop condition
``i < N`` and the initial value of ``i``), nested loops multiply. ``total_bytes`` is
``bytes * count``. Tuple-shaped collectives (combined by XLA) count their elements' bytes.

Example:
    >>> hlo = '''ENTRY %main (p: f32[8,4]) -> f32[8,4] {
    ...   %p = f32[8,4]{1,0} parameter(0)
    ...   ROOT %ar = f32[8,4]{1,0} all-reduce(%p), replica_groups={{0,1},{2,3}}, to_apply=%add
    ... }'''
    >>> [(c.kind, c.bytes, c.group_size) for c in parse_collectives(hlo)]
    [('all-reduce', 128.0, 2)]
"""

from __future__ import annotations

import glob
import math
import os
import re
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from autopar.errors import AutoparError

KINDS: tuple[str, ...] = (
    "all-reduce",
    "all-gather",
    "reduce-scatter",
    "all-to-all",
    "collective-permute",
)

_DTYPE_BYTES: dict[str, float] = {
    "pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2,
    "bf16": 2, "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8,
    "c128": 16, "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3": 1, "f8e4m3fnuz": 1, "f8e5m2fnuz": 1,
    "f8e4m3b11fnuz": 1, "f8e3m4": 1, "f8e8m0fnu": 1, "f4e2m1fn": 0.5, "token": 0,
}  # fmt: skip

_SHAPE_RE = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,<=\s]*)\]")
_COMP_RE = re.compile(r"^\s*(ENTRY\s+)?%?([\w.\-]+)\s*(\(.*\))?\s*->\s*.*\{\s*$")
_INSTR_RE = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")


class ParseHloError(AutoparError):
    """The HLO text could not be read (or no post-partitioning dump was produced)."""


# ------------------------------------------------------------------------------- records


@dataclass(frozen=True)
class HloCollective:
    """One collective instruction of the HLO.

    Attributes:
        kind: one of :data:`KINDS`.
        bytes: per device, per execution, in the cost model's convention (module doc).
        group_size: devices per replica group (2 for a collective-permute pair).
        count: executions per step (loop trip counts multiplied in).
        replica_groups: the groups as device (partition) ids; for a collective-permute the
            ``(source, target)`` pairs.
        name: the instruction name.
        computation: the computation it sits in.
        dtype: element type of the (first) result.
        trip_count_known: ``False`` if an enclosing loop's trip count could not be read
            (the count then assumes one iteration).
        op_name: the JAX operation it comes from (HLO ``metadata={op_name=...}``).
        branches: the ``conditional`` s it sits in, outermost first, as
            ``(instruction, branch index, number of branches)`` (``count`` assumes every
            branch runs each time its conditional does: which one runs is data).
    """

    kind: str
    bytes: float
    group_size: int
    count: int
    replica_groups: tuple[tuple[int, ...], ...]
    name: str = ""
    computation: str = ""
    dtype: str = ""
    trip_count_known: bool = True
    op_name: str = ""
    branches: tuple[tuple[str, int, int], ...] = ()

    @property
    def total_bytes(self) -> float:
        return self.bytes * self.count


@dataclass
class _Instr:
    name: str
    type_str: str
    opcode: str
    operands: list[str]
    attrs: str
    root: bool = False


@dataclass
class _Comp:
    name: str
    entry: bool
    instrs: dict[str, _Instr] = field(default_factory=dict)
    order: list[str] = field(default_factory=list)
    root: str | None = None


# ------------------------------------------------------------------------------- parsing


def _match_paren(s: str, start: int) -> int:
    """Index of the bracket closing the one at ``s[start]`` (``(``/``{``/``[``)."""
    pairs = {"(": ")", "{": "}", "[": "]"}
    stack = []
    for i in range(start, len(s)):
        ch = s[i]
        if ch in pairs:
            stack.append(pairs[ch])
        elif stack and ch == stack[-1]:
            stack.pop()
            if not stack:
                return i
    raise ParseHloError(f"unbalanced brackets in HLO line: {s[:200]!r}")


def _parse_instr(line: str) -> _Instr | None:
    m = _INSTR_RE.match(line)
    if not m:
        return None
    root, name, rest = bool(m.group(1)), m.group(2), m.group(3).strip()
    if rest.startswith("("):
        end = _match_paren(rest, 0)
        type_str, rest = rest[: end + 1], rest[end + 1 :].strip()
    else:
        sp = rest.find(" ")
        if sp < 0:
            return None
        type_str, rest = rest[:sp], rest[sp + 1 :].strip()
    om = re.match(r"([\w\-]+)\(", rest)
    if not om:
        return None
    opcode = om.group(1)
    open_i = om.end() - 1
    close_i = _match_paren(rest, open_i)
    operand_str = rest[open_i + 1 : close_i]
    operands = re.findall(r"%([\w.\-]+)", operand_str)
    if not operands and operand_str.strip():
        # Printers without '%': operands are bare names, possibly typed ("f32[2] x").
        operands = [tok.split()[-1] for tok in _split_top(operand_str) if tok.strip()]
    attrs = rest[close_i + 1 :]
    if opcode == "constant":
        attrs = f"value={operand_str}" + attrs
    return _Instr(name, type_str, opcode, operands, attrs, root)


def _split_top(s: str) -> list[str]:
    out, depth, cur = [], 0, []
    for ch in s:
        if ch in "({[":
            depth += 1
        elif ch in ")}]":
            depth -= 1
        if ch == "," and depth == 0:
            out.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    out.append("".join(cur))
    return out


def parse_module(hlo_text: str) -> dict[str, _Comp]:
    """Computations of an HLO module, by name (entry flagged)."""
    comps: dict[str, _Comp] = {}
    cur: _Comp | None = None
    for line in hlo_text.splitlines():
        if cur is None:
            m = _COMP_RE.match(line)
            if m and not line.lstrip().startswith("HloModule"):
                cur = _Comp(m.group(2), bool(m.group(1)))
            continue
        if line.strip() == "}":
            comps[cur.name] = cur
            cur = None
            continue
        ins = _parse_instr(line)
        if ins is None:
            continue
        cur.instrs[ins.name] = ins
        cur.order.append(ins.name)
        if ins.root:
            cur.root = ins.name
    if cur is not None:
        comps[cur.name] = cur
    return comps


def shape_bytes(type_str: str) -> float:
    """Bytes of an HLO type (tuples summed): ``"(f32[2,3]{1,0}, bf16[4])"`` -> 32."""
    total = 0.0
    for dtype, dims in _SHAPE_RE.findall(type_str):
        if dtype not in _DTYPE_BYTES:
            continue
        sizes = [int(d.replace("<=", "")) for d in dims.replace(" ", "").split(",") if d]
        total += _DTYPE_BYTES[dtype] * math.prod(sizes)
    return total


def _shape_elems(type_str: str) -> list[int]:
    out = []
    for dtype, dims in _SHAPE_RE.findall(type_str):
        if dtype not in _DTYPE_BYTES:
            continue
        sizes = [int(d.replace("<=", "")) for d in dims.replace(" ", "").split(",") if d]
        out.append(math.prod(sizes))
    return out


def _first_dtype(type_str: str) -> str:
    m = _SHAPE_RE.search(type_str)
    return m.group(1) if m else ""


# ------------------------------------------------------------------------------- groups


def _iota_groups(spec: str) -> list[list[int]]:
    """``[G,S]<=[d0,d1,...]T(p0,p1,...)`` -> G groups of S device ids."""
    m = re.match(r"\s*\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", spec)
    if not m:
        raise ParseHloError(f"cannot read iota replica groups {spec!r}")
    out_dims = [int(x) for x in m.group(1).split(",")]
    src_dims = [int(x) for x in m.group(2).split(",")]
    ids = np.arange(math.prod(src_dims)).reshape(src_dims)
    if m.group(3):
        ids = ids.transpose([int(x) for x in m.group(3).split(",")])
    ids = ids.reshape(out_dims)
    return ids.reshape(out_dims[0], -1).tolist() if len(out_dims) > 1 else [ids.tolist()]


def _iota_ids(text: str) -> np.ndarray:
    """Device ids of an iota tile assignment, ``[d0,d1]T(1,0)`` or ``[..]<=[d0,d1]T(1,0)``."""
    if "<=" in text:
        text = text.split("<=", 1)[1]
    m = re.match(r"\s*\[([\d,]+)\](?:T\(([\d,]+)\))?", text)
    if not m:
        raise ParseHloError(f"cannot read iota device ids {text!r}")
    dims = [int(x) for x in m.group(1).split(",")]
    ids = np.arange(math.prod(dims)).reshape(dims)
    if m.group(2):
        ids = ids.transpose([int(x) for x in m.group(2).split(",")])
    return ids.reshape(-1)


def _mesh_groups(spec: str) -> list[list[int]]:
    """``mesh['a'=2,'b'=4] {'b'}`` (optionally ``, device_ids=(...)`` and sub-axes
    ``'b':(1)2``) -> the groups varying over the listed axes."""
    m = re.match(r"\s*mesh\[(.*?)\]", spec)
    if not m:
        raise ParseHloError(f"cannot read mesh replica groups {spec!r}")
    axes = [(a, int(n)) for a, n in re.findall(r"'([^']+)'=(\d+)", m.group(1))]
    names = [a for a, _ in axes]
    sizes = [n for _, n in axes]
    n_dev = math.prod(sizes)
    rest = spec[m.end() :]
    ids = np.arange(n_dev)
    dm = re.match(r"\s*,\s*device_ids=\(", rest)
    if dm:
        close = _match_paren(rest, dm.end() - 1)
        ids_text = rest[dm.end() : close]
        rest = rest[close + 1 :]
        if "[" in ids_text:
            ids = _iota_ids(ids_text)
        else:
            ids = np.array([int(x) for x in re.findall(r"\d+", ids_text)])
    gm = re.match(r"\s*\{(.*?)\}", rest)
    if not gm or ids.size != n_dev:
        raise ParseHloError(f"cannot read mesh replica groups {spec[:120]!r}")
    refs = re.findall(r"'([^']+)'(?::\((\d+)\)(\d+))?", gm.group(1))
    # Split each axis into [pre, size, rest] where a sub-axis of it is referenced
    # (Shardy: pre-size = product of the sub-axes on the major side).
    fine: list[int] = []
    dims_of: dict[tuple[str, int, int], int] = {}
    for name, size in axes:
        subs = [(int(p), int(s)) for a, p, s in refs if a == name and p]
        if not subs:
            dims_of[(name, 1, size)] = len(fine)
            fine.append(size)
            continue
        # One referenced sub-axis per axis covers what the partitioner emits.
        pre, sub = subs[0]
        rest = size // (pre * sub)
        fine.extend([pre, sub, rest])
        dims_of[(name, pre, sub)] = len(fine) - 2
    group_dims = []
    for a, p, s in refs:
        key = (a, int(p), int(s)) if p else (a, 1, dict(axes)[a])
        if key not in dims_of:
            raise ParseHloError(f"replica groups name axis {a!r} not in mesh {names}")
        group_dims.append(dims_of[key])
    arr = ids.reshape(fine)
    rest_dims = [d for d in range(len(fine)) if d not in group_dims]
    arr = arr.transpose(rest_dims + group_dims)
    gsize = math.prod(fine[d] for d in group_dims) if group_dims else 1
    return arr.reshape(-1, gsize).tolist()


def parse_replica_groups(attrs: str, num_devices: int | None = None) -> list[list[int]]:
    """The replica groups of an instruction's attribute text, in any of XLA's spellings:
    explicit ``{{0,1},{2,3}}``, iota ``[2,4]<=[8]`` / ``[4,2]<=[2,4]T(1,0)``, or the mesh
    form ``mesh['axis_0'=2,'axis_1'=4] {'axis_1'}``. ``{}`` means one group of all
    ``num_devices``.

    Example:
        >>> parse_replica_groups("replica_groups=[2,2]<=[2,2]T(1,0), to_apply=%add")
        [[0, 2], [1, 3]]
    """
    m = re.search(r"replica_groups=", attrs)
    if not m:
        return [list(range(num_devices))] if num_devices else []
    rest = attrs[m.end() :]
    if rest.startswith("mesh["):
        return _mesh_groups(rest)
    if rest.startswith("["):
        return _iota_groups(rest)
    if rest.startswith("{"):
        end = _match_paren(rest, 0)
        inner = rest[1:end].strip()
        if not inner:
            return [list(range(num_devices))] if num_devices else []
        return [[int(x) for x in re.findall(r"\d+", g)] for g in re.findall(r"\{([^{}]*)\}", inner)]
    raise ParseHloError(f"cannot read replica groups {rest[:80]!r}")


def _pairs(attrs: str) -> list[list[int]]:
    m = re.search(r"source_target_pairs=\{(.*?)\}\}", attrs)
    if not m:
        return []
    return [
        [int(x) for x in re.findall(r"\d+", p)] for p in re.findall(r"\{([^{}]*)", m.group(1) + "}")
    ]


def group_axes(groups: Sequence[Sequence[int]], mesh: Mapping[str, int]) -> tuple[str, ...]:
    """The mesh axes a collective's groups span (device id = position in the mesh,
    row-major, as :func:`autopar.lower.make_mesh` lays devices out).

    Example:
        >>> group_axes([[0, 4], [1, 5], [2, 6], [3, 7]], {"data": 2, "tensor": 4})
        ('data',)
    """
    names, sizes = list(mesh), [mesh[a] for a in mesh]
    n = math.prod(sizes)
    varying: set[int] = set()
    for g in groups:
        coords = [np.unravel_index(d % n, sizes) for d in g]
        for ax in range(len(sizes)):
            if len({c[ax] for c in coords}) > 1:
                varying.add(ax)
    return tuple(names[a] for a in sorted(varying))


# ------------------------------------------------------------------------------- counting


def _int_constant(ins: _Instr | None) -> int | None:
    if ins is None or ins.opcode != "constant":
        return None
    m = re.match(r"value=\s*(-?\d+)\s*$", ins.attrs.split(",")[0]) or re.match(
        r"value=\s*(-?\d+)", ins.attrs
    )
    return int(m.group(1)) if m else None


def _skip_copies(comp: _Comp, ins: _Instr | None) -> _Instr | None:
    """The instruction a chain of ``copy`` s starts from (the SPMD partitioner wraps a
    ``shard_map`` loop's counter and bound in copies)."""
    seen = 0
    while ins is not None and ins.opcode == "copy" and ins.operands and seen < 64:
        ins = comp.instrs.get(ins.operands[0])
        seen += 1
    return ins


def _trip_count(comps: Mapping[str, _Comp], caller: _Comp, w: _Instr) -> int | None:
    m = re.search(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"?(\d+)', w.attrs)
    if m:
        return int(m.group(1))
    cm = re.search(r"condition=%?([\w.\-]+)", w.attrs)
    bm = re.search(r"body=%?([\w.\-]+)", w.attrs)
    if not cm or cm.group(1) not in comps or not w.operands:
        return None
    cond = comps[cm.group(1)]
    root = cond.instrs.get(cond.root or "")
    if root is None or root.opcode != "compare" or len(root.operands) != 2:
        return None
    direction = re.search(r"direction=(\w+)", root.attrs)
    a, b = (_skip_copies(cond, cond.instrs.get(o)) for o in root.operands)
    if a is None or b is None:
        return None
    direction_s = direction.group(1) if direction else ""
    if a.opcode == "constant":  # N > i  ==  i < N
        a, b = b, a
        direction_s = {"GT": "LT", "GE": "LE", "LT": "GT", "LE": "GE"}.get(direction_s, "")
    limit = _int_constant(b)
    if a.opcode != "get-tuple-element" or limit is None:
        return None
    im = re.search(r"index=(\d+)", a.attrs)
    if not im:
        return None
    idx = int(im.group(1))
    init_tuple = caller.instrs.get(w.operands[0])
    if init_tuple is None or init_tuple.opcode != "tuple" or idx >= len(init_tuple.operands):
        return None
    init = _skip_copies(caller, caller.instrs.get(init_tuple.operands[idx]))
    start = _int_constant(init) if init is not None else None
    if start is None:
        return None
    step = 1
    if bm and bm.group(1) in comps:
        body = comps[bm.group(1)]
        broot = body.instrs.get(body.root or "")
        if broot is not None and broot.opcode == "tuple" and idx < len(broot.operands):
            upd = _skip_copies(body, body.instrs.get(broot.operands[idx]))
            if upd is not None and upd.opcode == "add":
                consts = [
                    _int_constant(_skip_copies(body, body.instrs[o]))
                    for o in upd.operands
                    if o in body.instrs
                ]
                consts = [c for c in consts if c is not None]
                if consts:
                    step = consts[0]
    if step <= 0:
        return None
    if direction_s == "LT":
        return max(0, math.ceil((limit - start) / step))
    if direction_s == "LE":
        return max(0, math.floor((limit - start) / step) + 1)
    return None


def _branch_paths(comps: Mapping[str, _Comp]) -> dict[str, tuple[tuple[str, int, int], ...]]:
    """The conditionals each computation is reached through from the entry, outermost
    first (the first path found where there are several)."""
    paths: dict[str, tuple[tuple[str, int, int], ...]] = {}
    todo = [c.name for c in comps.values() if c.entry]
    for name in todo:
        paths[name] = ()
    while todo:
        comp = comps[todo.pop()]
        here = paths[comp.name]
        for ins in comp.instrs.values():
            callees: list[tuple[str, tuple[tuple[str, int, int], ...]]] = []
            bc = re.search(r"branch_computations=\{([^}]*)\}", ins.attrs)
            if bc:
                names = re.findall(r"%?([\w.\-]+)", bc.group(1))
                callees += [(n, (*here, (ins.name, k, len(names)))) for k, n in enumerate(names)]
            tm = re.search(r"true_computation=%?([\w.\-]+)", ins.attrs)
            fm = re.search(r"false_computation=%?([\w.\-]+)", ins.attrs)
            if tm and fm:  # a predicate conditional: true is branch 0
                callees += [(tm.group(1), (*here, (ins.name, 0, 2)))]
                callees += [(fm.group(1), (*here, (ins.name, 1, 2)))]
            for m in re.finditer(r"(?:calls|to_apply|body|condition)=%?([\w.\-]+)", ins.attrs):
                callees.append((m.group(1), here))
            for callee, path in callees:
                if callee in comps and callee not in paths:
                    paths[callee] = path
                    todo.append(callee)
    return paths


def _multipliers(comps: Mapping[str, _Comp]) -> dict[str, tuple[int, bool]]:
    """Executions per step of each computation (and whether every trip count was known)."""
    calls: dict[str, list[tuple[str, int | None]]] = {name: [] for name in comps}
    for comp in comps.values():
        for ins in comp.instrs.values():
            if ins.opcode == "while":
                trip = _trip_count(comps, comp, ins)
                bm = re.search(r"body=%?([\w.\-]+)", ins.attrs)
                if bm and bm.group(1) in calls:
                    calls[bm.group(1)].append((comp.name, trip))
                continue
            for m in re.finditer(
                r"(?:calls|to_apply|true_computation|false_computation)=%?([\w.\-]+)", ins.attrs
            ):
                if m.group(1) in calls:
                    calls[m.group(1)].append((comp.name, 1))
            bc = re.search(r"branch_computations=\{([^}]*)\}", ins.attrs)
            if bc:
                for name in re.findall(r"%?([\w.\-]+)", bc.group(1)):
                    if name in calls:
                        calls[name].append((comp.name, 1))
    memo: dict[str, tuple[int, bool]] = {}

    def mult(name: str, seen: frozenset[str]) -> tuple[int, bool]:
        if name in memo:
            return memo[name]
        comp = comps[name]
        if comp.entry:
            return (1, True)
        total, known, any_caller = 0, True, False
        for caller, factor in calls[name]:
            if caller in seen:
                continue
            any_caller = True
            n, k = mult(caller, seen | {name})
            total += n * (factor if factor is not None else 1)
            known = known and k and factor is not None
        result = (total if any_caller else 0, known)
        memo[name] = result
        return result

    return {name: mult(name, frozenset()) for name in comps}


def _reduce_scatter_like(comp: _Comp, ar: _Instr, group_size: int) -> bool:
    """An all-reduce whose every user is a dynamic-slice keeping 1/group_size of it."""
    if group_size <= 1 or ar.type_str.startswith("("):
        return False
    full = _shape_elems(ar.type_str)
    users = [i for i in comp.instrs.values() if ar.name in i.operands]
    if not users or not full:
        return False
    for u in users:
        if u.opcode != "dynamic-slice" or u.operands[0] != ar.name:
            return False
        part = _shape_elems(u.type_str)
        if not part or part[0] * group_size != full[0]:
            return False
    return True


def _permuted_slice(comp: _Comp, ar: _Instr, group_size: int) -> bool:
    """An all-reduce whose every user is a collective-permute (a reduce-scatter done as
    slice, all-reduce, send to the owner)."""
    if group_size <= 1 or ar.type_str.startswith("("):
        return False
    users = [i for i in comp.instrs.values() if ar.name in i.operands]
    return bool(users) and all(
        u.opcode in ("collective-permute", "collective-permute-start") for u in users
    )


def parse_collectives(hlo_text: str, num_devices: int | None = None) -> list[HloCollective]:
    """Every collective of an HLO module with bytes (module doc) and executions per step.

    Args:
        hlo_text: HLO module text (best: the dump after ``spmd-partitioning``).
        num_devices: device count, for ``replica_groups={}`` (one group of everything);
            read from ``num_partitions=`` in the module header when absent.

    Example:
        >>> hlo = '''ENTRY %m (p: f32[4]) -> f32[16] {
        ...   %p = f32[4]{0} parameter(0)
        ...   ROOT %ag = f32[16]{0} all-gather(%p), replica_groups=[2,4]<=[8], dimensions={0}
        ... }'''
        >>> c = parse_collectives(hlo)[0]
        >>> c.kind, c.bytes, c.group_size
        ('all-gather', 64.0, 4)
    """
    if num_devices is None:
        m = re.search(r"num_partitions=(\d+)", hlo_text)
        num_devices = int(m.group(1)) if m else None
    comps = parse_module(hlo_text)
    if not comps:
        raise ParseHloError("no HLO computations found in the text.")
    mults = _multipliers(comps)
    paths = _branch_paths(comps)
    out: list[HloCollective] = []
    for comp in comps.values():
        count, known = mults[comp.name]
        if count == 0:
            continue
        absorbed: set[str] = set()  # all-reduces that are a reduce-scatter's first leg
        for name in comp.order:
            ins = comp.instrs[name]
            op = ins.opcode
            base = op[: -len("-start")] if op.endswith("-start") else op
            if base not in KINDS:
                continue
            if base == "collective-permute" and ins.operands and ins.operands[0] in absorbed:
                continue  # the reduce-scatter's second leg: counted with it
            type_str = ins.type_str
            if op.endswith("-start") and type_str.startswith("("):
                parts = _split_top(type_str[1:-1])
                if base == "all-gather":
                    type_str = parts[-1]  # (operand, gathered output)
                elif base == "collective-permute" and len(parts) > 1:
                    type_str = parts[1]  # (operand, output, contexts...)
            nbytes = shape_bytes(type_str)
            if base == "collective-permute":
                groups = _pairs(ins.attrs)
                gsize = 2
            else:
                groups = parse_replica_groups(ins.attrs, num_devices)
                gsize = len(groups[0]) if groups else (num_devices or 1)
            kind = base
            if base == "reduce-scatter":
                nbytes *= gsize  # the full input
            elif base == "all-reduce" and _reduce_scatter_like(comp, ins, gsize):
                kind = "reduce-scatter"
            elif base == "all-reduce" and _permuted_slice(comp, ins, gsize):
                kind = "reduce-scatter"
                nbytes *= gsize  # the full input of the reduce-scatter it implements
                absorbed.add(ins.name)
            out.append(
                HloCollective(
                    kind=kind,
                    bytes=nbytes,
                    group_size=gsize,
                    count=count,
                    replica_groups=tuple(tuple(g) for g in groups),
                    name=ins.name,
                    computation=comp.name,
                    dtype=_first_dtype(type_str),
                    trip_count_known=known,
                    op_name=_op_name(ins.attrs),
                    branches=paths.get(comp.name, ()),
                )
            )
    return out


def _op_name(attrs: str) -> str:
    m = re.search(r'op_name="([^"]*)"', attrs)
    return m.group(1) if m else ""


# ------------------------------------------------------------------------------- dumping


SPMD_DUMP_OPTIONS: Mapping[str, str] = {"xla_dump_hlo_pass_re": "spmd-partitioning"}


def dump_spmd_hlo(jitted_or_lowered: Any, *args: Any) -> str:
    """The HLO text right after SPMD partitioning, for a jitted function, a
    ``jax.stages.Lowered`` or an :class:`autopar.lower.LoweredStep`.

    Compiles once more with the DebugOptions ``xla_dump_to`` (a fresh temporary directory)
    and ``xla_dump_hlo_pass_re=spmd-partitioning`` passed as compiler options (they are
    per-compile options in JAX 0.10, no ``XLA_FLAGS`` or subprocess needed), then reads
    the ``*after_spmd-partitioning*`` file.

    Raises:
        ParseHloError: XLA wrote no such file (e.g. a single-device program, which is
            never partitioned).

    Example:
        >>> lowered = autopar.lower.lower_plan(step, plan, (state, batch), graph=graph)
        >>> text = dump_spmd_hlo(lowered)
        >>> sorted((c.kind, c.bytes, c.group_size) for c in parse_collectives(text))
        [('all-reduce', 65536.0, 4)]
    """
    lowered = _as_lowered(jitted_or_lowered, args)
    tmp = tempfile.mkdtemp(prefix="autopar-spmd-")
    try:
        lowered.compile(compiler_options={"xla_dump_to": tmp, **SPMD_DUMP_OPTIONS})
        files = sorted(glob.glob(os.path.join(tmp, "*after_spmd-partitioning*.txt")))
        if not files:
            raise ParseHloError(
                "XLA wrote no '*after_spmd-partitioning*' dump: the program is probably not "
                "partitioned (one device), or the compile came from a cache."
            )
        # One module per jit; take the largest if several were compiled.
        path = max(files, key=os.path.getsize)
        with open(path) as f:
            return f.read()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _as_lowered(obj: Any, args: Sequence[Any]) -> Any:
    if hasattr(obj, "compile") and hasattr(obj, "as_text") and hasattr(obj, "compiler_ir"):
        return obj  # jax.stages.Lowered
    if hasattr(obj, "abstract_args") and hasattr(obj, "lower"):
        return obj.lower(*args)  # LoweredStep
    if hasattr(obj, "lower"):
        return obj.lower(*args)  # jax.jit-wrapped
    raise ParseHloError(
        f"cannot lower {type(obj).__name__}: pass a jax.jit function with its arguments, a "
        "jax.stages.Lowered, or an autopar LoweredStep."
    )
