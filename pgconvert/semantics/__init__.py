"""A model's semantics as data: every setting that changes what the model computes, in one table.

Each ``Setting`` row names the ``ModelConfig`` field(s) that hold it, the Megatron-LM argument(s)
(``megatron/training/arguments.py`` and megatron-core's ``TransformerConfig``, whose field names
are the argument names), where a ``torch_dist`` checkpoint keeps it (``common.pt``'s ``args``, the
same namespace as a per-rank file's) and the config.json key(s) of each HF family.

The table drives what pgconvert does with these settings:

* Megatron args -> ``ModelConfig`` (``from_args``) and back (``to_args``), for both Megatron formats;
  the config.json side lives in ``pgconvert.families`` (fields and rules), cross-checked by tests;
* a setting a target cannot express is lost only with a notice naming it, and ``--strict`` refuses
  it (``lose``): ``hf_losses`` for an HF target, ``hf_unrepresentable`` for config.json settings no
  Megatron argument holds;
* ``inspect`` prints ``describe(config)``; ``verify`` reports ``differences(a, b)`` as failures.
"""

from __future__ import annotations

import argparse
import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pgconvert.semantics import attention_scale
from pgconvert.semantics import mla as mla_args
from pgconvert.semantics import yarn
from pgconvert.model.config import ModelConfig
from pgconvert.errors import CheckpointError, StrictModeError
from pgconvert.io.limits import quote
from pgconvert.semantics import more as semantics_more  # f17a
from pgconvert.semantics.postnorm import (
    megatron_core_gaps,
    postnorm_from_args,
    postnorm_to_args,
)

log = logging.getLogger(__name__)

# megatron-core's llama3 RoPE scaling (RotaryEmbedding._apply_scaling) fixes these three.
MEGATRON_LLAMA3 = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
# Megatron-LM's argument defaults for settings a run's args may not record.
MEGATRON_DEFAULT_DROPOUT = 0.1
MEGATRON_DEFAULT_ROPE_SCALING_FACTOR = 8.0

ALL_FAMILIES = "*"


@dataclass(frozen=True)
class Setting:
    """One setting that changes the computation, and where each format keeps it."""

    name: str
    fields: tuple[str, ...]
    megatron: tuple[str, ...]
    common_pt: str
    hf: Mapping[str, str]
    note: str = ""


def _hf(**per_family: str) -> dict[str, str]:
    """Per-family HF keys; ``ALL`` stands for every other family."""
    return {ALL_FAMILIES if key == "ALL" else key: value for key, value in per_family.items()}


_ARGS = "common.pt['args'].{}"
_MOE = "Mixtral, Qwen3-MoE"  # DeepSeek's routers: the moe rows' DeepseekV2/V3 keys (pgconvert.families.deepseek)

SEMANTICS: tuple[Setting, ...] = (
    Setting("rope theta", ("rotary_base",), ("rotary_base",), _ARGS.format("rotary_base"),
            {ALL_FAMILIES: "rope_parameters.rope_theta (4.x: rope_theta)"}),
    Setting("rope scaling", ("rope_scaling", "rope_scaling_factor"),
            ("use_rope_scaling", "rope_scaling_factor", "rotary_seq_len_interpolation_factor"),
            _ARGS.format("use_rope_scaling / rope_scaling_factor / rotary_seq_len_interpolation_factor"),
            {ALL_FAMILIES: "rope_parameters.rope_type/factor (4.x: rope_scaling)"},
            "llama3 with low/high frequency factors 1/4 and 8192 original positions (what megatron-core "
            "hard-codes), linear and yarn (next row) are carried; dynamic, longrope and other llama3 "
            "parameters are not (notice; --strict refuses)"),
    Setting("yarn rope", yarn.YARN_FIELDS,
            ("position_embedding_type", "rope_type", "rotary_scaling_factor", "yarn_original_max_position_embeddings",
             "yarn_beta_fast", "yarn_beta_slow", "mscale", "mscale_all_dim", "yarn_correction_range_round_to_int",
             "original_max_position_embeddings", "beta_fast", "beta_slow"),
            _ARGS.format("position_embedding_type='yarn' (MLA: rope_type) / rotary_scaling_factor / yarn_* / mscale / "
                         "mscale_all_dim"),
            {ALL_FAMILIES: "rope_parameters (4.x: rope_scaling) rope_type=yarn: factor, original_max_position_embeddings, "
                           "beta_fast, beta_slow, mscale, mscale_all_dim, truncate, attention_factor"},
            "an HF attention_factor megatron-core's mscale ratio cannot give: notice, --strict refuses; "
            "mscale is read as 1 unless mscale and mscale_all_dim are both non-zero (transformers' rule)"),
    Setting("rotary percent", ("rotary_percent",), ("rotary_percent",), _ARGS.format("rotary_percent"),
            _hf(Glm4ForCausalLM="rope_parameters.partial_rotary_factor (default 0.5)",
                Glm4MoeForCausalLM="rope_parameters.partial_rotary_factor (default 0.5; carried both ways)",
                ALL="rope_parameters.partial_rotary_factor (read); no other family here computes it"),
            "HF -> Megatron carried; Megatron -> HF with < 1: notice, --strict refuses"),
    Setting("rotary interleaved", ("rotary_interleaved",), ("rotary_interleaved",),
            _ARGS.format("rotary_interleaved"),
            _hf(Glm4ForCausalLM="always (HF's own rotary is interleaved: rows kept as they are)",
                ALL="none: q/k head rows (and q/k-norm weights) written evens first, then odds"),
            "HF's rotate-half on the reordered rows is Megatron's interleaved rotary"),
    Setting("sliding window", ("sliding_window", "window_layers"), ("window_size", "window_attn_skip_freq"),
            _ARGS.format("window_size / window_attn_skip_freq"),
            _hf(MistralForCausalLM="sliding_window", MixtralForCausalLM="sliding_window",
                Qwen2ForCausalLM="use_sliding_window, sliding_window, max_window_layers, layer_types",
                Qwen3ForCausalLM="use_sliding_window, sliding_window, max_window_layers, layer_types",
                Qwen3MoeForCausalLM="use_sliding_window, sliding_window",
                LlamaForCausalLM="none (a windowed model is written as Mistral)"),
            "Megatron window_size = (sliding_window - 1, 0); window_attn_skip_freq = 0/1 per layer"),
    Setting("zero-centred norm gamma", ("layernorm_zero_centered_gamma",),
            ("layernorm_zero_centered_gamma", "apply_layernorm_1p"),
            _ARGS.format("layernorm_zero_centered_gamma (older: apply_layernorm_1p)"),
            {ALL_FAMILIES: "none: norm weights are written as 1 + gamma"}),
    Setting("norm epsilon", ("norm_epsilon",), ("norm_epsilon", "layernorm_epsilon"),
            _ARGS.format("norm_epsilon"), {ALL_FAMILIES: "rms_norm_eps"}),
    Setting("normalization", ("normalization",), ("normalization",), _ARGS.format("normalization"),
            {ALL_FAMILIES: "RMSNorm (fixed)"}),
    Setting("activation", ("activation", "gated_linear_unit"), ("swiglu", "gated_linear_unit", "openai_gelu", "quick_geglu"),
            _ARGS.format("swiglu (f17b: gated GELU: gated_linear_unit / openai_gelu)"),
            _hf(Gemma3ForCausalLM="hidden_activation = gelu_pytorch_tanh (fixed)",
                GptOssForCausalLM="clamped GLU of x*sigmoid(1.702x) (fixed; Megatron-LM --quick-geglu)",
                Gemma2ForCausalLM="hidden_activation = gelu_pytorch_tanh (fixed)", ALL="hidden_act = silu (fixed)")),
    Setting("qk-norm", ("qk_layernorm", "qk_layernorm_across_heads"), ("qk_layernorm", "qk_layernorm_across_heads"),
            _ARGS.format("qk_layernorm (f17b: qk_layernorm_across_heads)"),
            _hf(Qwen3ForCausalLM="always", Qwen3MoeForCausalLM="always", Gemma3ForCausalLM="always",
                Glm4MoeForCausalLM="use_qk_norm",
                Olmo2ForCausalLM="always, over the whole projection", OlmoeForCausalLM="always, over the whole projection",
                ALL="never (other families)")),
    Setting("linear biases", ("add_bias_linear", "add_qkv_bias"), ("add_bias_linear", "add_qkv_bias"),
            _ARGS.format("add_bias_linear / add_qkv_bias"),
            _hf(LlamaForCausalLM="attention_bias, mlp_bias", Qwen2ForCausalLM="q/k/v biases (fixed)",
                Glm4MoeForCausalLM="attention_bias (q/k/v only: add_qkv_bias)")),
    Setting("head dim", ("kv_channels",), ("kv_channels",), _ARGS.format("kv_channels"),
            {ALL_FAMILIES: "head_dim"}),
    Setting("query groups", ("num_query_groups",), ("group_query_attention", "num_query_groups"),
            _ARGS.format("num_query_groups"), {ALL_FAMILIES: "num_key_value_heads"}),
    Setting("tied embeddings", ("tie_embeddings",), ("untie_embeddings_and_output_weights",),
            _ARGS.format("untie_embeddings_and_output_weights"), {ALL_FAMILIES: "tie_word_embeddings"}),
    Setting("max positions", ("max_position_embeddings",), ("max_position_embeddings", "seq_length"),
            _ARGS.format("max_position_embeddings"), {ALL_FAMILIES: "max_position_embeddings"}),
    Setting("vocab sizes", ("vocab_size",),
            ("vocab_size", "padded_vocab_size", "make_vocab_size_divisible_by"),
            _ARGS.format("vocab_size / padded_vocab_size"), {ALL_FAMILIES: "vocab_size (true, unpadded)"}),
    Setting("moe top-k", ("moe_router_topk",), ("moe_router_topk",), _ARGS.format("moe_router_topk"),
            {_MOE: "num_experts_per_tok", "Glm4MoeForCausalLM": "num_experts_per_tok"}),
    Setting("moe score function", ("moe_router_score_function",), ("moe_router_score_function",),
            _ARGS.format("moe_router_score_function"), {_MOE: "softmax only (sigmoid: notice, --strict refuses)",
                                                       "DeepseekV3ForCausalLM": "sigmoid (fixed)",
                                                       "DeepseekV2ForCausalLM": "softmax (fixed)",
                                                       "Glm4MoeForCausalLM": "sigmoid (fixed)"}),
    Setting("moe pre-softmax", ("moe_router_pre_softmax",), ("moe_router_pre_softmax",),
            _ARGS.format("moe_router_pre_softmax"),
            _hf(Qwen3MoeForCausalLM="norm_topk_prob = not pre_softmax",
                MixtralForCausalLM="none (top-k renormalized: pre_softmax False)",
                Glm4MoeForCausalLM="norm_topk_prob (assumed true: megatron-core's sigmoid router renormalizes; "
                                   "false: notice, --strict refuses)")),
    Setting("moe expert bias", ("moe_router_enable_expert_bias",), ("moe_router_enable_expert_bias",),
            _ARGS.format("moe_router_enable_expert_bias"), {_MOE: "none (refused)",
                                                            "DeepseekV3ForCausalLM": "e_score_correction_bias (fixed)",
                                                            "Glm4MoeForCausalLM": "always: mlp.gate.e_score_correction_bias (fp32)"}),
    Setting("moe top-k scaling", ("moe_router_topk_scaling_factor",), ("moe_router_topk_scaling_factor",),
            _ARGS.format("moe_router_topk_scaling_factor"), {_MOE: "none (set: notice, --strict refuses)",
                                                             "DeepseekV2ForCausalLM, DeepseekV3ForCausalLM":
                                                             "routed_scaling_factor",
                                                             "Glm4MoeForCausalLM": "routed_scaling_factor"}),
    Setting("moe router groups", ("moe_router_num_groups", "moe_router_group_topk"),
            ("moe_router_num_groups", "moe_router_group_topk"),
            _ARGS.format("moe_router_num_groups / moe_router_group_topk"),
            _hf(DeepseekV3ForCausalLM="n_group, topk_group (group score: top-2 sum)",
                DeepseekV2ForCausalLM="topk_method=group_limited_greedy, n_group, topk_group (group score: best)",
                ALL="none (set: notice, --strict refuses)"),
            "megatron-core scores a group by its top moe_router_topk // group_topk experts; a setting "
            "that chooses every group is no grouping"),
    Setting("moe aux loss", ("moe_aux_loss_coeff",), ("moe_aux_loss_coeff",), _ARGS.format("moe_aux_loss_coeff"),
            {_MOE: "router_aux_loss_coef"}),
    Setting("dropout", ("attention_dropout", "hidden_dropout"), ("attention_dropout", "hidden_dropout"),
            _ARGS.format("attention_dropout / hidden_dropout"),
            {ALL_FAMILIES: "attention_dropout; no hidden dropout (non-zero: notice; training only, so --strict allows it)"},
            "Megatron's defaults are 0.1; an HF source writes its own values (0.0) explicitly"),
    # f17c: GPT-OSS. megatron-core computes these (TransformerConfig fields); Megatron-LM d98e8a64 has no
    # flag for them, so they are written into args (and pgconvert.json) and named in a notice.
    Setting("attention sinks", ("softmax_type",), ("softmax_type",), _ARGS.format("softmax_type"),
            _hf(GptOssForCausalLM="always: self_attn.sinks (softmax_type 'learnable')", ALL="none (vanilla)"),
            "Megatron-Bridge gpt_oss_bridge.py: softmax_type='learnable', core_attention.softmax_offset"),
    Setting("clamped GLU", ("glu_linear_offset", "activation_func_clamp_value"),
            ("glu_linear_offset", "activation_func_clamp_value"),
            _ARGS.format("glu_linear_offset / activation_func_clamp_value"),
            _hf(GptOssForCausalLM="swiglu_limit (clamp), offset 1 fixed; swiglu_alpha 1.702 = quick_gelu",
                ALL="none")),
    Setting("dtype", ("params_dtype",), ("params_dtype", "bf16", "fp16"), _ARGS.format("params_dtype"),
            {ALL_FAMILIES: "dtype (4.x: torch_dtype)"}),
    # f17a: Granite's muP multipliers, SmolLM3's NoPE layers (pgconvert.semantics.more).
    # tidy: one attention scale for every family (pgconvert.semantics.attention_scale).
    Setting("attention softmax scale", ("softmax_scale",), ("softmax_scale", "query_pre_attn_scalar"),
            _ARGS.format("softmax_scale (query_pre_attn_scalar, Megatron-Bridge's Gemma 2 spelling, read)"),
            _hf(GraniteForCausalLM="attention_multiplier", Gemma3ForCausalLM="query_pre_attn_scalar (scale**-2)",
                Gemma2ForCausalLM="query_pre_attn_scalar (scale**-2)",
                ALL="none: 1/sqrt(head_dim) (set: notice, --strict refuses)"),
            "megatron-core's TransformerConfig.softmax_scale (Megatron-LM has no flag for it); None: 1/sqrt(kv_channels)"),
    Setting("embedding, residual multipliers and logits scaling",
            ("embedding_multiplier", "residual_multiplier", "logits_scaling"),
            ("embedding_multiplier", "residual_multiplier", "logits_scaling"),
            _ARGS.format("embedding_multiplier / residual_multiplier / logits_scaling"),
            _hf(GraniteForCausalLM="embedding_multiplier, residual_multiplier, logits_scaling", ALL="none"),
            "megatron-core computes none of them: carried in args and pgconvert.json with a notice on every "
            "Megatron output; --strict refuses a Megatron target"),
    Setting("carried RoPE parameters", ("hf_rope_parameters",), ("hf_rope_parameters",),
            _ARGS.format("hf_rope_parameters"),
            _hf(Phi3ForCausalLM="rope_parameters (longrope, su), original_max_position_embeddings", ALL="none"),
            "megatron-core cannot compute longrope: carried as JSON in args and pgconvert.json with a notice "
            "on every Megatron output; --strict refuses a Megatron target"),
    Setting("NoPE layers", ("no_rope_layers",), ("no_rope_freq",), _ARGS.format("no_rope_freq"),
            _hf(SmolLM3ForCausalLM="no_rope_layers (1: RoPE), no_rope_layer_interval", ALL="none"),
            "megatron-core's no_rope_freq: 0/1 per layer, 1 = the layer skips RoPE"),
    # f17b: norms after the sublayers and Gemma's settings (pgconvert.semantics.postnorm, families_postnorm).
    Setting("post-sublayer norms", ("post_self_attn_layernorm", "post_mlp_layernorm", "pre_layernorms"),
            ("post_self_attn_layernorm", "post_mlp_layernorm", "pre_layernorms"),
            _ARGS.format("post_self_attn_layernorm / post_mlp_layernorm / pre_layernorms"),
            _hf(Gemma3ForCausalLM="post_attention_layernorm, post_feedforward_layernorm tensors (always)",
                Gemma2ForCausalLM="post_attention_layernorm, post_feedforward_layernorm tensors (always)",
                Olmo2ForCausalLM="post_attention_layernorm, post_feedforward_layernorm; no pre-norms (always)",
                Glm4ForCausalLM="post_self_attn_layernorm, post_mlp_layernorm tensors (always)",
                ALL="none (other families: pre-norm only)"),
            "Megatron-Bridge's TERowParallelLinearLayerNorm; megatron-core alone: notice"),
    Setting("embedding scale", ("embedding_scale_sqrt_hidden",), ("embedding_scale_sqrt_hidden",),
            _ARGS.format("embedding_scale_sqrt_hidden"),
            _hf(Gemma3ForCausalLM="always", Gemma2ForCausalLM="always", ALL="never")),
    Setting("logit soft-capping", ("attn_logit_softcapping", "final_logit_softcapping"),
            ("attn_logit_softcapping", "final_logit_softcapping"),
            _ARGS.format("attn_logit_softcapping / final_logit_softcapping"),
            _hf(Gemma3ForCausalLM="attn_logit_softcapping, final_logit_softcapping",
                Gemma2ForCausalLM="attn_logit_softcapping, final_logit_softcapping (null: off)")),
    Setting("local rope theta", ("rotary_base_local",), ("rotary_base_local",), _ARGS.format("rotary_base_local"),
            _hf(Gemma3ForCausalLM="rope_parameters.sliding_attention.rope_theta"),
            "the sliding-window layers' base; rotary_base and any linear scaling are the full-attention layers'"),
)

SEMANTIC_FIELDS: tuple[str, ...] = tuple(dict.fromkeys(name for row in SEMANTICS for name in row.fields))


# --- Megatron args -----------------------------------------------------------------------------

def _arg(args: argparse.Namespace, name: str, default: Any) -> Any:
    value = getattr(args, name, None)
    return default if value is None else value


def _number(args: argparse.Namespace, name: str, default: float, path: Path) -> float:
    value = _arg(args, name, default)
    if isinstance(value, (list, tuple)) and len(value) == 1:
        value = value[0]  # moe_aux_loss_coeff may be one value per load-balancing type
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise CheckpointError(f"{path}: args.{name}={quote(value)}: must be a finite number")
    return float(value)


def _flag(args: argparse.Namespace, name: str, path: Path) -> bool:
    value = _arg(args, name, False)
    if not isinstance(value, bool):
        raise CheckpointError(f"{path}: args.{name}={quote(value)}: expected True or False")
    return value


def _rope_from_args(args: argparse.Namespace, path: Path) -> dict[str, Any]:
    if yarn.uses_yarn(args):
        return yarn.from_args(args, path)
    llama3 = _flag(args, "use_rope_scaling", path)
    interpolation = getattr(args, "rotary_seq_len_interpolation_factor", None)
    if interpolation is not None:
        interpolation = _number(args, "rotary_seq_len_interpolation_factor", 1.0, path)
    if llama3 and interpolation not in (None, 1.0):
        raise CheckpointError(f"{path}: args.use_rope_scaling and args.rotary_seq_len_interpolation_factor="
                              f"{quote(interpolation)} together: no HF RoPE type computes both")
    if llama3:
        return {"rope_scaling": "llama3",
                "rope_scaling_factor": _number(args, "rope_scaling_factor", MEGATRON_DEFAULT_ROPE_SCALING_FACTOR, path)}
    if interpolation not in (None, 1.0):
        return {"rope_scaling": "linear", "rope_scaling_factor": interpolation}
    return {"rope_scaling": None, "rope_scaling_factor": 1.0}


def _window_from_args(args: argparse.Namespace, path: Path) -> dict[str, Any]:
    window = getattr(args, "window_size", None)
    if window is None or (isinstance(window, (list, tuple)) and tuple(window) == (-1, -1)):
        return {"sliding_window": None, "window_layers": None}
    if (not isinstance(window, (list, tuple)) or len(window) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) for v in window)):
        raise CheckpointError(f"{path}: args.window_size={quote(window)}: expected (left, right) integers")
    left, right = window
    if right != 0 or left < 0:
        raise CheckpointError(f"{path}: args.window_size={quote(window)}: only a causal window (W, 0) with "
                              "W >= 0 describes a decoder pgconvert converts")
    layers = args.num_layers if isinstance(getattr(args, "num_layers", None), int) else 0
    skip = getattr(args, "window_attn_skip_freq", None)
    if skip is None:
        pattern = None
    elif isinstance(skip, int) and not isinstance(skip, bool) and skip > 0:
        # megatron-core: 1-based layer n is windowed when n % skip != 0.
        pattern = tuple(int((layer + 1) % skip != 0) for layer in range(layers))
    elif isinstance(skip, (list, tuple)) and all(v in (0, 1) and not isinstance(v, bool) for v in skip):
        pattern = tuple(int(v) for v in skip)
    else:
        raise CheckpointError(f"{path}: args.window_attn_skip_freq={quote(skip)}: expected an int or a 0/1 list")
    if pattern is not None and not any(pattern):
        return {"sliding_window": None, "window_layers": None}
    if pattern is not None and all(pattern) and len(pattern) == layers:
        pattern = None
    return {"sliding_window": left + 1, "window_layers": pattern}


def _gpt_oss_from_args(args: argparse.Namespace, path: Path) -> dict[str, Any]:
    """f17c: attention sinks and the clamped GLU (megatron-core TransformerConfig fields)."""
    softmax_type = _arg(args, "softmax_type", "vanilla")
    if softmax_type not in ("vanilla", "learnable"):
        raise CheckpointError(f"{path}: args.softmax_type={quote(softmax_type)}: expected 'vanilla' or 'learnable'")
    clamp = getattr(args, "activation_func_clamp_value", None)
    return {"softmax_type": softmax_type, "glu_linear_offset": _number(args, "glu_linear_offset", 0.0, path),
            "activation_func_clamp_value": None if clamp is None
            else _number(args, "activation_func_clamp_value", 0.0, path)}


GPT_OSS_DEFAULTS: dict[str, Any] = {"softmax_type": "vanilla", "glu_linear_offset": 0.0,
                                    "activation_func_clamp_value": None}


def from_args(args: argparse.Namespace, path: Path) -> dict[str, Any]:
    """The table's ``ModelConfig`` values that Megatron ``args`` give (Megatron-LM's defaults apply)."""
    values: dict[str, Any] = {
        "rotary_percent": _number(args, "rotary_percent", 1.0, path),
        "rotary_interleaved": _flag(args, "rotary_interleaved", path),
        "layernorm_zero_centered_gamma": (_flag(args, "layernorm_zero_centered_gamma", path)
                                          or _flag(args, "apply_layernorm_1p", path)),
        "attention_dropout": _number(args, "attention_dropout", MEGATRON_DEFAULT_DROPOUT, path),
        "hidden_dropout": _number(args, "hidden_dropout", MEGATRON_DEFAULT_DROPOUT, path),
        **_rope_from_args(args, path),
        **_window_from_args(args, path),
        **mla_args.from_args(args, path),
        **semantics_more.from_args(args, path),  # f17a
        **postnorm_from_args(args, path),  # f17b
        **attention_scale.from_args(args, path),  # tidy
    }
    values.update(_gpt_oss_from_args(args, path))
    if getattr(args, "num_experts", None):
        scaling = getattr(args, "moe_router_topk_scaling_factor", None)
        values.update({
            "moe_router_score_function": _arg(args, "moe_router_score_function", "softmax"),
            "moe_router_pre_softmax": _flag(args, "moe_router_pre_softmax", path),
            "moe_router_topk_scaling_factor": None if scaling is None
            else _number(args, "moe_router_topk_scaling_factor", 1.0, path),
            "moe_aux_loss_coeff": _number(args, "moe_aux_loss_coeff", 0.0, path),
        })
    return values


def to_args(config: ModelConfig) -> dict[str, Any]:
    """The Megatron args of the table's settings (written explicitly, Megatron's defaults differ)."""
    values: dict[str, Any] = {
        "rotary_percent": config.rotary_percent,
        "rotary_interleaved": config.rotary_interleaved,
        "use_rope_scaling": config.rope_scaling == "llama3",
        "rope_scaling_factor": config.rope_scaling_factor if config.rope_scaling == "llama3"
        else MEGATRON_DEFAULT_ROPE_SCALING_FACTOR,
        "rotary_seq_len_interpolation_factor": config.rope_scaling_factor if config.rope_scaling == "linear" else None,
        **yarn.to_args(config),
        "window_size": None if config.sliding_window is None else (config.sliding_window - 1, 0),
        "window_attn_skip_freq": None if config.window_layers is None else list(config.window_layers),
        "layernorm_zero_centered_gamma": config.layernorm_zero_centered_gamma,
        "apply_layernorm_1p": config.layernorm_zero_centered_gamma,
        "attention_dropout": config.attention_dropout,
        "hidden_dropout": config.hidden_dropout,
        **semantics_more.to_args(config),  # f17a
        **postnorm_to_args(config),  # f17b
        **attention_scale.to_args(config),  # tidy
    }
    if config.rope_scaling == "yarn":
        values["position_embedding_type"] = "yarn"
    values.update(mla_args.to_args(config))  # ds16: MLA (position_embedding_type rope, rope_type), router groups
    # f17c: written only where they differ from megatron-core's defaults (other outputs are unchanged).
    values.update({name: getattr(config, name) for name, default in GPT_OSS_DEFAULTS.items()
                   if getattr(config, name) != default})
    if config.num_experts is not None:
        values.update({
            "moe_router_score_function": config.moe_router_score_function,
            "moe_router_pre_softmax": config.moe_router_pre_softmax,
            "moe_router_topk_scaling_factor": config.moe_router_topk_scaling_factor,
            "moe_aux_loss_coeff": config.moe_aux_loss_coeff,
        })
    return values


# --- HF config.json ----------------------------------------------------------------------------

def rope_parameters(doc: Mapping[str, Any]) -> dict[str, Any]:
    """config.json's RoPE parameters: transformers 5's ``rope_parameters`` or 4.x's ``rope_scaling``
    (which transformers 5 prefers when both are there)."""
    for key in ("rope_scaling", "rope_parameters"):
        value = doc.get(key)
        if isinstance(value, dict):
            return value
        if value is not None:
            raise ValueError(f"{key}={quote(value)}: expected an object")
    return {}


def rope_type_of(params: Mapping[str, Any]) -> str:
    rope_type = params.get("rope_type", params.get("type", "default"))
    return rope_type if isinstance(rope_type, str) else quote(rope_type)


def hf_unrepresentable(doc: Mapping[str, Any], path: Path) -> list[str]:
    """config.json settings that no Megatron argument holds (the model then computes differently)."""
    try:
        params = rope_parameters(doc)
    except ValueError:
        return []  # the family's rule names the bad value
    rope_type = rope_type_of(params)
    if rope_type in ("default", "linear") or semantics_more.carries_rope(doc, rope_type):
        return []
    if rope_type == "yarn":
        return yarn.hf_unrepresentable(params, doc, path)
    if rope_type == "llama3":
        odd = {key: params.get(key) for key, expected in MEGATRON_LLAMA3.items() if params.get(key) != expected}
        if not odd:
            return []
        detail = ", ".join(f"{key}={quote(value)}" for key, value in odd.items())
        return [f"{path}: rope_type='llama3' with {detail}: megatron-core's llama3 scaling fixes "
                f"{', '.join(f'{k}={v}' for k, v in MEGATRON_LLAMA3.items())}; a megatron target computes "
                "those instead"]
    return [f"{path}: rope_type={quote(rope_type)} (RoPE scaling) has no Megatron setting pgconvert writes: a "
            "megatron target computes plain RoPE"]


def hf_training_notes(architecture: str, config: ModelConfig) -> list[str]:
    """Training-only settings an HF ``architecture`` cannot hold: named, never refused.

    Dropout changes no output of the trained model (inference runs without it), so ``--strict``
    does not refuse it; every real Megatron-LM run records hidden_dropout (0.1 by default).
    """
    if config.hidden_dropout != 0.0:
        return [f"not carried (training only): hidden_dropout={config.hidden_dropout}: {architecture} has no "
                "hidden dropout; set it in your fine-tuning run"]
    return []


def _hf_computes(architecture: str) -> frozenset[str]:
    """The ``ModelConfig`` settings an HF ``architecture`` computes beyond every family's: its
    family's ``hf_computes`` (none for an architecture pgconvert has no family for)."""
    from pgconvert.families import FAMILIES  # fam17d (families imports this module)

    family = FAMILIES.get(architecture)
    return family.hf_computes if family is not None else frozenset()


def hf_losses(architecture: str, config: ModelConfig) -> list[str]:
    """The settings of ``config`` an HF ``architecture`` written from it cannot express."""
    from pgconvert.families.more import unmapped_losses  # f17a (families imports this module)

    computes = _hf_computes(architecture)
    losses = []
    if config.rotary_percent != 1.0 and "rotary_percent" not in computes:
        losses.append(f"rotary_percent={config.rotary_percent} (partial rotary): {architecture} rotates the "
                      "whole head")
    for name, default in (("glu_linear_offset", 0.0), ("activation_func_clamp_value", None)):
        if getattr(config, name) != default and name not in computes:
            losses.append(f"{name}={getattr(config, name)}: {architecture} has no clamped GLU")
    if config.num_experts is not None:
        losses += _router_losses(architecture, config, computes)
    return losses + unmapped_losses(architecture, config)


def _router_losses(architecture: str, config: ModelConfig, computes: frozenset[str]) -> list[str]:
    losses = []
    if config.moe_router_score_function != "softmax" and "moe_router_score_function" not in computes:
        losses.append(f"moe_router_score_function={config.moe_router_score_function!r}: {architecture} "
                      "routes with softmax")
    if (config.moe_router_topk_scaling_factor not in (None, 1.0)
            and "moe_router_topk_scaling_factor" not in computes):
        losses.append(f"moe_router_topk_scaling_factor={config.moe_router_topk_scaling_factor}: "
                      f"{architecture} does not scale routing weights")
    if config.moe_router_num_groups is not None and "moe_router_num_groups" not in computes:
        losses.append(f"moe_router_num_groups={config.moe_router_num_groups}, moe_router_group_topk="
                      f"{config.moe_router_group_topk}: {architecture} does not route by expert groups")
    if config.moe_router_pre_softmax and "moe_router_pre_softmax" not in computes:
        losses.append(f"moe_router_pre_softmax=True: {architecture} renormalizes the top-k weights")
    return losses


def lose(message: str, strict: bool, notices: list[str]) -> None:
    """A setting the target cannot express: a notice, or under ``strict`` an error (exit 2)."""
    if strict:
        raise StrictModeError(f"--strict: refusing to drop a setting the target cannot express: {message}")
    log.warning("not carried: %s", message)
    notices.append(f"not carried: {message}")


def check_target(source: Any, target_format: str, strict: bool) -> None:
    """Settings of an HF source that a Megatron target cannot hold (an hf target keeps config.json)."""
    if target_format == "hf":
        return
    gaps, refused = megatron_core_gaps(source.config)  # f17b
    source.notices.extend(gaps)
    for message in refused:
        lose(message, strict, source.notices)
    for message in source.unrepresentable:
        lose(message, strict, source.notices)
    config = source.config
    semantics_more.check_megatron_target(config, strict, source.notices)  # f17a
    if config.rope_scaling == "llama3" and config.rope_scaling_factor != MEGATRON_DEFAULT_ROPE_SCALING_FACTOR:
        # Written all the same: megatron-core computes it when it is passed (GPTModel(rope_scaling_factor=)).
        source.notices.append(
            f"args.rope_scaling_factor={config.rope_scaling_factor}: Megatron-LM (d98e8a64) builds GPTModel without "
            "it (gpt_builders.py, gpt_config_from_args), so a run built by Megatron-LM computes factor "
            f"{MEGATRON_DEFAULT_ROPE_SCALING_FACTOR}; megatron-core given the arg computes {config.rope_scaling_factor}")
    extra = {name: getattr(config, name) for name, default in GPT_OSS_DEFAULTS.items()
             if getattr(config, name) != default}
    if extra:  # f17c
        source.notices.append(
            f"args {', '.join(f'{name}={value!r}' for name, value in extra.items())}: megatron-core TransformerConfig "
            "fields that Megatron-LM (d98e8a64) has no command-line flag for; its core_transformer_config_from_args "
            "copies them from args, otherwise set them in your run (Megatron-Bridge's GPT-OSS provider does)")
    if config.rope_scaling == "linear":
        source.notices.append(
            "args.rotary_seq_len_interpolation_factor: Megatron-LM's gpt_builders.py (d98e8a64) does not pass it "
            "to GPTModel; its GPTModelBuilder (gpt_config_from_args) does")


# --- inspect and verify ------------------------------------------------------------------------

def describe(config: ModelConfig) -> dict[str, Any]:
    """Every table setting of ``config``, by field name."""
    values = config.to_dict()
    return {name: values[name] for name in SEMANTIC_FIELDS}


def summary(config: ModelConfig) -> dict[str, str]:
    """Each table row of ``config`` as text (``inspect``): row name -> ``field=value, …``."""
    values = config.to_dict()
    return {row.name: ", ".join(f"{name}={values[name]!r}" for name in row.fields) for row in SEMANTICS}


# Settings ``verify`` reports as notes, not failures: training-only ones (the forward pass and the
# logits do not depend on them) and the dtype, which every tensor's own dtype already compares.
VERIFY_NOTES_ONLY: frozenset[str] = frozenset({"attention_dropout", "hidden_dropout", "moe_aux_loss_coeff",
                                               "params_dtype"})
# Settings a format may leave unrecorded (None): compared only when both checkpoints record them.
OPTIONAL_SETTINGS: frozenset[str] = frozenset({"max_position_embeddings"})
# Compared by ``verify`` itself (the true vocab bounds the vocab tables' comparison).
VERIFIED_APART: frozenset[str] = frozenset({"vocab_size"})


def differences(a: ModelConfig, b: ModelConfig) -> tuple[list[tuple[str, str]], list[str]]:
    """(``(field, "A vs B")`` for each table setting on which the two models compute differently,
    notes for training-only settings that differ)."""
    in_a, in_b = describe(a), describe(b)
    failures, notes = [], []
    for name in SEMANTIC_FIELDS:
        if (name in VERIFIED_APART or in_a[name] == in_b[name]
                or (name in OPTIONAL_SETTINGS and None in (in_a[name], in_b[name]))):
            continue
        text = f"{name}: {in_a[name]!r} in A, {in_b[name]!r} in B"
        if name in VERIFY_NOTES_ONLY:
            notes.append(text)
        else:
            failures.append((name, text))
    return failures, notes
