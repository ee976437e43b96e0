"""Gradient accumulation written by the user: a ``lax.scan`` over microbatches.

A step that accumulates gradients itself looks like::

    mbs = jax.tree.map(lambda x: x.reshape(m, -1, *x.shape[1:]), batch)
    def body(acc, mb):
        loss, g = jax.value_and_grad(loss_fn)(params, mb)
        return jax.tree.map(jnp.add, acc, g), loss
    grads, losses = jax.lax.scan(body, zeros_like(params), mbs)
    ... optimizer update with grads / m ...

Its top level holds one ``scan`` whose body runs the whole model, forward and backward,
once per microbatch; the top level itself has no model equations. :func:`find_accumulations`
recognises such a loop by data flow alone (no names): a top-level ``scan``

* whose body differentiates (it holds backward equations),
* whose scanned-over operands (``xs``) are views of **batch** inputs (reshapes, casts),
* whose loop constants include views of **parameters**,
* and whose carry **accumulates** backward results: carry-out ``j`` is ``add(carry-in j,
  v)`` (either order, ``add``/``add_any``) with ``v`` computed from a backward equation.

:func:`annotate_accumulation` then gives the loop body what a plain step's top level has:
its inputs get roles (``param`` for the parameters it closes over, ``batch`` for the
microbatch slices, ``other`` for the accumulators and everything else) and paths naming
the outer value (``consts/3/params/h_0/attn/q/kernel``), and layers are found among its
equations exactly as for an unrolled step (Flax name stacks, nested layer scans, or
structural repetition: :func:`autopar.trace.layers.find_layers`). The body's nodes carry
``layer`` indices into **the body graph's** ``layers``; the top level keeps its own
(usually none), so nothing that reads top-level layers (pipeline stages, remat) mistakes
a body layer for one it can cut.

Example:
    >>> def step(ws, batch):  # three tanh layers, SGD, 4 microbatches
    ...     def loss(ws, x):
    ...         for w in ws:
    ...             x = jnp.tanh(x @ w)
    ...         return x.sum()
    ...     def body(acc, x):
    ...         g = jax.grad(loss)(ws, x)
    ...         return [a + b for a, b in zip(acc, g)], None
    ...     xs = batch.reshape(4, -1, 8)
    ...     grads = jax.lax.scan(body, [jnp.zeros_like(w) for w in ws], xs)[0]
    ...     return [w - 0.1 * g for w, g in zip(ws, grads)]
    >>> g = autopar.trace(step, [jnp.ones((8, 8))] * 3, jnp.ones((16, 8)))
    >>> acc = g.accumulations[0]
    >>> acc.microbatches, len(acc.params), len(acc.accumulators), g.layers
    (4, 3, 3, ())
    >>> [layer.kind for layer in g.nodes[acc.node].body[0].layers]
    ['repeat', 'repeat', 'repeat']
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from autopar.trace.graph import Graph, GraphInput, GraphOutput, InputRole, Node
from autopar.trace.layers import find_layers

# Ops through which an input stays "the same data" (a microbatch split is a reshape).
_VIEWS = frozenset(
    {"reshape", "convert_element_type", "transpose", "copy", "copy_p", "squeeze", "expand_dims"}
)
_ADDS = frozenset({"add", "add_any"})
_WALK_LIMIT = 400  # values visited from one accumulated gradient into the update


@dataclass(frozen=True)
class Accumulator:
    """One carry of an accumulation loop that sums backward results.

    Attributes:
        carry: index among the loop's carries (``0 .. num_carry - 1``).
        shape: the accumulated value's shape.
        dtype: its dtype.
        param: graph input index of the parameter whose updated value the accumulated
            sum reaches (through the optimizer), or ``None`` when it reaches several
            (global-norm clipping) or none.
    """

    carry: int
    shape: tuple[int, ...]
    dtype: str
    param: int | None = None


@dataclass(frozen=True)
class AccumulationScan:
    """A top-level ``scan`` that runs forward and backward once per microbatch.

    Attributes:
        node: its node id in the top-level graph.
        microbatches: trip count (``length``).
        params: ``(body input index, graph input index)`` of each loop constant that is a
            parameter (or a view of one).
        batch: ``(body input index, graph input index)`` of each scanned-over operand that
            is a view of a batch input.
        accumulators: the carries that sum backward results.
        layers: how many layers were found in the body (``graph.nodes[node].body[0].layers``).
    """

    node: int
    microbatches: int
    params: tuple[tuple[int, int], ...]
    batch: tuple[tuple[int, int], ...]
    accumulators: tuple[Accumulator, ...]
    layers: int = 0


def _views_of(
    nodes: Sequence[Node], inputs: Sequence[GraphInput], role: InputRole
) -> dict[int, int]:
    """Value id -> graph input index, for inputs of ``role`` and their views."""
    view = {gi.value: gi.index for gi in inputs if gi.role == role}
    for n in nodes:
        if n.primitive in _VIEWS and n.inputs and n.inputs[0] in view:
            for v in n.outputs:
                view[v] = view[n.inputs[0]]
    return view


def _backward_values(body: Graph) -> set[int]:
    """Body value ids computed (transitively) from a backward equation's result."""
    out: set[int] = set()
    for n in body.nodes:
        if n.phase == "backward" or any(v in out for v in n.inputs):
            out.update(n.outputs)
    return out


def _accumulators(node: Node, body: Graph) -> list[tuple[int, int]]:
    """``(carry index, body value of the carry-out)`` of carries that sum backward results."""
    nc, nk = int(node.params.get("num_consts", 0)), int(node.params.get("num_carry", 0))
    ins = sorted(body.inputs, key=lambda i: i.index)
    outs = sorted(body.outputs, key=lambda o: o.index)
    if len(ins) != len(node.inputs) or len(outs) != len(node.outputs):
        return []
    grads = _backward_values(body)
    found = []
    for j in range(nk):
        carry_in, carry_out = ins[nc + j].value, outs[j].value
        src = body.producer.get(carry_out)
        if src is None:
            continue
        n = body.nodes[src]
        if n.primitive not in _ADDS or len(n.inputs) != 2 or carry_in not in n.inputs:
            continue
        other = n.inputs[1] if n.inputs[0] == carry_in else n.inputs[0]
        if other in grads:
            found.append((j, carry_out))
    return found


def find_accumulations(
    nodes: Sequence[Node], inputs: Sequence[GraphInput], outputs: Sequence[GraphOutput]
) -> list[AccumulationScan]:
    """The gradient-accumulation loops among the top-level ``nodes`` (see the module
    docstring for the rule), in program order. ``inputs`` must carry their roles and
    ``output_index`` (a parameter's updated value pairs it with its accumulator)."""
    params = _views_of(nodes, inputs, "param")
    batch = _views_of(nodes, inputs, "batch")
    out: list[AccumulationScan] = []
    for n in nodes:
        if n.primitive != "scan" or not n.body:
            continue
        body = n.body[0]
        if not any(b.phase == "backward" for b in body.nodes):
            continue
        nc, nk = int(n.params.get("num_consts", 0)), int(n.params.get("num_carry", 0))
        p = tuple((i, params[v]) for i, v in enumerate(n.inputs[:nc]) if v in params)
        xs = tuple((nc + nk + i, batch[v]) for i, v in enumerate(n.inputs[nc + nk :]) if v in batch)
        accs = _accumulators(n, body)
        if not (p and xs and accs):
            continue
        shapes = [n.out_tensors[j] for j, _ in accs]
        pair = _paired_params(nodes, inputs, outputs, [n.outputs[j] for j, _ in accs])
        out.append(
            AccumulationScan(
                node=n.id,
                microbatches=n.length,
                params=p,
                batch=xs,
                accumulators=tuple(
                    Accumulator(j, s.shape, s.dtype, q)
                    for (j, _), s, q in zip(accs, shapes, pair, strict=True)
                ),
            )
        )
    return out


def _paired_params(
    nodes: Sequence[Node],
    inputs: Sequence[GraphInput],
    outputs: Sequence[GraphOutput],
    sums: Sequence[int],
) -> list[int | None]:
    """Per accumulated value (top-level value id of the loop's carry result), the one
    parameter whose updated value it reaches through the update, or ``None`` (several,
    e.g. after global-norm clipping; or none)."""
    new_value = {
        outputs[gi.output_index].value: gi.index
        for gi in inputs
        if gi.role == "param" and gi.output_index is not None
    }
    consumers: dict[int, list[int]] = {}
    for n in nodes:
        for v in n.inputs:
            if v >= 0:
                consumers.setdefault(v, []).append(n.id)
    out: list[int | None] = []
    for start in sums:
        reached: set[int] = set()
        seen: set[int] = set()
        stack = [start]
        while stack and len(seen) < _WALK_LIMIT:
            v = stack.pop()
            if v in seen:
                continue
            seen.add(v)
            if v in new_value:
                reached.add(new_value[v])
            for c in consumers.get(v, ()):
                stack.extend(nodes[c].outputs)
        out.append(reached.pop() if len(reached) == 1 and not stack else None)
    return out


def annotate_accumulation(
    node: Node, acc: AccumulationScan, inputs: Sequence[GraphInput]
) -> tuple[Graph, AccumulationScan]:
    """The loop body of ``node`` with input roles, paths and layers (see the module
    docstring), and ``acc`` with its layer count. The body's nodes get their ``layer``."""
    body = node.body[0]
    by_index = {gi.index: gi for gi in inputs}
    role: dict[int, tuple[InputRole, str]] = {}
    for i, gi in acc.params:
        role[i] = ("param", by_index[gi].path)
    for i, gi in acc.batch:
        role[i] = ("batch", by_index[gi].path)
    new_inputs = []
    for bi in body.inputs:
        r, outer = role.get(bi.index, ("other", ""))
        path = f"{bi.path}/{outer}" if outer else bi.path
        new_inputs.append(GraphInput(bi.index, bi.value, path, bi.tensor, r))
    layers, node_layer = find_layers(body.nodes, new_inputs, body.outputs)
    for nid, k in node_layer.items():
        # The body's nodes are not shared yet (the graph is being built): fill in the field
        # the frozen dataclass left empty, as the top level does.
        object.__setattr__(body.nodes[nid], "layer", k)
    new = Graph(
        body.nodes, body.values, new_inputs, body.outputs, layers, jaxpr=body.jaxpr,
        consts=body.consts, scope=body.scope,
    )  # fmt: skip
    return new, AccumulationScan(
        acc.node, acc.microbatches, acc.params, acc.batch, acc.accumulators, len(layers)
    )


__all__ = ["AccumulationScan", "Accumulator", "annotate_accumulation", "find_accumulations"]
