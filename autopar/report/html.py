"""A self-contained report directory: plan JSON, text summary, plots, and ``index.html``.

Every file is written atomically, so an interrupted run never leaves a half-written plan.

Example:
    >>> out = str(tmp_dir / "autopar-report")
    >>> write_report(plan, out, sections={"notes": "a 2-layer MLP"}) == f"{out}/index.html"
    True
    >>> sorted(os.listdir(out))
    ['index.html', 'memory.png', 'plan.json', 'summary.txt', 'time.png']
"""

from __future__ import annotations

import html
import os
import tempfile
from collections.abc import Mapping

from autopar.plan import Plan
from autopar.report.plots import save_plots
from autopar.report.text import summary


def _atomic_write(path: str, text: str) -> None:
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def write_report(
    plan: Plan,
    out_dir: str,
    sections: Mapping[str, str] | None = None,
    compare: list[Plan] | None = None,
) -> str:
    """Write ``plan.json``, ``summary.txt``, ``time.png``, ``memory.png`` and ``index.html``.

    Args:
        plan: the plan to report.
        out_dir: directory to write (created if missing).
        sections: extra titled text blocks (e.g. the ``verify`` table, a loss check).
        compare: other plans (baselines) drawn beside this one in the plots.

    Returns:
        The path of ``index.html``.
    """
    os.makedirs(out_dir, exist_ok=True)
    plan.save(os.path.join(out_dir, "plan.json"))
    text = summary(plan)
    _atomic_write(os.path.join(out_dir, "summary.txt"), text)
    save_plots([plan, *(compare or [])], out_dir)
    blocks = [("Plan", text), *((sections or {}).items())]
    body = "\n".join(
        f"<h2>{html.escape(title)}</h2>\n<pre>{html.escape(content)}</pre>"
        for title, content in blocks
    )
    page = f"""<!doctype html>
<html><head><meta charset="utf-8"><title>autopar report: {html.escape(plan.name)}</title>
<style>body{{font-family:sans-serif;margin:2em;max-width:80em}}
pre{{background:#f6f6f6;padding:1em;overflow-x:auto;font-size:12px}}</style></head>
<body><h1>autopar report</h1>
<p>Plan <code>plan.json</code> (load with <code>autopar.Plan.load</code>, replay with
<code>@autopar.autoparallel(plan="plan.json")</code>).</p>
<img src="time.png" alt="predicted step time breakdown">
<img src="memory.png" alt="predicted memory per device">
{body}
</body></html>
"""
    index = os.path.join(out_dir, "index.html")
    _atomic_write(index, page)
    return index
