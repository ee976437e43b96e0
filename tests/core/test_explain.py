"""``autopar explain``: one leaf or op of a saved plan, its sharding, collectives and the
next-best choice; unknown paths are errors that list close matches."""

import re

import pytest

import autopar
from autopar.cli import main
from autopar.explain import ExplainPathError, explain, price_alternatives
from autopar.plan import Candidate, Plan, Predicted, PredictedCollective, TensorSharding
from tests.core.test_export import _plan, _step


def _hand_plan() -> Plan:
    """A ZeRO-3-like layout with a runner-up in the shortlist."""
    return Plan(
        mesh={"data": 2, "tensor": 4},
        inputs=(
            TensorSharding(
                "state/params/h/attn/q/kernel", (64, 256), "float32", ("data", "tensor"), "param"
            ),
            TensorSharding("state/params/h/ln/scale", (64,), "float32", (None,), "param"),
            TensorSharding(
                "state/opt_state/mu/h/attn/q/kernel", (64, 256), "float32", ("data", "tensor"),
                "opt_state",
            ),
            TensorSharding("batch/tokens", (8, 32), "int32", ("data", None), "batch"),
        ),
        predicted=Predicted(
            step_time_s=1e-3,
            collectives=(
                PredictedCollective("all-gather", ("data",), 131072.0, 2, 2e-5, "fsdp_gather"),
                PredictedCollective("all-reduce", ("data",), 512.0, 1, 4e-6, "dp_grad"),
            ),
        ),
        shortlist=(
            Candidate("data 2 x tensor 4", {"data": 2, "tensor": 4}, 1e-3, 1e9, verdict="chosen"),
            Candidate("data 8", {"data": 8}, 1.25e-3, 2e9, verdict="slower by 25.0%"),
        ),
    )  # fmt: skip


def test_explain_cli_on_a_saved_plan(tmp_path, capsys):
    path = tmp_path / "plan.json"
    _hand_plan().save(path)
    assert main(["explain", str(path), "params/h/attn/q/kernel"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("state/params/h/attn/q/kernel  (param, float32, shape (64, 256))")
    assert "sharding: P('data', 'tensor') on mesh data=2 x tensor=4" in out
    assert "dim 0 (64): split over data (2 ways) -> 32 per device" in out
    assert "dim 1 (256): split over tensor (4 ways) -> 64 per device" in out
    assert "per device: (32, 64) float32 = 8.00 KiB of 64.00 KiB (1/8)" in out
    assert "every device holds a different block" in out
    assert "laid out the same: 1 leaves (state/opt_state/mu/h/attn/q/kernel)" in out
    # fsdp_gather over data: its full 64 KiB of the step's 128 KiB (half of 20 us).
    assert "all-gather over data [fsdp_gather]: x2, 128.00 KiB, 20.0 us" in out
    assert "~64.00 KiB of the step's 128.00 KiB (estimate: once per step, ~50%, ~10.0 us)" in out
    assert "dp_grad" not in out  # split over data: its gradient is not all-reduced over it
    assert "runner-up 'data 8' at 1.25 ms per step, +250.0 us (+25.0%)" in out

    # A replicated parameter: its gradient is all-reduced over the batch axis.
    assert main(["explain", str(path), "h/ln/scale"]) == 0
    out = capsys.readouterr().out
    assert "each block held by 8 devices (replicated over data, tensor)" in out
    assert "all-reduce over data [dp_grad]: x1, 512 B" in out
    assert "~256 B of the step's 512 B" in out

    # Unknown path: exit 2 and close matches.
    assert main(["explain", str(path), "params/h/atn/q/kernel"]) == 2
    err = capsys.readouterr().err
    assert "'params/h/atn/q/kernel' names no input, output or op" in err
    assert "params/h/attn/q/kernel" in err


def test_explain_an_op_and_a_searched_plan(tmp_path, capsys):
    plan = _plan()
    path = tmp_path / "mlp.json"
    plan.save(path)
    w0 = plan.input("params/layer_0/w")
    axis = next(e for e in w0.spec if e is not None)
    assert main(["explain", str(path), "layer_0/w"]) == 0
    out = capsys.readouterr().out
    ways = plan.mesh[axis]
    assert f"split over {axis} ({ways} ways)" in out
    assert "the plan records no alternative" in out  # fixed mesh: a shortlist of one
    op = plan.layers[0]
    name = f"{op.layer}/{op.ops[0][0]}"
    text = explain(Plan.load(path), name)
    assert text.startswith(f"{name}  (op in layer {op.layer!r})")
    assert f"strategy: {op.ops[0][1]}" in text
    with pytest.raises(ExplainPathError, match="close matches: .*layer_0/w"):
        explain(plan, "layer0/w")
    with pytest.raises(ExplainPathError, match="several leaves"):
        explain(plan, "w")  # many leaves end in /w (no param named exactly "w")
    assert issubclass(ExplainPathError, autopar.AutoparError)


def test_alternatives_are_priced_from_the_step():
    step, state, batch = _step()
    plan = _plan()
    base, alts = price_alternatives(plan, "layer_0/w", step, (state, batch))
    # The plan's layout re-completed with the planner's objective is the plan's price.
    assert base == pytest.approx(plan.predicted.step_time_s, rel=1e-9)
    assert alts and all(a.step_time_s is not None for a in alts)
    assert (None, None) in [a.spec for a in alts]
    # The planner chose the cheapest: every alternative costs at least as much.
    assert all(a.step_time_s >= base * (1 - 1e-9) for a in alts)
    text = explain(plan, "layer_0/w", step=step, args=(state, batch))
    best = alts[0]
    m = re.search(r"next-best choice: (P\(.*?\)), which costs ([\d.]+) us per step", text)
    assert m, text
    assert float(m.group(2)) == pytest.approx((best.step_time_s - base) * 1e6, abs=0.05)
    assert "P(None, None)" in text
