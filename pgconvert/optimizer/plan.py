"""optcli: what ``--dry-run`` shows of the optimizer state a conversion carries, per destination file.

The same decision as ``convert`` (``optimizer_reshard.carried_optimizer``: carried, or a notice, refused under
--strict) and the same layout derivations as the writers, without writing:

- Megatron per-rank, plain optimizer: each rank file's ``optimizer`` entry: per parameter ``exp_avg``,
  ``exp_avg_sq`` and ``step`` (and its fp32 master in the float16 form), fp32;
- Megatron per-rank, distributed optimizer: each rank's ``distrib_optim.pt``, per model chunk's buffer the
  flat ``param``, ``exp_avg`` and ``exp_avg_sq`` (``optimizer_map.flat_buffers``);
- torch_dist: the records file ``__1_0.distcp`` (``fully_reshardable``: three fp32 records per model
  chunk; ``dp_reshardable``: the DP-sharded bucket chunks and the per-rank objects).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from pgconvert.model.grid import RankCoord, iter_ranks
from pgconvert.formats.megatron import RANK_FILE, args_for_target, iteration_dir_name, rank_dir_name
from pgconvert.optimizer.flat import DISTRIB_OPTIM_FILE, FLAT_KEYS, dp_size
from pgconvert.optimizer.order import chained_slots, flat_buffers, optimizer_count
from pgconvert.optimizer.state import FORM_DISTRIBUTED, FORM_FP16, OptimizerSource

FP32 = 4  # bytes per element: every optimizer tensor pgconvert writes is fp32


@dataclass(frozen=True)
class OptimizerFile:
    """The optimizer state one destination file will hold."""

    relpath: str
    what: str
    tensors: int
    nbytes: int


def plan_optimizer(conversion: Any) -> tuple[list[OptimizerFile], list[str]]:
    """The destination files' optimizer state and the notices (what is not carried, and why)."""
    from pgconvert.optimizer.reshard import carried_optimizer, target_of
    from pgconvert.optimizer.torch_dist_dp import default_form

    notices: list[str] = []
    optimizer = carried_optimizer(conversion, notices)
    if optimizer is None:
        return [], notices
    config, rows = target_of(conversion)
    request, source = conversion.request, conversion.source
    directory = iteration_dir_name(source.iteration or 0, source.release)
    if conversion.dst_format == "torch_dist":
        form = default_form(getattr(request, "dst_optim_form", None), optimizer)
        return [_torch_dist_file(conversion, optimizer, config, rows, form, directory)], notices
    layout = conversion.save_options.layout
    files = []
    for coord in iter_ranks(layout):
        rank_dir = f"{directory}/{rank_dir_name(coord.tp, coord.pp, coord.ep, layout.pp, layout.ep)}"
        if optimizer.form == FORM_DISTRIBUTED:
            files.append(_distrib_optim_file(optimizer, config, layout, coord, rows, request.dst_dp, rank_dir))
        else:
            files.append(_rank_entry(optimizer, config, layout, coord, rows, f"{rank_dir}/{RANK_FILE}"))
    return files, notices


def _rank_entry(optimizer: OptimizerSource, config: Any, layout: Any, coord: RankCoord, rows: int,
                relpath: str) -> OptimizerFile:
    """A rank file's plain optimizer entry: per parameter both moments and the step (and the fp32 master)."""
    per_param = 3 if optimizer.form == FORM_FP16 else 2
    slots = [slot for groups in chained_slots(config, layout, coord, optimizer.rules, rows)
             for group in groups for slot in group]
    numel = sum(_numel(slot.spec.local_shape) for slot in slots)
    step_bytes = sum(optimizer.step(slot.spec.canonical).element_size() for slot in slots)
    return OptimizerFile(relpath, f"optimizer entry ({optimizer.form})", (per_param + 1) * len(slots),
                         per_param * FP32 * numel + step_bytes)


def _distrib_optim_file(optimizer: OptimizerSource, config: Any, layout: Any, coord: RankCoord, rows: int,
                        dst_dp: int | None, rank_dir: str) -> OptimizerFile:
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
            nbytes += len(FLAT_KEYS) * FP32 * numel
    return OptimizerFile(f"{rank_dir}/{DISTRIB_OPTIM_FILE}", f"flat buffers ({optimizer.form})", tensors, nbytes)


def _torch_dist_file(conversion: Any, optimizer: OptimizerSource, config: Any, rows: int, form: str,
                     directory: str) -> OptimizerFile:
    """The torch_dist records file, in ``form``."""
    from pgconvert.optimizer.torch_dist_dp import DP_RESHARDABLE, _plan
    from pgconvert.optimizer.torch_dist_plain import PLAIN, plain_chunks
    from pgconvert.optimizer.torch_dist_save import RECORDS_FILE, optimizer_chunks

    what = f"optimizer records ({optimizer.form}, {form}; common.pt and .metadata updated)"
    layout = conversion.save_options.layout
    if form == PLAIN:  # tdplain
        model_chunks = conversion.saver._chunks(conversion.source, conversion.save_options)[0]
        chunks = plain_chunks(optimizer.form, set(optimizer.names()), model_chunks)
        return OptimizerFile(f"{directory}/{RECORDS_FILE}", what, len(chunks), sum(chunk.nbytes for _, chunk in chunks))
    if form != DP_RESHARDABLE:
        chunks = optimizer_chunks(optimizer, conversion.saver._chunks(conversion.source, conversion.save_options)[0])
        return OptimizerFile(f"{directory}/{RECORDS_FILE}", what, len(chunks),
                             sum(chunk.nbytes for _, chunk in chunks))
    args = args_for_target(config, layout, rows, torch.float32, 0, conversion.source.megatron_args)
    dp = conversion.request.dst_dp or dp_size(args)
    records, objects = _plan(optimizer, config, layout, rows, dp, args)
    return OptimizerFile(f"{directory}/{RECORDS_FILE}", what, len(records) + len(objects),
                         sum(FP32 * (record.end - record.start) for record in records))


def _numel(shape: Any) -> int:
    total = 1
    for size in shape:
        total *= int(size)
    return total


def plan_lines(conversion: Any) -> list[str]:
    """``--dry-run``'s optimizer lines: each destination file's optimizer state and a total, or the notices of
    state that is not carried (nothing when the conversion has no optimizer state to carry)."""
    files, notices = plan_optimizer(conversion)
    lines = [f"  {item.relpath}  + {item.what}  {item.tensors} tensors  {item.nbytes} bytes" for item in files]
    if files:
        lines.append(f"optimizer: {len(files)} files, {sum(item.tensors for item in files)} tensors, "
                     f"{sum(item.nbytes for item in files)} bytes")
    return lines + [f"optimizer: {notice}" for notice in notices]
