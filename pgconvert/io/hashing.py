"""Hashing a file while it is written, so the manifest need not read it again.

Each buffer is hashed on a second thread while the main thread writes it (hashlib and file writes
both release the GIL for large buffers), so on a machine with a spare core the sha256 costs no
wall time, and the file is never read back.
"""

from __future__ import annotations

import hashlib
from concurrent.futures import ThreadPoolExecutor
from typing import BinaryIO


class HashingWriter:
    """A binary file that hashes what goes through it and counts the bytes written (``offset``)."""

    def __init__(self, handle: BinaryIO, hasher: ThreadPoolExecutor) -> None:
        self.handle = handle
        self.digest = hashlib.sha256()
        self.hasher = hasher
        self.offset = 0

    def write(self, data: bytes | bytearray | memoryview) -> int:
        hashed = self.hasher.submit(self.digest.update, data)
        try:
            written = self.handle.write(data)
        finally:
            hashed.result()
        self.offset += written
        return written

    def tell(self) -> int:
        return self.offset

    def flush(self) -> None:
        self.handle.flush()

    def hexdigest(self) -> str:
        return self.digest.hexdigest()
