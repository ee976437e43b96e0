"""Hand-written baseline plans: the spec of each leaf, written out from the paper rules."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from autopar import baselines
from autopar.errors import InvalidOptionError
from autopar.trace import trace
from tests.lower._zoo import zoo_step


def _gpt(precision: str = "fp32", scan: bool = True):
    from benchmarks.models.gpt import GPTConfig, make_train_step

    cfg = GPTConfig.preset("tiny", precision=precision, scan_layers=scan)
    return make_train_step(cfg, 8, abstract=True)


def _specs(plan) -> dict[str, tuple]:
    return {r.path.split("/", 1)[1]: r.spec for r in plan.inputs}


def test_megatron_splits_by_name() -> None:
    step, args = _gpt()
    plan = baselines.megatron(step, {"data": 2, "tensor": 4}, *args)
    s = _specs(plan)
    col, row = (None, None, "tensor"), (None, "tensor", None)
    for name in ("q", "k", "v"):
        assert s[f"params/h/attn/{name}/kernel"] == col  # [layer, in, out]: split out
        assert s[f"params/h/attn/{name}/bias"] == (None, "tensor")
    assert s["params/h/attn/out/kernel"] == row  # split the input dim
    assert s["params/h/attn/out/bias"] == (None, None)  # added after the all-reduce
    assert s["params/h/mlp/fc_in/kernel"] == col
    assert s["params/h/mlp/fc_out/kernel"] == row
    assert s["params/wte/embedding"] == ("tensor", None)  # vocab
    assert s["params/wpe/embedding"] == (None, None)  # positions: replicated
    assert s["params/h/ln_1/scale"] == (None, None)
    # Adam moments follow their parameter; the step counter is replicated.
    assert s["opt_state/0/mu/h/attn/q/kernel"] == col
    assert s["opt_state/0/nu/h/mlp/fc_out/kernel"] == row
    assert s["opt_state/0/count"] == ()
    # Batch over data, replicated over tensor.
    assert s["tokens"] == ("data", None)
    assert plan.name == "megatron" and plan.zero_stage == 0
    assert baselines.fallbacks(plan) == ()
    # Outputs: the updated state keeps its input's spec, the loss is replicated.
    by_out = {r.path.split("/", 2)[2]: r.spec for r in plan.outputs[:-1]}
    assert by_out["params/h/attn/q/kernel"] == col
    assert plan.outputs[-1].spec == () and plan.outputs[-1].shape == ()
    assert plan.num_devices == 8


def test_mixed_precision_optimizer_state_follows_parameters() -> None:
    step, args = _gpt("mixed", scan=False)
    s = _specs(baselines.data_tensor(step, {"data": 2, "tensor": 4}, *args))
    assert s["params/h_1/mlp/fc_in/kernel"] == (None, "tensor")
    assert s["opt_state/master/h_1/mlp/fc_in/kernel"] == (None, "tensor")
    assert s["opt_state/adam/0/mu/h_1/mlp/fc_in/kernel"] == (None, "tensor")
    assert s["opt_state/adam/0/nu/h_0/attn/out/kernel"] == ("tensor", None)


def test_zero_stages() -> None:
    step, args = _gpt()
    s3 = _specs(baselines.zero(step, {"data": 8}, 3, *args))
    # Largest dim that 8 divides (ties: the last).
    assert s3["params/h/attn/q/kernel"] == (None, None, "data")
    assert s3["params/h/mlp/fc_out/kernel"] == (None, "data", None)
    assert s3["params/wte/embedding"] == ("data", None)
    assert s3["params/h/ln_1/scale"] == (None, "data")
    assert s3["opt_state/0/mu/h/attn/q/kernel"] == (None, None, "data")
    assert s3["tokens"] == ("data", None)
    s1 = _specs(baselines.zero(step, {"data": 8}, 1, *args))
    assert s1["params/h/attn/q/kernel"] == (None, None, None)  # parameters replicated
    assert s1["opt_state/0/mu/h/attn/q/kernel"] == (None, None, "data")
    # ZeRO-3 with Megatron: the tensor dim taken first, data on another dim.
    s3t = _specs(baselines.zero(step, {"data": 2, "tensor": 4}, 3, *args, tensor_axis="tensor"))
    assert s3t["params/h/attn/q/kernel"] == (None, "data", "tensor")
    assert s3t["tokens"] == ("data", None)
    with pytest.raises(InvalidOptionError, match="stage=4"):
        baselines.zero(step, {"data": 8}, 4, *args)


def test_data_parallel_uses_every_axis() -> None:
    step, args = _gpt()
    s = _specs(baselines.data_parallel(step, {"data": 2, "tensor": 4}, *args))
    assert s["tokens"] == (("data", "tensor"), None)
    assert s["params/h/attn/q/kernel"] == (None, None, None)


def test_expert_parallel_splits_experts() -> None:
    from benchmarks.models.moe import MoEConfig, make_train_step

    step, args = make_train_step(MoEConfig.preset("tiny", precision="fp32"), 8)
    s = _specs(baselines.expert_parallel(step, {"data": 2, "expert": 4}, *args))
    assert s["params/h_1/moe/wi"] == ("expert", None, None)  # [E, hidden, ffn]
    assert s["params/h_3/moe/wo"] == ("expert", None, None)
    assert s["opt_state/0/mu/h_1/moe/wi"] == ("expert", None, None)
    assert s["params/h_1/moe/router/kernel"] == (None, None)
    assert s["tokens"] == (("data", "expert"), None)


def test_indivisible_dims_fall_back_and_are_recorded() -> None:
    def step(params, batch):
        loss = jnp.mean((batch["x"] @ params["w"]) ** 2)
        return params, loss

    params = {"w": jax.ShapeDtypeStruct((6, 10), jnp.float32)}
    batch = {"x": jax.ShapeDtypeStruct((12, 6), jnp.float32)}
    plan = baselines.zero(step, {"data": 4}, 3, params, batch)
    s = _specs(plan)
    assert s["w"] == (None, None)  # neither 6 nor 10 divisible by 4
    assert s["x"] == ("data", None)  # 12 is
    reasons = dict(baselines.fallbacks(plan))
    assert "divisible by ('data',)=4" in reasons["params/w"]
    plan8 = baselines.data_parallel(step, {"data": 8}, params, batch)
    assert _specs(plan8)["x"] == (None, None)
    assert "batch/x" in dict(baselines.fallbacks(plan8))


def test_graph_and_function_give_the_same_plan() -> None:
    step, args = zoo_step("wide_resnet", abstract=True)
    graph = trace(step, *args)
    for make in (baselines.data_parallel, baselines.megatron):
        mesh = {"data": 2, "tensor": 4}
        from_fn, from_graph = make(step, mesh, *args), make(graph, mesh)
        assert [(r.path, r.spec, r.role) for r in from_fn.inputs] == [
            (r.path, r.spec, r.role) for r in from_graph.inputs
        ]
        assert [r.spec for r in from_fn.outputs] == [r.spec for r in from_graph.outputs]
    # BatchNorm statistics are model state, replicated, and updated in place.
    s = _specs(baselines.zero(graph, {"data": 8}, 3))
    stats = [k for k in s if k.startswith("batch_stats/")]
    assert stats and all(all(e is None for e in s[k]) for k in stats)


def test_bad_meshes_are_refused() -> None:
    step, args = _gpt()
    with pytest.raises(InvalidOptionError, match="'tensor' axis"):
        baselines.megatron(step, {"data": 8}, *args)
    with pytest.raises(InvalidOptionError, match="'data' axis"):
        baselines.data_tensor(step, {"fsdp": 2, "tensor": 4}, *args)
