"""Named model configurations: one lookup shared by every config class's ``preset()``."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, TypeVar

C = TypeVar("C")


def lookup_preset(family: str, presets: Mapping[str, C], name: str, overrides: dict[str, Any]) -> C:
    """``presets[name]`` with ``overrides`` applied; a clear ``ValueError`` for unknown names.

    Example:
        >>> from benchmarks.models.mlp import MLP_PRESETS
        >>> lookup_preset("MLP", MLP_PRESETS, "tiny", {"hidden": 32}).hidden
        32
    """
    if name not in presets:
        raise ValueError(f"unknown {family} preset {name!r}; known: {sorted(presets)}")
    return dataclasses.replace(presets[name], **overrides)
