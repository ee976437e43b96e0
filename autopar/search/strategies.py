"""Sharding strategies of one operation on a mesh.

A strategy says how each operand must be laid out, how each result comes out, what the
operation costs per device (``compute_time`` of its FLOPs and bytes divided by the
shards) and which collectives it implies (partial sums resolved by an all-reduce or a
reduce-scatter). Two entry points:

* :func:`enumerate_strategies` lists every legal strategy of an operation (the
  operations the ILP chooses for: ``dot_general``, convolutions, gathers, scatters, ...).
* :func:`follow_strategy` derives the one strategy an operation takes when it simply
  follows the layout of one operand (elementwise ops, reshapes, transposes, reductions,
  broadcasts, ...). Coarsening merges such operations into the group of the operation
  they follow, so they add no choice of their own.

Example: a ``[64, 256] @ [256, 1024]`` matmul on a 2 x 4 mesh (``m``: a free dim of the
left operand, ``n``: of the right one, ``k``: contracted, its partial sums resolved by an
all-reduce ``AR`` or a reduce-scatter ``RS``).

    >>> from cost_models import Cluster
    >>> g = autopar.trace(lambda x, w: x @ w, jnp.ones((64, 256)), jnp.ones((256, 1024)))
    >>> ctx = CostContext(Cluster.preset("dgx-a100-80gb"), {"data": 2, "tensor": 4})
    >>> strategies = enumerate_strategies(g.nodes[0], ctx)
    >>> len(strategies), [s.name for s in strategies][:4]
    (28, ['R', 'm0=tensor', 'n1=tensor', 'k1=tensor AR(tensor)'])
    >>> best = min(strategies, key=lambda s: s.cost_s)
    >>> best.name, best.ins, best.outs
    ('n1=data+tensor', (((), ()), ((), ('data', 'tensor'))), (((), ('data', 'tensor')),))
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from autopar.primitives import FOLLOWABLE, family_of, sharding_rule
from autopar.search.costs import CostContext, itemsize
from autopar.search.sharding import (
    Collective,
    MeshShape,
    Sharding,
    device_bytes,
    divides,
    enumerate_shardings,
    replicated,
    reshape_sharding,
    shards,
    splits,
)
from autopar.trace.graph import Node

Tag = tuple[str, tuple[str, ...]]
IO = tuple[tuple[bool, ...], tuple[bool, ...]]
"""Which operands an operation reads from HBM and which results it writes (``fusion.py``);
``None``: all of them."""


@dataclass(frozen=True)
class OpStrategy:
    """One way to run one operation on the mesh.

    Attributes:
        name: short description, e.g. ``"m0=data n0=tensor"`` for a matmul.
        ins: required sharding per operand (``None`` for literals).
        outs: sharding per result.
        compute_s: per-device compute time (one execution).
        comm: collectives the strategy implies (one execution).
        flops: FLOPs each device executes (one execution).
        tags: structured description: ``(role, axes)`` pairs, e.g. ``("n0", ("tensor",))``
            for the rhs free dim 0 of a matmul, ``("all-reduce", axes)``.
    """

    name: str
    ins: tuple[Sharding | None, ...]
    outs: tuple[Sharding, ...]
    compute_s: float
    comm: tuple[Collective, ...] = ()
    flops: float = 0.0
    tags: tuple[Tag, ...] = ()

    @property
    def comm_s(self) -> float:
        return sum(c.time_s for c in self.comm)

    @property
    def cost_s(self) -> float:
        return self.compute_s + self.comm_s


_FIELD = re.compile(r"(\w+)=\(([^()]*)\)")


def _parse_record(text: str) -> dict[str, tuple[int, ...]]:
    """``"GatherDimensionNumbers(offset_dims=(2,), ...)"`` -> ``{"offset_dims": (2,), ...}``."""
    return {
        k: tuple(int(x) for x in v.replace(" ", "").split(",") if x)
        for k, v in _FIELD.findall(text)
    }


def _get(obj: Any, name: str, index: int) -> Any:
    """Read a field of a params record the tracer may have stored as object, dict, list or
    its ``repr`` string."""
    if isinstance(obj, str):
        obj = _parse_record(obj)
    if isinstance(obj, dict):
        return obj[name]
    if hasattr(obj, name):
        return getattr(obj, name)
    return obj[index]


def _tuple(x: Any) -> tuple[int, ...]:
    return tuple(int(v) for v in x)


# ----------------------------------------------------------------------------- pricing


def _price(
    node: Node,
    ins: Sequence[Sharding | None],
    outs: Sequence[Sharding],
    work_shards: int,
    ctx: CostContext,
    name: str,
    comm: Sequence[Collective] = (),
    tags: Sequence[Tag] = (),
    io: IO | None = None,
) -> OpStrategy:
    mesh = ctx.mesh
    nbytes = 0.0
    reads, writes = io if io is not None else ((True,) * len(ins), (True,) * len(outs))
    for t, s, r in zip(node.in_tensors, ins, reads, strict=False):
        if s is not None and r:
            nbytes += device_bytes(t.nbytes, t.shape, s, mesh)
    for t, s, w in zip(node.out_tensors, outs, writes, strict=True):
        if w:
            nbytes += device_bytes(t.nbytes, t.shape, s, mesh)
    flops = node.flops / max(work_shards, 1)
    family = family_of(node.primitive)
    kind = family.compute if family is not None else "other"
    if kind == "none":  # layout changes XLA turns into bitcasts or fuses: no time
        compute = 0.0
    else:
        dtype = node.in_tensors[0].dtype if node.in_tensors else node.out_tensors[0].dtype
        compute = ctx.compute(flops, nbytes, dtype, kind)
    return OpStrategy(name, tuple(ins), tuple(outs), compute, tuple(comm), flops, tuple(tags))


def _dedupe(strategies: Sequence[OpStrategy]) -> list[OpStrategy]:
    """Keep the cheapest strategy per distinct (operand, result) layout."""
    best: dict[tuple, OpStrategy] = {}
    for s in strategies:
        key = (s.ins, s.outs)
        if key not in best or s.cost_s < best[key].cost_s - 1e-15:
            best[key] = s
    return list(best.values())


def replicated_strategy(node: Node, ctx: CostContext) -> OpStrategy:
    """Everything replicated: every device runs the whole operation."""
    ins = tuple(replicated(t.ndim) for t in node.in_tensors)
    outs = tuple(replicated(t.ndim) for t in node.out_tensors)
    return _price(node, ins, outs, 1, ctx, "R")


# ----------------------------------------------------------------------------- followers
# A rule maps the layout of operand ``main`` to (operand layouts, result layouts, axes
# whose partial sums the results need reduced over). The operand layout it returns for
# ``main`` may drop axes of ``spec`` the operation cannot keep (the group pays to move).

Rule = Callable[[Node, int, Sharding, MeshShape], tuple[list, list, tuple[str, ...]]]


def _broadcast_to(spec: Sharding, src: Sequence[int], dst: Sequence[int]) -> Sharding:
    """The layout of a same-rank value of shape ``dst`` implied by ``spec`` on shape
    ``src``: elementwise operations broadcast size-1 dims (``x - mean`` with ``x``
    ``[b, s, h]`` and ``mean`` ``[b, s, 1]``), so a dim whose sizes differ is replicated
    and every other dim keeps its axes."""
    return tuple(s if a == b else () for s, a, b in zip(spec, src, dst, strict=True))


def _rule_elementwise(node: Node, main: int, spec: Sharding, mesh: MeshShape):
    ref = node.in_tensors[main]
    outs = [
        _broadcast_to(spec, ref.shape, t.shape) if t.ndim == ref.ndim else replicated(t.ndim)
        for t in node.out_tensors
    ]
    full = next((t for t in node.out_tensors if t.ndim == ref.ndim), ref)
    layout = _broadcast_to(spec, ref.shape, full.shape)
    ins = [
        _broadcast_to(layout, full.shape, t.shape)
        if t.ndim == ref.ndim and t.ndim
        else replicated(t.ndim)
        for t in node.in_tensors
    ]
    return ins, outs, ()


def _clear(spec: Sharding, dims) -> Sharding:
    dims = set(dims)
    return tuple(() if d in dims else s for d, s in enumerate(spec))


def _rule_reduce(node: Node, main: int, spec: Sharding, mesh: MeshShape):
    axes = set(_tuple(node.params.get("axes", ())))
    out = tuple(s for d, s in enumerate(spec) if d not in axes)
    reduced = tuple(a for d in sorted(axes) for a in spec[d])
    return [spec], [out], mesh.order(reduced)


def _rule_argreduce(node: Node, main: int, spec: Sharding, mesh: MeshShape):
    axes = set(_tuple(node.params.get("axes", ())))
    kept = _clear(spec, axes)
    out = tuple(s for d, s in enumerate(kept) if d not in axes)
    return [kept], [out], ()


def _rule_along_axis(param: str) -> Rule:
    def rule(node: Node, main: int, spec: Sharding, mesh: MeshShape):
        axis = int(node.params.get(param, 0))
        kept = _clear(spec, [axis])
        ins, outs, _ = _rule_elementwise(node, main, kept, mesh)
        return ins, outs, ()

    return rule


def _rule_top_k(node: Node, main: int, spec: Sharding, mesh: MeshShape):
    kept = _clear(spec, [len(spec) - 1])
    return [kept], [kept for _ in node.out_tensors], ()


def _rule_broadcast(node: Node, main: int, spec: Sharding, mesh: MeshShape):
    src, dst = node.in_tensors[0], node.out_tensors[0]
    bdims = _tuple(node.params.get("broadcast_dimensions", ()))
    kept = list(spec)
    out: list[tuple[str, ...]] = [() for _ in dst.shape]
    for i, d in enumerate(bdims):
        if src.shape[i] == dst.shape[d]:
            out[d] = spec[i]
        else:
            kept[i] = ()
    ins = [tuple(kept)] + [replicated(t.ndim) for t in node.in_tensors[1:]]
    return ins, [tuple(out)], ()


def _rule_reshape(node: Node, main: int, spec: Sharding, mesh: MeshShape):
    src, dst = node.in_tensors[0], node.out_tensors[0]
    if node.params.get("dimensions") is not None:
        return [replicated(src.ndim)], [replicated(dst.ndim)], ()
    kept, out = reshape_sharding(src.shape, dst.shape, spec, mesh)
    ins = [kept] + [replicated(t.ndim) for t in node.in_tensors[1:]]
    return ins, [out], ()


def _rule_squeeze(node: Node, main: int, spec: Sharding, mesh: MeshShape):
    dims = set(_tuple(node.params.get("dimensions", ())))
    out = tuple(s for d, s in enumerate(spec) if d not in dims)
    return [spec], [out], ()


def _rule_expand_dims(node: Node, main: int, spec: Sharding, mesh: MeshShape):
    dims = sorted(_tuple(node.params.get("dimensions", ())))
    out = list(spec)
    for d in dims:
        out.insert(d, ())
    return [spec], [tuple(out)], ()


def _rule_transpose(node: Node, main: int, spec: Sharding, mesh: MeshShape):
    perm = _tuple(node.params.get("permutation", range(len(spec))))
    return [spec], [tuple(spec[p] for p in perm)], ()


def _changed_dims(a: Sequence[int], b: Sequence[int]) -> list[int]:
    return [d for d, (x, y) in enumerate(zip(a, b, strict=True)) if x != y]


def _rule_slice(node: Node, main: int, spec: Sharding, mesh: MeshShape):
    src, dst = node.in_tensors[0], node.out_tensors[0]
    kept = _clear(spec, _changed_dims(src.shape, dst.shape))
    ins = [kept] + [replicated(t.ndim) for t in node.in_tensors[1:]]
    return ins, [kept], ()


def _rule_pad(node: Node, main: int, spec: Sharding, mesh: MeshShape):
    src, dst = node.in_tensors[0], node.out_tensors[0]
    kept = _clear(spec, _changed_dims(src.shape, dst.shape))
    cfg = node.params.get("padding_config")
    if cfg is not None:  # interior padding changes a dim even when its size is kept
        kept = _clear(kept, [d for d, c in enumerate(cfg) if any(int(v) for v in c)])
    return [kept, ()], [kept], ()


def _rule_dynamic_update_slice(node: Node, main: int, spec: Sharding, mesh: MeshShape):
    operand, update = node.in_tensors[0], node.in_tensors[1]
    kept = _clear(spec, _changed_dims(operand.shape, update.shape))
    ins = [kept, kept] + [replicated(t.ndim) for t in node.in_tensors[2:]]
    return ins, [kept], ()


def _rule_concatenate(node: Node, main: int, spec: Sharding, mesh: MeshShape):
    dim = int(node.params.get("dimension", 0))
    kept = _clear(spec, [dim])
    return [kept for _ in node.in_tensors], [kept], ()


def _rule_rev(node: Node, main: int, spec: Sharding, mesh: MeshShape):
    kept = _clear(spec, _tuple(node.params.get("dimensions", ())))
    return [kept], [kept], ()


def _rule_split(node: Node, main: int, spec: Sharding, mesh: MeshShape):
    kept = _clear(spec, [int(node.params.get("axis", 0))])
    return [kept], [kept for _ in node.out_tensors], ()


# Keyed by the primitives table's sharding rule (``autopar.primitives.FOLLOW_RULES``).
_RULES: dict[str, Rule] = {
    "elementwise": _rule_elementwise,
    "reduce": _rule_reduce,
    "arg_reduce": _rule_argreduce,
    "cumulative": _rule_along_axis("axis"),
    "sort": _rule_along_axis("dimension"),
    "top_k": _rule_top_k,
    "broadcast": _rule_broadcast,
    "reshape": _rule_reshape,
    "squeeze": _rule_squeeze,
    "expand_dims": _rule_expand_dims,
    "transpose": _rule_transpose,
    "slice": _rule_slice,
    "pad": _rule_pad,
    "dynamic_update_slice": _rule_dynamic_update_slice,
    "concatenate": _rule_concatenate,
    "rev": _rule_rev,
    "split": _rule_split,
}


def can_follow(node: Node, operand: int) -> bool:
    """Whether ``node`` can take its layout from operand ``operand``."""
    rule = sharding_rule(node.primitive)
    if rule not in _RULES or not node.out_tensors:
        return False
    t = node.in_tensors[operand]
    if rule == "elementwise":
        # Operands of the result's rank (size-1 dims broadcast); scalars cannot lead.
        return t.ndim > 0 and any(o.ndim == t.ndim for o in node.out_tensors)
    if rule in ("sort", "top_k"):
        return any(o.shape == t.shape for o in node.out_tensors)
    if rule == "concatenate":
        return True
    return operand == 0


def follow_strategy(
    node: Node, operand: int, spec: Sharding, ctx: CostContext, io: IO | None = None
) -> OpStrategy:
    """The strategy of ``node`` when operand ``operand`` arrives laid out as ``spec``.

    ``io`` says which operands and results touch HBM (fused values do not; see
    ``fusion.hbm_io``); by default all do.

    Example:
        >>> from cost_models import Cluster
        >>> ctx = CostContext(Cluster.preset("dgx-a100-80gb"), {"data": 2, "tensor": 4})
        >>> row_sum = autopar.trace(lambda x: x.sum(1), jnp.ones((64, 256))).nodes[0]
        >>> s = follow_strategy(row_sum, 0, (("data",), ()), ctx)   # rows split: local sums
        >>> s.outs[0], [c.kind for c in s.comm]
        ((('data',),), [])
        >>> s = follow_strategy(row_sum, 0, ((), ("tensor",)), ctx)  # summed dim split
        >>> s.outs[0], [(c.kind, c.axes) for c in s.comm]
        (((),), [('all-reduce', ('tensor',))])
    """
    rule = sharding_rule(node.primitive)
    ins, outs, reduce_axes = _RULES[rule](node, operand, spec, ctx.mesh)
    comm: list[Collective] = []
    if reduce_axes:
        # A reduction over a sharded dim leaves partial results: all-reduce them, once per
        # reduced dim (as XLA's partitioner does: see ``partial_groups``).
        out_bytes = sum(
            device_bytes(t.nbytes, t.shape, s, ctx.mesh)
            for t, s in zip(node.out_tensors, outs, strict=True)
        )
        reduced = sorted(_tuple(node.params.get("axes", ())))
        groups = partial_groups([ins[0][d] for d in reduced]) if rule == "reduce" else ()
        for g in groups or (reduce_axes,):
            comm.append(ctx.collective("all-reduce", out_bytes, g))
    if rule == "reduce":
        work = shards(ins[0], ctx.mesh)
    else:
        work = max((shards(s, ctx.mesh) for s in outs), default=1)
    tags = (("all-reduce", reduce_axes),) if reduce_axes else ()
    return _price(node, ins, outs, work, ctx, "follow", comm, tags, io)


def _enumerate_followable(node: Node, ctx: CostContext, io: IO | None) -> list[OpStrategy]:
    rule = sharding_rule(node.primitive)
    tensors = [(k, t) for k, t in enumerate(node.in_tensors) if t.ndim > 0]
    if not tensors or not any(can_follow(node, k) for k, _ in tensors):
        # Nothing to follow (e.g. a broadcast of a scalar): any result layout is free.
        out: list[OpStrategy] = []
        for spec in enumerate_shardings(node.out_tensors[0].shape, ctx.mesh):
            ins = tuple(replicated(t.ndim) for t in node.in_tensors)
            if rule == "broadcast":
                bdims = _tuple(node.params.get("broadcast_dimensions", ()))
                src = node.in_tensors[0]
                ins = (
                    tuple(
                        spec[d] if src.shape[i] == node.out_tensors[0].shape[d] else ()
                        for i, d in enumerate(bdims)
                    ),
                ) + ins[1:]
            outs = tuple(
                spec if t.shape == node.out_tensors[0].shape else replicated(t.ndim)
                for t in node.out_tensors
            )
            out.append(_price(node, ins, outs, shards(spec, ctx.mesh), ctx, "source", io=io))
        return _dedupe(out)
    k = max((k for k, _ in tensors if can_follow(node, k)), key=lambda k: node.in_tensors[k].ndim)
    out = [
        follow_strategy(node, k, s, ctx, io)
        for s in enumerate_shardings(node.in_tensors[k].shape, ctx.mesh)
    ]
    if rule == "reshape":
        # Also reach result layouts a forward mapping misses (split dims sharded minor).
        for s in enumerate_shardings(node.out_tensors[0].shape, ctx.mesh):
            back, fwd = reshape_sharding(
                node.out_tensors[0].shape, node.in_tensors[0].shape, s, ctx.mesh
            )
            out.append(follow_strategy(node, 0, fwd, ctx, io))
    return _dedupe(out)


# ----------------------------------------------------------------------------- dot_general


def _assignments(
    slots: Sequence[tuple[Any, int]], mesh: MeshShape
) -> list[dict[Any, tuple[str, ...]]]:
    """Every map of active mesh axes onto slots (or none), divisible by slot size."""
    axes = mesh.active
    names = [s for s, _ in slots]
    sizes = dict(slots)
    out = []
    for choice in itertools.product((None, *range(len(slots))), repeat=len(axes)):
        amap: dict[Any, list[str]] = {}
        for axis, c in zip(axes, choice, strict=True):
            if c is not None:
                amap.setdefault(names[c], []).append(axis)
        ok = all(sizes[k] % mesh.prod(v) == 0 for k, v in amap.items())
        if ok:
            out.append({k: mesh.order(v) for k, v in amap.items()})
    return out


def partial_groups(per_dim: Sequence[tuple[str, ...]]) -> tuple[tuple[str, ...], ...]:
    """The all-reduces XLA emits for partial sums over several summed dims: one per dim
    split over the mesh, the last dim's first, each of the whole result. (Measured: a
    sum over dims split as ``("data", "tensor")`` gives an all-reduce over ``tensor``
    then one over ``data``, both of the full buffer; over one dim split ``data+tensor``,
    a single all-reduce over both.)

    Example:
        >>> partial_groups([("data",), (), ("tensor",)])
        (('tensor',), ('data',))
    """
    return tuple(tuple(g) for g in reversed(per_dim) if g)


def _resolve_partial(
    node: Node,
    ins: tuple,
    out: Sharding,
    partial: tuple[str, ...],
    work: int,
    ctx: CostContext,
    name: str,
    tags: list[Tag],
    groups: Sequence[tuple[str, ...]] = (),
) -> list[OpStrategy]:
    """Strategies for a result with partial sums over ``partial``: all-reduce it (once
    per summed dim, ``groups`` from :func:`partial_groups`; default one over all of
    ``partial``), or reduce-scatter it onto one result dim."""
    mesh = ctx.mesh
    if not partial:
        return [_price(node, ins, (out,), work, ctx, name or "R", (), tags)]
    res = node.out_tensors[0]
    per_dev = device_bytes(res.nbytes, res.shape, out, mesh)
    label = "+".join(partial)
    strategies = [
        _price(
            node,
            ins,
            (out,),
            work,
            ctx,
            f"{name} AR({label})".strip(),
            tuple(ctx.collective("all-reduce", per_dev, g) for g in (groups or (partial,))),
            [*tags, ("all-reduce", partial)],
        )
    ]
    for d, dim in enumerate(out):
        new = dim + partial
        if mesh.order(new) != new or not splits(res.shape[d], mesh.prod(new), mesh):
            continue
        scattered = out[:d] + (new,) + out[d + 1 :]
        # The reduce-scatter's input: the result as its padded partitions hold it (the
        # unreduced buffer; per_dev when the partial axes divide the dim).
        rs_bytes = per_dev
        if mesh.padded:
            rs_bytes = device_bytes(res.nbytes, res.shape, scattered, mesh) * mesh.prod(partial)
        strategies.append(
            _price(
                node,
                ins,
                (scattered,),
                work,
                ctx,
                f"{name} RS({label}->{d})".strip(),
                (ctx.collective("reduce-scatter", rs_bytes, partial),),
                [*tags, ("reduce-scatter", partial)],
            )
        )
    return strategies


def _dot_general(node: Node, ctx: CostContext) -> list[OpStrategy]:
    lhs, rhs = node.in_tensors[0], node.in_tensors[1]
    (lc, rc), (lb, rb) = node.params["dimension_numbers"]
    lc, rc, lb, rb = _tuple(lc), _tuple(rc), _tuple(lb), _tuple(rb)
    lfree = [d for d in range(lhs.ndim) if d not in lc and d not in lb]
    rfree = [d for d in range(rhs.ndim) if d not in rc and d not in rb]
    slots: list[tuple[Any, int]] = []
    slots += [(("b", i), lhs.shape[d]) for i, d in enumerate(lb)]
    slots += [(("m", i), lhs.shape[d]) for i, d in enumerate(lfree)]
    slots += [(("n", i), rhs.shape[d]) for i, d in enumerate(rfree)]
    slots += [(("k", i), lhs.shape[d]) for i, d in enumerate(lc)]
    out: list[OpStrategy] = []
    for amap in _assignments(slots, ctx.mesh):
        ls: list[tuple[str, ...]] = [() for _ in lhs.shape]
        rs: list[tuple[str, ...]] = [() for _ in rhs.shape]
        for i, (a, b) in enumerate(zip(lb, rb, strict=True)):
            ls[a] = rs[b] = amap.get(("b", i), ())
        for i, (a, b) in enumerate(zip(lc, rc, strict=True)):
            ls[a] = rs[b] = amap.get(("k", i), ())
        for i, d in enumerate(lfree):
            ls[d] = amap.get(("m", i), ())
        for i, d in enumerate(rfree):
            rs[d] = amap.get(("n", i), ())
        res = (
            [amap.get(("b", i), ()) for i in range(len(lb))]
            + [amap.get(("m", i), ()) for i in range(len(lfree))]
            + [amap.get(("n", i), ()) for i in range(len(rfree))]
        )
        partial = ctx.mesh.order(a for i in range(len(lc)) for a in amap.get(("k", i), ()))
        work = math.prod(ctx.mesh.prod(v) for v in amap.values())
        # Tags name the operand dim: b/m/k by the lhs dim, n by the rhs dim.
        dim_of = {"b": lb, "m": lfree, "n": rfree, "k": lc}
        tags = [(f"{k}{dim_of[k][i]}", v) for (k, i), v in sorted(amap.items()) if v]
        name = " ".join(f"{r}={'+'.join(v)}" for r, v in tags)
        ins = (tuple(ls), tuple(rs)) + tuple(replicated(t.ndim) for t in node.in_tensors[2:])
        groups = partial_groups([ls[d] for d in sorted(lc)])
        out += _resolve_partial(node, ins, tuple(res), partial, work, ctx, name, tags, groups)
    return _dedupe(out)


# ----------------------------------------------------------------------------- convolution


def _conv(node: Node, ctx: CostContext) -> list[OpStrategy]:
    lhs, rhs = node.in_tensors[0], node.in_tensors[1]
    res = node.out_tensors[0]
    dn = node.params.get("dimension_numbers")
    if dn is None:
        lspec, rspec, ospec = tuple(range(lhs.ndim)), tuple(range(rhs.ndim)), tuple(range(res.ndim))
    else:
        lspec, rspec, ospec = (
            _tuple(_get(dn, n, i)) for i, n in enumerate(("lhs_spec", "rhs_spec", "out_spec"))
        )
    fgc = int(node.params.get("feature_group_count", 1))
    bgc = int(node.params.get("batch_group_count", 1))
    if bgc != 1:
        return [replicated_strategy(node, ctx)]
    slots: list[tuple[Any, int]] = [("batch", lhs.shape[lspec[0]])]
    if fgc == 1:
        slots += [("out_feature", rhs.shape[rspec[0]]), ("in_feature", lhs.shape[lspec[1]])]
    out: list[OpStrategy] = []
    for amap in _assignments(slots, ctx.mesh):
        ls = [() for _ in lhs.shape]
        rs = [() for _ in rhs.shape]
        os_ = [() for _ in res.shape]
        ls[lspec[0]] = os_[ospec[0]] = amap.get("batch", ())
        rs[rspec[0]] = os_[ospec[1]] = amap.get("out_feature", ())
        ls[lspec[1]] = rs[rspec[1]] = amap.get("in_feature", ())
        partial = amap.get("in_feature", ())
        work = math.prod(ctx.mesh.prod(v) for v in amap.values())
        tags = [(k, v) for k, v in sorted(amap.items()) if v]
        name = " ".join(f"{r}={'+'.join(v)}" for r, v in tags)
        ins = (tuple(ls), tuple(rs))
        out += _resolve_partial(node, ins, tuple(os_), partial, work, ctx, name, tags)
    return _dedupe(out)


# ----------------------------------------------------------------------------- gather


def _gather(node: Node, ctx: CostContext) -> list[OpStrategy]:
    operand, indices = node.in_tensors[0], node.in_tensors[1]
    res = node.out_tensors[0]
    dn = node.params["dimension_numbers"]
    offset_dims = _tuple(_get(dn, "offset_dims", 0))
    collapsed = _tuple(_get(dn, "collapsed_slice_dims", 1))
    start_index_map = _tuple(_get(dn, "start_index_map", 2))
    obatch = (
        _tuple(_get(dn, "operand_batching_dims", 3)) if _has(dn, "operand_batching_dims", 3) else ()
    )
    ibatch = (
        _tuple(_get(dn, "start_indices_batching_dims", 4))
        if _has(dn, "start_indices_batching_dims", 4)
        else ()
    )
    slice_sizes = _tuple(node.params["slice_sizes"])
    out_batch = [d for d in range(res.ndim) if d not in offset_dims]  # <-> indices dims [:-1]
    idx_dims = list(range(indices.ndim - 1))
    op_offset = [d for d in range(operand.ndim) if d not in collapsed and d not in obatch]
    slots: list[tuple[Any, int]] = []
    slots += [(("ib", j), indices.shape[j]) for j in idx_dims]
    slots += [
        (("off", d), operand.shape[d]) for d in op_offset if slice_sizes[d] == operand.shape[d]
    ]
    slots += [
        (("idx", d), operand.shape[d])
        for d in start_index_map
        if d in collapsed and slice_sizes[d] == 1
    ]
    out: list[OpStrategy] = []
    for amap in _assignments(slots, ctx.mesh):
        os_ = [() for _ in res.shape]
        ops = [() for _ in operand.shape]
        ins_idx = [() for _ in indices.shape]
        for j in idx_dims:
            v = amap.get(("ib", j), ())
            ins_idx[j] = os_[out_batch[j]] = v
            if j in ibatch:
                ops[obatch[ibatch.index(j)]] = v
        for i, d in enumerate(op_offset):
            ops[d] = os_[offset_dims[i]] = amap.get(("off", d), ())
        partial = ctx.mesh.order(a for (k, _), v in amap.items() if k == "idx" for a in v)
        for (k, d), v in amap.items():
            if k == "idx":
                ops[d] = v
        work = math.prod(ctx.mesh.prod(v) for (k, _), v in amap.items() if k != "idx")
        tags = [(f"{k}{i}", v) for (k, i), v in sorted(amap.items()) if v]
        name = " ".join(f"{r}={'+'.join(v)}" for r, v in tags)
        ins = (tuple(ops), tuple(ins_idx)) + tuple(replicated(t.ndim) for t in node.in_tensors[2:])
        # A table sharded on the looked-up dim: each device answers the indices it owns
        # (others masked to zero) and an all-reduce assembles the rows.
        out += _resolve_partial(node, ins, tuple(os_), partial, work, ctx, name, tags)
    return _dedupe(out)


def _has(obj: Any, name: str, index: int) -> bool:
    if isinstance(obj, str):
        obj = _parse_record(obj)
    if isinstance(obj, dict):
        return name in obj
    if hasattr(obj, name):
        return True
    return isinstance(obj, (list, tuple)) and len(obj) > index


# ----------------------------------------------------------------------------- scatter


def _scatter(node: Node, ctx: CostContext) -> list[OpStrategy]:
    operand, indices, updates = node.in_tensors[0], node.in_tensors[1], node.in_tensors[2]
    node.out_tensors[0]
    dn = node.params["dimension_numbers"]
    window = _tuple(_get(dn, "update_window_dims", 0))
    inserted = _tuple(_get(dn, "inserted_window_dims", 1))
    to_operand = _tuple(_get(dn, "scatter_dims_to_operand_dims", 2))
    obatch = (
        _tuple(_get(dn, "operand_batching_dims", 3)) if _has(dn, "operand_batching_dims", 3) else ()
    )
    ibatch = (
        _tuple(_get(dn, "scatter_indices_batching_dims", 4))
        if _has(dn, "scatter_indices_batching_dims", 4)
        else ()
    )
    additive = sharding_rule(node.primitive) == "scatter_add"
    upd_scatter = [d for d in range(updates.ndim) if d not in window]  # <-> indices dims [:-1]
    op_window = [d for d in range(operand.ndim) if d not in inserted and d not in obatch]
    slots: list[tuple[Any, int]] = []
    for j in range(indices.ndim - 1):
        if j in ibatch or additive:
            slots.append((("sb", j), indices.shape[j]))
    for i, d in enumerate(op_window):
        if updates.shape[window[i]] == operand.shape[d]:
            slots.append((("win", d), operand.shape[d]))
    for d in to_operand:
        if d in inserted:
            slots.append((("idx", d), operand.shape[d]))
    out: list[OpStrategy] = []
    for amap in _assignments(slots, ctx.mesh):
        ops = [() for _ in operand.shape]
        upd = [() for _ in updates.shape]
        idx = [() for _ in indices.shape]
        partial: list[str] = []
        for j in range(indices.ndim - 1):
            v = amap.get(("sb", j), ())
            idx[j] = upd[upd_scatter[j]] = v
            if j in ibatch:
                ops[obatch[ibatch.index(j)]] = v
            else:
                partial.extend(v)  # each device adds its updates into a full-size result
        for i, d in enumerate(op_window):
            ops[d] = upd[window[i]] = amap.get(("win", d), ())
        for (k, d), v in amap.items():
            if k == "idx":
                ops[d] = v  # each device applies the updates that land in its rows
        work = math.prod(ctx.mesh.prod(v) for (k, _), v in amap.items() if k != "idx")
        tags = [(f"{k}{i}", v) for (k, i), v in sorted(amap.items()) if v]
        name = " ".join(f"{r}={'+'.join(v)}" for r, v in tags)
        ins = (tuple(ops), tuple(idx), tuple(upd)) + tuple(
            replicated(t.ndim) for t in node.in_tensors[3:]
        )
        groups = partial_groups(
            [idx[j] for j in range(indices.ndim - 1) if j not in ibatch]
            + [v for (k, _), v in sorted(amap.items()) if k == "idx"]
        )
        out += _resolve_partial(
            node, ins, tuple(ops), ctx.mesh.order(partial), work, ctx, name, tags, groups
        )
    return _dedupe(out)


# ----------------------------------------------------------------------------- entry


def enumerate_strategies(node: Node, ctx: CostContext, io: IO | None = None) -> list[OpStrategy]:
    """Every legal strategy of ``node`` on ``ctx.mesh`` (deduplicated by layout).

    Operations without a rule get one strategy: everything replicated. ``io`` (fusible
    operations only) says which operands and results touch HBM.

    Example:
        >>> from cost_models import Cluster
        >>> ctx = CostContext(Cluster.preset("dgx-a100-80gb"), {"data": 8})
        >>> g = autopar.trace(lambda x, w: jnp.linalg.cholesky(x @ w),
        ...                   jnp.ones((64, 256)), jnp.ones((256, 64)))
        >>> [s.name for s in enumerate_strategies(g.nodes[0], ctx)]   # the matmul
        ['R', 'm0=data', 'n1=data', 'k1=data AR(data)', 'k1=data RS(data->0)', 'k1=data RS(data->1)']
        >>> g.nodes[4].primitive, [s.name for s in enumerate_strategies(g.nodes[4], ctx)]
        ('cholesky', ['R'])
    """
    rule = sharding_rule(node.primitive)
    if not node.out_tensors:
        return [replicated_strategy(node, ctx)]
    if rule == "dot":
        out = _dot_general(node, ctx)
    elif rule == "conv":
        out = _conv(node, ctx)
    elif rule == "gather":
        out = _gather(node, ctx)
    elif rule in ("scatter", "scatter_add"):
        out = _scatter(node, ctx)
    elif rule in _RULES or rule == "source":
        out = _enumerate_followable(node, ctx, io)
    else:
        out = [replicated_strategy(node, ctx)]
    return out or [replicated_strategy(node, ctx)]


def is_valid(node: Node, strategy: OpStrategy, mesh: MeshShape) -> bool:
    """Every sharded dim of every operand and result divisible by its axes."""
    for t, s in zip(node.in_tensors, strategy.ins, strict=False):
        if s is not None and not divides(t.shape, s, mesh):
            return False
    return all(
        divides(t.shape, s, mesh) for t, s in zip(node.out_tensors, strategy.outs, strict=True)
    )


__all__ = [
    "FOLLOWABLE",
    "OpStrategy",
    "can_follow",
    "enumerate_strategies",
    "follow_strategy",
    "itemsize",
]
