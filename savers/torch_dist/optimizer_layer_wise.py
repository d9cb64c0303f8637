"""A layer-wise (Muon or Lion) run's optimizer state written into a torch_dist destination, in either form Megatron-LM
saves.

Megatron-LM d98e8a64 with ``--optimizer muon --use-distributed-optimizer`` (``use_layer_wise_distributed_optimizer``;
``--optimizer lion`` likewise, Lion's ``exp_avg`` where Muon's ``momentum_buffer`` is) chains megatron-core's
``LayerWiseDistributedOptimizer`` over Muon's parameters, each a whole tensor kept by one
data-parallel rank, and a ``DistributedOptimizer`` (Adam) over a DDP buffer of the rest (the word embedding, output
layer and norms: ``flat_buffers`` of chained optimizer 1). Its ``sharded_state_dict`` saves:

- ``dp_reshardable`` (the default): Muon's records in the plain form, ``chained_0.optimizer.state.{fp32_param,
  momentum_buffer}.<model key>`` (the model tensor's global shape and chunks), and Adam's as the distributed optimizer's
  ``chained_1.optimizer.distributed.dp_group_idx_<g>...`` flat records and objects; the common state's ``optimizer``
  ``{0: {optimizer: {param_groups}}, 1: {param_state_sharding_type: 'dp_reshardable'}}``;
- ``fully_reshardable`` (``--dist-ckpt-optim-fully-reshardable``): the same records unprefixed, Adam's as
  ``optimizer.state.{param,exp_avg,exp_avg_sq}.<model key>``, and Adam's param groups (with ``step``) in the common
  state: ``{0: {optimizer: {param_groups}}, 1: {optimizer: {param_groups}, param_state_sharding_type}}``.

Both write their records in one pass into the records files (``optimizer_records.write_records``): the chunk records
first, then the flat ones (numbered after them), each produced when written.
"""

from __future__ import annotations

import dataclasses
import io
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from pgconvert.formats import PlannedFile
from pgconvert.formats.torch_dist_optimizer import (DP_RESHARDABLE, FULLY_RESHARDABLE, MODEL_SPACE_FIELDS, PLAIN_FIELDS,
                                                    chain_prefixes, state_key)
from pgconvert.io.dcp_plan import SavePlan, SavePlanner, WriteItem
from pgconvert.io.dcp_writer import ItemKey
from pgconvert.model.config import ModelConfig
from pgconvert.model.layout import ParallelLayout
from pgconvert.optimizer.order import ChainMember
from pgconvert.optimizer.source import FORM_FP16, OptimizerSource
from pgconvert.savers.torch_dist.common_state import rewrite_common
from pgconvert.savers.torch_dist.optimizer_dp_reshardable import (FlatRecord, FlatRecordsPlanner, plan_records,
                                                                  record_numbers)
from pgconvert.savers.torch_dist.optimizer_records import (OptimizerPlanner, RecordsShare, carry_counters,
                                                           chunk_numbers, per_field, records_files, write_records)


@dataclasses.dataclass
class LayerWisePlan:
    """What a layer-wise destination holds: the chunk records (field, chunk), the flat records and objects
    (dp_reshardable), and every record's file."""

    chunks: list[tuple[str, Any]]
    records: list[FlatRecord]
    objects: dict[str, Any]
    numbers: dict[ItemKey, int]

    def sizes(self) -> dict[ItemKey, int]:
        """Bytes of values per record."""
        return {**{(chunk.key, tuple(chunk.offsets)): chunk.nbytes for _, chunk in self.chunks},
                **{record.item_key: record.nbytes for record in self.records}}


def _chunks(optimizer: OptimizerSource, model_chunks: list[Any], form: str) -> list[tuple[str, Any]]:
    """The model-space records: Muon's in the plain form (prefixed ``chained_0.`` in dp_reshardable), and in
    fully_reshardable Adam's as that form's, fp32."""
    stored = [{field: name for field, name in PLAIN_FIELDS[FORM_FP16].items() if name},  # Muon's, plain
              MODEL_SPACE_FIELDS[FULLY_RESHARDABLE] if form == FULLY_RESHARDABLE else {}]  # Adam's (else flat)
    prefixes = chain_prefixes(len(stored), prefixed=form == DP_RESHARDABLE)

    def fields(name: str) -> list[str]:
        return [field for field in optimizer.fields(name) if field in stored[optimizer.optimizer_of(name)]]

    def key(name: str, field: str, model_key: str) -> str:
        index = optimizer.optimizer_of(name)
        return prefixes[index] + state_key(stored[index][field], model_key)

    return [(field, dataclasses.replace(chunk, key=key(chunk.canonical, field, chunk.key), dtype=torch.float32))
            for field, chunk in per_field(model_chunks, set(optimizer.names()), fields)]


def plan_layer_wise(optimizer: OptimizerSource, model_chunks: list[Any], form: str, config: ModelConfig,
                    layout: ParallelLayout, rows: int, dp: int, args: Any, limit: int) -> LayerWisePlan:
    """The records of ``form`` at ``layout`` (``dp`` data-parallel ranks; ``limit``: bytes of values per file)."""
    chunks = _chunks(optimizer, model_chunks, form)
    records: list[FlatRecord] = []
    objects: dict[str, Any] = {}
    if form == DP_RESHARDABLE:
        records, objects = plan_records(optimizer, config, layout, rows, dp, args, distributed=(1,))
    numbers = chunk_numbers(chunks, limit) if chunks else {}
    after = max(numbers.values(), default=-1) + 1
    numbers.update({key: after + number for key, number in record_numbers(records, limit).items()})
    return LayerWisePlan(chunks, records, objects, numbers)


class _Planner(SavePlanner):
    """Both planners' items in one plan, each resolved by the planner that made it."""

    def __init__(self, chunk_planner: OptimizerPlanner, flat_planner: FlatRecordsPlanner) -> None:
        self._planners = (chunk_planner, flat_planner)
        chunks = chunk_planner.create_local_plan().items
        self._chunk_keys = {(item.index.fqn, tuple(item.index.offset)) for item in chunks}

    def create_local_plan(self) -> SavePlan:
        return SavePlan([item for planner in self._planners for item in planner.create_local_plan().items])

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor | io.BytesIO:
        offset = tuple(write_item.index.offset) if write_item.index.offset is not None else None
        owner = self._planners[0] if (write_item.index.fqn, offset) in self._chunk_keys else self._planners[1]
        return owner.resolve_data(write_item)


def _common_update(optimizer: OptimizerSource, form: str,
                   target: list[tuple[ChainMember, int]]) -> Callable[[dict[str, Any]], None]:
    """The common state's ``optimizer`` entry and content metadata of ``form``, and the carried counters."""
    step = optimizer.group_step()

    def update(common: dict[str, Any]) -> None:
        adam: dict[str, Any] = {"param_state_sharding_type": form}
        if form == FULLY_RESHARDABLE:
            adam = {"optimizer": {"param_groups": [dict(settings, step=step) for settings in
                                                   optimizer.param_group_settings(count=target[1][1],
                                                                                  member=target[1][0])]}, **adam}
        muon = optimizer.param_group_settings(count=target[0][1], member=target[0][0])
        common["optimizer"] = {0: {"optimizer": {"param_groups": muon}}, 1: adam}
        carry_counters(optimizer, common)
        content = dict(common.get("content_metadata") or {}, distrib_optim_sharding_type=form,
                       chained_optim_avoid_prefix=True)
        if form == FULLY_RESHARDABLE:
            content["distrib_optim_fully_reshardable_mem_efficient"] = False
        else:
            content.pop("distrib_optim_fully_reshardable_mem_efficient", None)
        common["content_metadata"] = content
    return update


def write_layer_wise(optimizer: OptimizerSource, plan: LayerWisePlan, rows: int, fits_rows: set[str],
                     iteration_dir: Path, share: RecordsShare, form: str,
                     target: list[tuple[ChainMember, int]]) -> list[PlannedFile]:
    """Write ``plan``'s records beside the torch_dist saver's (``share``: which files) and, when shared, the common
    state's entry (``target``: the target's chained optimizers and their group counts); returns the files added."""
    planner = _Planner(OptimizerPlanner(plan.chunks, optimizer, rows, fits_rows),
                       FlatRecordsPlanner(plan.records, plan.objects, optimizer, rows))
    written = write_records(iteration_dir, planner, plan.numbers, share)
    if share.shared:
        rewrite_common(iteration_dir, _common_update(optimizer, form, target))
    return records_files(iteration_dir.name, plan.sizes(), plan.numbers, len(plan.objects), written)
