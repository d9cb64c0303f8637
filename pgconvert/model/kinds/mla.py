"""Multi-latent attention (megatron-core's MLASelfAttention) with its input norm.

The input norm is its own module in both specs; the TE spec fuses the q/kv latent norms into the up
projections (TELayerNormColumnParallelLinear).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pgconvert.model.kinds.attention import TE_CORE_ATTENTION
from pgconvert.model.kinds.table import LayerKind, TEModule, TensorKind, hidden
from pgconvert.model.layers import MULTI_LATENT_ATTENTION
from pgconvert.model.rules import COLUMN, REPLICATED, ROW, ShardRule

if TYPE_CHECKING:
    from pgconvert.model.config import ModelConfig

# The projections that carry TE ``_extra_state``: MLASelfAttention registers linear_proj (in
# MultiLatentAttention) before them.
TE_MLA_Q_LINEARS = ("self_attention.linear_q_down_proj", "self_attention.linear_q_up_proj")
TE_MLA_KV_LINEARS = ("self_attention.linear_kv_down_proj", "self_attention.linear_kv_up_proj")


def _q_lora(config: ModelConfig) -> bool:
    return config.attention.q_lora_rank is not None


def _no_q_lora(config: ModelConfig) -> bool:
    return config.attention.q_lora_rank is None


def _down_proj_rule(config: ModelConfig) -> ShardRule:
    """megatron-core's MLA down projections: ``backend.linear()``, a ColumnParallelLinear in the local
    spec (output rows split, gathered in the forward) and TELinear ``parallel_mode='duplicated'``
    (every rank the whole weight) in the Transformer Engine spec."""
    return REPLICATED if config.transformer_impl == "transformer_engine" else COLUMN


def _q_rows(c: ModelConfig) -> int:
    return c.attention.num_attention_heads * c.attention.q_head_dim


def _q_lora_rank(c: ModelConfig) -> int:
    return c.attention.q_lora_rank or 0


KIND = LayerKind(MULTI_LATENT_ATTENTION, tensors=(
    TensorKind("input_layernorm.weight", hidden, REPLICATED),
    TensorKind("self_attention.linear_q_proj.weight", lambda c: (_q_rows(c), c.hidden_size), COLUMN, _no_q_lora),
    TensorKind("self_attention.linear_q_down_proj.weight", lambda c: (_q_lora_rank(c), c.hidden_size),
               _down_proj_rule, _q_lora),
    TensorKind("self_attention.q_layernorm.weight", lambda c: (_q_lora_rank(c),), REPLICATED, _q_lora,
               te_name="self_attention.linear_q_up_proj.layer_norm_weight"),
    TensorKind("self_attention.linear_q_up_proj.weight", lambda c: (_q_rows(c), _q_lora_rank(c)), COLUMN,
               _q_lora),
    TensorKind("self_attention.linear_kv_down_proj.weight",
               lambda c: (c.attention.kv_lora_rank + c.attention.qk_pos_emb_head_dim, c.hidden_size),
               _down_proj_rule),
    TensorKind("self_attention.kv_layernorm.weight", lambda c: (c.attention.kv_lora_rank,), REPLICATED,
               te_name="self_attention.linear_kv_up_proj.layer_norm_weight"),
    TensorKind("self_attention.linear_kv_up_proj.weight",
               lambda c: (c.attention.num_attention_heads * (c.attention.qk_head_dim + c.attention.v_head_dim),
                          c.attention.kv_lora_rank), COLUMN),
    TensorKind("self_attention.linear_proj.weight",
               lambda c: (c.hidden_size, c.attention.num_attention_heads * c.attention.v_head_dim), ROW),
), te_modules=(
    TEModule(TE_CORE_ATTENTION, sharded=False),
    TEModule("self_attention.linear_proj"),
    TEModule("self_attention.linear_q_proj", _no_q_lora),
    *(TEModule(name, _q_lora) for name in TE_MLA_Q_LINEARS),
    *(TEModule(name) for name in TE_MLA_KV_LINEARS),
))
