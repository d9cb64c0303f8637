"""The torch_dist saver's optimizer state: which form a destination gets, what it refuses, and each form's writer.

A distributed optimizer's state is written in the form ``--dst-optim-form`` names (``DST_FORMS``), else the
source's own torch_dist form, else ``fully_reshardable``; a plain optimizer's in the plain form only. The
records go beside the model's, after the saver wrote it (``optimizer_records.py``, ``optimizer_dp_reshardable.py``,
``optimizer_fs_model_space.py``, ``optimizer_plain.py``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pgconvert.errors import ValidationError
from pgconvert.formats import CarriedOptimizer, OptimizerFile, PlannedFile, SaveOptions, target_config
from pgconvert.formats.stream import CanonicalSource
from pgconvert.formats.dcp_layout import DCP_METADATA_FILE
from pgconvert.formats.torch_dist_optimizer import DP_RESHARDABLE, FS_MODEL_SPACE, FULLY_RESHARDABLE, PLAIN
from pgconvert.io.dcp_writer import DEFAULT_MAX_DATA_FILE_SIZE
from pgconvert.model.grid import RankCoord
from pgconvert.optimizer.data_parallel import dp_size, with_dst_dp
from pgconvert.optimizer.order import ChainMember, chain, chained_slots
from pgconvert.optimizer.source import FORM_DISTRIBUTED, FORM_LAYER_WISE, OptimizerSource
from pgconvert.savers.torch_dist.optimizer_dp_reshardable import planned_files, plan_records, write_dp_reshardable
from pgconvert.savers.torch_dist.optimizer_fs_model_space import write_fs_model_space
from pgconvert.savers.torch_dist.optimizer_layer_wise import plan_layer_wise, write_layer_wise
from pgconvert.savers.torch_dist.optimizer_plain import plain_chunks, write_plain
from pgconvert.savers.torch_dist.common_state import common_relpath, rewrite_common
from pgconvert.savers.torch_dist.optimizer_records import (RecordsShare, chunk_numbers, optimizer_chunks, records_files,
                                                           write_fully_reshardable)

# The distributed optimizer's forms a destination may be given (fully_sharded_model_space: for megatron-core
# <= 0.15.0, which cannot load the others).
DST_FORMS = (FULLY_RESHARDABLE, DP_RESHARDABLE, FS_MODEL_SPACE)


def written_form(optimizer: OptimizerSource, requested: str | None) -> str:
    """The form ``optimizer`` is written in: a plain optimizer's its plain form (a requested form refused), a
    distributed one's the requested form, else the source's own torch_dist form, else fully_reshardable; a layer-wise
    Muon run's the requested or its own of the two forms Megatron-LM saves it in."""
    if optimizer.form == FORM_LAYER_WISE:
        if requested not in (None, FULLY_RESHARDABLE, DP_RESHARDABLE):
            raise ValidationError(
                f"--dst-optim-form {requested}: a layer-wise run's state (use_layer_wise_distributed_optimizer) "
                f"is written as {DP_RESHARDABLE} or {FULLY_RESHARDABLE}, the forms Megatron-LM saves it in")
        return requested or str(optimizer.sharding)
    if optimizer.form != FORM_DISTRIBUTED:
        if requested:
            raise ValidationError(
                f"--dst-optim-form {requested}: the {optimizer.form} (non-distributed) optimizer's state is written "
                "into torch_dist in its own plain form only (megatron-core's plain optimizer loads that); drop "
                "--dst-optim-form, or pass --skip-optimizer")
        return PLAIN
    own = optimizer.sharding
    return requested or (own if own in DST_FORMS else FULLY_RESHARDABLE)


def destination_notice(sharding: str | None, form: str) -> list[str]:
    """What a torch_dist destination of a fully_sharded_model_space source says when another ``form`` is asked
    for: megatron-core before 0.15.0 cannot load it."""
    if sharding != FS_MODEL_SPACE or form == FS_MODEL_SPACE:
        return []
    return [f"optimizer: the source's {FS_MODEL_SPACE} form is written as {form}: megatron-core 0.15.0 and later "
            f"load {form}, 0.14.0 and older only {FS_MODEL_SPACE} (--dst-optim-form {FS_MODEL_SPACE}) and the "
            "deprecated forms"]


def _target_groups(optimizer: OptimizerSource, source: CanonicalSource, options: SaveOptions,
                   rows: int) -> list[tuple[ChainMember, int]]:
    """The target's chained optimizers, each with its param group count."""
    config = target_config(source.config, options)
    slots = chained_slots(config, options.layout, RankCoord(0, 0, 0), optimizer.rules, rows)
    return list(zip(chain(config, options.layout, optimizer.rules), (len(groups) for groups in slots)))


def write_optimizer(source: CanonicalSource, optimizer: OptimizerSource, form: str, iteration_dir: Path,
                    options: SaveOptions, dst_dp: int | None, model_chunks: list[Any], rows: int, args: Any,
                    files: list[PlannedFile], share: RecordsShare) -> CarriedOptimizer:
    """The optimizer records in ``form`` beside the torch_dist saver's (``model_chunks``: its chunks; ``args``: the
    target's, as the common state holds them), for ``dst_dp`` (default: those args') data-parallel ranks: the records
    files ``share`` names and, when it says so, what they share (the common state and ``.metadata`` rewritten)."""
    layout = options.layout
    if dst_dp is not None:
        args = with_dst_dp(args, layout, dst_dp)
        if share.shared:
            rewrite_common(iteration_dir, lambda common: common.update(args=with_dst_dp(common.get("args"), layout,
                                                                                         dst_dp)))
    fits_rows = {name for name in optimizer.names() if optimizer.rule(name).fits_rows}
    if optimizer.form == FORM_LAYER_WISE:
        config = target_config(source.config, options)
        plan = plan_layer_wise(optimizer, model_chunks, form, config, layout, rows, dst_dp or dp_size(args), args,
                               share.limit)
        added = write_layer_wise(optimizer, plan, rows, fits_rows, iteration_dir, share, form,
                                 _target_groups(optimizer, source, options, rows))
    elif form == PLAIN:
        target = _target_groups(optimizer, source, options, rows)
        added = write_plain(optimizer, model_chunks, rows, fits_rows, iteration_dir, target, share)
    elif form == DP_RESHARDABLE:
        config = target_config(source.config, options)
        added = write_dp_reshardable(optimizer, config, layout, rows, dst_dp or dp_size(args), iteration_dir, args,
                                     share)
    elif form == FS_MODEL_SPACE:
        target = _target_groups(optimizer, source, options, rows)
        added = write_fs_model_space(optimizer, model_chunks, rows, fits_rows, iteration_dir, share, target)
    else:
        target = _target_groups(optimizer, source, options, rows)
        added = write_fully_reshardable(optimizer, model_chunks, rows, fits_rows, iteration_dir, share, target)
    # What the shared step rewrote (a share writes its records files alone): their digests are stale.
    rewritten = (common_relpath(iteration_dir), DCP_METADATA_FILE) if share.shared else ()
    names = tuple(f"{iteration_dir.name}/{name}" for name in rewritten)
    written = [PlannedFile(f.relpath, f.tensors, f.nbytes) if f.relpath.endswith(names) else f for f in files]
    return CarriedOptimizer(written + added, f"{optimizer.form}, {form}", destination_notice(optimizer.sharding, form))


def planned_records(source: CanonicalSource, optimizer: OptimizerSource, form: str, options: SaveOptions,
                    dst_dp: int | None, model_chunks: list[Any], rows: int, directory: str,
                    args: Any) -> list[OptimizerFile]:
    """``--dry-run``'s and a sharded run's records files in ``form``: their records (and objects) and bytes."""
    what = f"optimizer records ({optimizer.form}, {form}; common state and .metadata updated)"
    limit = options.max_shard_size or DEFAULT_MAX_DATA_FILE_SIZE
    if optimizer.form == FORM_LAYER_WISE:
        args = with_dst_dp(args, options.layout, dst_dp) if dst_dp is not None else args
        plan = plan_layer_wise(optimizer, model_chunks, form, target_config(source.config, options), options.layout,
                               rows, dst_dp or dp_size(args), args, limit)
        files = records_files(directory, plan.sizes(), plan.numbers, len(plan.objects))
    elif form in (PLAIN, FULLY_RESHARDABLE, FS_MODEL_SPACE):
        chunks = plain_chunks(optimizer, model_chunks) if form == PLAIN \
            else optimizer_chunks(optimizer, model_chunks)
        files = records_files(directory, {(chunk.key, tuple(chunk.offsets)): chunk.nbytes for _, chunk in chunks},
                              chunk_numbers(chunks, limit))
    else:
        args = with_dst_dp(args, options.layout, dst_dp) if dst_dp is not None else args
        config = target_config(source.config, options)
        records, objects = plan_records(optimizer, config, options.layout, rows, dst_dp or dp_size(args), args)
        files = planned_files(records, objects, limit, directory)
    return [OptimizerFile(item.relpath, what, item.tensors, item.nbytes) for item in files]
