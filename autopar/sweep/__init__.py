"""``autopar sweep SUITE.toml``: autopar's plans against hand-written baselines.

For every point of a suite (a model at one size on one cluster size;
:mod:`autopar.sweep.suite`), autopar's full search and the baselines (data parallel,
ZeRO-3/FSDP, Megatron 3D, FSDP + tensor; :mod:`autopar.sweep.plans`) are priced by the
same cost model; the results (:mod:`autopar.sweep.results`) are a JSON store keyed by
point (a rerun skips the points done), a CSV and a throughput plot.

Example:
    >>> store = autopar.sweep.run_sweep("benchmarks/suites/smoke.toml", "out")  # doctest: +SKIP
    >>> [r["plan"] for r in store.records()[0]["rows"]]  # doctest: +SKIP
    ['autopar', 'data_parallel', 'zero3', 'megatron_3d', 'fsdp_tensor']
"""

from autopar.sweep.plans import (
    PlanRow,
    PointContext,
    evaluate_baseline,
    megatron_3d_layout,
    plan_autopar,
)
from autopar.sweep.results import CSV_COLUMNS, ResultStore, atomic_write, plot, write_csv
from autopar.sweep.run import compile_plan, run_point, run_sweep
from autopar.sweep.suite import BASELINES, LoadSuiteError, Point, Suite, load_suite

__all__ = [
    "BASELINES",
    "CSV_COLUMNS",
    "LoadSuiteError",
    "PlanRow",
    "Point",
    "PointContext",
    "ResultStore",
    "Suite",
    "atomic_write",
    "compile_plan",
    "evaluate_baseline",
    "load_suite",
    "megatron_3d_layout",
    "plan_autopar",
    "plot",
    "run_point",
    "run_sweep",
    "write_csv",
]
