"""The intra-operator sharding problem as plain data, and its solution.

A :class:`ShardingProblem` is what the solver sees: nodes with one cost per strategy,
edges with a cost per (producer layout, consumer layout) pair, memory constraints that are
linear in the strategy choice, alias groups (nodes that must pick the same strategy
index, e.g. a parameter and its optimizer state) and shared costs (paid once when any
member strategy is chosen: combined collectives). It carries no JAX objects and
round-trips through JSON, so a slow or surprising solve can be replayed on its own.

Costs are seconds, memory is bytes per device.

Example:
    >>> p = ShardingProblem(
    ...     nodes=(ProblemNode("a", (1.0, 2.0)), ProblemNode("b", (2.0, 1.0))),
    ...     edges=(ProblemEdge(0, 1, (0, 1), (0, 1), ((0.0, 5.0), (5.0, 0.0))),),
    ... )
    >>> p.objective((0, 0)), p.objective((0, 1))
    (3.0, 7.0)
    >>> ShardingProblem.from_json(p.to_json()) == p
    True
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

SolveStatus = Literal["optimal", "feasible", "infeasible", "unknown"]


@dataclass(frozen=True)
class ProblemNode:
    """One choice: a group of operations that pick one strategy together.

    Attributes:
        name: for humans (the leading operation's name).
        costs: seconds per strategy (compute and collectives, weighted by repeat count).
        labels: optional description per strategy.
    """

    name: str
    costs: tuple[float, ...]
    labels: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "costs", tuple(float(c) for c in self.costs))
        object.__setattr__(self, "labels", tuple(self.labels))
        if not self.costs:
            raise ValueError(f"node {self.name!r} has no strategies")
        if self.labels and len(self.labels) != len(self.costs):
            raise ValueError(
                f"node {self.name!r}: {len(self.labels)} labels for {len(self.costs)} costs"
            )

    @property
    def num_strategies(self) -> int:
        return len(self.costs)


@dataclass(frozen=True)
class ProblemEdge:
    """Resharding between two nodes.

    The producer's strategies fall into classes by the layout they give the value
    (``src_classes[s]``), the consumer's by the layout they need (``dst_classes[s]``);
    ``costs[i][j]`` is the time to move from producer class ``i`` to consumer class ``j``.
    """

    src: int
    dst: int
    src_classes: tuple[int, ...]
    dst_classes: tuple[int, ...]
    costs: tuple[tuple[float, ...], ...]
    name: str = ""

    def __post_init__(self) -> None:
        # Builders pass tuples already; JSON and hand-written problems may pass lists.
        if type(self.src_classes) is not tuple:
            object.__setattr__(self, "src_classes", tuple(int(c) for c in self.src_classes))
        if type(self.dst_classes) is not tuple:
            object.__setattr__(self, "dst_classes", tuple(int(c) for c in self.dst_classes))
        if type(self.costs) is not tuple or any(type(r) is not tuple for r in self.costs):
            object.__setattr__(self, "costs", tuple(tuple(float(c) for c in r) for r in self.costs))
        rows, cols = len(self.costs), len(self.costs[0]) if self.costs else 0
        if max(self.src_classes, default=-1) >= rows or max(self.dst_classes, default=-1) >= cols:
            raise ValueError(f"edge {self.name!r}: class index outside its {rows}x{cols} matrix")

    def cost(self, s_src: int, s_dst: int) -> float:
        return self.costs[self.src_classes[s_src]][self.dst_classes[s_dst]]


@dataclass(frozen=True)
class MemoryConstraint:
    """Bytes per device at one moment: ``constant + sum(terms[node][strategy])``."""

    name: str
    constant: float
    terms: tuple[tuple[int, tuple[float, ...]], ...]

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "terms", tuple((int(n), tuple(float(b) for b in bs)) for n, bs in self.terms)
        )

    def usage(self, choice: Sequence[int]) -> float:
        return self.constant + sum(bs[choice[n]] for n, bs in self.terms)


@dataclass(frozen=True)
class SharedCost:
    """A cost paid once when any of its members is chosen.

    Collectives XLA combines into one (the gradient reductions of a layer: independent
    all-reduces over the same devices) pay the collective's latency once; each member
    strategy pays only its bandwidth part in its own cost.

    Attributes:
        name: for humans.
        cost: seconds, paid once if some member ``(node, strategy)`` is chosen.
        members: ``(node, strategies)`` pairs.
    """

    name: str
    cost: float
    members: tuple[tuple[int, tuple[int, ...]], ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "cost", float(self.cost))
        object.__setattr__(
            self, "members", tuple((int(n), tuple(int(x) for x in ss)) for n, ss in self.members)
        )

    def active(self, choice: Sequence[int]) -> bool:
        return any(choice[n] in ss for n, ss in self.members)


@dataclass(frozen=True)
class ShardingProblem:
    """Choose one strategy per node, minimising node + edge costs under memory bounds.

    Attributes:
        nodes: the choices.
        edges: resharding costs between choices.
        memory: linear memory constraints, each must stay ``<= memory_limit``.
        memory_limit: bytes per device (``None``: unbounded).
        aliases: groups of nodes that must choose the same strategy index (equal counts).
        shared: costs paid once when any of their members is chosen.
    """

    nodes: tuple[ProblemNode, ...]
    edges: tuple[ProblemEdge, ...] = ()
    memory: tuple[MemoryConstraint, ...] = ()
    memory_limit: float | None = None
    aliases: tuple[tuple[int, ...], ...] = ()
    meta: dict[str, Any] = field(default_factory=dict, compare=False)
    shared: tuple[SharedCost, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "nodes", tuple(self.nodes))
        object.__setattr__(self, "shared", tuple(self.shared))
        object.__setattr__(self, "edges", tuple(self.edges))
        object.__setattr__(self, "memory", tuple(self.memory))
        object.__setattr__(self, "aliases", tuple(tuple(int(n) for n in a) for a in self.aliases))
        for group in self.aliases:
            counts = {self.nodes[n].num_strategies for n in group}
            if len(counts) > 1:
                raise ValueError(f"alias group {group} mixes strategy counts {sorted(counts)}")
        for e in self.edges:
            if (
                len(e.src_classes) != self.nodes[e.src].num_strategies
                or len(e.dst_classes) != self.nodes[e.dst].num_strategies
            ):
                raise ValueError(f"edge {e.name!r} ({e.src}->{e.dst}) class lists do not match")

    # -- evaluation of a choice ---------------------------------------------------------
    def objective(self, choice: Sequence[int]) -> float:
        """Total cost (seconds) of a choice: node, edge and active shared costs."""
        total = sum(n.costs[c] for n, c in zip(self.nodes, choice, strict=True))
        total += sum(sc.cost for sc in self.shared if sc.active(choice))
        return total + sum(e.cost(choice[e.src], choice[e.dst]) for e in self.edges)

    def memory_usage(self, choice: Sequence[int]) -> float:
        """The largest memory constraint's bytes under ``choice`` (0 without any)."""
        return max((m.usage(choice) for m in self.memory), default=0.0)

    def is_feasible(self, choice: Sequence[int]) -> bool:
        if any(len({choice[n] for n in g}) > 1 for g in self.aliases):
            return False
        return self.memory_limit is None or self.memory_usage(choice) <= self.memory_limit

    @property
    def size(self) -> dict[str, int]:
        """Nodes, edges and the strategy/edge-class totals (how big the ILP is)."""
        return {
            "nodes": len(self.nodes),
            "edges": len(self.edges),
            "strategies": sum(n.num_strategies for n in self.nodes),
            "edge_pairs": sum(len(e.costs) * len(e.costs[0]) for e in self.edges if e.costs),
            "memory_constraints": len(self.memory),
            "alias_groups": len(self.aliases),
            "shared_costs": len(self.shared),
        }

    # -- JSON ------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return {
            "nodes": [
                {"name": n.name, "costs": list(n.costs), "labels": list(n.labels)}
                for n in self.nodes
            ],
            "edges": [
                {
                    "src": e.src,
                    "dst": e.dst,
                    "src_classes": list(e.src_classes),
                    "dst_classes": list(e.dst_classes),
                    "costs": [list(r) for r in e.costs],
                    "name": e.name,
                }
                for e in self.edges
            ],
            "memory": [
                {
                    "name": m.name,
                    "constant": m.constant,
                    "terms": [[n, list(b)] for n, b in m.terms],
                }
                for m in self.memory
            ],
            "memory_limit": self.memory_limit,
            "aliases": [list(a) for a in self.aliases],
            "meta": self.meta,
            "shared": [
                {"name": c.name, "cost": c.cost, "members": [[n, list(ss)] for n, ss in c.members]}
                for c in self.shared
            ],
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @classmethod
    def from_dict(cls, d: dict) -> ShardingProblem:
        return cls(
            nodes=tuple(
                ProblemNode(n["name"], tuple(n["costs"]), tuple(n["labels"])) for n in d["nodes"]
            ),
            edges=tuple(
                ProblemEdge(
                    e["src"],
                    e["dst"],
                    tuple(e["src_classes"]),
                    tuple(e["dst_classes"]),
                    tuple(tuple(r) for r in e["costs"]),
                    e.get("name", ""),
                )
                for e in d["edges"]
            ),
            memory=tuple(
                MemoryConstraint(
                    m["name"], m["constant"], tuple((n, tuple(b)) for n, b in m["terms"])
                )
                for m in d.get("memory", ())
            ),
            memory_limit=d.get("memory_limit"),
            aliases=tuple(tuple(a) for a in d.get("aliases", ())),
            meta=dict(d.get("meta", {})),
            shared=tuple(
                SharedCost(c["name"], c["cost"], tuple((n, tuple(ss)) for n, ss in c["members"]))
                for c in d.get("shared", ())
            ),
        )

    @classmethod
    def from_json(cls, text: str) -> ShardingProblem:
        return cls.from_dict(json.loads(text))


@dataclass(frozen=True)
class ShardingSolution:
    """The solver's answer.

    Attributes:
        choice: strategy index per node (empty when infeasible).
        objective: the choice's exact cost in seconds (``problem.objective(choice)``).
        status: ``"optimal"``, ``"feasible"`` (time limit hit), ``"infeasible"``, ``"unknown"``.
        solve_time_s: wall time of the solve.
        memory_bytes: the choice's largest memory constraint.
        bound: the solver's proven lower bound on the objective (seconds).
    """

    choice: tuple[int, ...]
    objective: float
    status: SolveStatus
    solve_time_s: float
    memory_bytes: float = 0.0
    bound: float = 0.0

    @property
    def ok(self) -> bool:
        return self.status in ("optimal", "feasible")
