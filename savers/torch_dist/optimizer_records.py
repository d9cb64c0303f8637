"""The distributed optimizer's state written into a torch_dist destination, in the ``fully_reshardable``
form (layout-independent: the same records at any TP/PP/DP; the layout is only in ``args``), and what every
form's writer shares: the records file beside the model's, merged into ``.metadata``, and ``common.pt`` rewritten.

``DistributedOptimizer.sharded_param_state_fully_reshardable`` (megatron-core 0.16.1 / 0.20.0) saves
``optimizer.state.{param,exp_avg,exp_avg_sq}.<model key>``: fp32, each with its model tensor's global
shape and chunks; the common state holds ``optimizer = {optimizer: {param_groups}, param_state_sharding_type:
'fully_reshardable'}`` and ``content_metadata['distrib_optim_sharding_type']``. Run after the torch_dist
saver: the records go to a second data file (``__1_0.distcp``) written by the saver's streaming writer
(one record at a time, each produced when written), and are added to ``.metadata`` and ``common.pt``.
"""

from __future__ import annotations

import dataclasses
import io
import os
import pickle
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultSavePlanner, SavePlan
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.planner import WriteItem

from pgconvert.formats import PlannedFile
from pgconvert.formats.megatron import FRAMEWORK_PICKLE, safe_torch_load
from pgconvert.formats.torch_dist import COMMON_FILE, DCP_METADATA_FILE, read_dcp_metadata, single_process_calls
from pgconvert.formats.torch_dist_optimizer import (FULLY_RESHARDABLE, RECORDS_FILE, chained_entries, common_entry,
                                                    state_key)
from pgconvert.io.durable import fsync_file
from pgconvert.optimizer.scaler import set_scalers, target_scalers
from pgconvert.optimizer.source import CARRIED_KEYS, FIELDS, OptimizerSource
from pgconvert.savers.torch_dist.streaming import StreamingWriter


class OptimizerPlanner(DefaultSavePlanner):
    """The optimizer records' plan; each chunk's data is cut from its parameter's state when written."""

    def __init__(self, chunks: list[tuple[str, Any]], optimizer: Any, rows: int, fits_rows: set[str]) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self._chunks = {(chunk.key, chunk.offsets): (field, chunk) for field, chunk in chunks}
        self._items = [chunk.write_item() for _, chunk in chunks]
        self._optimizer = optimizer
        self._rows = rows
        self._fits_rows = fits_rows
        self._last: tuple[tuple[str, str], torch.Tensor] | None = None

    def create_local_plan(self) -> SavePlan:
        self.plan = SavePlan(self._items)
        return self.plan

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor | io.BytesIO:
        field, chunk = self._chunks[(write_item.index.fqn, tuple(write_item.index.offset))]
        whole = self._whole(chunk.canonical, field)
        if chunk.row_start is not None:
            whole = whole.narrow(0, chunk.row_start, chunk.rows)
        return whole.to(torch.float32).reshape(chunk.sizes)

    def _whole(self, name: str, field: str) -> torch.Tensor:
        """The whole tensor (TP1, the target's padded vocab rows); the gate and up chunks share one read."""
        if self._last is None or self._last[0] != (name, field):
            self._last = None
            rows = self._rows if name in self._fits_rows else None
            self._last = ((name, field), self._optimizer.piece(name, field, 1, 0, rows))
        return self._last[1]


def _merge_metadata(iteration_dir: Path, added_path: Path) -> None:
    """Add the records of ``added_path`` (stored in RECORDS_FILE) to the checkpoint's ``.metadata``."""
    path = iteration_dir / DCP_METADATA_FILE
    metadata = read_dcp_metadata(path)
    added = read_dcp_metadata(added_path)
    metadata.state_dict_metadata.update(added.state_dict_metadata)
    for index, info in added.storage_data.items():
        metadata.storage_data[index] = _StorageInfo(RECORDS_FILE, info.offset, info.length, info.transform_descriptors)
    replace_durably(path, pickle.dumps(metadata))


def replace_durably(path: Path, data: bytes | memoryview) -> None:
    """``path``'s content replaced by ``data``: written beside it, synced, then renamed over it."""
    partial = path.with_name(path.name + ".optim")
    partial.write_bytes(data)
    fsync_file(partial)
    os.replace(partial, path)


def rewrite_common(iteration_dir: Path, update: Callable[[dict[str, Any]], None]) -> None:
    """``common.pt`` read, changed by ``update`` and written back durably."""
    path = iteration_dir / COMMON_FILE
    common = dict(safe_torch_load(path))
    update(common)
    buffer = io.BytesIO()
    torch.save(common, buffer, pickle_module=FRAMEWORK_PICKLE)
    replace_durably(path, buffer.getbuffer())


def carry_counters(optimizer: OptimizerSource, common: dict[str, Any]) -> None:
    """The carried counters of the source's first rank (scheduler, floating-point operations) into ``common``."""
    for key in CARRIED_KEYS:
        if key in optimizer.first.extra:
            common[key] = optimizer.first.extra[key]


def _add_common(optimizer: OptimizerSource, iteration_dir: Path, group_counts: list[int] | None = None) -> None:
    """``group_counts``: the target's param groups per chained optimizer (None: the source's one)."""
    step = float(optimizer.step(optimizer.names()[0]))
    counts: list[int | None] = list(group_counts) if group_counts else [None]
    groups = [[dict(settings, step=step) for settings in optimizer.param_group_settings(index, count)]
              for index, count in enumerate(counts)]

    def update(common: dict[str, Any]) -> None:
        common["optimizer"] = common_entry(groups)
        set_scalers(chained_entries(common["optimizer"]), target_scalers(optimizer, len(groups)))
        carry_counters(optimizer, common)
        common["content_metadata"] = dict(common.get("content_metadata") or {},
                                          distrib_optim_sharding_type=FULLY_RESHARDABLE,
                                          distrib_optim_fully_reshardable_mem_efficient=False)

    rewrite_common(iteration_dir, update)


def optimizer_chunks(optimizer: OptimizerSource, model_chunks: list[Any]) -> list[tuple[str, Any]]:
    """The fully_reshardable records, (field, chunk) per model chunk and field, fp32."""
    # parameters only (megatron-core's buffers' param_index_map): not a router's expert_bias buffer
    names = set(optimizer.names())
    return [(field, dataclasses.replace(chunk, key=state_key(field, chunk.key), dtype=torch.float32))
            for chunk in model_chunks if chunk.canonical in names for field in FIELDS]


def write_records(iteration_dir: Path, planner: Any,
                  merge: Callable[[Path, Path], None] = _merge_metadata) -> Any:
    """Save what ``planner`` plans (it brings its own items; no state dict) as RECORDS_FILE beside the model's
    records, then ``merge`` their metadata into the checkpoint's ``.metadata``; returns the streaming writer (its
    ``sha256`` and ``size``). One staging folder, removed whatever happens."""
    staging = iteration_dir / ".optimizer_records"
    staging.mkdir()
    try:
        writer = StreamingWriter(staging)
        with single_process_calls():
            dcp.save({}, storage_writer=writer, planner=planner, no_dist=True)
        os.replace(staging / "__0_0.distcp", iteration_dir / RECORDS_FILE)
        merge(iteration_dir, staging / DCP_METADATA_FILE)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return writer


def write_chunk_records(optimizer: OptimizerSource, chunks: list[tuple[str, Any]], rows: int, fits_rows: set[str],
                        iteration_dir: Path) -> list[PlannedFile]:
    """The records ``chunks`` ((field, chunk) pairs) written to RECORDS_FILE and added to ``.metadata``, each chunk
    cut from ``optimizer``'s field when written (the model-space forms and the plain form);
    returns the file added."""
    writer = write_records(iteration_dir, OptimizerPlanner(chunks, optimizer, rows, fits_rows))
    return [PlannedFile(f"{iteration_dir.name}/{RECORDS_FILE}", len(chunks), sum(chunk.nbytes for _, chunk in chunks),
                        sha256=writer.sha256, size=writer.size)]


def write_fully_reshardable(optimizer: OptimizerSource, model_chunks: list[Any], rows: int, fits_rows: set[str],
                            iteration_dir: Path, group_counts: list[int] | None = None) -> list[PlannedFile]:
    """Write the optimizer records beside the model's (``model_chunks``: the torch_dist saver's chunks, expert
    ones included); ``group_counts``: the target's param groups per chained optimizer. Returns the files added
    or rewritten."""
    added = write_chunk_records(optimizer, optimizer_chunks(optimizer, model_chunks), rows, fits_rows, iteration_dir)
    _add_common(optimizer, iteration_dir, group_counts)
    return added
