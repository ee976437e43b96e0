"""Rematerialisation per pipeline stage: a stage keeps its input, not its residuals.

A pipeline stage holds, for every microbatch in flight, what its forward piece leaves
for its backward piece (the *stash*: :attr:`autopar.lower.stages.Piece.stash`). Under
1F1B stage ``s`` holds ``p - s`` of them, under GPipe all ``m``; for a transformer the
stash is every layer's residuals, ``~34 s b h`` bytes per layer in 16 bits (Korthikanti
et al. 2022, eq. 2). With ``"full"`` rematerialisation of a stage (GPipe's
re-materialisation, Huang et al. 2019, section 2.2; Megatron-LM's full activation
recomputation), its forward piece stashes only what it *received* (its input from the
previous stage, ``2 s b h`` bytes for a transformer) and the values it reads from earlier
stages, and its backward piece first re-runs the part of the forward that makes the rest:
one more forward of the stage per microbatch, for a stash of one activation.

A stage's layers that run as a scan over a stacked stack (``scan_layers``) are recomputed
*layer by layer*, as Megatron-LM recomputes: the stage stashes each of its layers' input
(``2 s b h`` bytes per layer per microbatch in flight), and its backward scan re-runs one
layer's forward from that input in each iteration, right before that layer's backward,
so only one layer's residuals (``~34 s b h``) are alive at a time instead of the whole
stage's. (Recomputing the stage at once would re-create ``L/p`` layers' residuals in
one backward tick: 54 GiB of the 87 GiB of Megatron-LM's 76.1B configuration.) Unrolled
layers are recomputed with their stage at once.

:func:`remat_stages` rewrites a :class:`~autopar.lower.stages.StageCut` (pieces, stash)
and leaves everything else as cut, so the runtime (:mod:`autopar.lower.pipeline`) and
what it reports (:func:`autopar.lower.pipeline.buffer_slots`) follow without change.
Random bits are recomputed from the same key, so dropout masks are identical.

Example:
    >>> import functools
    >>> def loss(ws, x):
    ...     for w in ws:
    ...         x = jnp.tanh(x @ w)
    ...     return jnp.mean(x ** 2)
    >>> ws = [jnp.eye(4) * (k + 1) / 4 for k in range(4)]
    >>> g = autopar.trace(jax.value_and_grad(loss), ws, jnp.ones((2, 4)))
    >>> cut = autopar.lower.pipeline.cut_stages(g, [(0, 2), (2, 4)], batch_inputs=[4])
    >>> [len(cut.forward(s).stash) for s in range(2)]
    [4, 6]
    >>> lean = remat_stages(cut, ("full", "full"))
    >>> [len(lean.forward(s).stash) for s in range(2)]  # stage 1 keeps its input only
    [0, 1]
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import jax
from jax.extend.core import DropVar, Var, jaxpr_as_fun, new_jaxpr_eqn

from autopar.errors import LowerPlanError
from autopar.lower.stages import Piece, StageCut

__all__ = ["STAGE_REMAT_POLICIES", "remat_stages", "recomputed_equations"]

STAGE_REMAT_POLICIES: tuple[str, ...] = ("none", "full")


def recomputed_equations(
    forward: Piece, targets: Sequence[Var] | None = None, skip: frozenset[int] = frozenset()
) -> tuple[Any, ...]:
    """The equations of ``forward`` its backward piece re-runs under ``"full"``: those that
    make a stashed value (or one of ``targets``), with everything they read from the
    piece, in program order. Equations at the positions in ``skip`` are never re-run:
    what they make is stashed instead (a layer scan recomputed layer by layer)."""
    made: dict[Var, int] = {}
    for k, e in enumerate(forward.eqns):
        for v in e.outvars:
            if not isinstance(v, DropVar):
                made[v] = k
    need: set[int] = set()
    want = forward.stash if targets is None else targets
    todo = [made[v] for v in want if v in made and made[v] not in skip]
    while todo:
        k = todo.pop()
        if k in need:
            continue
        need.add(k)
        todo.extend(
            made[a]
            for a in forward.eqns[k].invars
            if isinstance(a, Var) and a in made and made[a] not in skip
        )
    return tuple(forward.eqns[k] for k in sorted(need))


@dataclass(frozen=True, eq=False)
class _LayerScan:
    """A stage's forward layer scan ``F`` (position ``f`` in its forward piece) whose
    stacked residuals only the backward layer scan ``B`` (position ``b``) reads."""

    f: int
    b: int
    residuals: frozenset[Var]


def _layer_scans(fwd: Piece, bwd: Piece) -> list[_LayerScan]:
    """The (forward, backward) layer-scan pairs of a stage that can be recomputed layer by
    layer: every stashed stacked output of ``F`` is read by ``B`` alone, as a scanned
    operand (``xs``), and by no other equation of the backward piece."""
    stash = set(fwd.stash)
    readers: dict[Var, list[tuple[int, int]]] = {}
    for k, e in enumerate(bwd.eqns):
        for j, a in enumerate(e.invars):
            if isinstance(a, Var):
                readers.setdefault(a, []).append((k, j))
    out = []
    for f, e in enumerate(fwd.eqns):
        if e.primitive.name != "scan" or e.params.get("reverse", False):
            continue
        nk = e.params["num_carry"]
        res = [v for v in e.outvars[nk:] if not isinstance(v, DropVar) and v in stash]
        if not res:
            continue
        places = {kj for v in res for kj in readers.get(v, ())}
        bs = {k for k, _ in places}
        if len(bs) != 1:
            continue
        b = bs.pop()
        be = bwd.eqns[b]
        first_x = be.params["num_consts"] + be.params["num_carry"]
        if (
            be.primitive.name != "scan"
            or not be.params.get("reverse", False)
            or be.params["length"] != e.params["length"]
            or any(j < first_x for _, j in places)
        ):
            continue
        out.append(_LayerScan(f, b, frozenset(res)))
    return out


def _avals(xs: Sequence[Any]) -> list[jax.ShapeDtypeStruct]:
    return [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in xs]


@functools.lru_cache(maxsize=64)
def _bodies(
    fbody: Any, bbody: Any, counts: tuple[int, int, int, int], res_at: tuple[tuple[int, int], ...]
) -> tuple[Any, Any]:
    """The loop bodies of :func:`_per_layer` (the same for every stage and chunk cut from
    one layer scan, so built once): the forward body also returning its carry in, and the
    backward body re-running the forward body from it before the layer's backward."""
    ncf, nkf, ncb, nkb = counts
    f_fun, b_fun = jaxpr_as_fun(fbody), jaxpr_as_fun(bbody)
    at = dict(res_at)
    n_xs = len(bbody.in_avals) - ncb - nkb

    def forward(*a: Any) -> list[Any]:
        return [*f_fun(*a), *a[ncf : ncf + nkf]]

    body_f = jax.make_jaxpr(forward)(*_avals(fbody.in_avals))
    kept_avals = [x for j, x in enumerate(bbody.in_avals[ncb + nkb :]) if j not in at]
    n_kept = len(kept_avals)

    def backward(*a: Any) -> list[Any]:
        bc, fc = a[:ncb], a[ncb : ncb + ncf]
        carry = a[ncb + ncf : ncb + ncf + nkb]
        rest = a[ncb + ncf + nkb :]
        kx, hx, fx = rest[:n_kept], rest[n_kept : n_kept + nkf], rest[n_kept + nkf :]
        ys = f_fun(*fc, *hx, *fx)[nkf:]
        it = iter(kx)
        xs = [ys[at[j]] if j in at else next(it) for j in range(n_xs)]
        return b_fun(*bc, *carry, *xs)

    in_avals = [
        *bbody.in_avals[:ncb], *fbody.in_avals[:ncf], *bbody.in_avals[ncb : ncb + nkb],
        *kept_avals, *fbody.in_avals[ncf : ncf + nkf], *fbody.in_avals[ncf + nkf :],
    ]  # fmt: skip
    return body_f, jax.make_jaxpr(backward)(*_avals(in_avals))


def _per_layer(fe: Any, be: Any, residuals: frozenset[Var]) -> tuple[Any, Any, list[Var]]:
    """``(F', B', H)``: the forward scan ``fe`` also returning each layer's carry in (the
    stacked layer inputs ``H``, what a stage stashes per microbatch), and the backward scan
    ``be`` re-running one layer's forward from its slice of ``H`` in every iteration
    before that layer's backward (the forward's per-layer residuals live one iteration):
    Megatron-LM's full recomputation, per layer."""
    fbody, bbody = fe.params["jaxpr"], be.params["jaxpr"]
    ncf, nkf = fe.params["num_consts"], fe.params["num_carry"]
    ncb, nkb = be.params["num_consts"], be.params["num_carry"]
    full = next(v for v in residuals).aval.shape[0]  # layers of the whole stack
    carry_in = fe.invars[ncf : ncf + nkf]
    h = [Var(a.aval.update(shape=(full, *a.aval.shape))) for a in carry_in]
    b_xs = be.invars[ncb + nkb :]
    f_ys = list(fe.outvars[nkf:])
    res_at = tuple((j, f_ys.index(x)) for j, x in enumerate(b_xs) if x in residuals)
    body_f, body_b = _bodies(fbody, bbody, (ncf, nkf, ncb, nkb), res_at)
    new_f = new_jaxpr_eqn(
        list(fe.invars), [*fe.outvars, *h], fe.primitive, dict(fe.params, jaxpr=body_f),
        fe.effects, fe.source_info, fe.ctx,
    )  # fmt: skip
    at = dict(res_at)
    kept = [x for j, x in enumerate(b_xs) if j not in at]
    f_consts, f_xs = fe.invars[:ncf], fe.invars[ncf + nkf :]
    invars = [
        *be.invars[:ncb], *f_consts, *be.invars[ncb : ncb + nkb], *kept, *h, *f_xs,
    ]  # fmt: skip
    params = dict(be.params, jaxpr=body_b, num_consts=ncb + ncf)
    if "linear" in params:
        params["linear"] = (False,) * len(invars)
    new_b = new_jaxpr_eqn(
        invars, list(be.outvars), be.primitive, params, be.effects, be.source_info, be.ctx
    )
    return new_f, new_b, h


def remat_stages(cut: StageCut, policies: Sequence[str]) -> StageCut:
    """``cut`` with the stages whose policy is ``"full"`` keeping their input only.

    Args:
        cut: from :func:`autopar.lower.stages.cut_stages`.
        policies: per stage of the cut (per chunk when interleaved), ``"none"`` or
            ``"full"``; empty means ``"none"`` everywhere.

    Returns:
        The rewritten cut: for a ``"full"`` stage, its stash is the values it reads but
        does not make (received from the previous stage, or from an earlier stage's
        forward for its own backward), and its backward piece starts with
        :func:`recomputed_equations`. A layer scan of the stage (``scan_layers``) is
        recomputed layer by layer, as Megatron-LM recomputes: the stage also stashes
        each of its layers' input (the forward scan returns them), and the backward scan
        re-runs one layer's forward from its input in each iteration, so only one
        layer's residuals are alive at a time (``cut.layer_recomputed`` lists the stacked
        residuals re-created that way). Unrolled layers are recomputed with the stage.

    Raises:
        LowerPlanError: a policy is unknown or there is not one per stage.

    Example:
        >>> remat_stages(cut, ("none", "selective"))  # doctest: +SKIP
        LowerPlanError: stage remat 'selective' is not available per pipeline stage ...
    """
    policies = tuple(policies) or ("none",) * cut.num_stages
    if len(policies) != cut.num_stages:
        raise LowerPlanError(
            f"{len(policies)} stage remat policies for {cut.num_stages} stages; give one per "
            f"stage (chunk when interleaved): {STAGE_REMAT_POLICIES}"
        )
    for s, pol in enumerate(policies):
        if pol not in STAGE_REMAT_POLICIES:
            raise LowerPlanError(
                f"stage {s}: remat {pol!r} is not available per pipeline stage; use one of "
                f"{STAGE_REMAT_POLICIES} (selective recomputation runs without pipelining)"
            )
    pieces = list(cut.pieces)
    local = dict(cut.local_avals)
    per_layer: dict[Var, int] = dict(cut.layer_recomputed or {})
    invar_index = {v: i for i, v in enumerate(cut.jaxpr.jaxpr.invars)}
    constvars = set(cut.jaxpr.jaxpr.constvars)
    for s, pol in enumerate(policies):
        if pol != "full":
            continue
        fwd, bwd = cut.forward(s), cut.backward(s)
        f_eqns, b_eqns = list(fwd.eqns), list(bwd.eqns)
        dropped: set[Var] = set()
        held: list[Var] = []  # stacked layer inputs, stashed
        extra_reads: list[Var] = []  # what the rewritten backward scans read
        for ls in _layer_scans(fwd, bwd):
            new_f, new_b, h = _per_layer(f_eqns[ls.f], b_eqns[ls.b], ls.residuals)
            f_eqns[ls.f], b_eqns[ls.b] = new_f, new_b
            # slots of the stage's slice (an uneven split's stage may run fewer layers)
            n = int(cut.aval(next(iter(ls.residuals))).shape[0])
            for v in h:
                local[v] = v.aval.update(shape=(n, *v.aval.shape[1:]))
            dropped |= ls.residuals
            per_layer.update(dict.fromkeys(ls.residuals, n))
            held += h
            nc, nk = new_f.params["num_consts"], new_f.params["num_carry"]
            f_reads = (*new_f.invars[:nc], *new_f.invars[nc + nk :])
            extra_reads += [a for a in f_reads if isinstance(a, Var)]
        fwd = replace(fwd, eqns=tuple(f_eqns))
        skip = frozenset(k for k, e in enumerate(f_eqns) if any(v in held for v in e.outvars))
        targets = [v for v in fwd.stash if v not in dropped]
        targets += [
            a
            for a in extra_reads
            if a not in dropped and a not in invar_index and a not in constvars
        ]
        redo = recomputed_equations(fwd, targets, skip)
        made = {v for e in redo for v in e.outvars if not isinstance(v, DropVar)}
        read = [
            a
            for e in redo
            for a in e.invars
            if isinstance(a, Var) and a not in made and a not in invar_index
        ]
        keep = dict.fromkeys(v for v in targets if v not in made)
        keep.update(dict.fromkeys(v for v in read if v not in constvars))
        keep.update(dict.fromkeys(held))
        stash = tuple(keep)
        inputs = set(bwd.inputs) | {
            invar_index[a]
            for e in (*redo, *b_eqns)
            for a in e.invars
            if isinstance(a, Var) and a in invar_index
        }
        f_pos, b_pos = fwd.position, bwd.position
        pieces[f_pos] = replace(fwd, stash=stash)
        pieces[b_pos] = replace(
            bwd, stash=stash, eqns=redo + tuple(b_eqns), inputs=tuple(sorted(inputs))
        )
    return replace(cut, pieces=tuple(pieces), local_avals=local, layer_recomputed=per_layer or None)
