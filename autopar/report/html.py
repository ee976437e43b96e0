"""The HTML report, written to disk: one self-contained file (:func:`write_html`), or a
report directory (:func:`write_report`: the plan JSON, a text summary, PNG plots and
``index.html``, the same self-contained page).

Every file is written atomically, so an interrupted run never leaves a half-written one.

Example:
    >>> out = str(tmp_dir / "autopar-report")
    >>> write_report(plan, out, sections={"notes": "a 2-layer MLP"}) == f"{out}/index.html"
    True
    >>> sorted(os.listdir(out))
    ['index.html', 'memory.png', 'plan.json', 'summary.txt', 'time.png']
    >>> write_html(plan, str(tmp_dir / "plan.html")).endswith("plan.html")
    True
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from autopar.atomic import atomic_write
from autopar.plan import Plan
from autopar.report.page import build_page
from autopar.report.plots import save_plots
from autopar.report.text import summary

if TYPE_CHECKING:
    from autopar.verify.report import VerifyReport


def write_html(
    plan: Plan,
    path: str | os.PathLike,
    *,
    verify: VerifyReport | None = None,
    sections: Mapping[str, str] | None = None,
    compare: Sequence[Plan] | None = None,
) -> str:
    """Write the report of ``plan`` as one self-contained HTML file (inline CSS and SVG,
    nothing fetched) at ``path``; returns the path.

    Args:
        plan: the plan to report.
        path: the file to write (its directory is created if missing).
        verify: the :func:`autopar.verify.verify` result of the compiled plan, if any
            (the ``verify`` section says "not run" without one).
        sections: extra titled text blocks (a loss check, notes).
        compare: other plans (baselines) whose step time is drawn beside this one's.

    Example:
        >>> write_html(plan, str(tmp_dir / "plan.html"), sections={"notes": "MLP"})[-9:]
        'plan.html'
    """
    path = os.fspath(path)
    page = build_page(plan, verify=verify, sections=sections, compare=compare or ())
    atomic_write(path, page)
    return path


def write_report(
    plan: Plan,
    out_dir: str,
    sections: Mapping[str, str] | None = None,
    compare: list[Plan] | None = None,
    *,
    verify: VerifyReport | None = None,
) -> str:
    """Write ``plan.json``, ``summary.txt``, ``time.png``, ``memory.png`` and ``index.html``.

    ``index.html`` is the self-contained report (:func:`write_html`); the PNGs are the
    matplotlib plots for other documents.

    Args:
        plan: the plan to report.
        out_dir: directory to write (created if missing).
        sections: extra titled text blocks (e.g. the ``verify`` table, a loss check).
        compare: other plans (baselines) drawn beside this one in the plots and the
            report's step-time chart.
        verify: the plan's :func:`autopar.verify.verify` result, for the report's
            predicted-vs-compiled section.

    Returns:
        The path of ``index.html``.
    """
    os.makedirs(out_dir, exist_ok=True)
    plan.save(os.path.join(out_dir, "plan.json"))
    atomic_write(os.path.join(out_dir, "summary.txt"), summary(plan))
    save_plots([plan, *(compare or [])], out_dir)
    return write_html(
        plan,
        os.path.join(out_dir, "index.html"),
        verify=verify,
        sections=sections,
        compare=compare,
    )
