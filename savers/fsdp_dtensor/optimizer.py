"""The optimizer state written into an ``fsdp_dtensor`` destination, as Megatron-LM saves Megatron-FSDP's.

``DistributedOptimizer.sharded_param_state_fsdp_dtensor`` (megatron/core/optimizer/distrib_optimizer.py at d98e8a64)
hands over torch Adam's state by parameter name and each parameter's group hyperparameters; the layout is
``pgconvert/formats/fsdp_dtensor.py``'s (``loaders/fsdp_dtensor/optimizer.py`` reads it back):

- per model key (a gated fc1's ``_w``/``_v`` halves each), ``optimizer.state.<wrappers><parameter>.{exp_avg,
  exp_avg_sq}`` fp32 at the model key's global shape, one chunk as the model's, and ``.step`` (0-dim fp32, the
  common step); ``<wrappers>``: ``module.module.module.`` for a bf16/fp16 run, ``module.module.`` for fp32;
- per parameter (unsplit name) and field of its group's settings (``OptimizerSource.param_group_settings``, the
  groups ``pgconvert/optimizer/order.py`` builds), the bytes entry ``optimizer.param_to_group_meta.<wrappers>
  <parameter>.<field>``; the scheduler's ``opt_param_scheduler.<field>`` and ``num_floating_point_operations_so_far``.

The model entries are the optimizer's fp32 masters (the saver declares ``stores_masters``: the conversion reads the
model from them). The state chunks go to data files after the bytes entries' (``__0_<n>.distcp``); the bytes entries'
file and ``.metadata`` are written again with the optimizer's entries added.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from pgconvert.formats.dcp_save import StateReader, StoredChunk
from pgconvert.formats.fsdp_dtensor import (FLOPS_KEY, FP32_RUN_WRAPPERS, HALF_RUN_WRAPPERS, OPTIMIZER_GROUP_PREFIX,
                                            OPTIMIZER_STATE_PREFIX, SCHEDULER_PREFIX, STEP_FIELD, fsdp_slots,
                                            state_key)
from pgconvert.model.config import ModelConfig
from pgconvert.model.layout import ParallelLayout
from pgconvert.optimizer.order import OptimizerLayoutError
from pgconvert.optimizer.source import MOMENTS, OptimizerSource

# Each written entry's path in Megatron-LM's nested state dict, as its flattening save records it (planner_data).
Paths = dict[str, tuple[str, ...]]


def run_wrappers(run_dtype: torch.dtype) -> str:
    return FP32_RUN_WRAPPERS if run_dtype == torch.float32 else HALF_RUN_WRAPPERS


def state_chunks(optimizer: OptimizerSource, model_chunks: list[StoredChunk], wrappers: str) -> list[StoredChunk]:
    """Per parameter, its moments' chunks field by field (a gated fc1's halves one after the other: each field read
    once), then its step records; fp32."""
    names = set(optimizer.names())
    by_name: dict[str, list[StoredChunk]] = {}
    for chunk in model_chunks:
        if chunk.canonical in names:
            by_name.setdefault(chunk.canonical, []).append(chunk)
    chunks = []
    for name, members in by_name.items():
        for field in MOMENTS:
            chunks += [StoredChunk(name, state_key(wrappers, chunk.key, field), chunk.offsets, chunk.sizes,
                                   chunk.global_shape, torch.float32, chunk.row_start, chunk.rows, field)
                       for chunk in members]
        chunks += [StoredChunk(name, state_key(wrappers, chunk.key, STEP_FIELD), (), (), (), torch.float32,
                               field=STEP_FIELD) for chunk in members]
    return chunks


def state_reader(optimizer: OptimizerSource, rows: int) -> StateReader:
    """A parameter's whole moment (at the target's padded vocab ``rows``) or its step."""
    def read(name: str, field: str) -> torch.Tensor:
        if field == STEP_FIELD:
            return optimizer.step(name)
        return optimizer.piece(name, field, 1, 0, rows if optimizer.rule(name).fits_rows else None)
    return read


def state_paths(chunks: list[StoredChunk]) -> Paths:
    """``optimizer`` -> ``state`` -> parameter name -> field."""
    paths: Paths = {}
    for chunk in chunks:
        parameter, _, field = chunk.key[len(OPTIMIZER_STATE_PREFIX):].rpartition(".")
        paths[chunk.key] = ("optimizer", "state", parameter, field)
    return paths


def optimizer_entries(optimizer: OptimizerSource, config: ModelConfig, layout: ParallelLayout, rows: int,
                      wrappers: str, encode: Callable[[object], bytes]) -> tuple[dict[str, bytes], Paths]:
    """The bytes entries (``encode``: as ``dcp.save`` stores an object) and their paths: each parameter's group
    hyperparameters, the scheduler and the floating-point operations."""
    entries: dict[str, bytes] = {}
    paths: Paths = {}
    slots = fsdp_slots(config, layout, optimizer.rules, rows)
    settings = optimizer.param_group_settings(0, len(slots))
    if len(settings) != len(slots):
        raise OptimizerLayoutError(f"{optimizer.first.path}: {len(settings)} param groups; megatron-core builds "
                                   f"{len(slots)} for the destination's model")
    for group, members in zip(settings, slots):
        for slot in members:
            parameter = wrappers + slot.spec.local_name
            for field, value in group.items():
                key = f"{OPTIMIZER_GROUP_PREFIX}{parameter}.{field}"
                entries[key], paths[key] = encode(value), ("optimizer", "param_to_group_meta", parameter, field)
    extra: dict[str, Any] = optimizer.first.extra
    for field, value in (extra.get("opt_param_scheduler") or {}).items():
        key = SCHEDULER_PREFIX + field
        entries[key], paths[key] = encode(value), (SCHEDULER_PREFIX.rstrip("."), field)
    if extra.get(FLOPS_KEY) is not None:
        entries[FLOPS_KEY], paths[FLOPS_KEY] = encode(extra[FLOPS_KEY]), (FLOPS_KEY,)
    return entries, paths

