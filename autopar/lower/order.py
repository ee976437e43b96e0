"""Gathers of inputs placed right before their use.

A plan gathers a sharded parameter (or optimizer-state leaf) where it is read: an operand
constraint on the consuming equation (ZeRO-3/FSDP, or a completed plan that computes a
layer with its weights whole). The cost model frees the gathered copy after that use. But
the gather depends on nothing computed in the step, so XLA's scheduler is free to issue
it at the very start (XLA:CPU does: every expert weight of a MoE gathered up front, all
live together, 50% more memory than planned). Tying the input to an operand that is
computed late, through ``lax.optimization_barrier``, makes the gather wait for it: the
gathered copy then lives from just before its use to just after, as planned.

:func:`late_gathers` finds, for every such operand constraint, the operand to tie it
to, and which later readers of the same gathered value reuse it.

Example: the plan's layer-1 weight is split over ``tensor``; computing layer 1's matmul
(node 6) with that weight whole (an operand constraint) gathers it there.

    >>> from autopar.plan import ActivationConstraint
    >>> whole = ActivationConstraint(node=6, output=0, spec=(None, None), operand=1)
    >>> specs = [r.spec for r in plan.inputs]
    >>> late = late_gathers(graph, plan.activations + (whole,), specs, plan.mesh)
    >>> late.ties  # layer 1's matmul (node 6) gathers its weight (operand 1) after operand 0
    {((), 6): {1: 0}}
    >>> graph.nodes[6].primitive, graph.nodes[6].layer
    ('dot_general', 1)
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp

from autopar.plan import ActivationConstraint, Spec, spec_axes

Scope = tuple[tuple[int, int], ...]


def _shards(spec: Spec, mesh: Mapping[str, int]) -> int:
    return math.prod(mesh[a] for a in spec_axes(spec))


def _input_roots(graph: Any) -> dict[int, int]:
    """value id -> flat input index, for every value that is a graph input or is made
    from exactly one such value by equations reading nothing else (casts, reshapes,
    scalings by literals): values XLA could compute at the step's very start."""
    roots = {inp.value: inp.index for inp in graph.inputs}
    for node in graph.nodes:
        if node.body:
            continue
        read = [v for v in node.inputs if v >= 0]
        if len(read) == 1 and read[0] in roots:
            for out in node.outputs:
                roots[out] = roots[read[0]]
    return roots


@dataclass(frozen=True)
class LateGathers:
    """How the lowering orders gathers of inputs (:func:`late_gathers`).

    Attributes:
        ties: ``{(scope, node): {operand: partner}}``: pass the operand through
            :func:`tie` with the partner operand before its constraints apply.
        reuse: ``{(scope, node): {operand: (first_node, first_operand)}}``: read the value
            the first reader gathered instead of gathering again (the cost model counts
            one gather per value and layout, kept for every reader, as XLA's CSE does
            when nothing is tied).
    """

    ties: Mapping[tuple[Scope, int], Mapping[int, int]] = field(default_factory=dict)
    reuse: Mapping[tuple[Scope, int], Mapping[int, tuple[int, int]]] = field(default_factory=dict)


def late_gathers(
    graph: Any,
    constraints: Sequence[ActivationConstraint],
    input_specs: Sequence[Spec],
    mesh: Mapping[str, int],
) -> LateGathers:
    """The top-level operands the plan gathers from an input's layout (fewer shards than
    the input has), grouped by value and target layout. The first reader of each group
    (in program order) is tied to its first operand computed in the step; the others
    reuse what it gathered. A first reader with no such partner (every operand an input)
    is left to XLA's scheduler. Loop bodies are left alone: their iterations already
    order their gathers."""
    roots = _input_roots(graph)
    chains: dict[tuple[int, int], list[Spec]] = {}  # (node, operand) -> specs, in order
    for c in constraints:
        if c.operand is not None and not c.scope:
            chains.setdefault((c.node, c.operand), []).append(c.spec)
    groups: dict[tuple[int, tuple[Spec, ...]], list[tuple[int, int]]] = {}
    for (node_id, operand), specs in sorted(chains.items()):
        value = graph.nodes[node_id].inputs[operand]
        root = roots.get(value)
        if root is None or _shards(specs[-1], mesh) >= _shards(input_specs[root], mesh):
            continue
        groups.setdefault((value, tuple(specs)), []).append((node_id, operand))
    ties: dict[tuple[Scope, int], dict[int, int]] = {}
    reuse: dict[tuple[Scope, int], dict[int, tuple[int, int]]] = {}
    for readers in groups.values():
        first, operand = readers[0]
        node = graph.nodes[first]
        partner = next((j for j, v in enumerate(node.inputs) if v >= 0 and v not in roots), None)
        if partner is not None:
            ties.setdefault(((), first), {})[operand] = partner
        for node_id, op in readers[1:]:
            reuse.setdefault(((), node_id), {})[op] = (first, operand)
    return LateGathers(ties, reuse)


def tie(value: Any, partner: Any, guard: str, predicate: Any = None) -> tuple[Any, Any]:
    """``(value, partner)`` passed through a barrier, so that whatever reads the returned
    ``value`` waits for ``partner``.

    ``guard="barrier"``: ``lax.optimization_barrier``, which accelerator backends keep
    until scheduling. XLA:CPU expands barriers before it schedules, so ``guard="cond"``
    also passes ``value`` through a ``lax.cond`` on ``predicate`` (an opaque ``True``, see
    :func:`autopar.lower.remat.default_guard`) or'ed with a test on one element of
    ``partner``: a conditional cannot start before its predicate exists, and XLA cannot
    fold it away.

    Example:
        >>> import jax.numpy as jnp
        >>> w, x = tie(jnp.ones(2), jnp.zeros(2), "barrier")
        >>> w.tolist(), x.tolist()
        ([1.0, 1.0], [0.0, 0.0])
    """
    value, partner = jax.lax.optimization_barrier((value, partner))
    if guard == "cond":
        from autopar.lower.remat import GUARD_SCOPE

        # Only ``value`` passes through the conditional: a branch returning its operand
        # makes XLA copy it, and a copy of a whole partner (a gradient, a moment) would
        # live from the conditional to the use (measured: +16% peak on a ZeRO-1 GPT and
        # an expert-parallel MoE). The partner gates the predicate through one element
        # of it instead (always true whatever that element is; XLA cannot fold it).
        if jnp.issubdtype(partner.dtype, jax.dtypes.prng_key):
            partner_data = jax.random.key_data(partner)
        else:
            partner_data = partner
        if jnp.size(partner_data):
            with jax.named_scope(GUARD_SCOPE):
                # One element, indexed in every dim: a sharded partner gives it from the
                # shard that holds it (no ``ravel``, whose reshape can make the
                # partitioner gather the whole partner first).
                first = partner_data[(0,) * partner_data.ndim].astype(jnp.float32)
                bits = jax.lax.bitcast_convert_type(first, jnp.int32)
                predicate = predicate | (bits == 0x7EADBEEF)
        value = jax.lax.cond(predicate, lambda v: v, jnp.zeros_like, value)
    return value, partner


__all__ = ["LateGathers", "late_gathers", "tie"]
