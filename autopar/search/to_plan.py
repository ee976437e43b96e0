"""Search level 3: a solution -> the :class:`~autopar.plan.Plan` users read.

Axes are named by role once solved (:func:`role_names`: ``expert`` for an expert
dimension, ``data`` for the batch, ``seq`` for the sequence, ``tensor`` for model
dims), each layer's strategies are described in words (:func:`describe_strategy`), the
ZeRO stage is read off the layouts, and every activation the ILP priced is pinned
(:func:`~autopar.search.evaluate.pinned_activations`). The prediction is the solution's
evaluation, whose step time is the solver's objective.

Example: the placeholder axis ``data`` (size 4) ends up splitting weights only, so it
is renamed ``tensor``, and the other one ``data`` (on this small MLP the solver leaves
that one idle: the mesh was fixed, and under 4 MB per device, below the replicated 6.3 MB
of weights and AdamW moments, 4-way column parallelism is cheapest).

    >>> import math
    >>> from autopar.search.intra_op import solve_mesh
    >>> result = solve_mesh(graph, cluster, {"data": 4, "tensor": 2}, SearchOptions(), 4e6)
    >>> result.rename = role_names(result.built, result.solution.choice, ("data", "tensor"))
    >>> result.rename
    {'data': 'tensor', 'tensor': 'data'}
    >>> plan = write_plan(result, graph, cluster, memory_limit=4e6)
    >>> plan.mesh, plan.layers[0].ops, plan.input("state/params/layer_0/w").spec
    ({'tensor': 4, 'data': 2}, (('dot_general', 'column(tensor)'),), (None, 'tensor'))
    >>> math.isclose(plan.predicted.step_time_s, result.solution.objective)
    True
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

import cost_models
from autopar.axes import BATCH_AXES, axes_splitting
from autopar.plan import (  # batch_only_axes: moved to plan.py (JAX-free), public here too
    LayerStrategy,
    PipelinePlan,
    Plan,
    TensorSharding,
    batch_only_axes,
)
from autopar.search.build.records import Op
from autopar.search.evaluate import decode, pinned_activations, rename_spec
from autopar.search.ilp import BuiltProblem
from autopar.search.intra_op import MeshResult
from autopar.search.meshes import expert_dims
from autopar.search.sharding import Sharding, to_plan_spec
from autopar.trace.graph import Graph

_UNUSED_AXIS_NAMES = ("data", "tensor", "seq", "fsdp", "expert")
"""Names an axis that splits nothing takes, in order of preference."""


def _split_count(spec: Sharding) -> int:
    return sum(len(dim) for dim in spec)


def batch_layouts(bp: BuiltProblem, choice: Sequence[int]) -> dict[int, Sharding]:
    """The layout each batch input (graph input index) is *used* in.

    That is its stored layout when that splits its leading (batch) dimension, else the
    most split layout its readers take it in: a ``[B, S]`` token array stored whole is
    often sliced for free by the embedding lookup that reads it, and the axis that slices
    it splits the batch as surely as one that splits the stored array. Naming axes
    (:func:`role_names`) and the ZeRO stage (:func:`zero_stage_of`) go by this layout, so
    a plan that keeps its small token arrays whole does not read as having no data
    parallelism.
    """
    out: dict[int, Sharding] = {}
    whole: dict[int, int] = {}  # the group of a batch input stored whole -> the input
    for gi in bp.graph.inputs:
        if gi.role != "batch":
            continue
        spec = bp.spec_of_input(gi.index, choice)
        out[gi.index] = spec
        if not (spec and spec[0]) and gi.tensor.ndim:
            whole[bp.op_group[bp.input_ops[gi.index]][0]] = gi.index
    if not whole:
        return out
    for _op, _k, ref, _have, need in bp.resharded_reads(choice):
        # The value read is the input or what its group computes from it (index
        # arithmetic, a reshape) with the same leading dimension.
        index = whole.get(bp.op_group.get(ref.op, (-1,))[0])
        if index is None or ref.delta or not need or not need[0]:
            continue
        src = bp.ops[ref.op]
        shape = src.node.out_tensors[ref.port].shape if src.kind == "node" else None
        batch = bp.graph.inputs[index].tensor.shape[0]
        if shape is not None and (not shape or shape[0] != batch):
            continue
        used = (tuple(need[0]),) + ((),) * (bp.graph.inputs[index].tensor.ndim - 1)
        if _split_count(used) > _split_count(out[index]):
            out[index] = used
    return out


def role_names(bp: BuiltProblem, choice: Sequence[int], allowed: Sequence[str]) -> dict[str, str]:
    """Rename placeholder axes by what the solution does with them.

    Axes that split an expert dimension of a parameter are ``expert``, axes that split
    the batch dimension ``data`` (then ``fsdp``), axes that split the sequence but not
    the batch ``seq``, the rest ``tensor``. A batch input is judged by the layout it is
    used in (:func:`batch_layouts`), not only the one it is stored in.
    """
    g = bp.graph
    mesh = list(bp.ctx.mesh_dict)
    experts = expert_dims(g) if "expert" in allowed else {}
    usage: dict[str, set[str]] = {a: set() for a in mesh}
    used_batch = batch_layouts(bp, choice)
    for gi in g.inputs:
        spec = used_batch.get(gi.index) or bp.spec_of_input(gi.index, choice)
        for d, dim in enumerate(spec):
            for a in dim:
                if gi.role == "batch":
                    usage[a].add("batch" if d == 0 else "seq")
                elif gi.role in ("param", "opt_state", "model_state"):
                    usage[a].add("expert" if experts.get(gi.index) == d else "param")
    pools = {
        "expert": list(axes_splitting("experts")),
        "batch": list(BATCH_AXES),
        "seq": list(axes_splitting("sequence")),
        "param": list(axes_splitting("model", "experts"))[::-1],  # tensor first
        "none": list(_UNUSED_AXIS_NAMES),
    }
    order = ("expert", "batch", "seq", "param", "none")
    role = {a: next((r for r in order[:-1] if r in usage[a]), "none") for a in mesh}
    taken: set[str] = set()
    out: dict[str, str] = {}
    # Axes with a role pick their names first; unused axes take what is left. Of two
    # axes with one role, the one doing only that picks first: an axis splitting the
    # batch alone is ``data`` before one that also splits weights (GPT-3 175B on 1024
    # GPUs read "tensor=128" for its 128-way batch split beside "data=8" for its
    # row-parallel weights).
    for a in sorted(mesh, key=lambda a: (order.index(role[a]), len(usage[a]))):
        choices = [n for n in pools[role[a]] + list(allowed) if n in allowed and n not in taken]
        name = choices[0] if choices else a
        taken.add(name)
        out[a] = name
    if len(set(out.values())) != len(out):
        return {a: a for a in mesh}
    return {a: out[a] for a in mesh}


# ----------------------------------------------------------------------------- describing


_WRAPPERS = re.compile(r"\b(?:jvp|transpose|vmap|remat|checkpoint|pjit|jit)\(|\)")


def _clean_name(name: str) -> str:
    return _WRAPPERS.sub("", name).strip("/")


def _weight_operand(bp: BuiltProblem, op: Op) -> int | None:
    """Which operand of a matmul is a parameter (traced back through its group)."""
    for k, ref in enumerate(op.operands[:2]):
        if ref is None or ref.op not in bp.op_group:
            continue
        g, _ = bp.op_group[ref.op]
        lead = bp.ops[bp.groups[g].ops[0]]
        if lead.root_role in ("param", "model_state"):
            return k
    return None


def describe_strategy(bp: BuiltProblem, op: Op, tags, rename: Mapping[str, str]) -> str:
    """Text like ``batch(data)+column(tensor)`` or ``row(tensor)+all-reduce``."""
    weight = _weight_operand(bp, op) if op.node.primitive == "dot_general" else None
    parts: list[str] = []
    suffix: list[str] = []
    for role, axes in tags:
        ax = ",".join(rename.get(a, a) for a in axes)
        if role in ("all-reduce", "reduce-scatter"):
            suffix.append(role)
            continue
        kind, idx = re.match(r"([a-z]+)(\d*)", role).groups()
        i = int(idx) if idx else 0
        if op.node.primitive == "dot_general":
            # i is the operand dim: b, m, k index the lhs, n the rhs.
            if kind == "b":
                word = "expert" if weight is not None else ("batch" if i == 0 else "heads")
            elif kind == "m":
                word = "column" if weight == 0 else ("batch" if i == 0 else "seq")
            elif kind == "n":
                if weight == 1:
                    word = "column"
                else:
                    word = "batch" if i == 0 else "seq" if weight == 0 else "rhs"
            else:  # k
                word = "row" if weight is not None else "contract"
        elif op.node.primitive == "gather":
            word = {"ib": "batch" if i == 0 else "seq", "off": "hidden", "idx": "vocab"}.get(
                kind, kind
            )
        elif op.node.primitive.startswith("scatter"):
            word = {"sb": "batch" if i == 0 else "seq", "win": "hidden", "idx": "vocab"}.get(
                kind, kind
            )
        else:
            word = kind
        parts.append(f"{word}({ax})")
    text = "+".join(parts) if parts else "replicated"
    for s in dict.fromkeys(suffix):
        text += f"+{s}"
    return text


def _layers(
    bp: BuiltProblem, choice: Sequence[int], rename: Mapping[str, str]
) -> tuple[LayerStrategy, ...]:
    g = bp.graph
    scan_names = {}
    for node in g.nodes:
        if node.primitive == "scan":
            scan_names[node.id] = (
                f"{_clean_name(node.name_stack) or 'scan'}[x{node.params.get('length', node.length)}]"
            )
    per_layer: dict[str, list[tuple[str, str]]] = {}
    order: list[str] = []
    for group in bp.groups:
        op = bp.ops[group.ops[0]]
        if op.kind != "node" or op.phase != "forward":
            continue
        if op.node.primitive not in (
            "dot_general",
            "conv_general_dilated",
            "gather",
        ) and not op.node.primitive.startswith("scatter"):
            continue
        if op.scope:
            layer = scan_names.get(op.scope[0][0], f"scan_{op.scope[0][0]}")
        elif op.node.layer is not None and op.node.layer < len(g.layers):
            layer = g.layers[op.node.layer].name
        else:
            layer = "(other)"
        name = _clean_name(op.node.name_stack) or op.node.primitive
        parts = name.split("/")
        for p, part in enumerate(parts):  # drop everything up to the layer's own name
            if part == layer or layer.startswith(part + "["):
                name = "/".join(parts[p + 1 :]) or name
                break
        st = bp.strategy(op.index, choice)
        if layer not in per_layer:
            per_layer[layer] = []
            order.append(layer)
        per_layer[layer].append((name, describe_strategy(bp, op, st.tags, rename)))
    return tuple(LayerStrategy(name, tuple(per_layer[name])) for name in order)


def zero_stage_of(
    batch: Sequence[Sharding],
    params: Sequence[tuple[Sharding, int]],
    opt_state: Sequence[tuple[Sharding, int]],
) -> int:
    """The ZeRO stage a layout amounts to: 3 when most parameter bytes are split over the
    data-parallel axes, 1 when (only) most optimizer-state bytes are, else 0.

    The data-parallel axes are those that split the leading (batch) dimension of every
    batch input whose leading dimension is split at all: an axis that splits one input's
    batch dimension beside another (a mask over ``('data', 'tensor')`` beside tokens over
    ``data``) is not one, so a tensor-parallel model does not read as ZeRO-3. "Most" is by
    bytes: a plan that splits only its embedding table over ``data`` is not ZeRO-3.

    Args:
        batch: the batch inputs' layouts (a tuple of axis tuples per dimension).
        params: ``(layout, bytes)`` per parameter.
        opt_state: ``(layout, bytes)`` per optimizer-state leaf.

    Example:
        >>> tokens, mask = (("data",), ()), (("data", "tensor"), ())
        >>> w, emb = ((), ("tensor",)), (("data",), ())
        >>> zero_stage_of([tokens, mask], [(w, 90), (emb, 10)], [])   # tensor parallel
        0
        >>> zero_stage_of([tokens], [(((), ("data",)), 90), (emb, 10)], [])
        3
    """
    split = [set(spec[0]) for spec in batch if spec and spec[0]]
    if not split:
        return 0
    axes = set.intersection(*split)

    def mostly(leaves: Sequence[tuple[Sharding, int]]) -> bool:
        total = sum(n for _, n in leaves)
        over = sum(n for spec, n in leaves if any(a in axes for dim in spec for a in dim))
        return total > 0 and 2 * over >= total

    if mostly(params):
        return 3
    return 1 if mostly(opt_state) else 0


def _zero_stage(bp: BuiltProblem, choice: Sequence[int]) -> int:
    g = bp.graph

    def leaves(role: str) -> list[tuple[Sharding, int]]:
        return [
            (bp.spec_of_input(gi.index, choice), gi.tensor.nbytes)
            for gi in g.inputs
            if gi.role == role
        ]

    batch = list(batch_layouts(bp, choice).values())
    return zero_stage_of(batch, leaves("param"), leaves("opt_state"))


def write_plan(
    result: MeshResult,
    graph: Graph,
    cluster: Any,
    memory_limit: float | None,
    pipeline: PipelinePlan | None = None,
) -> Plan:
    """The plan of one solved mesh (``result.rename`` names its axes; ``graph``: the
    step on its whole batch, whose inputs and outputs the plan describes; ``pipeline``:
    its microbatching, if any)."""
    bp, choice = result.built, result.solution.choice
    rename = result.rename or {a: a for a in bp.ctx.mesh_dict}
    evaluation = decode(
        bp, choice, rename, status=result.solution.status, memory_limit=memory_limit
    )
    return Plan(
        mesh={rename[a]: s for a, s in bp.ctx.mesh_dict.items()},
        inputs=tuple(
            TensorSharding(
                gi.path,
                gi.tensor.shape,
                gi.tensor.dtype,
                to_plan_spec(rename_spec(bp.spec_of_input(gi.index, choice), rename)),
                gi.role,
            )
            for gi in graph.inputs
        ),
        outputs=tuple(
            TensorSharding(
                go.path,
                go.tensor.shape,
                go.tensor.dtype,
                to_plan_spec(rename_spec(bp.spec_of_output(go.index, choice), rename)),
                "output",
            )
            for go in graph.outputs
        ),
        activations=pinned_activations(bp, choice, rename),
        zero_stage=_zero_stage(bp, choice),
        pipeline=pipeline,
        layers=_layers(bp, choice, rename),
        predicted=evaluation.to_predicted(),
        cluster=cluster.to_json(),
        cost_model_version=cost_models.COST_MODEL_VERSION,
        in_tree=graph.in_tree,
        out_tree=graph.out_tree,
    )


__all__ = [
    "batch_layouts",
    "batch_only_axes",
    "describe_strategy",
    "role_names",
    "write_plan",
    "zero_stage_of",
]
