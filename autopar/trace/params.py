"""JSON-friendly views of equation parameters (what the search and reports read).

Numbers, strings, booleans and ``None`` pass through; tuples become lists; dtypes and enums
become strings; jaxprs, functions, meshes and shardings are dropped (``Node.params`` is for
cost and sharding decisions, the real parameters stay on ``graph.jaxpr``). A few structured
parameters get explicit layouts:

* ``dot_general``: ``dimension_numbers = [[lhs_contracting, rhs_contracting],
  [lhs_batch, rhs_batch]]`` (lists of ints).
* ``conv_general_dilated``: ``dimension_numbers = {"lhs_spec", "rhs_spec", "out_spec"}``
  (dimension indices: batch/feature/spatial for lhs and out, out-feature/in-feature/spatial
  for the kernel), ``padding`` as ``[[lo, hi], ...]``.
* ``gather``/``scatter*``: ``dimension_numbers`` as the JAX string form, ``mode`` as a string.
* ``scan``: ``length``, ``num_consts``, ``num_carry``, ``reverse``, ``unroll``, ``linear``;
  ``while``: ``cond_nconsts``, ``body_nconsts``; ``cond``: ``num_branches``.
"""

from __future__ import annotations

import enum
from typing import Any

import numpy as np

_SCALARS = (bool, int, float, str, type(None))
_DROP = frozenset({"jaxpr", "branches", "cond_jaxpr", "body_jaxpr", "update_jaxpr", "call_jaxpr"})


def to_json_value(value: Any) -> tuple[bool, Any]:
    """``(ok, converted)``: a JSON-friendly version of a parameter value, if there is one.

    Example:
        >>> to_json_value((1, 2))
        (True, [1, 2])
        >>> to_json_value(np.dtype("float32"))
        (True, 'float32')
    """
    if isinstance(value, _SCALARS):
        return True, value
    if isinstance(value, np.integer):
        return True, int(value)
    if isinstance(value, np.floating):
        return True, float(value)
    if isinstance(value, np.dtype):
        return True, str(value)
    if isinstance(value, type) and issubclass(value, np.generic):
        return True, np.dtype(value).name
    if isinstance(value, enum.Enum):
        return True, value.name
    if isinstance(value, tuple | list):
        out = []
        for v in value:
            ok, c = to_json_value(v)
            if not ok:
                return False, None
            out.append(c)
        return True, out
    dtype = getattr(value, "dtype", None)  # JAX's extended dtypes (e.g. Int32DType)
    if type(value).__name__.endswith("DType") and dtype is not None:
        return True, str(np.dtype(dtype))
    return False, None


def json_params(primitive: str, params: dict[str, Any]) -> dict[str, Any]:
    """The JSON-friendly subset of ``params`` for an equation of ``primitive``.

    Example:
        >>> json_params("transpose", {"permutation": (1, 0)})
        {'permutation': [1, 0]}
    """
    out: dict[str, Any] = {}
    for key, value in params.items():
        if key in _DROP:
            continue
        if key == "dimension_numbers":
            out[key] = _dimension_numbers(primitive, value)
            continue
        if key == "padding" and primitive == "conv_general_dilated" and not isinstance(value, str):
            out[key] = [list(map(int, p)) for p in value]
            continue
        ok, converted = to_json_value(value)
        if ok:
            out[key] = converted
        elif key in ("mode", "precision", "preferred_element_type", "new_dtype"):
            out[key] = str(value)
    if primitive == "cond":
        out["num_branches"] = len(params.get("branches", ()))
    return out


def _dimension_numbers(primitive: str, dn: Any) -> Any:
    if primitive == "dot_general":
        (lc, rc), (lb, rb) = dn
        return [[list(map(int, lc)), list(map(int, rc))], [list(map(int, lb)), list(map(int, rb))]]
    if primitive == "conv_general_dilated":
        return {
            "lhs_spec": list(map(int, dn.lhs_spec)),
            "rhs_spec": list(map(int, dn.rhs_spec)),
            "out_spec": list(map(int, dn.out_spec)),
        }
    return str(dn)
