"""Search level 1: which meshes to try.

:func:`candidate_meshes` enumerates factorisations of the device count over the mesh axes
that can mean something for the graph (:func:`offered_axes`: the batch and model axes,
plus ``expert`` only with an expert dimension and ``seq`` only when a sequence dimension
needs it; ``fsdp`` only on request, since parameters sharded over ``data`` are ZeRO-3),
unless ``SearchOptions.mesh`` fixes one. What each axis means comes from the mesh-axes
table (:mod:`autopar.axes`).

Example:
    >>> [tuple(m.values()) for m in candidate_meshes(8, SearchOptions())]
    [(2, 2, 2), (2, 4), (4, 2), (8,)]
"""

from __future__ import annotations

from collections.abc import Sequence

from autopar.axes import AUTO_AXES, AXES, AXIS_NAMES, BATCH_AXES, axes_splitting
from autopar.options import SearchOptions
from autopar.search.build.coarsen import match_optimizer_state
from autopar.trace.graph import Graph

MAX_MESH_AXES = 3  # meshes with more non-trivial axes than this are not enumerated
_LONG_SEQUENCE = 4096  # tokens from which a sequence axis is offered whatever the batch
_EXPERT_WORDS = ("moe", "expert")
PLACEHOLDER_PREFERENCE: tuple[str, ...] = ("data", "tensor", "seq", "expert", "fsdp")
"""Names given to a k-axis mesh's axes before roles are known (the first k offered)."""


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

    Example: an expert weight ``[experts, in, out]`` read by a per-expert matmul.

        >>> def sgd_step(params, x):
        ...     def loss(p):
        ...         h = jnp.einsum("egm,emh->egh", x, p["moe"]["wi"])
        ...         return (h @ p["dense"]).sum()
        ...     grads = jax.grad(loss)(params)
        ...     return jax.tree.map(lambda w, g: w - 0.1 * g, params, grads)
        >>> params = {"dense": jnp.ones((16, 16)), "moe": {"wi": jnp.ones((4, 8, 16))}}
        >>> g = autopar.trace(sgd_step, params, jnp.ones((4, 32, 8)))
        >>> [gi.path for gi in g.inputs]
        ['params/dense', 'params/moe/wi', 'x']
        >>> expert_dims(g), expert_dims(graph)   # the dense MLP has none
        ({1: 0}, {})
    """
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
        >>> offered_axes(graph, 8, SearchOptions())   # the dense MLP, a batch of 64
        ('data', 'tensor')
        >>> offered_axes(graph, 8, SearchOptions(axes=("data", "fsdp", "pipe")))
        ('data', 'fsdp')
    """
    if options.axes is not None:  # the user listed axes: offer exactly those
        requested = tuple(a for a in options.axes if AXES[a].splits != "stages")
        return tuple(sorted(requested, key=AXIS_NAMES.index))
    requested = AUTO_AXES
    if graph is None:
        return requested
    keep = {a for a in requested if AXES[a].splits in ("batch", "model")}
    batch = graph.inputs_by_role("batch")
    if any(t.tensor.ndim >= 2 and t.tensor.shape[1] > 1 for t in batch):
        size = max((t.tensor.shape[0] for t in batch if t.tensor.ndim), default=1)
        longest = max(t.tensor.shape[1] for t in batch if t.tensor.ndim >= 2)
        if size < num_devices or longest >= _LONG_SEQUENCE:
            keep.update(axes_splitting("sequence"))
    if expert_dims(graph):
        keep.update(axes_splitting("experts"))
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
        return [{axes[0] if axes else BATCH_AXES[0]: 1}]
    out = []
    for sizes in _factorisations(num_devices, min(MAX_MESH_AXES, len(axes))):
        names = _placeholder_names(len(sizes), axes)
        if names is not None:
            out.append(dict(zip(names, sizes, strict=True)))
    return sorted(out, key=lambda m: tuple(m.values()))


def _placeholder_names(k: int, allowed: Sequence[str]) -> tuple[str, ...] | None:
    """Axis names for a k-axis mesh before roles are known, outer -> inner."""
    preference = PLACEHOLDER_PREFERENCE
    names = [a for a in preference if a in allowed][:k]
    if len(names) < k:
        names += [a for a in allowed if a not in names][: k - len(names)]
    if len(names) < k:
        return None
    return tuple(sorted(names, key=AXIS_NAMES.index))


__all__ = ["MAX_MESH_AXES", "candidate_meshes", "expert_dims", "offered_axes"]
