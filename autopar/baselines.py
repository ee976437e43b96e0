"""Hand-written parallel plans, the expert configurations the planner is compared against.

Each function takes a traced :class:`~autopar.trace.graph.Graph` (or the step function
followed by its arguments) and a mesh (``{"data": 8}``, or a ``jax.sharding.Mesh``) and
returns a :class:`~autopar.plan.Plan` with a spec for every input and output leaf:

* :func:`data_parallel`: the batch split over every mesh axis, everything else replicated.
* :func:`zero`: data parallel plus ZeRO: stage 1 shards optimizer state, stage 2 also
  gradients (inside the step, so its in/out layout equals stage 1's), stage 3 (FSDP) also
  parameters; sharded over every non-``tensor_axis`` axis.
* :func:`megatron`: tensor parallelism by parameter *name* (Megatron-LM): ``q/k/v/qkv``,
  ``fc_in/fc_gate/wi`` split column-wise (output dim), ``out/fc_out/wo`` row-wise (input
  dim), token embeddings on the vocabulary; the batch replicated over ``tensor`` and split
  over the other axes.
* :func:`data_tensor`: 2D, the batch over ``data`` and Megatron over ``tensor``.
* :func:`expert_parallel`: MoE experts split over ``expert`` (GShard), batch over all axes.

Optimizer-state leaves follow their parameter's spec (matched by the path after
``opt_state/...`` and the shape, so both ``opt_state/0/mu/<param>`` and the mixed-precision
``opt_state/master/<param>`` and ``opt_state/adam/0/nu/<param>`` work). An updated output
gets its input's spec; the loss and other outputs are replicated. A dimension is only split
over axes whose size divides it; otherwise that leaf stays replicated (or, for ZeRO with
``pad=True``, is split unevenly in padded partitions, which is priced but not lowered) and
the fallback is recorded in ``plan.layers`` under ``"fallbacks"``. ``plan.predicted`` is left empty: score
a baseline with ``autopar.evaluate``.

Example:
    >>> from benchmarks.models.gpt import GPTConfig, make_train_step
    >>> step, (state, batch) = make_train_step(GPTConfig.preset("tiny"), 8)
    >>> plan = megatron(step, {"data": 2, "tensor": 4}, state, batch)
    >>> plan.input("params/h/attn/q/kernel").spec
    (None, None, 'tensor')
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import jax
import numpy as np

from autopar.errors import InvalidOptionError
from autopar.lower.lowering import arg_names, leaf_paths
from autopar.plan import LayerStrategy, Plan, Predicted, Spec, SpecEntry, TensorSharding

# Megatron-LM's split, by the name of the parameter or of the module that owns it.
COLUMN_NAMES = frozenset(
    {"q", "k", "v", "qkv", "query", "key", "value", "fc_in", "fc_gate", "wi", "wi_0", "wi_1",
     "fc1", "up", "gate", "up_proj", "gate_proj", "q_proj", "k_proj", "v_proj"}
)  # fmt: skip
ROW_NAMES = frozenset({"out", "o", "fc_out", "wo", "fc2", "down", "down_proj", "o_proj"})
POSITION_EMBEDDING_NAMES = frozenset({"wpe", "pos_embed", "pos_emb", "position_embeddings"})
EXPERT_NAMES = frozenset({"wi", "wo", "wi_0", "wi_1", "experts"})
_LEAF_NAMES = frozenset({"kernel", "bias", "embedding", "scale", "weight"})


@dataclass(frozen=True)
class Leaf:
    """One flat input or output leaf as a baseline sees it."""

    path: str
    shape: tuple[int, ...]
    dtype: str
    role: str
    output_index: int | None = None  # for inputs: the output that is its update


# ------------------------------------------------------------------------------- leaves


def _role_from_path(path: str, stateful: bool) -> str:
    parts = path.split("/")
    if "opt_state" in parts:
        return "opt_state"
    if "params" in parts:
        return "param"
    return "model_state" if stateful else "batch"


def _dtype_name(x: Any) -> str:
    """The dtype name of a leaf as the tracer records it (Python scalars and typed PRNG
    keys included)."""
    return str(jax.typeof(x).dtype)


def describe(graph_or_fn: Any, args: Sequence[Any] = ()) -> tuple[list[Leaf], list[Leaf], Any, Any]:
    """Input and output leaves (and the trees to bind) of a graph or of ``fn(*args)``.

    From a function, roles come from paths: under ``opt_state`` -> optimizer state, under
    ``params`` -> parameter, other leaves of an argument holding parameters -> model state,
    leaves of other arguments -> batch. An output is an input's update when its path after
    the first part equals the input's (``0/params/w`` updates ``state/params/w``).
    """
    if hasattr(graph_or_fn, "inputs") and hasattr(graph_or_fn, "outputs"):
        g = graph_or_fn
        ins = [
            Leaf(i.path, tuple(i.tensor.shape), str(i.tensor.dtype), i.role, i.output_index)
            for i in g.inputs
        ]
        outs = [
            Leaf(o.path, tuple(o.tensor.shape), str(o.tensor.dtype), "other") for o in g.outputs
        ]
        return ins, outs, g.in_tree, g.out_tree
    fn: Callable = graph_or_fn
    if not callable(fn):
        raise InvalidOptionError(f"expected a Graph or a function, got {type(fn).__name__}.")
    args = tuple(args)
    names = arg_names(fn, len(args))
    paths = leaf_paths(args, names)
    leaves, in_tree = jax.tree_util.tree_flatten(args)
    heads = [p.split("/", 1)[0] for p in paths]
    # An argument holding parameters or optimizer state is the model state.
    stateful_args = {
        h for h, p in zip(heads, paths, strict=True) if {"params", "opt_state"} & set(p.split("/"))
    }
    out = jax.eval_shape(fn, *args)
    out_leaves, out_tree = jax.tree_util.tree_flatten(out)
    out_paths = leaf_paths((out,), ["out"])
    out_key = {}
    for j, (p, x) in enumerate(zip(out_paths, out_leaves, strict=True)):
        key = p.split("/", 2)[-1] if p.count("/") >= 2 else None
        if key is not None:
            out_key.setdefault((key, tuple(x.shape), _dtype_name(x)), j)
    ins = []
    for p, h, x in zip(paths, heads, leaves, strict=True):
        shape, dtype = tuple(np.shape(x)), _dtype_name(x)
        role = _role_from_path(p, h in stateful_args)
        key = p.split("/", 1)[-1]
        ins.append(Leaf(p, shape, dtype, role, out_key.get((key, shape, dtype))))
    outs = [
        Leaf(p, tuple(x.shape), _dtype_name(x), "other")
        for p, x in zip(out_paths, out_leaves, strict=True)
    ]
    return ins, outs, in_tree, out_tree


def _mesh_dict(mesh: Any) -> dict[str, int]:
    if isinstance(mesh, Mapping):
        return {str(k): int(v) for k, v in mesh.items()}
    if hasattr(mesh, "shape") and hasattr(mesh, "axis_names"):
        return {str(a): int(mesh.shape[a]) for a in mesh.axis_names}
    raise InvalidOptionError(f"mesh={mesh!r} must be a mapping axis -> size or a jax Mesh.")


# ------------------------------------------------------------------------------- specs


def _entry(axes: Sequence[str]) -> SpecEntry:
    return None if not axes else (axes[0] if len(axes) == 1 else tuple(axes))


def _size(mesh: Mapping[str, int], axes: Sequence[str]) -> int:
    return math.prod(mesh[a] for a in axes)


def _names(path: str) -> tuple[str, str]:
    """(leaf name, owner name): ``.../q/kernel`` -> ``("kernel", "q")``."""
    parts = path.split("/")
    leaf = parts[-1]
    owner = parts[-2] if len(parts) > 1 else ""
    return leaf, owner


def _param_key(path: str) -> str | None:
    parts = path.split("/")
    if "params" not in parts:
        return None
    return "/".join(parts[parts.index("params") + 1 :])


class _Builder:
    """Collects specs and the fallbacks taken."""

    def __init__(self, mesh: Mapping[str, int]) -> None:
        self.mesh = dict(mesh)
        self.fallbacks: list[tuple[str, str]] = []

    def split(
        self, spec: list[SpecEntry], shape: Sequence[int], dim: int, axes: Sequence[str], path: str
    ) -> bool:
        """Put ``axes`` on ``dim`` if they divide it; record a fallback otherwise."""
        if not axes:
            return True
        n = _size(self.mesh, axes)
        if not -len(shape) <= dim < len(shape):
            self.fallbacks.append(
                (path, f"rank {len(shape)} has no dim {dim} to split over {tuple(axes)}")
            )
            return False
        if shape[dim] % n:
            self.fallbacks.append(
                (
                    path,
                    f"dim {dim % len(shape)} ({shape[dim]}) not divisible by {tuple(axes)}={n}: replicated",
                )
            )
            return False
        spec[dim] = _entry(axes)
        return True

    def shard_free_dim(
        self,
        spec: list[SpecEntry],
        shape: Sequence[int],
        axes: Sequence[str],
        path: str,
        pad: bool = False,
    ) -> None:
        """ZeRO: split the largest still-unsplit dim that ``axes`` divide (ties: the last);
        with ``pad``, if none divides, the largest of at least ``n`` elements unevenly (padded
        partitions, as DeepSpeed's flattened ZeRO-3 buffers; priced, not lowered)."""
        if not axes or not shape:
            return
        n = _size(self.mesh, axes)
        free = [
            d for d in range(len(shape)) if spec[d] is None and shape[d] % n == 0 and shape[d] >= n
        ]
        if not free and pad:
            free = [d for d in range(len(shape)) if spec[d] is None and shape[d] >= n]
            if free:
                self.fallbacks.append(
                    (path, f"no dim of {tuple(shape)} divisible by {tuple(axes)}={n}: padded")
                )
        if not free:
            self.fallbacks.append(
                (path, f"no dim of {tuple(shape)} divisible by {tuple(axes)}={n}: not sharded")
            )
            return
        best = max(free, key=lambda d: (shape[d], d))
        spec[best] = _entry(axes)


def _tensor_spec(b: _Builder, leaf: Leaf, tensor_axis: str | None) -> list[SpecEntry]:
    spec: list[SpecEntry] = [None] * len(leaf.shape)
    if tensor_axis is None or not leaf.shape:
        return spec
    name, owner = _names(leaf.path)
    module = name if name not in _LEAF_NAMES else owner
    if module in COLUMN_NAMES:
        b.split(spec, leaf.shape, -1, (tensor_axis,), leaf.path)
    elif module in ROW_NAMES:
        if name != "bias":  # the row-parallel bias is added after the all-reduce
            b.split(spec, leaf.shape, -2, (tensor_axis,), leaf.path)
    elif name == "embedding" and owner not in POSITION_EMBEDDING_NAMES and len(leaf.shape) >= 2:
        b.split(spec, leaf.shape, -2, (tensor_axis,), leaf.path)
    return spec


def _expert_spec(b: _Builder, leaf: Leaf, expert_axis: str | None) -> list[SpecEntry]:
    spec: list[SpecEntry] = [None] * len(leaf.shape)
    if expert_axis is None:
        return spec
    name, owner = _names(leaf.path)
    if (name in EXPERT_NAMES or owner in EXPERT_NAMES) and len(leaf.shape) >= 3:
        b.split(spec, leaf.shape, -3, (expert_axis,), leaf.path)
    return spec


def _build(
    graph_or_fn: Any,
    mesh: Any,
    args: Sequence[Any],
    *,
    name: str,
    batch_axes: Sequence[str],
    zero_axes: Sequence[str] = (),
    zero_stage: int = 0,
    tensor_axis: str | None = None,
    expert_axis: str | None = None,
    pad: bool = False,
) -> Plan:
    mesh_d = _mesh_dict(mesh)
    for ax in (*batch_axes, *zero_axes, *(a for a in (tensor_axis, expert_axis) if a)):
        if ax not in mesh_d:
            raise InvalidOptionError(
                f"axis {ax!r} is not in the mesh {mesh_d}; axes: {list(mesh_d)}."
            )
    ins, outs, in_tree, out_tree = describe(graph_or_fn, args)
    b = _Builder(mesh_d)

    def model_spec(leaf: Leaf) -> list[SpecEntry]:
        spec = _tensor_spec(b, leaf, tensor_axis)
        if expert_axis is not None:
            ex = _expert_spec(b, leaf, expert_axis)
            spec = [e if e is not None else s for e, s in zip(ex, spec, strict=True)]
        return spec

    # Parameters first: optimizer-state leaves (which flatten before "params") follow them.
    param_specs: dict[tuple[str, tuple[int, ...]], list[SpecEntry]] = {}
    model_specs: dict[int, list[SpecEntry]] = {}
    for i, leaf in enumerate(ins):
        if leaf.role == "param":
            model_specs[i] = model_spec(leaf)
            key = _param_key(leaf.path)
            if key is not None:
                param_specs[(key, leaf.shape)] = list(model_specs[i])
    specs: list[Spec] = []
    for i, leaf in enumerate(ins):
        spec: list[SpecEntry] = [None] * len(leaf.shape)
        if leaf.role == "batch":
            if leaf.shape:
                b.split(spec, leaf.shape, 0, tuple(batch_axes), leaf.path)
        elif leaf.role == "param":
            spec = list(model_specs[i])
            if zero_stage >= 3:
                b.shard_free_dim(spec, leaf.shape, zero_axes, leaf.path, pad)
        elif leaf.role == "opt_state":
            spec = _follow_param(leaf, param_specs)
            if zero_stage >= 1:
                b.shard_free_dim(spec, leaf.shape, zero_axes, leaf.path, pad)
        specs.append(tuple(spec))

    inputs = tuple(
        TensorSharding(leaf.path, leaf.shape, leaf.dtype, spec, leaf.role)
        for leaf, spec in zip(ins, specs, strict=True)
    )
    by_output = {
        leaf.output_index: (spec, leaf.role)
        for leaf, spec in zip(ins, specs, strict=True)
        if leaf.output_index is not None
    }
    outputs = []
    for j, leaf in enumerate(outs):
        spec, role = by_output.get(j, ((None,) * len(leaf.shape), "other"))
        outputs.append(TensorSharding(leaf.path, leaf.shape, leaf.dtype, spec, role))
    layers = ()
    if b.fallbacks:
        layers = (LayerStrategy("fallbacks", tuple(b.fallbacks)),)
    plan = Plan(
        mesh=mesh_d,
        inputs=inputs,
        outputs=tuple(outputs),
        zero_stage=zero_stage,
        layers=layers,
        name=name,
    )
    return plan.bind(in_tree, out_tree)


def _follow_param(
    leaf: Leaf, param_specs: Mapping[tuple[str, tuple[int, ...]], list[SpecEntry]]
) -> list[SpecEntry]:
    """An optimizer-state leaf's spec: its parameter's (path suffix after ``opt_state`` and
    shape equal), else replicated (step counters, scalars)."""
    parts = leaf.path.split("/")
    rest = parts[parts.index("opt_state") + 1 :] if "opt_state" in parts else parts
    for start in range(len(rest)):
        key = "/".join(rest[start:])
        spec = param_specs.get((key, leaf.shape))
        if spec is not None:
            return list(spec)
    return [None] * len(leaf.shape)


# ------------------------------------------------------------------------------- plans


def data_parallel(graph_or_fn: Any, mesh: Any, *args: Any) -> Plan:
    """Pure data parallelism: the batch over every mesh axis, the rest replicated.

    Example:
        >>> plan = data_parallel(step, {"data": 8}, state, batch)
        >>> plan.input("batch/x").spec, plan.input("params/layer_0/w").spec
        (('data', None), (None, None))
    """
    axes = tuple(_mesh_dict(mesh))
    return _build(graph_or_fn, mesh, args, name="data_parallel", batch_axes=axes)


def zero(
    graph_or_fn: Any,
    mesh: Any,
    stage: int = 3,
    *args: Any,
    tensor_axis: str | None = None,
    pad: bool = False,
) -> Plan:
    """ZeRO stage 1/2/3 (stage 3 = FSDP) over every axis but ``tensor_axis``.

    With ``tensor_axis`` given, parameters are also split Megatron-style over it. From a
    function the arguments follow the stage: ``zero(step, mesh, 3, state, batch)``.
    ``pad=True``: a leaf no dim of which the ZeRO axes divide is split unevenly on its
    largest dim, as padded partitions (DeepSpeed flattens and pads; ``autopar.evaluate``
    prices it, the lowering refuses it), instead of kept whole.

    Example:
        >>> plan = zero(graph, {"data": 8}, stage=3)
        >>> plan.zero_stage, plan.input("params/layer_0/w").spec
        (3, (None, 'data'))
    """
    if stage not in (1, 2, 3):
        raise InvalidOptionError(f"stage={stage!r} must be 1, 2 or 3.")
    mesh_d = _mesh_dict(mesh)
    axes = tuple(a for a in mesh_d if a != tensor_axis)
    return _build(
        graph_or_fn, mesh, args, name=f"zero{stage}" + (f"+{tensor_axis}" if tensor_axis else ""),
        batch_axes=axes, zero_axes=axes, zero_stage=stage, tensor_axis=tensor_axis, pad=pad,
    )  # fmt: skip


def megatron(graph_or_fn: Any, mesh: Any, *args: Any, tensor_axis: str = "tensor") -> Plan:
    """Megatron-LM tensor parallelism over ``tensor_axis``; the batch over the other axes.

    Example:
        >>> from benchmarks.models.gpt import GPTConfig, make_train_step
        >>> step, (state, batch) = make_train_step(GPTConfig.preset("tiny"), 8)
        >>> plan = megatron(step, {"tensor": 8}, state, batch)
        >>> plan.input("params/h/mlp/fc_out/kernel").spec
        (None, 'tensor', None)
    """
    mesh_d = _mesh_dict(mesh)
    if tensor_axis not in mesh_d:
        raise InvalidOptionError(f"megatron needs a {tensor_axis!r} axis; the mesh is {mesh_d}.")
    axes = tuple(a for a in mesh_d if a != tensor_axis)
    return _build(
        graph_or_fn, mesh, args, name="megatron", batch_axes=axes, tensor_axis=tensor_axis
    )


def data_tensor(
    graph_or_fn: Any, mesh: Any, *args: Any, data_axis: str = "data", tensor_axis: str = "tensor"
) -> Plan:
    """2D parallelism: the batch over ``data_axis`` (and any other non-tensor axis),
    Megatron over ``tensor_axis``.

    Example:
        >>> from benchmarks.models.gpt import GPTConfig, make_train_step
        >>> step, (state, batch) = make_train_step(GPTConfig.preset("tiny"), 8)
        >>> plan = data_tensor(step, {"data": 2, "tensor": 4}, state, batch)
        >>> plan.input("batch/tokens").spec, plan.input("params/h/mlp/fc_in/kernel").spec
        (('data', None), (None, None, 'tensor'))
    """
    mesh_d = _mesh_dict(mesh)
    for ax in (data_axis, tensor_axis):
        if ax not in mesh_d:
            raise InvalidOptionError(f"data_tensor needs a {ax!r} axis; the mesh is {mesh_d}.")
    axes = tuple(a for a in mesh_d if a != tensor_axis)
    return _build(
        graph_or_fn, mesh, args, name="data+tensor", batch_axes=axes, tensor_axis=tensor_axis
    )


def expert_parallel(graph_or_fn: Any, mesh: Any, *args: Any, expert_axis: str = "expert") -> Plan:
    """GShard expert parallelism: expert weights (``wi``/``wo`` with a leading expert dim)
    split over ``expert_axis``, the batch over every axis, other parameters replicated.

    Example:
        >>> from benchmarks.models.moe import MoEConfig, make_train_step
        >>> step, (state, batch) = make_train_step(MoEConfig.preset("tiny"), 8)
        >>> plan = expert_parallel(step, {"data": 2, "expert": 4}, state, batch)
        >>> plan.input("params/h_1/moe/wi").spec, plan.input("batch/tokens").spec
        (('expert', None, None), (('data', 'expert'), None))
    """
    mesh_d = _mesh_dict(mesh)
    if expert_axis not in mesh_d:
        raise InvalidOptionError(
            f"expert_parallel needs a {expert_axis!r} axis; the mesh is {mesh_d}."
        )
    return _build(
        graph_or_fn,
        mesh,
        args,
        name="expert_parallel",
        batch_axes=tuple(mesh_d),
        expert_axis=expert_axis,
    )


def fallbacks(plan: Plan) -> tuple[tuple[str, str], ...]:
    """The ``(path, reason)`` of every leaf a baseline left replicated for divisibility."""
    for layer in plan.layers:
        if layer.layer == "fallbacks":
            return layer.ops
    return ()


def pipeline(
    fn: Any,
    mesh: Any,
    *args: Any,
    microbatches: int,
    schedule: str = "1f1b",
    stages: Sequence[tuple[int, int]] | None = None,
    virtual_stages: int = 1,
    inner: Plan | Callable[..., Plan] | None = None,
    stage_remat: str | Sequence[str] = "none",
    accumulation: Any = None,
) -> Plan:
    """Pipeline parallelism over the mesh's ``pipe`` axis, data parallel (or ``inner``)
    over the rest.

    The step's layers (found in the graph, not by name) are split into ``pipe`` stages of
    equal size (or the ``[start, stop)`` ``stages`` given); a scanned layer stack and its
    optimizer state are sharded over ``pipe`` on the layer dim (each stage holds its
    layers), the batch over the other axes; the batch is split into ``microbatches``
    that run in ``schedule`` (``"gpipe"``, ``"1f1b"``, or ``"interleaved-1f1b"`` with
    ``virtual_stages`` chunks per device: the layers are then split into ``pipe *
    virtual_stages`` equal chunks, device ``d`` running chunks ``d, pipe + d, ...``).

    Inside the stages the other axes are intra-op parallel as ``inner`` says: a plan for
    the same step on the mesh without ``pipe`` (e.g. a searched one), or a baseline
    called as ``inner(fn, sub_mesh, *args)`` (``megatron`` gives Megatron-LM's 3D
    parallelism: tensor inside the stages, data across them). Its input and output
    layouts are kept, with ``pipe`` added on the layer axis of the scanned stack (which no
    other axis may split: each stage runs its own layers whole; such a split is dropped).
    Without ``inner`` the batch is split over the data axes and everything else
    replicated.

    ``stage_remat`` (``"none"`` or ``"full"``, for every stage, or one per stage range)
    makes a stage keep only its input and re-run its forward in its backward
    (:mod:`autopar.lower.stage_remat`).

    ``accumulation``: the step already analysed for ``microbatches``
    (:func:`autopar.lower.split.plan_accumulation` of ``fn(*args)``), to save re-tracing it.

    Example:
        >>> from benchmarks.models.gpt import GPTConfig, make_train_step
        >>> gstep, (gstate, gbatch) = make_train_step(GPTConfig.preset("tiny"), 8)
        >>> plan = pipeline(gstep, {"pipe": 2, "data": 4}, gstate, gbatch, microbatches=2)
        >>> plan.pipeline.stages, plan.pipeline.microbatches, plan.input("batch/tokens").spec
        (((0, 1), (1, 2)), 2, ('data', None))
    """
    from autopar.axes import batch_axes
    from autopar.lower.pipeline import cut_stages
    from autopar.lower.split import even_stages, gradient_graph, plan_accumulation
    from autopar.plan import PipelinePlan
    from autopar.trace import trace

    mesh_d = _mesh_dict(mesh)
    p = mesh_d.get("pipe", 1)
    if p < 2:
        raise InvalidOptionError(f"mesh {mesh_d} needs a 'pipe' axis of size >= 2 to pipeline.")
    if not callable(fn) or hasattr(fn, "nodes"):
        raise InvalidOptionError(
            "pipeline() re-traces the step on one microbatch: pass the step function and its "
            "arguments, not a traced graph."
        )
    if accumulation is not None and accumulation.microbatches == microbatches:
        graph, acc = accumulation.full, accumulation
    else:
        graph = trace(fn, *args)
        acc = plan_accumulation(fn, args, microbatches, full=graph)
    ggraph = gradient_graph(acc, args)
    v = int(virtual_stages)
    if v > 1 and schedule != "interleaved-1f1b":
        raise InvalidOptionError(
            f"virtual_stages={v} needs schedule='interleaved-1f1b'; got {schedule!r}."
        )
    stages = tuple(stages) if stages is not None else even_stages(len(ggraph.layers), p * v)
    cut = cut_stages(ggraph, stages, batch_inputs=acc.batch_inputs)
    data = tuple(a for a in batch_axes(mesh_d) if a != "pipe")
    sub = {a: n for a, n in mesh_d.items() if a != "pipe"}
    if inner is None:
        plan = _build(graph, mesh_d, (), name=f"pipeline-{schedule}", batch_axes=data)
    else:
        if not isinstance(inner, Plan) and not callable(inner):
            raise InvalidOptionError(
                f"inner={inner!r}: give a Plan for the mesh without 'pipe' ({sub}) or a "
                "baseline called as inner(fn, mesh, *args), e.g. autopar.baselines.megatron."
            )
        within = inner if isinstance(inner, Plan) else inner(fn, sub or {"data": 1}, *args)
        plan = _within_stages(graph, within, mesh_d, f"pipeline-{schedule}+{within.name}")
    stacked = set(cut.stacked_inputs)
    from autopar.search.build.coarsen import match_optimizer_state

    for param, states in match_optimizer_state(graph).items():
        if param in stacked:
            stacked.update(states)

    def on_pipe(rec: TensorSharding) -> TensorSharding:
        spec = list(rec.spec)
        spec[0] = "pipe"  # the layer axis: each stage holds its layers whole
        return replace(rec, spec=tuple(spec))

    inputs = tuple(on_pipe(r) if i in stacked else r for i, r in enumerate(plan.inputs))
    moved = {graph.inputs[i].output_index for i in stacked} - {None}
    outputs = tuple(on_pipe(r) if j in moved else r for j, r in enumerate(plan.outputs))
    return replace(
        plan,
        inputs=inputs,
        outputs=outputs,
        zero_stage=_pipeline_zero_stage(inputs, data),
        pipeline=PipelinePlan(
            stages,
            schedule,
            microbatches,
            chunks=v,
            stage_remat=_stage_remat(stage_remat, len(stages)),
        ),
    ).bind(graph.in_tree, graph.out_tree)


def _pipeline_zero_stage(inputs: Sequence[TensorSharding], data: Sequence[str]) -> int:
    """The ZeRO stage of a pipeline's layouts: what the stages' layouts split over the
    data-parallel axes (``data``: the mesh's batch axes other than ``pipe``), by bytes, as
    :func:`autopar.search.to_plan.zero_stage_of` reads an intra-op plan (a microbatched
    stage may store its batch split on another dim than the batch's, so the data axes are
    the mesh's, not read from the batch layouts)."""
    from autopar.search.sharding import from_plan_spec
    from autopar.search.to_plan import zero_stage_of
    from autopar.trace.tensor import itemsize

    def leaves(role: str) -> list[tuple[Any, int]]:
        return [
            (from_plan_spec(r.spec, len(r.shape)), math.prod(r.shape) * itemsize(r.dtype))
            for r in inputs
            if r.role == role
        ]

    batch = [((*data,),)] if data else []
    return zero_stage_of(batch, leaves("param"), leaves("opt_state"))


def _stage_remat(policy: str | Sequence[str], n: int) -> tuple[str, ...]:
    """Per stage range; ``()`` when no stage is rematerialised (the default a hand edit
    of the stage ranges keeps valid)."""
    policies = (policy,) * n if isinstance(policy, str) else tuple(policy)
    return () if all(p == "none" for p in policies) else policies


def _within_stages(graph: Any, within: Plan, mesh: Mapping[str, int], name: str) -> Plan:
    """``within``'s layouts (a plan on the mesh without ``pipe``) on the whole ``mesh``."""
    sub = {a: n for a, n in mesh.items() if a != "pipe"}
    if "pipe" in within.mesh or dict(within.mesh) != (sub or dict(within.mesh)):
        raise InvalidOptionError(
            f"the plan inside the stages is for the mesh {dict(within.mesh)}; it must be for "
            f"the pipeline's mesh without 'pipe', {sub}."
        )
    if len(within.inputs) != len(graph.inputs) or any(
        tuple(r.shape) != tuple(gi.tensor.shape)
        for r, gi in zip(within.inputs, graph.inputs, strict=True)
    ):
        raise InvalidOptionError(
            f"the plan inside the stages ({within.name!r}) has {len(within.inputs)} inputs "
            f"that do not match the step's {len(graph.inputs)}; plan the same step."
        )
    return replace(
        within,
        mesh=dict(mesh),
        name=name,
        activations=(),
        pipeline=None,
        remat="none",
        predicted=Predicted(step_time_s=0.0),
    )


__all__ = [
    "COLUMN_NAMES",
    "ROW_NAMES",
    "data_parallel",
    "data_tensor",
    "describe",
    "expert_parallel",
    "fallbacks",
    "megatron",
    "pipeline",
    "zero",
]
