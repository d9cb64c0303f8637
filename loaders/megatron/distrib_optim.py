"""megatron-core's distributed optimizer state in per-rank checkpoints (``distrib_optim.pt``), read.

``DistributedOptimizer.save_parameter_state`` (``get_parameter_state_dp_zero``) gathers over the DP
group and writes ``{"buckets_coalesced": True, buffer_index: {(param_dtype, grad_dtype): {"param",
"exp_avg", "exp_avg_sq": fp32 flat tensors, "numel_unpadded": n}}}``: per model chunk's buffer, each
parameter's range as ``pgconvert.optimizer.flat.flat_buffers`` derives it (the padding after each bucket dropped),
so the file does not depend on the DP size. The rank file's ``optimizer`` holds only the param groups
(without ``params``, with ``step``): the same on every rank.

MoE at expert parallel size > 1: ``ChainedOptimizer.save_parameter_state`` writes a list, one
such dict per chained optimizer (dense, expert-parallel), None where the rank is not that optimizer's
DP rank 0; the rank file's entry is the list of their param-group entries.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from pgconvert.formats.megatron import DISTRIB_OPTIM_FILE, safe_torch_structure
from pgconvert.io.limits import quote
from pgconvert.model.config import ModelConfig
from pgconvert.model.grid import RankCoord
from pgconvert.model.layout import ParallelLayout
from pgconvert.optimizer.data_parallel import dp_size
from pgconvert.optimizer.flat import FLAT_KEYS, FlatParam, flat_buffers
from pgconvert.optimizer.order import MEGATRON_CORE_VERSIONS, OptimizerLayoutError, OptimizerRules


def _buffer_entry(loaded: dict[Any, Any], index: int, numel: int, path: Path) -> tuple[Any, dict[str, Any]]:
    """The one dtype entry of buffer ``index``, checked against the derived size."""
    entry = loaded.get(index)
    if not isinstance(entry, dict) or len(entry) != 1:
        count = len(entry) if isinstance(entry, dict) else "no"
        raise OptimizerLayoutError(f"{path}: buffer {index} holds {count} dtype entries; pgconvert reads one per "
                                   f"model chunk (megatron-core {' / '.join(MEGATRON_CORE_VERSIONS)})")
    ((dtype_key, tensors),) = entry.items()
    stored = tensors.get("numel_unpadded") if isinstance(tensors, dict) else None
    if type(stored) is not int or stored != numel:
        raise OptimizerLayoutError(
            f"{path}: buffer {index} {quote(dtype_key)}: numel_unpadded={quote(stored)}, but the model's parameters "
            f"on this rank fill {numel} elements (reverse parameter order, 64-element alignment, DDP buckets)")
    for key in FLAT_KEYS:
        value = tensors.get(key)
        if not isinstance(value, torch.Tensor) or tuple(value.shape) != (numel,):
            shape = tuple(value.shape) if isinstance(value, torch.Tensor) else quote(type(value).__name__)
            raise OptimizerLayoutError(f"{path}: buffer {index} {key} has shape {shape}; expected ({numel},)")
    return dtype_key, tensors


def _step_of(entry: Any, rank_file: Path, field: str) -> torch.Tensor:
    groups = entry.get("optimizer", {}).get("param_groups") if isinstance(entry, dict) else None
    held = isinstance(groups, list) and all(isinstance(group, dict) for group in groups)
    steps = [group.get("step") for group in groups] if held else []
    if not steps or not all(isinstance(step, (int, float)) for step in steps) or len(set(steps)) != 1:
        raise OptimizerLayoutError(f"{rank_file}: {field}.optimizer.param_groups[*].step = "
                                   f"{quote(steps if held else groups)}: expected one step count")
    return torch.tensor(float(steps[0]))


def read_distributed(config: ModelConfig, layout: ParallelLayout, coord: RankCoord, rules: OptimizerRules,
                     padded: int, state: dict[str, Any], rank_file: Path,
                     entries: list[Any]) -> list[tuple[dict[str, Any], dict[int, torch.Tensor]] | None]:
    """Per chained optimizer (``entries``: the rank file's entry of each), an ``{"state": position ->
    {step, exp_avg, exp_avg_sq}, "param_groups", "dtype_key", "dtype_keys" (each buffer's)}`` view of its flat
    buffers and its fp32 masters by position: views of the buffers left in the file (meta tensors that know where
    their bytes are, ``safe_torch_structure``; read with ``io.torch_input.StoredTensors``), nothing mapped or read
    yet; None for an optimizer whose state this
    rank's file does not hold (``ChainedOptimizer.save_parameter_state`` writes None where the rank is not
    that optimizer's DP rank 0: the dense state of expert-parallel ranks other than 0)."""
    path = rank_file.parent / DISTRIB_OPTIM_FILE
    loaded = safe_torch_structure(path, list_ok=len(entries) > 1)
    if len(entries) > 1 and (not isinstance(loaded, list) or len(loaded) != len(entries)):
        raise OptimizerLayoutError(f"{path}: holds {quote(type(loaded).__name__)}; the chained optimizers save "
                                   f"a list of {len(entries)} states (dense, expert-parallel)")
    contents = loaded if len(entries) > 1 else [loaded]
    args = state.get("args")
    views: list[tuple[dict[str, Any], dict[int, torch.Tensor]] | None] = []
    for index, (content, entry) in enumerate(zip(contents, entries)):
        field = "optimizer" if len(entries) == 1 else f"optimizer[{index}]"
        if content is None and len(entries) > 1:
            views.append(None)
            continue
        where = path if len(entries) == 1 else Path(f"{path}[{index}]")
        buffers = flat_buffers(config, layout, coord, rules, padded, args, dp_size(args), index)
        views.append(_read_buffers(content, buffers, _step_of(entry, rank_file, field), entry, where))
    if views[0] is None and coord.ep == 0:
        raise OptimizerLayoutError(f"{path}: the dense optimizer's state is None on expert-parallel rank 0, "
                                   "which writes it (its data-parallel rank 0)")
    return views


def _read_buffers(loaded: Any, buffers: list[tuple[list[FlatParam], int]], step: torch.Tensor, entry: dict[str, Any],
                  path: Path) -> tuple[dict[str, Any], dict[int, torch.Tensor]]:
    if not isinstance(loaded, dict) or loaded.get("buckets_coalesced") is not True:
        held = loaded.get("buckets_coalesced") if isinstance(loaded, dict) else type(loaded).__name__
        raise OptimizerLayoutError(f"{path}: buckets_coalesced={quote(held)}: only the "
                                   "coalesced form (megatron-core >= 0.8) is read")
    buffer_keys = [key for key in loaded if key != "buckets_coalesced"]
    if any(type(key) is not int for key in buffer_keys) or sorted(buffer_keys) != list(range(len(buffers))):
        raise OptimizerLayoutError(f"{path}: buffers {quote(sorted(map(str, loaded)))}; the layout has "
                                   f"{len(buffers)} model chunks with these parameters")
    entries: dict[int, dict[str, Any]] = {}
    masters: dict[int, torch.Tensor] = {}
    dtype_key: Any = None
    dtype_keys: list[Any] = []
    for index, (placed, numel) in enumerate(buffers):
        dtype_key, tensors = _buffer_entry(loaded, index, numel, path)
        dtype_keys.append(dtype_key)
        for item in placed:
            shape = item.slot.spec.local_shape
            views = {key: tensors[key][item.start:item.end].view(shape) for key in FLAT_KEYS}
            masters[item.slot.position] = views.pop("param")
            entries[item.slot.position] = dict(views, step=step)
    groups = entry["optimizer"]["param_groups"]
    settings = [{k: v for k, v in group.items() if k != "step"} for group in groups]
    return {"state": entries, "param_groups": settings, "dtype_key": dtype_key, "dtype_keys": dtype_keys}, masters
