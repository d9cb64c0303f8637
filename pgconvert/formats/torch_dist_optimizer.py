"""megatron-core's optimizer state in a torch_dist checkpoint: what its loader and saver both need (the forms'
names, record keys and field names, the common state's ``optimizer`` entry, the records file).

``DistributedOptimizer.sharded_state_dict`` (megatron/core/optimizer/distrib_optimizer.py) saves the parameter
state in the form ``metadata['distrib_optim_sharding_type']`` names and puts ``param_state_sharding_type`` in the
common state's ``optimizer`` entry:

- ``fully_reshardable``: ``optimizer.state.{param,exp_avg,exp_avg_sq}.<model key>``, each chunked like its model
  tensor; ``fully_sharded_model_space`` (megatron-core <= 0.15.0): ``optimizer.state.{fp32_param,exp_avg,
  exp_avg_sq}.<model key>``, reformulated (``loaders/torch_dist/fs_model_space.py``);
- ``dp_reshardable``: per model-parallel rank ``g``, buffer, DDP bucket and field the flat record
  ``[chained_<i>.]optimizer.distributed.dp_group_idx_<g>.gbuf_idx_<b>.dtype_<(param, grad)>.bucket_idx_<k>.<field>``
  and the ShardedObjects ``...dp_group_idx_<g>.{optimizer,per_bucket_numel,per_bucket_numel_unpadded,grad_scaler}``;
- ``plain`` (no distributed optimizer): megatron-core's plain optimizer's ``optimizer.state.{fp32_param (bf16/fp16
  only),exp_avg,exp_avg_sq}.<model key>``, ``state.common_step`` and ``param_groups`` in the common state.

A MoE model at expert parallel size > 1 chains a dense and an expert optimizer (``get_megatron_optimizer``):
``ChainedOptimizer.sharded_state_dict`` (megatron/core/optimizer/optimizer.py) returns ``{0: dense, 1: expert}``;
it adds the ``chained_<i>.`` key prefix unless the form is fully reshardable (or plain) and the metadata has
``chained_optim_avoid_prefix`` (Megatron-LM's ``_build_sharded_state_dict_metadata`` sets it from core_v0.14.0 on;
megatron-core 0.13.1 and older always prefix), so the model-space and plain records keep their model keys (an
expert key its global expert axis) or carry the prefix (``chain_prefixes``: read as the records are named), and the
dp_reshardable ones are prefixed. The common state's ``optimizer`` is then ``{0: {...}, 1: {...}}`` (int keys; ``dist_checkpointing``
drops the all-sharded ``param_state``), ``ChainedOptimizer.load_state_dict`` reading them in key order.
"""

from __future__ import annotations

from typing import Any

from pgconvert.model.config import ModelConfig
from pgconvert.model.grid import RankCoord
from pgconvert.model.layout import ParallelLayout
from pgconvert.optimizer.order import OptimizerRules, chain, optimizer_count
from pgconvert.optimizer.scaler import GRAD_SCALER
from pgconvert.optimizer.source import FORM_FP16, FORM_FP32

FULLY_RESHARDABLE = "fully_reshardable"
DP_RESHARDABLE = "dp_reshardable"
FS_MODEL_SPACE = "fully_sharded_model_space"
# The content-metadata flag that keeps chained optimizers' model-space and plain records unprefixed.
AVOID_PREFIX = "chained_optim_avoid_prefix"
# megatron-core's plain (non-distributed) optimizer: no param_state_sharding_type.
PLAIN = "plain"
# The optimizer records go to data files of their own beside the model's ``__0_<n>.distcp``: ``__1_0.distcp``,
# ``__1_1.distcp``, ... (a new one past ``--max-shard-size`` bytes of values, as the model's).
RECORDS_PREFIX = "__1_"
RECORDS_FILE = f"{RECORDS_PREFIX}0.distcp"


def records_file(number: int) -> str:
    """The name of the optimizer records' data file ``number``."""
    return RECORDS_FILE if number == 0 else f"{RECORDS_PREFIX}{number}.distcp"
# The stored field of each per-parameter key, per model-space form.
MODEL_SPACE_FIELDS = {
    FULLY_RESHARDABLE: {"param": "param", "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"},
    FS_MODEL_SPACE: {"param": "fp32_param", "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"},
}
# The stored field of each per-parameter key, per plain form ("": the model weight itself is the master).
PLAIN_FIELDS = {FORM_FP16: {"param": "fp32_param", "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq",
                            "momentum_buffer": "momentum_buffer"},
                FORM_FP32: {"param": "", "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq",
                            "momentum_buffer": "momentum_buffer"}}


def state_key(stored_field: str, model_key: str) -> str:
    """The model-space or plain record of ``stored_field`` of the model tensor stored as ``model_key``."""
    return f"optimizer.state.{stored_field}.{model_key}"


def record_prefix(config: ModelConfig, layout: ParallelLayout, coord: RankCoord, optimizer: int = 0,
                  rules: OptimizerRules = OptimizerRules()) -> str:
    """``[chained_<i>.]optimizer.distributed.dp_group_idx_<g>`` of chained optimizer ``optimizer`` on rank ``coord``:
    ``g`` the rank in its model-parallel group (dense: tp-pp; expert: expert tp-ep-pp, expert tp fastest). A layer-wise
    Muon run's Adam optimizer (``rules``) is the second of two, a dense one."""
    chained = f"chained_{optimizer}." if optimizer_count(config, layout, rules) > 1 else ""
    if not chain(config, layout, rules)[optimizer].expert:
        index = coord.tp + layout.tp * coord.pp
    else:
        etp = coord.tp if coord.etp is None else coord.etp
        index = etp + layout.expert_tp_size * (coord.ep + layout.ep * coord.pp)
    return f"{chained}optimizer.distributed.dp_group_idx_{index}"


def bucket_key(prefix: str, buffer: int, dtype_key: tuple[Any, Any], bucket: int, field: str) -> str:
    """The dp_reshardable record of ``field`` of a buffer's bucket (``prefix``: ``record_prefix``; ``dtype_key``:
    the buffer's ``(param dtype, grad dtype)``)."""
    return f"{prefix}.gbuf_idx_{buffer}.dtype_({dtype_key[0]}, {dtype_key[1]}).bucket_idx_{bucket}.{field}"


def object_key(prefix: str, name: str) -> str:
    """The stored entry of the dp_reshardable ShardedObject ``name`` (``optimizer``, ``per_bucket_numel``,
    ``grad_scaler``…) of a model-parallel rank (``prefix``: ``record_prefix``)."""
    return f"{prefix}.{name}/shard_0_1"


def scaler_key(prefix: str) -> str:
    """The dp_reshardable ShardedObject of a model-parallel rank's grad scaler."""
    return object_key(prefix, GRAD_SCALER)


def chained_entries(optimizer: Any) -> list[Any]:
    """The common state's ``optimizer`` per chained optimizer: ``{0: …, 1: …}`` in key order, else the one entry."""
    if isinstance(optimizer, dict) and optimizer and all(type(key) is int for key in optimizer):
        return [optimizer[key] for key in sorted(optimizer)]
    return [optimizer]


def chain_prefixes(count: int, prefixed: bool) -> list[str]:
    """Per chained optimizer (``count``), the prefix of its model-space and plain records: ``chained_<i>.`` where
    several are chained and their records are ``prefixed``, else none. megatron-core 0.13.1 and older always prefix
    them; 0.14.0 and later unless the content metadata sets ``chained_optim_avoid_prefix`` (Megatron-LM does from
    core_v0.14.0 on, and reads it back on load)."""
    return [f"chained_{index}." for index in range(count)] if count > 1 and prefixed else [""] * count


def common_entry(groups: list[list[dict[str, Any]]], form: str = FULLY_RESHARDABLE) -> dict[Any, Any]:
    """The common state's ``optimizer`` for these chained optimizers' param groups (with ``step``), each entry
    naming ``form`` (one of the model-space forms)."""
    entries = [{"optimizer": {"param_groups": own}, "param_state_sharding_type": form} for own in groups]
    return entries[0] if len(entries) == 1 else dict(enumerate(entries))
