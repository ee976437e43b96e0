"""Two ``jax.distributed`` processes on CPU run a pipeline plan with one process's losses.

Each process has 4 simulated CPU devices (``--xla_force_host_platform_device_count=4``)
and Gloo cross-process collectives (JAX 0.10's default ``jax_cpu_collectives_implementation``);
together they form one 8-device mesh ``{pipe: 2, data: 2, tensor: 2}``, ``pipe``
outermost, so stage 0 lives on process 0 and stage 1 on process 1: the activations and
gradients between stages cross processes. The worker (``tests/lower/_distributed_worker.py``)
builds the zoo GPT in each process, plans the pipeline baseline, lowers it on the global
mesh and runs it; process 0 reports the losses. Expected values: single-device
``jax.jit(step)`` in this process, and the same plan on this process's 8 local devices.
Tolerance: ``LOSS_RTOL`` of ``tests/lower/_zoo.py``.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from autopar import baselines
from autopar.lower import lower_plan
from tests.lower import _distributed_worker as worker
from tests.lower._zoo import LOSS_RTOL

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 300  # per run of both processes; they are killed past it


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_workers(out: Path, logs: Path) -> None:
    """Start the 2 processes, wait for both (killing both past ``TIMEOUT_S``)."""
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
    procs, files = [], []
    for i in range(2):
        log = open(logs / f"process_{i}.log", "w")  # noqa: SIM115 (closed below)
        files.append(log)
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "tests.lower._distributed_worker", str(i), str(port), out],
                cwd=ROOT,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        )
    deadline = time.monotonic() + TIMEOUT_S
    try:
        for p in procs:
            p.wait(timeout=max(deadline - time.monotonic(), 1))
    except subprocess.TimeoutExpired:
        pass
    finally:
        timed_out = [p.pid for p in procs if p.poll() is None]
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for f in files:
            f.close()
    tails = "\n".join(
        f"--- process {i} ---\n" + (logs / f"process_{i}.log").read_text()[-3000:] for i in range(2)
    )
    assert not timed_out, f"killed after {TIMEOUT_S} s:\n{tails}"
    assert all(p.returncode == 0 for p in procs), tails


@pytest.mark.slow
def test_two_processes_give_single_process_losses(tmp_path):
    out = tmp_path / "losses.json"
    _run_workers(out, tmp_path)
    got = json.loads(out.read_text())
    assert got["process_of_pipe_stage"] == [[0], [1]]  # the stages really are 2 processes

    # One process: single-device jax.jit, and the same plan on 8 local devices.
    step, (state, batch) = worker.build()
    jitted = jax.jit(step)
    want, s = [], state
    for _ in range(worker.STEPS):
        s, loss = jitted(s, batch)
        want.append(float(loss))
    plan = baselines.pipeline(step, worker.MESH, state, batch, microbatches=worker.MICROBATCHES)
    lowered = lower_plan(step, plan, (state, batch))
    local, s = [], state
    for _ in range(worker.STEPS):
        s, loss = lowered(s, batch)
        local.append(float(loss))

    np.testing.assert_allclose(got["same_input_losses"], want, rtol=LOSS_RTOL)
    np.testing.assert_allclose(got["losses"], want, rtol=LOSS_RTOL)
    np.testing.assert_allclose(got["global_batch_loss"], want[0], rtol=LOSS_RTOL)
    np.testing.assert_allclose(local, want, rtol=LOSS_RTOL)
    np.testing.assert_allclose(got["losses"], local, rtol=LOSS_RTOL)
