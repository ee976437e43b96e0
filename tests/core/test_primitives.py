"""The primitives table: one family per primitive, valid columns, the zoo covered, and the
facts the stages rely on (FLOP rules, fusion, recomputation, ILP groups)."""

from __future__ import annotations

from collections import Counter
from typing import get_args

import pytest

from autopar import primitives as P
from autopar.primitives import family_of


def test_every_primitive_is_in_at_most_one_family():
    counts = Counter(p for fam in P.FAMILIES for p in fam.members)
    assert [p for p, n in counts.items() if n > 1] == []
    assert P.KNOWN == frozenset(counts)
    assert len({fam.name for fam in P.FAMILIES}) == len(P.FAMILIES)
    assert all(fam.members for fam in P.FAMILIES)


def test_columns_hold_values_the_stages_dispatch_on():
    for fam in P.FAMILIES:
        assert fam.flops in get_args(P.FlopRule), fam.name
        assert fam.sharding in get_args(P.ShardingRule), fam.name
        assert fam.compute in get_args(P.ComputeKind), fam.name
        assert fam.reads in ("all", "slice")
        assert fam.update_operand in (None, 1, 2)
    assert P.FOLLOW_RULES | P.ENUMERATED_RULES | {"scan", "replicate"} == set(
        get_args(P.ShardingRule)
    )
    assert not P.FOLLOW_RULES & P.ENUMERATED_RULES


def test_strategies_have_a_rule_for_every_follow_rule():
    from autopar.search import strategies

    assert set(strategies._RULES) == P.FOLLOW_RULES
    assert strategies.FOLLOWABLE == P.FOLLOWABLE


def _primitives(graph, out: set[str]) -> set[str]:
    for node in graph.nodes:
        out.add(node.primitive)
        for body in node.body:
            _primitives(body, out)
    return out


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_every_primitive_of_the_gpt_step_has_a_family(dropout):
    from autopar import trace
    from benchmarks.models.gpt import GPTConfig, make_train_step

    step, args = make_train_step(GPTConfig.preset("tiny", dropout=dropout), 2, abstract=True)
    prims = _primitives(trace(step, *args), set())
    assert {"dot_general", "exp", "reduce_sum", "scatter-add"} <= prims
    assert sorted(p for p in prims if family_of(p) is None) == []
    if dropout:
        assert prims & P.RANDOM_BITS


def test_known_facts():
    dot = family_of("dot_general")
    assert (dot.flops, dot.sharding, dot.compute) == ("dot", "dot", "matmul")
    assert dot.leads_group and not dot.layout_following
    assert not dot.recomputable and not dot.fusible and "dot_general" not in P.RECOMPUTABLE
    assert P.MATMULS == {"dot_general", "conv_general_dilated"}

    exp = family_of("exp")
    assert (exp.flops, exp.sharding, exp.compute) == ("elementwise", "elementwise", "elementwise")
    assert exp.fusible and exp.recomputable and exp.expensive and exp.remat_tail
    assert not family_of("add").expensive and "add" in P.FUSIBLE

    # A cast counts no FLOPs but is laid out, fused and recomputed like elementwise ops.
    cast = family_of("convert_element_type")
    assert cast.flops == "free" and cast.sharding == "elementwise"
    assert cast.fusible and cast.recomputable and cast.compute == "elementwise"

    # Reductions root a fusion (XLA) and fuse recomputation (remat model); a
    # cumulative sum only the latter; gathers and scatter-adds recompute their operands.
    assert {"reduce_sum", "argmax"} <= P.FUSION_CONSUMERS - P.FUSIBLE
    assert "cumsum" in P.RECOMPUTE_CONSUMERS - P.FUSION_CONSUMERS
    assert {"gather", "scatter-add", "dynamic_update_slice"} <= P.RECOMPUTE_CONSUMERS
    assert "gather" not in P.RECOMPUTABLE

    # Slicing ops are recomputable but stay out of a remat block's tail.
    assert "slice" in P.RECOMPUTABLE - P.REMAT_TAIL
    assert {"reshape", "broadcast_in_dim", "transpose", "iota"} <= P.REMAT_TAIL

    assert P.RANDOM_BITS == {"random_bits", "threefry2x32", "rng_bit_generator", "rng_uniform"}
    assert "threefry2x32" not in P.RECOMPUTABLE
    assert P.SCATTER_ADDS == {"scatter-add", "scatter_add"}
    assert family_of("gather").reads == "slice" and family_of("scatter-add").update_operand == 2
    assert family_of("dynamic_update_slice").update_operand == 1
    assert {p for p in P.KNOWN if family_of(p).compute == "none"} == {
        "broadcast_in_dim", "reshape", "squeeze", "expand_dims",
    }  # fmt: skip


def test_ilp_group_leaders():
    # The primitives that lead their own ILP group (the search's old ``ilp._KNOWN``).
    assert P.LEADS_GROUP == {
        "dot_general", "conv_general_dilated", "gather", "iota", "scan",
        "scatter-add", "scatter_add", "scatter", "scatter-mul", "scatter_mul",
    }  # fmt: skip
    assert P.LEADS_GROUP - P.ENUMERATED == {"scan"}
    assert not P.LEADS_GROUP & P.FOLLOWABLE
    # scatters with a min / max / sub combiner have no rule yet: replicated, not leaders
    assert P.sharding_rule("scatter-max") == "replicate"
    assert P.sharding_rule("no_such_primitive") == "replicate"


def test_derived_sets_nest():
    assert P.FUSIBLE <= P.FUSION_CONSUMERS
    assert P.EXPENSIVE <= P.FUSIBLE
    assert P.RECOMPUTABLE <= P.RECOMPUTE_CONSUMERS
    assert P.REMAT_TAIL <= P.RECOMPUTABLE <= P.FUSIBLE
    assert P.select(compute="none") <= P.FOLLOWABLE


def test_flop_counting_follows_the_table():
    from autopar.trace.flops import eqn_flops, is_counted
    from autopar.trace.graph import TensorInfo

    t = TensorInfo((4, 8), "float32")
    assert eqn_flops("exp", {}, [t], [t]) == 32.0
    assert eqn_flops("convert_element_type", {}, [t], [t]) == 0.0
    assert eqn_flops("reduce_sum", {"axes": (1,)}, [t], [TensorInfo((4,), "float32")]) == 32.0
    assert all(is_counted(p) for p in P.KNOWN)
    assert not is_counted("my_custom_op")


def test_select_rejects_unknown_columns():
    assert P.select(flops="dot") == {"dot_general"}
    with pytest.raises(TypeError, match="unknown column"):
        P.select(fusable=True)
