"""The distributed optimizer's state written into a torch_dist destination in the ``fully_sharded_model_space``
form (``--dst-optim-form fully_sharded_model_space``), for megatron-core 0.15.0 and older.

The records are the ``fully_reshardable`` writer's chunks (``optimizer_records.py``: the torch_dist saver's
model chunks, fp32), each stored reformulated as megatron-core <= 0.15 stores a flattened_range ShardedTensor
(``loaders/torch_dist/fs_model_space.py``): key ``optimizer.state.{fp32_param,exp_avg,exp_avg_sq}.<model key>``, global shape
``(*chunks per axis, elements of one chunk)``, one whole chunk per stored piece (megatron-core reads any DP
rank's ``flattened_range`` of it). megatron-core loads such a record only with its original global shape in
``.metadata``: ``metadata.mcore_data[key]['nd_reformulated_orig_global_shape']`` (``strategies/torch.py``,
``get_reformulation_metadata``), here set on torch's own Metadata as 0.13.1 / 0.14.0 do. Common state:
``optimizer = {optimizer: {param_groups}, param_state_sharding_type: 'fully_sharded_model_space'[, grad_scaler]}`` and
``content_metadata['distrib_optim_sharding_type']``. Checked with megatron-core 0.15.0, 0.14.0 and 0.13.1 by
``scripts/make_fs_model_space_golden.py load DIR DP``; megatron-core 0.16.1 and later cannot load this form.

A MoE model's chained dense and expert optimizers (EP > 1): the records prefixed ``chained_<i>.`` and
``content_metadata['chained_optim_avoid_prefix']`` False, the form megatron-core 0.13.1 saves and loads (it always
prefixes) and 0.14.0 and 0.15.0 load (they read the prefixing from the content metadata); the common state's
``optimizer`` is ``{0: dense, 1: expert}``, each entry naming the form. Checked with megatron-core 0.15.0, 0.14.0 and
0.13.1 at EP2 and EP4 by ``scripts/make_fs_model_space_moe_golden.py load DIR DP EP``.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import torch

from pgconvert.formats import PlannedFile
from pgconvert.formats.dcp_layout import DCP_METADATA_FILE
from pgconvert.formats.torch_dist import read_dcp_metadata
from pgconvert.io.dcp_plan import Metadata, dump_metadata
from pgconvert.formats.torch_dist_optimizer import (AVOID_PREFIX, FS_MODEL_SPACE, MODEL_SPACE_FIELDS, chain_prefixes,
                                                    chained_entries, common_entry, state_key)
from pgconvert.model.provider import expert_of_key
from pgconvert.optimizer.order import ChainMember
from pgconvert.optimizer.scaler import set_scalers, target_scalers
from pgconvert.optimizer.source import OptimizerSource
from pgconvert.io.durable import replace_durably
from pgconvert.savers.torch_dist.common_state import rewrite_common
from pgconvert.savers.torch_dist.optimizer_records import RecordsShare, carry_counters, per_field, write_chunk_records

FIELDS = MODEL_SPACE_FIELDS[FS_MODEL_SPACE]


def _reformulated(field: str, chunk: Any, prefix: str) -> Any:
    """The model chunk's record (``prefix``: its chained optimizer's): its box of the reformulated tensor (the chunk
    grid is the model key's)."""
    local = chunk.sizes
    elements = math.prod(local)
    return dataclasses.replace(
        chunk, key=prefix + state_key(FIELDS[field], chunk.key), dtype=torch.float32,
        offsets=tuple(o // n for o, n in zip(chunk.offsets, local)) + (0,), sizes=(1,) * len(local) + (elements,),
        global_shape=tuple(g // n for g, n in zip(chunk.global_shape, local)) + (elements,))


def _merge_metadata(iteration_dir: Path, added: Metadata, original: dict[str, tuple[int, ...]]) -> None:
    """The checkpoint's ``.metadata`` with the records ``added`` indexes and ``mcore_data`` set on torch's own
    Metadata, as megatron-core 0.13.1 / 0.14.0 store it (``metadata.mcore_data = ...``; 0.15.0 pickles a subclass
    instead and reads either: it only asks for the attribute)."""
    path = iteration_dir / DCP_METADATA_FILE
    metadata = read_dcp_metadata(path)
    entries = {**metadata.state_dict_metadata, **added.state_dict_metadata}
    storage = {**metadata.storage_data, **added.storage_data}
    merged = Metadata(entries, metadata.planner_data, storage, metadata.storage_meta, metadata.version)
    merged.mcore_data = {key: {"nd_reformulated_orig_global_shape": shape} for key, shape in original.items()}
    replace_durably(path, dump_metadata(merged))


def _add_common(optimizer: OptimizerSource, iteration_dir: Path, target: list[tuple[ChainMember, int]]) -> None:
    """``target``: the target's chained optimizers and their group counts (a MoE model's at EP > 1: the dense and
    the expert one, ``{0: dense, 1: expert}``, each entry naming the form)."""
    step = optimizer.group_step()
    groups = [[dict(settings, step=step) for settings in optimizer.param_group_settings(count=count, member=member)]
              for member, count in target]

    def update(common: dict[str, Any]) -> None:
        common["optimizer"] = common_entry(groups, FS_MODEL_SPACE)
        # DistributedOptimizer.state_dict's grad_scaler stays plain common state in this form, as in fully_reshardable
        set_scalers(chained_entries(common["optimizer"]), target_scalers(optimizer, len(groups)))
        carry_counters(optimizer, common)
        # chained optimizers' records are prefixed (write_fs_model_space), which the metadata must say
        common["content_metadata"] = dict(common.get("content_metadata") or {},
                                          distrib_optim_sharding_type=FS_MODEL_SPACE)
        if len(groups) > 1:
            common["content_metadata"][AVOID_PREFIX] = False

    rewrite_common(iteration_dir, update)


def _chained_index(name: str, prefixes: list[str]) -> int:
    """The target's chained optimizer of parameter ``name``: the expert one (1) for a routed expert's where there are
    two, else the dense one."""
    return 1 if len(prefixes) > 1 and expert_of_key(name) is not None else 0


def write_fs_model_space(optimizer: OptimizerSource, model_chunks: list[Any], rows: int, fits_rows: set[str],
                         iteration_dir: Path, share: RecordsShare,
                         target: list[tuple[ChainMember, int]]) -> list[PlannedFile]:
    """Write the records beside the model's (``model_chunks``: the torch_dist saver's, expert ones included;
    ``share``: which; ``target``: the target's chained optimizers and their group counts); returns the files
    added."""
    pairs = per_field(model_chunks, set(optimizer.names()), list(FIELDS))
    # A MoE model's chained dense and expert optimizers: their records prefixed chained_<i>. (megatron-core 0.13.1
    # loads no other form; 0.14.0 and 0.15.0 take the prefix from the content metadata, _add_common).
    prefixes = chain_prefixes(len(target), prefixed=True)
    chunks = [(field, _reformulated(field, chunk, prefixes[_chained_index(chunk.canonical, prefixes)]))
              for field, chunk in pairs]
    original = {chunk.key: tuple(model.global_shape) for (_, chunk), (_, model) in zip(chunks, pairs)}
    added = write_chunk_records(optimizer, chunks, rows, fits_rows, iteration_dir, share,
                                lambda directory, index: _merge_metadata(directory, index, original))
    if share.shared:
        _add_common(optimizer, iteration_dir, target)
    return added
