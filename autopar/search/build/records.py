"""The records the ILP build stages hand to one another.

The build is one-way: :mod:`~autopar.search.build.flatten` turns a graph into
:class:`Op` records, :mod:`~autopar.search.build.coarsen` groups them
(:class:`GroupShape`), :mod:`~autopar.search.build.price` prices every group strategy
and every read across groups (:class:`Group`, :class:`EdgeRef`), and
:mod:`~autopar.search.build.memory` tracks what is live (:class:`MemValue`,
:class:`Timeline`). :mod:`autopar.search.ilp` assembles them into a
``BuiltProblem``. All records are frozen; a later stage makes new records rather than
editing an earlier stage's.

Example:
    >>> Ref(op=3, port=0).delta
    0
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from autopar.search.fusion import IO
from autopar.search.sharding import Sharding
from autopar.search.strategies import OpStrategy
from autopar.trace.graph import GraphInput, Node, TensorInfo

Scope = tuple[tuple[int, int], ...]
"""Where an op sits: the ``(scan node id, body index)`` of every loop around it."""

OpKind = Literal["node", "input", "body_input", "constraint", "output"]


@dataclass(frozen=True)
class Ref:
    """Where a value comes from: op ``op``'s result ``port``, seen with ``delta`` extra
    (unsharded) leading dims."""

    op: int
    port: int
    delta: int = 0


@dataclass(frozen=True)
class Op:
    """One thing the ILP prices: an equation, a graph input, a loop-body input, a pinned
    constraint or an output sink (a parameter's new value, stored in its input's layout).

    Attributes:
        index: position in the op list.
        kind: see :data:`OpKind`.
        node: the equation (a synthetic one for the other kinds).
        scope: the loops around it.
        weight: executions per step (the product of the trip counts around it).
        operands: where each operand comes from (``None``: a literal or a constant).
        name: for humans.
        phase: forward / backward / optimizer / other.
        input: the graph input (input ops and output sinks).
        root_role: the role of the graph input the op's group starts from, if any.
        depends: whether it depends on some graph input (else it is a constant).
        io: which operands and results touch HBM after XLA's fusion (fusible ops).
    """

    index: int
    kind: OpKind
    node: Node
    scope: Scope
    weight: float
    operands: tuple[Ref | None, ...]
    name: str
    phase: str = "other"
    input: GraphInput | None = None
    root_role: str | None = None
    depends: bool = True
    io: IO | None = None


@dataclass(frozen=True)
class CombinedReduction:
    """A combined gradient reduction: XLA's collective combiners merge the independent
    gradient all-reduces (reduce-scatters) of one computation over the same devices into
    one collective, so its latency is paid once per execution of the scope; each member
    strategy pays only the bandwidth part itself.

    Attributes:
        scope: the loops the reductions run in.
        kind: the collective.
        axes: the mesh axes it runs over.
        executions: how often the scope runs per step.
        latency_s: the latency paid once per execution.
    """

    scope: Scope
    kind: str
    axes: tuple[str, ...]
    executions: float
    latency_s: float


@dataclass(frozen=True)
class GroupShape:
    """A group of ops that take one strategy together: the leader (``ops[0]``) chooses,
    each follower takes its layout from operand ``follow[op]``."""

    index: int
    ops: tuple[int, ...]
    follow: Mapping[int, int] = field(default_factory=dict)


@dataclass(frozen=True)
class Group:
    """A priced group: per strategy ``s``, the strategy of every op (``strategies[s]``,
    in ``ops`` order), its objective seconds (``costs[s]``), the compute part of it
    (``compute[s]``) and the combined reductions it takes part in (``charges[s]``)."""

    index: int
    ops: tuple[int, ...]
    follow: Mapping[int, int]
    strategies: tuple[tuple[OpStrategy, ...], ...]
    costs: tuple[float, ...]
    compute: tuple[float, ...]
    charges: tuple[tuple[CombinedReduction, ...], ...]


@dataclass(frozen=True)
class EdgeRef:
    """A read across groups: op ``op`` operand ``operand`` reads ``ref``."""

    op: int
    operand: int
    ref: Ref
    problem_edge: int


@dataclass(frozen=True)
class MemValue:
    """One value the memory model tracks."""

    ref: Ref | None
    tensor: TensorInfo
    category: str
    name: str


def pad(spec: Sharding, delta: int) -> Sharding:
    """``spec`` seen with ``delta`` extra unsharded leading dims."""
    return ((),) * delta + spec if delta else spec


__all__ = [
    "CombinedReduction",
    "EdgeRef",
    "Group",
    "GroupShape",
    "MemValue",
    "Op",
    "OpKind",
    "Ref",
    "Scope",
    "pad",
]
