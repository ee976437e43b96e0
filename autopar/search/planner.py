"""The outer loop: pick a mesh, solve the sharding ILP on it, and write the Plan.

:func:`plan_graph` enumerates factorisations of the device count over the mesh axes that
can mean something for the graph (:func:`offered_axes`: ``data`` and ``tensor``, plus
``expert`` only with an expert dimension and ``seq`` only when a sequence dimension needs
it; ``fsdp`` only on request, since parameters sharded over ``data`` are ZeRO-3), unless
``SearchOptions.mesh`` fixes one. It builds each mesh's :class:`ShardingProblem`, ranks
the meshes by a step-time lower bound (the solver's presolve bound: edge minima moved onto
the nodes, every node at its cheapest strategy), solves at most ``max_meshes`` of them in
that order, skips those whose bound cannot beat the best step time found, gives those
whose bound is well above it a quarter of the time limit, and keeps the plan with the
lowest predicted step time that fits the per-device memory bound. Axes are named by role
once solved (``data`` for the batch, ``tensor`` for model dims, ...), outer -> inner.

Example:
    >>> plan = plan_graph(autopar.trace(step, state, batch),            # doctest: +SKIP
    ...                   Cluster.preset("dgx-a100-80gb"),
    ...                   SearchOptions(mesh={"data": 2, "tensor": 4}))
    >>> plan.layers[0].ops[:2]                                          # doctest: +SKIP
    (('attn/q', 'batch(data)+column(tensor)'), ('attn/k', 'batch(data)+column(tensor)'))
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from autopar.errors import InfeasiblePlanError, InvalidOptionError, SolveShardingError
from autopar.options import AUTO_AXES, AXIS_NAMES, SearchOptions
from autopar.plan import LayerStrategy, Plan, TensorSharding
from autopar.search.costs import CostContext
from autopar.search.evaluate import Evaluation, decode, pinned_activations, rename_spec
from autopar.search.ilp import BuiltProblem, Op, ProblemBuilder
from autopar.search.problem import ShardingSolution
from autopar.search.sharding import to_plan_spec
from autopar.search.solver import objective_lower_bound, solve
from autopar.trace.graph import Graph

_DATA_AXES = ("data", "fsdp")
_MAX_MESH_AXES = 3  # meshes with more non-trivial axes than this are not enumerated
_LAZY_MEMORY_ROUNDS = 6
_LONG_SEQUENCE = 4096  # tokens from which a sequence axis is offered whatever the batch
_EXPERT_WORDS = ("moe", "expert")
_CLOSE = 0.10  # meshes whose bound is within this of the best step time get the full limit
_LOSER_TIME_FRACTION = 0.25  # the others get this fraction of the solver time limit


@dataclass
class MeshResult:
    """One mesh the outer loop looked at (kept for reports and benchmarks)."""

    mesh: dict[str, int]
    bound_s: float
    built: BuiltProblem | None = None
    solution: ShardingSolution | None = None
    evaluation: Evaluation | None = None
    min_memory_bytes: float | None = None
    skipped: str = ""
    rename: dict[str, str] | None = None
    time_limit_s: float = 0.0


# ----------------------------------------------------------------------------- meshes


def _factorisations(n: int, max_len: int) -> list[tuple[int, ...]]:
    """Ordered factorisations of ``n`` into factors > 1, at most ``max_len`` of them."""
    out: list[tuple[int, ...]] = []

    def rec(rest: int, prefix: tuple[int, ...]) -> None:
        if rest == 1:
            if prefix:
                out.append(prefix)
            return
        if len(prefix) == max_len:
            return
        for f in range(2, rest + 1):
            if rest % f == 0:
                rec(rest // f, (*prefix, f))

    rec(n, ())
    return out


def expert_dims(graph: Graph) -> dict[int, int]:
    """Graph inputs (parameters, optimizer state) with an expert dimension: input index ->
    that dimension.

    A parameter has one when a ``dot_general`` batches over its leading non-layer dim (the
    per-expert matmul ``egcm,emh->egch``), or when its path names a mixture of experts
    (``moe``/``expert``) and it has a leading dim beyond a matrix's two (after the layer
    dim of a scanned stack). Optimizer state inherits its parameter's.

    Example:
        >>> expert_dims(trace(moe_step, state, batch))          # doctest: +SKIP
        {1: 0, 2: 0}
    """
    from autopar.search.ilp import match_optimizer_state

    stacked = _scanned_inputs(graph)
    shapes: dict[tuple[int, ...], list[tuple[int, int]]] = {}
    for gi in graph.inputs_by_role("param"):
        lead = 1 if gi.index in stacked else 0
        shape = gi.tensor.shape[lead:]
        shapes.setdefault(shape, []).append((gi.index, lead))
    out: dict[int, int] = {}
    for node in _all_nodes(graph):
        if node.primitive != "dot_general":
            continue
        (_, _), (lb, rb) = node.params["dimension_numbers"]
        for t, batch in zip(node.in_tensors[:2], (lb, rb), strict=True):
            if tuple(batch) and int(tuple(batch)[0]) == 0:
                for index, lead in shapes.get(t.shape, ()):
                    out[index] = lead
    for gi in graph.inputs_by_role("param"):
        lead = 1 if gi.index in stacked else 0
        path = gi.path.lower()
        if gi.index not in out and any(w in path for w in _EXPERT_WORDS):
            if gi.tensor.ndim - lead >= 3 and gi.tensor.shape[lead] > 1:
                out[gi.index] = lead
    for p, states in match_optimizer_state(graph).items():
        if p in out:
            for s in states:
                out[s] = out[p]
    return out


def _all_nodes(graph: Graph):
    for node in graph.nodes:
        yield node
        for body in node.body:
            yield from _all_nodes(body)


def _scanned_inputs(graph: Graph) -> set[int]:
    """Graph inputs that enter a top-level scan as a scanned (stacked) operand."""
    by_value = {gi.value: gi.index for gi in graph.inputs}
    out: set[int] = set()
    for node in graph.nodes:
        if node.primitive != "scan":
            continue
        p = node.params
        first = int(p.get("num_consts", 0)) + int(p.get("num_carry", 0))
        for v in node.inputs[first:]:
            if v in by_value:
                out.add(by_value[v])
    return out


def offered_axes(graph: Graph | None, num_devices: int, options: SearchOptions) -> tuple[str, ...]:
    """The mesh axes worth searching for ``graph`` (outer -> inner, ``pipe`` excluded).

    With ``SearchOptions.axes=None`` (the default): ``data`` and ``tensor`` always; ``expert``
    only when some parameter has an expert dimension (:func:`expert_dims`); ``seq`` only
    when a sequence dimension could use it (the batch is smaller than the device count,
    or sequences are at least 4096 long); ``fsdp`` never: sharding parameters and
    optimizer state over ``data`` *is* ZeRO-3/FSDP, and a second axis for the same role
    only doubles the space. Axes the user lists explicitly (``axes=(...)``) are all
    offered.

    Example:
        >>> offered_axes(dense_gpt_graph, 8, SearchOptions())      # doctest: +SKIP
        ('data', 'tensor')
    """
    if options.axes is not None:  # the user listed axes: offer exactly those
        requested = tuple(a for a in options.axes if a != "pipe")
        return tuple(sorted(requested, key=AXIS_NAMES.index))
    requested = AUTO_AXES
    if graph is None:
        return requested
    keep = {"data", "tensor"}
    batch = graph.inputs_by_role("batch")
    if any(t.tensor.ndim >= 2 and t.tensor.shape[1] > 1 for t in batch):
        size = max((t.tensor.shape[0] for t in batch if t.tensor.ndim), default=1)
        longest = max(t.tensor.shape[1] for t in batch if t.tensor.ndim >= 2)
        if size < num_devices or longest >= _LONG_SEQUENCE:
            keep.add("seq")
    if expert_dims(graph):
        keep.add("expert")
    return tuple(a for a in sorted(requested, key=AXIS_NAMES.index) if a in keep)


def candidate_meshes(
    num_devices: int, options: SearchOptions, graph: Graph | None = None
) -> list[dict[str, int]]:
    """The meshes the outer loop considers: ``options.mesh``, or the factorisations of the
    device count over the offered axes (:func:`offered_axes`; at most three, one mesh
    axis per offered axis, outer -> inner in ``AXIS_NAMES`` order so ``tensor`` lands
    on the fastest links). The names are placeholders, renamed by role once solved: the
    cost depends on sizes and order only.

    Example:
        >>> [tuple(m.values()) for m in candidate_meshes(8, SearchOptions())]
        [(2, 2, 2), (2, 4), (4, 2), (8,)]
    """
    if options.mesh is not None:
        return [dict(options.mesh)]
    axes = offered_axes(graph, num_devices, options)
    if num_devices == 1:
        return [{axes[0] if axes else "data": 1}]
    out = []
    for sizes in _factorisations(num_devices, min(_MAX_MESH_AXES, len(axes))):
        names = _placeholder_names(len(sizes), axes)
        if names is not None:
            out.append(dict(zip(names, sizes, strict=True)))
    return sorted(out, key=lambda m: tuple(m.values()))


def _placeholder_names(k: int, allowed: Sequence[str]) -> tuple[str, ...] | None:
    """Axis names for a k-axis mesh before roles are known, outer -> inner."""
    preference = ["data", "tensor", "seq", "expert", "fsdp"]
    names = [a for a in preference if a in allowed][:k]
    if len(names) < k:
        names += [a for a in allowed if a not in names][: k - len(names)]
    if len(names) < k:
        return None
    return tuple(sorted(names, key=AXIS_NAMES.index))


# ----------------------------------------------------------------------------- solving


def _input_axes(
    graph: Graph, mesh: Mapping[str, int], options: SearchOptions
) -> dict[int, list[str]]:
    """Axes each input may use when ``options.zero_stage`` is fixed."""
    if options.zero_stage is None or options.zero_stage == 3:
        return {}
    data = [a for a in mesh if a in _DATA_AXES]
    other = [a for a in mesh if a not in data]
    out: dict[int, list[str]] = {}
    for gi in graph.inputs:
        if gi.role == "param" or (gi.role == "opt_state" and options.zero_stage == 0):
            out[gi.index] = other
    return out


def build_problem(
    graph: Graph,
    cluster: Any,
    mesh: Mapping[str, int],
    options: SearchOptions,
    memory_limit: float | None,
) -> BuiltProblem:
    """The :class:`BuiltProblem` of ``graph`` on ``mesh`` under ``options``."""
    ctx = CostContext(cluster, mesh)
    return ProblemBuilder(
        graph,
        ctx,
        input_axes=_input_axes(graph, mesh, options),
        tie_optimizer_state=options.zero_stage not in (1, 2),
        coarsen=options.coarsen,
        memory_limit=memory_limit,
    ).build()


def solve_within_memory(
    bp: BuiltProblem,
    limit: float | None,
    time_limit_s: float,
    backend: str = "cpsat",
    peaks: list[float] | None = None,
) -> tuple[BuiltProblem, ShardingSolution]:
    """Solve, then check the exact peak over every moment; add the moment that breaks the
    bound as a constraint and re-solve (lazy constraint generation). A peak over the bound
    at a moment already constrained is over by resharded copies, which the constraints
    leave out (``BuiltProblem.peak``): the bound is lowered by the excess and the problem
    re-solved. The last solution may still not fit (the caller checks ``peak``). ``peaks``
    (if a list) receives the peak of every solution looked at."""
    sol = solve(bp.problem, time_limit_s, backend=backend)
    for _ in range(_LAZY_MEMORY_ROUNDS):
        if not sol.ok or limit is None:
            return bp, sol
        peak, moment, _ = bp.peak(sol.choice)
        if peaks is not None:
            peaks.append(peak)
        if peak <= limit * (1 + 1e-9):
            return bp, sol
        if moment in bp.moments:
            if bp.problem.memory_limit is None:
                return bp, sol
            tighter = bp.with_memory_limit(bp.problem.memory_limit - (peak - limit))
            again = solve(tighter.problem, time_limit_s, backend=backend)
            if not again.ok:
                return bp, sol
            bp, sol = tighter, again
        else:
            bp = bp.with_moments([*bp.moments, moment])
            sol = solve(bp.problem, time_limit_s, backend=backend)
    return bp, sol


def _better(a: MeshResult, b: MeshResult) -> bool:
    """Lower step time wins; on a tie (0.01%) the mesh with fewer axes (simpler plan),
    then the one whose axes, named by role, are in the conventional order (``data``
    outer, ``tensor`` inner)."""
    ta, tb = a.evaluation.step_time_s, b.evaluation.step_time_s
    if abs(ta - tb) <= 1e-4 * max(ta, tb):
        if len(a.mesh) != len(b.mesh):
            return len(a.mesh) < len(b.mesh)
        return _canonical(a) and not _canonical(b)
    return ta < tb


def _canonical(r: MeshResult) -> bool:
    names = [(r.rename or {}).get(a, a) for a in r.mesh]
    return names == sorted(names, key=AXIS_NAMES.index)


def _lower_bound(bp: BuiltProblem) -> float:
    """A lower bound on the ILP optimum: the solver's presolve (edge minima moved onto the
    nodes, dominated strategies dropped) with every node at its cheapest strategy."""
    return objective_lower_bound(bp.problem)


def _step_lower_bound(bp: BuiltProblem, objective_bound: float, eta: float) -> float:
    """A lower bound on the step time: at least the least compute every group needs, and
    at least the objective bound minus what overlap can hide (at most ``eta`` x compute,
    and compute <= the objective)."""
    compute = sum(min(g.compute) for g in bp.groups)
    return max(compute, (1 - eta) * objective_bound)


# ----------------------------------------------------------------------------- naming


def _role_names(bp: BuiltProblem, choice: Sequence[int], allowed: Sequence[str]) -> dict[str, str]:
    """Rename placeholder axes by what the solution does with them.

    Axes that split an expert dimension of a parameter are ``expert``, axes that split
    the batch dimension ``data`` (then ``fsdp``), axes that split the sequence but not
    the batch ``seq``, the rest ``tensor``.
    """
    g = bp.graph
    mesh = list(bp.ctx.mesh_dict)
    experts = expert_dims(g) if "expert" in allowed else {}
    usage: dict[str, set[str]] = {a: set() for a in mesh}
    for gi in g.inputs:
        spec = bp.spec_of_input(gi.index, choice)
        for d, dim in enumerate(spec):
            for a in dim:
                if gi.role == "batch":
                    usage[a].add("batch" if d == 0 else "seq")
                elif gi.role in ("param", "opt_state", "model_state"):
                    usage[a].add("expert" if experts.get(gi.index) == d else "param")
    pools = {
        "expert": ["expert"],
        "batch": ["data", "fsdp"],
        "seq": ["seq"],
        "param": ["tensor", "expert"],
        "none": ["data", "tensor", "seq", "fsdp", "expert"],
    }
    order = ("expert", "batch", "seq", "param", "none")
    role = {a: next((r for r in order[:-1] if r in usage[a]), "none") for a in mesh}
    taken: set[str] = set()
    out: dict[str, str] = {}
    # Axes with a role pick their names first; unused axes take what is left.
    for a in sorted(mesh, key=lambda a: order.index(role[a])):
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


def _zero_stage(bp: BuiltProblem, choice: Sequence[int]) -> int:
    g = bp.graph
    batch_axes = {
        a
        for gi in g.inputs
        if gi.role == "batch"
        for a in (bp.spec_of_input(gi.index, choice) or ((),))[0]
    }
    if not batch_axes:
        return 0

    def uses(role: str) -> bool:
        return any(
            a in batch_axes
            for gi in g.inputs
            if gi.role == role
            for dim in bp.spec_of_input(gi.index, choice)
            for a in dim
        )

    if uses("param"):
        return 3
    return 1 if uses("opt_state") else 0


# ----------------------------------------------------------------------------- entry


def plan_graph(
    graph: Graph, cluster: Any, options: SearchOptions | None = None, *, results: list | None = None
) -> Plan:
    """Search a parallel plan for a traced training step.

    Args:
        graph: from ``autopar.trace``.
        cluster: a ``cost_models.Cluster``.
        options: what is fixed and what is searched (default: everything searched).
        results: if given, a list that receives one :class:`MeshResult` per mesh looked at.

    Returns:
        The plan with the lowest predicted step time that fits the memory bound.

    Raises:
        InvalidOptionError: the options ask for something the search cannot do yet
            (pipelining, rematerialisation) or a mesh larger than the cluster.
        InfeasiblePlanError: no mesh and layout fits the per-device memory bound; the
            message gives the bound, the smallest footprint found and the excess.

    Example:
        >>> plan = plan_graph(graph, Cluster.preset("dgx-a100-80gb"),    # doctest: +SKIP
        ...                   SearchOptions(mesh={"data": 2, "tensor": 4}))
        >>> plan.input("params/wte/embedding").spec                      # doctest: +SKIP
        (None, 'tensor')
    """
    import cost_models

    options = options or SearchOptions()
    if options.pipeline_stages is not None and options.pipeline_stages > 1:
        raise InvalidOptionError(
            f"pipeline_stages={options.pipeline_stages}: pipelining is not available yet; "
            "use pipeline_stages=None or 1."
        )
    if options.remat not in (None, "none"):
        raise InvalidOptionError(
            f"remat={options.remat!r}: rematerialisation is not available yet; use None or 'none'."
        )
    if options.mesh is not None:
        size = 1
        for s in options.mesh.values():
            size *= s
        if size > cluster.num_devices:
            raise InvalidOptionError(
                f"mesh {dict(options.mesh)} needs {size} devices; the cluster has {cluster.num_devices}."
            )
    limit = float(options.memory_limit_bytes or cluster.device.hbm_bytes)
    meshes = candidate_meshes(cluster.num_devices, options, graph)
    allowed = offered_axes(graph, cluster.num_devices, options)
    rename_roles = options.mesh is None and options.zero_stage is None
    eta = cluster.overlap_efficiency
    tried: list[MeshResult] = []
    for mesh in meshes:
        bp = build_problem(graph, cluster, mesh, options, limit)
        tried.append(MeshResult(mesh, _step_lower_bound(bp, _lower_bound(bp), eta), bp))
    # The most promising mesh first (by its step-time lower bound; fewer axes on a tie):
    # it sets the incumbent that lets the others be skipped or solved briefly.
    tried.sort(key=lambda r: (r.bound_s, len(r.mesh)))
    best: MeshResult | None = None
    solved = 0
    for r in tried:
        if solved >= options.max_meshes:
            r.skipped = "max_meshes reached"
            continue
        incumbent = None if best is None else best.evaluation.step_time_s
        if incumbent is not None and r.bound_s >= incumbent:
            r.skipped = "lower bound above the best step time"
            continue
        solved += 1
        # A mesh whose bound is well above the incumbent is unlikely to win: a short solve
        # (its best solution is still compared) keeps it from eating the time of the search.
        r.time_limit_s = options.solver_time_limit_s
        if incumbent is not None and r.bound_s > (1 - _CLOSE) * incumbent:
            r.time_limit_s *= _LOSER_TIME_FRACTION
        peaks: list[float] = []
        r.built, r.solution = solve_within_memory(r.built, limit, r.time_limit_s, peaks=peaks)
        if not r.solution.ok:
            if r.solution.status == "infeasible":
                low = solve(r.built.problem, r.time_limit_s, minimize="memory")
                if low.ok:
                    peaks.append(r.built.peak(low.choice)[0])
            # The smallest footprint seen: the memory-minimal choice of the constraints,
            # or an earlier solution (resharded copies are outside the constraints).
            r.min_memory_bytes = min(peaks, default=None)
            continue
        r.evaluation = decode(
            r.built, r.solution.choice, status=r.solution.status, memory_limit=limit
        )
        if not r.evaluation.fits:
            r.min_memory_bytes = min(peaks, default=r.evaluation.memory_bytes_per_device)
            r.skipped = "rejected: its peak (with resharded copies) is over the memory bound"
            continue
        if rename_roles:
            r.rename = _role_names(r.built, r.solution.choice, allowed)
        if best is None or _better(r, best):
            best = r
    if results is not None:
        results.extend(tried)
    if best is None:
        lows = [(r.min_memory_bytes, r.mesh) for r in tried if r.min_memory_bytes is not None]
        if lows:
            low, mesh = min(lows, key=lambda t: t[0])
            raise InfeasiblePlanError(
                f"no plan fits the memory bound of {limit:.4g} bytes ({limit / 2**30:.3f} GiB) "
                f"per device: the smallest footprint found needs {low:.4g} bytes "
                f"({low / 2**30:.3f} GiB, on mesh {mesh}), {low - limit:.4g} bytes "
                f"({(low / limit - 1) * 100:.1f}%) over. Use more devices, a larger "
                "memory_limit_bytes, or a smaller batch."
            )
        # Nothing proved infeasible: the solver ran out of time before finding any plan.
        raise SolveShardingError(
            f"no plan found within {options.solver_time_limit_s} s on meshes "
            f"{[r.mesh for r in tried]}; raise solver_time_limit_s."
        )

    bp, choice = best.built, best.solution.choice
    rename = best.rename or {a: a for a in bp.ctx.mesh_dict}
    evaluation = decode(bp, choice, rename, status=best.solution.status, memory_limit=limit)
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
        layers=_layers(bp, choice, rename),
        predicted=evaluation.to_predicted(),
        cluster=cluster.to_json(),
        cost_model_version=cost_models.COST_MODEL_VERSION,
        in_tree=graph.in_tree,
        out_tree=graph.out_tree,
    )


__all__ = [
    "MeshResult",
    "build_problem",
    "candidate_meshes",
    "expert_dims",
    "offered_axes",
    "plan_graph",
]
