"""Self-attention (multi-head or grouped-query; megatron-core's SelfAttention) with its input norm."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pgconvert.model.kinds.table import (LayerKind, TEModule, TensorKind, fused_norm_name, hidden, layernorm,
                                         linear_bias, pre_norm, pre_norm_bias)
from pgconvert.model.layers import SELF_ATTENTION
from pgconvert.model.rules import COLUMN, REPLICATED, ROW

if TYPE_CHECKING:
    from pgconvert.model.config import ModelConfig

# The attention modules that carry TE ``_extra_state``, in registration order. megatron-core's
# torch_dist checkpoint saves none for the core attention (TEDotProductAttention.sharded_state_dict).
TE_CORE_ATTENTION = "self_attention.core_attention"
TE_ATTENTION_LINEARS = ("self_attention.linear_proj", "self_attention.linear_qkv")


def _qk_norm(config: ModelConfig) -> bool:
    return config.attention.qk_layernorm


def _qk_norm_bias(config: ModelConfig) -> bool:
    return config.attention.qk_layernorm and layernorm(config)


def _qkv_bias(config: ModelConfig) -> bool:
    return config.has_qkv_bias


def _post_attention_norm(config: ModelConfig) -> bool:
    return config.norms.post_self_attn_layernorm


def _sinks(config: ModelConfig) -> bool:
    return config.attention.softmax_type == "learnable"


def _qkv_rows(c: ModelConfig) -> tuple[int, ...]:
    return (c.attention.qkv_rows,)


def _q_norm_shape(c: ModelConfig) -> tuple[int, ...]:
    """Per head, or over every query head, replicated in HF's head order as Megatron-Bridge's
    OLMoESelfAttention holds it (src/megatron/bridge/models/olmoe/olmoe_provider.py)."""
    attention = c.attention
    return ((attention.num_attention_heads * attention.head_dim,) if attention.qk_layernorm_across_heads
            else (attention.head_dim,))


def _k_norm_shape(c: ModelConfig) -> tuple[int, ...]:
    attention = c.attention
    return (attention.query_groups * attention.head_dim,) if attention.qk_layernorm_across_heads else (attention.head_dim,)


# Names relative to ``decoder.layers.{L}.``; the TE spec's names of the fused norms come from
# ``FUSED_NORM_NAMES``.
KIND = LayerKind(SELF_ATTENTION, tensors=(
    TensorKind("input_layernorm.weight", hidden, REPLICATED, pre_norm,
               te_name=fused_norm_name("input_layernorm.weight"), norm_weight=True),
    TensorKind("input_layernorm.bias", hidden, REPLICATED, pre_norm_bias,
               te_name=fused_norm_name("input_layernorm.bias")),
    TensorKind("self_attention.linear_qkv.weight", lambda c: (c.attention.qkv_rows, c.hidden_size), COLUMN,
               rotary="qkv"),
    TensorKind("self_attention.linear_qkv.bias", _qkv_rows, COLUMN, _qkv_bias, rotary="qkv"),
    TensorKind("self_attention.q_layernorm.weight", _q_norm_shape, REPLICATED, _qk_norm, norm_weight=True,
               rotary="head"),
    TensorKind("self_attention.q_layernorm.bias", _q_norm_shape, REPLICATED, _qk_norm_bias),
    TensorKind("self_attention.k_layernorm.weight", _k_norm_shape, REPLICATED, _qk_norm, norm_weight=True,
               rotary="head"),
    TensorKind("self_attention.k_layernorm.bias", _k_norm_shape, REPLICATED, _qk_norm_bias),
    TensorKind("self_attention.linear_proj.weight",
               lambda c: (c.hidden_size, c.attention.num_attention_heads * c.attention.head_dim), ROW),
    TensorKind("self_attention.linear_proj.bias", hidden, REPLICATED, linear_bias),
    # The post-attention norm, a TENorm inside Megatron-Bridge's TERowParallelLinearLayerNorm
    # linear_proj (NVIDIA-NeMo/Megatron-Bridge src/megatron/bridge/models/gemma/gemma3_provider.py).
    TensorKind("self_attention.linear_proj.post_layernorm.weight", hidden, REPLICATED, _post_attention_norm,
               norm_weight=True),
    # Attention sinks, one logit per head, split over TP with the heads (megatron-core's
    # DotProductAttention.sharded_state_dict: {'softmax_offset': 0}).
    TensorKind("self_attention.core_attention.softmax_offset", lambda c: (c.attention.num_attention_heads,),
               COLUMN, _sinks),
), te_modules=(
    TEModule(TE_CORE_ATTENTION, sharded=False),
    *(TEModule(name) for name in TE_ATTENTION_LINEARS),
))
