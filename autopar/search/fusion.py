"""Which values XLA keeps in HBM: fusion-aware byte counts for memory-bound operations.

XLA fuses chains of elementwise operations (with the broadcasts, reshapes, converts and
slices between them, and the reduction they feed) into one kernel that reads the chain's
external inputs once and writes only the values used outside it. Pricing every
elementwise operation as its own HBM round trip (read all operands, write the result)
overstates them several times: GPT-2's tanh-gelu alone is ten operations but one kernel,
and AdamW's update some thirty operations but one pass over the parameters and moments.

The model here (:func:`hbm_io`, for time): the graph's operations are grouped into the
kernels XLA:GPU would run (:func:`fusion_groups`, each boundary rule citing XLA's fusion
passes): an elementwise chain with the reduction it feeds; a producer with all its
elementwise readers (a multi-output fusion); a softmax or layer norm, reductions over the
last dim and the elementwise work around them, as one kernel (XLA's Triton softmax
rewriter; Megatron-LM's fused softmax and layer-norm kernels). A kernel reads each value
from outside it once and writes each result read outside it (or leaving the graph) once;
every other value lives in registers. A value is stored whatever reads it when a
non-fusible operation (matmul, gather, scatter, a loop, an input) or a reduction over
other dims produces it. FLOPs are unaffected.

The memory count (:func:`materialised_values`) keeps the older, per-value rule, checked
against the CPU compiler's buffer assignment: a value is stored when a non-fusible
operation or a reduction produces it, it leaves the graph, a non-fusible operation reads
it, or several operations read it and its producer is expensive.

Example: a matmul and its tanh-gelu, one fused kernel after the matmul.

    >>> g = autopar.trace(lambda x, w: jax.nn.gelu(x @ w, approximate=True),
    ...                   jnp.ones((8, 16)), jnp.ones((16, 16)))
    >>> [n.primitive for n in g.nodes]
    ['dot_general', 'integer_pow', 'mul', 'add', 'mul', 'tanh', 'add', 'mul', 'mul']
    >>> io = hbm_io(g)
    >>> io[g.nodes[5].id]   # the tanh: its operand and result stay in registers
    ((False,), (False,))
    >>> io[g.nodes[1].id]   # the first reader of the matmul's result reads it from HBM
    ((True,), (False,))
    >>> io[g.nodes[-1].id]  # the last mul: the same kernel, it writes the output only
    ((False, False), (True,))
    >>> sorted(materialised_values(g)) == [g.nodes[0].outputs[0], g.outputs[0].value]
    True
"""

from __future__ import annotations

# Which operations XLA fuses (``FUSIBLE``), which read a fused value without it being
# materialised (``FUSION_CONSUMERS``: fusible ones, and reductions, which fuse the
# elementwise chain feeding them), which it does not duplicate into several consumer
# fusions (``EXPENSIVE``, XLA's ``InstructionFusion::IsExpensive``) and which scatters add
# (``SCATTER_ADDS``): columns of the primitives table.
from autopar.primitives import EXPENSIVE, FUSIBLE, FUSION_CONSUMERS, SCATTER_ADDS
from autopar.trace.graph import Graph, Node

IO = tuple[tuple[bool, ...], tuple[bool, ...]]
"""Per operand: read from HBM; per result: written to HBM."""


def materialised_values(graph: Graph) -> set[int]:
    """The values of ``graph`` (by id) that XLA keeps in memory: the rule of the module
    docstring, except that a cheap producer (not :data:`EXPENSIVE`) read only by fusions
    is recomputed inside each of them rather than stored (XLA duplicates it), which is
    what a memory count needs; every other node result lives only inside a fusion.

    Example: of the 111 node results of the MLP train step, 30 are stored.

        >>> results = {v for n in graph.nodes for v in n.outputs}
        >>> len(results), len(materialised_values(graph) & results)
        (111, 30)
    """
    nodes = {n.id: n for n in graph.nodes}
    escapes = {o.value for o in graph.outputs}
    out = set()
    for node in graph.nodes:
        for v in node.outputs:
            if v in escapes or node.primitive not in FUSIBLE:
                out.add(v)
                continue
            users = graph.consumers.get(v, ())
            if not users or any(nodes[u].primitive not in FUSION_CONSUMERS for u in users):
                out.add(v)
            elif len(users) > 1 and node.primitive in EXPENSIVE:
                out.add(v)  # XLA duplicates only cheap producers into several fusions
    out -= _scattered_into_sums(graph, nodes)
    return out


def _scattered_into_sums(graph: Graph, nodes: dict) -> set[int]:
    """Results of a scatter-add into a broadcast constant (zeros) whose only reader adds
    them to something: XLA rewrites ``x + scatter_add(0, i, u)`` into
    ``scatter_add(x, i, u)``, updating ``x``'s buffer in place, so the scatter's own
    result is never stored. (The gradient of ``take_along_axis``, in every language
    model's cross-entropy: the [batch, seq, vocab] one-hot part of the logits' gradient.)
    """
    out = set()
    for node in graph.nodes:
        if node.primitive not in SCATTER_ADDS or not node.inputs or node.inputs[0] < 0:
            continue
        src = graph.producer.get(node.inputs[0])
        init = nodes.get(src)
        if init is None or init.primitive != "broadcast_in_dim" or init.in_tensors[0].ndim:
            continue
        users = graph.consumers.get(node.outputs[0], ())
        if len(users) == 1 and nodes[users[0]].primitive in ("add", "add_any"):
            out.add(node.outputs[0])
    return out


def is_row_reduction(node: Node) -> bool:
    """Whether ``node`` reduces only the last (minor-most) dim of its operand: the
    reduction of a normalisation diamond (softmax's max and sum, layer norm's mean and
    variance), which XLA:GPU fuses with its producers and consumers into one kernel.

    Example:
        >>> g = autopar.trace(lambda x: jnp.sum(x, axis=-1), jnp.ones((4, 8)))
        >>> is_row_reduction(g.nodes[0])
        True
    """
    if node.primitive not in FUSION_CONSUMERS or node.primitive in FUSIBLE:
        return False
    if not node.in_tensors:
        return False
    axes = node.params.get("axes") if node.params else None
    if axes is None:
        return False
    ndim = node.in_tensors[0].ndim
    try:
        reduced = {int(a) % ndim for a in axes} if ndim else set()
    except (TypeError, ValueError):
        return False
    return ndim >= 1 and reduced == {ndim - 1}


def fusion_groups(graph: Graph) -> dict[int, int]:
    """The kernel (fusion) each node of ``graph`` runs in: node id -> the id of a
    representative node of its fusion. Non-fusible nodes run alone.

    Fusion boundaries follow XLA:GPU's rules (each cited):

    * a fusible producer read by one fusible op or reduction fuses into it (producer /
      consumer loop and input fusion: ``xla/service/gpu/transforms/priority_fusion.cc``);
    * a fusible producer every reader of which is fusible, or reduces the last dim (a
      *row* reduction), shares their kernel: XLA duplicates a cheap producer into each
      consumer or makes a multi-output fusion of them
      (``xla/service/gpu/transforms/multi_output_fusion.cc``); an expensive one read by
      several kernels is materialised once;
    * a row reduction fuses with the ops that read it: a *normalisation diamond*
      (producer -> reduce over the last dim -> broadcast -> elementwise with the
      producer) and chains of them are one kernel in XLA:GPU's
      ``SoftmaxRewriterTriton`` (``xla/service/gpu/softmax_rewriter_triton.cc``,
      ``MatchesTritonCompatibleClosedReductionDiamond`` / ``FindAllFusibleDiamondChains``),
      as in Megatron-LM's fused scale-mask-softmax and layer-norm kernels
      (``megatron/fused_kernels/scaled_masked_softmax.h``, Apex ``FusedLayerNorm``), which
      read the scores once and write the probabilities once, forward and backward.

    A reduction over other dims (a column reduction, e.g. a bias gradient) is the root of
    its kernel: its result is stored.

    Example: softmax is one kernel (its two row reductions included).

        >>> g = autopar.trace(lambda x: jax.nn.softmax(x, axis=-1), jnp.ones((4, 8)))
        >>> len(set(fusion_groups(g).values()))
        1
    """
    nodes = {n.id: n for n in graph.nodes}
    parent = {n.id: n.id for n in graph.nodes}

    def find(a: int) -> int:
        while parent[a] != a:
            parent[a] = parent[parent[a]]
            a = parent[a]
        return a

    def union(a: int, b: int) -> None:
        ra, rb = find(a), find(b)
        if ra != rb:
            parent[max(ra, rb)] = min(ra, rb)

    row = {n.id for n in graph.nodes if is_row_reduction(n)}
    for node in graph.nodes:
        if node.primitive not in FUSIBLE and node.id not in row:
            continue
        for v in node.outputs:
            users = graph.consumers.get(v, ())
            if not users:
                continue
            if node.id in row:
                # the diamond: the row reduction's fusible readers share its kernel
                for u in users:
                    if nodes[u].primitive in FUSIBLE or u in row:
                        union(node.id, u)
                continue
            if len(users) == 1:
                if nodes[users[0]].primitive in FUSION_CONSUMERS:
                    union(node.id, users[0])
            elif all(nodes[u].primitive in FUSIBLE or u in row for u in users):
                for u in users:
                    union(node.id, u)
    return {n.id: find(n.id) for n in graph.nodes}


def hbm_io(graph: Graph) -> dict[int, IO]:
    """Which operands each fusible or reducing node of ``graph`` reads from HBM and which
    results it writes there (nodes absent from the map read and write everything).

    The kernels are :func:`fusion_groups`. A kernel reads each value it takes from
    outside (a graph input, another kernel's result) once, charged to the first of its
    nodes that reads it, and writes each of its results that is read outside it or
    leaves the graph once; every other value stays in registers, and one nothing reads
    is dropped (XLA's dead-code elimination). Only this graph's nodes
    are classified (a loop body is its own graph): values that enter it or leave it are
    materialised.
    """
    nodes = {n.id: n for n in graph.nodes}
    escapes = {o.value for o in graph.outputs}
    group = fusion_groups(graph)

    def root_result(src: int) -> bool:
        # a matmul, a loop, a column reduction...: its result is stored whatever reads it
        return nodes[src].primitive not in FUSIBLE and not is_row_reduction(nodes[src])

    def external(v: int, reader: int) -> bool:
        src = graph.producer.get(v)
        return src is None or root_result(src) or group[src] != group[reader]

    out: dict[int, IO] = {}
    seen: set[tuple[int, int]] = set()
    for node in graph.nodes:
        if node.primitive not in FUSION_CONSUMERS:
            continue
        g = group[node.id]
        reads = []
        for v in node.inputs:
            hit = v >= 0 and external(v, node.id) and (g, v) not in seen
            if hit:
                seen.add((g, v))
            reads.append(hit)
        writes = []
        for v in node.outputs:
            users = graph.consumers.get(v, ())
            if v in escapes:
                writes.append(True)
            elif not users:
                writes.append(False)  # dead: XLA's dead-code elimination drops it
            else:
                writes.append(root_result(node.id) or any(group[u] != g for u in users))
        out[node.id] = (tuple(reads), tuple(writes))
    return out


__all__ = [
    "EXPENSIVE",
    "FUSIBLE",
    "FUSION_CONSUMERS",
    "IO",
    "fusion_groups",
    "hbm_io",
    "is_row_reduction",
    "materialised_values",
]
