"""Plan mesh -> ``jax.sharding.Mesh`` with compiler-propagated (``Auto``) axes.

Example:
    >>> mesh = make_mesh({"data": 2, "tensor": 4})
    >>> dict(mesh.shape)
    {'data': 2, 'tensor': 4}
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from autopar.errors import LowerPlanError


def make_mesh(plan_mesh: Mapping[str, int], devices: Sequence[Any] | None = None) -> Mesh:
    """A device mesh with the plan's axes, in order, all of type ``AxisType.Auto``.

    Devices fill the mesh in row-major order, so the innermost (last) axis takes
    consecutive devices: on a GPU node those share NVLink, which is why plans put
    ``tensor`` innermost. ``Auto`` axes (not ``jax.make_mesh``'s default ``Explicit``) let
    XLA propagate shardings between the planned points.

    Args:
        plan_mesh: ordered mapping axis name -> size (outer -> inner), e.g. ``plan.mesh``.
        devices: the devices to use (default ``jax.devices()``); their number must equal
            the product of the sizes.

    Raises:
        LowerPlanError: the device count differs from the mesh size, or a size is < 1.

    Example:
        >>> make_mesh({"data": 2, "tensor": 4}).axis_names
        ('data', 'tensor')
    """
    names = tuple(plan_mesh)
    sizes = tuple(int(plan_mesh[n]) for n in names)
    if not names:
        raise LowerPlanError("the plan's mesh has no axes; a plan needs at least one axis.")
    if any(s < 1 for s in sizes):
        raise LowerPlanError(f"mesh {dict(plan_mesh)} has a size < 1; sizes must be >= 1.")
    devs = list(jax.devices() if devices is None else devices)
    need = math.prod(sizes)
    if len(devs) != need:
        raise LowerPlanError(
            f"the plan's mesh {dict(plan_mesh)} needs {need} devices but {len(devs)} are "
            f"available; re-plan for {len(devs)} devices (SearchOptions(mesh=...)) or pass "
            f"{need} devices."
        )
    grid = np.empty(len(devs), dtype=object)
    grid[:] = devs
    return Mesh(grid.reshape(sizes), names, axis_types=(AxisType.Auto,) * len(names))
