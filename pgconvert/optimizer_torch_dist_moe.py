"""tdmoe: a MoE model's chained optimizer state in a torch_dist checkpoint, in the fully_reshardable form.

megatron-core 0.16.1 chains two optimizers for a MoE model at expert parallel size > 1 (``get_megatron_optimizer``:
dense, then the ``is_expert_parallel`` groups). ``ChainedOptimizer.sharded_state_dict``
(megatron/core/optimizer/optimizer.py) returns ``{0: dense, 1: expert}``, each a
``DistributedOptimizer.sharded_state_dict``; it adds no ``chained_<i>.`` key prefix for a fully reshardable
form when the metadata has ``chained_optim_avoid_prefix`` (Megatron-LM's ``_build_sharded_state_dict_metadata``
sets it). So:

- records: ``optimizer.state.{param,exp_avg,exp_avg_sq}.<model key>`` for dense and expert parameters alike
  (``sharded_param_state_fully_reshardable``: the model ShardedTensor with the key prefixed; an expert key keeps
  its global expert axis and chunks);
- common state: ``optimizer = {0: {optimizer: {param_groups}, param_state_sharding_type}, 1: {...}}`` (int
  keys; ``dist_checkpointing`` drops the all-sharded ``param_state``), ``ChainedOptimizer.load_state_dict``
  reading them in key order. One optimizer (a dense model, or a MoE one at expert parallel size 1): the entry
  itself.

dp_reshardable MoE state (``chained_<i>.``-prefixed ShardedObjects and per-optimizer buffers) is not read or
written: refused by name (``moe_refusal``).
"""

from __future__ import annotations

from typing import Any

from pgconvert.errors import PgconvertError

FULLY_RESHARDABLE = "fully_reshardable"


def chained_entries(optimizer: Any) -> list[Any]:
    """The common state's ``optimizer`` per chained optimizer: ``{0: …, 1: …}`` in key order, else the one entry."""
    if isinstance(optimizer, dict) and optimizer and all(type(key) is int for key in optimizer):
        return [optimizer[key] for key in sorted(optimizer)]
    return [optimizer]


def common_entry(groups: list[list[dict[str, Any]]]) -> dict[Any, Any]:
    """The common state's ``optimizer`` for these chained optimizers' param groups (with ``step``)."""
    entries = [{"optimizer": {"param_groups": own}, "param_state_sharding_type": FULLY_RESHARDABLE} for own in groups]
    return entries[0] if len(entries) == 1 else dict(enumerate(entries))


def moe_refusal(conversion: Any) -> str | None:
    """Why a MoE model's optimizer state is not carried from or into torch_dist here (None: it is): only the
    fully_reshardable form is carried for MoE."""
    from pgconvert.optimizer_torch_dist import sharding_type

    source = conversion.source
    if not source.config.num_experts or "torch_dist" not in (conversion.src_format, conversion.dst_format):
        return None
    own = None
    if conversion.src_format == "torch_dist":
        try:
            own = sharding_type(source.common_state, f"{source.directory} (common state)")
        except PgconvertError:
            return None  # open_optimizer names it
    requested = getattr(conversion.request, "dst_optim_form", None)
    dst_form = requested or own or FULLY_RESHARDABLE
    forms = [form for form, used in ((own, conversion.src_format == "torch_dist"),
                                     (dst_form, conversion.dst_format == "torch_dist")) if used]
    if all(form in (None, FULLY_RESHARDABLE) for form in forms):
        return None
    where = "from" if own not in (None, FULLY_RESHARDABLE) else "into"
    form = own if where == "from" else dst_form  # fsms: name the form (dp_reshardable or fully_sharded_model_space)
    hint = "--skip-optimizer" if where == "from" else "--dst-optim-form fully_reshardable or --skip-optimizer"
    return (f"optimizer state not carried: num_experts={source.config.num_experts}: a MoE model's optimizer state "
            "(megatron-core's chained dense and expert optimizers) is carried from or into torch_dist in the "
            f"fully_reshardable form only, not {where} {form}; pass {hint}")
