"""Same inputs, same plan: the search's plan JSON is byte-identical across runs and processes.

Many processes of one job (``jax.distributed``) each search the plan themselves
(``tests/lower/test_distributed.py``) and must run the same program, and a plan cache or a
saved plan is only as good as the search is repeatable. So the zoo GPT (preset ``tiny``)
is planned in two fresh interpreters with different ``PYTHONHASHSEED`` (set and dict
iteration order of strings differs between them) and in this process, and the three
``plan.to_json()`` must be the same bytes.

What could break it, and why it does not today: string-set iteration order (hash seed:
covered here); CP-SAT with several workers or stopped by its wall-clock time limit (the
tiny GPT's problems are proved optimal by the rounded LP relaxation, HiGHS, which is
deterministic; the one CP-SAT solve, in ``search/evaluate.py``, runs one worker to
optimality); timings (the plan holds none: ``predicted`` is the cost model's, a pure
function of sizes and hardware).
"""

from __future__ import annotations

import difflib
import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CLUSTER = "cpu-sim"  # one node of 8 simulated devices, as in every process here

_PLAN = """
import sys
import autopar
from benchmarks.models.gpt import GPTConfig, make_train_step

step, (state, batch) = make_train_step(GPTConfig.preset("tiny"), 16, abstract=True, seed=0)
plan = autopar.plan(step, state, batch, cluster=sys.argv[2])
with open(sys.argv[1], "w") as f:
    f.write(plan.to_json())
"""


def _plan_in_process() -> str:
    import autopar
    from benchmarks.models.gpt import GPTConfig, make_train_step

    step, (state, batch) = make_train_step(GPTConfig.preset("tiny"), 16, abstract=True, seed=0)
    return autopar.plan(step, state, batch, cluster=CLUSTER).to_json()


def _first_difference(a: str, b: str) -> str:
    diff = difflib.unified_diff(a.splitlines(), b.splitlines(), lineterm="", n=2)
    return "\n".join(list(diff)[:40])


def test_plan_json_is_byte_identical_across_processes(tmp_path):
    procs = []
    for seed in ("1", "2"):
        env = dict(
            os.environ,
            PYTHONHASHSEED=seed,
            XLA_FLAGS="--xla_force_host_platform_device_count=8",
            JAX_PLATFORMS="cpu",
        )
        out = tmp_path / f"plan_{seed}.json"
        cmd = [sys.executable, "-c", textwrap.dedent(_PLAN), str(out), CLUSTER]
        procs.append((out, subprocess.Popen(cmd, cwd=ROOT, env=env, stderr=subprocess.PIPE)))
    here = _plan_in_process()  # meanwhile: a third process, pytest's own hash seed
    texts = []
    for out, p in procs:
        _, err = p.communicate(timeout=240)
        assert p.returncode == 0, err.decode()[-3000:]
        texts.append(out.read_text())

    assert texts[0] == texts[1], _first_difference(texts[0], texts[1])
    assert texts[0] == here, _first_difference(texts[0], here)
