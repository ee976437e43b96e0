"""The plan's ZeRO stage says what the layout does (issue 15, item 6): the label counts
parameter and optimizer-state bytes split over the data-parallel axes, which are the axes
splitting every split batch input's leading dimension."""

from __future__ import annotations

from autopar.search.to_plan import zero_stage_of

REP2 = ((), ())
TOKENS = (("data",), ())  # [batch, seq] over data


def test_tensor_parallel_model_is_not_zero3():
    # A ViT split over tensor: its pixels' batch dim over (data, tensor), its labels over
    # data; every weight split over tensor. The data-parallel axis is data alone.
    pixels = (("data", "tensor"), (), (), ())
    labels = (("data",),)
    weights = [(((), ("tensor",)), 4_000), ((("tensor",), ()), 4_000)]
    assert zero_stage_of([pixels, labels], weights, weights) == 0


def test_only_the_embedding_split_over_data_is_not_zero3():
    # A T5-small: the 32128 x 512 shared embedding (16.4M of 60.5M parameters) split over
    # data, everything else replicated.
    emb = ((("data",), ()), 32128 * 512 * 4)
    rest = (REP2, (60_506_624 - 32128 * 512) * 4)
    assert zero_stage_of([TOKENS], [emb, rest], [emb, rest]) == 0


def test_parameters_split_over_data_are_zero3():
    fsdp = [((("data",), ()), 1000), (((), ("data",)), 1000), (((),), 10)]
    assert zero_stage_of([TOKENS], fsdp, fsdp) == 3


def test_only_the_optimizer_state_split_over_data_is_zero1():
    params = [(REP2, 1000)]
    state = [((("data",), ()), 2000)]
    assert zero_stage_of([TOKENS], params, state) == 1


def test_no_data_parallel_axis_is_zero0():
    fsdp = [((("data",), ()), 1000)]
    assert zero_stage_of([REP2], fsdp, fsdp) == 0
    assert zero_stage_of([], fsdp, fsdp) == 0
