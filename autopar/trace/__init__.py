"""Trace a JAX function into a :class:`Graph`: nodes = equations, edges = tensors.

``trace(fn, *args, **kwargs)`` runs ``jax.make_jaxpr`` (abstract arguments allocate
nothing), inlines call-like equations (:func:`inline_jaxpr`), and records per node the
shapes, FLOPs, bytes, name stack, phase and layer; inputs get paths and roles.
:func:`evaluate_inlined` re-runs the inlined jaxpr with a hook after every equation (loop
bodies included), which is how the lowering inserts sharding constraints.

Example:
    >>> import jax, jax.numpy as jnp
    >>> g = trace(lambda x: jnp.sin(x) * 2, jax.ShapeDtypeStruct((4,), jnp.float32))
    >>> len(g), g.total_flops
    (2, 8.0)
"""

import sys
import types

from autopar.trace.api import graph_from_jaxpr, trace
from autopar.trace.evaluate import Hook, as_function, evaluate_inlined, hooked_body
from autopar.trace.graph import (
    Graph,
    GraphInput,
    GraphOutput,
    InputRole,
    Layer,
    Node,
    Phase,
    TensorInfo,
)
from autopar.trace.inline import inline_jaxpr

__all__ = [
    "Graph",
    "GraphInput",
    "GraphOutput",
    "Hook",
    "InputRole",
    "Layer",
    "Node",
    "Phase",
    "TensorInfo",
    "as_function",
    "evaluate_inlined",
    "graph_from_jaxpr",
    "hooked_body",
    "inline_jaxpr",
    "trace",
]


class _CallableModule(types.ModuleType):
    """Makes ``autopar.trace(fn, *args)`` work whether ``autopar.trace`` names this package
    or the function: Python rebinds a package attribute to the submodule when a submodule
    is imported later, so the package itself forwards calls to :func:`trace`."""

    def __call__(self, fn, *args, **kwargs):
        return trace(fn, *args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
