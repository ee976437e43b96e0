"""Export a plan to the forms other JAX code reads, and import specs back as a plan.

Three views of one :class:`~autopar.plan.Plan`:

* :func:`partition_specs`: a pytree of ``jax.sharding.PartitionSpec`` matching the step's
  arguments (or results), ready for ``jax.jit(in_shardings=...)`` with a mesh.
* :func:`named_shardings`: the same with the plan's mesh attached (``NamedSharding``).
* :func:`logical_axis_rules`: Flax ``nn.logical_axis_rules``-style
  ``(logical_name, mesh_axes)`` pairs, with :func:`logical_axes` naming every parameter
  dimension (what a model's ``nn.with_logical_partitioning`` would say).

And back: :func:`plan_from_specs` turns a ``PartitionSpec`` (or ``NamedSharding``) pytree
for a step's arguments into a plan the lowering runs; ``autopar.autoparallel(step,
plan=specs)`` calls it.

What maps and what does not: specs carry the layout of every argument, nothing else.
A pipelined plan's stages, its microbatches, its remat policy and its activation
constraints are not in them. :func:`plan_from_specs` re-derives activation layouts by
completing the plan with the planner's objective (the cheapest layouts given the fixed
inputs and outputs, as the search prices them: for a searched plan's specs, the search's
own choice). Outputs that update an input take that input's spec, the others are
replicated. Logical-axis rules are per parameter dimension: optimizer state laid out
unlike its parameter (ZeRO-1/2) and batch inputs are reported in
:attr:`LogicalAxes.unmapped` (they are not parameters a Flax model annotates).

Example:
    >>> from autopar import export
    >>> p = autopar.Plan(mesh={"data": 2, "tensor": 4}, inputs=(
    ...     autopar.TensorSharding("state/params/fc/kernel", (16, 32), "float32",
    ...                            (None, "tensor"), "param"),
    ...     autopar.TensorSharding("batch/x", (8, 16), "float32", ("data", None), "batch")))
    >>> export.partition_specs(p)
    {'state/params/fc/kernel': P(None, 'tensor'), 'batch/x': P('data',)}
    >>> export.logical_axis_rules(p)
    (('fc.in', None), ('fc.out', 'tensor'))
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
from jax.sharding import NamedSharding, PartitionSpec
from jax.sharding import PartitionSpec as P  # noqa: F401  (docstring examples)

from autopar.errors import LoadPlanError
from autopar.plan import (  # per_device_shape: public here too (it moved to plan.py, JAX-free)
    Plan,
    Spec,
    SpecEntry,
    TensorSharding,
    per_device_shape,
    spec_axes,
    to_partition_spec,
)

__all__ = [
    "ImportSpecsError",
    "LogicalAxes",
    "is_spec_tree",
    "logical_axes",
    "logical_axis_rules",
    "named_shardings",
    "partition_specs",
    "per_device_shape",
    "plan_from_specs",
]


class ImportSpecsError(LoadPlanError):
    """A ``PartitionSpec`` pytree does not fit the step it is applied to (structure, rank,
    mesh axis, divisibility); the message names the leaf."""


# ------------------------------------------------------------------------------- export


def _args_tree(tree: Any) -> Any:
    """The arguments' tree of a graph's ``(args, kwargs)`` tree when there are no keyword
    arguments (specs then match the positional arguments tuple), else ``tree``."""
    if tree is None:
        return None
    children = tree.children()
    if len(children) == 2 and children[1] == jax.tree_util.tree_structure({}):
        return children[0]
    return tree


def _unflatten(records: Sequence[TensorSharding], leaves: list, tree: Any, like: Any) -> Any:
    if like is not None:
        like_leaves, like_tree = jax.tree_util.tree_flatten(like)
        if len(like_leaves) != len(records):
            raise ImportSpecsError(
                f"like= has {len(like_leaves)} leaves but the plan describes {len(records)}; "
                "pass the arguments (or results) the plan was made for."
            )
        for x, r in zip(like_leaves, records, strict=True):
            if tuple(getattr(x, "shape", ())) != tuple(r.shape):
                raise ImportSpecsError(
                    f"like= leaf of shape {tuple(getattr(x, 'shape', ()))} where the plan has "
                    f"{r.path} {tuple(r.shape)}; pass the arguments the plan was made for."
                )
        return jax.tree_util.tree_unflatten(like_tree, leaves)
    if tree is not None:
        return jax.tree_util.tree_unflatten(_args_tree(tree), leaves)
    return {r.path: s for r, s in zip(records, leaves, strict=True)}


def partition_specs(plan: Plan, *, like: Any = None, outputs: bool = False) -> Any:
    """The plan's layouts as a pytree of ``PartitionSpec``, one per argument leaf.

    Args:
        plan: any plan.
        like: a pytree with the arguments' structure (the arrays, or ``ShapeDtypeStruct``s)
            to shape the result like; needed for a plan loaded from JSON, which does not
            record the pytree structure. Without it a loaded plan gives a dict by path.
        outputs: the results' layouts instead of the arguments'.

    Returns:
        A pytree of ``PartitionSpec`` (trailing ``None`` dims dropped) matching the step's
        arguments (a tuple, one entry per argument), or a ``{path: PartitionSpec}`` dict.

    Example:
        >>> specs = partition_specs(plan, like=(state, batch))
        >>> specs[0]["params"]["layer_0"]["w"] == P(*plan.input("layer_0/w").spec)
        True
    """
    records = plan.outputs if outputs else plan.inputs
    tree = plan.out_tree if outputs else plan.in_tree
    return _unflatten(records, [to_partition_spec(r.spec) for r in records], tree, like)


def named_shardings(plan: Plan, *, like: Any = None, outputs: bool = False, devices=None) -> Any:
    """As :func:`partition_specs`, with the plan's mesh attached (``NamedSharding``s on
    ``autopar.lower.mesh.make_mesh(plan.mesh)``): what ``jax.jit(in_shardings=...)`` and
    ``jax.device_put`` take, and what ``autoparallel(plan=...)`` reads the mesh from.

    Example:
        >>> sh = named_shardings(plan, like=(state, batch))
        >>> dict(sh[1]["x"].mesh.shape) == plan.mesh
        True
    """
    from autopar.lower.mesh import make_mesh

    mesh = make_mesh(plan.mesh, devices)
    records = plan.outputs if outputs else plan.inputs
    tree = plan.out_tree if outputs else plan.in_tree
    leaves = [NamedSharding(mesh, to_partition_spec(r.spec)) for r in records]
    return _unflatten(records, leaves, tree, like)


# ----------------------------------------------------------------------- logical axes

_KERNEL_DIMS = ("in", "out")
_EMBED_DIMS = ("vocab", "embed")


def _param_key(path: str) -> str | None:
    parts = path.split("/")
    if "params" not in parts:
        return None
    return "/".join(parts[parts.index("params") + 1 :])


def _dim_names(key: str, ndim: int) -> tuple[str, ...]:
    """Logical names of a parameter's dims from its path (see :func:`logical_axes`)."""
    parts = key.split("/")
    leaf = parts[-1]
    owner = parts[-2] if len(parts) > 1 else leaf
    if leaf == "embedding" and ndim >= 2:
        tail: tuple[str, ...] = _EMBED_DIMS
    elif leaf in ("kernel", "weight", "w") and ndim >= 2:
        tail = _KERNEL_DIMS
    elif ndim >= 1:
        tail = ("out",)
    else:
        return ()
    if ndim < len(tail):
        tail = tail[-ndim:]
    lead = tuple(f"stack{i}" for i in range(ndim - len(tail)))
    return tuple(f"{owner}.{n}" for n in (*lead, *tail))


@dataclass(frozen=True)
class LogicalAxes:
    """A plan as Flax logical axes: rules and the names of every parameter's dims.

    Attributes:
        rules: ``(logical_name, mesh axis | tuple of axes | None)`` pairs, for
            ``nn.logical_axis_rules`` / ``nn.logical_to_mesh_axes``.
        axes: parameter path (after ``params/``) -> one logical name per dimension.
        unmapped: ``(path, why)`` for leaves the rules do not describe (batch inputs,
            optimizer state laid out unlike its parameter).
    """

    rules: tuple[tuple[str, SpecEntry], ...]
    axes: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    unmapped: tuple[tuple[str, str], ...] = ()


def logical_axes(plan: Plan) -> LogicalAxes:
    """Derive Flax logical-axis names and rules for the plan's parameters.

    Names come from the parameter's path, per module, in Flax's conventions: a
    ``kernel`` / ``weight`` / ``w`` of rank >= 2 has ``<module>.in`` and ``<module>.out``
    as its last two dims; an ``embedding`` has ``<module>.vocab`` and ``<module>.embed``;
    a bias or scale has ``<module>.out``; extra leading dims (a scanned layer stack) are
    ``<module>.stack0``, ``<module>.stack1``, ... (``<module>`` is the name right above
    the leaf, e.g. ``q`` for ``params/h/attn/q/kernel``). A name maps to the mesh axes the
    plan puts on that dim. When two parameters give one name different axes (two modules
    called ``q`` laid out differently, or a bias unlike its kernel), the later ones are
    renamed by their full path (``h/attn/q/kernel.out``), so every rule is exact:
    ``nn.logical_to_mesh_axes(axes[k], rules)`` equals the plan's spec for every parameter.

    Example:
        >>> la = logical_axes(plan)
        >>> la.axes["layer_0/w"], dict(la.rules)["layer_0.out"] in (None, "data", "tensor")
        (('layer_0.in', 'layer_0.out'), True)
    """
    rules: dict[str, SpecEntry] = {}
    axes: dict[str, tuple[str, ...]] = {}
    unmapped: list[tuple[str, str]] = []
    param_specs: dict[tuple[str, tuple[int, ...]], Spec] = {}
    for r in plan.inputs:
        key = _param_key(r.path)
        if r.role != "param" or key is None:
            continue
        names = list(_dim_names(key, len(r.shape)))
        for d, name in enumerate(names):
            entry = r.spec[d] if d < len(r.spec) else None
            if name in rules and rules[name] != entry:
                name = f"{key}.{d}"
                names[d] = name
            rules.setdefault(name, entry)
        axes[key] = tuple(names)
        param_specs[(key, tuple(r.shape))] = tuple(r.spec)
    for r in plan.inputs:
        if r.role == "param" and _param_key(r.path) is not None:
            continue
        if r.role == "batch":
            if spec_axes(r.spec):
                unmapped.append((r.path, f"batch input laid out {_fmt(r.spec)}"))
            continue
        if r.role == "opt_state":
            parts = r.path.split("/")
            rest = parts[parts.index("opt_state") + 1 :] if "opt_state" in parts else parts
            own = next(
                (
                    param_specs[("/".join(rest[i:]), tuple(r.shape))]
                    for i in range(len(rest))
                    if ("/".join(rest[i:]), tuple(r.shape)) in param_specs
                ),
                None,
            )
            if own is not None and tuple(own) == tuple(r.spec):
                continue
            if own is None and not spec_axes(r.spec):
                continue
            why = (
                f"optimizer state laid out {_fmt(r.spec)}, its parameter {_fmt(own)}"
                if own is not None
                else f"optimizer state laid out {_fmt(r.spec)} (no parameter of its shape)"
            )
            unmapped.append((r.path, why))
            continue
        if spec_axes(r.spec):
            unmapped.append((r.path, f"{r.role} laid out {_fmt(r.spec)}"))
    return LogicalAxes(tuple(rules.items()), axes, tuple(unmapped))


def logical_axis_rules(plan: Plan) -> tuple[tuple[str, SpecEntry], ...]:
    """The plan's parameter layouts as Flax logical-axis rules (see :func:`logical_axes`
    for how names are derived and what is left out).

    Example:
        >>> import flax.linen as nn
        >>> rules = logical_axis_rules(plan)
        >>> names = logical_axes(plan).axes["layer_0/w"]
        >>> tuple(nn.logical_to_mesh_axes(names, rules)) == plan.input("layer_0/w").spec
        True
    """
    return logical_axes(plan).rules


def _fmt(spec: Spec | None) -> str:
    from autopar.report.text import format_spec

    return "unknown" if spec is None else format_spec(tuple(spec))


# ------------------------------------------------------------------------------- import


def _is_spec_leaf(x: Any) -> bool:
    return x is None or isinstance(x, (PartitionSpec, NamedSharding))


def is_spec_tree(x: Any) -> bool:
    """Whether ``x`` is a non-empty pytree whose leaves are all ``PartitionSpec`` /
    ``NamedSharding`` / ``None``: what ``autoparallel(plan=...)`` takes besides a Plan.

    Example:
        >>> is_spec_tree(({"w": PartitionSpec(None, "tensor")}, PartitionSpec("data")))
        True
        >>> is_spec_tree("plan.json")
        False
    """
    if isinstance(x, (str, Plan)):
        return False
    leaves = jax.tree_util.tree_leaves(x, is_leaf=_is_spec_leaf)
    return bool(leaves) and all(_is_spec_leaf(v) for v in leaves)


def _mesh_of(mesh: Any, leaves: Sequence[Any]) -> dict[str, int]:
    from_sharding = [s.mesh for s in leaves if isinstance(s, NamedSharding)]
    if mesh is None and from_sharding:
        mesh = from_sharding[0]
    if mesh is None:
        used = list(
            dict.fromkeys(a for s in leaves if isinstance(s, PartitionSpec) for a in _p_axes(s))
        )
        if len(used) <= 1:
            return {(used[0] if used else "data"): jax.device_count()}
        raise ImportSpecsError(
            f"the specs use the mesh axes {used} but give no sizes: pass NamedShardings, "
            "mesh={'data': 2, 'tensor': 4} (or a jax Mesh), or, through autoparallel, "
            "options=SearchOptions(mesh={...})."
        )
    if isinstance(mesh, Mapping):
        return {str(k): int(v) for k, v in mesh.items()}
    if hasattr(mesh, "shape") and hasattr(mesh, "axis_names"):
        return {str(a): int(mesh.shape[a]) for a in mesh.axis_names}
    raise ImportSpecsError(f"mesh={mesh!r} must be a mapping axis -> size or a jax Mesh.")


def _p_axes(p: PartitionSpec) -> tuple[str, ...]:
    out: list[str] = []
    for e in p:
        if e is None:
            continue
        out.extend((e,) if isinstance(e, str) else tuple(e))
    return tuple(out)


def _to_spec(s: Any, shape: Sequence[int], mesh: Mapping[str, int], path: str) -> Spec:
    if s is None:
        return (None,) * len(shape)
    p = s.spec if isinstance(s, NamedSharding) else s
    if not isinstance(p, PartitionSpec):
        raise ImportSpecsError(
            f"{path}: got {type(s).__name__} {s!r}; each leaf must be a PartitionSpec, a "
            "NamedSharding or None (replicated)."
        )
    entries = list(p)
    if len(entries) > len(shape):
        raise ImportSpecsError(
            f"{path}: spec {p} has {len(entries)} entries for an array of rank {len(shape)} "
            f"{tuple(shape)}."
        )
    out: list[SpecEntry] = []
    for d, e in enumerate(entries + [None] * (len(shape) - len(entries))):
        if e is None or e == ():
            out.append(None)
            continue
        axes = (e,) if isinstance(e, str) else tuple(e)
        for a in axes:
            if a not in mesh:
                raise ImportSpecsError(
                    f"{path}: spec {p} names the axis {a!r}, which is not in the mesh {dict(mesh)}."
                )
        n = math.prod(mesh[a] for a in axes)
        if shape[d] % n:
            raise ImportSpecsError(
                f"{path}: dim {d} of {tuple(shape)} ({shape[d]}) is not divisible by "
                f"{axes}={n}; replicate it (None) or use other axes."
            )
        out.append(axes[0] if len(axes) == 1 else axes)
    return tuple(out)


def plan_from_specs(
    fn: Callable,
    specs: Any,
    *args: Any,
    mesh: Mapping[str, int] | Any | None = None,
    cluster: Any = None,
    graph: Any = None,
    complete: bool = True,
    name: str = "imported",
) -> Plan:
    """A plan for ``fn(*args)`` whose argument layouts are ``specs``.

    Args:
        fn: the single-device step.
        specs: a pytree matching ``args`` (a tuple, one entry per argument) whose leaves
            are ``PartitionSpec``, ``NamedSharding`` or ``None`` (replicated): what
            :func:`partition_specs` / :func:`named_shardings` return.
        *args: the step's arguments (arrays or ``ShapeDtypeStruct``s).
        mesh: axis -> size (or a jax ``Mesh``); default: the ``NamedSharding``s' mesh, or
            for specs naming at most one axis, that axis over every device.
        cluster: the hardware to price the completion on (default: the local devices).
        graph: ``autopar.trace(fn, *args)``, if already traced.
        complete: pin the activation layouts the planner would choose for these inputs
            (its completion problem, priced by its objective), so the lowered program is
            the one the cost model scores and, for specs exported from a searched plan,
            the original's; ``False`` leaves them to XLA's sharding propagation
            (``plan.predicted`` then empty). ``autopar.complete(fn, plan, ...)`` instead
            completes them the way propagation would.
        name: the plan's name.

    Returns:
        A :class:`Plan` bound to ``args``' structure: the inputs laid out as given,
        outputs that update an input laid out like it, other outputs replicated.

    Raises:
        ImportSpecsError: the specs do not match the arguments' structure or ranks, name
            an axis not in the mesh, or split a dim the axes do not divide.

    Example:
        >>> specs = partition_specs(plan, like=(state, batch))
        >>> again = plan_from_specs(step, specs, state, batch, mesh=plan.mesh)
        >>> [r.spec for r in again.inputs] == [r.spec for r in plan.inputs]
        True
    """
    from autopar.baselines import describe
    from autopar.trace import trace

    if graph is None:
        graph = trace(fn, *args)
    try:
        leaves = _args_tree(graph.in_tree).flatten_up_to(specs)
    except (ValueError, TypeError) as e:
        raise ImportSpecsError(
            f"the specs do not match the arguments' structure ({e}); give one PartitionSpec "
            "(or None) per array leaf, shaped like the arguments tuple, e.g. "
            "autopar.export.partition_specs(plan, like=args)."
        ) from e
    mesh_d = _mesh_of(mesh, leaves)
    inputs = tuple(
        TensorSharding(
            gi.path,
            tuple(gi.tensor.shape),
            str(gi.tensor.dtype),
            _to_spec(s, gi.tensor.shape, mesh_d, gi.path),
            gi.role,
        )
        for gi, s in zip(graph.inputs, leaves, strict=True)
    )
    ins, outs, _, _ = describe(graph)
    by_output = {
        leaf.output_index: rec.spec
        for leaf, rec in zip(ins, inputs, strict=True)
        if leaf.output_index is not None
    }
    outputs = tuple(
        TensorSharding(o.path, o.shape, o.dtype, by_output.get(j, (None,) * len(o.shape)), "output")
        for j, o in enumerate(outs)
    )
    plan = Plan(mesh=mesh_d, inputs=inputs, outputs=outputs, name=name).bind(
        graph.in_tree, graph.out_tree
    )
    if not complete:
        return plan
    return _complete_as_planned(graph, plan, cluster)


def _complete_as_planned(graph: Any, plan: Plan, cluster: Any) -> Plan:
    """``plan`` with the activation layouts the planner would pick for its inputs.

    ``autopar.complete`` completes a plan without pins the way XLA's propagation would
    (``PROPAGATION_PENALTY``), which is right for a hand-written baseline but not for
    specs exported from a searched plan: their activations were chosen by the planner's
    own objective. So this completes it by that objective
    (``complete_plan(..., as_propagation=False)``): given a searched plan's input and
    output layouts, the search's optimum stays optimal, and the plan lowers to the
    original's collectives (``tests/core/test_export.py``).
    """
    import dataclasses

    import cost_models
    from autopar.search.evaluate import complete_plan
    from cost_models import Cluster

    if cluster is None:
        cluster = Cluster.local()
    elif isinstance(cluster, str):
        cluster = Cluster.preset(cluster)
    if plan.num_devices > cluster.num_devices:
        raise ImportSpecsError(
            f"the specs' mesh {dict(plan.mesh)} needs {plan.num_devices} devices; the "
            f"cluster has {cluster.num_devices}: pass a mesh or cluster that agree."
        )
    try:
        done = complete_plan(graph, plan, cluster, as_propagation=False)
    except LoadPlanError as e:
        raise ImportSpecsError(f"could not complete the layouts for these specs: {e}") from e
    return dataclasses.replace(
        done, cluster=cluster.to_json(), cost_model_version=cost_models.COST_MODEL_VERSION
    )
