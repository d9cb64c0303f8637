"""The distributed optimizer's state written into a torch_dist destination in the ``dp_reshardable``
form (Megatron-LM's default: ``metadata['distrib_optim_sharding_type']`` unless
``--dist-ckpt-optim-fully-reshardable``), at the destination's TP/PP and data-parallel size.

What ``DistributedOptimizer.sharded_state_dict`` / ``sharded_param_state_dp_reshardable`` save
(megatron-core 0.16.1 and Megatron-LM d98e8a64's 0.20.0 write the same), per model-parallel rank
``g = tp + tp_size * pp`` (``data_parallel_group_idx``):

- ShardedObjects (``<key>/shard_0_1``, stored as ``torch.save([value])``):
  ``optimizer.distributed.dp_group_idx_<g>.optimizer`` = ``{'param_groups': [...]}`` (with ``step``,
  without ``params``), ``.per_bucket_numel`` / ``.per_bucket_numel_unpadded`` = per buffer
  ``{(param dtype, grad dtype): [bucket numel]}``;
- per buffer (``gbuf_idx``: chunks with parameters), DDP bucket (``flat_buffers``' buckets) and field (``param``,
  ``exp_avg``, ``exp_avg_sq``, fp32) the ShardedTensor ``...gbuf_idx_<i>.dtype_<(param, grad)>.bucket_idx_<b>.
  <field>`` of global shape ``(numel_unpadded,)``, one chunk per parameter's part in each DP rank's shard and one per gap
  (``flat_buffers``' 64-element alignment; the bucket is padded to ``lcm(dp, 128)``, or
  ``lcm(dp, 128, 2**16)`` with ``ddp_pad_buckets_for_high_nccl_busbw``, and split in ``dp`` equal
  shards, ``dp`` being DP x CP: the dense optimizer's ``intra_dp_cp`` group; padding past ``numel_unpadded`` is not stored). megatron-core leaves gaps uninitialised
  (``torch.empty``); they are written as zeros here.

The common state holds ``optimizer = {'param_state_sharding_type': 'dp_reshardable'}`` and
``content_metadata['distrib_optim_sharding_type']``. As for ``fully_reshardable``
(``optimizer_records.py``), the records go to ``__1_<n>.distcp`` through the streaming
writer (one parameter's piece in memory at a time; a parameter's records of one field in one file) and are merged
into ``.metadata`` and the common state.

A MoE model at expert parallel size > 1 (megatron-core chains a dense and an expert distributed
optimizer, ``get_megatron_optimizer``). ``ChainedOptimizer.sharded_state_dict`` (optimizer.py) prefixes every
ShardedTensor and ShardedObject key of optimizer ``i`` with ``chained_<i>.`` for a non fully-reshardable form
(``chained_optim_avoid_prefix`` does not suppress it), and the common state holds ``optimizer = {0: {...},
1: {...}}``. The dense optimizer (``model_parallel_group`` tp-pp, ``intra_dp_cp`` group): ``g = tp + tp_size *
pp`` and the DP size as above, its parameters alike on every EP rank. The expert one (DDP's
``expert_parallel_buffers``, one per model chunk holding experts, ``gbuf_idx`` counting those only): ``g`` its
rank in the expert tensor-model-pipeline group (``get_expert_tensor_model_pipeline_parallel_group``, ranks
tp-ep-pp, tp fastest): ``tp + tp_size * (ep + ep_size * pp)``, and the expert data-parallel size
``tp * cp * dp / (expert_tp * ep)`` (``intra_expt_dp``) that its buckets are padded (``lcm(expert dp, 128)``)
and split by. Expert tensor parallel size other than tp is refused.
"""

from __future__ import annotations

import dataclasses
import io
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pgconvert.formats import PlannedFile
from pgconvert.formats.torch_dist_optimizer import DP_RESHARDABLE, bucket_key, object_key, record_prefix, scaler_key
from pgconvert.io.dcp_plan import SavePlan, SavePlanner, WriteItem, WriteItemType, bytes_item, tensor_item
from pgconvert.io.dcp_writer import ItemKey, WrittenFiles, split_by_size
from pgconvert.model.config import ModelConfig
from pgconvert.model.grid import RankCoord
from pgconvert.model.layout import ParallelLayout
from pgconvert.optimizer.data_parallel import optimizer_dp, optimizer_ranks
from pgconvert.optimizer.flat import FlatParam, bucket_divisor, bucket_pieces, bucket_ranges, flat_buffers
from pgconvert.optimizer.order import chain, chained_slots, optimizer_count
from pgconvert.optimizer.scaler import target_scalers
from pgconvert.optimizer.source import FIELDS, FP32_BYTES, OptimizerSource
from pgconvert.savers.torch_dist.common_state import rewrite_common
from pgconvert.savers.torch_dist.optimizer_records import (RecordsShare, carry_counters, numbered, records_files,
                                                           write_records)


@dataclass(frozen=True)
class FlatRecord:
    """One stored chunk: elements ``[start, end)`` of a bucket's field; ``param`` None: a gap."""

    key: str
    coord: RankCoord
    field: str
    start: int
    end: int
    numel: int
    param: FlatParam | None

    @property
    def item_key(self) -> ItemKey:
        return self.key, (self.start,)

    @property
    def nbytes(self) -> int:
        return FP32_BYTES * (self.end - self.start)

    def write_item(self) -> WriteItem:
        return tensor_item(self.key, (self.start,), (self.end - self.start,), (self.numel,), torch.float32)


class FlatRecordsPlanner(SavePlanner):
    """The records' plan; each chunk is cut from its parameter's TP piece when written."""

    def __init__(self, records: list[FlatRecord], objects: dict[str, Any], optimizer: Any, rows: int) -> None:
        self._records = {(record.key, (record.start,)): record for record in records}
        self._items = [bytes_item(key) for key in objects] + [record.write_item() for record in records]
        self._objects = objects
        self._optimizer = optimizer
        self._rows = rows
        self._last: tuple[tuple[RankCoord, str, str], torch.Tensor] | None = None

    def create_local_plan(self) -> SavePlan:
        return SavePlan(self._items)

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor | io.BytesIO:
        if write_item.type == WriteItemType.BYTE_IO:
            buffer = io.BytesIO()
            torch.save([self._objects[write_item.index.fqn]], buffer)  # megatron-core stores [ShardedObject.data]
            buffer.seek(0)
            return buffer
        record = self._records[(write_item.index.fqn, tuple(write_item.index.offset))]
        if record.param is None:
            return torch.zeros(record.end - record.start, dtype=torch.float32)
        flat = self._piece(record.coord, record.param, record.field)
        return flat[record.start - record.param.start:record.end - record.param.start]

    def _piece(self, coord: RankCoord, placed: FlatParam, field: str) -> torch.Tensor:
        """The parameter's flat TP piece (a part split between DP shards is read once)."""
        spec = placed.slot.spec
        key = (coord, spec.canonical, field)
        if self._last is None or self._last[0] != key:
            self._last = None
            rows = self._rows if spec.rule.fits_rows else None
            piece = self._optimizer.piece(spec.canonical, field, spec.tp_size, spec.tp_rank, rows, spec.rule)
            self._last = (key, piece.to(torch.float32).reshape(-1).contiguous())
        return self._last[1]


def _buckets(placed: list[FlatParam], numel: int) -> list[tuple[list[FlatParam], int]]:
    """A buffer's DDP buckets, each its parameters placed in the bucket (offsets from its start) and its
    unpadded size (buckets: each bucket is its own record)."""
    return [([dataclasses.replace(item, start=item.start - start, end=item.end - start, bucket_start=0)
              for item in placed if item.bucket == bucket], end - start)
            for bucket, (start, end) in enumerate(bucket_ranges(placed, numel))]


def plan_records(optimizer: OptimizerSource, config: ModelConfig, layout: ParallelLayout, rows: int, dp: int,
                 args: Any, distributed: Collection[int] | None = None) -> tuple[list[FlatRecord], dict[str, Any]]:
    """Every model-parallel rank's records and objects, in megatron-core's key layout (per chained optimizer;
    ``distributed``: those that are distributed ones, default all)."""
    rules = optimizer.rules
    counts = [len(groups) for groups in chained_slots(config, layout, RankCoord(0, 0, 0), rules, rows)]
    members = chain(config, layout, rules)
    step = optimizer.group_step()
    records: list[FlatRecord] = []
    objects: dict[str, Any] = {}
    scalers = target_scalers(optimizer, len(counts))  # beside the param groups, per model-parallel rank
    for index, count in enumerate(counts):
        if distributed is not None and index not in distributed:
            continue
        groups = [dict(settings, step=step) for settings in optimizer.param_group_settings(count=count,
                                                                                           member=members[index])]
        own_dp = optimizer_dp(config, layout, dp, args, index, f"layout {layout.describe()}", rules)
        for coord in optimizer_ranks(config, layout, index, rules):
            buffers = [_buckets(placed, numel) for placed, numel in
                       flat_buffers(config, layout, coord, rules, rows, args, dp, index)]
            prefix = record_prefix(config, layout, coord, index, rules)
            if scalers[index] is not None:
                objects[scaler_key(prefix)] = scalers[index]
            _add_rank(optimizer, prefix, coord, buffers, groups, own_dp, bucket_divisor(own_dp, args), records, objects)
    return records, objects


def _add_rank(optimizer: OptimizerSource, prefix: str, coord: RankCoord, buffers: list[list[tuple[list[FlatParam], int]]],
              groups: list[dict[str, Any]], dp: int, divisor: int, records: list[FlatRecord],
              objects: dict[str, Any]) -> None:
    """One optimizer's records and objects of one model-parallel rank (``buffers``: per gbuf, its buckets)."""
    objects[object_key(prefix, "optimizer")] = {"param_groups": groups}
    objects[object_key(prefix, "per_bucket_numel")] = [
        {optimizer.dtype_key: [-(-numel // divisor) * divisor for _, numel in buckets]} for buckets in buffers]
    objects[object_key(prefix, "per_bucket_numel_unpadded")] = [
        {optimizer.dtype_key: [numel for _, numel in buckets]} for buckets in buffers]
    for index, buckets in enumerate(buffers):
        for bucket, (placed, numel) in enumerate(buckets):
            records += [FlatRecord(bucket_key(prefix, index, optimizer.dtype_key, bucket, field), coord, field, start,
                                end, numel, param)
                        for field in FIELDS for start, end, param in bucket_pieces(placed, numel, dp, divisor)]


def _common_update(optimizer: OptimizerSource, count: int = 1) -> Callable[[dict[str, Any]], None]:
    def update(common: dict[str, Any]) -> None:
        entry = {"param_state_sharding_type": DP_RESHARDABLE}  # {0: dense, 1: expert} when chained
        common["optimizer"] = entry if count == 1 else {index: dict(entry) for index in range(count)}
        carry_counters(optimizer, common)
        content = dict(common.get("content_metadata") or {}, distrib_optim_sharding_type=DP_RESHARDABLE)
        content.pop("distrib_optim_fully_reshardable_mem_efficient", None)
        common["content_metadata"] = content
    return update


def record_numbers(records: list[FlatRecord], limit: int) -> dict[ItemKey, int]:
    """The records file of each record: a parameter's records of one field (its parts in the DP shards and the gaps
    after them) in one file, so a process reads each piece it writes once."""
    owners: list[tuple[FlatRecord, object]] = []
    owner: object = None
    for record in records:
        if record.param is not None:
            owner = (record.coord, record.param.slot.spec.canonical, record.field)
        owners.append((record, owner))
    files = split_by_size(owners, lambda pair: pair[1], lambda pair: pair[0].nbytes, limit)
    return numbered(files, lambda pair: pair[0].item_key)


def planned_files(records: list[FlatRecord], objects: dict[str, Any], limit: int, directory: str,
                  written: WrittenFiles | None = None) -> list[PlannedFile]:
    """The records files (``directory``: the iteration's) and what each holds (with ``written``: those it names)."""
    return records_files(directory, {record.item_key: record.nbytes for record in records},
                         record_numbers(records, limit), len(objects), written)


def write_dp_reshardable(optimizer: OptimizerSource, config: ModelConfig, layout: ParallelLayout, rows: int, dp: int,
                         iteration_dir: Path, args: Any, share: RecordsShare) -> list[PlannedFile]:
    """Write the records beside the torch_dist saver's (for ``dp`` data-parallel ranks at ``layout``; ``args``: the
    target's, as the common state holds them; ``share``: which); returns the files added."""
    records, objects = plan_records(optimizer, config, layout, rows, dp, args)
    written = write_records(iteration_dir, FlatRecordsPlanner(records, objects, optimizer, rows),
                            record_numbers(records, share.limit), share)
    if share.shared:
        rewrite_common(iteration_dir, _common_update(optimizer, optimizer_count(config, layout, optimizer.rules)))
    return planned_files(records, objects, share.limit, iteration_dir.name, written)
