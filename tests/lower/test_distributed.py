"""Two ``jax.distributed`` processes on CPU give one process's losses.

Each process has 4 simulated CPU devices (``--xla_force_host_platform_device_count=4``)
and Gloo cross-process collectives; together they form one 8-device mesh. The worker
(``tests/lower/_distributed_worker.py``) builds the zoo GPT in each process; what it does
with it is the case:

* ``autoparallel`` (runs in CI): the step decorated with ``autopar.autoparallel`` and no
  plan cache, so **each process runs the search itself**; the plan JSON of both
  processes, and of the same search in this process on 8 local devices, must be the same
  bytes (the search is deterministic: ``tests/core/test_determinism.py``; the workers also
  check it among themselves with ``multihost_utils.assert_equal`` before running, since
  processes running different programs would hang in a collective). The plan must
  shard something over an axis that spans both processes, and the losses must equal this
  process's 8-device run of the same decorated step. Both processes then save the state
  with ``autopar.checkpoint`` (each its own shards); this process restores it on its 8
  devices and its next loss is the 1-process run's.
* ``outer`` (slow): the search for the default cluster, ``Cluster.local()``, which for 2
  processes is 2 nodes of 4 devices and goes through the 4D outer loop; same bytes in
  both processes.
* ``pipeline`` (slow): the pipeline baseline on ``{pipe: 2, data: 2, tensor: 2}``,
  ``pipe`` outermost, so stage 0 lives on process 0 and stage 1 on process 1: the
  activations and gradients between stages cross processes.

Tolerance: ``LOSS_RTOL`` of ``tests/lower/_zoo.py``.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import jax
import numpy as np
import pytest

from autopar import baselines, checkpoint
from autopar.lower import lower_plan
from autopar.plan import Plan, idle_axes, spec_axes
from tests.lower import _distributed_worker as worker
from tests.lower._zoo import LOSS_RTOL

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 300  # per run of both processes; they are killed past it


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Workers:
    """The 2 processes of one worker case, started at construction; :meth:`results`
    waits for both (killing both past ``TIMEOUT_S``) and returns what each wrote, by
    process id. The test computes its single-process reference while they run."""

    def __init__(self, case: str, out: Path) -> None:
        self.case, self.out = case, out
        flags = [
            f
            for f in os.environ.get("XLA_FLAGS", "").split()
            if not f.startswith("--xla_force_host_platform_device_count")
        ]
        env = dict(
            os.environ,
            XLA_FLAGS=" ".join([*flags, "--xla_force_host_platform_device_count=4"]),
            JAX_PLATFORMS="cpu",
        )
        port = _free_port()
        self.deadline = time.monotonic() + TIMEOUT_S
        self.procs, self.files = [], []
        for i in range(2):
            log = open(out / f"{case}_{i}.log", "w")  # noqa: SIM115 (closed in results)
            self.files.append(log)
            self.procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", "tests.lower._distributed_worker", case, str(i)]
                    + [str(port), str(out)],
                    cwd=ROOT,
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            )

    def results(self) -> list[dict]:
        try:
            for p in self.procs:
                p.wait(timeout=max(self.deadline - time.monotonic(), 1))
        except subprocess.TimeoutExpired:
            pass
        timed_out = [p.pid for p in self.procs if p.poll() is None]
        self.close()
        tails = "\n".join(
            f"--- process {i} ---\n" + (self.out / f"{self.case}_{i}.log").read_text()[-3000:]
            for i in range(2)
        )
        assert not timed_out, f"killed after {TIMEOUT_S} s:\n{tails}"
        assert all(p.returncode == 0 for p in self.procs), tails
        return [json.loads((self.out / f"{self.case}_{i}.json").read_text()) for i in range(2)]

    def close(self) -> None:
        """Kill whichever process still runs (the test failed early, or time is up)."""
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for f in self.files:
            f.close()


@contextlib.contextmanager
def _workers(case: str, out: Path) -> Iterator[_Workers]:
    w = _Workers(case, out)
    try:
        yield w
    finally:
        w.close()


def test_two_processes_search_one_plan_and_give_one_process_losses(tmp_path):
    with _workers("autoparallel", tmp_path) as workers:
        # Meanwhile, one process on 8 local devices: the same decorated step and search.
        step, (state, batch) = worker.build(worker.DECORATED_LAYERS)
        train_step = worker.decorated(step)
        plan = train_step.plan_for(state, batch)
        placed = train_step.lower(state, batch).place_inputs((state, batch))
        local, reached = worker.run_steps(train_step, *placed, final=True)
        _, next_loss = train_step(reached, placed[1])
        got = workers.results()

    # Each process searched (no plan cache, nothing shared) and all chose the same bytes.
    for r in got:
        assert "cache_hit" not in r["timings"] and r["timings"]["plan_s"] > 0, r["timings"]
    assert got[0]["plan_json"] == got[1]["plan_json"]
    assert got[0]["plan_json"] == plan.to_json()

    # The plan splits something over an axis whose collectives cross the processes: an
    # axis is used when an input, output or activation layout names it or a collective
    # runs over it (the int32 tokens may arrive whole and be split on the device: the
    # activations carry the split then).
    used = {a for a, n in plan.mesh.items() if n > 1} - set(idle_axes(plan))
    assert used, f"the plan shards nothing: {plan.mesh}, idle {idle_axes(plan)}"
    assert got[0]["cross_process_axes"] == got[1]["cross_process_axes"]
    assert used & set(got[0]["cross_process_axes"]), (
        f"no axis the plan uses ({sorted(used)}) spans both processes "
        f"(cross-process axes: {got[0]['cross_process_axes']})"
    )
    # Data parallelism over 'data' (the outer axis, spanning both processes): values
    # split over it, and the gradients all-reduced across it.
    split = [c.name for c in plan.activations if "data" in spec_axes(c.spec)]
    split += [r.path for r in plan.inputs if "data" in spec_axes(r.spec)]
    assert split, [(c.name, c.spec) for c in plan.activations][:10]
    reductions = [c for c in plan.predicted.collectives if "data" in c.axes]
    assert any(c.kind == "all-reduce" for c in reductions), reductions

    # The 2-process losses are the 1-process 8-device losses (which other tests hold to
    # single-device jax.jit), in both processes.
    np.testing.assert_allclose(got[0]["losses"], got[1]["losses"], rtol=0)
    np.testing.assert_allclose(got[0]["losses"], local, rtol=LOSS_RTOL)

    # The state the 2 processes saved (each its own shards) restores in this one process
    # and continues as the 1-process run does.
    assert checkpoint.steps(tmp_path / "ckpt") == (worker.STEPS,)
    assert checkpoint.saved_plan(tmp_path / "ckpt") == plan
    restored = checkpoint.restore(tmp_path / "ckpt", plan)
    _, loss = train_step(restored, placed[1])
    np.testing.assert_allclose(float(loss), float(next_loss), rtol=LOSS_RTOL)


@pytest.mark.slow
def test_two_processes_outer_loop_search_the_same_plan(tmp_path):
    with _workers("outer", tmp_path) as workers:
        got = workers.results()
    assert [r["nodes"] for r in got] == [2, 2]  # Cluster.local(): one node per process
    assert got[0]["plan_json"] == got[1]["plan_json"]
    assert Plan.from_json(got[0]["plan_json"]).num_devices == 8


@pytest.mark.slow
def test_two_processes_give_single_process_losses(tmp_path):
    with _workers("pipeline", tmp_path) as workers:
        # One process: single-device jax.jit, and the same plan on 8 local devices.
        step, (state, batch) = worker.build()
        want = worker.run_steps(jax.jit(step), state, batch)
        plan = baselines.pipeline(step, worker.MESH, state, batch, microbatches=worker.MICROBATCHES)
        local = worker.run_steps(lower_plan(step, plan, (state, batch)), state, batch)
        got = workers.results()[0]
    assert got["process_of_pipe_stage"] == [[0], [1]]  # the stages really are 2 processes

    np.testing.assert_allclose(got["same_input_losses"], want, rtol=LOSS_RTOL)
    np.testing.assert_allclose(got["losses"], want, rtol=LOSS_RTOL)
    np.testing.assert_allclose(got["global_batch_loss"], want[0], rtol=LOSS_RTOL)
    np.testing.assert_allclose(local, want, rtol=LOSS_RTOL)
    np.testing.assert_allclose(got["losses"], local, rtol=LOSS_RTOL)
