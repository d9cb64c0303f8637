"""Optimizer state written out: the layout-independent per-parameter form, and megatron-core's plain
optimizer per rank of a new TP/PP/VPP layout (``carry_optimizer``, run by ``convert`` after the model).

Per-parameter form (``export_parameters``): one ``<canonical name>.pt`` per parameter holding
``param`` (fp32 master), ``exp_avg``, ``exp_avg_sq`` and ``step``, written one parameter at a time,
and ``optimizer.json`` (form, groups' hyperparameters, each parameter's group, scheduler, iteration,
floating-point operations, consumed samples). Vocab tables keep the source's padded rows.

Per rank: each state tensor is cut with its parameter's ShardRule (``OptimizerSource.piece``) and
produced only when the file writer reaches it, so memory holds one tensor, not the rank's state.
Carried: scheduler state, iteration, ``num_floating_point_operations_so_far``, the grad scaler, and
the consumed-samples counters (in ``args``). Not carried: RNG state (it depends on the rank count).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from pgconvert.model.config import ModelConfig
from pgconvert.formats import PlannedFile
from pgconvert.model.grid import RankCoord, iter_ranks
from pgconvert.model.layout import ParallelLayout
from pgconvert.formats.megatron import RANK_FILE, rank_dir_name, safe_torch_load
from pgconvert.optimizer.order import (MEGATRON_CORE_VERSIONS, OptimizerLayoutError, OptimizerSlot, chained_slots,
                                     flat_buffers, optimizer_count)
from pgconvert.optimizer.dp import check_dst_dp, with_dst_dp
from pgconvert.optimizer.flat import DISTRIB_OPTIM_FILE, dp_size, planned_buffers
from pgconvert.optimizer.scaler import lost_scaler, set_scalers, target_scalers
from pgconvert.optimizer.state import CARRIED_KEYS, FORM_DISTRIBUTED, FORM_FP16, MOMENTS, OptimizerSource
from pgconvert.optimizer.torch_dist_dp import check_form, default_form
from pgconvert.optimizer.torch_dist_moe import moe_refusal
from pgconvert.optimizer.torch_dist_plain import PLAIN, plain_refusal
from pgconvert.io.torchzip import PlannedTensor

log = logging.getLogger(__name__)

RNG_NOTICE = ("RNG state is not carried (it depends on the rank count): resume with --no-load-rng")
SAVER_NOTICE_PREFIX = "optimizer, scheduler and RNG state are not carried"
COUNTERS = ("consumed_train_samples", "consumed_valid_samples", "skipped_train_samples")


def _safe_name(name: str) -> str:
    return name.replace("/", "_")


def export_parameters(source: OptimizerSource, out_dir: Path) -> int:
    """Write the per-parameter form into ``out_dir`` (created); returns the parameter count."""
    out_dir.mkdir(parents=True, exist_ok=True)
    groups: dict[str, int] = {}
    shapes: dict[str, list[int]] = {}
    for name in source.names():
        tensors = source.parameter(name)
        torch.save(tensors, out_dir / f"{_safe_name(name)}.pt")
        groups[name] = source.group_of(name)
        shapes[name] = list(tensors["param"].shape)
        del tensors
    extra = source.first.extra
    args = extra.get("args")
    index = {
        "format": "pgconvert per-parameter optimizer state v1",
        "megatron_core_versions": list(MEGATRON_CORE_VERSIONS),
        "form": source.form,
        "iteration": extra.get("iteration"),
        "num_floating_point_operations_so_far": extra.get("num_floating_point_operations_so_far"),
        "opt_param_scheduler": extra.get("opt_param_scheduler"),
        "counters": {key: getattr(args, key, None) for key in COUNTERS},
        "param_groups": source.param_group_settings(),
        "parameters": {name: {"group": groups[name], "shape": shapes[name], "file": f"{_safe_name(name)}.pt"}
                       for name in groups},
        "padded_vocab_rows": source.vocab_rows,
        "not_carried": ["rng_state"],
    }
    (out_dir / "optimizer.json").write_text(json.dumps(index, indent=1, default=str) + "\n")
    return len(groups)


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
    scalers = target_scalers(source, len(chained))  # optcli
    entries = [_one_optimizer(source, slots, index, padded_rows, scalers[index]) for index, slots in enumerate(chained)]
    return entries[0] if len(entries) == 1 else entries


def _one_optimizer(source: OptimizerSource, slots: list[list[OptimizerSlot]], index: int,
                   padded_rows: int, scaler: Any = None) -> dict[str, Any]:
    settings = source.param_group_settings(index, len(slots))
    state: dict[int, dict[str, Any]] = {}
    for slot in (slot for group in slots for slot in group):
        rows = padded_rows if slot.spec.rule.fits_rows else None
        entry: dict[str, Any] = {"step": source.step(slot.spec.canonical)}
        entry.update({key: _planned(source, slot, key, rows) for key in MOMENTS})
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


def _distributed_entries(source: OptimizerSource, count: int, groups: list[int]) -> Any:
    """The rank file's entry of a distributed optimizer (param groups with their step, no params), per
    chained optimizer: the source's own, or its dense one with ``is_expert_parallel`` set."""
    held = source.first.extra["distributed_entries"]
    entries = []
    for index in range(count):
        entry = dict(held[min(index, len(held) - 1)])
        step = entry["optimizer"]["param_groups"][0].get("step")
        settings = source.param_group_settings(index, groups[index])
        entry["optimizer"] = dict(entry["optimizer"], param_groups=[dict(group, step=step) for group in settings])
        entries.append(entry)
    set_scalers(entries, target_scalers(source, count))  # optcli: torch_dist sources' too
    return entries[0] if count == 1 else entries


def _write_distributed(source: OptimizerSource, config: ModelConfig, layout: ParallelLayout, coord: RankCoord,
                       padded_rows: int, rank_dir: Path, save: Callable[[dict[str, Any], Path], str],
                       dp: int | None = None) -> Any:
    """``distrib_optim.pt`` of rank ``coord``: each model chunk's coalesced flat buffers, under the source's
    dtype key, every parameter's piece cut with its rule (built when written); per chained optimizer, None
    for the dense one on expert-parallel ranks other than 0 (not its DP rank 0, as megatron-core saves).
    Returns the rank file's optimizer entry."""
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
    save(contents[0] if count == 1 else contents, rank_dir / DISTRIB_OPTIM_FILE)  # type: ignore[arg-type]
    groups = [len(slots) for slots in chained_slots(config, layout, coord, source.rules, padded_rows)]
    return _distributed_entries(source, count, groups)


def carry_optimizer(source: OptimizerSource, config: ModelConfig, layout: ParallelLayout, iteration_dir: Path,
                    padded_rows: int, save: Callable[[dict[str, Any], Path], str],
                    dst_dp: int | None = None) -> list[PlannedFile]:
    """Add the optimizer and the carried counters to every rank file under ``iteration_dir`` (written by
    the model saver), rewriting each through ``save``; returns the rewritten files (sha256 filled).
    ``dst_dp``: the data-parallel size recorded in ``args`` (``optimizer_dp``)."""
    rewritten = []
    for coord in iter_ranks(layout):
        relpath = f"{rank_dir_name(coord.tp, coord.pp, coord.ep, layout.pp, layout.ep)}/{RANK_FILE}"
        path = iteration_dir / relpath
        state = dict(safe_torch_load(path))
        if source.form == FORM_DISTRIBUTED:
            state["optimizer"] = _write_distributed(source, config, layout, coord, padded_rows, path.parent, save,
                                                    dst_dp)
        else:
            state["optimizer"] = rank_optimizer(source, config, layout, coord, padded_rows)
        for key in CARRIED_KEYS:
            if key in source.first.extra:
                state[key] = source.first.extra[key]
        if dst_dp is not None:
            state["args"] = with_dst_dp(state.get("args"), layout, dst_dp)
        partial = path.with_name(path.name + ".optim")
        save(state, partial)
        del state
        os.replace(partial, path)
        rewritten.append(PlannedFile(f"{iteration_dir.name}/{relpath}", 0, 0, sha256=None))
        log.info("%s: optimizer state carried", path)
    return rewritten


def _not_carried(conversion: Any) -> str | None:
    """Why the optimizer state of this conversion is not carried (None: it is)."""
    request = conversion.request
    if request.dtype != "keep":
        return (f"--dtype {request.dtype}: optimizer state is not carried across a dtype change (the optimizer "
                "form changes); pass --skip-optimizer")
    return moe_refusal(conversion)  # tdmoe: MoE through torch_dist in the fully_reshardable form only


def check_optimizer_options(conversion: Any) -> None:
    """optcli: ``--dst-optim-form`` and ``--dst-dp`` checked while planning, before anything is written."""
    from pgconvert.errors import ValidationError

    request, source = conversion.request, conversion.source
    dst_dp = getattr(request, "dst_dp", None)
    check_form(getattr(request, "dst_optim_form", None), conversion.dst_format, request.skip_optimizer)  # dprw
    if dst_dp is None:
        return
    check_dst_dp(dst_dp, conversion.save_options.layout, source.megatron_args,
                 request.skip_optimizer, conversion.dst_format)
    if not _carries(conversion):
        raise ValidationError(f"--dst-dp {dst_dp}: the source holds no Megatron optimizer state to size")


def note_sharded_run(conversion: Any) -> None:
    """optcli: a sharded run writes the model alone; optimizer state its source holds is named in a notice
    (``conversion.source.notices``) and refused under --strict, before anything is written."""
    from pgconvert.formats.strict import fallback

    if _carries(conversion):
        fallback("optimizer state not carried: a sharded run (--shard-index/--num-shards, or a launcher's RANK "
                 "and WORLD_SIZE) writes the model alone; convert without sharding to carry it, or pass "
                 "--skip-optimizer", conversion.request.strict, conversion.source.notices)


def _carries(conversion: Any) -> bool:
    """Whether this conversion is one that carries a Megatron optimizer state (its source holds one)."""
    return not conversion.request.skip_optimizer and conversion.src_format in ("megatron", "torch_dist") \
        and conversion.dst_format in ("megatron", "torch_dist") and _holds_optimizer(conversion.source)


def carried_optimizer(conversion: Any, notices: list[str]) -> OptimizerSource | None:
    """optcli: the source's optimizer state when this conversion carries it, else None. One rule for every
    source and destination: state that is held but not carried is named in a notice (``guess: optimizer
    state not carried: ...``), and refused under --strict; a broken one is a named error."""
    from pgconvert.errors import ValidationError
    from pgconvert.formats.strict import fallback

    if not _carries(conversion):
        return None
    strict = conversion.request.strict
    refused = _not_carried(conversion)
    if refused:
        fallback(refused, strict, notices)
        return None
    try:
        optimizer = open_optimizer(conversion.source, conversion.src_format)
    except ValidationError as exc:
        fallback(f"optimizer state not carried: {exc}", strict, notices)
        return None
    except OptimizerLayoutError as exc:
        if "--skip-optimizer" in str(exc):
            raise
        raise OptimizerLayoutError(f"{exc}; pass --skip-optimizer to convert the model alone") from exc
    refused = plain_refusal(conversion, optimizer) if optimizer.form != FORM_DISTRIBUTED else None  # tdplain
    if refused:
        fallback(f"optimizer state not carried: {optimizer.first.path}: {refused}", strict, notices)
        return None
    lost = lost_scaler(optimizer, optimizer_count(target_of(conversion)[0], conversion.save_options.layout))
    if lost:
        fallback(lost, strict, notices)
    return optimizer


def target_of(conversion: Any) -> tuple[ModelConfig, int]:
    """The destination's model config and padded vocab rows."""
    from pgconvert.formats import target_config
    from pgconvert.model.provider import target_vocab_rows

    options = conversion.save_options
    config = target_config(conversion.source.config, options)
    return config, target_vocab_rows(config, conversion.source.vocab_rows, options.layout)


def carry_training_state(conversion: Any, staging: Path, files: list[PlannedFile]) -> list[str]:
    """``convert``'s step after the model is written: carry the optimizer state of a Megatron per-rank
    or torch_dist source into the Megatron per-rank destination, or into a torch_dist destination (the
    distributed optimizer in its forms; tdplain: the plain one in its plain form); returns the notices to add."""
    from pgconvert.formats.megatron import iteration_dir_name
    from pgconvert.optimizer.fs_model_space import destination_notice
    from pgconvert.optimizer.mla import qk_norm_decay_notice
    from pgconvert.savers.megatron import save_durably

    request, source = conversion.request, conversion.source
    dst_dp = getattr(request, "dst_dp", None)
    notices: list[str] = []
    optimizer = carried_optimizer(conversion, notices)
    if optimizer is None:
        return notices
    options = conversion.save_options
    config, padded = target_of(conversion)
    iteration_dir = staging / iteration_dir_name(source.iteration or 0, source.release)
    if conversion.dst_format == "torch_dist":
        form = default_form(getattr(request, "dst_optim_form", None), optimizer)  # dprw
        _write_torch_dist(conversion, optimizer, iteration_dir, files, form, dst_dp)
    else:
        rewritten = {item.relpath for item in carry_optimizer(optimizer, config, options.layout, iteration_dir,
                                                              padded, save_durably, dst_dp)}
        files[:] = [PlannedFile(f.relpath, f.tensors, f.nbytes) if f.relpath in rewritten else f for f in files]
    # opttd: a torch_dist source's "optimizer/RNG/rerun entries ... not converted": the optimizer now is
    source.notices[:] = [note for note in source.notices if "optimizer/RNG/rerun entries" not in note]
    torch_dist = conversion.dst_format == "torch_dist"
    fsms = destination_notice(getattr(optimizer, "sharding", None), form) if torch_dist else []
    form = f"{optimizer.form}, {form}" if conversion.dst_format == "torch_dist" else optimizer.form
    return notices + [f"optimizer ({form}), scheduler, iteration, floating-point operations and consumed samples "
                      f"carried to {options.layout.describe()}; " + RNG_NOTICE, *fsms] \
        + qk_norm_decay_notice(optimizer.rules, source.config, config)  # mla


def _write_torch_dist(conversion: Any, optimizer: OptimizerSource, iteration_dir: Path,
                      files: list[PlannedFile], form: str = "fully_reshardable", dst_dp: int | None = None) -> None:
    """opttd: the optimizer records beside the torch_dist saver's, in the fully_reshardable form, or
    (dprw) the dp_reshardable one for ``dst_dp`` (default: the written args') data-parallel ranks."""
    from pgconvert.formats import target_config
    from pgconvert.optimizer.torch_dist_dp import DP_RESHARDABLE, write_dp_reshardable
    from pgconvert.optimizer.torch_dist_save import rewrite_common
    from pgconvert.optimizer.torch_dist_save import write_fully_reshardable
    from pgconvert.optimizer.fs_model_space import FS_MODEL_SPACE
    from pgconvert.optimizer.fs_model_space_save import write_fs_model_space
    from pgconvert.optimizer.torch_dist_plain import write_plain

    chunks, _, rows = conversion.saver._chunks(conversion.source, conversion.save_options)
    layout = conversion.save_options.layout
    if dst_dp is not None:
        rewrite_common(iteration_dir, lambda common: common.update(args=with_dst_dp(common.get("args"), layout,
                                                                                     dst_dp)))
    fits_rows = {name for name in optimizer.names() if optimizer._owners[name][0][1].spec.rule.fits_rows}
    if form == PLAIN:  # tdplain; moeplain: per chained optimizer its groups
        config = target_config(conversion.source.config, conversion.save_options)
        counts = [len(groups) for groups in chained_slots(config, layout, RankCoord(0, 0, 0), optimizer.rules, rows)]
        added = write_plain(optimizer, chunks, rows, fits_rows, iteration_dir, counts)
    elif form == DP_RESHARDABLE:
        dp = dst_dp or dp_size(safe_torch_load(iteration_dir / "common.pt").get("args"))
        config = target_config(conversion.source.config, conversion.save_options)
        added = write_dp_reshardable(optimizer, config, layout, rows, dp, iteration_dir)
    elif form == FS_MODEL_SPACE:  # fsms
        added = write_fs_model_space(optimizer, chunks, rows, fits_rows, iteration_dir)
    else:
        config = target_config(conversion.source.config, conversion.save_options)  # tdmoe: chained groups
        counts = [len(groups) for groups in chained_slots(config, layout, RankCoord(0, 0, 0), optimizer.rules, rows)]
        added = write_fully_reshardable(optimizer, chunks, rows, fits_rows, iteration_dir, counts)
    names = {f"{iteration_dir.name}/{name}" for name in ("common.pt", ".metadata")}
    files[:] = [PlannedFile(f.relpath, f.tensors, f.nbytes) if f.relpath.endswith(tuple(names)) else f
                for f in files] + added


def open_optimizer(source: Any, src_format: str) -> OptimizerSource:
    """The optimizer state of an open Megatron per-rank or torch_dist source."""
    if src_format == "torch_dist":  # opttd
        from pgconvert.optimizer.torch_dist import TorchDistOptimizerSource
        return TorchDistOptimizerSource(source)
    return OptimizerSource(source)


def _holds_optimizer(source: Any) -> bool:
    if hasattr(source, "common_state"):  # opttd: torch_dist
        from pgconvert.optimizer.torch_dist import holds_optimizer
        return holds_optimizer(source)
    files = getattr(source, "files", None)
    if not files:
        return False
    return "optimizer" in safe_torch_load(next(iter(files.values())))


def replace_saver_notice(notices: list[str], carried: list[str]) -> list[str]:
    """The saver's "not carried" notice replaced by what was carried, when something was."""
    if not any(note.startswith("optimizer (") for note in carried):
        return notices + carried
    # opttd: the torch_dist saver's notice ends with "; optimizer, scheduler and RNG state are not carried..."
    kept = [note.split("; " + SAVER_NOTICE_PREFIX)[0] for note in notices]
    return [note for note in kept if not note.startswith(SAVER_NOTICE_PREFIX)] + carried


def export_from_path(src: Path, out_dir: Path, iteration: int | None) -> int:
    """``export-optimizer``: open the Megatron per-rank or torch_dist checkpoint ``src`` and write its
    per-parameter optimizer state into ``out_dir`` (which must not exist or be empty)."""
    from pgconvert.errors import DestinationError
    from pgconvert.formats import LoadOptions
    from pgconvert.formats.registry import detect_format, get_loader

    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise DestinationError(f"OUT {out_dir}: exists and is not an empty directory")
    src_format = "torch_dist" if detect_format(src) == "torch_dist" else "megatron"
    source = get_loader(src_format).open(src, LoadOptions(iteration=iteration))
    try:
        return export_parameters(open_optimizer(source, src_format), out_dir)
    finally:
        source.close()
