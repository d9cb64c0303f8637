"""The tiny Qwen3.5 text models (``Qwen3_5ForCausalLM``, ``Qwen3_5MoeForCausalLM``) several tests convert.

They keep the released configurations' structural and semantic fields (the text model of Qwen/Qwen3.5-35B-A3B:
three gated delta net layers to one gated-attention layer; value heads twice the key heads in the linear layers;
eight query heads per key-value head; partial rotary 0.25 at ``rope_theta`` 1e7 with the vision model's
``mrope_section`` / ``mrope_interleaved`` in ``rope_parameters``; RMSNorm at 1e-6; untied output; no biases; the
MoE model: a MoE block with a gated shared expert in every layer), with every size shrunk.
"""

from __future__ import annotations

from pathlib import Path

from support.family_helpers import save_with_side_files, seeded_model
from support.qwen3_next_models import gated_delta_net_value
from transformers import Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig, Qwen3_5TextConfig

TEXT = dict(
    vocab_size=131, hidden_size=32, num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=2, head_dim=8,
    linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
    linear_num_value_heads=4, hidden_act="silu", rms_norm_eps=1e-6, max_position_embeddings=4096,
    tie_word_embeddings=False, attention_bias=False,
    rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                     "mrope_section": [11, 11, 10], "mrope_interleaved": True},
)
DENSE = dict(TEXT, intermediate_size=48)
MOE = dict(TEXT, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16,
           router_aux_loss_coef=0.001)
MODELS = {"dense": (Qwen3_5ForCausalLM, Qwen3_5TextConfig, DENSE), "moe": (Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig, MOE)}


def write_tiny_qwen3_5(directory: Path, kind: str, **changes: object) -> Path:
    """The tiny ``kind`` ("dense" or "moe") model's HF checkpoint (seeded values, side files) in ``directory``."""
    model_class, config_class, config = MODELS[kind]
    model, _ = seeded_model(model_class, config_class(**{**config, **changes}), seed=12, value=gated_delta_net_value)
    return save_with_side_files(model, directory)
