"""What torch.distributed.checkpoint's own ``dcp.save`` writes for a plan of pgconvert's DCP writer: the reference
its data files and ``.metadata`` are compared with, byte for byte.

``save_with_torch`` takes the place of ``StreamingWriter.save``: the plan pgconvert's planner makes, rebuilt with
torch's own classes, saved by ``dcp.save(no_dist=True)`` with torch's ``DefaultSavePlanner`` (which makes the plan
global and builds the metadata) and ``FileSystemWriter`` (one data file per rank, no save id or path recorded, as
pgconvert's store records none).
"""

from __future__ import annotations

import io
import warnings
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultSavePlanner, FileSystemWriter, SavePlan
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, StorageMeta, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from pgconvert.io import dcp_plan


def torch_item(item: dcp_plan.WriteItem) -> WriteItem:
    """One of pgconvert's plan items as torch's planner builds it."""
    if item.type == dcp_plan.WriteItemType.BYTE_IO:
        return WriteItem(index=MetadataIndex(item.index.fqn), type=WriteItemType.BYTE_IO)
    data = item.tensor_data
    assert data is not None
    offsets = torch.Size(data.chunk.offsets)
    return WriteItem(index=MetadataIndex(item.index.fqn, offsets), type=WriteItemType.SHARD,
                     tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(offsets, torch.Size(data.chunk.sizes)),
                                                 properties=TensorProperties(dtype=data.properties.dtype),
                                                 size=torch.Size(data.size)))


def _key(index: Any) -> tuple[str, tuple[int, ...] | None]:
    return index.fqn, tuple(index.offset) if index.offset is not None else None


class _NoRunIds(FileSystemWriter):
    def storage_meta(self) -> StorageMeta:
        return StorageMeta()


def save_with_torch(writer: Any, planner: dcp_plan.SavePlanner) -> None:
    """``writer``'s store (its directory) written by torch's ``dcp.save`` from ``planner``'s plan and data."""
    ours = planner.create_local_plan()
    by_key = {_key(item.index): item for item in ours.items}

    class Planner(DefaultSavePlanner):
        def create_local_plan(self) -> SavePlan:
            self.plan = SavePlan([torch_item(item) for item in ours.items], planner_data=ours.planner_data)
            return self.plan

        def resolve_data(self, write_item: WriteItem) -> torch.Tensor | io.BytesIO:
            return planner.resolve_data(by_key[_key(write_item.index)])

    storage = _NoRunIds(str(writer.directory), single_file_per_rank=True, sync_files=True, thread_count=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({}, storage_writer=storage, no_dist=True,
                 planner=Planner(flatten_state_dict=ours.planner_data is not None, flatten_sharded_tensors=False))
