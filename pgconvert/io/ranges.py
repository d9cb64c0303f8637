"""Reading tensors' bytes from files with positional system calls, straight into their destination.

A tensor stored in a checkpoint file is a strided region of that file (``FileRegion``: where its first
element is, its shape, strides and dtype). ``read_region`` fills a destination tensor, itself possibly a
strided view of a larger buffer (one source rank's columns of a merged row-parallel weight), with
``os.preadv``: the runs of bytes that are contiguous in both the file and the destination go, for each
contiguous stretch of the file, into one call of up to ``IOV_MAX`` buffers, with no copy in user space.
Nothing is memory-mapped, so no page is faulted in and the process's resident memory holds only the
result (and the scratch buffer below).

Short runs go through a scratch buffer instead, where a buffer (and often a call) per run would cost
more in Python and system calls than the copy it saves: a region whose runs are shorter than
``LONG_RUN`` (one source rank's rows of a row-parallel merge, a few KiB each; one rank's columns of a
record stored whole) and whose file span is at most ``SPAN_RATIO`` times its bytes is read a piece of at
most ``SCRATCH_BYTES`` at a time, each piece's span with one call, and its elements copied into their
place (about a fifth of the CPU time of one buffer, or one call, per run). Runs shorter
than ``SHORT_RUN`` bytes (a tensor cut along a tiny last dimension) go this way whatever their density,
and a transposed record is read as one span and gathered. Longer runs are scattered by the kernel.
"""

from __future__ import annotations

import itertools
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from pgconvert.errors import CheckpointError
from pgconvert.io import sizes
from pgconvert.io.reuse import new_tensor

IOV_MAX = 1024  # Linux's UIO_MAXIOV: the most buffers one preadv takes
SHORT_RUN = 512  # bytes: shorter contiguous runs are read as one span and gathered in memory
LONG_RUN = 16 << 10  # bytes: shorter runs are read through the scratch buffer (if their span is dense enough)
SCRATCH_BYTES = 4 << 20  # the scratch buffer a region is read through, piece by piece
SPAN_RATIO = 8  # runs of LONG_RUN or less go through the scratch if their span is at most this many times them
OPEN_FILES = 64  # file descriptors a ``FileHandles`` keeps open at once, per thread


@dataclass(frozen=True)
class FileRegion:
    """A tensor's elements in a file: element 0 at byte ``offset``, ``stride`` in elements."""

    path: Path
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype

    @classmethod
    def contiguous(cls, path: Path, offset: int, shape: tuple[int, ...], dtype: torch.dtype) -> FileRegion:
        """A row-major tensor stored whole from ``offset`` (a safetensors entry, a torch storage)."""
        return cls(path, offset, shape, sizes.contiguous_stride(shape), dtype)

    def narrow(self, dim: int, start: int, length: int) -> FileRegion:
        """Indices ``[start, start + length)`` of ``dim``, as ``torch.Tensor.narrow``."""
        if not 0 <= start <= start + length <= self.shape[dim]:
            raise ValueError(f"indices [{start}, {start + length}) of dim {dim} outside {list(self.shape)}")
        shape = list(self.shape)
        shape[dim] = length
        offset = self.offset + start * self.stride[dim] * sizes.itemsize(self.dtype)
        return FileRegion(self.path, offset, tuple(shape), self.stride, self.dtype)

    def span(self) -> int:
        """Elements from the region's first element to its last, inclusive (the file span that holds it)."""
        return 1 + sum((count - 1) * step for count, step in zip(self.shape, self.stride, strict=True))

    def reshape(self, shape: Sequence[int]) -> FileRegion:
        """The same elements in row-major order seen as ``shape`` (a contiguous region only)."""
        dense = all(step == want for count, step, want in zip(self.shape, self.stride, sizes.contiguous_stride(self.shape))
                    if count > 1)
        if not dense or sizes.numel(tuple(shape)) != sizes.numel(self.shape):
            raise ValueError(f"cannot view {list(self.shape)} with strides {list(self.stride)} as {list(shape)}")
        return FileRegion.contiguous(self.path, self.offset, tuple(shape), self.dtype)

    def read_into(self, out: torch.Tensor) -> None:
        """Fill ``out`` (any strides) with the region's elements, seen in ``out``'s shape where it differs."""
        region = self if tuple(out.shape) == self.shape else self.reshape(out.shape)
        fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        try:
            read_region(fd, region, out)
        finally:
            os.close(fd)

    def read(self) -> torch.Tensor:
        """The region's elements as a new contiguous tensor."""
        out = new_tensor(self.shape, self.dtype)
        self.read_into(out)
        return out

    def read_parts_into(self, parts: Sequence[tuple[int, int, torch.Tensor]]) -> None:
        """Fill each ``(start, length, out)`` with the region's indices ``[start, start + length)`` of its last
        dimension (a row-major region: every TP piece of a row-parallel weight stored whole) in one pass over its
        bytes: ``SCRATCH_BYTES`` of rows at a time read into one scratch buffer, each part's columns of them
        copied into its ``out`` while they are in cache, so the file span is read once for all the parts."""
        if self.stride != sizes.contiguous_stride(self.shape) or len(self.shape) < 2:
            raise ValueError(f"parts of columns of a row-major region only, not {list(self.shape)} with strides "
                             f"{list(self.stride)}")
        rows = sizes.numel(self.shape[:-1])
        region = self.reshape((rows, self.shape[-1]))
        row_bytes = self.shape[-1] * sizes.itemsize(self.dtype)
        step = max(1, SCRATCH_BYTES // max(1, row_bytes))
        scratch = torch.empty(min(step, rows) * row_bytes, dtype=torch.uint8)
        flat = [(start, length, out.view(rows, length)) for start, length, out in parts]
        fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        try:
            for first in range(0, rows, step):
                count = min(step, rows - first)
                _preadv_all(fd, [_byte_view(scratch)[:count * row_bytes]], region.offset + first * row_bytes,
                            self.path)
                held = scratch[:count * row_bytes].view(self.dtype).view(count, self.shape[-1])
                for start, length, out in flat:
                    out.narrow(0, first, count).copy_(held.narrow(1, start, length))
        finally:
            os.close(fd)


class FileHandles:
    """Read-only descriptors by path, opened on first use; at most ``limit`` stay open per thread.

    Each thread has its own descriptors (``--threads`` produces files on several): a descriptor one
    thread is reading from is never closed, and its number never reused, by another thread's eviction.
    """

    def __init__(self, limit: int = OPEN_FILES) -> None:
        self.limit = limit
        self._local = threading.local()
        self._lock = threading.Lock()
        self._every: list[OrderedDict[Path, int]] = []  # each thread's descriptors, for ``close``

    def _mine(self) -> OrderedDict[Path, int]:
        mine: OrderedDict[Path, int] | None = getattr(self._local, "open", None)
        if mine is None:
            mine = self._local.open = OrderedDict()
            with self._lock:
                self._every.append(mine)
        return mine

    def fd(self, path: Path) -> int:
        mine = self._mine()
        fd = mine.pop(path, None)
        if fd is None:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
            while len(mine) >= self.limit:
                os.close(mine.popitem(last=False)[1])
        mine[path] = fd
        return fd

    def close(self) -> None:
        """Close every thread's descriptors (once no thread reads through them any more)."""
        with self._lock:
            every, self._every = self._every, []
            self._local = threading.local()
        for handles in every:
            while handles:
                os.close(handles.popitem()[1])


def _byte_view(tensor: torch.Tensor) -> memoryview:
    """A writable view of the bytes of ``tensor``'s whole storage."""
    flat = torch.empty(0, dtype=torch.uint8).set_(tensor.untyped_storage())
    return memoryview(flat.numpy()).cast("B")


def _runs(shape: Sequence[int], source: Sequence[int], target: Sequence[int]) -> tuple[int, list[tuple[int, int, int]]]:
    """(elements per run, the outer dimensions as (count, source step, target step)): the runs of ``shape``
    that are contiguous in both strided layouts, one per index of the outer dimensions."""
    dims = [(n, s, t) for n, s, t in zip(shape, source, target, strict=True) if n != 1]
    run = 1
    while dims and dims[-1][1] == run and dims[-1][2] == run:
        run *= dims.pop()[0]
    return run, dims


def _offsets(dims: list[tuple[int, int, int]]) -> Iterator[tuple[int, int]]:
    """(source element offset, target element offset) of each run, in order, produced as they are read."""
    for index in itertools.product(*(range(count) for count, _, _ in dims)):
        yield (sum(i * step for i, (_, step, _) in zip(index, dims)),
               sum(i * step for i, (_, _, step) in zip(index, dims)))


def read_region(fd: int, region: FileRegion, out: torch.Tensor) -> None:
    """Fill ``out`` (same shape and dtype as ``region``; any strides) with the region's bytes."""
    if tuple(out.shape) != region.shape or out.dtype != region.dtype:
        raise ValueError(f"cannot read {region.dtype} {list(region.shape)} into {out.dtype} {list(out.shape)}")
    if out.numel() == 0:
        return
    itemsize = out.element_size()
    run, dims = _runs(region.shape, region.stride, out.stride())
    run_bytes = run * itemsize
    # Decided before any run is listed: a transposed record has millions.
    if dims and run_bytes < LONG_RUN and _nested(region) and (
            run_bytes < SHORT_RUN or region.span() <= SPAN_RATIO * out.numel()):
        scratch = torch.empty(min(SCRATCH_BYTES, region.span() * itemsize), dtype=torch.uint8)
        _read_through(fd, region, out, scratch)
        return
    if dims and run_bytes < SHORT_RUN:
        _read_gathered(fd, region, out)
        return
    target = _byte_view(out)
    base = out.storage_offset() * itemsize
    batch: list[memoryview] = []
    start = end = 0
    for source_offset, target_offset in _offsets(dims):
        position = region.offset + source_offset * itemsize
        if batch and (position != end or len(batch) == IOV_MAX):
            _preadv_all(fd, batch, start, region.path)
            batch = []
        if not batch:
            start = end = position
        batch.append(target[base + target_offset * itemsize:base + target_offset * itemsize + run_bytes])
        end += run_bytes
    _preadv_all(fd, batch, start, region.path)


def _nested(region: FileRegion) -> bool:
    """Whether each index of a dimension holds a span of the file after the previous index's, as in a
    row-major tensor or a window of one (not a transposed record): so its slices are read in order."""
    inner = 1
    for count, step in reversed([(n, s) for n, s in zip(region.shape, region.stride, strict=True) if n > 1]):
        if step < inner:
            return False
        inner = step * (count - 1) + inner
    return True


def _read_through(fd: int, region: FileRegion, out: torch.Tensor, scratch: torch.Tensor) -> None:
    """Fill ``out`` from a nested region a piece at a time: each piece's file span read into ``scratch``
    with one call, then its elements copied from there into their (possibly strided) place in ``out``."""
    itemsize = out.element_size()
    dim = next((axis for axis, count in enumerate(region.shape) if count > 1), len(region.shape) - 1)
    one = region.narrow(dim, 0, 1).span()  # elements spanned by one index of ``dim``
    if one * itemsize > scratch.numel():
        for index in range(region.shape[dim]):
            _read_through(fd, region.narrow(dim, index, 1), out.narrow(dim, index, 1), scratch)
        return
    step = 1 + (scratch.numel() // itemsize - one) // max(1, region.stride[dim])
    for first in range(0, region.shape[dim], step):
        piece = region.narrow(dim, first, min(step, region.shape[dim] - first))
        nbytes = piece.span() * itemsize
        _preadv_all(fd, [_byte_view(scratch)[:nbytes]], piece.offset, region.path)
        held = torch.as_strided(scratch[:nbytes].view(out.dtype), piece.shape, piece.stride)
        out.narrow(dim, first, piece.shape[dim]).copy_(held)


def _read_gathered(fd: int, region: FileRegion, out: torch.Tensor) -> None:
    """Read the file span that holds the region, then gather its elements into ``out``."""
    itemsize = out.element_size()
    span = 1 + sum((n - 1) * s for n, s in zip(region.shape, region.stride))
    scratch = torch.empty(span * itemsize, dtype=torch.uint8)
    _preadv_all(fd, [_byte_view(scratch)], region.offset, region.path)
    out.copy_(torch.as_strided(scratch.view(region.dtype), region.shape, region.stride))


def _preadv_all(fd: int, buffers: list[memoryview], position: int, path: Path) -> None:
    """``os.preadv`` until every buffer is full; the end of the file before that is a truncated file."""
    wanted = sum(len(buffer) for buffer in buffers)
    done = os.preadv(fd, buffers, position)
    while done < wanted:
        remaining = _after(buffers, done)
        got = os.preadv(fd, remaining, position + done)
        if got == 0:  # the end of the file, which may lie before the region's start
            ends = min(position + done, os.fstat(fd).st_size)
            raise CheckpointError(f"{path}: the file ends at byte {ends}, but a tensor's bytes run to "
                                  f"byte {position + wanted}; the file is truncated")
        done += got


def _after(buffers: list[memoryview], skip: int) -> list[memoryview]:
    """The parts of ``buffers`` after their first ``skip`` bytes."""
    rest = []
    for buffer in buffers:
        if skip >= len(buffer):
            skip -= len(buffer)
            continue
        rest.append(buffer[skip:])
        skip = 0
    return rest


Locate = Callable[[torch.Tensor], "tuple[int, FileRegion] | None"]


def joined_shape(views: Sequence[torch.Tensor], dim: int) -> list[int]:
    """The shape of ``views`` joined along ``dim``; a ValueError when they do not fit together."""
    first = views[0]
    for view in views[1:]:
        if view.dtype != first.dtype or view.dim() != first.dim() or any(
                view.shape[axis] != first.shape[axis] for axis in range(first.dim()) if axis != dim):
            raise ValueError(f"cannot concatenate {first.dtype} {list(first.shape)} and {view.dtype} "
                             f"{list(view.shape)} along dim {dim}")
    shape = list(first.shape)
    shape[dim] = sum(view.shape[dim] for view in views)
    return shape


def concat_reading(views: list[torch.Tensor], dim: int, locate: Locate) -> torch.Tensor:
    """``torch.cat(views, dim)``, each view that ``locate`` finds in a file read from there with
    ``read_region`` straight into its place in the result (the others copied from memory)."""
    out = new_tensor(joined_shape(views, dim), views[0].dtype)
    offset = 0
    for view in views:
        target = out.narrow(dim, offset, view.shape[dim])
        offset += view.shape[dim]
        if not view.numel():  # nothing to read (and a meta view has nothing to copy)
            continue
        found = locate(view)
        if found is None:
            target.copy_(view)
        else:
            read_region(found[0], found[1], target)
    return out
