"""Inspecting plans: text summaries, plots, an HTML report, and plan diffs."""

from autopar.report.diff import diff
from autopar.report.html import write_html, write_report
from autopar.report.plots import save_plots
from autopar.report.text import format_bytes, format_seconds, format_spec, summary

__all__ = [
    "diff",
    "format_bytes",
    "format_seconds",
    "format_spec",
    "save_plots",
    "summary",
    "write_html",
    "write_report",
]
