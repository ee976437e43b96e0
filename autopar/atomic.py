"""Atomic file writes: a reader (or a crash) never sees half a plan, report or result file.

The data goes to a temporary file in the target's directory, which then replaces the target
in one ``os.replace``. The file gets the permissions a plain ``open(path, "w")`` would give
(0666 less the umask), not ``mkstemp``'s private 0600: plans and reports are for sharing.

Example:
    >>> path = str(tmp_dir / "atomic" / "note.txt")
    >>> atomic_write(path, "hello")
    >>> open(path).read()
    'hello'
    >>> with atomic_path(str(tmp_dir / "atomic" / "raw.bin")) as tmp:
    ...     _ = open(tmp, "wb").write(b"\\x00\\x01")
    >>> os.path.getsize(tmp_dir / "atomic" / "raw.bin")
    2
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator

__all__ = ["atomic_path", "atomic_write"]


def _default_mode() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[str]:
    """A temporary path beside ``path``; on a clean exit it replaces ``path`` atomically.

    For writers that want a file name (``matplotlib``'s ``savefig``, ``numpy.save``). On an
    exception the temporary file is removed and ``path`` is left as it was.
    """
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{os.path.basename(path)}.", suffix=".tmp")
    os.close(fd)
    try:
        yield tmp
        os.chmod(tmp, _default_mode())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def atomic_write(path: str | os.PathLike, data: str | bytes) -> None:
    """Write ``data`` (text as UTF-8, or bytes) to ``path`` atomically."""
    with atomic_path(path) as tmp:
        raw = data if isinstance(data, bytes) else data.encode("utf-8")
        with open(tmp, "wb") as f:
            f.write(raw)
            f.flush()
            os.fsync(f.fileno())  # on disk before it replaces the old file
