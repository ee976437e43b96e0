"""One process of the 2-process ``jax.distributed`` pipeline run (``test_distributed.py``).

Usage: ``python -m tests.lower._distributed_worker PROCESS_ID PORT OUT_JSON``, started by
the test, once per process, with ``XLA_FLAGS=--xla_force_host_platform_device_count=4``.

Every process builds the zoo GPT (tiny, fp32, 4 scanned layers, batch 16, seed 0): the
same arrays in each, on its first local device. The plan is the pipeline baseline on
``{pipe: 2, data: 2, tensor: 2}`` with 4 microbatches, lowered on the global mesh of all
8 devices (4 per process; ``pipe`` outermost, so each process holds one stage). The
lowered step places the process-local arrays on the planned global shardings itself.

Process 0 writes ``{"losses": [...], "same_input_losses": [...]}``:

* ``losses``: 2 free-running steps of the lowered step from the initial state;
* ``same_input_losses``: step ``k``'s loss computed by the lowered step from the state
  that single-device ``jax.jit(step)`` reached after ``k`` steps (the comparison the
  tolerance of ``tests/lower/_zoo.py`` is written for).
"""

from __future__ import annotations

import json
import os
import sys

STEPS = 2
MESH = {"pipe": 2, "data": 2, "tensor": 2}
MICROBATCHES = 4
BATCH = 16


def build():
    """(step, (state, batch)) of the zoo GPT used by the distributed test."""
    from benchmarks.models.gpt import GPTConfig, make_train_step

    cfg = GPTConfig.preset("tiny", precision="fp32", scan_layers=True, layers=4)
    return make_train_step(cfg, BATCH, abstract=False, seed=0)


def main(process_id: int, port: int, out: str) -> None:
    import jax
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        f"127.0.0.1:{port}", num_processes=2, process_id=process_id, initialization_timeout=120
    )
    assert jax.process_count() == 2 and jax.device_count() == 8, jax.devices()
    assert jax.local_device_count() == 4

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

    losses, s = [], state
    for _ in range(STEPS):
        s, loss = lowered(s, batch)
        losses.append(float(loss))
    same_input = [float(lowered(start, batch)[1]) for start in starts]
    # A global batch on another layout (replicated over all 8 devices) is resharded.
    replicated = NamedSharding(lowered.mesh, P())
    global_batch = jax.tree.map(
        lambda a: jax.make_array_from_callback(a.shape, replicated, lambda i: np.asarray(a)[i]),
        batch,
    )
    global_batch_loss = float(lowered(state, global_batch)[1])

    if process_id == 0:
        with open(out, "w") as f:
            json.dump(
                {
                    "losses": losses,
                    "same_input_losses": same_input,
                    "global_batch_loss": global_batch_loss,
                    "devices": [d.id for d in lowered.mesh.devices.flat],
                    "process_of_pipe_stage": [
                        sorted({d.process_index for d in row.flat}) for row in lowered.mesh.devices
                    ],
                },
                f,
            )
    print(f"process {process_id}: losses {losses} same-input {same_input}", flush=True)
    jax.distributed.shutdown()


if __name__ == "__main__":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
