"""The tiny Qwen3-Next model (``Qwen3NextForCausalLM``) several tests convert.

It keeps the released configuration's structural and semantic fields (Qwen/Qwen3-Next-80B-A3B-Instruct:
``full_attention_interval`` 4, so three gated delta net layers to one gated-attention layer; a MoE block in
every layer (``decoder_sparse_step`` 1, no ``mlp_only_layers``) with a shared expert behind its sigmoid gate;
``norm_topk_prob`` true; value heads twice the key heads in the linear layers; eight query heads per key-value
head; partial rotary 0.25 at ``rope_theta`` 1e7; RMSNorm at 1e-6; untied output; no biases), with every size
shrunk.
"""

from __future__ import annotations

from pathlib import Path

import torch
from support.family_helpers import save_with_side_files, seeded_model
from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

TINY = dict(
    vocab_size=131, hidden_size=32, intermediate_size=48, num_hidden_layers=8, num_attention_heads=16,
    num_key_value_heads=2, head_dim=8, full_attention_interval=4, linear_conv_kernel_dim=4,
    linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
    decoder_sparse_step=1, mlp_only_layers=[], num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
    shared_expert_intermediate_size=16, norm_topk_prob=True, hidden_act="silu", rms_norm_eps=1e-6,
    max_position_embeddings=4096, tie_word_embeddings=False, attention_bias=False, router_aux_loss_coef=0.001,
    rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
)


def gated_delta_net_value(name: str, noise: torch.Tensor) -> torch.Tensor:
    """The gated delta nets' output norms near one (stored as HF computes with them; megatron-core's are
    zero-centred, w - 1, exact in [0.5, 2]); every other norm (1 + w) and the time-step bias and decay near
    their initial values."""
    if name.endswith("linear_attn.norm.weight"):
        return 1.0 + 0.1 * noise
    if name.endswith("norm.weight"):
        return 0.1 * noise
    if name.endswith(("dt_bias", "A_log")):
        return 1.0 + 0.2 * noise
    return 0.1 * noise


def write_tiny_qwen3_next(directory: Path, **changes: object) -> Path:
    """The tiny model's HF checkpoint (seeded values, side files) in ``directory``, with ``changes`` to its config."""
    model, _ = seeded_model(Qwen3NextForCausalLM, Qwen3NextConfig(**{**TINY, **changes}), seed=11, value=gated_delta_net_value)
    return save_with_side_files(model, directory)
