"""FLOPs and bytes of one (non-composite) equation.

Counting rules (one execution of the equation; loops are scaled by the graph builder); a
primitive's rule is its family's ``flops`` column in :mod:`autopar.primitives`:

* ``dot_general``: ``2 * prod(out.shape) * prod(lhs.shape[c] for c in lhs_contracting)``
  (one multiply and one add per term), exact.
* ``conv_general_dilated``: ``2 * prod(out.shape) * (in_features / feature_groups) *
  prod(kernel spatial)``, where ``in_features / feature_groups`` is the kernel's input
  feature dimension. Exact for ordinary convolutions; like XLA's own count it includes the
  taps that land on zeros of a dilated input (input gradients of strided convolutions).
* Elementwise arithmetic, comparisons, ``select_n`` and transcendentals (``exp``, ``log``,
  ``tanh``, ``erf``, ``rsqrt``, ``logistic``, ...): 1 per output element. A transcendental
  costs several hardware operations, but counting 1 keeps the totals comparable with the
  usual "model FLOPs" and with XLA's ``cost_analysis()['flops']``; transcendental throughput
  belongs in the cost model.
* Reductions (``reduce_*``, ``argmax``/``argmin``, ``cumsum`` and friends): 1 per input
  element. ``reduce_window_*``: ``prod(out) * prod(window)``. Scatter with a combiner
  (``scatter-add``, ``scatter_mul``, ...): 1 per update element. ``sort``:
  ``prod(shape) * ceil(log2(n))``. ``cholesky``: ``n^3 / 3`` per matrix;
  ``triangular_solve``: ``m^2 n`` per batch.
* Data movement (reshape, transpose, broadcast, slices, gather, concatenate, pad, casts,
  iota, copies, sharding constraints): 0.
* Unknown primitives: 0 (listed by :func:`is_counted` so a summary can flag them).

Bytes: ``bytes_in`` sums the operands that are variables (literals are free), ``bytes_out``
the results; ``gather``/``dynamic_slice`` read only the slice they return (plus indices);
scatters and ``dynamic_update_slice`` update in place, so they read and write the updated
region (plus indices), not the whole operand.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from autopar.primitives import family_of
from autopar.trace.tensor import TensorInfo


def is_counted(primitive: str) -> bool:
    """Whether :func:`eqn_flops` knows ``primitive`` (unknown ones count 0 FLOPs): whether
    it has a family in :mod:`autopar.primitives`.

    Example:
        >>> is_counted("dot_general"), is_counted("my_custom_op")
        (True, False)
    """
    return family_of(primitive) is not None


def dot_general_flops(lhs_shape: Sequence[int], out_shape: Sequence[int], lhs_contracting) -> float:
    """``2 * prod(out) * prod(contracted lhs dims)``.

    Example:
        >>> dot_general_flops((8, 16), (8, 32), (1,))   # [8,16] @ [16,32]
        8192.0
    """
    k = math.prod(lhs_shape[i] for i in lhs_contracting)
    return 2.0 * math.prod(out_shape) * k


def conv_flops(
    rhs_shape: Sequence[int], out_shape: Sequence[int], rhs_spec: Sequence[int]
) -> float:
    """``2 * prod(out) * in_features_per_group * prod(kernel spatial)``.

    ``rhs_spec`` is the kernel's ``(out_feature_dim, in_feature_dim, *spatial_dims)`` from
    ``ConvDimensionNumbers.rhs_spec``.

    Example:
        >>> conv_flops((64, 3, 3, 3), (1, 64, 32, 32), (0, 1, 2, 3))   # 3x3 conv, 3 -> 64
        3538944.0
    """
    per_out = rhs_shape[rhs_spec[1]] * math.prod(rhs_shape[d] for d in rhs_spec[2:])
    return 2.0 * math.prod(out_shape) * per_out


def eqn_flops(
    primitive: str,
    params: dict,
    in_tensors: Sequence[TensorInfo],
    out_tensors: Sequence[TensorInfo],
) -> float:
    """FLOPs of one non-composite equation (see the module docstring for the rules).

    Args:
        primitive: the primitive name.
        params: the equation's raw parameters (``eqn.params``).
        in_tensors / out_tensors: operand and result shapes.

    Example:
        >>> eqn_flops("exp", {}, [TensorInfo((4, 4), "float32")], [TensorInfo((4, 4), "float32")])
        16.0
    """
    family = family_of(primitive)
    rule = family.flops if family is not None else None
    if rule == "dot":
        (lc, _), _ = params["dimension_numbers"]
        return dot_general_flops(in_tensors[0].shape, out_tensors[0].shape, lc)
    if rule == "conv":
        dn = params["dimension_numbers"]
        return conv_flops(in_tensors[1].shape, out_tensors[0].shape, dn.rhs_spec)
    if rule == "elementwise":
        return float(sum(t.size for t in out_tensors))
    if rule == "reduction":
        # one reduced operand per result (a variadic ``reduce`` has several)
        return float(sum(t.size for t in in_tensors[: len(out_tensors)]))
    if rule == "scatter_combine":
        return float(in_tensors[2].size)
    if rule == "reduce_window":
        window = params.get("window_dimensions", ())
        return float(out_tensors[0].size * math.prod(window))
    if rule == "sort":
        dim = params.get("dimension", 0)
        t = in_tensors[0]
        n = t.shape[dim] if t.shape else 1
        return float(t.size * max(1, math.ceil(math.log2(max(n, 2)))))
    if rule == "top_k":
        return float(in_tensors[0].size)
    if rule == "cholesky":  # n^3 / 3 multiply-adds per matrix
        t = in_tensors[0]
        n = t.shape[-1] if t.shape else 1
        return float(t.size // max(n * n, 1) * (n**3 / 3.0))
    if rule == "triangular_solve":  # a: [..., m, m], b: [..., m, n] -> m^2 n per batch
        a, b = in_tensors[0], in_tensors[1]
        m = a.shape[-1] if a.shape else 1
        return float(b.size * m)
    if rule == "fft":
        t = in_tensors[0]
        lengths = params.get("fft_lengths", ())
        n = math.prod(lengths) if lengths else 1
        return 5.0 * t.size * math.log2(max(n, 2))
    return 0.0


def eqn_bytes(
    primitive: str,
    in_tensors: Sequence[TensorInfo],
    out_tensors: Sequence[TensorInfo],
    literal: Sequence[bool],
) -> tuple[int, int]:
    """``(bytes_in, bytes_out)`` of one non-composite equation.

    Args:
        primitive: the primitive name.
        in_tensors / out_tensors: operand and result shapes.
        literal: per operand, whether it is a literal (free).

    Example:
        >>> t = TensorInfo((1024,), "float32")
        >>> eqn_bytes("add", [t, t], [t], [False, False])
        (8192, 4096)
    """
    family = family_of(primitive)
    if family is not None and family.reads == "slice":
        out = sum(t.nbytes for t in out_tensors)
        idx = sum(t.nbytes for t, lit in zip(in_tensors[1:], literal[1:], strict=True) if not lit)
        return out + idx, out
    k = family.update_operand if family is not None else None
    if k is not None and len(in_tensors) > k:
        upd = in_tensors[k].nbytes
        rest = sum(
            t.nbytes
            for i, (t, lit) in enumerate(zip(in_tensors, literal, strict=True))
            if i not in (0, k) and not lit
        )
        return 2 * upd + rest, upd
    b_in = sum(t.nbytes for t, lit in zip(in_tensors, literal, strict=True) if not lit)
    return b_in, sum(t.nbytes for t in out_tensors)
