"""The search: sharding strategies per operation, the intra-operator ILP, the outer loop.

* :func:`plan_graph` ``(graph, cluster, options) -> Plan``: pick a mesh and a layout for
  every tensor that minimises the predicted step time within the memory bound.
* :func:`plan_outer` ``(fn, args, graph, cluster, options) -> Plan``: the 4D outer loop
  above it (pipeline stages, the group inside a node, microbatches, schedule, stage
  remat), as ``autopar.plan`` runs it for multi-node clusters when the step has a
  scanned layer stack (pipelines split it), when the options ask for its levers, or
  when nothing fits without them.
* :func:`evaluate_plan` ``(graph, plan, cluster) -> Evaluation``: score any plan with the
  same cost model (``sources=[]`` also lists each predicted collective's
  :class:`CollectiveSource`).
* :class:`ShardingProblem` / :func:`solve` / :class:`ShardingSolution`: the ILP as plain,
  JSON-serialisable data and its solver, for replaying and testing solves on their own.

Example:
    >>> from autopar.search import ShardingProblem, ProblemNode, solve
    >>> solve(ShardingProblem((ProblemNode("a", (2.0, 1.0)),))).choice
    (1,)
"""

from autopar.search.evaluate import CollectiveSource, Evaluation, complete_plan, evaluate_plan
from autopar.search.outer import plan_outer
from autopar.search.planner import candidate_meshes, plan_graph
from autopar.search.problem import (
    MemoryConstraint,
    ProblemEdge,
    ProblemNode,
    ShardingProblem,
    ShardingSolution,
    SharedCost,
)
from autopar.search.solver import solve

__all__ = [
    "CollectiveSource",
    "Evaluation",
    "MemoryConstraint",
    "ProblemEdge",
    "ProblemNode",
    "ShardingProblem",
    "ShardingSolution",
    "SharedCost",
    "candidate_meshes",
    "complete_plan",
    "evaluate_plan",
    "plan_graph",
    "plan_outer",
    "solve",
]
