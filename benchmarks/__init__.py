"""Benchmarks for autopar: a model zoo of real train steps, baselines and sweeps.

The model zoo lives in :mod:`benchmarks.models`; every model there exposes the same
``make_train_step(config, batch_size, abstract=True, seed=0) -> (step_fn, (state, batch))``
contract so the tracer, the planner and the baselines can treat them alike.
"""
