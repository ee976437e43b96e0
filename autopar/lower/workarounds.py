"""Workarounds for XLA partitioner faults we measured, applied where our programs meet them.

**Gathers on a split dimension inside a partly manual ``shard_map``.** The pipeline runs
its stages in a ``jax.shard_map`` that is manual over ``pipe`` only, so the partitioner
shards the stage programs over the other (automatic) axes. If a ``gather`` indexes an
operand dimension that propagation split over one of those axes (Megatron's
vocabulary-split embedding makes the logits vocabulary-split; ``take_along_axis`` of the
labels then gathers along it), XLA 0.10's SPMD partitioner aborts the process
(``spmd_partitioner_util.cc: Check failed: partition_group_list.num_replica_groups() *
... == device_groups.num_devices_per_group()``; reproduced with a 12-line program:
``log_softmax(h @ e.T)`` with ``e`` split ``P("tensor", None)``, ``take_along_axis`` of
the labels, inside ``shard_map(..., axis_names={"pipe"})`` on a ``{pipe, data, tensor}``
mesh). The same program partitions fine outside ``shard_map``. A ``scatter-add`` into
such a dimension (the embedding's gradient, the transpose of its lookup) aborts the same
way (seen in the zoo GPT with unrolled layers and Megatron's layout inside the stages).

:func:`guard_gather` keeps the indexed dimensions of a gather's operand (and of a
scatter's operand and result) whole over the automatic axes
(``with_sharding_constraint`` to ``None`` there, ``UNCONSTRAINED`` elsewhere), which
partitions correctly; the price is an all-gather of that operand over the axes that split
it (:func:`gather_guard_dims` says which dimensions, for pricing).

Example:
    >>> import jax.numpy as jnp
    >>> g = autopar.trace(lambda x, i: jnp.take_along_axis(x, i, axis=1),
    ...                   jnp.ones((4, 8)), jnp.zeros((4, 1), jnp.int32))
    >>> gather = [e for e in g.jaxpr.eqns if e.primitive.name == "gather"][0]
    >>> gather_guard_dims(gather)
    (1,)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
from jax.sharding import PartitionSpec as P

__all__ = ["gather_guard_dims", "guard_gather", "guard_scatter_result", "splits_automatic_axes"]


def gather_guard_dims(eqn: Any) -> tuple[int, ...]:
    """Operand dimensions a ``gather`` equation indexes (its ``start_index_map``) and
    does not take whole (slice size below the dimension), else ``()``."""
    name = eqn.primitive.name
    dn = eqn.params.get("dimension_numbers")
    if name == "gather":
        shape = eqn.invars[0].aval.shape
        sizes = eqn.params["slice_sizes"]
        return tuple(sorted(d for d in dn.start_index_map if sizes[d] < shape[d]))
    if name.startswith("scatter") and dn is not None:
        return tuple(sorted(dn.scatter_dims_to_operand_dims))
    return ()


def splits_automatic_axes() -> bool:
    """Whether the current (abstract) mesh has an automatic axis of more than 1 device
    beside manual ones: where the fault can happen."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return False
    types = dict(zip(mesh.axis_names, mesh.axis_types, strict=True))
    auto = [a for a, t in types.items() if t == jax.sharding.AxisType.Auto and mesh.shape[a] > 1]
    manual = [a for a, t in types.items() if t == jax.sharding.AxisType.Manual]
    return bool(auto) and bool(manual)


def guard_gather(eqn: Any, invals: Sequence[Any]) -> list[Any]:
    """``invals`` of ``eqn`` with a gather's indexed operand dimensions kept whole over
    the automatic mesh axes (a no-op for other equations and outside a partly manual
    ``shard_map``)."""
    dims = gather_guard_dims(eqn)
    if not dims or not splits_automatic_axes():
        return list(invals)
    return [_whole(invals[0], dims), *invals[1:]]


def guard_scatter_result(eqn: Any, outs: Sequence[Any]) -> list[Any]:
    """A scatter's results kept whole on the dimensions it indexes (so propagation does
    not split the scatter itself from its readers); other equations pass through."""
    dims = gather_guard_dims(eqn)
    if not dims or not eqn.primitive.name.startswith("scatter") or not splits_automatic_axes():
        return list(outs)
    return [_whole(o, dims) for o in outs]


def _whole(x: Any, dims: Sequence[int]) -> Any:
    spec = P(*(None if d in dims else P.UNCONSTRAINED for d in range(x.ndim)))
    return jax.lax.with_sharding_constraint(x, spec)
