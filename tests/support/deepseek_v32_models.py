"""Test-only: a tiny DeepSeek-V3.2 (DeepSeek Sparse Attention) in the released configuration, and a tiny GLM-5.

``RELEASED`` is deepseek-ai/DeepSeek-V3.2-Exp's config.json as published, its sizes shrunk (``SIZES``) and nothing
else changed but ``quantization_config`` (the tiny weights are float32, not FP8 blocks): YaRN as released, the
sigmoid grouped router (``n_group`` 8, ``topk_group`` 4 over 8 experts per token become 4 groups, 2 chosen, 4
experts per token: transformers and megatron-core both score a group by its best 2), one shared expert, an MTP layer
declared (transformers builds none, so none is stored), ``index_topk`` 4 so that from the fifth token on the indexer
keeps a strict subset of the keys at ``SEQ`` tokens.

``GLM5_TINY`` is GlmMoeDsaConfig's defaults (transformers' GLM-5 class; no released config.json is at hand here)
shrunk the same way: no router groups, ``rms_norm_eps`` 1e-5 (the indexer's k_norm keeps 1e-6), the indexer's RoPE
interleaved, every layer's indexer ``full``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

RELEASED: dict[str, Any] = {
    "architectures": ["DeepseekV32ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 0, "eos_token_id": 1, "ep_size": 1, "first_k_dense_replace": 3, "hidden_act": "silu",
    "hidden_size": 7168, "index_head_dim": 128, "index_n_heads": 64, "index_topk": 2048, "initializer_range": 0.02,
    "intermediate_size": 18432, "kv_lora_rank": 512, "max_position_embeddings": 163840, "model_type": "deepseek_v32",
    "moe_intermediate_size": 2048, "moe_layer_freq": 1, "n_group": 8, "n_routed_experts": 256, "n_shared_experts": 1,
    "norm_topk_prob": True, "num_attention_heads": 128, "num_experts_per_tok": 8, "num_hidden_layers": 61,
    "num_key_value_heads": 128, "num_nextn_predict_layers": 1, "q_lora_rank": 1536, "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64, "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "tie_word_embeddings": False,
    "topk_group": 4, "topk_method": "noaux_tc", "torch_dtype": "bfloat16", "transformers_version": "4.44.2",
    "use_cache": True, "v_head_dim": 128, "vocab_size": 129280,
}
SIZES: dict[str, Any] = {
    "hidden_size": 64, "index_head_dim": 16, "index_n_heads": 4, "index_topk": 4, "intermediate_size": 96,
    "kv_lora_rank": 16, "moe_intermediate_size": 32, "n_group": 4, "n_routed_experts": 8, "num_attention_heads": 4,
    "num_experts_per_tok": 4, "num_hidden_layers": 4, "first_k_dense_replace": 1, "num_key_value_heads": 4,
    "q_lora_rank": 24, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "topk_group": 2, "v_head_dim": 12,
    "vocab_size": 250, "torch_dtype": "float32",
}
TINY: dict[str, Any] = {**RELEASED, **SIZES}
GLM5_TINY: dict[str, Any] = {
    **SIZES, "architectures": ["GlmMoeDsaForCausalLM"], "model_type": "glm_moe_dsa", "n_group": 1, "topk_group": 1,
    "rms_norm_eps": 1e-5, "num_nextn_predict_layers": 1, "tie_word_embeddings": False,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
}
SEQ = 12


def input_ids(seed: int = 1) -> torch.Tensor:
    return torch.randint(0, TINY["vocab_size"], (2, SEQ), generator=torch.Generator().manual_seed(seed))


def write_tiny(path: Path, seed: int = 0, base: dict[str, Any] = TINY) -> Path:
    """The tiny model saved by transformers (its config.json then set back to ``base``, as released), every
    parameter and router bias drawn at random."""
    from transformers import AutoConfig, AutoModelForCausalLM

    path.mkdir(parents=True)
    doc = dict(base)
    (path / "config.json").write_text(json.dumps(doc))
    config = AutoConfig.from_pretrained(path)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            norm = name.endswith("norm.weight")
            param.copy_((1.0 if norm else 0.0) + (0.2 if norm else 0.3) * torch.randn(param.shape, generator=generator))
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(0.1 * torch.randn(buffer.shape, generator=generator))
    model.save_pretrained(path)
    (path / "config.json").write_text(json.dumps(doc))
    return path


def logits(path: Path, ids: torch.Tensor) -> torch.Tensor:
    """transformers' float32 logits of the checkpoint at ``path`` (eager attention: the indexer's mask is exact)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        return model(input_ids=ids).logits
