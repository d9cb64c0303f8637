"""tdplain: megatron-core's plain (non-distributed) optimizer state in a torch_dist checkpoint, read and written.

Megatron-LM's default ``--ckpt-format torch_dist`` without ``--use-distributed-optimizer`` saves
``optimizer.sharded_state_dict`` of megatron-core 0.16.1's plain optimizers (megatron/core/optimizer/optimizer.py):

- ``Float16OptimizerWithFloat16Params`` (``--bf16`` / ``--fp16``): each fp32 master of ``fp32_from_fp16_params`` as
  ``optimizer.state.fp32_param.<model key>`` (``make_sharded_optimizer_tensor``: the model parameter's ShardedTensor,
  or ShardedTensorFactory for a SwiGLU ``linear_fc1``, with the key prefixed and the fp32 data; same global shape,
  chunks and replica ids), the Adam moments as ``optimizer.state.{exp_avg,exp_avg_sq}.<model key>``
  (``optim_state_to_sharding_state`` with ``exclude_keys="step"``); the common state keeps
  ``optimizer = {optimizer: {state: {common_step}, param_groups}, grad_scaler (fp16 only)}`` (the groups' ``params``
  are ``LocalNonpersistentObject``: not saved; ``fp32_from_fp16_params`` holds only ShardedTensors: dropped);
- ``FP32Optimizer`` (fp32 training): the moments alone (the model weights are the masters) and
  ``optimizer = {state: {common_step}, param_groups}``.

No ``param_state_sharding_type`` and no ``distrib_optim_sharding_type``. So it is the fully_reshardable records
(``optimizer_torch_dist_save``) with other field names and the step in the common state: read by
``TorchDistOptimizerSource`` (``sharding = PLAIN``, ``form`` the per-rank form it maps to) and written by
``write_plain``. moeplain: a MoE run at expert parallel size > 1 chains a dense and an expert plain optimizer
(``get_megatron_optimizer``); ``ChainedOptimizer.sharded_state_dict`` adds no ``chained_<i>.`` key prefix here (it
adds one only for a non-fully-reshardable ``distrib_optim_sharding_type``, absent for plain optimizers, or without
``chained_optim_avoid_prefix``, which Megatron-LM sets), so every record keeps its model key (an expert key its
global expert axis) and the common state is ``{0: dense, 1: expert}`` (``optimizer_torch_dist_moe``).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch

from pgconvert.formats import PlannedFile
from pgconvert.io.limits import quote
from pgconvert.optimizer.order import OptimizerLayoutError, UnsupportedOptimizerError
from pgconvert.optimizer.state import CARRIED_KEYS, FORM_FP16, FORM_FP32
from pgconvert.optimizer.torch_dist_moe import chained_entries

PLAIN = "plain"
# The stored field of each per-parameter key, per plain form ("": the model weight itself is the master).
FIELDS = {FORM_FP16: {"param": "fp32_param", "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"},
          FORM_FP32: {"param": "", "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}}
_VERSION = "megatron-core 0.16.1"


def plain_form(common: dict[str, Any], where: str) -> str | None:
    """The plain optimizer's form (FORM_FP16 or FORM_FP32) of a torch_dist common state, None if it is not one."""
    entries = chained_entries(common.get("optimizer"))
    forms = [_entry_form(entry) for entry in entries]
    if None in forms:
        return None
    if len(set(forms)) > 1:  # moeplain: chained dense and expert optimizers share one form
        raise UnsupportedOptimizerError(f"{where}: the chained plain optimizers' forms differ: {quote(forms)}; "
                                        "pass --skip-optimizer")
    return forms[0]


def _entry_form(entry: Any) -> str | None:
    if not isinstance(entry, dict) or "param_state_sharding_type" in entry:
        return None
    inner = entry.get("optimizer")
    if isinstance(inner, dict) and {"state", "param_groups"} <= set(inner):
        return FORM_FP16
    if {"state", "param_groups"} <= set(entry):
        return FORM_FP32
    return None


def inner(entry: dict[str, Any], form: str) -> dict[str, Any]:
    """The torch optimizer's ``{state, param_groups}`` of a plain entry."""
    return entry["optimizer"] if form == FORM_FP16 else entry


def plain_step(entry: Any, form: str, where: str) -> torch.Tensor:
    """The shared Adam step (``common_step``) of a plain entry (moeplain: of each chained one, all equal), checked."""
    steps = []
    for each in chained_entries(entry):
        step = inner(each, form)["state"].get("common_step")
        if not isinstance(step, (torch.Tensor, int, float)) or (isinstance(step, torch.Tensor) and step.numel() != 1):
            raise OptimizerLayoutError(f"{where}: optimizer state.common_step = {quote(step, 80)}: expected the "
                                       f"step count {_VERSION} saves for a plain optimizer that has stepped")
        steps.append(torch.as_tensor(step, dtype=torch.float32).clone())
    if any(not torch.equal(step, steps[0]) for step in steps):  # ChainedOptimizer._synchronize_steps
        raise OptimizerLayoutError(f"{where}: the chained plain optimizers' common_step differ: "
                                   f"{quote([float(step) for step in steps])}")
    return steps[0]


def plain_chunks(form: str, names: set[str], model_chunks: list[Any]) -> list[tuple[str, Any]]:
    """The records of the plain ``form``: (field, chunk) per model chunk of a parameter and stored field, fp32."""
    return [(field, dataclasses.replace(chunk, key=f"optimizer.state.{stored}.{chunk.key}", dtype=torch.float32))
            for chunk in model_chunks if chunk.canonical in names
            for field, stored in FIELDS[form].items() if stored]


def _common_entry(optimizer: Any, group_counts: list[int]) -> dict[Any, Any]:
    """The common state's ``optimizer``: one plain entry per chained optimizer (moeplain: ``{0: dense, 1: expert}``
    when ``group_counts`` has two)."""
    from pgconvert.optimizer.scaler import set_scalers, target_scalers

    entries: list[dict[str, Any]] = []
    for index, count in enumerate(group_counts):
        step = optimizer.step(optimizer.names()[0]).clone()
        torch_state = {"state": {"common_step": step}, "param_groups": optimizer.param_group_settings(index, count)}
        entries.append(torch_state if optimizer.form == FORM_FP32 else {"optimizer": torch_state})
    if optimizer.form != FORM_FP32:
        set_scalers(entries, target_scalers(optimizer, len(entries)))  # fp16: its grad scaler
    return entries[0] if len(entries) == 1 else dict(enumerate(entries))


def write_plain(optimizer: Any, model_chunks: list[Any], rows: int, fits_rows: set[str],
                iteration_dir: Path, group_counts: list[int]) -> list[PlannedFile]:
    """Write the plain optimizer's records beside the model's (``model_chunks``: the torch_dist saver's) and its
    entry in ``common.pt`` (``group_counts``: the target's param groups per chained optimizer); returns the files
    added."""
    from pgconvert.optimizer.torch_dist_save import rewrite_common, write_chunk_records

    chunks = plain_chunks(optimizer.form, set(optimizer.names()), model_chunks)
    added = write_chunk_records(optimizer, chunks, rows, fits_rows, iteration_dir)

    def update(common: dict[str, Any]) -> None:
        common["optimizer"] = _common_entry(optimizer, group_counts)
        for key in CARRIED_KEYS:
            if key in optimizer.first.extra:
                common[key] = optimizer.first.extra[key]
        metadata = dict(common.get("content_metadata") or {})
        for key in ("distrib_optim_sharding_type", "distrib_optim_fully_reshardable_mem_efficient"):
            metadata.pop(key, None)
        common["content_metadata"] = metadata

    rewrite_common(iteration_dir, update)
    return added


def plain_refusal(conversion: Any, optimizer: Any) -> str | None:
    """Why a plain optimizer's state is not carried by this conversion (None: it is): into torch_dist it is written
    in its own plain form (moeplain: a MoE run's chained two too) and no --dst-optim-form."""
    if conversion.dst_format != "torch_dist":
        return None
    requested = getattr(conversion.request, "dst_optim_form", None)
    if requested:
        return (f"--dst-optim-form {requested}: the {optimizer.form} (non-distributed) optimizer's state is written "
                "into torch_dist in its own plain form only (megatron-core's plain optimizer loads that); drop "
                "--dst-optim-form, or pass --skip-optimizer")
    return None
