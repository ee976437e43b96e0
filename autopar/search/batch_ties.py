"""Inputs of one batch take one layout (issue 15, item 6).

A Hugging-Face-style step takes ``{"input_ids", "attention_mask", "labels"}``: three
``[batch, seq]`` arrays that are rows of the same examples. Priced one by one, the ILP
may split the mask's batch dimension over ``('data', 'tensor')`` (it feeds the
attention, which the plan splits over both) and ``input_ids`` over ``data`` (they feed
the embedding lookup), since nothing ties them; but a plan that lays out one batch two ways reads
as if the examples were different ones, and the data-parallel axes (those splitting every
batch input, :func:`autopar.search.to_plan.zero_stage_of`) shrink to what they share.

:func:`batch_ties` aliases (one strategy index for all, as the ILP's alias sets do for a
parameter and its optimizer state) the input groups of batch inputs of one shape whose
strategy lists line up. Inputs of other shapes (pixels ``[B, H, W, C]`` beside labels
``[B]``) have different layout lists and stay free: tying only their batch dimension
would need a constraint kind the problem does not have.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from autopar.search.build.coarsen import Coarse, same_layouts
from autopar.search.build.records import Group
from autopar.trace.graph import Graph


def batch_input_sets(graph: Graph) -> list[tuple[int, ...]]:
    """Graph-input indices of batch inputs, grouped by shape (sets of two or more).

    Example:
        >>> [[graph.inputs[i].path for i in s] for s in batch_input_sets(graph)]
        [['batch/x', 'batch/y']]
        >>> [graph.inputs[i].tensor.shape for i in batch_input_sets(graph)[0]]
        [(64, 256), (64, 256)]
    """
    by_shape: dict[tuple[int, ...], list[int]] = {}
    for gi in graph.inputs:
        if gi.role == "batch" and gi.tensor.ndim >= 1:
            by_shape.setdefault(tuple(gi.tensor.shape), []).append(gi.index)
    return [tuple(v) for v in by_shape.values() if len(v) > 1]


def batch_ties(
    coarse: Coarse, input_ops: Mapping[int, int], groups: Sequence[Group]
) -> list[tuple[int, ...]]:
    """Alias sets (group indices) tying batch inputs of one shape to one layout.

    Only groups whose strategy lists line up index by index
    (:func:`~autopar.search.build.coarsen.same_layouts`) are tied, so an alias never
    forces a layout one of them cannot take.
    """
    out: list[tuple[int, ...]] = []
    for members in batch_input_sets(coarse.graph):
        gs: list[int] = []
        for index in members:
            op = input_ops.get(index)
            if op is None or op not in coarse.where:
                continue
            g = coarse.where[op][0]
            if g not in gs:
                gs.append(g)
        if len(gs) < 2:
            continue
        first = groups[gs[0]]
        tied = [gs[0]] + [g for g in gs[1:] if same_layouts(first, groups[g])]
        if len(tied) > 1:
            out.append(tuple(sorted(tied)))
    return out


__all__ = ["batch_input_sets", "batch_ties"]
