"""Sizes of a train state's pytree, shared by the zoo's tests."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp


def count(tree) -> int:
    """Elements in all leaves (arrays or ``jax.ShapeDtypeStruct``)."""
    return sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(tree))


def nbytes(tree) -> int:
    """Bytes in all leaves at their dtypes."""
    return sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))
