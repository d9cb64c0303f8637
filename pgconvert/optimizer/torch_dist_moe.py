"""tdmoe: a MoE model's chained optimizer state in a torch_dist checkpoint (fully_reshardable first; below, the others).

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

dpmoe: the dp_reshardable form is read and written too (``optimizer_torch_dist_dp``: ``chained_<i>.``-prefixed
ShardedObjects and per-optimizer buffers, the expert one per TP x EP x PP rank at the expert data-parallel size);
refused by name (``moe_refusal``) only where the expert tensor parallel size differs from the tensor parallel size.
fsms: MoE state in the fully_sharded_model_space form is refused by name. moeplain: the plain (non-distributed)
optimizers chain the same way (``{0: dense, 1: expert}`` common state, records without a prefix: Megatron-LM sets
``chained_optim_avoid_prefix``), read and written by ``optimizer_torch_dist_plain``.
"""

from __future__ import annotations

from typing import Any

from pgconvert.errors import PgconvertError

FULLY_RESHARDABLE = "fully_reshardable"
DP_RESHARDABLE = "dp_reshardable"
FS_MODEL_SPACE = "fully_sharded_model_space"


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
    """Why a MoE model's optimizer state is not carried from or into torch_dist here (None: it is): dpmoe: the
    dp_reshardable form at expert parallel size > 1 maps the expert optimizer's records only with expert
    tensor parallel size = tensor parallel size."""
    from pgconvert.optimizer.torch_dist import sharding_type

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
    sides = [(side, form, layout) for side, form, layout, used in (
        ("from", own, source.layout, conversion.src_format == "torch_dist"),
        ("into", dst_form, conversion.save_options.layout, conversion.dst_format == "torch_dist")) if used]
    for side, form, layout in sides:
        hint = "--skip-optimizer" if side == "from" else "--dst-optim-form fully_reshardable or --skip-optimizer"
        if form == FS_MODEL_SPACE:  # fsms
            return (f"optimizer state not carried: num_experts={source.config.num_experts}: a MoE model's optimizer "
                    "state (megatron-core's chained dense and expert optimizers) is carried from or into torch_dist "
                    f"in the fully_reshardable and dp_reshardable forms only, not {side} {form}; pass {hint}")
        if form == DP_RESHARDABLE and layout.ep > 1 and layout.expert_tp_size != layout.tp:
            return (f"optimizer state not carried: num_experts={source.config.num_experts}: expert tensor parallel "
                    f"size {layout.expert_tp_size} differs from tensor parallel size {layout.tp}: the expert "
                    f"optimizer's dp_reshardable records are not mapped for that, not {side} dp_reshardable; "
                    f"pass {hint}")
    return None
