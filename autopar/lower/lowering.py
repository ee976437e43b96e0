"""Plan -> a sharded ``jax.jit`` program.

:func:`lower_plan` turns a :class:`~autopar.plan.Plan` into a :class:`LoweredStep`:

* ``in_shardings`` / ``out_shardings``: a ``NamedSharding`` per flat leaf from
  ``plan.inputs`` / ``plan.outputs`` on a mesh of ``Auto`` axes (:func:`make_mesh`);
* ``with_sharding_constraint`` at ``plan.activations``, inserted by re-interpreting the
  traced, inlined jaxpr (loop bodies included, addressed by ``scope``) when a graph is
  given; without constraints the user's function itself is jitted;
* ZeRO-3 (``plan.zero_stage == 3``): a completed plan (``autopar.complete``, or the
  planner's) gathers each parameter where it is used, by its operand constraints. In a
  plan without activation constraints, parameters sharded over data-parallel axes are
  constrained to their *gathered* spec at the step's entry, which makes XLA all-gather
  weights (not activations, its choice without the constraint) and, transposing the
  constraint, reduce their gradients to the sharded update's layout (all-reduce +
  dynamic-slice on CPU, a reduce-scatter on accelerators). The gathered copy lives for the
  whole step: per-layer gathering inside a scanned body would need a hook on loop-body
  *inputs*, which the graph interpreter does not offer. ZeRO-1/2 need nothing beyond the
  in/out shardings (stage 2's sharded gradients are internal; XLA picks the same
  reduce-then-slice pattern for both);
* donation only of ``options.donate_argnums``; :meth:`LoweredStep.place_inputs` copies
  inputs onto the planned shardings without ever aliasing the caller's buffers.

Remat: ``jax.checkpoint`` must wrap a function *before* it is differentiated, and the
user's step already contains ``jax.grad``. So a plan with ``remat="selective"``/``"full"``
is realised by rewriting the evaluation of the traced jaxpr (:mod:`autopar.lower.remat`):
each layer's residuals are recomputed right before its backward pass, from saved values
passed through ``optimization_barrier`` (and, on CPU, inside an opaque ``lax.cond``). This
needs the graph (traced here when not given) and unrolled layers; layers in a ``scan`` are
refused. A user who applied the policy inside the model (:func:`remat_policy` gives the
``jax.checkpoint`` policy) says so with ``LoweringOptions(extra={"remat": "in_model"})``
and no rewrite is done.

Example:
    >>> lowered = lower_plan(step, plan, (state, batch), graph=graph)
    >>> new_state, loss = lowered(state, batch)
    >>> new_state["params"]["layer_0"]["w"].sharding.spec       # as planned
    P(None, 'tensor')
    >>> lowered.memory_analysis().temp_size_in_bytes > 0         # what XLA compiled
    True
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from autopar.axes import batch_axes
from autopar.errors import LoadPlanError, LowerPlanError, MatchSignatureError
from autopar.lower.mesh import make_mesh
from autopar.lower.order import LateGathers, late_gathers, tie
from autopar.lower.remat import (
    RematRewrite,
    check_policy,
    default_guard,
    evaluate_remat,
    opaque_true,
    plan_remat,
)
from autopar.options import LoweringOptions
from autopar.plan import (
    ActivationConstraint,
    Plan,
    Spec,
    TensorSharding,
    spec_axes,
    to_partition_spec,
)
from autopar.trace.roles import key_name

Scope = tuple[tuple[int, int], ...]

# Axes that never split the batch: ZeRO-3's "gathered" spec keeps them.

# Memory figures on CPU hide the scratch of YNN fusions unless this is set (JAX-NOTES).
CPU_MEMORY_COMPILER_OPTIONS: Mapping[str, Any] = {"xla_cpu_experimental_ynn_fusion_type": ""}


# ------------------------------------------------------------------------------- paths


def leaf_paths(args: Sequence[Any], names: Sequence[str] | None = None) -> list[str]:
    """``/``-joined paths of the flat leaves of positional ``args`` (``jax.tree.leaves``
    order), e.g. ``"state/params/h/attn/q/kernel"``; the first part is the argument's name
    (``names``) or its position.

    Example:
        >>> leaf_paths(({"w": 1, "b": (2, 3)},), ["params"])
        ['params/b/0', 'params/b/1', 'params/w']
    """
    out: list[str] = []
    for i, a in enumerate(args):
        head = names[i] if names is not None and i < len(names) else str(i)
        for kp, _ in jax.tree_util.tree_flatten_with_path(a)[0]:
            out.append("/".join([head, *(key_name(k) for k in kp)]))
    return out


def arg_names(fn: Callable, n: int) -> list[str] | None:
    """The names of ``fn``'s first ``n`` positional parameters, if it has a signature."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return None
    names = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(names) < n:
        return None
    return names[:n]


def same_path(a: str, b: str) -> bool:
    """Paths agree, allowing the argument's name to be spelt as a name or a position."""
    return a == b or a.split("/", 1)[-1] == b.split("/", 1)[-1]


# ------------------------------------------------------------------------------- checks


def _dtype_str(x: Any) -> str:
    """The dtype of an argument leaf as the tracer records it: ``"float32"``,
    ``"bfloat16"``, ``"key<fry>"`` (a typed PRNG key: an extended dtype NumPy does not
    know), and for a Python number the dtype JAX gives it (``1.0`` -> ``"float32"``)."""
    dtype = getattr(x, "dtype", None)
    if dtype is None:
        try:
            dtype = jax.typeof(x).dtype
        except TypeError:
            return "?"
    try:
        return str(np.dtype(dtype))
    except TypeError:
        return str(dtype)


def _sds(x: Any, s: Any) -> jax.ShapeDtypeStruct:
    """``x`` as a ``jax.ShapeDtypeStruct`` on sharding ``s`` (Python numbers are weakly
    typed, as ``jax.jit`` sees them)."""
    if isinstance(x, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s, weak_type=x.weak_type)
    if hasattr(x, "dtype") and hasattr(x, "shape"):
        return jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=s)
    aval = jax.typeof(x)
    return jax.ShapeDtypeStruct(aval.shape, aval.dtype, sharding=s, weak_type=aval.weak_type)


def _signature_guard(
    body: Callable[..., Any], in_tree: Any, leaves: Sequence[Any], paths: Sequence[str]
) -> Callable[..., Any]:
    """``body`` refusing, while it is traced, arguments of another structure, shape or dtype
    than ``leaves`` (:class:`MatchSignatureError`).

    ``jax.jit`` traces a function again for every new argument signature; the lowered
    program is planned for one. The check runs only when ``jax.jit`` traces, never when it
    dispatches a compiled call, so a caller can hand arguments straight to the jitted
    function (its C++ fast path) and catch this error to re-plan for a new signature."""
    expected = [(tuple(np.shape(x)), _dtype_str(x)) for x in leaves]

    def guarded(*dyn_args: Any) -> Any:
        got_leaves, tree = jax.tree_util.tree_flatten(dyn_args)
        if tree != in_tree:
            raise MatchSignatureError(
                f"the step was lowered for arguments structured as {in_tree}, got {tree}; "
                "lower it again for these arguments (@autoparallel re-plans by itself)."
            )
        for i, x in enumerate(got_leaves):
            got = (tuple(np.shape(x)), _dtype_str(x))
            if got != expected[i]:
                raise MatchSignatureError(
                    f"input leaf {i} ({paths[i]}) is {got[0]} {got[1]} but the step was "
                    f"lowered for {expected[i][0]} {expected[i][1]}; lower it again for these "
                    "arguments (@autoparallel re-plans by itself)."
                )
        return body(*dyn_args)

    for attr in ("__name__", "__qualname__", "__doc__", "__module__"):
        if hasattr(body, attr):
            try:
                setattr(guarded, attr, getattr(body, attr))
            except (AttributeError, TypeError):
                pass
    guarded.__wrapped__ = body  # type: ignore[attr-defined]  (inspect.unwrap finds the step)
    return guarded


def check_leaves(
    records: Sequence[TensorSharding], leaves: Sequence[Any], paths: Sequence[str], what: str
) -> None:
    """Raise :class:`LoadPlanError` naming the first leaf whose path/shape/dtype differs."""
    if len(records) != len(leaves):
        raise LoadPlanError(
            f"the plan has {len(records)} {what} leaves but the function has {len(leaves)}; "
            "the plan was made for another signature: re-plan with autopar.plan(...)."
        )
    for i, (rec, leaf, path) in enumerate(zip(records, leaves, paths, strict=True)):
        shape, dtype = tuple(np.shape(leaf)), _dtype_str(leaf)
        if not same_path(rec.path, path) or tuple(rec.shape) != shape or rec.dtype != dtype:
            raise LoadPlanError(
                f"{what} leaf {i} is {path} {shape} {dtype} but the plan has {rec.path} "
                f"{tuple(rec.shape)} {rec.dtype}; re-plan for this signature."
            )


def _check_spec(spec: Spec, shape: Sequence[int], mesh: Mesh, where: str) -> None:
    if len(spec) > len(shape):
        raise LowerPlanError(
            f"{where}: spec {spec} has {len(spec)} entries for a rank-{len(shape)} tensor"
            "; fix the spec in the plan (Plan JSON) or re-plan with autopar.plan(...)."
        )
    used = spec_axes(spec)
    for ax in used:
        if ax not in mesh.shape:
            raise LowerPlanError(
                f"{where}: spec {spec} uses axis {ax!r}, not in the mesh {dict(mesh.shape)}"
                "; fix the spec in the plan (Plan JSON) or re-plan with autopar.plan(...)."
            )
    if len(set(used)) != len(used):
        raise LowerPlanError(
            f"{where}: spec {spec} uses a mesh axis twice"
            "; fix the spec in the plan (Plan JSON) or re-plan with autopar.plan(...)."
        )
    for d, entry in enumerate(spec):
        if entry is None:
            continue
        axes = (entry,) if isinstance(entry, str) else entry
        n = math.prod(mesh.shape[a] for a in axes)
        if shape[d] % n:
            raise LowerPlanError(
                f"{where}: dim {d} of size {shape[d]} is split over {axes} ({n} devices), "
                "which does not divide it; fix the spec or pad the tensor."
            )


def _shardings(records: Sequence[TensorSharding], mesh: Mesh, what: str) -> list[NamedSharding]:
    out = []
    for r in records:
        _check_spec(r.spec, r.shape, mesh, f"{what} {r.path}")
        out.append(NamedSharding(mesh, to_partition_spec(r.spec)))
    return out


# ------------------------------------------------------------------------------- remat


def remat_policy(name: str) -> Callable[..., bool] | None:
    """The ``jax.checkpoint`` policy for a plan's ``remat`` (``None`` for ``"none"``).

    ``"selective"`` saves matmul outputs without batch dimensions (weights-stationary
    dots, Megatron's selective recomputation spirit: recompute the cheap elementwise and
    attention-softmax work); ``"full"`` saves nothing (recompute the whole layer).
    Apply it where the layer is defined, e.g. ``nn.remat(Block, policy=...)`` or
    ``jax.checkpoint(layer_fn, policy=...)``.

    Example:
        >>> remat_policy("full") is jax.checkpoint_policies.nothing_saveable
        True
    """
    if name == "none":
        return None
    if name == "selective":
        return jax.checkpoint_policies.dots_with_no_batch_dims_saveable
    if name == "full":
        return jax.checkpoint_policies.nothing_saveable
    raise LowerPlanError(f"remat={name!r} is unknown; use 'none', 'selective' or 'full'.")


# ------------------------------------------------------------------------------- result


def _identity(x: Any) -> Any:
    """Jitted with ``out_shardings`` to reshard a global array (one compile per layout)."""
    return x


@dataclass(frozen=True, eq=False)
class LoweredStep:
    """A plan lowered to a sharded ``jax.jit`` program (not yet compiled).

    Call it like the user's function: ``lowered(*args)`` places the inputs on the planned
    shardings (copies, never aliases) and runs the program.

    Attributes:
        plan: the plan it realises.
        mesh: the device mesh.
        jitted: the ``jax.jit``-wrapped callable of the dynamic arguments.
        in_shardings: one pytree of ``NamedSharding`` per dynamic argument.
        out_shardings: pytree of ``NamedSharding`` matching the results.
        options: the lowering options.
        static_args: ``{position: value}`` of the static arguments closed over.
        abstract_args: ``jax.ShapeDtypeStruct`` (with shardings) per dynamic argument.
    """

    plan: Plan
    mesh: Mesh
    jitted: Any
    in_shardings: tuple[Any, ...]
    out_shardings: Any
    options: LoweringOptions
    static_args: Mapping[int, Any]
    abstract_args: tuple[Any, ...]
    _cache: dict[Any, Any] = field(default_factory=dict, repr=False)

    # -- running ----------------------------------------------------------------------
    def _dynamic(self, args: Sequence[Any]) -> tuple[Any, ...]:
        n = len(self.abstract_args) + len(self.static_args)
        if len(args) == len(self.abstract_args) and self.static_args and len(args) != n:
            return tuple(args)  # already the dynamic arguments only
        if len(args) != n:
            raise LowerPlanError(
                f"the step was lowered for {n} arguments, got {len(args)}; pass the same "
                "arguments as to lower_plan."
            )
        for i, v in self.static_args.items():
            if args[i] is not v and args[i] != v:
                raise LowerPlanError(
                    f"static argument {i} is {args[i]!r} but the step was lowered with "
                    f"{v!r}; lower again for the new value."
                )
        return tuple(a for i, a in enumerate(args) if i not in self.static_args)

    def place_inputs(self, args: Sequence[Any]) -> tuple[Any, ...]:
        """The dynamic arguments laid out as planned.

        Arrays already on their planned sharding pass through untouched (and are donated
        if their argument is in ``donate_argnums``). Everything else is first copied
        (``jax.device_put(x, x.sharding, may_alias=False)``, or ``np.array`` for host
        data) and the copy is placed: in JAX 0.10 ``device_put(x, sharding,
        may_alias=False)`` from one device onto a mesh still reuses ``x``'s buffer as a
        shard (measured), so donating the placed array would delete the caller's.

        Several processes (``jax.distributed``, a mesh over devices of all of them): each
        process passes the same values, as host data or as arrays on its own devices, and
        keeps its shards of them. Such a process-local array goes through a host copy, since
        ``device_put`` onto devices of other processes is a cross-host transfer that the
        CPU backend refuses; a global array on another layout is resharded by a compiled
        identity (its collectives do the moving).
        """
        dyn = self._dynamic(args)

        def place(x: Any, s: NamedSharding) -> Any:
            if isinstance(x, jax.core.Tracer | bool | int | float | complex):
                return x  # jax.jit places Python numbers itself (weakly typed)
            if isinstance(x, jax.Array):
                if x.sharding.is_equivalent_to(s, x.ndim):
                    return x
                if not s.is_fully_addressable:
                    if not x.is_fully_addressable:
                        return jax.jit(_identity, out_shardings=s)(x)
                    return jax.device_put(np.array(x, copy=True), s, may_alias=False)
                x = jax.device_put(x, x.sharding, may_alias=False)
            else:
                x = np.array(x, copy=True)
            return jax.device_put(x, s, may_alias=False)

        return tuple(jax.tree.map(place, a, s) for a, s in zip(dyn, self.in_shardings, strict=True))

    def __call__(self, *args: Any) -> Any:
        placed = self.place_inputs(args)
        # Run the executable .compile() built (one compile, not one per entry point) when
        # the arguments have the lowered shapes; anything else goes through jax.jit.
        if _same_avals(placed, self.abstract_args):
            return self.compile()(*placed)
        return self.jitted(*placed)

    # -- stages -----------------------------------------------------------------------
    def _abstract(self, args: Sequence[Any]) -> tuple[Any, ...]:
        if not args:
            return self.abstract_args
        dyn = self._dynamic(args)
        return tuple(jax.tree.map(_sds, a, s) for a, s in zip(dyn, self.in_shardings, strict=True))

    def lower(self, *args: Any) -> jax.stages.Lowered:
        """``jax.stages.Lowered`` for ``args`` (default: the arguments lowered with)."""
        abstract = self._abstract(args)
        key = ("lower", tuple(jax.tree.leaves(abstract)) if args else ())
        if key not in self._cache:
            self._cache[key] = self.jitted.lower(*abstract)
        return self._cache[key]

    def compile(
        self, *args: Any, compiler_options: Mapping[str, Any] | None = None
    ) -> jax.stages.Compiled:
        """The compiled program (cached per argument shapes and compiler options)."""
        opts = dict(compiler_options or {})
        key = (
            "compile",
            tuple(jax.tree.leaves(self._abstract(args))) if args else (),
            tuple(sorted(opts.items())),
        )
        if key not in self._cache:
            lowered = self.lower(*args)
            self._cache[key] = lowered.compile(compiler_options=opts) if opts else lowered.compile()
        return self._cache[key]

    def hlo_text(self, *args: Any, stage: str = "compiled") -> str:
        """HLO text: ``"compiled"`` (final, optimised) or ``"lowered"`` (StableHLO).

        For the collectives XLA emits right after SPMD partitioning use
        :func:`autopar.verify.dump_spmd_hlo`.
        """
        if stage == "lowered":
            return self.lower(*args).as_text()
        if stage == "compiled":
            return self.compile(*args).as_text()
        raise LowerPlanError(f"stage={stage!r} is unknown; use 'compiled' or 'lowered'.")

    def memory_analysis(self, *args: Any) -> Any:
        """``compiled.memory_analysis()``, compiled so that CPU scratch is counted."""
        opts = CPU_MEMORY_COMPILER_OPTIONS if jax.default_backend() == "cpu" else {}
        return self.compile(*args, compiler_options=opts).memory_analysis()


def _same_avals(args: Sequence[Any], abstract: Sequence[Any]) -> bool:
    a_leaves, a_tree = jax.tree_util.tree_flatten(tuple(args))
    b_leaves, b_tree = jax.tree_util.tree_flatten(tuple(abstract))
    if a_tree != b_tree:
        return False
    return all(
        not isinstance(x, jax.core.Tracer)
        and tuple(np.shape(x)) == tuple(y.shape)
        and _dtype_str(x) == _dtype_str(y)
        for x, y in zip(a_leaves, b_leaves, strict=True)
    )


# ------------------------------------------------------------------------------- lowering


def _constraint_hook(
    constraints: Sequence[ActivationConstraint],
    mesh: Mesh,
    late: LateGathers | None = None,
    guard: str = "barrier",
) -> tuple[Any, Callable[[Any], bool]]:
    """``hook(node, outs)`` applying the constraints, and the predicate choosing which loop
    bodies to re-trace (those holding a constraint at any depth). ``late`` (from
    :func:`autopar.lower.order.late_gathers`): operands tied to a partner operand before
    their constraints apply (:func:`autopar.lower.order.tie` with ``guard``), and operands
    that reuse an earlier reader's gathered value; call ``hook.reset()`` before each trace."""
    late = late or LateGathers()
    sources = {first for m in late.reuse.values() for first in m.values()}
    Point = dict[tuple[Scope, int], list[tuple[int, NamedSharding, ActivationConstraint]]]
    by_point: Point = {}  # results
    by_operand: Point = {}  # inputs, as one equation reads them
    inside: set[tuple[Scope, int]] = set()  # (scope, node) of loops with constraints within
    for c in constraints:
        for i in range(len(c.scope)):
            inside.add((tuple(c.scope[:i]), c.scope[i][0]))
        table, index = (by_point, c.output) if c.operand is None else (by_operand, c.operand)
        table.setdefault((tuple(c.scope), c.node), []).append(
            (index, NamedSharding(mesh, to_partition_spec(c.spec)), c)
        )

    def constrain(node: Any, vals: list[Any], table: Point, what: str, skip: Any = ()) -> list[Any]:
        for i, sharding, c in table.get((tuple(node.scope), node.id), ()):
            if i in skip:
                continue
            if i >= len(vals):
                raise LowerPlanError(
                    f"activation constraint {c.name!r} at node {node.id} (scope {c.scope}) "
                    f"names {what} {i}, but {node.primitive} has {len(vals)} {what}s; "
                    "the plan was made for another graph."
                )
            where = f"activation constraint {c.name!r} (node {node.id}, scope {c.scope})"
            _check_spec(c.spec, np.shape(vals[i]), mesh, where)
            vals[i] = jax.lax.with_sharding_constraint(vals[i], sharding)
        return vals

    class _Hook:
        def __init__(self) -> None:
            self.reset()

        def reset(self) -> None:
            self.predicate: Any = None
            self.gathered: dict[tuple[int, int], Any] = {}  # (node, operand) -> value

        def __call__(self, node: Any, outs: list[Any]) -> list[Any]:
            return constrain(node, outs, by_point, "output")

        def before(self, node: Any, ins: list[Any]) -> list[Any]:
            key = (tuple(node.scope), node.id)
            tied = late.ties.get(key, {})
            reused = set()
            for i, first in late.reuse.get(key, {}).items():
                if first in self.gathered:
                    ins[i] = self.gathered[first]
                    reused.add(i)
            # Partners first, laid out as this equation reads them (so that their own
            # reshards stay the ones other readers share), then tied, then the gathers.
            ins = constrain(node, ins, by_operand, "operand", skip=reused | set(tied))
            for i, j in tied.items():
                if guard == "cond" and self.predicate is None:
                    self.predicate = opaque_true()
                ins[i], ins[j] = tie(ins[i], ins[j], guard, self.predicate)
            last = {i: sh for i, sh, _ in by_operand.get(key, ())}
            for j in set(tied.values()) & set(last):
                ins[j] = jax.lax.with_sharding_constraint(ins[j], last[j])
            done = set(range(len(ins))) - set(tied)
            ins = constrain(node, ins, by_operand, "operand", skip=done | reused)
            for i in range(len(ins)):
                if not node.scope and (node.id, i) in sources:
                    self.gathered[(node.id, i)] = ins[i]
            return ins

    def into_bodies(node: Any) -> bool:
        return (tuple(node.scope), node.id) in inside

    return _Hook(), into_bodies


def _gathered(spec: Spec, data_axes: frozenset[str]) -> Spec:
    """``spec`` without the data-parallel axes (what ZeRO-3 gathers before use)."""
    out = []
    for e in spec:
        axes = () if e is None else ((e,) if isinstance(e, str) else e)
        keep = tuple(a for a in axes if a not in data_axes)
        out.append(None if not keep else (keep[0] if len(keep) == 1 else keep))
    return tuple(out)


def data_parallel_axes(plan: Plan) -> frozenset[str]:
    """Axes that split the batch: those the plan's batch inputs are sharded over
    (default ``data``/``fsdp``, or every non-model axis, when no input is a batch)."""
    axes = {a for r in plan.inputs if r.role == "batch" for a in spec_axes(r.spec)}
    if not axes:
        axes = set(batch_axes(plan.mesh))
    return frozenset(axes)


def lower_plan(
    fn: Callable,
    plan: Plan,
    args: Sequence[Any],
    graph: Any = None,
    options: LoweringOptions = LoweringOptions(),  # noqa: B008 (frozen, immutable)
    *,
    mesh: Mesh | None = None,
) -> LoweredStep:
    """Lower ``fn`` under ``plan`` to a sharded ``jax.jit`` program.

    Args:
        fn: the single-device step, ``fn(*args)``.
        plan: the plan (its ``inputs``/``outputs`` in ``jax.tree.leaves`` order of the
            dynamic arguments / results).
        args: the positional arguments: arrays or ``jax.ShapeDtypeStruct`` (nothing is
            allocated or run here). Static ones (``options.static_argnums``) are closed over.
        graph: the traced :class:`~autopar.trace.graph.Graph` of ``fn(*dynamic args)``;
            needed for ``plan.activations`` (its inlined jaxpr is re-interpreted).
        options: :class:`LoweringOptions`.
        mesh: a ready mesh with the plan's axes (default: :func:`make_mesh` of all devices).

    Returns:
        A :class:`LoweredStep`.

    Raises:
        LoadPlanError: the plan's leaves do not match ``args`` or the results.
        LowerPlanError: the plan cannot be realised (mesh size, bad spec, unknown remat
            policy or remat of layers inside a scan, pipeline, activation constraints
            without a graph).

    Example:
        >>> plan = autopar.baselines.data_parallel(step, {"data": 8}, state, batch)
        >>> lowered = lower_plan(step, plan, (state, batch))  # no activation constraints
        >>> state, loss = lowered(state, batch)
        >>> loss.shape, state["params"]["layer_0"]["w"].sharding.is_fully_replicated
        ((), True)
    """
    args = tuple(args)
    stages = plan.pipeline.num_stages if plan.pipeline is not None else 1
    microbatches = plan.pipeline.microbatches if plan.pipeline is not None else 1
    remat = check_policy(plan.remat)
    remat_outside = remat != "none" and options.extra.get("remat") != "in_model"
    if mesh is None:
        mesh = make_mesh(plan.mesh)
    elif dict(mesh.shape) != dict(plan.mesh) or tuple(mesh.axis_names) != tuple(plan.mesh):
        raise LowerPlanError(
            f"mesh {dict(mesh.shape)} does not match the plan's {dict(plan.mesh)}."
        )

    static = {i: args[i] for i in options.static_argnums if i < len(args)}
    dyn_pos = [i for i in range(len(args)) if i not in static]
    dyn = tuple(args[i] for i in dyn_pos)

    def bound(*dyn_args: Any) -> Any:
        it = iter(dyn_args)
        return fn(*[static[i] if i in static else next(it) for i in range(len(args))])

    if not static:
        bound = fn  # noqa: F811 (the user's own function, untouched)

    # Inputs: check against the plan, build shardings.
    names = arg_names(fn, len(args))
    dyn_names = [names[i] for i in dyn_pos] if names else None
    in_leaves, in_tree = jax.tree_util.tree_flatten(dyn)
    in_paths = leaf_paths(dyn, dyn_names)
    check_leaves(plan.inputs, in_leaves, in_paths, "input")
    in_flat = _shardings(plan.inputs, mesh, "input")
    in_tree_shardings = jax.tree_util.tree_unflatten(in_tree, in_flat)

    # Outputs.
    out_shape = jax.eval_shape(bound, *dyn)
    out_leaves, out_tree = jax.tree_util.tree_flatten(out_shape)
    check_leaves(plan.outputs, out_leaves, leaf_paths((out_shape,), ["out"]), "output")
    out_shardings = jax.tree_util.tree_unflatten(out_tree, _shardings(plan.outputs, mesh, "output"))

    # The body: the user's function, or the re-interpreted jaxpr with constraints.
    body: Callable[..., Any] = bound
    constraints = plan.activations if options.activation_constraints else ()
    if constraints and stages <= 1:
        if graph is None or getattr(graph, "jaxpr", None) is None or not hasattr(graph, "nodes"):
            raise LowerPlanError(
                f"the plan has {len(constraints)} activation constraints, which are placed "
                "on the traced jaxpr: pass graph=autopar.trace(fn, *args) to lower_plan "
                "(or LoweringOptions(activation_constraints=False) to drop them)."
            )
        body = _interpreted(graph, constraints, mesh, out_tree, late=_late(graph, plan, options))
    if stages > 1:
        if remat_outside:
            raise LowerPlanError(
                f"remat={remat!r} for a whole pipeline plan is not available; a pipeline "
                "rematerialises per stage: set plan.pipeline.stage_remat (one of "
                "'none', 'full' per stage) and remat='none'."
            )
        if "pipe" not in mesh.shape or mesh.shape["pipe"] != stages:
            raise LowerPlanError(
                f"the plan has {stages} pipeline stages but its mesh {dict(plan.mesh)} has no "
                f"'pipe' axis of {stages} devices."
            )
        body = _pipelined(bound, dyn, graph, plan, mesh, out_tree, constraints)
    elif microbatches > 1:
        if remat_outside:
            raise LowerPlanError(
                f"remat={remat!r} with {microbatches} microbatches is not available yet; "
                "use remat='none' or microbatches=1."
            )
        body = _accumulated(bound, dyn, graph, plan, constraints, mesh, out_tree, options)
    elif remat_outside:
        # Remat from outside the model: recompute residuals in the re-interpreted jaxpr.
        if graph is None:
            from autopar.trace import trace

            graph = trace(bound, *dyn)
        elif getattr(graph, "jaxpr", None) is None or not hasattr(graph, "nodes"):
            raise LowerPlanError(
                f"remat={remat!r} is applied to the traced jaxpr, but graph has none: pass "
                "graph=autopar.trace(fn, *args) (or leave graph=None to trace here)."
            )
        rewrite = plan_remat(graph, remat)
        body = _interpreted(
            graph, constraints, mesh, out_tree, rewrite, late=_late(graph, plan, options)
        )

    if plan.zero_stage == 3 and not constraints:
        # A completed plan says how every use reads each parameter (gathered right
        # before it, operand constraints); a bare one gets them gathered at entry.
        body = _zero3_gather(body, plan, mesh, in_tree)

    donate = tuple(dyn_pos.index(i) for i in options.donate_argnums if i in dyn_pos)
    jitted = jax.jit(
        _signature_guard(body, in_tree, in_leaves, in_paths),
        in_shardings=tuple(in_tree_shardings),
        out_shardings=out_shardings,
        donate_argnums=donate,
    )

    abstract = tuple(
        jax.tree.map(_sds, a, s) for a, s in zip(dyn, tuple(in_tree_shardings), strict=True)
    )
    return LoweredStep(
        plan=plan,
        mesh=mesh,
        jitted=jitted,
        in_shardings=tuple(in_tree_shardings),
        out_shardings=out_shardings,
        options=options,
        static_args=static,
        abstract_args=abstract,
    )


def _check_constraints(graph: Any, constraints: Sequence[ActivationConstraint]) -> None:
    """Every constraint names an existing node (at its scope) of ``graph``."""
    for c in constraints:
        g = graph
        for node, b in c.scope:
            if node >= len(g.nodes) or b >= len(g.nodes[node].body):
                raise LowerPlanError(
                    f"activation constraint {c.name!r} has scope {c.scope}, which is not a loop "
                    "body of the traced graph; the plan was made for another graph."
                )
            g = g.nodes[node].body[b]
        if not 0 <= c.node < len(g.nodes):
            raise LowerPlanError(
                f"activation constraint {c.name!r} names node {c.node}, but the graph at scope "
                f"{c.scope} has {len(g.nodes)} nodes; the plan was made for another graph."
            )
        node = g.nodes[c.node]
        what, i, n = (
            ("output", c.output, len(node.outputs))
            if c.operand is None
            else ("operand", c.operand, len(node.inputs))
        )
        if not 0 <= i < n:
            raise LowerPlanError(
                f"activation constraint {c.name!r} at node {c.node} (scope {c.scope}) names "
                f"{what} {i}, but {node.primitive} has {n} {what}s; the plan was made for "
                "another graph."
            )


def _late(graph: Any, plan: Plan, options: LoweringOptions) -> LateGathers:
    """Gathers of inputs tied to the use they feed (:mod:`autopar.lower.order`)."""
    if not options.activation_constraints or not options.late_gathers:
        return LateGathers()
    _check_constraints(graph, plan.activations)
    return late_gathers(graph, plan.activations, [r.spec for r in plan.inputs], plan.mesh)


def _interpreted(
    graph: Any,
    constraints: Sequence[ActivationConstraint],
    mesh: Mesh,
    out_tree: Any,
    rewrite: RematRewrite | None = None,
    late: LateGathers | None = None,
) -> Callable[..., Any]:
    """The step as the traced jaxpr re-run with ``with_sharding_constraint`` at the plan's
    activation points (via :func:`autopar.trace.evaluate_inlined`), or, given a remat
    ``rewrite``, via :func:`autopar.lower.remat.evaluate_remat`."""
    from autopar.trace import evaluate_inlined

    _check_constraints(graph, constraints)
    guard = default_guard(mesh.devices.flat[0].platform)
    hook, into_bodies = _constraint_hook(constraints, mesh, late, guard)

    if rewrite is not None:
        remat_hook = hook if constraints else None

        def run_remat(*dyn_args: Any) -> Any:
            hook.reset()
            flat = jax.tree_util.tree_leaves(dyn_args)
            outs = evaluate_remat(
                graph, rewrite, *flat, hook=remat_hook, into_bodies=into_bodies, guard=guard
            )
            return jax.tree_util.tree_unflatten(out_tree, outs)

        return run_remat

    def run(*dyn_args: Any) -> Any:
        hook.reset()
        flat = jax.tree_util.tree_leaves(dyn_args)
        outs = evaluate_inlined(graph, *flat, hook=hook, into_bodies=into_bodies)
        return jax.tree_util.tree_unflatten(out_tree, outs)

    return run


def _pipelined(
    fn: Callable[..., Any],
    dyn: Sequence[Any],
    graph: Any,
    plan: Plan,
    mesh: Mesh,
    out_tree: Any,
    constraints: Sequence[ActivationConstraint] = (),
) -> Callable[..., Any]:
    """The step with its gradients computed by a pipeline over ``pipe`` (stages, schedule
    and microbatches from ``plan.pipeline``) and its update applied once
    (:func:`autopar.lower.split.pipelined_function`).

    Inside the stages the other mesh axes are intra-op parallel. The plan's activation
    constraints (``autopar.search.stages.pipeline_activations``: node ids of the step
    traced on one microbatch, specs on the mesh without ``pipe``) are applied to the
    gradient computation before it is cut into stages, so every stage piece carries its
    ``with_sharding_constraint``s (``pipe`` is manual there, the other axes automatic:
    the partitioner lays the stage out as the plan priced). Without constraints the
    stages are left to XLA's propagation from the input layouts."""
    from autopar.lower.split import pipelined_function, plan_accumulation
    from autopar.trace import trace

    pp = plan.pipeline
    if graph is None or getattr(graph, "jaxpr", None) is None or not hasattr(graph, "nodes"):
        graph = trace(fn, *dyn)
    acc = plan_accumulation(fn, dyn, pp.microbatches, full=graph)
    hook, into_bodies = None, False
    if constraints:
        _check_constraints(acc.micro, constraints)
        guard = default_guard(mesh.devices.flat[0].platform)
        hook, into_bodies = _constraint_hook(constraints, mesh, None, guard)
    run = pipelined_function(
        acc, dyn, pp.stages, pp.schedule, mesh, pp.virtual_stages, pp.stage_remat,
        hook=hook, into_bodies=into_bodies,
    )  # fmt: skip

    def step(*dyn_args: Any) -> Any:
        return jax.tree_util.tree_unflatten(out_tree, run(*jax.tree_util.tree_leaves(dyn_args)))

    return step


def _accumulated(
    fn: Callable[..., Any],
    dyn: Sequence[Any],
    graph: Any,
    plan: Plan,
    constraints: Sequence[ActivationConstraint],
    mesh: Mesh,
    out_tree: Any,
    options: LoweringOptions,
) -> Callable[..., Any]:
    """The step with its gradients computed over ``plan.pipeline.microbatches``
    microbatches and its update applied once (:mod:`autopar.lower.split`), the plan's
    activation constraints applied to both (equation ``k`` is the same in each)."""
    from autopar.lower.split import accumulated_function, plan_accumulation
    from autopar.trace import trace

    if graph is None or getattr(graph, "jaxpr", None) is None or not hasattr(graph, "nodes"):
        graph = trace(fn, *dyn)
    acc = plan_accumulation(fn, dyn, plan.pipeline.microbatches, full=graph)
    hook, into_bodies = None, False
    if constraints:
        _check_constraints(graph, constraints)
        guard = default_guard(mesh.devices.flat[0].platform)
        hook, into_bodies = _constraint_hook(constraints, mesh, _late(graph, plan, options), guard)
    run = accumulated_function(acc, hook, into_bodies)

    def step(*dyn_args: Any) -> Any:
        return jax.tree_util.tree_unflatten(out_tree, run(*jax.tree_util.tree_leaves(dyn_args)))

    return step


def _zero3_gather(
    body: Callable[..., Any], plan: Plan, mesh: Mesh, in_tree: Any
) -> Callable[..., Any]:
    """Constrain sharded parameters to their gathered spec at the step's entry.

    This realises ZeRO-3 / FSDP: parameters and optimizer state stay sharded over the
    data-parallel axes between steps; inside the step XLA all-gathers each parameter
    before use and, transposing the constraint, reduce-scatters its gradient to the
    update's sharding.
    """
    data_axes = data_parallel_axes(plan)
    gathered: list[NamedSharding | None] = []
    for r in plan.inputs:
        g = _gathered(r.spec, data_axes)
        if r.role == "param" and g != r.spec:
            gathered.append(NamedSharding(mesh, to_partition_spec(g)))
        else:
            gathered.append(None)
    if not any(gathered):
        return body

    def step(*dyn_args: Any) -> Any:
        flat = jax.tree_util.tree_leaves(dyn_args)
        flat = [
            x if s is None else jax.lax.with_sharding_constraint(x, s)
            for x, s in zip(flat, gathered, strict=True)
        ]
        return body(*jax.tree_util.tree_unflatten(in_tree, flat))

    return step
