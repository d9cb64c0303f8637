"""OLMo 2 (``Olmo2ForCausalLM``) and OLMoE (``OlmoeForCausalLM``).

OLMo 2 has Gemma's norms after attention and the MLP and none before them
(``pre_layernorms=False``: no megatron-core or Megatron-Bridge layer spec computes it, so a Megatron
target carries it with a notice); OLMoE is Qwen3-MoE's tensors with every layer MoE and a softmax
over all experts. Both normalize q and k over the whole projection, not per head
(``qk_layernorm_across_heads``, Megatron-Bridge's ``OLMoESelfAttention``).
"""

from __future__ import annotations

from pgconvert.families.experts import EVERY_LAYER_MOE, aux_loss, expert_count, expert_ffn_size
from pgconvert.families.gemma import SANDWICH_ROWS
from pgconvert.families.llama import (
    DENSE_FFN,
    HEAD_DIM_NULL,
    ROPE_DEFAULT,
    ROPE_RULE,
    decoder_fields,
    head_dim_field,
    max_positions,
)
from pgconvert.families.qwen import NORM_TOPK_RULE, PRE_SOFTMAX, QWEN3_MOE_TENSORS
from pgconvert.families.table import DROP, ConfigField, Family, TensorTable

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
