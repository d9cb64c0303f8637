"""ModelConfig: the architecture of a GPT-style decoder, validated on construction."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from pgconvert.errors import ConfigError
from pgconvert.limits import quote

NORMALIZATIONS = ("RMSNorm", "LayerNorm")
POSITION_EMBEDDINGS = ("rope", "learned_absolute", "none")
ACTIVATIONS = ("silu", "gelu")
# Megatron's two layer specs name the fused norms differently; pgconvert keeps the source's choice.
TRANSFORMER_IMPLS = ("local", "transformer_engine")
DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class ModelConfig:
    """The architecture: everything needed to know every tensor's global name and shape.

    ``vocab_size`` is the true (tokenizer) vocabulary, ``None`` when unknown; padding is a
    property of a layout (see ``ParallelLayout.padded_vocab_size``).
    """

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    ffn_hidden_size: int
    num_query_groups: int | None = None
    kv_channels: int | None = None
    vocab_size: int | None = None
    make_vocab_size_divisible_by: int = 128
    gated_linear_unit: bool = True
    activation: str = "silu"
    normalization: str = "RMSNorm"
    norm_epsilon: float = 1e-5
    add_bias_linear: bool = False
    add_qkv_bias: bool = False
    qk_layernorm: bool = False
    tie_embeddings: bool = False
    position_embedding_type: str = "rope"
    max_position_embeddings: int | None = None
    rotary_base: float = 10000.0
    params_dtype: str = "bfloat16"
    transformer_impl: str = "local"
    # Mixture of experts (megatron-core's TransformerConfig names, ``moe_`` prefix kept).
    num_experts: int | None = None
    moe_ffn_hidden_size: int | None = None
    moe_layer_freq: int | tuple[int, ...] = 1
    moe_router_topk: int = 2
    moe_shared_expert_intermediate_size: int | None = None
    moe_shared_expert_gate: bool = False
    moe_router_enable_expert_bias: bool = False
    # Only key names: grouped GEMM (``experts.linear_fc1.weight{j}``) vs SequentialMLP.
    moe_grouped_gemm: bool = False

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size",
                     "make_vocab_size_divisible_by"):
            _require_positive(name, getattr(self, name))
        for name in ("norm_epsilon", "rotary_base"):
            _require_finite(name, getattr(self, name))
        if self.num_query_groups is None:
            object.__setattr__(self, "num_query_groups", self.num_attention_heads)
        if self.kv_channels is None:
            if self.hidden_size % self.num_attention_heads:
                raise ConfigError(
                    f"kv_channels: not given and hidden_size={self.hidden_size} is not divisible "
                    f"by num_attention_heads={self.num_attention_heads}"
                )
            object.__setattr__(self, "kv_channels", self.hidden_size // self.num_attention_heads)
        _require_positive("num_query_groups", self.num_query_groups)
        _require_positive("kv_channels", self.kv_channels)
        if self.num_attention_heads % self.query_groups:
            raise ConfigError(
                f"num_query_groups={self.query_groups}: num_attention_heads="
                f"{self.num_attention_heads} must be a multiple of it"
            )
        if self.vocab_size is not None:
            _require_positive("vocab_size", self.vocab_size)
        _require_choice("normalization", self.normalization, NORMALIZATIONS)
        _require_choice("position_embedding_type", self.position_embedding_type, POSITION_EMBEDDINGS)
        _require_choice("activation", self.activation, ACTIVATIONS)
        _require_choice("transformer_impl", self.transformer_impl, TRANSFORMER_IMPLS)
        _require_choice("params_dtype", self.params_dtype, DTYPES)
        if self.position_embedding_type == "learned_absolute":
            if self.max_position_embeddings is None:
                raise ConfigError(
                    "max_position_embeddings: required when position_embedding_type='learned_absolute'"
                )
        # Checked with RoPE too: it is written into every output's config (a fuzz find).
        if self.max_position_embeddings is not None:
            _require_positive("max_position_embeddings", self.max_position_embeddings)
        if self.num_experts is not None:
            _require_positive("num_experts", self.num_experts)
            if self.moe_ffn_hidden_size is not None:
                _require_positive("moe_ffn_hidden_size", self.moe_ffn_hidden_size)
            if self.moe_shared_expert_intermediate_size is not None:
                _require_positive("moe_shared_expert_intermediate_size", self.moe_shared_expert_intermediate_size)
            _require_positive("moe_router_topk", self.moe_router_topk)
            if self.add_bias_linear:
                raise ConfigError("add_bias_linear=True: biases on expert linears are not supported")
            if isinstance(self.moe_layer_freq, list):
                object.__setattr__(self, "moe_layer_freq", tuple(self.moe_layer_freq))
            if isinstance(self.moe_layer_freq, tuple):
                if len(self.moe_layer_freq) != self.num_layers or set(self.moe_layer_freq) - {0, 1}:
                    raise ConfigError(
                        f"moe_layer_freq={list(self.moe_layer_freq)}: must list 0 or 1 for each of the "
                        f"{self.num_layers} layers"
                    )
            else:
                _require_positive("moe_layer_freq", self.moe_layer_freq)

    @property
    def query_groups(self) -> int:
        """``num_query_groups`` after defaulting (never None)."""
        assert self.num_query_groups is not None
        return self.num_query_groups

    @property
    def head_dim(self) -> int:
        """``kv_channels`` after defaulting (never None)."""
        assert self.kv_channels is not None
        return self.kv_channels

    @property
    def qkv_rows(self) -> int:
        """Rows of the fused QKV weight: every query head plus one key and one value head per group."""
        return (self.num_attention_heads + 2 * self.query_groups) * self.head_dim

    @property
    def has_qkv_bias(self) -> bool:
        return self.add_bias_linear or self.add_qkv_bias

    @property
    def fc1_rows(self) -> int:
        return self.ffn_hidden_size * (2 if self.gated_linear_unit else 1)

    @property
    def expert_ffn_size(self) -> int:
        """FFN size of one routed expert (``moe_ffn_hidden_size``, defaulting to ``ffn_hidden_size``)."""
        return self.moe_ffn_hidden_size or self.ffn_hidden_size

    def is_moe_layer(self, layer: int) -> bool:
        """megatron-core's ``moe_layer_freq``: every k-th layer (int) or a 0/1 pattern (list)."""
        if self.num_experts is None:
            return False
        if isinstance(self.moe_layer_freq, tuple):
            return self.moe_layer_freq[layer] == 1
        return layer % self.moe_layer_freq == 0

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _require_positive(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ConfigError(f"{name}={quote(value)}: must be a positive integer")


def _require_finite(name: str, value: object) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise ConfigError(f"{name}={quote(value)}: must be a finite number")


def _require_choice(name: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"{name}={quote(value)}: must be one of {', '.join(choices)}")
