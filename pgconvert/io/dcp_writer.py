"""A DCP store's writer (the torch_dist and fsdp_dtensor savers', through ``pgconvert/formats/dcp_save.py``, and the
torch_dist optimizer records'): what ``dcp.save(no_dist=True)`` with torch's ``FileSystemWriter`` writes, with the
data files written item by item and no import of torch.distributed.checkpoint (``dcp_plan``).

torch's own loop keeps every tensor it wrote in a dict until the file is closed; this writer writes the same bytes
(the items in torch's order, each the ``torch.save`` archive of its chunk, CRC32s included, and ``.metadata`` as
torch pickles it) with nothing outliving its record, and hashes the file on the way. Used for the model's
``__0_<n>.distcp`` and torch_dist's optimizer records' ``__1_<n>.distcp``.

The model's items may be spread over several data files (``files``: which file each item goes to), and a process may
write only some of them (``writes``): an item's record is a ``torch.save`` archive whose length follows from its
shape and dtype alone (``archive_length``), so the offsets of the files another process writes are known without
reading them, and ``.metadata`` is written from the plan (``index``) by the one process that finalizes. A file this
writer does write is checked against those planned offsets. ``.metadata`` records no path and no save id
(``storage_meta``), so the same plan gives the same bytes whoever writes it.
"""

from __future__ import annotations

import functools
import io
import itertools
from collections.abc import Callable, Collection, Hashable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TypeVar

import torch

from pgconvert.errors import PgconvertError
from pgconvert.io.dcp_plan import (DCP_VERSION, Metadata, SavePlanner, StorageInfo, StorageMeta, WriteItem,
                                   WriteItemType, WriteResult, dump_metadata, global_save_plan)
from pgconvert.io.durable import replace_durably
from pgconvert.io.output import OutputFile
from pgconvert.io.reuse import RecordsInFlight
from pgconvert.io.sizes import itemsize, nbytes
from pgconvert.io.torchzip import CountingSink, PlannedTensor, save_stream, storage_data_offset


def _write_order(items: Sequence[WriteItem]) -> list[WriteItem]:
    """The order torch's single-threaded writer puts one file's items in: the bytes entries, then
    the tensors, each in plan order (so the gate and up halves of one fc1 stay next to each other)."""
    return ([item for item in items if item.type == WriteItemType.BYTE_IO]
            + [item for item in items if item.type != WriteItemType.BYTE_IO])


Item = TypeVar("Item")
# torch's names: a single process's data files ``__0_<n>.distcp``, and the index.
DEFAULT_PREFIX = "__0_"
DATA_SUFFIX = ".distcp"
METADATA_FILE = ".metadata"
# At most this many bytes of values in one data file unless --max-shard-size says otherwise, as an hf destination's
# default shard.
DEFAULT_MAX_DATA_FILE_SIZE = 5 * 10**9
# Tensor items left being written from their own memory while the next is made: none. The planner keeps the tensor
# an item is cut from for the next item (a SwiGLU fc1's gate and up halves), so a second block would add the largest
# tensor to a conversion's memory.
ITEMS_IN_FLIGHT = 0

# Which data file an item goes to, by (key, chunk offsets); an item not named (a bytes entry) goes to file 0.
ItemKey = tuple[str, tuple[int, ...] | None]


def item_key(item: WriteItem) -> ItemKey:
    offset = item.index.offset
    return item.index.fqn, tuple(offset) if offset is not None else None


# The data files a writer wrote: file name -> (its labelled digest, None when digests are off; its size).
WrittenFiles = Mapping[str, tuple[str | None, int]]


class StreamingWriter:
    """A store's data files written here, item by item (see the module docstring): nothing outlives its record,
    and each file's digest is computed on the way; then its ``.metadata``.

    ``files``: the data file (``<prefix><n>.distcp``) of each item (None: one file); ``writes``: the file numbers
    this writer writes (None: all), the others' offsets planned; ``index``: whether it writes ``.metadata``.
    """

    def __init__(self, directory: Path, files: Mapping[ItemKey, int] | None = None,
                 writes: Collection[int] | None = None, index: bool = True, prefix: str = DEFAULT_PREFIX) -> None:
        self.directory = directory
        self.files = files
        self.writes = writes
        self.index = index
        # The data files' name before their number.
        self.prefix = prefix
        # The files written: name -> (labelled digest or None, size); ``digest`` and ``size``: the last one's.
        self.written: dict[str, tuple[str | None, int]] = {}
        self.digest: str | None = None
        self.size: int | None = None

    def save(self, planner: SavePlanner) -> None:
        """What ``dcp.save({}, storage_writer=self, planner=planner, no_dist=True)`` does: the planner's plan made
        global, its data files written, then ``finish``."""
        items, metadata = global_save_plan(planner.create_local_plan())
        self.directory.mkdir(parents=True, exist_ok=True)
        self.finish(metadata, self.write_data(items, planner))

    def write_data(self, items: Sequence[WriteItem], planner: SavePlanner) -> list[WriteResult]:
        groups: dict[int, list[WriteItem]] = {}
        for item in items:
            groups.setdefault(self.files.get(item_key(item), 0) if self.files is not None else 0, []).append(item)
        results = []
        records = RecordsInFlight(ITEMS_IN_FLIGHT)  # the memory each tensor item is made in, file after file
        for number in sorted(groups):
            file_name = f"{self.prefix}{number}{DATA_SUFFIX}"
            ordered = _write_order(groups[number])
            if self.writes is not None and number not in self.writes:
                results += planned_results(file_name, ordered, planner)
                continue
            written = self._write_file(file_name, ordered, planner, records)
            if self.files is not None:
                _check_planned(self.directory / file_name, written, planned_results(file_name, ordered, planner))
            results += written
        return results

    def _write_file(self, file_name: str, items: list[WriteItem], planner: SavePlanner,
                    records: RecordsInFlight) -> list[WriteResult]:
        path = self.directory / file_name
        results = []
        with OutputFile(path) as writer:
            for item in items:
                start = writer.offset
                _write_item(writer, item, planner, records)
                length = writer.offset - start
                results.append(WriteResult(index=item.index, size_in_bytes=length,
                                           storage_data=StorageInfo(file_name, start, length)))
        self.digest, self.size = writer.hexdigest(), writer.offset
        self.written[file_name] = (self.digest, self.size)
        return results

    def finish(self, metadata: Metadata, results: list[WriteResult]) -> None:
        """With ``index``, ``.metadata`` as torch's writer leaves it: the format's version, where each item lies,
        and no checkpoint path or random save id (``StorageMeta()``: the same plan gives the same bytes), written
        durably (``replace_durably``)."""
        if not self.index:
            return
        metadata.version = DCP_VERSION
        metadata.storage_data = {result.index: result.storage_data for result in results}
        metadata.storage_meta = StorageMeta()
        replace_durably(self.directory / METADATA_FILE, dump_metadata(metadata))


def split_by_size(items: Sequence[Item], group: Callable[[Item], Hashable], size: Callable[[Item], int],
                  limit: int) -> list[list[Item]]:
    """``items`` in order, cut into files of at most ``limit`` bytes (``size``): a new file when the next run of
    consecutive items of one ``group`` (a canonical tensor's chunks) would take the file past it; a run larger than
    that has a file of its own. At least one file, empty when there are no items."""
    files: list[list[Item]] = [[]]
    held = 0
    for _, run in itertools.groupby(items, key=group):
        members = list(run)
        nbytes = sum(map(size, members))
        if files[-1] and held + nbytes > limit:
            files.append([])
            held = 0
        files[-1] += members
        held += nbytes
    return files


def planned_results(file_name: str, items: list[WriteItem], planner: SavePlanner) -> list[WriteResult]:
    """Where ``items`` lie in ``file_name`` when written in this order, from their shapes and dtypes alone (a bytes
    entry is resolved: it is small and reads no tensor)."""
    results = []
    offset = 0
    for item in items:
        if item.type == WriteItemType.BYTE_IO:
            data = planner.resolve_data(item)
            assert isinstance(data, io.BytesIO)
            length = len(data.getbuffer())
        else:
            assert item.tensor_data is not None
            length = archive_length(tuple(item.tensor_data.chunk.sizes), item.tensor_data.properties.dtype)
        results.append(WriteResult(index=item.index, size_in_bytes=length,
                                   storage_data=StorageInfo(file_name, offset, length)))
        offset += length
    return results


def _check_planned(path: Path, written: list[WriteResult], planned: list[WriteResult]) -> None:
    """A written file's records lie where the plan put them (the offsets other processes rely on)."""
    for actual, expected in zip(written, planned, strict=True):
        if actual.storage_data != expected.storage_data:
            raise PgconvertError(
                f"{path}: record {actual.index.fqn} was written at {actual.storage_data.offset} with "
                f"{actual.storage_data.length} bytes; planned at {expected.storage_data.offset} with "
                f"{expected.storage_data.length} bytes (its length depends on more than its shape and dtype)")


_ZERO_BLOCK_BYTES = 1 << 24


def _zero_parts(numel: int, dtype: torch.dtype) -> Iterator[torch.Tensor]:
    if not numel:
        return
    block = torch.zeros(min(numel, max(1, _ZERO_BLOCK_BYTES // itemsize(dtype))), dtype=dtype)
    for start in range(0, numel, block.numel()):
        yield block[:min(block.numel(), numel - start)]


@functools.lru_cache(maxsize=4096)
def archive_length(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    """The bytes of one tensor item's record as ``_write_item`` writes it: the archive of a tensor of ``shape``
    and ``dtype``, written from zeros into a sink that only counts (its layout does not depend on the values)."""
    sink = CountingSink()
    numel = nbytes(shape, dtype) // itemsize(dtype)
    # No CRC32s: they change the values of the archive, never its length.
    zeros = PlannedTensor(shape, dtype, _never, parts=lambda: _zero_parts(numel, dtype))
    save_stream(zeros, sink)  # type: ignore[arg-type]
    return sink.offset


@functools.lru_cache(maxsize=4096)
def archive_data_offset(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    """Where the tensor's bytes start in the archive of one tensor item of ``shape`` and ``dtype``."""
    offset = storage_data_offset(PlannedTensor(shape, dtype, _never))
    assert offset is not None
    return offset


def _never() -> torch.Tensor:
    raise AssertionError("a planned tensor only described, or written from its parts")


def _made_for(planner: SavePlanner, item: WriteItem) -> tuple[int, int] | None:
    """What ``resolve_data`` makes for a tensor item: the bytes of the tensor it makes (the item may be a window of
    its rows) and where the item's bytes start in it; None when it makes none (a window of the tensor made for the
    item before). A planner without ``made_for`` is taken to make the item's tensor itself."""
    made = getattr(planner, "made_for", None)
    if made is not None:
        return made(item)  # type: ignore[no-any-return]
    assert item.tensor_data is not None
    return nbytes(tuple(item.tensor_data.chunk.sizes), item.tensor_data.properties.dtype), 0


def _write_item(writer: OutputFile, item: WriteItem, planner: SavePlanner, records: RecordsInFlight) -> None:
    """One item as torch's writer writes it: a bytes entry as is, a tensor as ``torch.save`` of a tensor owning
    exactly its bytes (torch clones a view of a larger storage first; the stream writes the view's bytes with no
    clone). A tensor is made in the memory ``records`` lends, placed at its bytes' offset in the file, and written
    from there (``OutputFile.write_in_place``) where its dtype can start at that place (an archive's length is odd,
    so about every other item starts at an odd offset, and is staged)."""
    if item.type == WriteItemType.BYTE_IO:
        data = planner.resolve_data(item)
        assert isinstance(data, io.BytesIO)
        writer.write(data.getbuffer())
        return
    assert item.tensor_data is not None
    shape, dtype = tuple(item.tensor_data.chunk.sizes), item.tensor_data.properties.dtype
    made = _made_for(planner, item)
    if made is None:
        resolved = planner.resolve_data(item)
    else:
        with records.lending(made[0], writer.offset + archive_data_offset(shape, dtype) - made[1]):
            resolved = planner.resolve_data(item)
    assert isinstance(resolved, torch.Tensor)
    tensor = resolved.detach().contiguous()
    planned = PlannedTensor(tuple(tensor.shape), tensor.dtype, lambda: tensor)
    written = save_stream(planned, writer, crc32=True, reuse_memory=False, from_memory=True)  # type: ignore[arg-type]
    records.add(written)
