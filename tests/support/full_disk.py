"""A disk that fills up, planted in ``os.pwrite`` (how ``OutputFile`` writes every output file)."""

from __future__ import annotations

import errno
import os
import threading

from pgconvert.io.output import BLOCK


class FillingDisk:
    """``os.pwrite`` onto a disk with ``free`` bytes left (whole blocks): a write that does not fit writes what does
    and returns that count, as the kernel does, and every later write fails with ENOSPC. Records the files written
    to, in order, and the first that failed."""

    def __init__(self, free: int) -> None:
        self.free = free - free % BLOCK
        self.files: list[str] = []
        self.failed: str | None = None
        self._real = os.pwrite
        self._lock = threading.Lock()

    def pwrite(self, fd: int, data: bytes | bytearray | memoryview, offset: int) -> int:
        path = os.readlink(f"/proc/self/fd/{fd}")
        with self._lock:
            if path not in self.files:
                self.files.append(path)
            if self.free == 0:
                self.failed = self.failed or path
                raise OSError(errno.ENOSPC, "No space left on device")
            written = self._real(fd, memoryview(data).cast("B")[:self.free], offset)
            self.free -= written
            return written
