"""Check a lowered plan against what XLA compiled: collectives and memory.

Example:
    >>> lowered = autopar.lower.lower_plan(step, plan, (state, batch), graph=graph)
    >>> report = autopar.verify(plan, lowered)  # compiles twice, ~2 s  # doctest: +SKIP
    >>> report.ok                                                      # doctest: +SKIP
    True
"""

import sys
import types

from autopar.verify.hlo import (
    KINDS,
    HloCollective,
    ParseHloError,
    dump_spmd_hlo,
    group_axes,
    parse_collectives,
    parse_replica_groups,
    shape_bytes,
)
from autopar.verify.report import (
    BYTES_TOLERANCE,
    MEMORY_TOLERANCE,
    UNPLANNED_SHARE,
    MemoryRow,
    VerifyReport,
    VerifyRow,
    compiled_peak_bytes,
    memory_row,
    state_bytes_per_device,
    verify,
)

__all__ = [
    "BYTES_TOLERANCE",
    "KINDS",
    "MEMORY_TOLERANCE",
    "UNPLANNED_SHARE",
    "HloCollective",
    "MemoryRow",
    "ParseHloError",
    "VerifyReport",
    "VerifyRow",
    "compiled_peak_bytes",
    "dump_spmd_hlo",
    "group_axes",
    "memory_row",
    "parse_collectives",
    "parse_replica_groups",
    "shape_bytes",
    "state_bytes_per_device",
    "verify",
]


class _CallableModule(types.ModuleType):
    """Makes ``autopar.verify(plan, lowered, *args)`` work whether ``autopar.verify`` names
    this package or the function: importing ``autopar.verify.<submodule>`` rebinds the
    package attribute to this package, so the package forwards calls to :func:`verify`."""

    def __call__(self, plan, lowered, *args, **kwargs):
        return verify(plan, lowered, *args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
