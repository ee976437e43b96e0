"""What each JAX primitive is, for every stage: one table of primitive families.

A *family* is a set of primitives that every stage treats alike: the tracer counts their
FLOPs and bytes by one rule, the search shards them by one rule, the fusion, activation
and remat models classify them the same way. Each primitive belongs to at most one family;
a primitive in none is unknown (0 FLOPs, flagged by the trace summary, replicated by the
search). This module imports nothing from ``autopar``, so ``trace``, ``search`` and
``lower`` all read it; they keep no primitive lists of their own.

Columns of :class:`PrimitiveFamily`:

* ``name``: the family's name; ``members``: its primitive names (``eqn.primitive.name``;
  some primitives have had two spellings across JAX versions, e.g. ``scatter-add`` and
  ``scatter_add``, and both are listed).
* ``flops``: the FLOP rule ``autopar.trace.flops.eqn_flops`` dispatches on
  (:data:`FlopRule`): ``"dot"``, ``"conv"`` (exact), ``"elementwise"`` (1 per result
  element), ``"reduction"`` (1 per reduced input element), ``"scatter_combine"`` (1 per
  update element), ``"reduce_window"``, ``"sort"``, ``"top_k"``, ``"cholesky"``,
  ``"triangular_solve"``, ``"fft"``, ``"free"`` (0: data movement, casts, annotations)
  and ``"loop"`` (0 here: the graph builder counts the bodies). Bytes follow two more
  columns: ``reads="slice"`` (reads only the slice it returns, plus indices) and
  ``update_operand`` (the operand holding the updates of an in-place update: it reads and
  writes that region only).
* ``sharding``: the rule ``autopar.search.strategies`` dispatches on
  (:data:`ShardingRule`). The follow rules (:data:`FOLLOW_RULES`: ``"elementwise"``,
  ``"reduce"``, ``"transpose"``, ``"slice"``, ...) take the layout from one operand, so
  the op joins that operand's ILP group (:data:`FOLLOWABLE`, the *layout-following* ops,
  :attr:`PrimitiveFamily.layout_following`); the enumerated rules
  (:data:`ENUMERATED_RULES`: ``"dot"``, ``"conv"``, ``"gather"``, ``"scatter"``,
  ``"scatter_add"``, ``"source"``) list every legal layout and lead an ILP group, as does
  ``"scan"`` (the ILP solves its body); ``"replicate"``: no rule, everything replicated.
* ``compute``: the compute-time kind the cost model prices the op's FLOPs and bytes as
  (``"matmul"``, ``"reduction"``, ``"elementwise"``, ``"other"``); ``"none"``: no time of
  its own (layout changes XLA turns into bitcasts or fuses into their consumers).
* ``fusible``: XLA loop-fuses it, so its result can stay in registers
  (``autopar.search.fusion``, the HBM traffic and memory model); ``fusion_consumer``: it
  reads a fused operand without that operand being stored (fusible ops, and reductions,
  the roots of their fusions); ``expensive``: XLA's ``InstructionFusion::IsExpensive``
  (not duplicated into several consumer fusions, so stored when read by several).
* ``recomputable``: the remat model (``autopar.search.build.residuals``) may recompute it
  in a fused backward kernel rather than store its result; ``recompute_consumer``: a
  backward consumer that fuses such recomputation (any other reader needs its operand in
  memory). These follow Megatron's hand-fused kernels, not XLA, and differ from the
  ``fusible`` columns on purpose (a gather or a scatter-add recomputes its operand; a
  cumulative sum does too, though XLA does not loop-fuse into it).
* ``remat_tail``: an elementwise or layout op that a remat recompute block runs after its
  guard when it feeds no heavier op of the block (``autopar.lower.remat``): XLA fuses it
  into the backward node reading it. Slicing ops are recomputable but not in the tail.
* ``random_bits``: its results are fresh random bits (values computed from them are
  activations even when no batch input reaches them: a dropout mask).

Derived sets (frozensets of primitive names): :data:`KNOWN`, :data:`FOLLOWABLE`,
:data:`ENUMERATED`, :data:`LEADS_GROUP`, :data:`MATMULS`, :data:`FUSIBLE`,
:data:`FUSION_CONSUMERS`, :data:`EXPENSIVE`, :data:`RECOMPUTABLE`,
:data:`RECOMPUTE_CONSUMERS`, :data:`REMAT_TAIL`, :data:`RANDOM_BITS`,
:data:`SCATTER_ADDS`; :func:`select` builds any other.

Example:
    >>> family_of("exp").name, family_of("exp").flops, family_of("exp").sharding
    ('expensive_elementwise', 'elementwise', 'elementwise')
    >>> family_of("exp").fusible, "exp" in RECOMPUTABLE, "dot_general" in RECOMPUTABLE
    (True, True, False)
    >>> family_of("dot_general").flops, family_of("my_custom_op") is None
    ('dot', True)
    >>> sorted(select(sharding="reduce"))[:2]
    ['reduce_and', 'reduce_max']
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, fields
from typing import Literal

FlopRule = Literal[
    "dot",
    "conv",
    "elementwise",
    "reduction",
    "scatter_combine",
    "reduce_window",
    "sort",
    "top_k",
    "cholesky",
    "triangular_solve",
    "fft",
    "free",
    "loop",
]
"""How ``autopar.trace.flops.eqn_flops`` counts a family's FLOPs."""

ShardingRule = Literal[
    # follow rules: the layout comes from one operand
    "elementwise",
    "reduce",
    "arg_reduce",
    "cumulative",
    "sort",
    "top_k",
    "broadcast",
    "reshape",
    "squeeze",
    "expand_dims",
    "transpose",
    "slice",
    "pad",
    "dynamic_update_slice",
    "concatenate",
    "rev",
    "split",
    # enumerated rules: every legal layout is listed
    "dot",
    "conv",
    "gather",
    "scatter",
    "scatter_add",
    "source",
    # the ILP solves the body
    "scan",
    # no rule: everything replicated
    "replicate",
]
"""How ``autopar.search.strategies`` shards a family."""

FOLLOW_RULES: frozenset[str] = frozenset(
    """elementwise reduce arg_reduce cumulative sort top_k broadcast reshape squeeze
    expand_dims transpose slice pad dynamic_update_slice concatenate rev split""".split()
)
"""Sharding rules that take the layout of one operand (``strategies.follow_strategy``)."""

ENUMERATED_RULES: frozenset[str] = frozenset(
    ["dot", "conv", "gather", "scatter", "scatter_add", "source"]
)
"""Sharding rules whose every legal layout ``strategies.enumerate_strategies`` lists."""

ComputeKind = Literal["matmul", "reduction", "elementwise", "other", "none"]
"""How the cost model prices a family's compute (``"none"``: free)."""


@dataclass(frozen=True)
class PrimitiveFamily:
    """One row of the table: primitives every stage treats alike (see the module
    docstring for what each column means).

    Example:
        >>> f = family_of("reshape")
        >>> f.sharding, f.compute, f.layout_following, f.leads_group
        ('reshape', 'none', True, False)
    """

    name: str
    members: frozenset[str]
    flops: FlopRule
    sharding: ShardingRule = "replicate"
    compute: ComputeKind = "other"
    fusible: bool = False
    fusion_consumer: bool = False
    expensive: bool = False
    recomputable: bool = False
    recompute_consumer: bool = False
    remat_tail: bool = False
    random_bits: bool = False
    reads: Literal["all", "slice"] = "all"
    update_operand: int | None = None

    @property
    def layout_following(self) -> bool:
        """Takes its layout from one operand (joins that operand's ILP group)."""
        return self.sharding in FOLLOW_RULES

    @property
    def leads_group(self) -> bool:
        """Leads its own ILP group: its layouts are enumerated (or, for ``scan``, solved
        in its body)."""
        return self.sharding in ENUMERATED_RULES or self.sharding == "scan"


def _family(name: str, members: str, flops: FlopRule, **columns) -> PrimitiveFamily:
    return PrimitiveFamily(name, frozenset(members.split()), flops, **columns)


# Elementwise ops XLA fuses, the remat model (search/build/residuals) recomputes and remat
# runs in its tail.
_FUSED_ELEMENTWISE = dict(
    sharding="elementwise",
    compute="elementwise",
    fusible=True,
    fusion_consumer=True,
    recomputable=True,
    recompute_consumer=True,
    remat_tail=True,
)
# Layout and slicing ops: free to count, fused by XLA, recomputable.
_FUSED_LAYOUT = dict(fusible=True, fusion_consumer=True, recomputable=True, recompute_consumer=True)

FAMILIES: tuple[PrimitiveFamily, ...] = (
    # ---------------------------------------------------------------- elementwise
    _family(
        "elementwise",
        """abs add add_any sub mul neg sign square max min clamp select_n floor ceil round
        is_finite eq ne lt le gt ge and or xor not shift_left shift_right_logical
        shift_right_arithmetic clz population_count nextafter reduce_precision erfc acos
        asin atan sinh cosh asinh acosh atanh lgamma digamma complex conj real imag""",
        "elementwise",
        **_FUSED_ELEMENTWISE,
    ),
    _family(
        "expensive_elementwise",
        """exp exp2 expm1 log log1p logistic tanh sin cos tan atan2 sqrt rsqrt cbrt erf
        erf_inv div rem pow integer_pow""",
        "elementwise",
        **_FUSED_ELEMENTWISE,
        expensive=True,
    ),
    # Special functions XLA expands into loops or long series: sharded like elementwise
    # ops, but neither fused nor recomputed.
    _family(
        "special_function",
        """igamma igammac bessel_i0e bessel_i1e polygamma zeta regularized_incomplete_beta
        random_gamma_grad""",
        "elementwise",
        sharding="elementwise",
        compute="elementwise",
    ),
    # Casts, copies and identities: elementwise in layout, no FLOPs.
    _family(
        "conversion",
        "convert_element_type bitcast_convert_type copy copy_p stop_gradient",
        "free",
        **_FUSED_ELEMENTWISE,
    ),
    _family(
        "optimization_barrier",
        "optimization_barrier",
        "free",
        sharding="elementwise",
        compute="elementwise",
        fusible=True,
        fusion_consumer=True,
    ),
    # ---------------------------------------------------------------- random numbers
    _family(
        "threefry",
        "threefry2x32",
        "elementwise",
        sharding="elementwise",
        compute="elementwise",
        fusible=True,
        fusion_consumer=True,
        random_bits=True,
    ),
    _family("random_bits", "random_bits rng_bit_generator rng_uniform", "free", random_bits=True),
    _family(
        "random_key",
        "random_seed random_wrap random_unwrap random_fold_in random_split random_clone",
        "free",
    ),
    # ---------------------------------------------------------------- reductions
    _family(
        "reduction",
        "reduce_sum reduce_max reduce_min reduce_prod reduce_and reduce_or reduce_xor",
        "reduction",
        sharding="reduce",
        compute="reduction",
        fusion_consumer=True,
        recompute_consumer=True,
    ),
    _family(
        "arg_reduction",
        "argmax argmin",
        "reduction",
        sharding="arg_reduce",
        compute="reduction",
        fusion_consumer=True,
        recompute_consumer=True,
    ),
    _family(
        "cumulative",
        "cumsum cumprod cummax cummin cumlogsumexp",
        "reduction",
        sharding="cumulative",
        compute="reduction",
        recompute_consumer=True,
    ),
    # the general (variadic) reduce: 1 FLOP per element of each reduced operand
    _family("reduce", "reduce", "reduction"),
    _family(
        "reduce_window",
        """reduce_window_sum reduce_window_max reduce_window_min reduce_window
        select_and_scatter_add select_and_gather_add select_and_scatter""",
        "reduce_window",
    ),
    _family("sort", "sort", "sort", sharding="sort"),
    _family("top_k", "top_k", "top_k", sharding="top_k"),
    # ---------------------------------------------------------------- layout
    _family(
        "broadcast",
        "broadcast_in_dim",
        "free",
        sharding="broadcast",
        compute="none",
        remat_tail=True,
        **_FUSED_LAYOUT,
    ),
    _family(
        "reshape",
        "reshape",
        "free",
        sharding="reshape",
        compute="none",
        remat_tail=True,
        **_FUSED_LAYOUT,
    ),
    _family(
        "squeeze",
        "squeeze",
        "free",
        sharding="squeeze",
        compute="none",
        remat_tail=True,
        **_FUSED_LAYOUT,
    ),
    _family(
        "expand_dims",
        "expand_dims",
        "free",
        sharding="expand_dims",
        compute="none",
        remat_tail=True,
        **_FUSED_LAYOUT,
    ),
    _family(
        "transpose", "transpose", "free", sharding="transpose", remat_tail=True, **_FUSED_LAYOUT
    ),
    # ---------------------------------------------------------------- slicing
    _family(
        "slice", "slice dynamic_slice", "free", sharding="slice", reads="slice", **_FUSED_LAYOUT
    ),
    _family("pad", "pad", "free", sharding="pad", **_FUSED_LAYOUT),
    _family("concatenate", "concatenate", "free", sharding="concatenate", **_FUSED_LAYOUT),
    _family("rev", "rev", "free", sharding="rev", **_FUSED_LAYOUT),
    _family("split", "split", "free", sharding="split", **_FUSED_LAYOUT),
    _family(
        "dynamic_update_slice",
        "dynamic_update_slice",
        "free",
        sharding="dynamic_update_slice",
        recompute_consumer=True,
        update_operand=1,
    ),
    # ---------------------------------------------------------------- sources
    _family("iota", "iota", "free", sharding="source", remat_tail=True, **_FUSED_LAYOUT),
    # ---------------------------------------------------------------- contractions
    _family("dot_general", "dot_general", "dot", sharding="dot", compute="matmul"),
    _family("conv", "conv_general_dilated", "conv", sharding="conv", compute="matmul"),
    # ---------------------------------------------------------------- gather / scatter
    _family("gather", "gather", "free", sharding="gather", reads="slice", recompute_consumer=True),
    _family("scatter", "scatter", "free", sharding="scatter", update_operand=2),
    _family(
        "scatter_add",
        "scatter-add scatter_add",
        "scatter_combine",
        sharding="scatter_add",
        recompute_consumer=True,
        update_operand=2,
    ),
    _family(
        "scatter_mul",
        "scatter-mul scatter_mul",
        "scatter_combine",
        sharding="scatter",
        update_operand=2,
    ),
    # No sharding rule yet (replicated): a min / max / sub combiner.
    _family(
        "scatter_combine",
        "scatter-min scatter_min scatter-max scatter_max scatter-sub scatter_sub",
        "scatter_combine",
        update_operand=2,
    ),
    # ---------------------------------------------------------------- linear algebra
    _family("cholesky", "cholesky", "cholesky"),
    _family("triangular_solve", "triangular_solve", "triangular_solve"),
    _family("fft", "fft", "fft"),
    # ---------------------------------------------------------------- control flow
    _family("scan", "scan", "loop", sharding="scan"),
    _family("while_cond", "while cond", "loop"),
    # ---------------------------------------------------------------- annotations
    # Sharding and placement annotations (and the mesh position): no FLOPs, no rule.
    _family(
        "annotation",
        "sharding_constraint device_put mesh_cast reshard pvary pcast axis_index",
        "free",
    ),
)
"""Every primitive family, one row each."""


def _index(families: Iterable[PrimitiveFamily]) -> dict[str, PrimitiveFamily]:
    out: dict[str, PrimitiveFamily] = {}
    for fam in families:
        for p in fam.members:
            if p in out:
                raise ValueError(f"primitive {p!r} is in families {out[p].name!r} and {fam.name!r}")
            out[p] = fam
    return out


_BY_PRIMITIVE: dict[str, PrimitiveFamily] = _index(FAMILIES)
_COLUMNS = frozenset(f.name for f in fields(PrimitiveFamily))


def family_of(primitive: str) -> PrimitiveFamily | None:
    """The family of ``primitive`` (a primitive name), or ``None`` if it is unknown.

    Example:
        >>> family_of("add").name, family_of("cumsum").sharding
        ('elementwise', 'cumulative')
    """
    return _BY_PRIMITIVE.get(primitive)


def sharding_rule(primitive: str) -> ShardingRule:
    """The sharding rule of ``primitive`` (``"replicate"`` if it is unknown).

    Example:
        >>> sharding_rule("dot_general"), sharding_rule("my_custom_op")
        ('dot', 'replicate')
    """
    fam = _BY_PRIMITIVE.get(primitive)
    return fam.sharding if fam is not None else "replicate"


def select(**columns) -> frozenset[str]:
    """The primitives of the families whose columns have the given values (a set, tuple
    or list of values matches any of them).

    Example:
        >>> sorted(select(flops=("dot", "conv")))
        ['conv_general_dilated', 'dot_general']
        >>> "iota" in select(fusible=True, sharding="source")
        True
    """
    unknown = set(columns) - _COLUMNS - {"layout_following", "leads_group"}
    if unknown:
        raise TypeError(f"unknown column(s) {sorted(unknown)}; columns: {sorted(_COLUMNS)}")

    def match(fam: PrimitiveFamily) -> bool:
        for col, want in columns.items():
            got = getattr(fam, col)
            if isinstance(want, (set, frozenset, tuple, list)):
                if got not in want:
                    return False
            elif got != want:
                return False
        return True

    return frozenset(p for fam in FAMILIES if match(fam) for p in fam.members)


KNOWN: frozenset[str] = frozenset(_BY_PRIMITIVE)
"""Every primitive in the table (the tracer counts its FLOPs)."""
FOLLOWABLE: frozenset[str] = select(layout_following=True)
"""Take their layout from one operand (merged into that operand's ILP group)."""
ENUMERATED: frozenset[str] = select(sharding=ENUMERATED_RULES)
"""The search lists every legal layout of these."""
LEADS_GROUP: frozenset[str] = select(leads_group=True)
"""Lead their own ILP group: :data:`ENUMERATED` and ``scan``."""
MATMULS: frozenset[str] = select(flops=("dot", "conv"))
"""Contractions: ``dot_general`` and ``conv_general_dilated``."""
FUSIBLE: frozenset[str] = select(fusible=True)
"""XLA loop-fuses them (their results can stay in registers)."""
FUSION_CONSUMERS: frozenset[str] = select(fusion_consumer=True)
"""Read a fused value without it being stored (fusible ops and reductions)."""
EXPENSIVE: frozenset[str] = select(expensive=True)
"""Elementwise ops XLA does not duplicate into several consumer fusions."""
RECOMPUTABLE: frozenset[str] = select(recomputable=True)
"""The remat model (``autopar.search.build.residuals``) may recompute them in a fused
backward kernel."""
RECOMPUTE_CONSUMERS: frozenset[str] = select(recompute_consumer=True)
"""Backward consumers that fuse the recomputation of their recomputable operands."""
REMAT_TAIL: frozenset[str] = select(remat_tail=True)
"""Elementwise and layout ops a remat recompute block may run after its guard."""
RANDOM_BITS: frozenset[str] = select(random_bits=True)
"""Their results are fresh random bits."""
SCATTER_ADDS: frozenset[str] = select(sharding="scatter_add")
"""Scatters that add their updates (partial sums combine by an all-reduce)."""

__all__ = [
    "ENUMERATED",
    "ENUMERATED_RULES",
    "EXPENSIVE",
    "FAMILIES",
    "FOLLOWABLE",
    "FOLLOW_RULES",
    "FUSIBLE",
    "FUSION_CONSUMERS",
    "KNOWN",
    "LEADS_GROUP",
    "MATMULS",
    "RANDOM_BITS",
    "RECOMPUTABLE",
    "RECOMPUTE_CONSUMERS",
    "REMAT_TAIL",
    "SCATTER_ADDS",
    "ComputeKind",
    "FlopRule",
    "PrimitiveFamily",
    "ShardingRule",
    "family_of",
    "select",
    "sharding_rule",
]
