"""Flatten call-like equations into one jaxpr, keeping loops and conditionals composite.

``jax.make_jaxpr`` of a train step nests ``jit`` calls (``jnp.where``, ``jnp.take``, ...),
custom-derivative calls and ``jax.checkpoint`` regions. The search and the lowering want one
flat list of equations, so :func:`inline_jaxpr` splices every such call into its caller and
keeps ``scan``, ``while`` and ``cond`` as single composite equations whose bodies are inlined
the same way, recursively.

The result computes the same function as the input (custom derivative rules and remat
policies are dropped: they matter only if the jaxpr is differentiated again, and the
lowering applies its own remat). Name stacks of spliced equations get the call site's name
stack prepended, so ``transpose(jvp(GPT))/wte`` reaches the scatter-add inside ``_take``.
Loop bodies keep names relative to the loop equation, as JAX does.
"""

from __future__ import annotations

from typing import Any

from jax.extend.core import ClosedJaxpr, DropVar, Jaxpr, Literal, Var, new_jaxpr_eqn

from autopar._compat import (
    COMPOSITE_BODY_PARAMS,
    INLINED_PRIMITIVES,
    call_body,
    with_name_prefix,
)


def inline_jaxpr(closed: ClosedJaxpr) -> ClosedJaxpr:
    """Splice ``jit``/``closed_call``/custom-derivative/``checkpoint`` calls into their callers.

    ``scan``/``while``/``cond`` stay single equations; their bodies are inlined too.
    Constants of inlined calls become constants of the enclosing (closed) jaxpr.

    Args:
        closed: a closed jaxpr, e.g. from ``jax.make_jaxpr``.

    Returns:
        A new closed jaxpr with the same inputs, outputs and semantics.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> f = jax.jit(lambda x: x + 1)
        >>> c = inline_jaxpr(jax.make_jaxpr(lambda x: f(x) * 2)(1.0))
        >>> [e.primitive.name for e in c.jaxpr.eqns]
        ['add', 'mul']
    """
    return _Inliner().closed(closed)


class _Inliner:
    def __init__(self) -> None:
        # id(original body) -> (original, inlined): a body shared by several loops is
        # inlined once (the original is kept alive so its id cannot be reused).
        self._cache: dict[int, tuple[Any, ClosedJaxpr]] = {}

    def closed(self, closed: ClosedJaxpr) -> ClosedJaxpr:
        hit = self._cache.get(id(closed))
        if hit is not None:
            return hit[1]
        jaxpr = closed.jaxpr
        env: dict[Any, Any] = {}
        constvars: list[Var] = []
        constvals: list[Any] = []
        for v, c in zip(jaxpr.constvars, closed.consts, strict=True):
            nv = Var(v.aval)
            env[v] = nv
            constvars.append(nv)
            constvals.append(c)
        invars = [Var(v.aval) for v in jaxpr.invars]
        env.update(zip(jaxpr.invars, invars, strict=True))
        eqns: list[Any] = []
        self._splice(jaxpr, env, eqns, constvars, constvals, None)
        outvars = [_read(env, v) for v in jaxpr.outvars]
        new = Jaxpr(constvars, invars, outvars, eqns, jaxpr.effects, jaxpr.debug_info)
        result = ClosedJaxpr(new, constvals)
        self._cache[id(closed)] = (closed, result)
        return result

    def _splice(
        self,
        jaxpr: Jaxpr,
        env: dict[Any, Any],
        eqns: list[Any],
        constvars: list[Var],
        constvals: list[Any],
        prefix: Any,
    ) -> None:
        for eqn in jaxpr.eqns:
            source_info = with_name_prefix(eqn.source_info, prefix)
            name = eqn.primitive.name
            if name in INLINED_PRIMITIVES:
                inner, consts = call_body(eqn)
                inner_env: dict[Any, Any] = {}
                for v, c in zip(inner.constvars, consts, strict=True):
                    nv = Var(v.aval)
                    constvars.append(nv)
                    constvals.append(c)
                    inner_env[v] = nv
                for v, a in zip(inner.invars, eqn.invars, strict=True):
                    inner_env[v] = _read(env, a)
                self._splice(inner, inner_env, eqns, constvars, constvals, source_info.name_stack)
                for ov, iv in zip(eqn.outvars, inner.outvars, strict=True):
                    if not isinstance(ov, DropVar):
                        env[ov] = _read(inner_env, iv)
                continue
            params = eqn.params
            if name in COMPOSITE_BODY_PARAMS:
                params = self._inline_bodies(name, params)
            invars = [_read(env, a) for a in eqn.invars]
            outvars = []
            for v in eqn.outvars:
                if isinstance(v, DropVar):
                    outvars.append(DropVar(v.aval))
                else:
                    nv = Var(v.aval)
                    env[v] = nv
                    outvars.append(nv)
            eqns.append(
                new_jaxpr_eqn(
                    invars, outvars, eqn.primitive, params, eqn.effects, source_info, eqn.ctx
                )
            )

    def _inline_bodies(self, name: str, params: dict[str, Any]) -> dict[str, Any]:
        new = dict(params)
        for key in COMPOSITE_BODY_PARAMS[name]:
            value = params[key]
            if isinstance(value, tuple | list):
                new[key] = type(value)(self._body(b) for b in value)
            else:
                new[key] = self._body(value)
        return new

    def _body(self, body: Any) -> Any:
        if isinstance(body, ClosedJaxpr):
            return self.closed(body)
        # An open jaxpr parameter stays open (no constants can appear: calls inside it
        # that had constants would need a closed body to hold them).
        closed = self.closed(ClosedJaxpr(body, []))
        if closed.consts:  # pragma: no cover - not produced by JAX 0.10's loops
            raise ValueError("inlining added constants to an open loop body")
        return closed.jaxpr


def _read(env: dict[Any, Any], atom: Any) -> Any:
    return atom if isinstance(atom, Literal) else env[atom]
