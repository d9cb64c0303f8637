"""OLMo 2 (``Olmo2ForCausalLM``), OLMo 3 (``Olmo3ForCausalLM``) and OLMoE (``OlmoeForCausalLM``).

OLMo 2 has Gemma's norms after attention and the MLP and none before them
(``pre_layernorms=False``: no megatron-core or Megatron-Bridge layer spec computes it, so a Megatron
target carries it with a notice); OLMoE is Qwen3-MoE's tensors with every layer MoE and a softmax
over all experts. Both normalize q and k over the whole projection, not per head
(``qk_layernorm_across_heads``, Megatron-Bridge's ``OLMoESelfAttention``).

OLMo 3 (allenai/Olmo-3-7B, Olmo-3-32B) is OLMo 2 with a sliding window (``sliding_window``, 4096) on the
layers ``layer_types`` marks (by default three in four, every 4th full attention: megatron-core's
``window_size`` with ``window_attn_skip_freq``) and a RoPE per layer type (``rope_parameters.
{sliding,full}_attention``, base 500000 by default). megatron-core applies one RoPE to every layer, so
the two must agree on the layer types the model has; the long-context releases' YaRN, which 4.x's
``rope_scaling`` lays over the full-attention layers only, is refused, named.
"""

from __future__ import annotations

from collections.abc import Mapping

from pgconvert.io.limits import quote
from pgconvert.model.config import ModelConfig
from pgconvert.families.experts import EVERY_LAYER_MOE, aux_loss, expert_count, expert_ffn_size
from pgconvert.families.gemma import SANDWICH_ROWS, rope_block, rope_parameters_of, rope_theta_of
from pgconvert.families.llama import (
    DENSE_FFN,
    HEAD_DIM_NULL,
    ROPE_DEFAULT,
    ROPE_RULE,
    decoder_fields,
    head_dim_field,
    max_positions,
    read_rope,
    write_rope,
)
from pgconvert.families.qwen import NORM_TOPK_RULE, PRE_SOFTMAX, QWEN3_MOE_TENSORS
from pgconvert.families.sliding_window import layer_types_window, write_layer_types_window
from pgconvert.families.table import DROP, ConfigField, ConfigRule, Family, TensorTable

# Gemma's rows without the pre-norms (norms only after attention and the MLP).
_PRE_NORMS = ("decoder.layers.{}.input_layernorm.weight", "decoder.layers.{}.pre_mlp_layernorm.weight")
OLMO2_TENSORS = TensorTable(tuple(row for row in SANDWICH_ROWS if row.canonical not in _PRE_NORMS))

# SwiGLU, RMSNorm (w, not 1 + w), RoPE, none of Gemma's settings: the families with norms after
# their sublayers but Gemma's (OLMo, GLM-4); each says which norms it has in its own fixed values.
PLAIN_SWIGLU: dict[str, object] = {
    "gated_linear_unit": True, "activation": "silu", "normalization": "RMSNorm", "position_embedding_type": "rope",
    "add_bias_linear": False, "layernorm_zero_centered_gamma": False, "embedding_scale_sqrt_hidden": False,
    "attn_logit_softcapping": None, "final_logit_softcapping": None,
    "rotary_base_local": None, "sliding_window": None,
}
_MOE_OFF: dict[str, object] = {"moe_shared_expert_intermediate_size": None, "moe_router_enable_expert_bias": False}
_HF_OLMO: dict[str, object] = {"hidden_act": "silu", "attention_bias": False}
_ACROSS_HEADS_NOTE = "always, over the whole projection"

OLMO2 = Family(
    architecture="Olmo2ForCausalLM",
    model_type="olmo2",
    tensors=OLMO2_TENSORS,
    fields=(*decoder_fields(max_position_embeddings=2048, norm_epsilon=1e-5,
                            head_dim=head_dim_field(null_refused=HEAD_DIM_NULL)), DENSE_FFN),
    rules=(ROPE_RULE,),
    fixed={**PLAIN_SWIGLU, "num_experts": None, "add_qkv_bias": False, "qk_layernorm": True,
           "qk_layernorm_across_heads": True, "pre_layernorms": False, "post_self_attn_layernorm": True,
           "post_mlp_layernorm": True},
    hf_fixed=_HF_OLMO,
    hf_scratch=ROPE_DEFAULT,
    hf_notes={"qk-norm": _ACROSS_HEADS_NOTE,
              "post-sublayer norms": "post_attention_layernorm, post_feedforward_layernorm; no pre-norms (always)"},
)

# --- OLMo 3: OLMo 2 with sliding-window attention and a RoPE per layer type ----------------------

_OLMO3_THETA = 500_000.0  # Olmo3Config.default_theta
_WINDOW_PERIOD = 4  # Olmo3Config's default layer_types: every 4th layer full attention


def _olmo3_rope_blocks(present: Mapping[str, object]) -> dict[str, dict[str, object]]:
    """Each layer type's RoPE block as Olmo3Config completes it: ``rope_parameters``' own (without it:
    plain), 4.x's ``rope_scaling`` laid over the full-attention layers', and a top-level ``rope_theta``
    for the full-attention layers only (the sliding ones then take ``default_theta``)."""
    params = rope_parameters_of(present)
    given = "rope_parameters" in present
    full = {**(rope_block(params, "full_attention") if given else {"rope_type": "default"}),
            **rope_parameters_of(present, "rope_scaling")}
    local = dict(rope_block(params, "sliding_attention") if given else {"rope_type": "default"})
    full["rope_theta"] = rope_theta_of(full, "rope_parameters.full_attention", present, "rope_theta", _OLMO3_THETA)
    local["rope_theta"] = rope_theta_of(local, "rope_parameters.sliding_attention", {}, "rope_theta", _OLMO3_THETA)
    return {"full_attention": full, "sliding_attention": local}


def _read_olmo3_layers(present: Mapping[str, object], model: Mapping[str, object]) -> Mapping[str, object]:
    """The window on the layers ``layer_types`` marks, and one RoPE for the layer types the model has:
    megatron-core applies one to every layer, so blocks that differ (the long-context releases' YaRN on
    the full-attention layers only) are refused, named."""
    window = layer_types_window(present, model, _WINDOW_PERIOD)
    blocks = _olmo3_rope_blocks(present)
    windowed = window["sliding_window"] is not None
    used = [kind for kind, has in (("full_attention", not windowed or window["window_layers"] is not None),
                                   ("sliding_attention", windowed)) if has]
    readings = [{**read_rope({"rope_parameters": blocks[kind]}, model), "rotary_base": blocks[kind]["rope_theta"]}
                for kind in used]
    if any(reading != readings[0] for reading in readings):
        raise ValueError(f"rope_parameters.full_attention={quote(blocks['full_attention'])} and "
                         f"rope_parameters.sliding_attention={quote(blocks['sliding_attention'])}: Megatron applies "
                         "one RoPE to every layer, so layers of both types need the same")
    return {**window, **readings[0]}


def _write_olmo3_layers(config: ModelConfig) -> Mapping[str, object]:
    params = write_rope(config)["rope_parameters"]
    assert isinstance(params, dict)
    return {**write_layer_types_window(config),
            "rope_parameters": {kind: dict(params) for kind in ("sliding_attention", "full_attention")}}


OLMO3 = OLMO2.derive(
    "Olmo3ForCausalLM", "olmo3",
    # Olmo3Config's 2048 positions, RMS eps 1e-5 and (absent or null) one KV head per query head, as OLMo 2's.
    rules=(ConfigRule(keys=("rope_parameters", "sliding_window", "layer_types"),
                      model_fields=(*ROPE_RULE.model_fields, "rotary_base", "sliding_window", "window_layers"),
                      read=_read_olmo3_layers, write=_write_olmo3_layers,
                      null_keys=("sliding_window", "rope_theta"), legacy_keys=("rope_scaling", "rope_theta")),),
    hf_notes={"sliding window": "sliding_window, layer_types (by default every 4th layer full attention)",
              "rope theta": "rope_parameters.{sliding,full}_attention.rope_theta (the same)"},
)


# OLMo 2 with Qwen3-MoE's tensors: every layer MoE (intermediate_size is the experts' FFN), norms
# before the sublayers, not after.
OLMOE = OLMO2.derive(
    "OlmoeForCausalLM", "olmoe",
    tensors=QWEN3_MOE_TENSORS,
    fields=(
        max_positions(4096),
        ConfigField(("intermediate_size",), "moe_ffn_hidden_size", int, default=2048, written=expert_ffn_size),
        expert_count("num_experts", 64, legacy="num_local_experts"),
        ConfigField(("num_experts_per_tok",), "moe_router_topk", int, default=8),
        aux_loss(0.01),
    ),
    rules=(EVERY_LAYER_MOE, NORM_TOPK_RULE),
    fixed={**_MOE_OFF, "pre_layernorms": True, "post_self_attn_layernorm": False, "post_mlp_layernorm": False},
    hf_computes=PRE_SOFTMAX,
    # clip_qkv clamps q, k and v: no Megatron layer does.
    hf_fixed={"clip_qkv": None},
    hf_notes={"post-sublayer norms": DROP, "moe pre-softmax": "norm_topk_prob = not pre_softmax"},
)
