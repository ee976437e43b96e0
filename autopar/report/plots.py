"""Matplotlib figures of a plan's predicted cost (headless: the Agg backend).

Example:
    >>> paths = save_plots(plan, str(tmp_dir))
    >>> [os.path.basename(p) for p in paths]
    ['time.png', 'memory.png']
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from autopar.atomic import atomic_path
from autopar.plan import Plan


def _pyplot():
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def time_breakdown_figure(plans: Sequence[Plan]):
    """Stacked bars: compute, exposed communication, bubble per plan."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(max(4.0, 1.2 * len(plans) + 2), 3.5))
    names = [p.name for p in plans]
    compute = [p.predicted.compute_s * 1e3 for p in plans]
    comm = [p.predicted.exposed_communication_s * 1e3 for p in plans]
    bubble = [p.predicted.bubble_s * 1e3 for p in plans]
    ax.bar(names, compute, label="compute")
    ax.bar(names, comm, bottom=compute, label="exposed comm")
    ax.bar(
        names, bubble, bottom=[c + m for c, m in zip(compute, comm, strict=True)], label="bubble"
    )
    ax.set_ylabel("predicted ms / step")
    ax.legend(fontsize=8)
    ax.tick_params(axis="x", labelrotation=20, labelsize=8)
    fig.tight_layout()
    return fig


def memory_breakdown_figure(plans: Sequence[Plan]):
    """Stacked bars of predicted per-device memory by category."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(max(4.0, 1.2 * len(plans) + 2), 3.5))
    names = [p.name for p in plans]
    cats: list[str] = []
    for p in plans:
        for k in p.predicted.memory_breakdown:
            if k not in cats:
                cats.append(k)
    bottom = [0.0] * len(plans)
    for k in cats:
        vals = [p.predicted.memory_breakdown.get(k, 0.0) / 2**30 for p in plans]
        ax.bar(names, vals, bottom=bottom, label=k)
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    ax.set_ylabel("predicted GiB / device")
    if cats:
        ax.legend(fontsize=8)
    ax.tick_params(axis="x", labelrotation=20, labelsize=8)
    fig.tight_layout()
    return fig


def save_plots(plan: Plan | Sequence[Plan], out_dir: str) -> list[str]:
    """Write ``time.png`` and ``memory.png`` for one plan or a comparison of several."""
    plt = _pyplot()
    plans = [plan] if isinstance(plan, Plan) else list(plan)
    os.makedirs(out_dir, exist_ok=True)
    paths = []
    for name, make in (
        ("time.png", time_breakdown_figure),
        ("memory.png", memory_breakdown_figure),
    ):
        fig = make(plans)
        path = os.path.join(out_dir, name)
        try:
            with atomic_path(path) as tmp:  # a reader never sees half a PNG
                fig.savefig(tmp, dpi=110, format="png")
        finally:
            plt.close(fig)
        paths.append(path)
    return paths
