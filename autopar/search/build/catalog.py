"""The strategies an op may take on one mesh, enumerated once and cached.

The build stages ask the catalog, never each other: coarsening asks whether a pinned
producer can make a layout, pricing asks for every leader's strategies and for the one
strategy a follower takes. Identical equations (the same matmul in 96 identical layers)
share one enumeration (:func:`struct_key`).

Example: the first matmul of the MLP train step on 8 devices.

    >>> from autopar.search.build.flatten import flatten
    >>> cat = StrategyCatalog(CostContext(cluster, {"data": 8}))
    >>> ops = flatten(graph).ops
    >>> matmul = next(op for op in ops if op.kind == "node" and op.node.primitive == "dot_general")
    >>> [st.name for st in cat.leader_strategies(matmul)]
    ['R', 'm0=data', 'n1=data', 'k1=data AR(data)', 'k1=data RS(data->0)', 'k1=data RS(data->1)']
    >>> cat.leader_strategies(matmul) is cat.leader_strategies(matmul)   # enumerated once
    True
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from autopar.search.build.records import Op, pad
from autopar.search.costs import CostContext
from autopar.search.sharding import Sharding, enumerate_shardings, format_sharding, shards
from autopar.search.strategies import OpStrategy, enumerate_strategies, follow_strategy
from autopar.trace.graph import GraphInput, Node


def struct_key(node: Node) -> tuple:
    """What an equation's strategies depend on: primitive, operand and result types,
    FLOPs and parameters (not its position): equal keys price identically.

    Example:
        >>> from autopar.trace.graph import TensorInfo
        >>> a = TensorInfo((4, 8), "float32")
        >>> n1 = Node(1, "exp", (0,), (1,), (a,), (a,), {})
        >>> n2 = Node(7, "exp", (5,), (6,), (a,), (a,), {})
        >>> struct_key(n1) == struct_key(n2)
        True
    """
    params = tuple(
        (k, repr(v)) for k, v in sorted(node.params.items()) if "jaxpr" not in k and k != "body"
    )
    return (node.primitive, node.in_tensors, node.out_tensors, node.flops, params)


class StrategyCatalog:
    """Strategies on one mesh, memoised.

    Args:
        ctx: prices on the mesh.
        fixed_inputs: graph input index -> the only sharding it may take.
        input_axes: graph input index -> the axes its sharding may use.
        required_axes: graph input index -> axes its sharding must use, when a sharding
            it may take can (a fixed ZeRO stage: optimizer state split over the
            data-parallel axes; a tensor no split divides keeps its other choices).
    """

    def __init__(
        self,
        ctx: CostContext,
        *,
        fixed_inputs: Mapping[int, Sharding] | None = None,
        input_axes: Mapping[int, Sequence[str]] | None = None,
        required_axes: Mapping[int, Sequence[str]] | None = None,
    ) -> None:
        self.ctx = ctx
        self.fixed_inputs = dict(fixed_inputs or {})
        self.input_axes = dict(input_axes or {})
        self.required_axes = {i: frozenset(a) for i, a in (required_axes or {}).items() if a}
        self._keys: dict[int, tuple] = {}
        self._enum: dict[tuple, list[OpStrategy]] = {}
        self._follow: dict[tuple, OpStrategy] = {}
        self._specs: dict[tuple, list[Sharding]] = {}

    def key(self, op: Op) -> tuple:
        """:func:`struct_key` of ``op``'s equation with its fusion I/O."""
        k = self._keys.get(op.index)
        if k is None:
            k = self._keys[op.index] = (struct_key(op.node), op.io)
        return k

    def input_specs(self, gi: GraphInput, whole: frozenset[int] = frozenset()) -> list[Sharding]:
        """The layouts graph input ``gi`` may take, keeping the dims ``whole`` whole."""
        ck = (gi.index, whole)
        hit = self._specs.get(ck)
        if hit is None:
            fixed = self.fixed_inputs.get(gi.index)
            if fixed is not None:
                hit = [fixed]
            else:
                dims = [d for d in range(gi.tensor.ndim) if d not in whole]
                hit = enumerate_shardings(
                    gi.tensor.shape, self.ctx.mesh, self.input_axes.get(gi.index), dims
                )
                need = self.required_axes.get(gi.index)
                if need:
                    using = [s for s in hit if need <= {a for dim in s for a in dim}]
                    if gi.role == "batch":
                        # ZeRO's data-parallel ranks split the batch: its leading dim (a
                        # required axis on the sequence instead made another axis the
                        # batch's, and the plan no ZeRO plan at all).
                        lead = [s for s in using if s and need <= set(s[0])]
                        using = lead or using
                    hit = using or hit
            self._specs[ck] = hit
        return hit

    def leader_strategies(
        self,
        op: Op,
        pinned: Mapping[int, Sharding] | None = None,
        whole: frozenset[int] = frozenset(),
        reads: Mapping[int, Sharding] | None = None,
    ) -> list[OpStrategy]:
        """Every strategy ``op`` may take when it leads a group (``pinned``: result port
        -> the layout the plan pins; ``whole``: an input's dims kept whole; ``reads``:
        operand -> the layout the plan reads it in)."""
        if op.kind == "node":
            key = self.key(op)
            hit = self._enum.get(key)
            if hit is None:
                hit = self._enum[key] = enumerate_strategies(op.node, self.ctx, op.io)
            if pinned:
                hit = [st for st in hit if all(st.outs[p] == s for p, s in pinned.items())]
            if reads:
                hit = [
                    st
                    for st in hit
                    if all(k < len(st.ins) and st.ins[k] == s for k, s in reads.items())
                ]
            return hit
        if op.kind == "input":
            out = []
            for s in self.input_specs(op.input, whole):
                # Batch data is written into device memory every step: sharding it
                # writes less (and breaks ties towards sharded inputs).
                cost = 0.0
                if op.input.role in ("batch", "other"):
                    t = op.input.tensor
                    cost = self.ctx.compute(
                        0.0, t.nbytes / shards(s, self.ctx.mesh), t.dtype, "other"
                    )
                out.append(OpStrategy(format_sharding(s), (), (s,), cost))
            return out
        if op.kind == "output":
            return [
                OpStrategy(format_sharding(s), (s,), (), 0.0)
                for s in self.input_specs(op.input, whole)
            ]
        if op.kind == "constraint":
            s = op.node.params["spec"]
            return [OpStrategy("pinned " + format_sharding(s), (s,), (s,), 0.0)]
        if op.kind == "body_input":
            lead = op.node.params["lead"]
            carry = len(op.node.in_tensors) == 2
            out = []
            for s in enumerate_shardings(op.node.out_tensors[0].shape, self.ctx.mesh):
                ins = (pad(s, lead), s) if carry else (pad(s, lead),)
                out.append(OpStrategy(format_sharding(s), ins, (s,), 0.0))
            return out
        raise AssertionError(op.kind)

    def follow(self, op: Op, k: int, spec: Sharding) -> OpStrategy:
        """The one strategy ``op`` takes when operand ``k`` arrives laid out as ``spec``."""
        if op.kind == "body_input":
            lead = op.node.params["lead"]
            kept = ((),) * lead + spec[lead:]  # the scanned dim is sliced: never sharded
            body = spec[lead:]
            ins = (kept, body) if len(op.node.in_tensors) == 2 else (kept,)
            return OpStrategy(format_sharding(body), ins, (body,), 0.0)
        key = (self.key(op), k, spec)
        hit = self._follow.get(key)
        if hit is None:
            hit = self._follow[key] = follow_strategy(op.node, k, spec, self.ctx, op.io)
        return hit


__all__ = ["StrategyCatalog", "struct_key"]
