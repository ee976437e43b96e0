"""A progress bar for searches that take a while (``rich``), silent for quick ones.

A search that finishes within :data:`SHOW_AFTER_S` prints nothing; one that runs longer
shows a transient ``rich`` progress bar on stderr (one: a search run inside another's,
as the outer loop runs the intra-op search, advances silently) (steps done out of the total, the
current step's description, the elapsed time) from then on, and leaves the terminal
clean when it ends. ``AUTOPAR_PROGRESS=0`` turns it off; ``AUTOPAR_PROGRESS=1`` shows it
from the start.

Example:
    >>> with SearchProgress(3, "meshes") as bar:
    ...     for mesh in ({"data": 8}, {"data": 4, "tensor": 2}, {"tensor": 8}):
    ...         bar.advance(f"solved {mesh}")
    >>> bar.done, bar.shown
    (3, False)
"""

from __future__ import annotations

import os
import sys
import time
from types import TracebackType
from typing import Any

SHOW_AFTER_S = 2.0
"""Seconds a search runs before its progress bar appears (issue 13: "over two seconds")."""

__all__ = ["SHOW_AFTER_S", "SearchProgress"]


class SearchProgress:
    """Steps of a search, shown as a ``rich`` progress bar once it has run
    :data:`SHOW_AFTER_S` seconds (see the module docstring).

    Args:
        total: how many steps the search has (may grow with :meth:`add`).
        what: what a step is, e.g. ``"meshes"``.
        show_after_s: seconds before the bar appears.
    """

    def __init__(self, total: int, what: str, *, show_after_s: float = SHOW_AFTER_S) -> None:
        self.total = max(0, int(total))
        self.what = what
        self.done = 0
        self.description = f"searching {what}"
        setting = os.environ.get("AUTOPAR_PROGRESS", "")
        self._enabled = setting != "0"
        self._show_after = 0.0 if setting == "1" else show_after_s
        self._start = time.perf_counter()
        self._progress: Any = None
        self._task: Any = None

    @property
    def shown(self) -> bool:
        """Whether the bar has appeared."""
        return self._progress is not None

    _open = 0  # bars entered and not yet exited: a search inside a search shows none

    def __enter__(self) -> SearchProgress:
        self._start = time.perf_counter()
        self._nested = SearchProgress._open > 0
        SearchProgress._open += 1
        self._maybe_show()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        SearchProgress._open -= 1
        if self._progress is not None:
            self._progress.stop()

    def add(self, steps: int) -> None:
        """The search found ``steps`` more steps to do."""
        self.total += steps
        self._refresh()

    def advance(self, description: str = "") -> None:
        """One step done; ``description`` says what (shown beside the bar)."""
        self.done += 1
        if description:
            self.description = description
        self._refresh()

    def _refresh(self) -> None:
        self._maybe_show()
        if self._progress is not None:
            self._progress.update(
                self._task, completed=self.done, total=self.total, description=self.description
            )

    def _maybe_show(self) -> None:
        if self._progress is not None or not self._enabled or getattr(self, "_nested", False):
            return
        if time.perf_counter() - self._start < self._show_after:
            return
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
        )

        self._progress = Progress(
            TextColumn(f"[bold]autopar[/] {self.what}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("{task.description}"),
            console=Console(file=sys.stderr),
            transient=True,
        )
        self._task = self._progress.add_task(
            self.description, total=self.total, completed=self.done
        )
        self._progress.start()
