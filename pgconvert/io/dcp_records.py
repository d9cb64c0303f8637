"""Tensor records of a torch.distributed.checkpoint store's ``*.distcp`` files (torch_dist and fsdp_dtensor
sources), read in place: only the bytes a requested box needs.

torch.distributed.checkpoint stores each chunk as a ``torch.save`` zip of one tensor, at an
offset and length of a ``.distcp`` file named by ``.metadata``'s ``storage_data``. torch's own
reader ``torch.load``s every overlapping record whole before copying the requested part, so its
peak memory is the largest record. Here nothing is memory-mapped: the record's zip directory and
pickle (a few hundred bytes) are read with ``os.pread`` and parsed with storages on the meta device,
which gives the tensor's dtype, shape, stride and where its bytes start (after its storage record's
zip local header); the requested box is then a strided region of the file (``io.ranges.FileRegion``)
read with ``os.preadv`` straight into its place in the destination tensor (``io.ranges.read_region``),
in slabs of at most ``SLAB_BYTES`` of the file, so a box of runs too short to read one by one, read
as one span and gathered, holds at most one slab of scratch. Memory is the requested piece plus at
most one slab, whatever the size of the record, and no page of the file is faulted in.
"""

from __future__ import annotations

import io
import os
import pickle
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from pgconvert.io import limits
from pgconvert.errors import CheckpointError, UnsafePickleError
from pgconvert.io.limits import over_limit, quote
from pgconvert.io.ranges import FileRegion, read_region
from pgconvert.io.torch_input import _meta_unpickling, _Needs, _unpickle_for_needs, _zip_records

# The most bytes of a record's storage one read of a box spans (its scratch, when short runs are gathered).
SLAB_BYTES = 16 * 2**20


class _Window(io.RawIOBase):
    """A read-only file over ``length`` bytes of an open file from ``start`` (one record of a .distcp),
    read with ``os.pread``; the file ending early reads as the window's end."""

    def __init__(self, fd: int, start: int, length: int) -> None:
        super().__init__()
        self._fd, self._start, self._length, self._position = fd, start, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._position

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._position, io.SEEK_END: self._length}[whence]
        if base + offset < 0:
            raise ValueError("negative seek position")
        self._position = base + offset
        return self._position

    def readinto(self, buffer: bytearray | memoryview) -> int:  # type: ignore[override]
        count = max(0, min(len(buffer), self._length - self._position))
        data = os.pread(self._fd, count, self._start + self._position) if count else b""
        memoryview(buffer)[:len(data)] = data
        self._position += len(data)
        return len(data)


def read_bytes(fd: int, offset: int, length: int, label: str) -> bytes:
    """``length`` bytes of the open file from ``offset`` (``os.pread``); the file ending first is a
    CheckpointError naming ``label``."""
    parts: list[bytes] = []
    done = 0
    while done < length:
        part = os.pread(fd, length - done, offset + done)
        if not part:
            raise CheckpointError(f"{label}: the file ends at byte {offset + done}, before the record's end at "
                                  f"byte {offset + length} (truncated checkpoint)")
        parts.append(part)
        done += len(part)
    return b"".join(parts)


@dataclass(frozen=True)
class TensorRecord:
    """Where a stored chunk's values lie in its .distcp file, and how they are laid out."""

    data_offset: int  # absolute offset in the file of the storage's first byte
    dtype: torch.dtype
    size: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int  # in elements


def check_extent(path: Path, key: str, offset: int, length: int, size: int) -> None:
    """A record must lie inside its file (the file may have changed since the index was checked)."""
    if length <= 0 or offset + length > size:
        raise CheckpointError(f"{path}: {quote(key)} is stored at offset {offset}, length {length}, which does not "
                              f"lie inside the file's {size} bytes (truncated or corrupt checkpoint)")


def parse_tensor_record(fd: int, offset: int, length: int, label: str) -> TensorRecord:
    """The layout of the ``torch.save`` zip at ``offset`` of the open file ``fd``, read without its tensor bytes."""
    window = _Window(fd, offset, length)
    records = _zip_records(label, window, length)
    pickles = [name for name in records if name.endswith("/data.pkl") and name.count("/") == 1]
    if len(pickles) != 1:
        raise CheckpointError(f"{label}: not a torch.save record of one tensor (no single data.pkl)")
    prefix = pickles[0][: -len("data.pkl")]
    start, pickled_length = records[pickles[0]]
    if pickled_length > limits.MAX_PICKLE_BYTES:
        raise over_limit(label, "the data.pkl record's size in bytes", pickled_length, "MAX_PICKLE_BYTES")
    _check_byteorder(window, records.get(prefix + "byteorder"), label)
    needs = _Needs(label, legacy=False)
    try:
        with _meta_unpickling(label):
            tensor = _unpickle_for_needs(io.BytesIO(read_bytes(fd, offset + start, pickled_length, label)), needs)
    except pickle.UnpicklingError as exc:
        raise UnsafePickleError(f"{label}: refuses to unpickle it ({quote(str(exc).strip()[:400], 200)}); "
                                "nothing from the file was executed") from exc
    if not isinstance(tensor, torch.Tensor) or len(needs.bytes) != 1:
        raise CheckpointError(f"{label}: not a torch.save record of one tensor ({quote(type(tensor).__name__)})")
    (key, needed), = needs.bytes.items()
    data = records.get(f"{prefix}data/{key}")
    if data is None or data[1] < needed:
        raise CheckpointError(f"{label}: truncated or corrupt record (storage {quote(key)} holds "
                              f"{0 if data is None else data[1]} bytes, the tensor's storage needs {needed})")
    record = TensorRecord(offset + data[0], tensor.dtype, tuple(tensor.shape), tuple(tensor.stride()),
                          tensor.storage_offset())
    last = record.storage_offset + _span(record.size, record.stride)
    if any(step < 0 for step in record.stride) or last * tensor.element_size() > needed:
        raise CheckpointError(f"{label}: truncated or corrupt record (a {list(record.size)} tensor with strides "
                              f"{list(record.stride)} at element {record.storage_offset} overruns its "
                              f"{needed}-byte storage)")
    return record


def _check_byteorder(window: _Window, record: tuple[int, int] | None, label: str) -> None:
    if record is None:
        return  # torch wrote no byteorder record before 2.1: native (little-endian) order
    window.seek(record[0])
    order = window.read(min(record[1], 16))
    if order != sys.byteorder.encode():
        raise CheckpointError(f"{label}: stored in byte order {quote(order)}; pgconvert reads {sys.byteorder}-endian "
                              "records only")


def _span(lengths: tuple[int, ...] | list[int], stride: tuple[int, ...] | list[int]) -> int:
    """How many elements of storage a box with these lengths and strides covers, first to last."""
    if any(length == 0 for length in lengths):
        return 0
    return 1 + sum((length - 1) * step for length, step in zip(lengths, stride))


def _slabs(starts: list[int], lengths: list[int], stride: tuple[int, ...], itemsize: int,
           limit: int) -> Iterator[tuple[list[int], list[int]]]:
    """The box as sub-boxes, in order, each covering at most ``limit`` bytes of storage (or one element)."""
    split = [index for index, length in enumerate(lengths) if length > 1]
    if not split or _span(lengths, stride) * itemsize <= limit:
        yield starts, lengths
        return
    dim = split[0]
    one = _span(lengths[:dim] + [1] + lengths[dim + 1:], stride)
    budget = limit // itemsize
    # entries along ``dim`` per sub-box: as many as keep its span within the budget (fewer than all)
    step = 1 if one > budget or stride[dim] == 0 else 1 + (budget - one) // stride[dim]
    for begin in range(0, lengths[dim], step):
        sub_starts = starts[:dim] + [starts[dim] + begin] + starts[dim + 1:]
        sub_lengths = lengths[:dim] + [min(step, lengths[dim] - begin)] + lengths[dim + 1:]
        yield from _slabs(sub_starts, sub_lengths, stride, itemsize, limit)


def read_box(fd: int, path: Path, record: TensorRecord, starts: list[int], lengths: list[int],
             target: torch.Tensor, label: str) -> None:
    """Read the box ``starts``/``lengths`` of the stored chunk from the open file ``fd`` (at ``path``)
    straight into ``target`` (any strides: its place in the destination piece), slab by slab."""
    if (len(starts) != len(record.size) or len(lengths) != len(record.size)
            or any(begin + count > total for begin, count, total in zip(starts, lengths, record.size))):
        raise CheckpointError(f"{label}: the requested box {starts} + {lengths} does not lie inside the stored "
                              f"chunk of shape {list(record.size)}")
    if target.dtype != record.dtype or list(target.shape) != list(lengths):
        raise CheckpointError(f"{label}: stored as {record.dtype} {list(record.size)}, but the index describes "
                              f"{target.dtype} (a box of {list(target.shape)})")
    itemsize = target.element_size()
    chunk = FileRegion(path, record.data_offset + record.storage_offset * itemsize, record.size, record.stride,
                       record.dtype)
    for sub_starts, sub_lengths in _slabs(list(starts), list(lengths), record.stride, itemsize, SLAB_BYTES):
        if _span(sub_lengths, record.stride) == 0:
            continue
        region, destination = chunk, target
        for dim, (begin, sub_length) in enumerate(zip(sub_starts, sub_lengths)):
            region = region.narrow(dim, begin, sub_length)
            destination = destination.narrow(dim, begin - starts[dim], sub_length)
        read_region(fd, region, destination)
