"""GPT-OSS (``GptOssForCausalLM``).

transformers 5.24 ``models/gpt_oss``: every layer MoE; q/k/v/o biases; per-head attention sinks;
the router a biased linear whose top-k logits are softmaxed (megatron-core's default router);
experts stacked per layer, ``gate_up_proj`` [E, hidden, 2·I] with gate and up interleaved column by
column (gate = ``[..., ::2]``), ``down_proj`` [E, I, hidden], each with a bias; the expert
activation (clamp(up, ±limit) + 1) · g·σ(1.702·g), g = clamp(gate, max=limit). The Megatron side
as Megatron-Bridge writes it (src/megatron/bridge/models/gpt_oss/gpt_oss_bridge.py):
``add_bias_linear``, ``softmax_type`` 'learnable' (``self_attention.core_attention.softmax_offset``),
``quick_gelu`` with ``activation_func_clamp_value`` = ``swiglu_limit`` and ``glu_linear_offset`` 1,
``window_size`` (W - 1, 0) on the sliding layers, ``linear_fc1`` = [gate; up] (its ``_interleave``),
the experts' fc2 transposed.
"""

from __future__ import annotations

from collections.abc import Mapping

from pgconvert.model.config import ModelConfig
from pgconvert.families.experts import AUX_LOSS, EVERY_LAYER_MOE, expert_count, expert_ffn_size
from pgconvert.families.llama import (
    ATTENTION_ROWS,
    EMBEDDING_ROWS,
    FINAL_ROWS,
    ROPE_RULE,
    SWIGLU_RMS_ROPE,
    decoder_fields,
    head_dim_field,
    query_groups_field,
    read_whole_head_rope,
)
from pgconvert.families.sliding_window import layer_types_of, layer_types_window
from pgconvert.families.table import (
    IDENTITY,
    INTERLEAVED_GATE_UP,
    INTERLEAVED_GATE_UP_TRANSPOSED,
    TRANSPOSED,
    ConfigField,
    ConfigRule,
    Family,
    TensorMapping,
    TensorTable,
)

GPT_OSS_SWIGLU_ALPHA = 1.702  # megatron-core's quick_gelu constant
GPT_OSS_SWIGLU_LIMIT = 7.0
GPT_OSS_WINDOW = 128
# GptOssConfig's RoPE where config.json gives none (its __post_init__): YaRN over a 4096 context.
GPT_OSS_ROPE: dict[str, object] = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                   "truncate": False, "original_max_position_embeddings": 4096}

_EXPERT = "decoder.layers.{}.mlp.experts.local_experts.{}."
_GPT_OSS_ROWS = (
    TensorMapping("decoder.layers.{}.self_attention.core_attention.softmax_offset",
                  ("model.layers.{}.self_attn.sinks",)),
    TensorMapping("decoder.layers.{}.mlp.router.weight", ("model.layers.{}.mlp.router.weight",)),
    TensorMapping("decoder.layers.{}.mlp.router.bias", ("model.layers.{}.mlp.router.bias",)),
    TensorMapping(_EXPERT + "linear_fc1.weight", ("model.layers.{}.mlp.experts.gate_up_proj",),
                  INTERLEAVED_GATE_UP_TRANSPOSED, stacked=True),
    TensorMapping(_EXPERT + "linear_fc1.bias", ("model.layers.{}.mlp.experts.gate_up_proj_bias",),
                  INTERLEAVED_GATE_UP, stacked=True),
    TensorMapping(_EXPERT + "linear_fc2.weight", ("model.layers.{}.mlp.experts.down_proj",), TRANSPOSED,
                  stacked=True),
    TensorMapping(_EXPERT + "linear_fc2.bias", ("model.layers.{}.mlp.experts.down_proj_bias",), IDENTITY,
                  stacked=True),
)
GPT_OSS_TENSORS = TensorTable((*EMBEDDING_ROWS, *ATTENTION_ROWS, *_GPT_OSS_ROWS, *FINAL_ROWS))


def _read_layer_window(present: Mapping[str, object], model: Mapping[str, object]) -> Mapping[str, object]:
    """``sliding_window`` on the layers ``layer_types`` marks; transformers' GptOssConfig default
    alternates, layer 0 sliding."""
    return layer_types_window(present, model, period=2, default_window=GPT_OSS_WINDOW)


def _write_layer_window(config: ModelConfig) -> Mapping[str, object]:
    return {"sliding_window": config.attention.sliding_window or GPT_OSS_WINDOW, "layer_types": layer_types_of(config)}


def _read_rope(present: Mapping[str, object], model: Mapping[str, object]) -> Mapping[str, object]:
    """As every family's, but no ``rope_parameters`` (absent or null) nor ``rope_scaling`` is GptOssConfig's YaRN."""
    if present.get("rope_parameters") is None and not present.get("rope_scaling"):
        present = {**present, "rope_parameters": GPT_OSS_ROPE}
    return read_whole_head_rope(present, model)


GPT_OSS = Family(
    architecture="GptOssForCausalLM",
    model_type="gpt_oss",
    hf_computes=frozenset({"glu_linear_offset", "activation_func_clamp_value"}),
    tensors=GPT_OSS_TENSORS,
    fields=(
        # GptOssConfig's 8 KV heads and head_dim 64 (null: hidden_size / num_attention_heads).
        *decoder_fields(max_position_embeddings=131072, norm_epsilon=1e-5, rotary_base=150000.0,
                        query_groups=query_groups_field(8), head_dim=head_dim_field(64, nullable=True)),
        ConfigField(("intermediate_size",), "moe_ffn_hidden_size", int, default=2880, written=expert_ffn_size),
        expert_count("num_local_experts", 128, "num_experts"),
        ConfigField(("num_experts_per_tok",), "moe_router_topk", int, default=4),
        ConfigField(("swiglu_limit",), "activation_func_clamp_value", float, default=GPT_OSS_SWIGLU_LIMIT),
        AUX_LOSS,
    ),
    rules=(
        EVERY_LAYER_MOE,
        ConfigRule(keys=("sliding_window", "layer_types"), model_fields=("sliding_window", "window_layers"),
                   read=_read_layer_window, write=_write_layer_window, null_keys=("sliding_window",)),
        ConfigRule(keys=ROPE_RULE.keys, model_fields=ROPE_RULE.model_fields, read=_read_rope, write=ROPE_RULE.write),
    ),
    fixed={
        **SWIGLU_RMS_ROPE,
        "activation": "quick_gelu",
        "glu_linear_offset": 1.0,
        "softmax_type": "learnable",
        "add_bias_linear": True,
        "add_qkv_bias": False,
        "qk_layernorm": False,
        "moe_shared_expert_intermediate_size": None,
        "moe_router_enable_expert_bias": False,
        "moe_router_score_function": "softmax",
        "moe_router_pre_softmax": False,
    },
    # Every linear has a bias; the experts' sigmoid gain is quick_gelu's.
    hf_fixed={"attention_bias": True, "swiglu_alpha": GPT_OSS_SWIGLU_ALPHA},
    hf_scratch={"hidden_act": "silu"},
    hf_notes={"activation": "clamped GLU of x*sigmoid(1.702x) (fixed; Megatron-LM --quick-geglu)",
              "attention sinks": "always: self_attn.sinks (softmax_type 'learnable')",
              "clamped GLU": "swiglu_limit (clamp), offset 1 fixed; swiglu_alpha 1.702 = quick_gelu"},
)
