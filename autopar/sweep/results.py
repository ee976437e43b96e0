"""A sweep's results: the JSON store (keyed by point, written atomically), the CSV and
the throughput plot, all derived from the same records.

Per plan the CSV reports the predicted step time, samples per second, model TFLOP/s per
device (the traced forward + backward FLOPs of a step, whatever the plan recomputes, over
the step time and the devices: Megatron-LM's "model FLOPs"), MFU (those TFLOP/s over the
device's dense bf16 peak from the cost model's device catalog), the peak memory per device
against the bound and whether it fits, the search (or pricing) time, autopar's speedup over
the plan, and for compiled points what ``verify`` measured.

Example:
    >>> store = ResultStore("sweep-smoke/results.json", suite)  # doctest: +SKIP
    >>> write_csv(store, "sweep-smoke/results.csv")  # doctest: +SKIP
"""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from autopar.atomic import atomic_write
from autopar.sweep.suite import Suite

GIB = 2**30
SCHEMA = 1

CSV_COLUMNS: tuple[str, ...] = (
    "point",
    "model",
    "params",
    "devices",
    "nodes",
    "batch",
    "plan",
    "status",
    "fits",
    "mesh",
    "schedule",
    "microbatches",
    "remat",
    "step_time_s",
    "samples_per_s",
    "tflops_per_device",
    "mfu",
    "memory_gib",
    "limit_gib",
    "search_s",
    "autopar_speedup",
    "compiled_collective_bytes",
    "predicted_collective_bytes",
    "compiled_memory_gib",
    "predicted_memory_gib",
    "verify_ok",
    "reason",
)
"""The CSV's columns, in order (one row per point and plan)."""

__all__ = [
    "CSV_COLUMNS",
    "ResultStore",
    "atomic_write",
    "derived",
    "losses",
    "plot",
    "rows",
    "write_csv",
]


class ResultStore:
    """The results JSON: ``{"suite": ..., "points": {point key: record}}``, rewritten
    atomically after every point, so an interrupted sweep resumes where it stopped."""

    def __init__(self, path: str | Path, suite: Suite) -> None:
        self.path = Path(path)
        self.suite = suite
        self.points: dict[str, dict[str, Any]] = {}
        if self.path.exists():
            data = json.loads(self.path.read_text())
            if data.get("schema") == SCHEMA:
                self.points = dict(data.get("points", {}))

    def done(self, key: str) -> bool:
        return key in self.points

    def put(self, key: str, record: Mapping[str, Any]) -> None:
        self.points[key] = dict(record)
        self.save()

    def save(self) -> None:
        data = {"schema": SCHEMA, "suite": self.suite.name, "points": self.points}
        # Not sorted: a mesh mapping is ordered (outer -> inner axes).
        atomic_write(self.path, json.dumps(data, indent=1) + "\n")

    def records(self) -> list[dict[str, Any]]:
        """The suite's points' records in suite order (points not run yet left out)."""
        keys = [p.key() for p in self.suite.points]
        return [self.points[k] for k in keys if k in self.points]


def derived(record: Mapping[str, Any], row: Mapping[str, Any]) -> dict[str, Any]:
    """One CSV row (:data:`CSV_COLUMNS`) for ``row`` (a plan) of ``record`` (a point)."""
    p = record["point"]
    step = row.get("step_time_s")
    auto = next((r for r in record["rows"] if r["plan"] == "autopar"), None)
    auto_step = auto.get("step_time_s") if auto and auto["status"] == "ok" else None
    tflops = record["model_flops"] / step / p["devices"] / 1e12 if step else None
    mem, limit = row.get("memory_bytes"), row["limit_bytes"]
    comp = row.get("compiled", {})
    out = {
        "point": p["name"],
        "model": f"{p['model']}:{p['preset']}",
        "params": record["params"],
        "devices": p["devices"],
        "nodes": record["nodes"],
        "batch": p["batch"],
        "plan": row["plan"],
        "status": row["status"],
        "fits": mem is not None and mem <= limit,
        "mesh": " x ".join(f"{a} {n}" for a, n in row.get("mesh", {}).items()),
        "schedule": row.get("schedule", "-"),
        "microbatches": row.get("microbatches", 1),
        "remat": row.get("remat", "none"),
        "step_time_s": step,
        "samples_per_s": p["batch"] / step if step else None,
        "tflops_per_device": tflops,
        "mfu": tflops * 1e12 / record["peak_flops"] if tflops is not None else None,
        "memory_gib": mem / GIB if mem is not None else None,
        "limit_gib": limit / GIB,
        "search_s": row.get("search_s"),
        "autopar_speedup": step / auto_step
        if step and auto_step and row["status"] == "ok"
        else None,
        "compiled_collective_bytes": comp.get("hlo_collective_bytes"),
        "predicted_collective_bytes": comp.get("predicted_collective_bytes"),
        "compiled_memory_gib": _gib(comp.get("compiled_memory_bytes")),
        "predicted_memory_gib": _gib(comp.get("predicted_memory_bytes")),
        "verify_ok": comp.get("verify_ok"),
        "reason": row.get("reason", "") or comp.get("error", ""),
    }
    return out


def _gib(x: float | None) -> float | None:
    return x / GIB if x is not None else None


def rows(store: ResultStore) -> list[dict[str, Any]]:
    """Every CSV row of the store, in suite then plan order."""
    return [derived(rec, r) for rec in store.records() for r in rec["rows"]]


def losses(store: ResultStore) -> list[tuple[str, str, float]]:
    """``(point, baseline, autopar's step time over the baseline's)`` wherever a baseline
    that fits is faster than autopar's plan (or autopar found none): the sweep's
    acceptance is that this is empty.

    Example:
        >>> losses(store)  # doctest: +SKIP
        []
    """
    out = []
    for rec in store.records():
        auto = next(r for r in rec["rows"] if r["plan"] == "autopar")
        for r in rec["rows"]:
            if r["plan"] == "autopar" or r["status"] != "ok":
                continue
            if auto["status"] != "ok" or auto["step_time_s"] > r["step_time_s"] * (1 + 1e-9):
                ratio = auto["step_time_s"] / r["step_time_s"] if auto["step_time_s"] else 0.0
                out.append((rec["point"]["name"], r["plan"], ratio))
    return out


def write_csv(store: ResultStore, path: str | Path) -> None:
    """The CSV of every point done so far (atomically)."""
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=list(CSV_COLUMNS))
    w.writeheader()
    for r in rows(store):
        w.writerow({k: _cell(v) for k, v in r.items()})
    atomic_write(path, buf.getvalue())


def _cell(v: Any) -> Any:
    if isinstance(v, float):
        return f"{v:.6g}"
    return "" if v is None else v


def plot(store: ResultStore, path: str | Path) -> None:
    """Grouped bars per point: predicted model TFLOP/s per device of autopar and of each
    baseline; a plan that does not fit or cannot be formed is an ``x`` at zero with its
    status (never left out). Written as PNG (matplotlib, Agg), atomically."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = store.records()
    plans = ["autopar", *store.suite.baselines]
    width = 0.8 / len(plans)
    fig, ax = plt.subplots(figsize=(max(6.0, 1.3 * len(records) + 2), 4.5))
    colors = plt.get_cmap("tab10")
    for j, name in enumerate(plans):
        xs, ys, bad = [], [], []
        for i, rec in enumerate(records):
            row = next((r for r in rec["rows"] if r["plan"] == name), None)
            x = i + (j - (len(plans) - 1) / 2) * width
            d = derived(rec, row) if row else None
            if d is not None and d["status"] == "ok" and d["tflops_per_device"]:
                xs.append(x)
                ys.append(d["tflops_per_device"])
            else:
                bad.append(x)
        ax.bar(xs, ys, width, label=name, color=colors(j))
        if bad:
            ax.plot(bad, [0] * len(bad), "x", color=colors(j), markersize=8)
    ax.set_xticks(range(len(records)))
    ax.set_xticklabels(
        [f"{r['point']['name']}\n{r['point']['devices']} dev" for r in records], fontsize=8
    )
    ax.set_ylabel("predicted model TFLOP/s per device")
    ax.set_title(f"{store.suite.name}: autopar vs baselines (x: does not fit / cannot form)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    atomic_write(path, buf.getvalue())
