"""``trace(fn, *args, **kwargs) -> Graph``: the tracer's entry point."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from autopar.errors import TraceFunctionError
from autopar.gc_pause import gc_paused
from autopar.trace.accumulate import annotate_accumulation, find_accumulations
from autopar.trace.build import make_node, scan_jaxpr
from autopar.trace.graph import Graph, GraphInput, GraphOutput
from autopar.trace.inline import inline_jaxpr
from autopar.trace.layers import find_layers
from autopar.trace.phases import assign_phases, backward_tainted
from autopar.trace.roles import (
    assign_roles,
    input_paths,
    key_name,
    match_updates,
    output_paths,
    path_str,
    positional_names,
)


def trace(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Graph:
    """Trace ``fn(*args, **kwargs)`` into a :class:`Graph` without running it.

    Arguments may be concrete arrays or abstract (``jax.ShapeDtypeStruct``, e.g. from
    ``jax.eval_shape``), in any pytree; abstract ones allocate nothing, so a 175B model
    traces on a laptop. The graph holds the *inlined* jaxpr (``graph.jaxpr``; node ``k`` is
    its equation ``k``), per-node shapes, FLOPs, bytes, name stacks, phases and layers, and
    the inputs tied back to their paths and roles.

    Args:
        fn: the function to trace, e.g. ``step_fn(state, batch) -> (new_state, loss)``.
        *args: positional arguments (pytrees of arrays / ``ShapeDtypeStruct`` / scalars).
        **kwargs: keyword arguments (same kinds).

    Returns:
        The traced :class:`Graph`.

    Raises:
        TraceFunctionError: ``fn`` is not callable, an argument leaf is not an array-like,
            or ``fn`` failed while tracing (the original exception is chained).

    Example:
        >>> import jax, jax.numpy as jnp
        >>> g = trace(lambda w, x: jnp.tanh(x @ w).sum(),
        ...           jax.ShapeDtypeStruct((4, 8), jnp.float32), jnp.ones((2, 4)))
        >>> [n.primitive for n in g], g.total_flops
        (['dot_general', 'tanh', 'reduce_sum'], 160.0)
    """
    if not callable(fn):
        raise TraceFunctionError(
            f"trace() needs a callable as its first argument, got {type(fn).__name__}: "
            f"pass the step function, then its arguments: trace(step_fn, state, batch)"
        )
    check_arguments(fn, args, kwargs)
    # Tracing allocates ~10^5 small objects and frees none of them until it returns; the
    # cyclic garbage collector's passes over them cost 40% of the trace time, for nothing.
    with gc_paused():
        try:
            closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - any failure of user code while tracing
            name = getattr(fn, "__qualname__", getattr(fn, "__name__", repr(fn)))
            raise TraceFunctionError(
                f"tracing {name} failed with {type(e).__name__}: {e}. Check that it runs "
                f"under jax.jit with these argument shapes (jax.eval_shape(fn, *args) "
                f"reproduces it)."
            ) from e
        return graph_from_jaxpr(closed, out_shape, fn=fn, args=args, kwargs=kwargs)


def graph_from_jaxpr(
    closed: Any,
    out_shape: Any,
    *,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    input_roles: Sequence[str] | None = None,
) -> Graph:
    """Build the :class:`Graph` of an already traced ``jax.make_jaxpr(fn)(*args, **kwargs)``.

    ``input_roles`` (one per flat input) replaces the roles the data flow would give: a piece of
    a step (its gradient computation alone, :mod:`autopar.lower.split`) keeps the roles
    its inputs have in the whole step."""
    inlined = inline_jaxpr(closed)
    raw = scan_jaxpr(inlined)
    in_tree = jax.tree_util.tree_structure((tuple(args), dict(kwargs)))
    out_tree = jax.tree_util.tree_structure(out_shape)

    in_paths = input_paths(fn, args, kwargs)
    if len(in_paths) != len(raw.invars):  # pragma: no cover - make_jaxpr flattens the same way
        raise TraceFunctionError(
            f"{len(in_paths)} argument leaves but the jaxpr has {len(raw.invars)} inputs"
        )
    in_tensors = [raw.values[v] for v in raw.invars]
    out_paths = output_paths(out_shape)
    pairs = match_updates(in_paths, in_tensors, out_paths, raw.out_tensors)
    state_outputs = {raw.outvars[o] for o in pairs.values() if raw.outvars[o] >= 0}

    phases = assign_phases(raw.eqns, state_outputs)
    tainted = backward_tainted(raw.eqns, phases)
    roles = assign_roles(
        in_paths=in_paths,
        in_tensors=in_tensors,
        in_values=raw.invars,
        out_values=raw.outvars,
        out_tensors=raw.out_tensors,
        pairs=pairs,
        eqns=raw.eqns,
        phases=phases,
        tainted=tainted,
    )
    if input_roles is not None:
        roles = [(r, None) for r in input_roles]
    inputs = [
        GraphInput(i, vid, path_str(in_paths[i]), in_tensors[i], role, out_idx)
        for i, (vid, (role, out_idx)) in enumerate(zip(raw.invars, roles, strict=True))
    ]
    outputs = [
        GraphOutput(i, vid, path_str(out_paths[i], "out"), raw.out_tensors[i])
        for i, vid in enumerate(raw.outvars)
    ]
    nodes = [make_node(r, phases[k], None, ()) for k, r in enumerate(raw.eqns)]
    accumulations = []
    for acc in find_accumulations(nodes, inputs, outputs):
        # A loop running the model once per microbatch: its body gets the roles and layers
        # the top level of an unrolled step would have (autopar.trace.accumulate).
        body, acc = annotate_accumulation(nodes[acc.node], acc, inputs)
        object.__setattr__(nodes[acc.node], "body", (body, *nodes[acc.node].body[1:]))
        accumulations.append(acc)
    layers, node_layer = find_layers(nodes, inputs, outputs)
    for nid, k in node_layer.items():
        # The nodes are not shared yet: fill in the field the frozen dataclass left empty
        # (dataclasses.replace on ~10^4 nodes costs a noticeable share of the trace time).
        object.__setattr__(nodes[nid], "layer", k)
    return Graph(
        nodes, raw.values, inputs, outputs, layers, jaxpr=inlined, in_tree=in_tree,
        out_tree=out_tree, consts=tuple(raw.constvars), accumulations=accumulations,
    )  # fmt: skip


def check_arguments(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Raise :class:`TraceFunctionError` naming the first argument leaf that is not an
    array-like (a string, an arbitrary object, ...), with its path and what to do.

    ``None`` leaves are empty subtrees (legal, as in ``jax.jit``); arrays, NumPy scalars,
    ``jax.ShapeDtypeStruct``, Python numbers and typed PRNG keys are accepted.

    Example:
        >>> check_arguments(lambda w, x: x, ("weights", np.ones(2)), {})
        Traceback (most recent call last):
        ...
        autopar.errors.TraceFunctionError: argument leaf w is of type str ('weights'); ...
    """
    leaves, _ = jax.tree_util.tree_flatten_with_path((args, kwargs))
    for kp, leaf in leaves:
        if isinstance(leaf, jax.Array | np.ndarray | np.generic | jax.ShapeDtypeStruct):
            continue
        if isinstance(leaf, bool | int | float | complex):
            continue
        if hasattr(leaf, "shape") and hasattr(leaf, "dtype"):
            continue  # array-likes JAX can abstractify
        keys = [key_name(k) for k in kp[2:]]
        head = (
            positional_names(fn, len(args))[int(key_name(kp[1]))]
            if key_name(kp[0]) == "0"
            else key_name(kp[1])
        )
        where = "/".join([head, *keys])
        raise TraceFunctionError(
            f"argument leaf {where} is of type {type(leaf).__name__} ({leaf!r:.60}); a step takes "
            f"pytrees of arrays, jax.ShapeDtypeStruct or Python scalars. Pass it as an array "
            f"(jnp.asarray), mark its argument static (static_argnums / static_argnames), or "
            f"close over it (functools.partial)."
        )
