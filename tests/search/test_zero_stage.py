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


# -- the layout a batch input is used in ------------------------------------------------


def _problem(mesh, stored, reads, params):
    """A stand-in for a built problem: batch inputs ``tokens`` [32, 2048] stored as
    ``stored``, read (by an embedding lookup, through an index op in its group) in the
    layouts ``reads``; ``params``: ``(spec, bytes)`` of [4096, 4096] weights."""
    from types import SimpleNamespace as NS

    def tensor(shape, nbytes):
        return NS(shape=shape, ndim=len(shape), nbytes=nbytes)

    inputs = [NS(index=0, role="batch", path="batch/tokens", tensor=tensor((32, 2048), 0))]
    specs = {0: stored}
    for i, (spec, nbytes) in enumerate(params, start=1):
        inputs.append(NS(index=i, role="param", path=f"w{i}", tensor=tensor((4096, 4096), nbytes)))
        specs[i] = spec
    graph = NS(inputs=inputs)
    index_op = NS(kind="node", node=NS(out_tensors=(NS(shape=(32, 2048)),)))
    ops = {0: NS(kind="input"), 1: index_op}
    Ref = NS
    return NS(
        graph=graph,
        ctx=NS(mesh_dict=mesh),
        spec_of_input=lambda i, choice: specs[i],
        input_ops={gi.index: gi.index * 10 for gi in inputs},
        op_group={0: (0, 0), 1: (0, 1), **{i * 10: (i, 0) for i in range(1, len(inputs))}},
        ops=ops,
        resharded_reads=lambda choice: [
            (None, 1, Ref(op=1, port=0, delta=0), stored, need) for need in reads
        ],
    )


def test_a_batch_stored_whole_and_read_split_is_data_parallel():
    from autopar.search.to_plan import _zero_stage, batch_layouts, role_names

    # GPT-3 1.3B on 16 GPUs: the token arrays are kept whole (256 KiB) and the embedding
    # lookup slices them over the one axis, which also shards every weight: FSDP.
    bp = _problem({"a": 16}, REP2, [(("a",), ())], [((("a",), ()), 100), (((), ("a",)), 100)])
    assert batch_layouts(bp, ())[0] == (("a",), ())
    assert role_names(bp, (), ("data", "tensor")) == {"a": "data"}
    assert _zero_stage(bp, ()) == 3


def test_the_axis_splitting_only_the_batch_is_named_data():
    from autopar.search.to_plan import role_names

    # x splits the batch and the weights, y only the batch: y is the data axis.
    bp = _problem(
        {"x": 8, "y": 128}, REP2, [(("y", "x"), ())], [((("x",), ()), 100), (((), ("x",)), 100)]
    )
    assert role_names(bp, (), ("data", "tensor")) == {"x": "tensor", "y": "data"}
