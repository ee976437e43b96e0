"""One process of a 2-process ``jax.distributed`` run (``test_distributed.py``).

Usage: ``python -m tests.lower._distributed_worker CASE PROCESS_ID PORT OUT_DIR``, started
by the test, once per process, with ``XLA_FLAGS=--xla_force_host_platform_device_count=4``.
Each process writes ``OUT_DIR/CASE_PROCESS_ID.json``.

Every process builds the zoo GPT (tiny, fp32, scanned layers, batch 16, seed 0): the
same arrays in each, on its first local device. Three cases:

``pipeline`` (4 layers): the pipeline baseline on ``{pipe: 2, data: 2, tensor: 2}`` with 4
microbatches, lowered on the global mesh of all 8 devices (4 per process; ``pipe``
outermost, so each process holds one stage). The lowered step places the process-local
arrays on the planned global shardings itself. It writes:

* ``losses``: 2 free-running steps of the lowered step from the initial state;
* ``same_input_losses``: step ``k``'s loss computed by the lowered step from the state
  that single-device ``jax.jit(step)`` reached after ``k`` steps (the comparison the
  tolerance of ``tests/lower/_zoo.py`` is written for).

``autoparallel`` (``DECORATED_LAYERS``): the step decorated with ``autopar.autoparallel``
without a plan cache, so **every process runs the search itself**; nothing is shared
between them but the inputs. It plans for ``CLUSTER`` (one node of 8 ``cpu-sim``
devices: the hardware the 1-process / 8-device reference plans for), checks with
``multihost_utils.assert_equal`` that both processes chose the same plan bytes (before
any collective could hang on different programs), runs 2 free-running steps, saves the
state reached with ``autopar.checkpoint`` (``OUT_DIR/ckpt``, step 2: each process
writes its shards) and writes the plan JSON, which mesh axes span both processes, and
the losses.

``outer`` (``DECORATED_LAYERS``): plans only, for the default cluster,
``Cluster.local()``, which here is 2 nodes (one per process) of 4 devices, and so goes
through the 4D outer loop (``autopar.search.outer``); writes the plan JSON.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time

STEPS = 2
MESH = {"pipe": 2, "data": 2, "tensor": 2}
MICROBATCHES = 4
BATCH = 64  # at 16 sequences the cost model replicates the tiny GPT's batch (latency-bound)
CASES = ("pipeline", "autoparallel", "outer")
DECORATED_LAYERS = 2  # the decorated-step cases: a smaller GPT (compile time)
CLUSTER = "cpu-sim"  # the preset the autoparallel case (and its reference) plans for


def build(layers: int = 4):
    """(step, (state, batch)) of the zoo GPT used by the distributed test."""
    from benchmarks.models.gpt import GPTConfig, make_train_step

    cfg = GPTConfig.preset("tiny", precision="fp32", scan_layers=True, layers=layers)
    return make_train_step(cfg, BATCH, abstract=False, seed=0)


def decorated(step, cluster=CLUSTER):
    """``step`` under ``@autoparallel`` as both the workers and the reference use it."""
    import autopar

    return autopar.autoparallel(step, cluster=cluster, cache=False)


def run_steps(fn, state, batch, *, final: bool = False):
    """``STEPS`` free-running steps of ``fn`` from ``state``: their losses (and the state
    reached, with ``final``)."""
    losses, s = [], state
    for _ in range(STEPS):
        s, loss = fn(s, batch)
        losses.append(float(loss))
    return (losses, s) if final else losses


def cross_process_axes(mesh) -> list[str]:
    """Axes of ``mesh`` (a ``jax.sharding.Mesh``) along which the owning process changes:
    a collective over one of them moves data between processes."""
    import numpy as np

    procs = np.vectorize(lambda d: d.process_index)(mesh.devices)
    return [
        name
        for i, name in enumerate(mesh.axis_names)
        if procs.shape[i] > 1 and not (np.diff(procs, axis=i) == 0).all()
    ]


def _pipeline(out_dir: str) -> dict:
    import jax
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from autopar import baselines
    from autopar.lower import lower_plan

    step, (state, batch) = build()
    plan = baselines.pipeline(step, MESH, state, batch, microbatches=MICROBATCHES)
    lowered = lower_plan(step, plan, (state, batch))  # mesh: all 8 global devices
    assert lowered.mesh.size == 8

    # Single-device reference states (this process's first device) for same-input losses.
    jitted = jax.jit(step)
    starts, s = [], state
    for _ in range(STEPS):
        starts.append(s)
        s, _ = jitted(s, batch)

    losses = run_steps(lowered, state, batch)
    same_input = [float(lowered(start, batch)[1]) for start in starts]
    # A global batch on another layout (replicated over all 8 devices) is resharded.
    replicated = NamedSharding(lowered.mesh, P())
    global_batch = jax.tree.map(
        lambda a: jax.make_array_from_callback(a.shape, replicated, lambda i: np.asarray(a)[i]),
        batch,
    )
    global_batch_loss = float(lowered(state, global_batch)[1])
    return {
        "losses": losses,
        "same_input_losses": same_input,
        "global_batch_loss": global_batch_loss,
        "devices": [d.id for d in lowered.mesh.devices.flat],
        "process_of_pipe_stage": [
            sorted({d.process_index for d in row.flat}) for row in lowered.mesh.devices
        ],
    }


def _autoparallel(out_dir: str) -> dict:
    import numpy as np
    from jax.experimental import multihost_utils

    step, (state, batch) = build(DECORATED_LAYERS)
    train_step = decorated(step)
    t0 = time.perf_counter()
    plan = train_step.plan_for(state, batch)  # traces and searches, here, in this process
    search_s = time.perf_counter() - t0
    text = plan.to_json()
    digest = hashlib.sha256(text.encode()).hexdigest()
    # Every process must run the same program: fail here, loudly, if the searches disagreed
    # (a collective would otherwise hang or mix layouts).
    digest_bytes = np.frombuffer(bytes.fromhex(digest), np.uint8).astype(np.int32)
    multihost_utils.assert_equal(digest_bytes, "the processes' searches chose different plans")
    # Laid out as planned before the first call (host copies of this process's arrays,
    # keeping its own shards), so the first and later calls share one compiled program.
    state, batch = train_step.lower(state, batch).place_inputs((state, batch))
    t0 = time.perf_counter()
    losses, reached = run_steps(train_step, state, batch, final=True)
    run_s = time.perf_counter() - t0
    mesh = train_step.lower(state, batch).mesh
    # Both processes save the state reached, each writing only its own shards.
    from autopar import checkpoint

    t0 = time.perf_counter()
    checkpoint.save(os.path.join(out_dir, "ckpt"), reached, plan, step=STEPS)
    save_s = time.perf_counter() - t0
    return {
        "plan_json": text,
        "plan_sha256": digest,
        "search_s": search_s,
        "run_s": run_s,
        "save_s": save_s,
        "timings": train_step.last_timings,
        "mesh_axes": list(mesh.axis_names),
        "cross_process_axes": cross_process_axes(mesh),
        "losses": losses,
    }


def _outer(out_dir: str) -> dict:
    step, (state, batch) = build(DECORATED_LAYERS)
    train_step = decorated(step, cluster=None)  # Cluster.local(): 2 nodes (processes) x 4
    t0 = time.perf_counter()
    text = train_step.plan_for(state, batch).to_json()
    return {
        "plan_json": text,
        "plan_sha256": hashlib.sha256(text.encode()).hexdigest(),
        "search_s": time.perf_counter() - t0,
        "cluster": train_step.cluster.name,
        "nodes": train_step.cluster.num_nodes,
    }


def main(case: str, process_id: int, port: int, out_dir: str) -> None:
    import jax

    if case not in CASES:
        raise SystemExit(f"case {case!r}: one of {CASES}")
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        f"127.0.0.1:{port}", num_processes=2, process_id=process_id, initialization_timeout=120
    )
    assert jax.process_count() == 2 and jax.device_count() == 8, jax.devices()
    assert jax.local_device_count() == 4

    result = {"pipeline": _pipeline, "autoparallel": _autoparallel, "outer": _outer}[case](out_dir)
    result["process_id"] = process_id
    with open(os.path.join(out_dir, f"{case}_{process_id}.json"), "w") as f:
        json.dump(result, f)
    print(
        f"process {process_id}: {case} {result.get('losses', result.get('plan_sha256'))}",
        flush=True,
    )
    jax.distributed.shutdown()


if __name__ == "__main__":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
