"""The torch_dist saver's data-file writer: torch's ``FileSystemWriter`` with the data file written item by item.

torch's own loop keeps every tensor it wrote in a dict until the file is closed; this writer writes the same
bytes (the items in torch's order, each the ``torch.save`` archive of its chunk, CRC32s included) with nothing
outliving its record, and hashes the file on the way. Used for the model's ``__0_0.distcp`` and the optimizer
records' ``__1_0.distcp``.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemWriter, SavePlan, SavePlanner
from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX, _StorageInfo
from torch.distributed.checkpoint.planner import WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from pgconvert.io.output import OutputFile
from pgconvert.io.torchzip import PlannedTensor, save_stream


def _write_order(items: Sequence[WriteItem]) -> list[WriteItem]:
    """The order torch's single-threaded writer puts one file's items in: the bytes entries, then
    the tensors, each in plan order (so the gate and up halves of one fc1 stay next to each other)."""
    return ([item for item in items if item.type == WriteItemType.BYTE_IO]
            + [item for item in items if item.type != WriteItemType.BYTE_IO])


class StreamingWriter(FileSystemWriter):
    """torch's ``FileSystemWriter`` with the data file written here, item by item (see the module
    docstring): nothing outlives its record, and the file's sha256 is computed on the way."""

    def __init__(self, directory: Path) -> None:
        super().__init__(str(directory), single_file_per_rank=True, sync_files=True, thread_count=1,
                         per_thread_copy_ahead=0)
        self.directory = directory
        self.sha256: str | None = None
        self.size: int | None = None

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        file_name = f"{plan.storage_data.prefix}0{DEFAULT_SUFFIX}"
        path = self.directory / file_name
        results = []
        with OutputFile(path) as writer:
            for item in _write_order(plan.items):
                start = writer.offset
                _write_item(writer, planner.resolve_data(item))
                length = writer.offset - start
                results.append(WriteResult(index=item.index, size_in_bytes=length,
                                           storage_data=_StorageInfo(file_name, start, length)))
        self.sha256, self.size = writer.hexdigest(), writer.offset
        future: Future[list[WriteResult]] = Future()
        future.set_result(results)
        return future


def _write_item(writer: OutputFile, data: torch.Tensor | io.BytesIO) -> None:
    """One item as torch's writer writes it: a bytes entry as is, a tensor as ``torch.save`` of a
    tensor owning exactly its bytes (torch clones a view of a larger storage first; the stream
    writes the view's bytes with no clone)."""
    if isinstance(data, io.BytesIO):
        writer.write(data.getbuffer())
        return
    tensor = data.detach().contiguous()
    save_stream(PlannedTensor(tuple(tensor.shape), tensor.dtype, lambda: tensor), writer,  # type: ignore[arg-type]
                crc32=True)
