"""Test-only helpers for MiniMax-M2: a tiny seeded release and its independent TP forward pass.

Nothing here imports pgconvert. The release's shape at test size: 6 query heads per KV head with
heads × head_dim = 2 × hidden, RoPE on half of each head (``rotary_dim``), q/k norms over the whole
projection, every layer MoE with no shared expert and a sigmoid router with a non-zero
``e_score_correction_bias``, RoPE base 5e6, eps 1e-6, untied, a vocab not a multiple of 128, and
the keys MiniMaxM2Config ignores set as the release sets them (``use_qk_norm``, ``qk_norm_type``,
``scoring_func``, ``use_routing_bias``, ``shared_intermediate_size``, ``attn_type_list``, the MTP keys).
The reference forward is GLM-4.5-MoE's (tests/support/glm4_moe_gpt_oss_helpers.py) with those settings.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from support.family_helpers import save_with_side_files, seeded_model
from support.glm4_moe_gpt_oss_helpers import glm4_moe_tp_logits, seed_correction_biases, sigmoid_moe_value
from support.hf_side_helpers import BOS, EOS, PAD
from transformers import MiniMaxM2Config, MiniMaxM2ForCausalLM, PreTrainedModel

LAYERS = 4
MINIMAX_M2_KWARGS: dict[str, Any] = dict(
    hidden_size=96, num_hidden_layers=LAYERS, num_attention_heads=12, num_key_value_heads=2, head_dim=16,
    rotary_dim=8, intermediate_size=48, num_local_experts=8, num_experts_per_tok=4, vocab_size=1030,
    max_position_embeddings=196608, rms_norm_eps=1e-6, rope_theta=5e6, tie_word_embeddings=False,
    bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD,
    use_qk_norm=True, qk_norm_type="per_layer", scoring_func="sigmoid", use_routing_bias=True,
    shared_intermediate_size=0, attn_type_list=[1] * LAYERS, use_mtp=True, num_mtp_modules=3,
    mtp_transformer_layers=1,
)


def build_minimax_m2(seed: int = 0, **overrides: Any) -> PreTrainedModel:
    """The tiny fp32 model: norms near one, routers unit-scale (well separated), the rest small."""
    config = MiniMaxM2Config(**{**MINIMAX_M2_KWARGS, **overrides})
    model, generator = seeded_model(MiniMaxM2ForCausalLM, config, seed, sigmoid_moe_value)
    seed_correction_biases(model, generator)
    return model


def save_minimax_m2(path: Path, seed: int = 0, **overrides: Any) -> Path:
    """A complete tiny release: weights in small shards, generation config, tokenizer, chat template."""
    return save_with_side_files(build_minimax_m2(seed, **overrides), path)


def minimax_m2_tp_logits(models: list[dict[str, torch.Tensor]], c: dict[str, Any], ids: torch.Tensor,
                         rotary_dim: int | None = None) -> torch.Tensor:
    """Logits from TP rank dicts (float64): q/k norms over the whole projection, RoPE on the first
    ``rotary_dim`` (config.json's unless given) of each head, sigmoid routing, weights renormalized."""
    rotary = c["rotary_dim"] if rotary_dim is None else rotary_dim
    settings = {**c, "use_qk_norm": True, "qk_norm_across_heads": True, "n_routed_experts": c["num_local_experts"],
                "routed_scaling_factor": 1.0,
                "rope_parameters": {"rope_theta": c["rope_parameters"]["rope_theta"],
                                    "partial_rotary_factor": rotary / c["head_dim"]}}
    return glm4_moe_tp_logits(models, settings, ids)
