"""Re-run a (traced, inlined) jaxpr equation by equation, with a hook on equation outputs.

The lowering inserts ``with_sharding_constraint`` at planned points by re-interpreting the
jaxpr the search saw: node ``k`` of a :class:`~autopar.trace.graph.Graph` is equation ``k``
of ``graph.jaxpr`` (the *inlined* closed jaxpr), and an
:class:`~autopar.plan.ActivationConstraint` addresses a value inside a loop body with a
``scope`` of ``(node, body_index)`` pairs. Body ``b`` of a node is the ``b``-th jaxpr of
``jax.extend.core.jaxprs_in_params(eqn.params)`` (``scan``: 0 = the body; ``while``:
``cond_jaxpr`` / ``body_jaxpr`` in parameter order; ``cond``: the branches).

This module also has :func:`inline_jaxpr`, which flattens ``jit``/``closed_call``/
custom-derivative/``checkpoint`` calls (loop bodies too) the way the tracer does, so tests and
callers without a traced graph can address equations the same way.

Example:
    >>> closed = inline_jaxpr(jax.make_jaxpr(lambda x: jnp.sin(x) * 2)(1.0))
    >>> evaluate(closed, [1.0], hook=lambda scope, k, outs: outs)   # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.extend.core import ClosedJaxpr, DropVar, Jaxpr, Literal, jaxprs_in_params

Scope = tuple[tuple[int, int], ...]
# hook(scope, eqn_index, outputs) -> outputs (same length, same avals)
Hook = Callable[[Scope, int, list[Any]], list[Any]]

# Call-like primitives whose body is evaluated in place (the tracer inlines the same ones).
_INLINED = frozenset(
    {
        "jit",
        "pjit",
        "closed_call",
        "core_call",
        "custom_jvp_call",
        "custom_vjp_call",
        "custom_vjp_call_jaxpr",
        "checkpoint",
        "remat",
    }
)
# Primitives with bodies that stay composite; their bodies are rewritten when needed.
_BODY_PARAMS: dict[str, tuple[str, ...]] = {
    "scan": ("jaxpr",),
    "while": ("cond_jaxpr", "body_jaxpr"),
    "cond": ("branches",),
}


def _closed(j: Jaxpr | ClosedJaxpr) -> ClosedJaxpr:
    return j if isinstance(j, ClosedJaxpr) else ClosedJaxpr(j, [])


def body_jaxprs(eqn: Any) -> list[ClosedJaxpr]:
    """The nested jaxprs of a composite equation, in ``jaxprs_in_params`` order."""
    return [_closed(j) for j in jaxprs_in_params(eqn.params)]


def _body_slots(eqn) -> list[tuple[str, int | None]]:
    """``(param name, index in a tuple param or None)`` for each body, matching
    :func:`_bodies`' order (``jaxprs_in_params`` walks the params dict in order)."""
    slots: list[tuple[str, int | None]] = []
    for name, value in eqn.params.items():
        if isinstance(value, Jaxpr | ClosedJaxpr):
            slots.append((name, None))
        elif isinstance(value, tuple | list):
            for i, v in enumerate(value):
                if isinstance(v, Jaxpr | ClosedJaxpr):
                    slots.append((name, i))
    return slots


def _replace_bodies(eqn, new_bodies: dict[int, ClosedJaxpr]) -> dict[str, Any]:
    """``eqn.params`` with body ``b`` replaced by ``new_bodies[b]`` (kept closed/open)."""
    params = dict(eqn.params)
    for b, (name, idx) in enumerate(_body_slots(eqn)):
        if b not in new_bodies:
            continue
        new = new_bodies[b]
        old = eqn.params[name] if idx is None else eqn.params[name][idx]
        if isinstance(old, Jaxpr):
            if new.consts:
                raise ValueError(f"cannot put a body with constants into open jaxpr {name!r}")
            new = new.jaxpr
        if idx is None:
            params[name] = new
        else:
            seq = list(params[name])
            seq[idx] = new
            params[name] = type(eqn.params[name])(seq)
    return params


def _retrace(body: ClosedJaxpr, run: Callable[[Sequence[Any]], list[Any]]) -> ClosedJaxpr:
    """A new closed jaxpr with ``body``'s signature whose equations are what ``run`` binds."""
    avals = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in body.jaxpr.invars]
    new = jax.make_jaxpr(lambda *xs: run(xs))(*avals)
    if [v.aval for v in new.jaxpr.outvars] != [v.aval for v in body.jaxpr.outvars]:
        raise ValueError("re-traced body changed its output types")
    return new


def evaluate(
    closed: ClosedJaxpr,
    args: Sequence[Any],
    hook: Hook | None = None,
    scope: Scope = (),
    *,
    wants_scope: Callable[[Scope], bool] | None = None,
    inline: bool = False,
    body_of: Callable[[Scope], ClosedJaxpr | None] | None = None,
) -> list[Any]:
    """Evaluate ``closed`` on ``args`` (arrays or tracers), calling ``hook`` after each eqn.

    Args:
        closed: the (inlined) closed jaxpr.
        args: one value per ``closed.jaxpr.invars``.
        hook: ``hook(scope, k, outs) -> outs`` for equation ``k`` of the jaxpr at ``scope``.
        scope: where ``closed`` sits (``()`` = top level).
        wants_scope: ``wants_scope(scope + ((k, b),))`` is true when the hook has something
            to do inside body ``b`` of equation ``k``; that body is then re-traced through
            this interpreter. Default: never.
        inline: evaluate call-like primitives (``jit``, ``custom_jvp_call``, ...) in place,
            and re-trace every loop body, so that tracing this function gives the inlined
            jaxpr (see :func:`inline_jaxpr`).
        body_of: ``body_of(scope)`` may return the jaxpr to run for a body scope (the
            tracer's inlined body graph); default: the body from the equation's params.

    Returns:
        The values of ``closed.jaxpr.outvars``.
    """
    jaxpr = closed.jaxpr
    env: dict[Any, Any] = {}

    def read(v: Any) -> Any:
        return v.val if isinstance(v, Literal) else env[v]

    for v, c in zip(jaxpr.constvars, closed.consts, strict=True):
        env[v] = c
    if len(args) != len(jaxpr.invars):
        raise ValueError(f"jaxpr takes {len(jaxpr.invars)} arguments, got {len(args)}")
    for v, a in zip(jaxpr.invars, args, strict=True):
        env[v] = a
    for k, eqn in enumerate(jaxpr.eqns):
        invals = [read(v) for v in eqn.invars]
        name = eqn.primitive.name
        if inline and name in _INLINED:
            (sub,) = body_jaxprs(eqn)[:1]
            outs = evaluate(sub, invals, None, (), inline=True)
        else:
            params = eqn.params
            if name in _BODY_PARAMS:
                new_bodies: dict[int, ClosedJaxpr] = {}
                for b, body in enumerate(body_jaxprs(eqn)):
                    inner = scope + ((k, b),)
                    if not (inline or (wants_scope is not None and wants_scope(inner))):
                        continue
                    run_body = body
                    if body_of is not None:
                        run_body = body_of(inner) or body

                    def run(xs, run_body=run_body, inner=inner):
                        return evaluate(
                            run_body,
                            list(xs),
                            hook,
                            inner,
                            wants_scope=wants_scope,
                            inline=inline,
                            body_of=body_of,
                        )

                    new_bodies[b] = _retrace(body, run)
                if new_bodies:
                    params = _replace_bodies(eqn, new_bodies)
            bind_params = eqn.primitive.get_bind_params(params)
            with eqn.ctx.manager:
                outs = eqn.primitive.bind(*invals, **bind_params)
            outs = list(outs) if eqn.primitive.multiple_results else [outs]
        if hook is not None:
            outs = list(hook(scope, k, outs))
        for v, o in zip(eqn.outvars, outs, strict=True):
            if not isinstance(v, DropVar):
                env[v] = o
    return [read(v) for v in jaxpr.outvars]


def inline_jaxpr(closed: ClosedJaxpr) -> ClosedJaxpr:
    """Flatten call-like equations (``jit``, ``closed_call``, custom derivatives,
    ``checkpoint``) into their callers, loop bodies included.

    Example:
        >>> f = jax.jit(lambda x: x + 1)
        >>> c = inline_jaxpr(jax.make_jaxpr(lambda x: f(x) * 2)(1.0))
        >>> [e.primitive.name for e in c.jaxpr.eqns]
        ['add', 'mul']
    """
    avals = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in closed.jaxpr.invars]
    return jax.make_jaxpr(lambda *xs: evaluate(closed, list(xs), inline=True))(*avals)
