"""megatron-core's distributed optimizer state in per-rank checkpoints (``distrib_optim.pt``).

``DistributedOptimizer.save_parameter_state`` (``get_parameter_state_dp_zero``) gathers over the DP
group and writes ``{"buckets_coalesced": True, buffer_index: {(param_dtype, grad_dtype): {"param",
"exp_avg", "exp_avg_sq": fp32 flat tensors, "numel_unpadded": n}}}``: per model chunk's buffer, each
parameter's range as ``optimizer_map.flat_buffers`` derives it (the padding after each bucket dropped),
so the file does not depend on the DP size. The rank file's ``optimizer`` holds only the param groups
(without ``params``, with ``step``): the same on every rank and carried as it is.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch

from pgconvert.config import ModelConfig
from pgconvert.grid import RankCoord
from pgconvert.layout import ParallelLayout
from pgconvert.limits import quote
from pgconvert.megatron_format import safe_torch_load
from pgconvert.optimizer_map import (MEGATRON_CORE_VERSIONS, FlatParam, OptimizerLayoutError, OptimizerRules,
                                     flat_buffers)
from pgconvert.torchzip import PlannedTensor

DISTRIB_OPTIM_FILE = "distrib_optim.pt"
FLAT_KEYS = ("param", "exp_avg", "exp_avg_sq")


def dp_size(args: argparse.Namespace | None) -> int:
    return int(getattr(args, "data_parallel_size", None) or 1)


def _buffer_entry(loaded: dict[Any, Any], index: int, numel: int, path: Path) -> tuple[Any, dict[str, Any]]:
    """The one dtype entry of buffer ``index``, checked against the derived size."""
    entry = loaded.get(index)
    if not isinstance(entry, dict) or len(entry) != 1:
        count = len(entry) if isinstance(entry, dict) else "no"
        raise OptimizerLayoutError(f"{path}: buffer {index} holds {count} dtype entries; pgconvert reads one per "
                                   f"model chunk (megatron-core {' / '.join(MEGATRON_CORE_VERSIONS)})")
    ((dtype_key, tensors),) = entry.items()
    stored = tensors.get("numel_unpadded") if isinstance(tensors, dict) else None
    if stored != numel:
        raise OptimizerLayoutError(
            f"{path}: buffer {index} {quote(dtype_key)}: numel_unpadded={quote(stored)}, but the model's parameters "
            f"on this rank fill {numel} elements (reverse parameter order, 64-element alignment)")
    for key in FLAT_KEYS:
        value = tensors.get(key)
        if not isinstance(value, torch.Tensor) or tuple(value.shape) != (numel,):
            shape = tuple(value.shape) if isinstance(value, torch.Tensor) else quote(type(value).__name__)
            raise OptimizerLayoutError(f"{path}: buffer {index} {key} has shape {shape}; expected ({numel},)")
    return dtype_key, tensors


def read_distributed(config: ModelConfig, layout: ParallelLayout, coord: RankCoord, rules: OptimizerRules,
                     padded: int, state: dict[str, Any], rank_file: Path) -> tuple[dict[str, Any], list[torch.Tensor]]:
    """An ``{"state": position -> {step, exp_avg, exp_avg_sq}}`` view of the rank's flat buffers, and the
    fp32 masters in position order (views into the memory-mapped file)."""
    path = rank_file.parent / DISTRIB_OPTIM_FILE
    loaded = safe_torch_load(path)
    if loaded.get("buckets_coalesced") is not True:
        raise OptimizerLayoutError(f"{path}: buckets_coalesced={quote(loaded.get('buckets_coalesced'))}: only the "
                                   "coalesced form (megatron-core >= 0.8) is read")
    args = state.get("args")
    buffers = flat_buffers(config, layout, coord, rules, padded, args, dp_size(args))
    if sorted(k for k in loaded if k != "buckets_coalesced") != list(range(len(buffers))):
        raise OptimizerLayoutError(f"{path}: buffers {quote(sorted(map(str, loaded)))}; the layout has "
                                   f"{len(buffers)} model chunks")
    groups = state["optimizer"]["optimizer"].get("param_groups")
    steps = {group.get("step") for group in groups} if isinstance(groups, list) else set()
    if len(steps) != 1 or not isinstance(next(iter(steps)), (int, float)):
        raise OptimizerLayoutError(f"{rank_file}: optimizer.optimizer.param_groups[*].step = {quote(sorted(map(str, steps)))}: "
                                   "expected one step count")
    step = torch.tensor(float(next(iter(steps))))
    entries: dict[int, dict[str, Any]] = {}
    masters: dict[int, torch.Tensor] = {}
    for index, (placed, numel) in enumerate(buffers):
        dtype_key, tensors = _buffer_entry(loaded, index, numel, path)
        for item in placed:
            shape = item.slot.spec.local_shape
            views = {key: tensors[key][item.start:item.end].view(shape) for key in FLAT_KEYS}
            masters[item.slot.position] = views.pop("param")
            entries[item.slot.position] = dict(views, step=step)
    settings = [{k: v for k, v in group.items() if k != "step"} for group in groups]
    return {"state": entries, "param_groups": settings, "dtype_key": dtype_key}, [masters[position] for position in sorted(masters)]


def planned_buffers(placed: list[FlatParam], numel: int,
                    piece: Any) -> dict[str, PlannedTensor | int]:
    """One buffer's flat tensors, each built when written: zeros with every parameter's piece
    (``piece(slot, key)``) at its range."""
    def producer(key: str) -> Any:
        def produce() -> torch.Tensor:
            flat = torch.zeros(numel, dtype=torch.float32)
            for item in placed:
                flat[item.start:item.end] = piece(item.slot, key).reshape(-1)
            return flat
        return produce

    tensors: dict[str, PlannedTensor | int] = {key: PlannedTensor((numel,), torch.float32, producer(key))
                                               for key in FLAT_KEYS}
    tensors["numel_unpadded"] = numel
    return tensors
