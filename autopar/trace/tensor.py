"""Shape and dtype of one tensor: the leaf type every other module of the trace uses.

It imports nothing from autopar, so :mod:`autopar.trace.flops` (per-equation costs) and
:mod:`autopar.trace.graph` (the graph, which reports FLOPs) both build on it one way.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np

__all__ = ["KEY_IMPLS", "TensorInfo", "itemsize"]

_ITEMSIZE: dict[str, int] = {"bool": 1, "float0": 1}
KEY_IMPLS: dict[str, tuple[str, int]] = {
    "key<fry>": ("threefry2x32", 2),
    "key<rbg>": ("rbg", 4),
    "key<urbg>": ("unsafe_rbg", 4),
}
"""JAX's built-in typed PRNG key dtypes, by name: (implementation, uint32 words of data)."""


@functools.cache
def itemsize(dtype: object) -> int:
    """Bytes per element of ``dtype`` (a name, a numpy dtype or a JAX one), typed PRNG
    keys included (their key data: two uint32 words for threefry). Memoised: the search
    asks it for every reshard it prices.

    Example:
        >>> import jax
        >>> itemsize("bfloat16"), itemsize(jax.numpy.bfloat16), itemsize(jax.random.key(0).dtype)
        (2, 2, 8)
    """
    if isinstance(dtype, str):
        name = dtype
    else:
        try:
            name = np.dtype(dtype).name  # numpy's, and ml_dtypes' (bfloat16, float8_*)
        except TypeError:
            name = str(dtype)  # JAX extended dtypes: "key<fry>"
    return _ITEMSIZE.get(name) or _itemsize(name)


def _itemsize(dtype: str) -> int:
    try:
        return np.dtype(dtype).itemsize
    except TypeError:
        pass
    try:  # bfloat16, float8_*: numpy knows them once ml_dtypes is imported
        import ml_dtypes  # noqa: F401

        return np.dtype(dtype).itemsize
    except (ImportError, TypeError):
        # Other extended dtypes (a key of an implementation outside JAX's, tokens):
        # a key as one threefry key; opaque values hold no data worth counting.
        return 4 * KEY_IMPLS.get(dtype, ("", 2))[1] if dtype.startswith("key<") else 0


@dataclass(frozen=True)
class TensorInfo:
    """Shape and dtype of one tensor (an abstract value).

    Example:
        >>> TensorInfo((8, 1024), "bfloat16").nbytes
        16384
    """

    shape: tuple[int, ...]
    dtype: str

    @functools.cached_property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def itemsize(self) -> int:
        return itemsize(self.dtype)

    @functools.cached_property
    def nbytes(self) -> int:
        return self.size * self.itemsize

    @property
    def ndim(self) -> int:
        return len(self.shape)
