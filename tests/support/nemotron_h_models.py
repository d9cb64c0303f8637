"""The tiny Nemotron-H models (``NemotronHForCausalLM``, dense and MoE) several tests convert.

It keeps the released configuration's structural fields (nvidia/Nemotron-H-8B-Base-8K, whose values are
transformers' NemotronHConfig defaults: relu2 MLP, SiLU Mamba-2 mixers with a 4-wide biased convolution,
grouped-query attention without positions, RMSNorm at 1e-5, untied output, no biases) and its ``M-``/``M*-``
rhythm of layers, with every size shrunk.
"""

from __future__ import annotations

from pathlib import Path

import torch
from support.family_helpers import save_with_side_files, seeded_model
from transformers import NemotronHConfig, NemotronHForCausalLM

PATTERN = "M-M*-M-M*-M-"
KINDS = {"M": "linear_attention", "*": "full_attention", "-": "mlp"}
TINY = dict(
    vocab_size=131, hidden_size=64, layers_block_type=[KINDS[symbol] for symbol in PATTERN],
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=96,
    mamba_num_heads=8, mamba_head_dim=16, n_groups=2, ssm_state_size=8, conv_kernel=4,
    mlp_hidden_act="relu2", mamba_hidden_act="silu", use_conv_bias=True, use_bias=False, mlp_bias=False,
    attention_bias=False, layer_norm_epsilon=1e-5, tie_word_embeddings=False,
    # Chunks shorter than the test sequence: transformers' chunked scan crosses a chunk boundary.
    chunk_size=8,
)


def _value(name: str, noise: torch.Tensor) -> torch.Tensor:
    """Norms near one; the Mamba time-step bias and decay near their initial values (softplus(dt)
    well above time_step_min, which transformers clamps at and megatron-core does not)."""
    if name.endswith("norm.weight") or name.endswith("norm_f.weight"):
        return 1.0 + 0.1 * noise
    if name.endswith(("dt_bias", "A_log")):
        return 1.0 + 0.2 * noise
    if name.endswith(".D"):
        return 1.0 + 0.1 * noise
    return 0.1 * noise


def write_tiny_nemotron_h(directory: Path) -> Path:
    """The tiny model's HF checkpoint (seeded values, side files) in ``directory``."""
    model, _ = seeded_model(NemotronHForCausalLM, NemotronHConfig(**TINY), seed=3, value=_value)
    return save_with_side_files(model, directory)


# Nemotron 3 Nano's rhythm (nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B: Mamba and MoE layers alternating, an
# attention layer every few) and its MoE settings (sigmoid router with e_score_correction_bias, one
# group, renormalized top-k scaled by 2.5, one relu2 shared expert twice the routed experts' width), shrunk.
MOE_PATTERN = "MEM*EMEM*E"
MOE_KINDS = {**KINDS, "E": "moe"}
TINY_MOE = dict(
    TINY, layers_block_type=[MOE_KINDS[symbol] for symbol in MOE_PATTERN], n_routed_experts=8,
    num_experts_per_tok=4, moe_intermediate_size=32, moe_shared_expert_intermediate_size=64, n_shared_experts=1,
    routed_scaling_factor=2.5, n_group=1, topk_group=1, norm_topk_prob=True, moe_latent_size=None,
)


def write_tiny_nemotron_h_moe(directory: Path) -> Path:
    """The tiny MoE model's HF checkpoint; the routers' expert bias (a buffer) seeded after the parameters."""
    model, generator = seeded_model(NemotronHForCausalLM, NemotronHConfig(**TINY_MOE), seed=5, value=_value)
    with torch.no_grad():
        for name, buffer in sorted(model.named_buffers()):
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(0.05 * torch.randn(buffer.shape, generator=generator))
    return save_with_side_files(model, directory)
