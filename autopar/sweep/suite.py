"""Sweep suites: a TOML file of points (model x size x cluster) to plan and compare.

A suite names the cluster preset, the baselines to compare against, defaults shared by
every point, and the points themselves::

    name = "smoke"
    cluster = "dgx-a100-80gb"            # a cost_models.Cluster preset
    baselines = ["data_parallel", "zero3", "megatron_3d", "fsdp_tensor"]

    [defaults]                           # any point key; a point's own value wins
    model = "gpt"                        # a registered model family (autopar.registry)
    preset = "tiny"                      # its preset ...
    batch = 8                            # global batch (sequences per step)
    config = { scan_layers = true }      # ... with these fields overridden

    [[points]]
    name = "tiny-8"
    devices = 8                          # 1, 2, 4: part of a node; 8k: k whole nodes
    compile = true                       # also lower, compile and verify on CPU devices

A point with fewer devices than a node holds is one node of that many devices (the same
links); more must be whole nodes.

Example:
    >>> suite = load_suite("benchmarks/suites/smoke.toml")
    >>> suite.points[0].devices
    8
"""

from __future__ import annotations

import hashlib
import json
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from autopar.errors import InvalidOptionError

BASELINES: tuple[str, ...] = ("data_parallel", "zero3", "megatron_3d", "fsdp_tensor")
"""The baselines a suite may name (see :mod:`autopar.sweep.plans`)."""

_POINT_KEYS = frozenset(
    {"name", "model", "preset", "batch", "devices", "config", "compile", "memory_limit_gb"}
)
_TOP_KEYS = frozenset({"name", "cluster", "baselines", "defaults", "points", "fsdp_tensor"})

__all__ = ["BASELINES", "LoadSuiteError", "Point", "Suite", "load_suite"]


class LoadSuiteError(InvalidOptionError):
    """A sweep suite file is missing a key, names something unknown, or has a bad value;
    the message names the file and the key."""


@dataclass(frozen=True)
class Point:
    """One point of a sweep: a model at one size on one cluster size.

    Attributes:
        name: unique within the suite; the key of its results.
        model: the model family (``autopar.registry``), e.g. ``"gpt"``.
        preset: the family's preset the ``config`` overrides start from.
        config: fields overriding the preset (``hidden``, ``layers``, ...).
        batch: the global batch.
        devices: devices of the cluster.
        compile: the plans to also lower, compile and verify on simulated CPU devices
            (``compile = true`` in the file: every plan; a list: those named).
        memory_limit_gb: per-device bound in GB (1e9 bytes); default: the device's memory.
    """

    name: str
    model: str
    preset: str
    batch: int
    devices: int
    config: Mapping[str, Any] = field(default_factory=dict)
    compile: tuple[str, ...] = ()
    memory_limit_gb: float | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "config", MappingProxyType(dict(self.config)))
        object.__setattr__(self, "compile", tuple(self.compile))

    def key(self) -> str:
        """The results key: the name and a digest of everything that changes the result.

        Example:
            >>> Point("a", "gpt", "tiny", 8, 8).key().startswith("a-")
            True
        """
        spec = {
            "model": self.model,
            "preset": self.preset,
            "batch": self.batch,
            "devices": self.devices,
            "config": dict(self.config),
            "compile": list(self.compile),
            "memory_limit_gb": self.memory_limit_gb,
        }
        digest = hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:10]
        return f"{self.name}-{digest}"


@dataclass(frozen=True)
class Suite:
    """A parsed suite file (see the module docstring).

    Attributes:
        name: the suite's name (the default output folder is ``sweep-<name>``).
        path: the file it was read from.
        cluster: the cluster preset.
        baselines: the baselines compared at every point, in order.
        points: the points, in file order.
        fsdp_tensor: the tensor-parallel size of the ``fsdp_tensor`` baseline (capped by
            the devices and the heads).
    """

    name: str
    path: str
    cluster: str
    baselines: tuple[str, ...]
    points: tuple[Point, ...]
    fsdp_tensor: int = 4

    def cluster_for(self, point: Point) -> Any:
        """The point's :class:`cost_models.Cluster` (fewer devices than a node: one node
        of that many)."""
        from cost_models import Cluster

        per_node = Cluster.preset(self.cluster).devices_per_node
        if point.devices < per_node:
            return Cluster.preset(self.cluster, devices_per_node=point.devices)
        return Cluster.preset(self.cluster, nodes=point.devices // per_node)


def _fail(path: Path, key: str, why: str) -> LoadSuiteError:
    return LoadSuiteError(f"suite {str(path)!r}: key {key!r}: {why}")


def _require(table: Mapping[str, Any], key: str, path: Path, where: str, kind: type) -> Any:
    if key not in table:
        raise _fail(path, f"{where}{key}", f"is missing; add {key} = ... to the file.")
    value = table[key]
    if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise _fail(path, f"{where}{key}", f"must be an integer, got {value!r}.")
    if not isinstance(value, kind):
        raise _fail(path, f"{where}{key}", f"must be a {kind.__name__}, got {value!r}.")
    return value


def _compile_list(value: Any, baselines: tuple[str, ...], path: Path, where: str) -> tuple:
    plans = ("autopar", *baselines)
    if value is True:
        return plans
    if value is False:
        return ()
    if not isinstance(value, list) or any(v not in plans for v in value):
        raise _fail(
            path,
            where + "compile",
            f"give true, false or a list of plans from {plans}; got {value!r}.",
        )
    return tuple(value)


def load_suite(path: str | Path) -> Suite:
    """Read and check a suite file.

    Raises:
        LoadSuiteError: the file is missing or not TOML, a key is missing or unknown, a
            model, preset, cluster or baseline is unknown, or a value is out of range; the
            message names the file and the key.

    Example:
        >>> load_suite("benchmarks/suites/alpa_gpt.toml").cluster
        'dgx-a100-80gb'
    """
    from autopar.registry import load_model
    from cost_models import PRESETS, Cluster

    path = Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError as e:
        raise LoadSuiteError(f"suite {str(path)!r} does not exist; give a .toml file.") from e
    except tomllib.TOMLDecodeError as e:
        raise LoadSuiteError(f"suite {str(path)!r} is not valid TOML: {e}") from e
    unknown = sorted(set(data) - _TOP_KEYS)
    if unknown:
        raise _fail(path, unknown[0], f"is not a suite key; allowed: {sorted(_TOP_KEYS)}.")
    name = _require(data, "name", path, "", str)
    cluster = _require(data, "cluster", path, "", str)
    if cluster not in PRESETS:
        raise _fail(path, "cluster", f"{cluster!r} is not a cluster preset; known: {PRESETS}.")
    per_node = Cluster.preset(cluster).devices_per_node
    baselines = tuple(data.get("baselines", BASELINES))
    for b in baselines:
        if b not in BASELINES:
            raise _fail(path, "baselines", f"{b!r} is not a baseline; known: {BASELINES}.")
    fsdp_t = data.get("fsdp_tensor", {}).get("tensor", 4)
    if not isinstance(fsdp_t, int) or fsdp_t < 1:
        raise _fail(path, "fsdp_tensor.tensor", f"must be an integer >= 1, got {fsdp_t!r}.")
    defaults = data.get("defaults", {})
    raw_points = _require(data, "points", path, "", list)
    if not raw_points:
        raise _fail(path, "points", "is empty; add at least one [[points]] table.")
    points: list[Point] = []
    families: dict[str, Any] = {}
    for i, raw in enumerate(raw_points):
        where = f"points[{i}]."
        merged = {**defaults, **raw}
        merged["config"] = {**defaults.get("config", {}), **raw.get("config", {})}
        bad = sorted(set(merged) - _POINT_KEYS)
        if bad:
            raise _fail(
                path, where + bad[0], f"is not a point key; allowed: {sorted(_POINT_KEYS)}."
            )
        pname = _require(merged, "name", path, where, str)
        model = _require(merged, "model", path, where, str)
        preset = _require(merged, "preset", path, where, str)
        batch = _require(merged, "batch", path, where, int)
        devices = _require(merged, "devices", path, where, int)
        if batch < 1:
            raise _fail(path, where + "batch", f"must be >= 1, got {batch}.")
        if devices < 1 or (devices > per_node and devices % per_node):
            raise _fail(
                path, where + "devices",
                f"{devices}: give fewer than a node's {per_node} devices or whole nodes "
                f"(a multiple of {per_node}).",
            )  # fmt: skip
        if model not in families:
            try:
                families[model] = load_model(model)
            except InvalidOptionError as e:
                raise _fail(path, where + "model", str(e)) from e
        try:
            families[model].preset(preset, **merged["config"])
        except (ValueError, TypeError) as e:
            raise _fail(path, where + "config", f"model {model!r} preset {preset!r}: {e}") from e
        limit = merged.get("memory_limit_gb")
        if limit is not None and not (isinstance(limit, int | float) and limit > 0):
            raise _fail(
                path, where + "memory_limit_gb", f"must be a positive number, got {limit!r}."
            )
        point = Point(
            pname, model, preset, batch, devices, merged["config"],
            _compile_list(merged.get("compile", False), baselines, path, where),
            None if limit is None else float(limit),
        )  # fmt: skip
        if any(p.name == pname for p in points):
            raise _fail(path, where + "name", f"{pname!r} is used by an earlier point.")
        points.append(point)
    return Suite(name, str(path), cluster, baselines, tuple(points), fsdp_t)
