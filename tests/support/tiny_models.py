"""The tiny models of the architecture matrix most tests convert (the ``tiny_model`` fixture's and others)."""

from __future__ import annotations

import torch

from support.megatron_fixtures import TinyModel


# GQA + SwiGLU + RMSNorm + RoPE + untied + padded vocab (1000 -> 1024 at every tp <= 8).
GQA_SWIGLU = TinyModel(
    num_layers=4, hidden_size=64, num_attention_heads=16, num_query_groups=8, kv_channels=4,
    ffn_hidden_size=128, vocab_size=1000, swiglu=True, normalization="RMSNorm",
    add_bias_linear=False, add_qkv_bias=False, qk_layernorm=False, tied_embeddings=False,
    position_embedding_type="rope",
)


# MHA + GELU + LayerNorm + biases + tied + learned absolute positions.
MHA_GELU_TIED = TinyModel(
    num_layers=4, hidden_size=64, num_attention_heads=8, num_query_groups=8, kv_channels=8,
    ffn_hidden_size=128, vocab_size=1000, swiglu=False, normalization="LayerNorm",
    add_bias_linear=True, add_qkv_bias=False, qk_layernorm=False, tied_embeddings=True,
    position_embedding_type="learned_absolute", max_position_embeddings=32,
)


# qk-layernorm + QKV-only bias, Transformer-Engine-spec key names, bf16.
QK_NORM_TE = TinyModel(
    num_layers=4, hidden_size=64, num_attention_heads=16, num_query_groups=8, kv_channels=4,
    ffn_hidden_size=128, vocab_size=1000, swiglu=True, normalization="RMSNorm",
    add_bias_linear=False, add_qkv_bias=True, qk_layernorm=True, tied_embeddings=False,
    position_embedding_type="rope", transformer_impl="transformer_engine", dtype=torch.bfloat16,
)


# MoE: 8 experts (SwiGLU, ffn 64), layers 0, 2, 3 MoE and layer 1 dense, shared experts with a gate,
# router expert bias (float32 in a bf16 model).
MOE = TinyModel(
    num_layers=4, hidden_size=64, num_attention_heads=16, num_query_groups=8, kv_channels=4,
    ffn_hidden_size=128, vocab_size=1000, swiglu=True, normalization="RMSNorm",
    add_bias_linear=False, add_qkv_bias=False, qk_layernorm=False, tied_embeddings=False,
    position_embedding_type="rope", dtype=torch.bfloat16, num_experts=8, moe_ffn_hidden_size=64,
    moe_layer_freq=[1, 0, 1, 1], moe_shared_expert_intermediate_size=96, moe_shared_expert_gate=True,
    moe_router_enable_expert_bias=True,
)


# Grouped-GEMM experts, TE naming, every other layer MoE, GELU, LayerNorm, qk-norm, tied, learned positions.
MOE_GROUPED_TE = TinyModel(
    num_layers=4, hidden_size=64, num_attention_heads=16, num_query_groups=8, kv_channels=4,
    ffn_hidden_size=128, vocab_size=1000, swiglu=False, normalization="LayerNorm",
    add_bias_linear=False, add_qkv_bias=True, qk_layernorm=True, tied_embeddings=True,
    position_embedding_type="learned_absolute", transformer_impl="transformer_engine",
    num_experts=8, moe_layer_freq=2, moe_grouped_gemm=True,
)


MODELS = {"gqa_swiglu_untied": GQA_SWIGLU, "mha_gelu_tied": MHA_GELU_TIED, "qknorm_te_bf16": QK_NORM_TE}
