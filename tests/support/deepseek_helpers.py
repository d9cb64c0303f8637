"""Test-only helpers: tiny seeded transformers DeepSeek-V2/V3 models (MLA, shared experts, groups)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

# name -> (version, config overrides). 4 layers, layer 0 dense; 8 experts; vocab 250 (Megatron pads it).
_COMMON: dict[str, Any] = dict(
    vocab_size=250, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8, num_experts_per_tok=2,
    kv_lora_rank=16, qk_rope_head_dim=8, v_head_dim=12, qk_nope_head_dim=16, first_k_dense_replace=1,
    max_position_embeddings=32, rms_norm_eps=1e-6, tie_word_embeddings=False,
)
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8, "beta_fast": 32.0, "beta_slow": 1.0,
        "mscale": 1.0, "mscale_all_dim": 0.8, "rope_theta": 10000.0}
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    # V3: 2 groups, 1 chosen (HF's top-2 group score = megatron's topk // group_topk = 2), q-LoRA, YaRN.
    "v3": ("v3", dict(_COMMON, q_lora_rank=24, n_group=2, topk_group=1, routed_scaling_factor=2.5,
                      norm_topk_prob=True, rope_parameters=dict(YARN))),
    # V3 without q-LoRA (one q projection), plain RoPE.
    "v3_no_q_lora": ("v3", dict(_COMMON, q_lora_rank=None, n_group=2, topk_group=1, routed_scaling_factor=1.5)),
    # V2-Lite style: no q-LoRA, softmax, group_limited_greedy (best expert per group), 2 shared experts.
    "v2": ("v2", dict(_COMMON, q_lora_rank=None, n_group=4, topk_group=2, topk_method="group_limited_greedy",
                      n_shared_experts=2, routed_scaling_factor=1.25, rope_parameters=dict(YARN, mscale=0.707,
                                                                                           mscale_all_dim=0.707))),
    # V2 with q-LoRA, greedy routing.
    "v2_q_lora": ("v2", dict(_COMMON, q_lora_rank=24, topk_method="greedy")),
}


def build_deepseek(case: str, seed: int = 0) -> Any:
    """A float32 model with every parameter and the router bias buffers drawn at random."""
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM, DeepseekV3Config, DeepseekV3ForCausalLM

    version, kwargs = CASES[case]
    config_class, model_class = ((DeepseekV3Config, DeepseekV3ForCausalLM) if version == "v3"
                                 else (DeepseekV2Config, DeepseekV2ForCausalLM))
    torch.manual_seed(seed)
    model = model_class(config_class(**kwargs)).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            scale = 1.0 if name.endswith("norm.weight") else 0.2
            offset = 1.0 if name.endswith("norm.weight") else 0.0
            param.copy_(offset + scale * torch.randn(param.shape, generator=generator))
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(0.1 * torch.randn(buffer.shape, generator=generator))
    return model


def save(model: Any, path: Path) -> Path:
    model.save_pretrained(path)
    return path


def logits(model_or_path: Any, ids: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = model_or_path
    if isinstance(model_or_path, Path):
        model = AutoModelForCausalLM.from_pretrained(model_or_path, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(input_ids=ids).logits
