"""megatron-core's optimizer state written into Megatron per-rank destination files, with the model.

Each rank file (``model_optim_rng.pt``) the saver writes holds its ``optimizer`` entry and the carried counters
(``training_state``), in the source's form:

- plain (FP32Optimizer, Float16OptimizerWithFloat16Params): the ``optimizer.state_dict()`` of the rank (a plain
  Muon run's the list of its Muon and Adam optimizers', Muon's state a ``momentum_buffer`` without step), each
  state tensor cut with its parameter's ShardRule (``OptimizerSource.piece``) and produced only when the file
  writer reaches it, so memory holds one tensor, not the rank's state;
- distributed: the param groups (with ``step``) in the rank file, the state in ``distrib_optim.pt`` beside it:
  each model chunk's coalesced flat buffers (``pgconvert.optimizer.flat``), one per chained optimizer.

Carried: scheduler state, iteration, ``num_floating_point_operations_so_far``, the grad scaler, and the
consumed-samples counters (in ``args``). Not carried: RNG state (it depends on the rank count).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from pgconvert.formats import OptimizerFile, OptimizerInModelFiles, PlannedFile
from pgconvert.formats.megatron import DISTRIB_OPTIM_FILE, RANK_FILE, rank_dir_name
from pgconvert.io.torchzip import PlannedTensor
from pgconvert.model.config import ModelConfig
from pgconvert.model.grid import RankCoord, iter_ranks
from pgconvert.model.layout import ParallelLayout
from pgconvert.optimizer.data_parallel import dp_size, with_dst_dp
from pgconvert.optimizer.flat import FLAT_KEYS, flat_buffers, planned_buffers
from pgconvert.optimizer.order import ChainMember, OptimizerSlot, chain, chained_slots, optimizer_count
from pgconvert.optimizer.scaler import set_scalers, target_scalers
from pgconvert.optimizer.source import (CARRIED_KEYS, FORM_DISTRIBUTED, FORM_FP16, FP32_BYTES,
                                        OptimizerSource)

log = logging.getLogger(__name__)

Save = Callable[[dict[str, Any], Path], str | None]


def _planned(source: OptimizerSource, slot: OptimizerSlot, key: str, rows: int | None) -> PlannedTensor:
    spec = slot.spec
    dtype = torch.float32

    def produce() -> torch.Tensor:
        return source.piece(spec.canonical, key, spec.tp_size, spec.tp_rank, rows, spec.rule).to(dtype).contiguous()

    return PlannedTensor(tuple(spec.local_shape), dtype, produce)


def rank_optimizer(source: OptimizerSource, config: ModelConfig, layout: ParallelLayout, coord: RankCoord,
                   padded_rows: int) -> dict[str, Any] | list[dict[str, Any]]:
    """The ``optimizer`` entry of rank ``coord`` at ``layout``, in the source's form: one optimizer's, or
    the list of the chained dense and expert-parallel optimizers' (MoE at expert parallel size > 1)."""
    chained = chained_slots(config, layout, coord, source.rules, padded_rows)
    scalers = target_scalers(source, len(chained))
    members = chain(config, layout, source.rules)
    entries = [_one_optimizer(source, slots, members[index], padded_rows, scalers[index])
               for index, slots in enumerate(chained)]
    return entries[0] if len(entries) == 1 else entries


def _one_optimizer(source: OptimizerSource, slots: list[list[OptimizerSlot]], member: ChainMember,
                   padded_rows: int, scaler: Any = None) -> dict[str, Any]:
    settings = source.param_group_settings(count=len(slots), member=member)
    state: dict[int, dict[str, Any]] = {}
    fields = member.state_fields
    for slot in (slot for group in slots for slot in group):
        rows = padded_rows if slot.spec.rule.fits_rows else None
        entry: dict[str, Any] = {"step": source.step(slot.spec.canonical)} if member.stepped else {}
        entry.update({key: _planned(source, slot, key, rows) for key in fields})
        state[slot.position] = entry
    groups = [dict(settings[number], params=[slot.position for slot in members])
              for number, members in enumerate(slots)]
    inner = {"state": state, "param_groups": groups}
    if source.form != FORM_FP16:
        return inner
    masters = [[_planned(source, slot, "param", padded_rows if slot.spec.rule.fits_rows else None)
                for slot in members] for members in slots]
    optimizer: dict[str, Any] = {"optimizer": inner, "fp32_from_fp16_params": masters}
    if scaler is not None:
        optimizer["grad_scaler"] = scaler
    return optimizer


def _distributed_entries(source: OptimizerSource, members: tuple[ChainMember, ...], groups: list[int]) -> Any:
    """The rank file's entry of a distributed optimizer (param groups with their step, no params), per
    chained optimizer (``members``): the source's own, or its dense one with ``is_expert_parallel`` set."""
    held = source.first.extra["distributed_entries"]
    entries = []
    count = len(members)
    for index, member in enumerate(members):
        entry = dict(held[min(index, len(held) - 1)])
        step = entry["optimizer"]["param_groups"][0].get("step")
        settings = source.param_group_settings(count=groups[index], member=member)
        entry["optimizer"] = dict(entry["optimizer"], param_groups=[dict(group, step=step) for group in settings])
        entries.append(entry)
    set_scalers(entries, target_scalers(source, count))
    return entries[0] if count == 1 else entries


def _write_distributed(source: OptimizerSource, config: ModelConfig, layout: ParallelLayout, coord: RankCoord,
                       padded_rows: int, rank_dir: Path, save: Save, dp: int | None = None) -> str | None:
    """``distrib_optim.pt`` of rank ``coord``: each model chunk's coalesced flat buffers, under the source's
    dtype key, every parameter's piece cut with its rule (built when written); per chained optimizer, None
    for the dense one on expert-parallel ranks other than 0 (not its DP rank 0, as megatron-core saves).
    Returns the digest of the file written."""
    args = source.first.extra.get("args")

    def piece(slot: OptimizerSlot, key: str) -> torch.Tensor:
        rows = padded_rows if slot.spec.rule.fits_rows else None
        return source.piece(slot.spec.canonical, key, slot.spec.tp_size, slot.spec.tp_rank, rows, slot.spec.rule)

    count = optimizer_count(config, layout)
    contents: list[Any] = []
    for index in range(count):
        if index == 0 and count > 1 and coord.ep > 0:
            contents.append(None)
            continue
        buffers = flat_buffers(config, layout, coord, source.rules, padded_rows, args, dp or dp_size(args), index)
        content: dict[Any, Any] = {"buckets_coalesced": True}
        for number, (placed, numel) in enumerate(buffers):
            content[number] = {source.dtype_key: planned_buffers(placed, numel, piece)}
        contents.append(content)
    return save(contents[0] if count == 1 else contents, rank_dir / DISTRIB_OPTIM_FILE)  # type: ignore[arg-type]


# What a rank file holds besides its model, and what writes the files beside it (returning them as written).
RankTrainingState = tuple[dict[str, Any], Callable[[], list[PlannedFile]]]


def training_state(carried: OptimizerInModelFiles, config: ModelConfig, layout: ParallelLayout, coord: RankCoord,
                   padded_rows: int, rank_file: str, rank_dir: Path, args: Any, save: Save) -> RankTrainingState:
    """What rank ``coord``'s file holds besides its model, in the carried state's form: the ``optimizer`` entry, the
    carried counters and ``args`` sized for ``--dst-dp``; and what writes the files beside it once it is written
    (the distributed form's ``distrib_optim.pt`` into ``rank_dir``), returning them as written (``rank_file``: the
    rank file's path relative to the output root)."""
    source, dst_dp = carried.optimizer, carried.options.dp
    entries: dict[str, Any] = {}
    beside: Callable[[], list[PlannedFile]] = list  # nothing beside a plain optimizer's rank file

    def write_distrib_optim() -> list[PlannedFile]:
        digest = _write_distributed(source, config, layout, coord, padded_rows, rank_dir, save, dst_dp)
        return [_written(rank_file, DISTRIB_OPTIM_FILE, rank_dir, digest)]

    if source.form == FORM_DISTRIBUTED:
        groups = [len(slots) for slots in chained_slots(config, layout, coord, source.rules, padded_rows)]
        entries["optimizer"] = _distributed_entries(source, chain(config, layout, source.rules), groups)
        beside = write_distrib_optim
    else:
        entries["optimizer"] = rank_optimizer(source, config, layout, coord, padded_rows)
    for key in CARRIED_KEYS:
        if key in source.first.extra:
            entries[key] = source.first.extra[key]
    if dst_dp is not None:
        entries["args"] = with_dst_dp(args, layout, dst_dp)
    log.info("%s: optimizer state carried", rank_file)
    return entries, beside


def _written(rank_file: str, name: str, rank_dir: Path, digest: str | None) -> PlannedFile:
    """File ``name`` of the rank directory of ``rank_file`` (a path relative to the output root) as written: its
    size on disk and the digest computed as it was written."""
    relpath = f"{rank_file.rpartition('/')[0]}/{name}"
    size = (rank_dir / name).stat().st_size
    return PlannedFile(relpath, 0, size, digest=digest, size=size)


def planned_optimizer_files(optimizer: OptimizerSource, config: ModelConfig, layout: ParallelLayout, rows: int,
                            dst_dp: int | None, directory: str) -> list[OptimizerFile]:
    """``--dry-run``'s optimizer files: per rank its ``distrib_optim.pt`` (distributed) or its rank file's
    optimizer entry (plain)."""
    files = []
    for coord in iter_ranks(layout):
        rank_dir = f"{directory}/{rank_dir_name(coord.tp, coord.pp, coord.ep, layout.pp, layout.ep)}"
        if optimizer.form == FORM_DISTRIBUTED:
            planned = _distrib_optim_file(optimizer, config, layout, coord, rows, dst_dp, rank_dir)
        else:
            planned = _rank_entry(optimizer, config, layout, coord, rows, f"{rank_dir}/{RANK_FILE}")
        files.append(dataclasses.replace(planned, written_with=f"{rank_dir}/{RANK_FILE}"))  # by the rank's process
    return files


def _rank_entry(optimizer: OptimizerSource, config: ModelConfig, layout: ParallelLayout, coord: RankCoord,
                rows: int, relpath: str) -> OptimizerFile:
    """A rank file's plain optimizer entry: per parameter its state (both moments and the step, or Muon's momentum
    buffer) and the fp32 master (Float16OptimizerWithFloat16Params)."""
    tensors = nbytes = 0
    chained = chained_slots(config, layout, coord, optimizer.rules, rows)
    for slot in (slot for groups in chained for group in groups for slot in group):
        per_param = len(slot.member.state_fields) + (optimizer.form == FORM_FP16)  # and the master
        numel = math.prod(int(size) for size in slot.spec.local_shape)
        step_bytes = optimizer.step(slot.spec.canonical).element_size() if slot.member.stepped else 0
        tensors += per_param + (step_bytes > 0)
        nbytes += per_param * FP32_BYTES * numel + step_bytes
    return OptimizerFile(relpath, f"optimizer entry ({optimizer.form})", tensors, nbytes)


def _distrib_optim_file(optimizer: OptimizerSource, config: ModelConfig, layout: ParallelLayout, coord: RankCoord,
                        rows: int, dst_dp: int | None, rank_dir: str) -> OptimizerFile:
    """A rank's ``distrib_optim.pt``: per chained optimizer it saves, per buffer, the three flat fields."""
    args = optimizer.first.extra.get("args")
    count = optimizer_count(config, layout)
    tensors = nbytes = 0
    for index in range(count):
        if index == 0 and count > 1 and coord.ep > 0:
            continue  # the dense optimizer's state is saved by expert-parallel rank 0 only
        for _, numel in flat_buffers(config, layout, coord, optimizer.rules, rows, args, dst_dp or dp_size(args),
                                     index):
            tensors += len(FLAT_KEYS)
            nbytes += len(FLAT_KEYS) * FP32_BYTES * numel
    return OptimizerFile(f"{rank_dir}/{DISTRIB_OPTIM_FILE}", f"flat buffers ({optimizer.form})", tensors, nbytes)
