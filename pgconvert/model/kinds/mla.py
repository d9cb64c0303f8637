"""Multi-latent attention (megatron-core's MLASelfAttention) with its input norm, and DeepSeek Sparse
Attention's lightning indexer beside it.

The input norm is its own module in both specs; the TE spec fuses the q/kv latent norms into the up
projections (TELayerNormColumnParallelLinear).

Sparse attention (``dsa_indexer_*``; megatron-core's ``get_dsa_module_spec_for_backend``, core_v0.19.0 on:
AbsorbedMLASelfAttention, whose state dict is MLASelfAttention's) keeps the q/kv latent norms apart from the up
projections even in the TE spec (the indexer takes the normalized q latent) and builds its down projections and
the indexer's linears with ``backend.linear()``, TELinear ``parallel_mode='duplicated'``: every rank holds them
whole. The indexer (``core_attention.indexer``, DSAIndexer) holds ``linear_wq_b`` ``[heads * head_dim,
q_lora_rank]``, ``linear_wk`` ``[head_dim, hidden]``, a LayerNorm ``k_norm`` (weight and bias) and
``linear_weights_proj`` ``[heads, hidden]``; the core attention is DSAttention, no TE module.
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


def _sparse(config: ModelConfig) -> bool:
    return config.attention.sparse


def _dense(config: ModelConfig) -> bool:
    return not config.attention.sparse


def _down_proj_rule(config: ModelConfig) -> ShardRule:
    """megatron-core's MLA down projections: ``backend.linear()``, a ColumnParallelLinear in the local
    spec (output rows split, gathered in the forward) and TELinear ``parallel_mode='duplicated'``
    (every rank the whole weight) in the Transformer Engine spec and the sparse attention spec."""
    return REPLICATED if config.transformer_impl == "transformer_engine" or config.attention.sparse else COLUMN


_INDEXER = "self_attention.core_attention.indexer."
TE_INDEXER_LINEARS = tuple(_INDEXER + name for name in ("linear_wq_b", "linear_wk", "linear_weights_proj"))


def _indexer_head_dim(c: ModelConfig) -> int:
    return c.attention.dsa_indexer_head_dim or 0


def _indexer_heads(c: ModelConfig) -> int:
    return c.attention.dsa_indexer_n_heads or 0


# DSAttention's indexer, registered before linear_proj (Attention.__init__ builds core_attention first).
_INDEXER_ROWS = (
    TensorKind(_INDEXER + "linear_wq_b.weight", lambda c: (_indexer_heads(c) * _indexer_head_dim(c), _q_lora_rank(c)),
               REPLICATED, _sparse),
    TensorKind(_INDEXER + "linear_wk.weight", lambda c: (_indexer_head_dim(c), c.hidden_size), REPLICATED, _sparse),
    TensorKind(_INDEXER + "k_norm.weight", lambda c: (_indexer_head_dim(c),), REPLICATED, _sparse, norm_weight=True),
    TensorKind(_INDEXER + "k_norm.bias", lambda c: (_indexer_head_dim(c),), REPLICATED, _sparse),
    TensorKind(_INDEXER + "linear_weights_proj.weight", lambda c: (_indexer_heads(c), c.hidden_size), REPLICATED,
               _sparse),
)


def _q_rows(c: ModelConfig) -> int:
    return c.attention.num_attention_heads * c.attention.q_head_dim


def _q_lora_rank(c: ModelConfig) -> int:
    return c.attention.q_lora_rank or 0


KIND = LayerKind(MULTI_LATENT_ATTENTION, tensors=(
    TensorKind("input_layernorm.weight", hidden, REPLICATED),
    *_INDEXER_ROWS,
    TensorKind("self_attention.linear_q_proj.weight", lambda c: (_q_rows(c), c.hidden_size), COLUMN, _no_q_lora),
    TensorKind("self_attention.linear_q_down_proj.weight", lambda c: (_q_lora_rank(c), c.hidden_size),
               _down_proj_rule, _q_lora),
    TensorKind("self_attention.q_layernorm.weight", lambda c: (_q_lora_rank(c),), REPLICATED, _q_lora,
               te_name="self_attention.linear_q_up_proj.layer_norm_weight", te_fused=_dense),
    TensorKind("self_attention.linear_q_up_proj.weight", lambda c: (_q_rows(c), _q_lora_rank(c)), COLUMN,
               _q_lora),
    TensorKind("self_attention.linear_kv_down_proj.weight",
               lambda c: (c.attention.kv_lora_rank + c.attention.qk_pos_emb_head_dim, c.hidden_size),
               _down_proj_rule),
    TensorKind("self_attention.kv_layernorm.weight", lambda c: (c.attention.kv_lora_rank,), REPLICATED,
               te_name="self_attention.linear_kv_up_proj.layer_norm_weight", te_fused=_dense),
    TensorKind("self_attention.linear_kv_up_proj.weight",
               lambda c: (c.attention.num_attention_heads * (c.attention.qk_head_dim + c.attention.v_head_dim),
                          c.attention.kv_lora_rank), COLUMN),
    TensorKind("self_attention.linear_proj.weight",
               lambda c: (c.hidden_size, c.attention.num_attention_heads * c.attention.v_head_dim), ROW),
), te_modules=(
    TEModule(TE_CORE_ATTENTION, _dense, sharded=False),
    *(TEModule(name, _sparse) for name in TE_INDEXER_LINEARS),
    TEModule("self_attention.linear_proj"),
    TEModule("self_attention.linear_q_proj", _no_q_lora),
    *(TEModule(name, _q_lora) for name in TE_MLA_Q_LINEARS),
    *(TEModule(name) for name in TE_MLA_KV_LINEARS),
))
