"""Test-only tiny Llama 4 text models (``Llama4ForCausalLM``) in the released configurations, seeded.

Nothing here imports pgconvert.

``SCOUT_TEXT`` is meta-llama/Llama-4-Scout-17B-16E-Instruct's ``text_config`` with every structural and semantic
field as published and the sizes shrunk: every layer MoE (``moe_layers``, ``interleave_moe_layer_step`` 1), top-1
sigmoid routing over 16 → 4 experts with a shared expert, a NoPE layer every fourth (``no_rope_layers``), the
qk L2 norm, chunked attention (8192) and the attention temperature (``floor_scale`` 8192, ``attn_scale`` 0.1) as
released, llama3 RoPE scaling (factor 8 over 8192, low/high 1/4), base 500,000, untied. The release's
``attn_temperature_tuning`` is 4, which transformers 5.24's config class refuses (a bool field): true here.
``MAVERICK_TEXT`` is Llama-4-Maverick's shape: MoE on every second layer (dense MLPs of ``intermediate_size_mlp``
between), no qk norm, no RoPE scaling.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from support.family_helpers import save_with_side_files, seeded_model
from support.hf_side_helpers import BOS, EOS, PAD
from transformers import Llama4ForCausalLM, Llama4TextConfig, PreTrainedModel

LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}

SCOUT_TEXT: dict[str, Any] = dict(
    hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    intermediate_size=32, intermediate_size_mlp=48, num_local_experts=4, num_experts_per_tok=1,
    moe_layers=[0, 1, 2, 3], interleave_moe_layer_step=1, no_rope_layers=[1, 1, 1, 0], use_qk_norm=True,
    attention_chunk_size=8192, attn_temperature_tuning=True, floor_scale=8192, attn_scale=0.1,
    attention_bias=False, attention_dropout=0.0, hidden_act="silu", rms_norm_eps=1e-5,
    rope_parameters=dict(LLAMA3_ROPE), max_position_embeddings=10485760, vocab_size=1030,
    tie_word_embeddings=False, router_aux_loss_coef=0.001, router_jitter_noise=0.0, output_router_logits=False,
    bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD,
)
MAVERICK_TEXT: dict[str, Any] = {
    **SCOUT_TEXT, "moe_layers": None, "interleave_moe_layer_step": 2, "use_qk_norm": False,
    "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}, "max_position_embeddings": 1048576,
}


def llama4_value(name: str, noise: torch.Tensor) -> torch.Tensor:
    """A parameter from its noise: norms near one, routers well separated but their logits far below where an fp32
    sigmoid saturates to 1 (megatron-core takes the top-k of the sigmoids, transformers of the logits: saturated
    scores would tie), the rest small."""
    if name.endswith("layernorm.weight") or name.endswith("norm.weight"):
        return 1.0 + 0.1 * noise
    return 0.25 * noise if name.endswith("router.weight") else 0.05 * noise


def build_llama4(seed: int = 0, base: dict[str, Any] | None = None, **overrides: Any) -> PreTrainedModel:
    config = Llama4TextConfig(**{**(base or SCOUT_TEXT), **overrides})
    model, _ = seeded_model(Llama4ForCausalLM, config, seed, llama4_value)
    return model


def save_llama4(path: Path, seed: int = 0, base: dict[str, Any] | None = None, **overrides: Any) -> Path:
    """A complete tiny release: weights in small shards, generation config, tokenizer, chat template."""
    return save_with_side_files(build_llama4(seed, base, **overrides), path)
