"""Tensor records of ``*.distcp`` files, read in place: only the bytes a requested box needs.

torch.distributed.checkpoint stores each chunk as a ``torch.save`` zip of one tensor, at an
offset and length of a ``.distcp`` file named by ``.metadata``'s ``storage_data``. torch's own
reader ``torch.load``s every overlapping record whole before copying the requested part, so its
peak memory is the largest record. Here the file is memory-mapped read-only; the record's zip
directory and pickle (a few hundred bytes) are parsed with storages on the meta device, which gives
the tensor's dtype, shape, stride and where its bytes start; the requested box is then copied out of
the mapping in slabs of at most ``SLAB_BYTES`` of the file, each slab's pages handed back as soon as
it is copied. Memory is the requested piece plus one slab, whatever the size of the record.
"""

from __future__ import annotations

import io
import mmap
import pickle
import sys
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from pgconvert.io import limits
from pgconvert.errors import CheckpointError, UnsafePickleError
from pgconvert.io.limits import over_limit, quote
from pgconvert.io.memory import release_mapped_pages
from pgconvert.io.torch_input import _meta_unpickling, _Needs, _unpickle_for_needs, _zip_records

# The most bytes of a record's mapping resident at once while a box is copied out of it.
SLAB_BYTES = 16 * 2**20


class _Window(io.RawIOBase):
    """A read-only file over ``length`` bytes of a mapping from ``start`` (one record of a .distcp)."""

    def __init__(self, mapped: mmap.mmap, start: int, length: int) -> None:
        super().__init__()
        self._mapped, self._start, self._length, self._position = mapped, start, length, 0

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
        begin = self._start + self._position
        memoryview(buffer)[:count] = self._mapped[begin:begin + count]
        self._position += count
        return count


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


def parse_tensor_record(mapped: mmap.mmap, offset: int, length: int, label: str) -> TensorRecord:
    """The layout of the ``torch.save`` zip at ``offset`` of ``mapped``, read without its tensor bytes."""
    window = _Window(mapped, offset, length)
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
            tensor = _unpickle_for_needs(io.BytesIO(mapped[offset + start:offset + start + pickled_length]), needs)
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


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A uint8 view of ``tensor`` with one more, innermost dimension: its elements' bytes."""
    itemsize = tensor.element_size()
    return torch.empty(0, dtype=torch.uint8).set_(
        tensor.untyped_storage(), tensor.storage_offset() * itemsize,
        [*tensor.shape, itemsize], [step * itemsize for step in tensor.stride()] + [1])


def copy_box(mapped: mmap.mmap, record: TensorRecord, starts: list[int], lengths: list[int],
             target: torch.Tensor, label: str) -> None:
    """Copy the box ``starts``/``lengths`` of the stored chunk into ``target``, slab by slab.

    Copies go byte-wise (records need not be aligned in the file); no view of the mapping outlives
    this call.
    """
    if (len(starts) != len(record.size) or len(lengths) != len(record.size)
            or any(begin + count > total for begin, count, total in zip(starts, lengths, record.size))):
        raise CheckpointError(f"{label}: the requested box {starts} + {lengths} does not lie inside the stored "
                              f"chunk of shape {list(record.size)}")
    if target.dtype != record.dtype or list(target.shape) != list(lengths):
        raise CheckpointError(f"{label}: stored as {record.dtype} {list(record.size)}, but the index describes "
                              f"{target.dtype} (a box of {list(target.shape)})")
    itemsize = target.element_size()
    for sub_starts, sub_lengths in _slabs(list(starts), list(lengths), record.stride, itemsize, SLAB_BYTES):
        count = _span(sub_lengths, record.stride)
        if count == 0:
            continue
        first = record.storage_offset + sum(begin * step for begin, step in zip(sub_starts, record.stride))
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The given buffer is not writable")
            source = torch.frombuffer(mapped, dtype=torch.uint8, count=count * itemsize,
                                      offset=record.data_offset + first * itemsize)
        view = source.as_strided([*sub_lengths, itemsize], [step * itemsize for step in record.stride] + [1])
        destination = target
        for dim, (begin, sub_length) in enumerate(zip(sub_starts, sub_lengths)):
            destination = destination.narrow(dim, begin - starts[dim], sub_length)
        _as_bytes(destination).copy_(view)
        release_mapped_pages([source])
        del view, source
