"""On-disk plan cache: a second process with the same step skips the search.

Plans are keyed by a fingerprint of the traced (inlined) jaxpr, the cluster, the search
options, and the autopar and cost-model versions, so any change that could change the plan
misses the cache. Writes are atomic (temporary file + ``os.replace``): a crash never leaves
a partial plan behind, and two processes racing on the same key both end with a whole file.

Example:
    >>> cache = PlanCache(tmp_dir)
    >>> key = plan_key(graph, cluster, SearchOptions())
    >>> p = cache.get(key) or cache.put(key, autopar.plan(graph, cluster=cluster))  # a miss
    >>> cache.get(key).mesh == p.mesh                                             # a hit
    True
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from autopar.errors import LoadPlanError
from autopar.plan import Plan

CACHE_ENV = "AUTOPAR_CACHE_DIR"


def default_cache_dir() -> Path:
    """``$AUTOPAR_CACHE_DIR`` if set (read at call time), else ``~/.cache/autopar/plans``."""
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env)
    return Path(os.path.expanduser("~")) / ".cache" / "autopar" / "plans"


def graph_fingerprint(graph) -> str:
    """SHA-256 of the inlined jaxpr text plus the input paths, shapes and dtypes."""
    h = hashlib.sha256()
    h.update(str(graph.jaxpr).encode())
    for inp in graph.inputs:
        h.update(f"{inp.path}:{inp.tensor.shape}:{inp.tensor.dtype}\n".encode())
    return h.hexdigest()


def signature_fingerprint(graph) -> str:
    """SHA-256 of the argument leaves (paths, shapes, dtypes): what a plan is valid for."""
    h = hashlib.sha256()
    for inp in graph.inputs:
        h.update(f"{inp.path}:{inp.tensor.shape}:{inp.tensor.dtype}\n".encode())
    for out in graph.outputs:
        h.update(f"out:{out.path}:{out.tensor.shape}:{out.tensor.dtype}\n".encode())
    return h.hexdigest()[:32]


def plan_key(graph, cluster, options, extra: str = "") -> str:
    """The cache key of one planning problem."""
    import cost_models
    from autopar import __version__

    cost_models_version = getattr(cost_models, "__version__", "0")

    payload = json.dumps(
        {
            "graph": graph_fingerprint(graph),
            "cluster": cluster.to_json(),
            "options": options.cache_key(),
            "autopar": __version__,
            "cost_models": cost_models_version,
            "extra": extra,
        },
        sort_keys=True,
        default=str,
    )
    return hashlib.sha256(payload.encode()).hexdigest()[:40]


class PlanCache:
    """A directory of ``<key>.json`` plans."""

    def __init__(self, directory: str | os.PathLike | None = None) -> None:
        self.directory = Path(directory) if directory is not None else default_cache_dir()

    def path(self, key: str) -> Path:
        return self.directory / f"{key}.json"

    def get(self, key: str) -> Plan | None:
        """The cached plan, or ``None`` on a miss. A corrupt entry is treated as a miss."""
        p = self.path(key)
        if not p.exists():
            return None
        try:
            return Plan.load(p)
        except LoadPlanError:
            return None

    def put(self, key: str, plan: Plan) -> Plan:
        plan.save(self.path(key))
        return plan

    def clear(self) -> int:
        """Delete every cached plan; returns how many were removed."""
        n = 0
        if self.directory.exists():
            for p in self.directory.glob("*.json"):
                p.unlink()
                n += 1
        return n
