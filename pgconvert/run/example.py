"""A tiny seeded model for the README's example and smoke tests."""

from __future__ import annotations

import torch

from pgconvert.model.config import AttentionConfig, MLPConfig, ModelConfig, NormConfig, PositionConfig
from pgconvert.model.provider import canonical_names, canonical_shapes
from pgconvert.formats.stream import InMemorySource


def example_config() -> ModelConfig:
    """A Llama-shaped toy: GQA (16 heads, 8 groups), SwiGLU, RMSNorm, RoPE, untied, padded vocab."""
    return ModelConfig(
        num_layers=4,
        hidden_size=64,
        attention=AttentionConfig(num_attention_heads=16, num_query_groups=8, kv_channels=8),
        mlp=MLPConfig(ffn_hidden_size=256, gated_linear_unit=True),
        positions=PositionConfig(position_embedding_type="rope", max_position_embeddings=128),
        norms=NormConfig(normalization="RMSNorm"),
        vocab_size=1000,
        params_dtype="bfloat16",
    )


def example_source(config: ModelConfig | None = None, seed: int = 0, iteration: int = 1000) -> InMemorySource:
    """Seeded random weights for every tensor of ``config`` (norm weights near one)."""
    config = config or example_config()
    generator = torch.Generator().manual_seed(seed)
    dtype = getattr(torch, config.params_dtype)
    shapes = canonical_shapes(config)
    tensors = {}
    for name in canonical_names(config):
        tensor = torch.randn(shapes[name], generator=generator) * 0.02
        if "norm" in name.rsplit(".", 1)[0] and name.endswith("weight"):
            tensor += 1.0
        tensors[name] = tensor.to(dtype)
    return InMemorySource(config, tensors, iteration=iteration)
