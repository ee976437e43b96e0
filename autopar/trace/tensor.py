"""Shape and dtype of one tensor: the leaf type every other module of the trace uses.

It imports nothing from autopar, so :mod:`autopar.trace.flops` (per-equation costs) and
:mod:`autopar.trace.graph` (the graph, which reports FLOPs) both build on it one way.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np

__all__ = ["TensorInfo"]

_ITEMSIZE: dict[str, int] = {"bool": 1, "float0": 1}


def _itemsize(dtype: str) -> int:
    try:
        return np.dtype(dtype).itemsize
    except TypeError:
        pass
    try:  # bfloat16, float8_*: numpy knows them once ml_dtypes is imported
        import ml_dtypes  # noqa: F401

        return np.dtype(dtype).itemsize
    except (ImportError, TypeError):
        # JAX extended dtypes: typed PRNG keys ("key<fry>") hold two uint32 words;
        # tokens and other opaque values hold no data worth counting.
        return 8 if dtype.startswith("key<") else 0


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
        size = _ITEMSIZE.get(self.dtype)
        if size is None:
            size = _ITEMSIZE[self.dtype] = _itemsize(self.dtype)
        return size

    @functools.cached_property
    def nbytes(self) -> int:
        return self.size * self.itemsize

    @property
    def ndim(self) -> int:
        return len(self.shape)
