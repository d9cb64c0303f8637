"""Which form of megatron-core's optimizer state a torch_dist checkpoint's common state holds, read.

The distributed optimizer names its form in ``optimizer.param_state_sharding_type`` (per chained optimizer);
megatron-core's plain optimizer (Megatron-LM's ``--ckpt-format torch_dist`` without
``--use-distributed-optimizer``) saves ``optimizer.sharded_state_dict`` of megatron-core 0.16.1's plain
optimizers (megatron/core/optimizer/optimizer.py):

- ``Float16OptimizerWithFloat16Params`` (``--bf16`` / ``--fp16``): each fp32 master of ``fp32_from_fp16_params`` as
  ``optimizer.state.fp32_param.<model key>`` (``make_sharded_optimizer_tensor``: the model parameter's ShardedTensor,
  or ShardedTensorFactory for a SwiGLU ``linear_fc1``, with the key prefixed and the fp32 data; same global shape,
  chunks and replica ids), the Adam moments as ``optimizer.state.{exp_avg,exp_avg_sq}.<model key>``
  (``optim_state_to_sharding_state`` with ``exclude_keys="step"``); the common state keeps
  ``optimizer = {optimizer: {state: {common_step}, param_groups}, grad_scaler (fp16 only)}`` (the groups' ``params``
  are ``LocalNonpersistentObject``: not saved; ``fp32_from_fp16_params`` holds only ShardedTensors: dropped);
- ``FP32Optimizer`` (fp32 training): the moments alone (the model weights are the masters) and
  ``optimizer = {state: {common_step}, param_groups}``.

No ``param_state_sharding_type`` and no ``distrib_optim_sharding_type`` there: it is presented in its per-rank
form (``float16`` or ``fp32``). A MoE run at expert parallel size > 1 chains a dense and an expert plain optimizer,
the common state ``{0: dense, 1: expert}`` (``pgconvert.formats.torch_dist_optimizer``).
"""

from __future__ import annotations

from typing import Any

import torch

from pgconvert.formats.torch_dist_optimizer import (DP_RESHARDABLE, FS_MODEL_SPACE, FULLY_RESHARDABLE, PLAIN,
                                                    chained_entries)
from pgconvert.io.limits import quote
from pgconvert.optimizer.order import MEGATRON_CORE_VERSIONS, OptimizerLayoutError, UnsupportedOptimizerError
from pgconvert.optimizer.source import DISTRIBUTED_SHARDING_TYPES, FORM_FP16, FORM_FP32

# The distributed optimizer's forms read: fully_sharded_model_space was written by megatron-core <= 0.15.0 (verified
# with 0.15.0); fully_sharded_bucket_space and dp_zero_gather_scatter, deprecated forms, are not.
TORCH_DIST_FORMS = (DP_RESHARDABLE, FULLY_RESHARDABLE, FS_MODEL_SPACE)
_NOT_REPRODUCED: dict[str, str] = {}
_VERSIONS = "megatron-core " + " / ".join(MEGATRON_CORE_VERSIONS)
_VERSION = "megatron-core 0.16.1"


def sharding_type(common: dict[str, Any], where: str) -> str | None:
    """The checkpoint's ``param_state_sharding_type`` (None: no distributed optimizer state), checked."""
    if common.get("optimizer") is None:
        return None
    entries = chained_entries(common["optimizer"])  # {0: dense, 1: expert} when chained
    if not all(isinstance(optimizer, dict) for optimizer in entries):
        kinds = sorted({type(optimizer).__name__ for optimizer in entries})
        raise OptimizerLayoutError(f"{where}: optimizer is {quote(kinds)}, not a dict")
    if any("param_state_sharding_type" not in optimizer for optimizer in entries):
        return None
    types = {str(optimizer["param_state_sharding_type"]) for optimizer in entries}
    if len(types) != 1:
        raise OptimizerLayoutError(f"{where}: the chained optimizers' param_state_sharding_type differ: "
                                   f"{quote(sorted(types))}")
    sharding = entries[0]["param_state_sharding_type"]
    if sharding not in DISTRIBUTED_SHARDING_TYPES:
        raise OptimizerLayoutError(
            f"{where}: optimizer.param_state_sharding_type={quote(sharding)}: unknown sharding type ({_VERSIONS} "
            f"writes {', '.join(DISTRIBUTED_SHARDING_TYPES)})")
    if sharding not in TORCH_DIST_FORMS:
        why = _NOT_REPRODUCED.get(str(sharding), "not a form pgconvert reads")
        raise UnsupportedOptimizerError(
            f"{where}: optimizer.param_state_sharding_type={quote(sharding)}: {why}; pgconvert reads "
            f"{', '.join(TORCH_DIST_FORMS)} ({_VERSIONS}); pass --skip-optimizer")
    return str(sharding)


def layer_wise_shardings(common: dict[str, Any], where: str) -> list[str]:
    """Per chained optimizer, the form a layer-wise (Muon or Lion) run's state is stored in (megatron-core's
    ``LayerWiseDistributedOptimizer`` chained with a ``DistributedOptimizer``, Megatron-LM d98e8a64): the layer-wise
    one's entry ``{optimizer: {param_groups}}`` (its records the plain form's, in model space), then the distributed
    one's, naming its ``param_state_sharding_type`` (dp_reshardable or fully_reshardable)."""
    entries = chained_entries(common.get("optimizer"))
    if len(entries) != 2 or not all(isinstance(entry, dict) for entry in entries):
        raise OptimizerLayoutError(f"{where}: optimizer = {quote(common.get('optimizer'), 160)}: a layer-wise "
                                   "run (use_layer_wise_distributed_optimizer) chains two optimizers, {0: the "
                                   "layer-wise (Muon's or Lion's), 1: Adam's}")
    if _entry_form(entries[0]) != FORM_FP16:
        raise OptimizerLayoutError(f"{where}: optimizer[0] = {quote(entries[0], 160)}: expected the layer-wise "
                                   "optimizer's {optimizer: {param_groups}} (a bf16 run's)")
    sharding = entries[1].get("param_state_sharding_type")
    if sharding not in (DP_RESHARDABLE, FULLY_RESHARDABLE):
        raise OptimizerLayoutError(
            f"{where}: optimizer[1].param_state_sharding_type={quote(sharding)}: the layer-wise run's Adam "
            f"optimizer is megatron-core's distributed one, saved as {DP_RESHARDABLE} or {FULLY_RESHARDABLE}")
    return [PLAIN, str(sharding)]


def object_value(stored: Any) -> Any:
    """A ShardedObject's value: megatron-core stores it as ``torch.save([value])``."""
    return stored[0] if isinstance(stored, list) and len(stored) == 1 else stored


def plain_form(common: dict[str, Any], where: str) -> str | None:
    """The plain optimizer's form (FORM_FP16 or FORM_FP32) of a torch_dist common state, None if it is not one."""
    entries = chained_entries(common.get("optimizer"))
    forms = [_entry_form(entry) for entry in entries]
    if None in forms:
        return None
    if len(set(forms)) > 1:  # chained dense and expert optimizers share one form
        raise UnsupportedOptimizerError(f"{where}: the chained plain optimizers' forms differ: {quote(forms)}; "
                                        "pass --skip-optimizer")
    return forms[0]


def _entry_form(entry: Any) -> str | None:
    if not isinstance(entry, dict) or "param_state_sharding_type" in entry:
        return None
    # a Muon optimizer keeps no common_step: its entry has param groups alone
    inner = entry.get("optimizer")
    if isinstance(inner, dict) and "param_groups" in inner:
        return FORM_FP16
    if "param_groups" in entry:
        return FORM_FP32
    return None


def plain_inner(entry: dict[str, Any], form: str) -> dict[str, Any]:
    """The torch optimizer's ``{state, param_groups}`` of a plain entry."""
    return entry["optimizer"] if form == FORM_FP16 else entry


def plain_step(entry: Any, form: str, where: str, stepped: list[bool] | None = None) -> torch.Tensor | None:
    """The shared Adam step (``common_step``) of a plain entry (of each chained one that counts steps, ``stepped``:
    not a Muon or Lion optimizer's; default every one; all equal), checked; None where none counts steps."""
    steps = []
    entries = chained_entries(entry)
    for each, counts in zip(entries, stepped or [True] * len(entries)):
        if not counts:
            continue
        state = plain_inner(each, form).get("state")
        step = state.get("common_step") if isinstance(state, dict) else None
        if not isinstance(step, (torch.Tensor, int, float)) or (isinstance(step, torch.Tensor) and step.numel() != 1):
            raise OptimizerLayoutError(f"{where}: optimizer state.common_step = {quote(step, 80)}: expected the "
                                       f"step count {_VERSION} saves for a plain optimizer that has stepped")
        steps.append(torch.as_tensor(step, dtype=torch.float32).clone())
    if any(not torch.equal(step, steps[0]) for step in steps):  # ChainedOptimizer._synchronize_steps
        raise OptimizerLayoutError(f"{where}: the chained plain optimizers' common_step differ: "
                                   f"{quote([float(step) for step in steps])}")
    return steps[0] if steps else None
