"""Writing an output file: bytes staged in aligned buffers, hashed and written on two threads.

Every writer (rank files, safetensors shards, ``.distcp`` files) writes through an ``OutputFile``.
``write`` copies bytes into one of ``BUFFERS`` page-aligned staging buffers of ``BUFFER_BYTES``; a full
buffer goes to a hashing thread (the manifest's digest, ``pgconvert.io.digest``) and to a writing thread, which writes it with
``pwrite`` at its offset, while the caller fills the next buffer. The file is opened with ``O_DIRECT``
where the file system takes it: the buffers go to the device without being copied into the page cache,
which on most hosts is the largest CPU cost of writing and leaves the output evicting the source from
memory. The last partial block is written padded and the file truncated to its size; ``close`` fsyncs.
Where ``O_DIRECT`` is refused (tmpfs, some network file systems: at open or at the first write), the same
path runs with buffered writes.

The hashers and positional writes release the GIL, so on a machine with a spare core hashing and writing cost
little wall time; the manifest's digest never reads a file back.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import mmap
import os
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path
from types import TracebackType

from pgconvert.io.digest import DEFAULT_ALGORITHM, Hasher, labelled, new_hasher
from pgconvert.io.threads import check_running

log = logging.getLogger(__name__)

BUFFER_BYTES = 8 << 20  # bytes per staging buffer (a multiple of BLOCK)
BUFFERS = 4  # staging buffers in flight: one filling, the rest hashing or writing
OUTPUT_STAGING_BYTES = BUFFERS * BUFFER_BYTES  # the memory an open OutputFile holds besides what it is given
BLOCK = 4096  # the alignment O_DIRECT needs of offsets, lengths and memory on common devices
_DIRECT = getattr(os, "O_DIRECT", 0)
# Environment switch to write through the page cache (for measuring, or a file system that misbehaves).
BUFFERED_ENV = "PGCONVERT_BUFFERED_WRITES"
# The digest output files opened here get (``--digest``; None: none): set around a conversion by ``digests``.
_DIGESTS: ContextVar[str | None] = ContextVar("pgconvert_digests", default=DEFAULT_ALGORITHM)
# How many files written at once share one file's staging memory (``sharing_staging``).
_SHARERS: ContextVar[int] = ContextVar("pgconvert_staging_sharers", default=1)
SMALLEST_SHARED_BUFFER = 1 << 20  # a shared staging buffer is never smaller (a multiple of BLOCK)
IN_PLACE_SMALLEST = 1 << 20  # fewer whole blocks than this are staged rather than written in place
# Records a writer leaves to be written from their own memory (``write_in_place``) while it produces the next:
# its memory holds that many records besides the one being produced.
RECORDS_IN_FLIGHT = 1


@contextmanager
def digests(algorithm: str | None) -> Iterator[None]:
    """Within the block, ``OutputFile`` computes each file's digest with ``algorithm`` (None: none, ``digest``
    None). A saver whose format records a digest of its own (megatron-core's ``integrity.json``: sha256) sets
    that algorithm around its writing, so no file is read back to hash it."""
    token = _DIGESTS.set(algorithm)
    try:
        yield
    finally:
        _DIGESTS.reset(token)


@contextmanager
def sharing_staging(files: int) -> Iterator[None]:
    """Within the block, the ``files`` written at once (a TP group's rank files) each get a ``files``-th of a file's
    staging buffers, down to ``SMALLEST_SHARED_BUFFER`` bytes each, so together they hold what one file holds."""
    token = _SHARERS.set(files)
    try:
        yield
    finally:
        _SHARERS.reset(token)


def buffer_bytes(sharers: int | None = None) -> int:
    """The bytes of each staging buffer of a file opened now (or among ``sharers`` files sharing their staging)."""
    share = BUFFER_BYTES // (sharers or _SHARERS.get())
    return max(min(BUFFER_BYTES, SMALLEST_SHARED_BUFFER), share - share % BLOCK)


def staging_bytes(files: int) -> int:
    """The staging memory of ``files`` files written at once that share it (``sharing_staging``)."""
    return files * BUFFERS * buffer_bytes(files)


def settled(futures: list[Future[None]]) -> None:
    """Wait for the hashing and writing of ``write_in_place``; raises what they raised."""
    for future in futures:
        future.result()


def _address(view: memoryview) -> int:
    """The address of a memoryview's first byte."""
    import numpy

    return int(numpy.frombuffer(view, dtype=numpy.uint8).ctypes.data) if len(view) else 0


class _Held:
    """Bytes handed to a thread, let go of by the thread once it has used them (``take``), so that the memory
    they belong to is no longer referred to when the thread's future is done."""

    def __init__(self, view: memoryview) -> None:
        self._view: memoryview | None = view

    def take(self) -> memoryview:
        view, self._view = self._view, None
        assert view is not None, "held bytes are taken once"
        return view


class OutputFile:
    """A new file written front to back; ``offset`` counts the bytes written so far.

    Use as a context manager: leaving the block normally writes what is staged, truncates the file to
    its size and fsyncs it (``digest`` and ``size`` then hold the labelled digest and the size); leaving it with an
    exception closes the file as it is. An OSError, raised here or by the code producing the bytes inside
    the block, names the path.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.digest: str | None = None
        self.size: int | None = None
        self._algorithm = _DIGESTS.get()
        self._digest: Hasher | None = None if self._algorithm is None else new_hasher(self._algorithm)
        self._closed = False
        self._fd = self._open(path)
        self._buffer_bytes = buffer_bytes()
        self._buffers = [mmap.mmap(-1, self._buffer_bytes) for _ in range(BUFFERS)]
        self._views = [memoryview(buffer) for buffer in self._buffers]
        self._pending: list[list[Future[None]]] = [[] for _ in range(BUFFERS)]
        self._in_place: list[Future[None]] = []  # writes from the caller's memory (``write_in_place``) not seen done
        self._current = 0
        self._filled = 0  # bytes staged in the current buffer
        self._handed = 0  # bytes handed to the threads before it (the file position it starts at)
        self._hasher = ThreadPoolExecutor(1, thread_name_prefix="pgconvert-hash")
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="pgconvert-write")

    @staticmethod
    def _open(path: Path) -> int:
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0)
        if _DIRECT and not os.environ.get(BUFFERED_ENV):
            try:
                return os.open(path, flags | _DIRECT, 0o644)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise OSError(exc.errno, exc.strerror, str(path)) from exc
        return os.open(path, flags, 0o644)

    @property
    def direct(self) -> bool:
        """Whether writes bypass the page cache (``O_DIRECT``)."""
        return bool(_DIRECT and fcntl.fcntl(self._fd, fcntl.F_GETFL) & _DIRECT)

    def write(self, data: bytes | bytearray | memoryview) -> int:
        check_running()  # another file of a ``--threads`` pool failed: stop this one too
        source = memoryview(data).cast("B")
        done = 0
        while done < len(source):
            if self._filled == 0:
                self._reuse(self._current)
            count = min(len(source) - done, self._buffer_bytes - self._filled)
            self._views[self._current][self._filled:self._filled + count] = source[done:done + count]
            self._filled += count
            done += count
            if self._filled == self._buffer_bytes:
                self._hand_off()
        return len(source)

    def write_in_place(self, data: bytes | bytearray | memoryview) -> list[Future[None]]:
        """Write ``data`` from its own memory where it can: the futures of its hashing and writing, which the caller
        waits for (``settled``) before it changes or reuses that memory. Under ``O_DIRECT`` the whole blocks of
        ``data`` are written in place when its address agrees with its file offset modulo ``BLOCK`` (memory lent
        with that ``phase``, ``pgconvert.io.reuse``), its head and tail staged as ``write`` stages them; otherwise
        (or for fewer than ``IN_PLACE_SMALLEST`` bytes) it is staged whole and nothing is returned."""
        source = memoryview(data).cast("B")
        head = -self.offset % BLOCK
        body = (len(source) - head) // BLOCK * BLOCK
        if body < IN_PLACE_SMALLEST or (self.direct and (_address(source) + head) % BLOCK):
            self.write(source)
            return []
        self.write(source[:head])
        if self._filled:
            self._hand_off()  # a block boundary: the staged bytes go now, this buffer's next fill starts after data
        placed = source[head:head + body]
        futures = [*self._hashed(_Held(placed)), self._writer.submit(self._write_held, _Held(placed), self._handed)]
        self._handed += body
        self._in_place = [*self._unfinished(), *futures]
        self.write(source[head + body:])
        return futures

    def _unfinished(self) -> list[Future[None]]:
        """The in-place writes not done yet; one done with an error raises it here (it is never dropped unseen)."""
        unfinished = []
        for future in self._in_place:
            if future.done():
                future.result()
            else:
                unfinished.append(future)
        return unfinished

    @property
    def offset(self) -> int:
        """Bytes written so far."""
        return self._handed + self._filled

    def tell(self) -> int:
        return self.offset

    def flush(self) -> None:
        """Nothing to do before ``close``: staged bytes are written there (kept for file-like callers)."""

    def hexdigest(self) -> str | None:
        """The labelled digest (``<algorithm>:<hex>``) of every byte written (None when digests are off); only after
        ``close``."""
        if not self._closed:
            raise RuntimeError(f"{self.path}: the digest is known once the file is closed")
        return self.digest

    def _reuse(self, index: int) -> None:
        """Wait until buffer ``index`` is hashed and written (raising what its writing raised)."""
        pending, self._pending[index] = self._pending[index], []
        settled(pending)

    def _hand_off(self) -> None:
        """Send the current buffer's filled bytes to be hashed and written; move to the next buffer."""
        view = self._views[self._current][:self._filled]
        self._pending[self._current] = [*self._hashed(view), self._writer.submit(self._write_at, view, self._handed)]
        self._handed += self._filled
        self._current = (self._current + 1) % BUFFERS
        self._filled = 0

    def _hashed(self, view: memoryview | _Held) -> list[Future[None]]:
        if self._digest is None:
            return []
        return [self._hasher.submit(self._hash_held if isinstance(view, _Held) else self._digest.update, view)]

    def _hash_held(self, held: _Held) -> None:
        """Hash the bytes ``held`` refers to, letting go of them once hashed (as ``_write_held``)."""
        assert self._digest is not None
        self._digest.update(held.take())

    def _write_held(self, held: _Held, position: int) -> None:
        """Write the bytes ``held`` refers to, letting go of them once written (so their memory is free when the future
        says the write is done)."""
        self._write_at(held.take(), position)

    def _write_at(self, view: memoryview, position: int) -> None:
        """Write ``view`` at ``position``; a refused O_DIRECT write is retried through the page cache."""
        done = 0
        while done < len(view):
            try:
                written = os.pwrite(self._fd, view[done:], position + done)
            except OSError as exc:
                if exc.errno == errno.EINVAL and self.direct:
                    self._drop_direct()
                    continue
                raise OSError(exc.errno, exc.strerror, str(self.path)) from exc
            if written == 0:
                raise OSError(errno.EIO, "the file system wrote nothing", str(self.path))
            if written % BLOCK and self.direct:
                self._drop_direct()  # a short, unaligned write: finish through the page cache
            done += written

    def _drop_direct(self) -> None:
        log.debug("%s: O_DIRECT refused; writing through the page cache", self.path)
        fcntl.fcntl(self._fd, fcntl.F_SETFL, fcntl.fcntl(self._fd, fcntl.F_GETFL) & ~_DIRECT)

    def __enter__(self) -> OutputFile:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        try:
            if kind is None:
                self._finish()
            elif isinstance(error, OSError) and error.filename is None:
                # A write error raised while producing this file's bytes names the file too.
                raise OSError(error.errno, error.strerror, str(self.path)) from error
        finally:
            self._hasher.shutdown(wait=True)
            self._writer.shutdown(wait=True)
            os.close(self._fd)
            self._pending = [[] for _ in range(BUFFERS)]
            self._in_place = []
            self._views = []
            self._buffers = []  # unmapped once the last slice handed to the threads is gone

    def _finish(self) -> None:
        """Write the staged tail (padded to a block under O_DIRECT), truncate to size, fsync."""
        size, tail = self.offset, self._filled
        if tail:
            padded = -(-tail // BLOCK) * BLOCK if self.direct else tail
            view = self._views[self._current]
            view[tail:padded] = bytes(padded - tail)
            self._pending[self._current] = [*self._hashed(view[:tail]),
                                            self._writer.submit(self._write_at, view[:padded], self._handed)]
            self._handed, self._filled = size, 0
        for index in range(BUFFERS):
            self._reuse(index)
        settled(self._in_place)
        check_running()  # no fsync for a file that will be thrown away
        try:
            os.ftruncate(self._fd, size)
            os.fsync(self._fd)
        except OSError as exc:
            raise OSError(exc.errno, exc.strerror, str(self.path)) from exc
        if self._digest is not None and self._algorithm is not None:
            self.digest = labelled(self._algorithm, self._digest.hexdigest())
        self.size, self._closed = size, True
