"""Run a traced graph's inlined jaxpr equation by equation, with a hook after each one.

This is how the lowering inserts ``with_sharding_constraint`` at planned points: node
``k`` of a :class:`Graph` is equation ``k`` of ``graph.jaxpr``, so a hook that sees
``(node, outputs)`` can constrain exactly the values the search reasoned about.

Hooks inside loops: with ``into_bodies`` a ``scan``/``while``/``cond`` node is not bound
with its original body. Each body graph (``node.body[b]``) is re-traced with
``jax.make_jaxpr`` through this same interpreter, so the hook runs on the body's equations
(``node.scope`` says where they sit), and the loop is bound with the new body. Closed-over
constants of the re-traced body stay in its ``ClosedJaxpr`` (``scan``/``while``/``cond``
accept that in JAX 0.10). A hook inside a body runs at trace time of that body: it must use
only static things (shardings, meshes), never values from outside the loop.

Semantics match ``jax.core.eval_jaxpr``: each bind runs under the equation's name stack,
traceback and context, and uses ``primitive.get_bind_params``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.extend.core import ClosedJaxpr, DropVar, Jaxpr, Literal

from autopar._compat import COMPOSITE_BODY_PARAMS, eqn_context
from autopar.errors import TraceFunctionError
from autopar.trace.graph import Graph, Node

Hook = Callable[[Node, list[Any]], Sequence[Any]]
"""``hook(node, outvals) -> outvals``: same length, shapes and dtypes. A hook may also
have a ``before(node, invals) -> invals`` method, applied to an equation's inputs (as that
equation alone reads them) before it runs."""

IntoBodies = bool | Callable[[Node], bool]


def evaluate_inlined(
    graph: Graph,
    *flat_args: Any,
    hook: Hook | None = None,
    into_bodies: IntoBodies = False,
) -> list[Any]:
    """Evaluate ``graph.jaxpr`` on flat arguments, calling ``hook`` after every equation.

    Works on concrete arrays and on tracers (call it inside ``jax.jit``).

    Args:
        graph: a graph from :func:`autopar.trace.trace` (or a body graph, ``node.body[b]``).
        *flat_args: one value per ``graph.inputs`` (``jax.tree.leaves((args, kwargs))``).
        hook: ``hook(node, outvals) -> outvals`` after each equation; ``node.scope`` is
            ``()`` at top level and ``((loop_node_id, body_index), ...)`` inside bodies.
        into_bodies: also hook the equations inside loop/conditional bodies (re-tracing
            them); ``True`` for every such node, or a predicate ``into_bodies(node)``
            choosing which composite nodes (at any depth) to enter.

    Returns:
        The flat outputs (``jax.tree.unflatten(graph.out_tree, ...)`` gives the pytree).

    Raises:
        TraceFunctionError: wrong number of arguments, a hook returned the wrong number of
            values, or a re-traced body changed its output types.

    Example:
        >>> g = autopar.trace(step, state, batch)
        >>> rows = jax.NamedSharding(jax.sharding.Mesh(jax.devices(), ("data",)),
        ...                          jax.P("data"))
        >>> def hook(node, outs):  # split every matmul's result by rows
        ...     if node.primitive == "dot_general":
        ...         outs = [jax.lax.with_sharding_constraint(o, rows) for o in outs]
        ...     return outs
        >>> flat = jax.jit(lambda *xs: evaluate_inlined(g, *xs, hook=hook))(
        ...     *jax.tree.leaves((state, batch)))
        >>> new_state, loss = jax.tree.unflatten(g.out_tree, flat)
    """
    closed = graph.jaxpr
    if closed is None:
        raise TraceFunctionError("this graph has no jaxpr to evaluate")
    return _run(graph, list(flat_args), hook, into_bodies)


def as_function(
    graph: Graph, hook: Hook | None = None, into_bodies: IntoBodies = False
) -> Callable[..., Any]:
    """A function with the traced function's signature that runs :func:`evaluate_inlined`.

    ``as_function(g)(*args, **kwargs)`` equals ``fn(*args, **kwargs)`` (same pytrees in
    and out), so ``jax.jit(as_function(g, hook))`` is the step with the hook applied.

    Example:
        >>> g = autopar.trace(lambda x: jnp.sin(x) * 2, jnp.ones(3))
        >>> as_function(g)(jnp.zeros(3))
        Array([0., 0., 0.], dtype=float32)
    """

    def fn(*args: Any, **kwargs: Any) -> Any:
        flat, tree = jax.tree_util.tree_flatten((args, kwargs))
        if graph.in_tree is not None and tree != graph.in_tree:
            raise TraceFunctionError(
                f"arguments have structure {tree}, but the graph was traced with "
                f"{graph.in_tree}; trace again for these arguments"
            )
        outs = evaluate_inlined(graph, *flat, hook=hook, into_bodies=into_bodies)
        return jax.tree_util.tree_unflatten(graph.out_tree, outs) if graph.out_tree else outs

    return fn


def _enters(node: Node, into: IntoBodies) -> bool:
    return bool(node.body) and (into is True or (callable(into) and bool(into(node))))


def _run(graph: Graph, args: list[Any], hook: Hook | None, into: IntoBodies) -> list[Any]:
    closed = graph.jaxpr
    jaxpr = closed.jaxpr
    if len(args) != len(jaxpr.invars):
        raise TraceFunctionError(
            f"the graph takes {len(jaxpr.invars)} flat arguments, got {len(args)}"
        )
    env: dict[Any, Any] = {}
    for v, c in zip(jaxpr.constvars, closed.consts, strict=True):
        env[v] = c
    for v, a in zip(jaxpr.invars, args, strict=True):
        env[v] = a
    run_equations(graph, env, hook=hook, into_bodies=into)
    return [read_var(env, v) for v in jaxpr.outvars]


def read_var(env: dict[Any, Any], a: Any) -> Any:
    """The value of jaxpr atom ``a`` (a literal's value, else ``env[a]``)."""
    return a.val if isinstance(a, Literal) else env[a]


def run_equations(
    graph: Graph,
    env: dict[Any, Any],
    eqns: Sequence[int] | None = None,
    *,
    hook: Hook | None = None,
    into_bodies: IntoBodies = False,
) -> dict[Any, Any]:
    """Run some equations of ``graph.jaxpr`` (indices ``eqns``, in that order; default
    all) on ``env`` (jaxpr variable -> value), writing their results into ``env``.

    This is how a step is run in pieces: the gradient computation once per microbatch,
    the update once (:mod:`autopar.lower.split`).

    Example:
        >>> g = autopar.trace(lambda x: jnp.sin(x) * 2, jnp.ones(3))
        >>> env = {g.jaxpr.jaxpr.invars[0]: jnp.zeros(3)}
        >>> env = run_equations(g, env)
        >>> read_var(env, g.jaxpr.jaxpr.outvars[0])
        Array([0., 0., 0.], dtype=float32)
    """
    jaxpr = graph.jaxpr.jaxpr
    order = range(len(jaxpr.eqns)) if eqns is None else eqns
    for k in order:
        node, eqn = graph.nodes[k], jaxpr.eqns[k]
        invals = [read_var(env, a) for a in eqn.invars]
        params = eqn.params
        if hook is not None and _enters(node, into_bodies):
            params = _hooked_params(node, params, hook, into_bodies)
        outs = bind_equation(node, eqn, invals, params, hook)
        for v, o in zip(eqn.outvars, outs, strict=True):
            if not isinstance(v, DropVar):
                env[v] = o
    return env


def bind_equation(
    node: Node, eqn: Any, invals: Sequence[Any], params: Any, hook: Hook | None
) -> list[Any]:
    """Run one equation (with ``params``, possibly hooked bodies) on ``invals`` and pass
    its results through ``hook``; the results as a list."""
    before = getattr(hook, "before", None)
    if before is not None:
        new_in = list(before(node, list(invals)))
        if len(new_in) != len(invals):
            raise TraceFunctionError(
                f"hook.before returned {len(new_in)} values for node {node.id} "
                f"({node.primitive}), which reads {len(invals)}"
            )
        invals = new_in
    with eqn_context(eqn):
        outs = eqn.primitive.bind(*invals, **eqn.primitive.get_bind_params(params))
    outs = list(outs) if eqn.primitive.multiple_results else [outs]
    if hook is None:
        return outs
    new = list(hook(node, outs))
    if len(new) != len(outs):
        raise TraceFunctionError(
            f"hook returned {len(new)} values for node {node.id} ({node.primitive}), "
            f"which has {len(outs)} outputs"
        )
    return new


def hooked_body(body: Graph, hook: Hook, into_bodies: IntoBodies = True) -> ClosedJaxpr:
    """``body.jaxpr`` re-traced through the interpreter with ``hook`` on its equations.

    The result has the same input and output types as ``body.jaxpr``; put it in the loop
    equation's parameters in place of the original body.
    """
    old = body.jaxpr.jaxpr
    avals = [
        jax.ShapeDtypeStruct(
            v.aval.shape, v.aval.dtype, weak_type=getattr(v.aval, "weak_type", False)
        )
        for v in old.invars
    ]
    new = jax.make_jaxpr(lambda *xs: _run(body, list(xs), hook, into_bodies))(*avals)
    want = [_strip(v.aval) for v in old.outvars]
    got = [_strip(v.aval) for v in new.jaxpr.outvars]
    if want != got:
        raise TraceFunctionError(
            f"re-tracing the body at scope {body.scope} changed its output types from {want} "
            f"to {got}; a hook must return values of the same shapes and dtypes"
        )
    return new


def _strip(aval: Any) -> tuple:
    return (tuple(getattr(aval, "shape", ())), str(getattr(aval, "dtype", aval)))


def _hooked_params(
    node: Node, params: dict[str, Any], hook: Hook, into: IntoBodies
) -> dict[str, Any]:
    new_bodies = [hooked_body(b, hook, into) for b in node.body]
    out = dict(params)
    it = iter(new_bodies)
    for key in COMPOSITE_BODY_PARAMS[node.primitive]:
        value = params[key]
        if isinstance(value, tuple | list):
            out[key] = type(value)(_like(v, next(it)) for v in value)
        else:
            out[key] = _like(value, next(it))
    return out


def _like(old: Any, new: ClosedJaxpr) -> Any:
    if isinstance(old, Jaxpr):  # an open body must stay open
        if new.consts:
            raise TraceFunctionError("a re-traced open loop body closed over constants")
        return new.jaxpr
    return new
