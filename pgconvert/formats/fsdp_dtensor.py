"""Facts of Megatron-FSDP's checkpoint format (``fsdp_dtensor``) shared by its loader and saver.

Megatron-LM writes it with ``--use-megatron-fsdp --ckpt-format fsdp_dtensor`` (megatron/training/
checkpointing.py at d98e8a64: ``generate_state_dict`` takes the wrapped model's ``state_dict()``, whose
tensors are Megatron-FSDP DTensors, ``preprocess_fsdp_dtensor_state_dict`` renames them, and
``torch.distributed.checkpoint.save`` writes the lot)::

    ROOT/latest_checkpointed_iteration.txt        "1000"
    ROOT/iter_0001000/
        .metadata         torch.distributed.checkpoint's Metadata (no metadata.json, no common.pt)
        __R_0.distcp      the chunks written by rank R

Entries (tests/data/megatron_lm/train_tp2dp2_fsdp_dtensor holds them as Megatron-LM wrote them):

- bytes entries ``args`` (the run's argparse.Namespace), ``iteration``, ``checkpoint_version``,
  ``num_floating_point_operations_so_far``, ``opt_param_scheduler.*``, ``rng_state.(<pp>, <tp>).0.*``
  (python and numpy states; the torch and tracker states are uint8 tensors);
- ``model.module.<GPTModel parameter name>``: every parameter at its global shape, TP-merged (each
  DTensor is ``Shard(tp_dim)`` over the TP mesh dimension and ``Shard(0)`` over the data-parallel one,
  whose chunks need not be even nor row-aligned to the TP pieces: any box is a chunk); layer and
  expert indices are global; in the optimizer's precision (fp32 main weights, also in a bf16 run);
- a gated ``linear_fc1`` (``--swiglu``) as two keys ``linear_fc1.weight_w`` (the gate) and
  ``linear_fc1.weight_v`` (the up projection), each ``[ffn, hidden]`` (``handle_swiglu_in_state_dict``):
  the canonical ``[gate; up]`` is their concatenation; QKV is megatron-core's fused TP1 layout;
- no ``_extra_state`` (``handle_fp8_extra_state_case`` drops them);
- routed experts under their global indices (``handle_experts_in_state_dict``), a gated expert's and shared expert's
  fc1 split as a dense one's; an MTP layer's inner layer as ``transformer_layer`` (``handle_mtp_in_state_dict``: the
  live module is ``mtp_model_layer``, which ``param_to_group_meta`` keeps); multi-latent attention's unfused
  projections (tests/data/megatron_lm/train_tp1ep2dp4_mla_moe_mtp_fsdp_dtensor_optim holds all three);
- with the optimizer (tests/data/megatron_lm/train_tp2dp2_fsdp_dtensor_optim):
  ``optimizer.state.module.module.module.<parameter name>.{exp_avg,exp_avg_sq}`` (fp32, the model key's global
  shape, chunked as the parameter; a gated fc1's as ``weight_w``/``weight_v``), ``<…>.step`` (torch Adam's 0-dim
  fp32 step per parameter), ``optimizer.param_to_group_meta.module.module.module.<parameter name>.<field>``
  bytes entries (each parameter's param-group hyperparameters, unsplit names); the fp32 masters are the
  ``model.`` entries themselves (``loaders/fsdp_dtensor/optimizer.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from pgconvert.errors import CheckpointError
from pgconvert.formats.megatron import resolve_megatron_iteration
# GATED_HALVES: handle_swiglu_in_state_dict's suffixes, megatron-core's singleton_local_shards ones too.
from pgconvert.formats.dcp_layout import CHECKPOINT_CONFIG_FILE, DCP_METADATA_FILE, GATED_HALVES
from pgconvert.io.limits import quote
from pgconvert.model.config import ModelConfig
from pgconvert.model.grid import RankCoord, build_converter_process_groups
from pgconvert.model.layout import ParallelLayout
from pgconvert.model.provider import MTP_LAYER_MODULE, provide
from pgconvert.optimizer.order import OptimizerRules, OptimizerSlot, chained_slots

MODEL_PREFIX = "model.module."
# An MTP layer's inner layer as the store names it.
CANONICAL_MTP_MODULE = MTP_LAYER_MODULE.rstrip(".")
# Followed by the wrapper modules' prefix (``module.module.module.`` in a bf16 run) and the parameter name.
OPTIMIZER_STATE_PREFIX = "optimizer.state."
OPTIMIZER_GROUP_PREFIX = "optimizer.param_to_group_meta."
SCHEDULER_PREFIX = "opt_param_scheduler."
# torch Adam's per-parameter step, a 0-dim fp32 record beside the moments.
STEP_FIELD = "step"
# The optimizer names a parameter by the wrapped model chunk's ``named_parameters()``: Megatron-FSDP's
# FullyShardedDataParallel and MegatronFSDP modules, and in a bf16/fp16 run Float16Module, around the GPTModel.
FP32_RUN_WRAPPERS = "module.module."
HALF_RUN_WRAPPERS = "module.module.module."
# The distributed optimizer's sharding type Megatron-LM asks for with this format (_build_sharded_state_dict_metadata).
FSDP_DTENSOR_FORM = "fsdp_dtensor"
# Why no pipeline-parallel layout is read or written: no such store exists.
NO_PIPELINE = ("Megatron-FSDP has no pipeline dimension (Megatron-LM d98e8a64's mcore_fsdp_adapter._get_dp_tp_mesh "
               "lays the world out as dp x ep x tp and fails at PP > 1)")
ARGS_KEY = "args"
ITERATION_KEY = "iteration"
# Entries that are neither model weights nor read: training state, accounted for and named in a notice.
TRAINING_STATE_PREFIXES = ("optimizer.", "rng_state.", SCHEDULER_PREFIX, "rerun_state_machine.")
FLOPS_KEY = "num_floating_point_operations_so_far"
COMMON_KEYS = (ARGS_KEY, ITERATION_KEY, "checkpoint_version", FLOPS_KEY)


@dataclass(frozen=True)
class FsdpLocation:
    """The keys a canonical tensor is stored under: one, or a gated fc1's halves (stacked on dim 0)."""

    keys: tuple[str, ...]

    def parts(self, rows: int) -> list[tuple[str, int, int]]:
        """``(key, first row, row count)`` of each key within the canonical tensor of ``rows`` rows."""
        length = rows // len(self.keys)
        return [(key, index * length, length) for index, key in enumerate(self.keys)]


def is_iteration_dir(path: Path) -> bool:
    """A DCP store without megatron-core's ``metadata.json`` (which marks a torch_dist iteration)."""
    return (path / DCP_METADATA_FILE).is_file() and not (path / CHECKPOINT_CONFIG_FILE).exists()


def resolve_iteration_dir(root: Path, iteration: int | None) -> tuple[Path, int | None, bool]:
    return resolve_megatron_iteration(root, iteration, is_iteration_dir)


def refuse_unknown_keys(config: ModelConfig, where: str, verb: str = "read") -> None:
    """Parts of a model whose fsdp_dtensor keys no golden of Megatron-LM's shows yet are refused, not guessed
    (hybrid models' Mamba and gated-delta-net layers are split by their own handlers, ``handle_gdn_in_state_dict``;
    a sparse-attention indexer's and a vision tower's were never saved here); ``verb``: "read" or "written"."""
    unknown = {"hybrid_override_pattern": config.hybrid_override_pattern,
               "experimental_attention_variant": config.linear_attention.experimental_attention_variant,
               "dsa_indexer_n_heads": config.attention.dsa_indexer_n_heads,
               "vision_config": "set" if config.vision.vision_config is not None else None}
    found = {name: value for name, value in unknown.items() if value}
    if found:
        raise CheckpointError(f"{where}: fsdp_dtensor checkpoints of models with {quote(found)} are not {verb} yet; "
                              f"pgconvert's fsdp_dtensor format holds GPT models of attention (multi-latent too), "
                              "dense MLP and MoE layers, and their multi-token prediction layers")


def tensor_locations(config: ModelConfig, rows: int) -> dict[str, FsdpLocation]:
    """Every canonical tensor's keys, in stream order: the parameter names of the whole model (a rank of
    the TP1 PP1 EP1 layout holds every tensor under its global name), a gated fc1 split in two, an MTP layer's inner
    layer as ``transformer_layer`` (``handle_mtp_in_state_dict`` renames Megatron-LM's ``mtp_model_layer``)."""
    groups = build_converter_process_groups(ParallelLayout())
    locations: dict[str, FsdpLocation] = {}
    stored = config.replace(mtp_layer_module=CANONICAL_MTP_MODULE)
    for spec in provide(stored, groups, padded_vocab_size=rows).specs:
        key = MODEL_PREFIX + spec.local_name
        halves = tuple(key + half for half in GATED_HALVES) if spec.rule.row_segments == 2 else (key,)
        locations[spec.canonical] = FsdpLocation(halves)
    return locations


def parameter_key(model_key: str) -> str:
    """A model entry's parameter name (``model.module.`` stripped; a gated fc1's half keeps its suffix)."""
    return model_key[len(MODEL_PREFIX):]


def state_key(wrappers: str, model_key: str, field: str) -> str:
    """The optimizer record of ``field`` of the parameter stored under ``model_key``."""
    return OPTIMIZER_STATE_PREFIX + wrappers + parameter_key(model_key) + "." + field


def is_training_state(key: str) -> bool:
    return key.startswith(TRAINING_STATE_PREFIXES)


def fsdp_slots(config: ModelConfig, layout: ParallelLayout, rules: OptimizerRules,
               vocab_rows: int) -> list[list[OptimizerSlot]]:
    """The param groups of Megatron-FSDP's one optimizer: every parameter of the model, routed experts too, in the
    groups of a dense run. Megatron-FSDP replaces the module's parameters with its own, which do not keep
    megatron-core's ``allreduce=False`` of an expert-parallel linear, so ``get_megatron_optimizer`` puts the experts
    in the dense groups (``is_expert_parallel`` False in their ``param_to_group_meta``, an EP2 run of Megatron-LM
    d98e8a64: tests/data/megatron_lm/train_tp1ep2dp4_mla_moe_mtp_fsdp_dtensor_optim)."""
    return chained_slots(config, replace(layout, ep=1, expert_tp=None), RankCoord(0, 0, 0), rules, vocab_rows)[0]
