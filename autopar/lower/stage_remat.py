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

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from jax.extend.core import DropVar, Var

from autopar.errors import LowerPlanError
from autopar.lower.stages import Piece, StageCut

__all__ = ["STAGE_REMAT_POLICIES", "remat_stages", "recomputed_equations"]

STAGE_REMAT_POLICIES: tuple[str, ...] = ("none", "full")


def recomputed_equations(forward: Piece) -> tuple[Any, ...]:
    """The equations of ``forward`` its backward piece re-runs under ``"full"``: those that
    make a stashed value, with everything they read from the piece, in program order."""
    made: dict[Var, int] = {}
    for k, e in enumerate(forward.eqns):
        for v in e.outvars:
            if not isinstance(v, DropVar):
                made[v] = k
    need: set[int] = set()
    todo = [made[v] for v in forward.stash if v in made]
    while todo:
        k = todo.pop()
        if k in need:
            continue
        need.add(k)
        todo.extend(made[a] for a in forward.eqns[k].invars if isinstance(a, Var) and a in made)
    return tuple(forward.eqns[k] for k in sorted(need))


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
        :func:`recomputed_equations`.

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
    invar_index = {v: i for i, v in enumerate(cut.jaxpr.jaxpr.invars)}
    for s, pol in enumerate(policies):
        if pol != "full":
            continue
        fwd, bwd = cut.forward(s), cut.backward(s)
        redo = recomputed_equations(fwd)
        made = {v for e in redo for v in e.outvars if not isinstance(v, DropVar)}
        read = [
            a
            for e in redo
            for a in e.invars
            if isinstance(a, Var) and a not in made and a not in invar_index
        ]
        keep = dict.fromkeys(v for v in fwd.stash if v not in made)
        keep.update(dict.fromkeys(v for v in read if v not in cut.jaxpr.jaxpr.constvars))
        stash = tuple(keep)
        inputs = set(bwd.inputs) | {
            invar_index[a]
            for e in redo
            for a in e.invars
            if isinstance(a, Var) and a in invar_index
        }
        f_pos, b_pos = fwd.position, bwd.position
        pieces[f_pos] = replace(fwd, stash=stash)
        pieces[b_pos] = replace(
            bwd, stash=stash, eqns=redo + tuple(bwd.eqns), inputs=tuple(sorted(inputs))
        )
    return replace(cut, pieces=tuple(pieces))
