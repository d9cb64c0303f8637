"""megatron-core's plain (non-distributed) optimizer state written into a torch_dist destination, in its plain form.

The records are megatron-core's plain optimizer's (``loaders/torch_dist/optimizer_forms.py``):
``optimizer.state.{fp32_param (bf16/fp16 only),exp_avg,exp_avg_sq}.<model key>``, chunked as the model's, fp32, written
through the fully_reshardable writer's ``write_chunk_records``; the common state's ``optimizer`` is
``{optimizer: {state: {common_step}, param_groups}[, grad_scaler]}`` (fp32: ``{state: {common_step}, param_groups}``),
``{0: dense, 1: expert}`` for a MoE run's chained two (no ``chained_<i>.`` record prefix: Megatron-LM sets
``chained_optim_avoid_prefix``), and no ``distrib_optim_sharding_type``.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch

from pgconvert.formats import PlannedFile
from pgconvert.formats.torch_dist_optimizer import PLAIN_FIELDS, state_key
from pgconvert.optimizer.order import ChainMember
from pgconvert.optimizer.scaler import set_scalers, target_scalers
from pgconvert.optimizer.source import FORM_FP32, OptimizerSource
from pgconvert.savers.torch_dist.common_state import rewrite_common
from pgconvert.savers.torch_dist.optimizer_records import RecordsShare, carry_counters, per_field, write_chunk_records


def plain_chunks(optimizer: OptimizerSource, model_chunks: list[Any]) -> list[tuple[str, Any]]:
    """The records of ``optimizer`` in its plain form: (field, chunk) per model chunk of a parameter and stored
    field (``per_field``: a parameter's own fields, Muon's or Adam's), fp32."""
    stored = {field: name for field, name in PLAIN_FIELDS[optimizer.form].items() if name}

    def fields(name: str) -> list[str]:
        return [field for field in optimizer.fields(name) if field in stored]

    return [(field, dataclasses.replace(chunk, key=state_key(stored[field], chunk.key), dtype=torch.float32))
            for field, chunk in per_field(model_chunks, set(optimizer.names()), fields)]


def _common_entry(optimizer: OptimizerSource, groups: list[tuple[ChainMember, int]]) -> dict[Any, Any]:
    """The common state's ``optimizer``: one plain entry per chained optimizer (``{0: dense, 1: expert}``, or a
    Muon run's ``{0: Muon, 1: Adam or Lion}``, when ``groups`` has two); Muon's and Lion's count no step."""
    entries: list[dict[str, Any]] = []
    step = optimizer.shared_step()
    for member, count in groups:
        torch_state: dict[str, Any] = {"param_groups": optimizer.param_group_settings(count=count, member=member)}
        if member.stepped and step is not None:
            torch_state["state"] = {"common_step": step.clone()}
        entries.append(torch_state if optimizer.form == FORM_FP32 else {"optimizer": torch_state})
    if optimizer.form != FORM_FP32:
        set_scalers(entries, target_scalers(optimizer, len(entries)))  # its grad scaler (fp16)
    return entries[0] if len(entries) == 1 else dict(enumerate(entries))


def write_plain(optimizer: OptimizerSource, model_chunks: list[Any], rows: int, fits_rows: set[str],
                iteration_dir: Path, groups: list[tuple[ChainMember, int]], share: RecordsShare) -> list[PlannedFile]:
    """Write the plain optimizer's records beside the model's (``model_chunks``: the torch_dist saver's; ``share``:
    which) and its entry in the common state (``groups``: the target's chained optimizers and their group counts);
    returns the files added."""
    chunks = plain_chunks(optimizer, model_chunks)
    added = write_chunk_records(optimizer, chunks, rows, fits_rows, iteration_dir, share)
    if not share.shared:
        return added

    def update(common: dict[str, Any]) -> None:
        common["optimizer"] = _common_entry(optimizer, groups)
        carry_counters(optimizer, common)
        metadata = dict(common.get("content_metadata") or {})
        for key in ("distrib_optim_sharding_type", "distrib_optim_fully_reshardable_mem_efficient"):
            metadata.pop(key, None)
        common["content_metadata"] = metadata

    rewrite_common(iteration_dir, update)
    return added
