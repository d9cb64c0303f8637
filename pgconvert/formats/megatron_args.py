"""Every field of a Megatron run's ``args`` that pgconvert reads, in one table, with Megatron-LM's facts.

A Megatron checkpoint (per-rank or ``torch_dist``) describes its model, layout and training run in the
``args`` namespace Megatron-LM's ``parse_args`` + ``validate_args`` built (megatron/training/arguments.py;
many fields are megatron-core ``TransformerConfig`` fields turned into flags by ``ArgumentGroupFactory``).
Each ``ArgField`` row says, for one field: Megatron-LM's default (what those two leave when the flag is
not given; Megatron-LM d98e8a64), whether Megatron-LM itself ever writes None for it (an optional
setting that really is unset: ``num_experts``, ``window_size``), and what pgconvert does when the field
is absent (an older Megatron-LM without the flag: its default) and when it is None.

A None that the field's writer never writes (``args.rotary_base=None``) is not a setting: pgconvert then
computes with Megatron-LM's default, or with what its ``validate_args`` derives, and says so in a notice
naming the file, the field and the value (``none_notices``; ``--strict`` refuses it). Both Megatron
loaders get it through ``pgconvert.formats.megatron.layout_from_args``, the first reader they call.
Fields pgconvert only carries into the target's ``args`` or reports (``carried``) and the ones without
which no model is described (``required``, refused by name) have no notice.

Rows of settings whose readers live in ``pgconvert.semantics`` take their values from the constants those
readers use; the tests read every row's None and its stated value through the readers and compare.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pgconvert.families import CARRIED_SETTINGS
from pgconvert.formats.hybrid_args import LINEAR_ATTENTION_DEFAULTS, LINEAR_ATTENTION_SIZES, MAMBA_DEFAULTS
from pgconvert.formats.strict import fallback
from pgconvert.model.config import POSTNORM_OFF
from pgconvert.optimizer.order import EMERGING
from pgconvert.semantics import CORE_ONLY_DEFAULTS, MEGATRON_DEFAULT_DROPOUT
from pgconvert.semantics.mla import MEGATRON_MLA_DEFAULTS
from pgconvert.semantics.rope import MEGATRON_DEFAULT_ROPE_SCALING_FACTOR
from pgconvert.semantics.yarn import YARN_DEFAULTS, uses_yarn

# Megatron-LM's defaults (arguments.py, d98e8a64) that pgconvert's Megatron readers outside semantics fall back to.
MEGATRON_DEFAULTS: dict[str, Any] = {
    "rotary_base": 10000, "make_vocab_size_divisible_by": 128, "layernorm_epsilon": 1e-5,
    "normalization": "LayerNorm", "moe_router_topk": 2, "moe_layer_freq": 1, "moe_router_score_function": "softmax",
    "moe_aux_loss_coeff": 0.0, "rotary_percent": 1.0, "transformer_impl": "transformer_engine",
    "rotary_scaling_factor": 1.0, "mscale": YARN_DEFAULTS["yarn_mscale"],
    "mscale_all_dim": YARN_DEFAULTS["yarn_mscale_all_dim"],
}
_NOT_GIVEN = object()

Reader = Callable[[argparse.Namespace], Any]


def _always(args: argparse.Namespace) -> bool:
    return True


@dataclass(frozen=True)
class ArgField:
    """One field of ``args`` that pgconvert reads.

    ``default``: Megatron-LM's value when its flag is not given (text); ``writes_none``: Megatron-LM (or
    ``origin``, the writer of a field Megatron-LM has no flag for) writes None for it; ``absent`` / ``none``:
    what pgconvert does without the field / with None; ``readers``: where it is read; ``value``: the value
    pgconvert computes with for None (``why``: Megatron-LM's default or what its validate_args derives);
    ``when``: the args whose model or run uses the field (an expert setting: a model with experts);
    ``kind``: ``read``, ``required`` (no model without it) or ``carried`` (only carried or reported).
    """

    name: str
    default: str
    writes_none: bool
    absent: str
    none: str
    readers: str
    value: Reader | None = None
    why: str = "Megatron-LM's default"
    when: Callable[[argparse.Namespace], bool] = _always
    origin: str = "Megatron-LM"
    kind: str = "read"

    @property
    def notices_none(self) -> bool:
        """Whether a None in ``args`` is named in a notice (``--strict``: refused)."""
        return self.kind == "read" and not self.writes_none

    def notice(self, args: argparse.Namespace) -> str:
        """The notice for ``args.<name>=None``."""
        used = f"using {self.value(args)!r} ({self.why})" if self.value is not None else self.none
        return f"args.{self.name}=None, which {self.origin} never writes: {used}"


def _constant(value: Any) -> Reader:
    return lambda args: value


def _given(args: argparse.Namespace, name: str) -> Any:
    """``args.<name>``; None when absent."""
    return getattr(args, name, None)


def _experts(args: argparse.Namespace) -> bool:
    return bool(_given(args, "num_experts"))


def _mla(args: argparse.Namespace) -> bool:
    return bool(_given(args, "multi_latent_attention"))


def _grouped_experts(args: argparse.Namespace) -> bool:
    return _experts(args) and bool(_given(args, "moe_grouped_gemm"))


def _muon(args: argparse.Namespace) -> bool:
    return _given(args, "optimizer") == "muon"


def _layer_wise(args: argparse.Namespace) -> bool:
    return _given(args, "optimizer") in EMERGING and bool(_given(args, "use_layer_wise_distributed_optimizer"))


def _mla_yarn(args: argparse.Namespace) -> bool:
    return uses_yarn(args) and _mla(args) and _given(args, "position_embedding_type") != "yarn"


def megatron_ffn_hidden_size(hidden_size: int, swiglu: bool) -> int:
    """Megatron-LM's validate_args for ``--ffn-hidden-size`` not given: ``4 * hidden_size``, with
    ``--swiglu`` two thirds of it rounded down to a multiple of 64."""
    return int((4 * hidden_size * 2 / 3) / 64) * 64 if swiglu else 4 * hidden_size


def _ffn_hidden_size(args: argparse.Namespace) -> Any:
    hidden = _given(args, "hidden_size")
    return megatron_ffn_hidden_size(hidden, bool(_given(args, "swiglu"))) if isinstance(hidden, int) else None


def _kv_channels(args: argparse.Namespace) -> Any:
    hidden, heads = _given(args, "hidden_size"), _given(args, "num_attention_heads")
    return hidden // heads if isinstance(hidden, int) and isinstance(heads, int) and heads > 0 else None


def _recorded_size(args: argparse.Namespace, name: str) -> int:
    value = _given(args, name)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 1


def megatron_data_parallel_size(args: Any) -> int:
    """``args.data_parallel_size``, else what Megatron-LM's validate_args derives:
    ``world_size // (tensor × pipeline × context parallel sizes)`` (1 without a ``world_size``)."""
    recorded = _given(args, "data_parallel_size")
    if recorded:
        return int(recorded)
    model_parallel = 1
    for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size"):
        model_parallel *= _recorded_size(args, name)
    world = _recorded_size(args, "world_size")
    return world // model_parallel if world % model_parallel == 0 else 1


def _params_dtype(args: argparse.Namespace) -> torch.dtype:
    """Megatron-LM's validate_args: bfloat16 with ``--bf16``, float16 with ``--fp16``, else float32."""
    return torch.bfloat16 if _given(args, "bf16") else torch.float16 if _given(args, "fp16") else torch.float32


def _position_type(args: argparse.Namespace) -> str:
    return "rope" if _given(args, "use_rotary_position_embeddings") else "learned_absolute"


def _norm_epsilon(args: argparse.Namespace) -> Any:
    return _given(args, "layernorm_epsilon") or MEGATRON_DEFAULTS["layernorm_epsilon"]


def _defaulted(name: str, value: Any, readers: str, when: Callable[[argparse.Namespace], bool] = _always,
               origin: str = "Megatron-LM") -> ArgField:
    """A field Megatron-LM always writes, with a plain default: absent and None both read as it."""
    text = repr(value)
    return ArgField(name, text, False, text, text, readers, _constant(value),
                    when=when, origin=origin,
                    why="Megatron-LM's default" if origin.startswith("Megatron-LM") else f"{origin}'s default")


def _optional(name: str, default: str, meaning: str, readers: str, origin: str = "Megatron-LM") -> ArgField:
    """A field Megatron-LM writes None for (the setting is unset): absent and None both mean ``meaning``."""
    return ArgField(name, default, True, meaning, meaning, readers, origin=origin)


def _carried(name: str, default: str, absent: str, readers: str) -> ArgField:
    """A field pgconvert computes nothing from: carried into the target's args as recorded, or reported."""
    return ArgField(name, default, False, absent, "kept as recorded", readers, kind="carried")


_LAYOUT = "formats.megatron.layout_from_args"
_CONFIG = "formats.megatron.config_from_args"
_SEMANTICS = "semantics.from_args"
_OPTIMIZER = "optimizer (flat buffers, param groups)"

_LAYOUT_ROWS: tuple[ArgField, ...] = (
    _defaulted("tensor_model_parallel_size", 1, _LAYOUT),
    _defaulted("pipeline_model_parallel_size", 1, _LAYOUT),
    _defaulted("expert_model_parallel_size", 1, _LAYOUT),
    ArgField("expert_tensor_parallel_size", "tensor_model_parallel_size (validate_args)", False,
             "tensor_model_parallel_size", "tensor_model_parallel_size", _LAYOUT,
             lambda args: _recorded_size(args, "tensor_model_parallel_size"),
             "what Megatron-LM's validate_args derives: tensor_model_parallel_size", when=_experts),
    _optional("virtual_pipeline_model_parallel_size", "None (validate_args derives it)", "no virtual pipeline",
              _LAYOUT),
    _optional("pipeline_model_parallel_layout", "None", "no layout string", _LAYOUT),
    _optional("decoder_first_pipeline_num_layers", "None", "even stages", _LAYOUT),
    _optional("decoder_last_pipeline_num_layers", "None", "even stages", _LAYOUT),
)

_MODEL_ROWS: tuple[ArgField, ...] = (
    *(ArgField(name, "none: required by validate_args", False, "refused (named)", "refused (named)", _CONFIG,
               kind="required") for name in ("num_layers", "hidden_size", "num_attention_heads")),
    ArgField("ffn_hidden_size", "validate_args: 4 * hidden_size; with --swiglu int(4 * hidden_size * 2 / 3 / 64) * 64",
             False, "validate_args' value", "validate_args' value", _CONFIG, _ffn_hidden_size,
             "what Megatron-LM's validate_args derives: 4 * hidden_size, with --swiglu "
             "int(4 * hidden_size * 2 / 3 / 64) * 64"),
    ArgField("kv_channels", "validate_args: hidden_size // num_attention_heads", False,
             "hidden_size // num_attention_heads", "hidden_size // num_attention_heads", _CONFIG, _kv_channels,
             "what Megatron-LM's validate_args derives: hidden_size // num_attention_heads"),
    _defaulted("group_query_attention", False, _CONFIG),
    ArgField("num_query_groups", "1 (read only with group_query_attention)", False, "num_attention_heads",
             "num_attention_heads", _CONFIG, lambda args: _given(args, "num_attention_heads"),
             "megatron-core's TransformerConfig takes num_attention_heads for None",
             when=lambda args: bool(_given(args, "group_query_attention"))),
    ArgField("position_embedding_type", "'learned_absolute'; validate_args: 'rope' with --use-rotary-position-embeddings",
             False, "'rope' with use_rotary_position_embeddings, else 'learned_absolute'",
             "as absent", _CONFIG, _position_type,
             "Megatron-LM's default; validate_args sets 'rope' for --use-rotary-position-embeddings"),
    _defaulted("use_rotary_position_embeddings", False, _CONFIG,
               when=lambda args: _given(args, "position_embedding_type") is None),
    _optional("vocab_size", "None (the tokenizer's)", "unknown: the padded table is kept (a guess, notice)", _CONFIG),
    ArgField("padded_vocab_size", "the tokenizer's vocab padded (always written)", False,
             "the stored word embeddings' rows", "the stored word embeddings' rows are the vocab tables' size",
             "loaders/megatron"),
    ArgField("max_position_embeddings", "none: required by validate_args", False, "unrecorded (None)",
             "kept unrecorded (None); a learned_absolute model needs it and is refused", _CONFIG),
    _defaulted("make_vocab_size_divisible_by", MEGATRON_DEFAULTS["make_vocab_size_divisible_by"], _CONFIG),
    _defaulted("swiglu", False, _CONFIG),
    _defaulted("quick_geglu", False, _CONFIG),
    ArgField("openai_gelu", "False (megatron-core's TransformerConfig has no such field: F.gelu)", False, "False",
             "False", _CONFIG, _constant(False),
             "Megatron-LM's default; only args that record gated_linear_unit (pgconvert's) mean gelu_tanh by it"),
    _defaulted("squared_relu", False, _CONFIG),
    _defaulted("gated_linear_unit", False, _CONFIG, origin="megatron-core's TransformerConfig"),
    _defaulted("normalization", MEGATRON_DEFAULTS["normalization"], _CONFIG),
    ArgField("norm_epsilon", "1e-5 (--norm-epsilon; other versions write layernorm_epsilon)", False,
             "layernorm_epsilon", "layernorm_epsilon", _CONFIG, _norm_epsilon,
             "args.layernorm_epsilon, what other Megatron-LM versions write, else its default",
             origin="Megatron-LM core_v0.4.0 to core_v0.15"),
    _defaulted("layernorm_epsilon", MEGATRON_DEFAULTS["layernorm_epsilon"], _CONFIG,
               when=lambda args: not _given(args, "norm_epsilon")),
    _defaulted("add_bias_linear", True, _CONFIG),
    ArgField("add_qkv_bias", "False; validate_args: True with add_bias_linear", False,
             "add_bias_linear (Megatron-LM before core_v0.5.0: linear_qkv's bias is add_bias_linear's)",
             "add_bias_linear", _CONFIG, lambda args: _given(args, "add_bias_linear") is not False,
             "what Megatron-LM's validate_args derives: add_bias_linear turns it on"),
    _defaulted("qk_layernorm", False, _CONFIG),
    _defaulted("untie_embeddings_and_output_weights", False, _CONFIG),
    _defaulted("rotary_base", MEGATRON_DEFAULTS["rotary_base"], _CONFIG),
    ArgField("params_dtype", "validate_args: bfloat16 with --bf16, float16 with --fp16, else float32", False,
             "from bf16 / fp16", "from bf16 / fp16", _CONFIG, _params_dtype,
             "what Megatron-LM's validate_args derives from bf16 / fp16"),
    _defaulted("bf16", False, f"{_CONFIG}, optimizer.flat (buffer dtype key)"),
    _defaulted("fp16", False, f"{_CONFIG}, optimizer.flat (buffer dtype key)"),
    ArgField("transformer_impl", repr(MEGATRON_DEFAULTS["transformer_impl"]), False,
             "per-rank: the norm keys, else 'local' (older Megatron-LM); torch_dist: 'transformer_engine' (a guess, notice)",
             "the norm keys of a per-rank checkpoint, else 'transformer_engine'", "loaders",
             _constant(MEGATRON_DEFAULTS["transformer_impl"]),
             "Megatron-LM's default, where a per-rank checkpoint's norm keys do not tell the layer spec"),
    _optional("mtp_num_layers", "None", "no MTP layers", _CONFIG),
)

_MOE_ROWS: tuple[ArgField, ...] = (
    _optional("num_experts", "None (validate_args: 0 is None)", "a dense model", f"{_LAYOUT}, {_CONFIG}"),
    ArgField("moe_ffn_hidden_size", "validate_args: ffn_hidden_size for a model with experts", False,
             "ffn_hidden_size", "ffn_hidden_size", _CONFIG, lambda args: _given(args, "ffn_hidden_size")
             or _ffn_hidden_size(args), "what Megatron-LM's validate_args derives: ffn_hidden_size", when=_experts),
    _defaulted("moe_layer_freq", MEGATRON_DEFAULTS["moe_layer_freq"], _CONFIG, when=_experts),
    _defaulted("moe_router_topk", MEGATRON_DEFAULTS["moe_router_topk"], _CONFIG, when=_experts),
    _optional("moe_shared_expert_intermediate_size", "None", "no shared experts", _CONFIG),
    _defaulted("moe_shared_expert_gate", False, _CONFIG, when=_experts),
    _defaulted("moe_router_enable_expert_bias", False, _CONFIG, when=_experts),
    _defaulted("moe_grouped_gemm", False, "loaders/torch_dist, optimizer", when=_experts),
    _defaulted("moe_router_score_function", MEGATRON_DEFAULTS["moe_router_score_function"], _SEMANTICS,
               when=_experts),
    _defaulted("moe_router_pre_softmax", False, _SEMANTICS, when=_experts),
    _optional("moe_router_topk_scaling_factor", "None", "no scaling", _SEMANTICS),
    _defaulted("moe_aux_loss_coeff", MEGATRON_DEFAULTS["moe_aux_loss_coeff"], _SEMANTICS, when=_experts),
    _optional("moe_router_num_groups", "None", "no router groups", "semantics.mla"),
    _optional("moe_router_group_topk", "None", "no router groups", "semantics.mla"),
    _defaulted("moe_apply_probs_on_input", False, _SEMANTICS, when=_experts),
)

_POSITION_ROWS: tuple[ArgField, ...] = (
    _defaulted("rotary_percent", MEGATRON_DEFAULTS["rotary_percent"], _SEMANTICS),
    _defaulted("rotary_interleaved", False, _SEMANTICS),
    _defaulted("use_rope_scaling", False, "semantics.rope"),
    _defaulted("rope_scaling_factor", MEGATRON_DEFAULT_ROPE_SCALING_FACTOR, "semantics.rope",
               when=lambda args: bool(_given(args, "use_rope_scaling"))),
    _optional("rotary_seq_len_interpolation_factor", "None", "no linear scaling", "semantics.rope"),
    _optional("no_rope_freq", "None", "RoPE in every layer", "semantics.rope"),
    _optional("window_size", "None", "no sliding window", _SEMANTICS),
    _optional("window_attn_skip_freq", "None", "every layer windowed", _SEMANTICS),
    _defaulted("rotary_scaling_factor", MEGATRON_DEFAULTS["rotary_scaling_factor"], "semantics.yarn", when=uses_yarn),
    _defaulted("mscale", MEGATRON_DEFAULTS["mscale"], "semantics.yarn", when=uses_yarn),
    _defaulted("mscale_all_dim", MEGATRON_DEFAULTS["mscale_all_dim"], "semantics.yarn", when=uses_yarn),
    *(_optional(f"yarn_{name}", "None", f"{YARN_DEFAULTS[f'yarn_{name}']!r} (as _apply_yarn_config_from_args)",
                "semantics.yarn")
      for name in ("original_max_position_embeddings", "beta_fast", "beta_slow", "correction_range_round_to_int")),
    # Multi-latent attention's own YaRN fields (MLATransformerConfig; Megatron-LM has no flag for them).
    *(_defaulted(name, YARN_DEFAULTS[f"yarn_{name}"], "semantics.yarn", when=_mla_yarn,
                 origin="megatron-core's MLATransformerConfig")
      for name in ("original_max_position_embeddings", "beta_fast", "beta_slow")),
)

_ATTENTION_ROWS: tuple[ArgField, ...] = (
    _defaulted("multi_latent_attention", False, "semantics.mla, semantics.yarn"),
    _optional("rope_type", "None (MLATransformerConfig: 'yarn')", "'yarn' with multi-latent attention",
              "semantics.yarn"),
    _optional("q_lora_rank", "None", "one q projection", "semantics.mla"),
    *(_defaulted(name, default, "semantics.mla", when=_mla)
      for name, default in MEGATRON_MLA_DEFAULTS.items() if default is not None),
    _defaulted("layernorm_zero_centered_gamma", False, _SEMANTICS),
    _defaulted("qk_l2_norm", False, _SEMANTICS),
    _defaulted("apply_layernorm_1p", False, _SEMANTICS, origin="Megatron-LM before core_v0.16"),
    _defaulted("attention_dropout", MEGATRON_DEFAULT_DROPOUT, _SEMANTICS),
    _defaulted("hidden_dropout", MEGATRON_DEFAULT_DROPOUT, _SEMANTICS),
    *(_defaulted(name, default, _SEMANTICS) for name, default in CORE_ONLY_DEFAULTS.items() if default is not None),
    *(_optional(name, "None", "off", _SEMANTICS) for name, default in CORE_ONLY_DEFAULTS.items() if default is None),
    _optional("softmax_scale", "None: 1/sqrt(kv_channels)", "1/sqrt(kv_channels)", "semantics.attention_scale",
              origin="megatron-core's TransformerConfig"),
    _optional("query_pre_attn_scalar", "none (Megatron-Bridge's Gemma 2)", "softmax_scale decides",
              "semantics.attention_scale", origin="Megatron-Bridge"),
    # Settings megatron-core does not compute: Megatron-Bridge's and pgconvert's names (semantics.postnorm),
    # the families' carried ones (semantics.carried).
    *(_defaulted(name, default, "semantics.postnorm", origin="pgconvert")
      for name, default in POSTNORM_OFF.items() if default is not None),
    *(_optional(name, "none", "off", "semantics.postnorm", origin="Megatron-Bridge")
      for name, default in POSTNORM_OFF.items() if default is None),
    *(_defaulted(setting.name, setting.default, "semantics.carried", origin="pgconvert")
      for setting in CARRIED_SETTINGS if setting.default is not None),
    *(_optional(setting.name, "none", "not carried", "semantics.carried", origin="pgconvert")
      for setting in CARRIED_SETTINGS if setting.default is None),
)

_RUN_ROWS: tuple[ArgField, ...] = (
    ArgField("data_parallel_size", "validate_args: world_size // (tp * pp * cp)", False,
             "world_size // (tp * pp * cp), else 1", "as absent", "optimizer.data_parallel", megatron_data_parallel_size,
             "what Megatron-LM's validate_args derives: world_size // (tensor x pipeline x context parallel "
             "sizes), 1 without world_size"),
    ArgField("world_size", "the job's (always written)", False, "data-parallel size 1",
             "the data-parallel size is then 1", "optimizer.data_parallel",
             when=lambda args: not _given(args, "data_parallel_size")),
    _defaulted("context_parallel_size", 1, f"optimizer, {'formats.megatron.args_for_target'}"),
    _optional("ddp_bucket_size", "None", "DistributedDataParallel's default size", _OPTIMIZER),
    _optional("ddp_num_buckets", "None", "not given (a value: the rank's parameter count over it)", _OPTIMIZER),
    _defaulted("overlap_grad_reduce", False, _OPTIMIZER),
    _defaulted("overlap_param_gather_with_optimizer_step", False, _OPTIMIZER,
               when=lambda args: bool(_given(args, "overlap_grad_reduce"))),
    _defaulted("ddp_pad_buckets_for_high_nccl_busbw", False, _OPTIMIZER),
    _defaulted("optimizer", "adam", f"{_OPTIMIZER}, optimizer.checks (Adam's state, or Muon's or Lion's)"),
    _defaulted("use_layer_wise_distributed_optimizer", False,
               f"{_OPTIMIZER}, optimizer.checks (Muon's or Lion's layer-wise distributed optimizer: read from "
               "torch_dist)",
               origin="Megatron-LM's validate_args"),
    _defaulted("use_layer_wise_param_layout", True, f"{_OPTIMIZER} (the legacy layout is refused)", when=_layer_wise),
    _defaulted("muon_scalar_optimizer", "adam", f"{_OPTIMIZER} (Adam or Lion; another is refused)", when=_muon),
    _optional("decoupled_lr", "None", "no embedding/output param group (a value: its max_lr)", _OPTIMIZER),
    _optional("decoupled_min_lr", "None", "that group's min_lr is min_lr (a value: its min_lr)", _OPTIMIZER),
    _defaulted("apply_wd_to_qk_layernorm", False, _OPTIMIZER),
    _defaulted("moe_use_legacy_grouped_gemm", False, _OPTIMIZER, when=_grouped_experts,
               origin="Megatron-LM before d98e8a64"),
    _defaulted("moe_single_grouped_weight", False, _OPTIMIZER, when=_grouped_experts),
    _defaulted("moe_single_grouped_bias", False, _OPTIMIZER, when=_grouped_experts),
    _defaulted("accumulate_allreduce_grads_in_fp32", False, "optimizer.flat (buffer dtype key)"),
    *(_carried(name, "0 (the training loop's count)", "not reported; verify compares it where both record it",
               "optimizer.export, run.verify_optimizer")
      for name in ("consumed_train_samples", "consumed_valid_samples", "skipped_train_samples")),
    *(_carried(name, "False", "written False (Megatron-LM's tools/checkpoint reads it)",
               "formats.megatron.args_for_target")
      for name in ("sequence_parallel", "apply_query_key_layer_scaling")),
)

def _hybrid(args: argparse.Namespace) -> bool:
    return _given(args, "hybrid_override_pattern") is not None


_HYBRID = "formats.hybrid_args.hybrid_from_args"
# Megatron-LM core_v0.16.1's pretrain_mamba.py (hybrid models, pgconvert.formats.hybrid_args); the Mamba
# sizes are megatron-core TransformerConfig fields, turned into flags with their defaults.
_HYBRID_ROWS: tuple[ArgField, ...] = (
    _optional("hybrid_override_pattern", "None", "a GPT model (attention and an MLP in every layer)", _HYBRID),
    *(_defaulted(name, MAMBA_DEFAULTS[name], _HYBRID, when=_hybrid, origin="Megatron-LM (megatron-core's TransformerConfig)")
      for name in ("mamba_state_dim", "mamba_head_dim", "mamba_num_groups")),
    _optional("mamba_num_heads", "None", "hidden_size * 2 // mamba_head_dim (megatron-core's MambaMixer)", _HYBRID),
)


def _linear_attention(args: argparse.Namespace) -> bool:
    return _given(args, "experimental_attention_variant") is not None


_LINEAR = "formats.hybrid_args.linear_attention_from_args"
_CORE_FIELD = "Megatron-LM (megatron-core's TransformerConfig)"
# Gated delta net layers (Qwen3-Next) and the attention output gate: megatron-core TransformerConfig fields.
_LINEAR_ATTENTION_ROWS: tuple[ArgField, ...] = (
    _defaulted("attention_output_gate", False, _LINEAR, origin=_CORE_FIELD),
    _optional("experimental_attention_variant", "None", "no linear attention (self-attention in every layer)",
              _LINEAR),
    _optional("linear_attention_freq", "None", "no linear attention layers; with experimental_attention_variant "
              "refused by name (megatron-core's TransformerConfig asserts it is set)", _LINEAR),
    *(_defaulted(name, LINEAR_ATTENTION_DEFAULTS[name], _LINEAR, when=_linear_attention, origin=_CORE_FIELD)
      for name in LINEAR_ATTENTION_SIZES),
)

_VISION = "formats.vision_args.vision_from_args"
_PGCONVERT_VISION = "pgconvert (Megatron-Bridge's VL provider keeps HF's config object)"
# A vision-language model (pgconvert.formats.vision_args): megatron-core's multimodal RoPE sections, and the vision
# part's HF config and token ids, which pgconvert records as JSON text.
_VISION_ROWS: tuple[ArgField, ...] = (
    _optional("mrope_section", "None", "no multimodal RoPE (read only with position_embedding_type='mrope')",
              _VISION),
    _optional("vision_config", "None", "a text model (no vision part)", _VISION, origin=_PGCONVERT_VISION),
    _optional("vision_token_ids", "None", "no image or video token ids", _VISION, origin=_PGCONVERT_VISION),
)

MEGATRON_ARGS: tuple[ArgField, ...] = (*_LAYOUT_ROWS, *_MODEL_ROWS, *_MOE_ROWS, *_POSITION_ROWS, *_ATTENTION_ROWS,
                                       *_HYBRID_ROWS, *_LINEAR_ATTENTION_ROWS, *_VISION_ROWS, *_RUN_ROWS)
ARG_FIELDS: dict[str, ArgField] = {row.name: row for row in MEGATRON_ARGS}


def none_notices(args: argparse.Namespace, path: Path, strict: bool, notices: list[str] | None) -> None:
    """A notice for every field ``args`` holds as None where its writer never writes None (and the model
    or run uses it), naming the file, the field and the value pgconvert computes with; ``strict``: the
    first is a ``StrictModeError``."""
    recorded = vars(args)
    for row in MEGATRON_ARGS:
        if row.notices_none and recorded.get(row.name, _NOT_GIVEN) is None and row.when(args):
            fallback(f"{path}: {row.notice(args)}", strict, notices)


def markdown_table() -> str:
    """The table as docs/safety.md shows it."""
    lines = ["| field | written by | default | writes None | absent | None |", "|---|---|---|---|---|---|"]
    for row in MEGATRON_ARGS:
        none = f"{row.none}; notice, `--strict` refuses" if row.notices_none else row.none
        lines.append(f"| `{row.name}` | {row.origin} | {row.default} | {'yes' if row.writes_none else 'no'} "
                     f"| {row.absent} | {none} |")
    return "\n".join(lines) + "\n"
