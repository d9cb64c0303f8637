"""A model's semantics as data: every setting that changes what the model computes, in one table.

Each ``Setting`` row names the ``ModelConfig`` field(s) that hold it, the Megatron-LM argument(s)
(``megatron/training/arguments.py`` and megatron-core's ``TransformerConfig``, whose field names
are the argument names), where a ``torch_dist`` checkpoint keeps it (``common.pt``'s ``args``, the
same namespace as a per-rank file's) and how config.json holds it in a family without a note of
its own (a family's ``hf_notes`` say how its config.json holds a setting where it differs).

The table drives what pgconvert does with these settings:

* Megatron args -> ``ModelConfig`` (``from_args``) and back (``to_args``), for both Megatron formats,
  with the settings the families carry that megatron-core does not compute (``carried``, given by
  the caller: ``pgconvert.families.CARRIED_SETTINGS``); the config.json side is each family's
  fields and rules (``pgconvert.families``), cross-checked by tests;
* a setting a target cannot express is lost only with a notice naming it, and ``--strict`` refuses
  it (``lose``): ``check_target`` for a Megatron target, ``pgconvert.formats.hf.hf_losses`` for an
  HF one, ``pgconvert.semantics.rope.hf_unrepresentable`` for config.json settings no Megatron
  argument holds;
* ``inspect`` prints ``summary(config)``; ``verify`` reports ``differences(a, b)`` as failures.

Nothing here knows a family: what a family adds is passed in by the caller.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pgconvert.errors import CheckpointError, StrictModeError
from pgconvert.io.limits import quote
from pgconvert.model.config import ModelConfig
from pgconvert.semantics import attention_scale, carried, mamba, mla, rope, yarn
from pgconvert.semantics.arg_values import arg, flag, number
from pgconvert.semantics.carried import CarriedSetting
from pgconvert.semantics.postnorm import megatron_core_gaps, postnorm_from_args, postnorm_to_args
from pgconvert.semantics.rope import MEGATRON_DEFAULT_ROPE_SCALING_FACTOR

log = logging.getLogger(__name__)

# Megatron-LM's argument default for settings a run's args may not record.
MEGATRON_DEFAULT_DROPOUT = 0.1


@dataclass(frozen=True)
class Setting:
    """One setting that changes the computation, and where each format keeps it (``hf``: how
    config.json holds it in a family whose ``hf_notes`` do not say otherwise)."""

    name: str
    fields: tuple[str, ...]
    megatron: tuple[str, ...]
    common_pt: str
    hf: str
    note: str = ""


_ARGS = "common.pt['args'].{}"

SEMANTICS: tuple[Setting, ...] = (
    Setting("rope theta", ("rotary_base",), ("rotary_base",), _ARGS.format("rotary_base"),
            "rope_parameters.rope_theta (4.x: rope_theta)"),
    Setting("rope scaling", ("rope_scaling", "rope_scaling_factor"),
            ("use_rope_scaling", "rope_scaling_factor", "rotary_seq_len_interpolation_factor"),
            _ARGS.format("use_rope_scaling / rope_scaling_factor / rotary_seq_len_interpolation_factor"),
            "rope_parameters.rope_type/factor (4.x: rope_scaling)",
            "llama3 with low/high frequency factors 1/4 and 8192 original positions (what megatron-core "
            "hard-codes), linear and yarn (next row) are carried; dynamic, longrope and other llama3 "
            "parameters are not (notice; --strict refuses)"),
    Setting("yarn rope", yarn.YARN_FIELDS,
            ("position_embedding_type", "rope_type", "rotary_scaling_factor", "yarn_original_max_position_embeddings",
             "yarn_beta_fast", "yarn_beta_slow", "mscale", "mscale_all_dim", "yarn_correction_range_round_to_int",
             "original_max_position_embeddings", "beta_fast", "beta_slow"),
            _ARGS.format("position_embedding_type='yarn' (MLA: rope_type) / rotary_scaling_factor / yarn_* / mscale / "
                         "mscale_all_dim"),
            "rope_parameters (4.x: rope_scaling) rope_type=yarn: factor, original_max_position_embeddings, "
            "beta_fast, beta_slow, mscale, mscale_all_dim, truncate, attention_factor",
            "an HF attention_factor megatron-core's mscale ratio cannot give: notice, --strict refuses; "
            "mscale is read as 1 unless mscale and mscale_all_dim are both non-zero (transformers' rule)"),
    Setting("rotary percent", ("rotary_percent",), ("rotary_percent",), _ARGS.format("rotary_percent"),
            "rope_parameters.partial_rotary_factor (read); no other family here computes it",
            "HF -> Megatron carried; Megatron -> HF with < 1: notice, --strict refuses"),
    Setting("rotary interleaved", ("rotary_interleaved",), ("rotary_interleaved",),
            _ARGS.format("rotary_interleaved"),
            "none: q/k head rows (and q/k-norm weights) written evens first, then odds",
            "HF's rotate-half on the reordered rows is Megatron's interleaved rotary"),
    Setting("sliding window", ("sliding_window", "window_layers"), ("window_size", "window_attn_skip_freq"),
            _ARGS.format("window_size / window_attn_skip_freq"),
            "none (the families with a window name their keys)",
            "Megatron window_size = (sliding_window - 1, 0); window_attn_skip_freq = 0/1 per layer"),
    Setting("zero-centred norm gamma", ("layernorm_zero_centered_gamma",),
            ("layernorm_zero_centered_gamma", "apply_layernorm_1p"),
            _ARGS.format("layernorm_zero_centered_gamma (older: apply_layernorm_1p)"),
            "none: norm weights are written as 1 + gamma"),
    Setting("norm epsilon", ("norm_epsilon",), ("norm_epsilon", "layernorm_epsilon"),
            _ARGS.format("norm_epsilon"), "rms_norm_eps"),
    Setting("normalization", ("normalization",), ("normalization",), _ARGS.format("normalization"),
            "RMSNorm (fixed)"),
    Setting("activation", ("activation", "gated_linear_unit"),
            ("swiglu", "squared_relu", "quick_geglu", "gated_linear_unit", "openai_gelu"),
            _ARGS.format("swiglu / squared_relu / quick_geglu (gated GELU: gated_linear_unit / openai_gelu)"),
            "hidden_act = silu (fixed)",
            "Megatron-LM's core_transformer_config_from_args: --swiglu, --squared-relu, --quick-geglu, else F.gelu; "
            "its --openai-gelu reaches no TransformerConfig field, so openai_gelu means the tanh GELU only in "
            "args that record gated_linear_unit (pgconvert's)"),
    Setting("qk-norm", ("qk_layernorm", "qk_layernorm_across_heads"), ("qk_layernorm", "qk_layernorm_across_heads"),
            _ARGS.format("qk_layernorm (over the whole projection: qk_layernorm_across_heads)"),
            "never (other families)"),
    Setting("linear biases", ("add_bias_linear", "add_qkv_bias"), ("add_bias_linear", "add_qkv_bias"),
            _ARGS.format("add_bias_linear / add_qkv_bias"), "none (other families)"),
    Setting("head dim", ("kv_channels",), ("kv_channels",), _ARGS.format("kv_channels"), "head_dim"),
    Setting("query groups", ("num_query_groups",), ("group_query_attention", "num_query_groups"),
            _ARGS.format("num_query_groups"), "num_key_value_heads"),
    Setting("tied embeddings", ("tie_embeddings",), ("untie_embeddings_and_output_weights",),
            _ARGS.format("untie_embeddings_and_output_weights"), "tie_word_embeddings"),
    Setting("max positions", ("max_position_embeddings",), ("max_position_embeddings", "seq_length"),
            _ARGS.format("max_position_embeddings"), "max_position_embeddings"),
    Setting("vocab sizes", ("vocab_size",),
            ("vocab_size", "padded_vocab_size", "make_vocab_size_divisible_by"),
            _ARGS.format("vocab_size / padded_vocab_size"), "vocab_size (true, unpadded)"),
    Setting("moe top-k", ("moe_router_topk",), ("moe_router_topk",), _ARGS.format("moe_router_topk"),
            "num_experts_per_tok"),
    Setting("moe score function", ("moe_router_score_function",), ("moe_router_score_function",),
            _ARGS.format("moe_router_score_function"), "softmax only (sigmoid: notice, --strict refuses)"),
    Setting("moe pre-softmax", ("moe_router_pre_softmax",), ("moe_router_pre_softmax",),
            _ARGS.format("moe_router_pre_softmax"), "none (top-k renormalized: pre_softmax False)"),
    Setting("moe expert bias", ("moe_router_enable_expert_bias",), ("moe_router_enable_expert_bias",),
            _ARGS.format("moe_router_enable_expert_bias"), "none (refused)"),
    Setting("moe top-k scaling", ("moe_router_topk_scaling_factor",), ("moe_router_topk_scaling_factor",),
            _ARGS.format("moe_router_topk_scaling_factor"), "none (set: notice, --strict refuses)"),
    Setting("moe router groups", ("moe_router_num_groups", "moe_router_group_topk"),
            ("moe_router_num_groups", "moe_router_group_topk"),
            _ARGS.format("moe_router_num_groups / moe_router_group_topk"), "none (set: notice, --strict refuses)",
            "megatron-core scores a group by its top moe_router_topk // group_topk experts; a setting "
            "that chooses every group is no grouping"),
    Setting("moe aux loss", ("moe_aux_loss_coeff",), ("moe_aux_loss_coeff",), _ARGS.format("moe_aux_loss_coeff"),
            "router_aux_loss_coef"),
    Setting("dropout", ("attention_dropout", "hidden_dropout"), ("attention_dropout", "hidden_dropout"),
            _ARGS.format("attention_dropout / hidden_dropout"),
            "attention_dropout; no hidden dropout (non-zero: notice; training only, so --strict allows it)",
            "Megatron's defaults are 0.1; an HF source writes its own values (0.0) explicitly"),
    # megatron-core computes the next two (TransformerConfig fields); Megatron-LM d98e8a64 has no
    # flag for them, so they are written into args (and pgconvert.json) and named in a notice.
    Setting("attention sinks", ("softmax_type",), ("softmax_type",), _ARGS.format("softmax_type"), "none (vanilla)",
            "Megatron-Bridge gpt_oss_bridge.py: softmax_type='learnable', core_attention.softmax_offset"),
    Setting("clamped GLU", ("glu_linear_offset", "activation_func_clamp_value"),
            ("glu_linear_offset", "activation_func_clamp_value"),
            _ARGS.format("glu_linear_offset / activation_func_clamp_value"), "none"),
    Setting("dtype", ("params_dtype",), ("params_dtype", "bf16", "fp16"), _ARGS.format("params_dtype"),
            "dtype (4.x: torch_dtype)"),
    # One attention scale for every family (pgconvert.semantics.attention_scale).
    Setting("attention softmax scale", ("softmax_scale",), ("softmax_scale", "query_pre_attn_scalar"),
            _ARGS.format("softmax_scale (query_pre_attn_scalar, Megatron-Bridge's Gemma 2 spelling, read)"),
            "none: 1/sqrt(head_dim) (set: notice, --strict refuses)",
            "megatron-core's TransformerConfig.softmax_scale (Megatron-LM has no flag for it); None: 1/sqrt(kv_channels)"),
    Setting("embedding, residual multipliers and logits scaling",
            ("embedding_multiplier", "residual_multiplier", "logits_scaling"),
            ("embedding_multiplier", "residual_multiplier", "logits_scaling"),
            _ARGS.format("embedding_multiplier / residual_multiplier / logits_scaling"), "none",
            "megatron-core computes none of them: carried in args and pgconvert.json with a notice on every "
            "Megatron output; --strict refuses a Megatron target"),
    Setting("carried RoPE parameters", ("hf_rope_parameters",), ("hf_rope_parameters",),
            _ARGS.format("hf_rope_parameters"), "none",
            "megatron-core cannot compute longrope: carried as JSON in args and pgconvert.json with a notice "
            "on every Megatron output; --strict refuses a Megatron target"),
    Setting("NoPE layers", ("no_rope_layers",), ("no_rope_freq",), _ARGS.format("no_rope_freq"), "none",
            "megatron-core's no_rope_freq: 0/1 per layer, 1 = the layer skips RoPE"),
    # Norms after the sublayers and the settings of Megatron-Bridge's custom layers (pgconvert.semantics.postnorm).
    Setting("post-sublayer norms", ("post_self_attn_layernorm", "post_mlp_layernorm", "pre_layernorms"),
            ("post_self_attn_layernorm", "post_mlp_layernorm", "pre_layernorms"),
            _ARGS.format("post_self_attn_layernorm / post_mlp_layernorm / pre_layernorms"),
            "none (other families: pre-norm only)",
            "Megatron-Bridge's TERowParallelLinearLayerNorm; megatron-core alone: notice"),
    Setting("embedding scale", ("embedding_scale_sqrt_hidden",), ("embedding_scale_sqrt_hidden",),
            _ARGS.format("embedding_scale_sqrt_hidden"), "never"),
    Setting("logit soft-capping", ("attn_logit_softcapping", "final_logit_softcapping"),
            ("attn_logit_softcapping", "final_logit_softcapping"),
            _ARGS.format("attn_logit_softcapping / final_logit_softcapping"), "none"),
    Setting("local rope theta", ("rotary_base_local",), ("rotary_base_local",), _ARGS.format("rotary_base_local"),
            "none", "the sliding-window layers' base; rotary_base and any linear scaling are the full-attention layers'"),
    # Hybrid models (pgconvert.model.kinds.mamba, pgconvert.semantics.mamba).
    Setting("hybrid layer pattern and Mamba mixers",
            ("hybrid_override_pattern", "mamba_state_dim", "mamba_head_dim", "mamba_num_groups", "mamba_num_heads"),
            ("hybrid_override_pattern", "mamba_state_dim", "mamba_head_dim", "mamba_num_groups", "mamba_num_heads"),
            _ARGS.format("hybrid_override_pattern / mamba_state_dim / mamba_head_dim / mamba_num_groups / "
                         "mamba_num_heads"), "none (other families: no Mamba layers)",
            "the Mamba mixers' gated norm: megatron-core fixes its epsilon at 1e-5 (another norm_epsilon: notice, "
            "--strict refuses a Megatron target)"),
    Setting("Mamba time-step clamp", ("time_step_min",), ("time_step_min",), _ARGS.format("time_step_min"), "none",
            "megatron-core does not clamp: carried in args and pgconvert.json with a notice on every Megatron "
            "output; --strict refuses a Megatron target"),
    Setting("parallel attention and MLP", ("use_parallel_residual", "shared_input_layernorm"),
            ("use_parallel_residual", "shared_input_layernorm"),
            _ARGS.format("use_parallel_residual / shared_input_layernorm"),
            "none (other families: the MLP after the attention)",
            "x + attn(ln1(x)) + mlp(ln2(x)), with one shared norm x + attn(ln(x)) + mlp(ln(x)); megatron-core "
            "0.16.1's TransformerLayer.forward runs the MLP on the attention's output (transformer/transformer_layer.py:513-518) and no config field changes that: "
            "carried in args and pgconvert.json with a notice on every Megatron output; --strict refuses a "
            "Megatron target"),
    Setting("LayerNorm bias", ("layernorm_bias",), ("layernorm_bias",), _ARGS.format("layernorm_bias"),
            "none (other families: LayerNorm with a bias, RMSNorm without)",
            "False: LayerNorms without a bias (Cohere); megatron-core's LayerNorm always has one "
            "(transformer/torch_norm.py:38-39, torch.nn.LayerNorm): carried with a notice; --strict refuses"),
    Setting("logit scale", ("logit_scale",), ("logit_scale",), _ARGS.format("logit_scale"), "none",
            "the logits multiplied by it (Cohere); megatron-core has no such setting (models/gpt/gpt_model.py:685): "
            "carried with a notice; --strict refuses"),
    Setting("qk-norm after RoPE", ("qk_layernorm_after_rope",), ("qk_layernorm_after_rope",),
            _ARGS.format("qk_layernorm_after_rope"), "none (other families: q/k norms before RoPE)",
            "HunYuan normalizes the rotated q/k heads; megatron-core 0.16.1 applies q_layernorm / k_layernorm in "
            "get_query_key_value_tensors (transformer/attention.py:1478-1481), before the rotary in Attention.forward "
            "(:1097-1110), and no "
            "config field moves them; the same only where each rotated pair's two norm weights are equal: carried "
            "with a notice; --strict refuses"),
    # Llama 4 (pgconvert.families.llama4).
    Setting("qk L2 norm", ("qk_l2_norm",), ("qk_l2_norm",), _ARGS.format("qk_l2_norm"), "never (other families)",
            "q and k RMS-normalized per head without a weight, on the RoPE layers only: Megatron-Bridge's Llama 4 "
            "layer spec; megatron-core's own specs normalize every layer (a notice names it with NoPE layers)"),
    Setting("moe probs on input", ("moe_apply_probs_on_input",), ("moe_apply_probs_on_input",),
            _ARGS.format("moe_apply_probs_on_input"), "never (other families: the probability scales the output)",
            "top-1 only (megatron-core's experts assert it)"),
    Setting("chunked attention and attention temperature",
            ("attention_chunk_size", "attn_temperature_tuning", "floor_scale", "attn_scale"),
            ("attention_chunk_size", "attn_temperature_tuning", "floor_scale", "attn_scale"),
            _ARGS.format("attention_chunk_size / attn_temperature_tuning / floor_scale / attn_scale"), "none",
            "megatron-core 0.16.1 computes neither (Megatron-Bridge's Llama4SelfAttention chunks, on every layer): "
            "carried in args and pgconvert.json with a notice on every Megatron output; --strict refuses"),
)

SEMANTIC_FIELDS: tuple[str, ...] = tuple(dict.fromkeys(name for row in SEMANTICS for name in row.fields))

# Settings that only some families' config.json can hold, with the value a model computes as
# without them: a family with no key for one cannot express another value
# (pgconvert.formats.hf.hf_losses names it; a model that names no family is not written as that one).
FAMILY_SPECIFIC_SETTINGS: dict[str, object] = {
    "embedding_multiplier": 1.0,
    "residual_multiplier": 1.0,
    "logits_scaling": 1.0,
    "no_rope_layers": None,
    "hf_rope_parameters": None,
    "softmax_scale": None,
    "time_step_min": 0.0,
    "use_parallel_residual": False,
    "shared_input_layernorm": False,
    "layernorm_bias": True,
    "logit_scale": 1.0,
    "qk_layernorm_after_rope": False,
    "qk_l2_norm": False,
    "moe_apply_probs_on_input": False,
    "attention_chunk_size": None,
    "attn_temperature_tuning": False,
    "floor_scale": 8192,
    "attn_scale": 0.1,
}


# --- Megatron args -----------------------------------------------------------------------------

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


# megatron-core TransformerConfig fields that Megatron-LM (d98e8a64) has no flag for: attention
# sinks and the clamped GLU (GPT-OSS's), with megatron-core's defaults.
CORE_ONLY_DEFAULTS: dict[str, Any] = {"softmax_type": "vanilla", "glu_linear_offset": 0.0,
                                      "activation_func_clamp_value": None}
# megatron-core TransformerConfig switches Megatron-LM's parser makes from the config (its ArgumentGroupFactory),
# written only where set, so other models' args stay as they were.
CORE_SWITCHES: tuple[str, ...] = ("qk_l2_norm", "moe_apply_probs_on_input")


def _core_only_from_args(args: argparse.Namespace, path: Path) -> dict[str, Any]:
    """Attention sinks and the clamped GLU (megatron-core TransformerConfig fields)."""
    softmax_type = arg(args, "softmax_type", "vanilla")
    if softmax_type not in ("vanilla", "learnable"):
        raise CheckpointError(f"{path}: args.softmax_type={quote(softmax_type)}: expected 'vanilla' or 'learnable'")
    clamp = getattr(args, "activation_func_clamp_value", None)
    return {"softmax_type": softmax_type, "glu_linear_offset": number(args, "glu_linear_offset", 0.0, path),
            "activation_func_clamp_value": None if clamp is None
            else number(args, "activation_func_clamp_value", 0.0, path)}


def from_args(args: argparse.Namespace, path: Path, carried_settings: Sequence[CarriedSetting] = ()) -> dict[str, Any]:
    """The table's ``ModelConfig`` values that Megatron ``args`` give (Megatron-LM's defaults apply),
    with ``carried_settings`` (the families' settings megatron-core does not compute)."""
    values: dict[str, Any] = {
        "rotary_percent": number(args, "rotary_percent", 1.0, path),
        "rotary_interleaved": flag(args, "rotary_interleaved", path),
        "layernorm_zero_centered_gamma": (flag(args, "layernorm_zero_centered_gamma", path)
                                          or flag(args, "apply_layernorm_1p", path)),
        "attention_dropout": number(args, "attention_dropout", MEGATRON_DEFAULT_DROPOUT, path),
        "hidden_dropout": number(args, "hidden_dropout", MEGATRON_DEFAULT_DROPOUT, path),
        **rope.scaling_from_args(args, path),
        **_window_from_args(args, path),
        **mla.from_args(args, path),
        "no_rope_layers": rope.no_rope_from_args(args, path),
        **carried.from_args(carried_settings, args, path),
        **postnorm_from_args(args, path),
        **attention_scale.from_args(args, path),
    }
    values.update(_core_only_from_args(args, path))
    values["qk_l2_norm"] = flag(args, "qk_l2_norm", path)
    if getattr(args, "num_experts", None):
        scaling = getattr(args, "moe_router_topk_scaling_factor", None)
        values.update({
            "moe_router_score_function": arg(args, "moe_router_score_function", "softmax"),
            "moe_router_pre_softmax": flag(args, "moe_router_pre_softmax", path),
            "moe_router_topk_scaling_factor": None if scaling is None
            else number(args, "moe_router_topk_scaling_factor", 1.0, path),
            "moe_aux_loss_coeff": number(args, "moe_aux_loss_coeff", 0.0, path),
            "moe_apply_probs_on_input": flag(args, "moe_apply_probs_on_input", path),
        })
    return values


def to_args(config: ModelConfig, carried_settings: Sequence[CarriedSetting] = ()) -> dict[str, Any]:
    """The Megatron args of the table's settings (written explicitly, Megatron's defaults differ),
    with those of ``carried_settings`` the model has."""
    positions, attention = config.positions, config.attention
    values: dict[str, Any] = {
        "rotary_percent": positions.rotary_percent,
        "rotary_interleaved": positions.rotary_interleaved,
        "use_rope_scaling": positions.rope_scaling == "llama3",
        "rope_scaling_factor": positions.rope_scaling_factor if positions.rope_scaling == "llama3"
        else MEGATRON_DEFAULT_ROPE_SCALING_FACTOR,
        "rotary_seq_len_interpolation_factor": positions.rope_scaling_factor if positions.rope_scaling == "linear" else None,
        **yarn.to_args(config),
        "window_size": None if attention.sliding_window is None else (attention.sliding_window - 1, 0),
        "window_attn_skip_freq": None if attention.window_layers is None else list(attention.window_layers),
        "layernorm_zero_centered_gamma": config.norms.layernorm_zero_centered_gamma,
        "apply_layernorm_1p": config.norms.layernorm_zero_centered_gamma,
        "attention_dropout": attention.attention_dropout,
        "hidden_dropout": config.hidden_dropout,
        "no_rope_freq": None if positions.no_rope_layers is None else list(positions.no_rope_layers),
        **carried.to_args(carried_settings, config),
        **postnorm_to_args(config),
        **attention_scale.to_args(config),
    }
    if positions.rope_scaling == "yarn":
        values["position_embedding_type"] = "yarn"
    # Multi-latent attention (position_embedding_type rope, rope_type) and router groups.
    values.update(mla.to_args(config))
    # Written only where they differ from megatron-core's defaults (other outputs are unchanged).
    values.update({name: config.setting(name) for name, default in CORE_ONLY_DEFAULTS.items()
                   if config.setting(name) != default})
    values.update({name: True for name in CORE_SWITCHES if config.setting(name)})
    moe = config.moe
    if moe.num_experts is not None:
        values.update({
            "moe_router_score_function": moe.moe_router_score_function,
            "moe_router_pre_softmax": moe.moe_router_pre_softmax,
            "moe_router_topk_scaling_factor": moe.moe_router_topk_scaling_factor,
            "moe_aux_loss_coeff": moe.moe_aux_loss_coeff,
        })
    return values


# --- what a target cannot express ----------------------------------------------------------------

def lose(message: str, strict: bool, notices: list[str]) -> None:
    """A setting the target cannot express: a notice, or under ``strict`` an error (exit 2)."""
    if strict:
        raise StrictModeError(f"--strict: refusing to drop a setting the target cannot express: {message}")
    log.warning("not carried: %s", message)
    notices.append(f"not carried: {message}")


def _check_carried(config: ModelConfig, strict: bool, notices: list[str],
                   carried_settings: Sequence[CarriedSetting]) -> None:
    """A Megatron target of a model megatron-core computes differently: refused under ``strict``,
    else carried with a notice naming each setting."""
    settings = carried.uncomputed(carried_settings, config)
    if not settings:
        return
    computes_differently(f"{', '.join(settings)}: megatron-core has no such setting, so a Megatron run of this "
                         "checkpoint computes without it; carried in args (transformers' names where it has them) and "
                         "pgconvert.json, so converting back to HF restores it", strict, notices)


def computes_differently(message: str, strict: bool, notices: list[str]) -> None:
    """A Megatron target that holds a setting megatron-core computes otherwise: a notice, under ``strict`` an error."""
    if strict:
        raise StrictModeError(f"--strict: refusing a target that computes differently: {message}")
    notices.append(message)


def router_gaps(config: ModelConfig) -> list[str]:
    """Routers megatron-core does not compute: an expert bias steering a softmax router's choice (ERNIE 4.5 MoE)."""
    moe = config.moe
    if moe.num_experts is None or not moe.moe_router_enable_expert_bias or moe.moe_router_score_function != "softmax":
        return []
    return ["moe_router_enable_expert_bias=True with moe_router_score_function='softmax' (the top-k chosen by the "
            "softmax plus the expert bias, the unbiased weights renormalized): megatron-core 0.16.1 computes an expert "
            "bias only with the sigmoid router (its TransformerConfig refuses this pair); carried in args and "
            "pgconvert.json, so converting back to HF restores it"]


def check_target(source: Any, target_format: str, strict: bool,
                 carried_settings: Sequence[CarriedSetting] = ()) -> None:
    """Settings of a source that a Megatron target cannot hold (an hf target keeps config.json);
    ``carried_settings``: the families' settings megatron-core does not compute."""
    if target_format == "hf":
        return
    gaps, refused = megatron_core_gaps(source.config)
    source.notices.extend(gaps)
    for message in refused:
        lose(message, strict, source.notices)
    for message in source.unrepresentable:
        lose(message, strict, source.notices)
    config = source.config
    positions = config.positions
    _check_carried(config, strict, source.notices, carried_settings)
    for message in mamba.megatron_core_gaps(config):
        lose(message, strict, source.notices)
    for message in router_gaps(config):
        computes_differently(message, strict, source.notices)
    if positions.rope_scaling == "llama3" and positions.rope_scaling_factor != MEGATRON_DEFAULT_ROPE_SCALING_FACTOR:
        # Written all the same: megatron-core computes it when it is passed (GPTModel(rope_scaling_factor=)).
        source.notices.append(
            f"args.rope_scaling_factor={positions.rope_scaling_factor}: Megatron-LM (d98e8a64) builds GPTModel without "
            "it (gpt_builders.py, gpt_config_from_args), so a run built by Megatron-LM computes factor "
            f"{MEGATRON_DEFAULT_ROPE_SCALING_FACTOR}; megatron-core given the arg computes {positions.rope_scaling_factor}")
    extra = {name: config.setting(name) for name, default in CORE_ONLY_DEFAULTS.items()
             if config.setting(name) != default}
    if extra:
        source.notices.append(
            f"args {', '.join(f'{name}={value!r}' for name, value in extra.items())}: megatron-core TransformerConfig "
            "fields that Megatron-LM (d98e8a64) has no command-line flag for; its core_transformer_config_from_args "
            "copies them from args, otherwise set them in your run (Megatron-Bridge's GPT-OSS provider does)")
    if positions.rope_scaling == "linear":
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
