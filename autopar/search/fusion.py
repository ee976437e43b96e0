"""Which values XLA keeps in HBM: fusion-aware byte counts for memory-bound operations.

XLA fuses chains of elementwise operations (with the broadcasts, reshapes, converts and
slices between them, and the reduction they feed) into one kernel that reads the chain's
external inputs once and writes only the values used outside it. Pricing every
elementwise operation as its own HBM round trip (read all operands, write the result)
overstates them several times: GPT-2's tanh-gelu alone is ten operations but one kernel,
and AdamW's update some thirty operations but one pass over the parameters and moments.

The model here: a value is *materialised* (written once to HBM, and read from HBM by each
consumer) when

* a non-fusible operation produces it (matmul, gather, scatter, a loop, an input), or a
  reduction (the root of its fusion);
* it leaves its graph (a result, a loop output);
* a non-fusible operation reads it (a matmul operand); or
* two or more operations read it (XLA either materialises it or recomputes it in each
  consumer, re-reading its inputs: about the same traffic).

Every other value lives in registers between fused operations: its producer writes no
bytes for it and its consumer reads none. FLOPs are unaffected.

Example: a matmul and its tanh-gelu, one fused kernel after the matmul.

    >>> g = autopar.trace(lambda x, w: jax.nn.gelu(x @ w, approximate=True),
    ...                   jnp.ones((8, 16)), jnp.ones((16, 16)))
    >>> [n.primitive for n in g.nodes]
    ['dot_general', 'integer_pow', 'mul', 'add', 'mul', 'tanh', 'add', 'mul', 'mul']
    >>> io = hbm_io(g)
    >>> io[g.nodes[5].id]   # the tanh: its operand and result stay in registers
    ((False,), (False,))
    >>> io[g.nodes[-1].id]  # the last mul: reads the matmul's result, writes the output
    ((True, False), (True,))
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
from autopar.trace.graph import Graph

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


def hbm_io(graph: Graph) -> dict[int, IO]:
    """Which operands each fusible or reducing node of ``graph`` reads from HBM and which
    results it writes there (nodes absent from the map read and write everything).

    Only this graph's nodes are classified (a loop body is its own graph): values that
    enter it or leave it are materialised.
    """
    nodes = {n.id: n for n in graph.nodes}
    escapes = {o.value for o in graph.outputs}

    def materialised(v: int) -> bool:
        src = graph.producer.get(v)
        if src is None or v in escapes:
            return True  # a graph input, a constant, or a result
        if nodes[src].primitive not in FUSIBLE:
            return True
        users = graph.consumers.get(v, ())
        if len(users) != 1:
            return True
        return nodes[users[0]].primitive not in FUSION_CONSUMERS

    out: dict[int, IO] = {}
    for node in graph.nodes:
        if node.primitive not in FUSION_CONSUMERS:
            continue
        reads = tuple(v >= 0 and materialised(v) for v in node.inputs)
        if node.primitive in FUSIBLE:
            writes = tuple(materialised(v) for v in node.outputs)
        else:
            writes = tuple(True for _ in node.outputs)  # a reduction's result is stored
        out[node.id] = (reads, writes)
    return out


__all__ = ["EXPENSIVE", "FUSIBLE", "FUSION_CONSUMERS", "IO", "hbm_io", "materialised_values"]
