"""Making written files and renames durable: fsync of a file and of a directory, and a file replaced whole."""

from __future__ import annotations

import os
from pathlib import Path


def fsync_file(path: Path) -> None:
    """Flush a written file's data to disk (before it is renamed into place or recorded)."""
    with open(path, "rb") as handle:
        os.fsync(handle.fileno())


def fsync_dir(path: Path) -> None:
    """Flush a directory's entries (files created or renamed in it) to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_durably(path: Path, data: bytes | memoryview) -> None:
    """``path``'s content (a small file: an index, a common state) replaced by ``data``: written beside it as
    ``<name>.partial``, synced, then renamed over it, so ``path`` is the old bytes or the new, never a part."""
    partial = path.with_name(path.name + ".partial")
    partial.write_bytes(data)
    fsync_file(partial)
    os.replace(partial, path)
