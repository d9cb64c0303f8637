"""ModelConfig: the architecture of a decoder, grouped by part, validated on construction.

Every setting keeps its megatron-core ``TransformerConfig`` name (Megatron-LM's argument name where
megatron-core has none): those names are the vocabulary of the family tables, of Megatron args and of
every output's pgconvert.json. Each setting lives in one place, named in ``SETTING_GROUPS``: a
sub-config (``attention``, ``mlp``, ``moe``, ``positions``, ``norms``, ``carried``, ``mamba``,
``linear_attention``, ``vision``) or the config
itself (layers, hidden size, vocabulary, embeddings, dtype, layer spec, MTP). The sub-configs are
plain data; ``ModelConfig`` validates the whole, since several rules span groups (``kv_channels``
defaults from ``hidden_size``, the per-layer lists have ``num_layers`` entries). Which kind each
layer is comes from the settings once (``ModelConfig.layers``, pgconvert.model.layers).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from pgconvert.errors import ConfigError
from pgconvert.io.limits import quote
from pgconvert.model.layers import (HYBRID_LAYER_KINDS, ROTARY_TYPES, LayerSpec, MTPLayerSpec, layer_specs,
                                    mtp_layer_specs)
from pgconvert.model.vision import check_projector_width, tower_tensors

NORMALIZATIONS = ("RMSNorm", "LayerNorm")
# mrope: megatron-core's multimodal RoPE (Qwen2.5-VL), rotary with ``mrope_section``.
POSITION_EMBEDDING_TYPES = ("rope", "mrope", "learned_absolute", "none")
# gelu_tanh: the tanh approximation (HF gelu_pytorch_tanh; pgconvert's Megatron args: openai_gelu with
# gated_linear_unit recorded: a Megatron-LM run's --openai-gelu computes F.gelu, pgconvert.formats.megatron);
# quick_gelu: x * sigmoid(1.702 x) (GPT-OSS, Megatron-LM --quick-geglu); squared_relu: relu(x)**2
# (Megatron-LM --squared-relu).
ACTIVATIONS = ("silu", "gelu", "gelu_tanh", "quick_gelu", "squared_relu")
SOFTMAX_TYPES = ("vanilla", "learnable")
# Megatron's two layer specs name the fused norms differently; pgconvert keeps the source's choice.
TRANSFORMER_IMPLS = ("local", "transformer_engine")
# How per-rank files spell the MTP layer's inner layer: megatron-core 0.16.1's "transformer_layer",
# Megatron-LM d98e8a64's "mtp_model_layer".
MTP_LAYER_MODULES = ("transformer_layer", "mtp_model_layer")
DTYPES = ("float32", "bfloat16", "float16")
# RoPE scalings Megatron expresses: llama3 (``--use-rope-scaling``, low/high frequency factors 1 and
# 4 and 8192 original positions, as megatron-core hard-codes them) and linear position interpolation
# (``--rotary-seq-len-interpolation-factor``), yarn (``--position-embedding-type yarn``, MLA's
# ``--rope-type yarn``; parameters in the ``yarn_*`` fields). None: plain RoPE.
ROPE_SCALINGS = ("llama3", "linear", "yarn")
MOE_SCORE_FUNCTIONS = ("softmax", "sigmoid")


# The post-sublayer-norm and Gemma-style settings of a plain pre-norm decoder (families fix them).
POSTNORM_OFF: dict[str, object] = {
    "post_self_attn_layernorm": False, "post_mlp_layernorm": False, "pre_layernorms": True,
    "embedding_scale_sqrt_hidden": False, "attn_logit_softcapping": None,
    "final_logit_softcapping": None, "rotary_base_local": None, "qk_layernorm_across_heads": False,
}


@dataclass(frozen=True)
class AttentionConfig:
    """Self-attention (MHA/GQA) or multi-latent attention: heads, projections, softmax, windows."""

    num_attention_heads: int
    # None: one group per head (ModelConfig fills it in).
    num_query_groups: int | None = None
    # None: hidden_size / num_attention_heads (ModelConfig fills it in).
    kv_channels: int | None = None
    add_qkv_bias: bool = False
    qk_layernorm: bool = False
    # q/k norms over the whole projection (num_heads * head_dim, one RMS over all heads: OLMo 2, OLMoE)
    # instead of per head.
    qk_layernorm_across_heads: bool = False
    attention_dropout: float = 0.0
    # "learnable": attention sinks, a per-head logit in every softmax's denominator
    # (core_attention.softmax_offset; GPT-OSS).
    softmax_type: str = "vanilla"
    # megatron-core's TransformerConfig.softmax_scale (Granite's attention_multiplier, Gemma's
    # query_pre_attn_scalar**-0.5: pgconvert.semantics.attention_scale). None: megatron-core's default
    # 1/sqrt(kv_channels), which a scale equal to it is read as.
    softmax_scale: float | None = None
    # tanh soft-capping of the attention scores (Gemma 2).
    attn_logit_softcapping: float | None = None
    # HF's window: a query attends to itself and the sliding_window - 1 keys before it (Megatron's
    # window_size (sliding_window - 1, 0)); window_layers, a 0/1 per layer (1: windowed), None: all.
    sliding_window: int | None = None
    window_layers: tuple[int, ...] | None = None
    # Multi-latent attention (megatron-core's MLATransformerConfig names; q_lora_rank None: one q
    # projection).
    multi_latent_attention: bool = False
    q_lora_rank: int | None = None
    kv_lora_rank: int = 512
    qk_head_dim: int = 128
    qk_pos_emb_head_dim: int = 64
    v_head_dim: int = 128
    # DeepSeek Sparse Attention (megatron-core's DSAttention, ``experimental_attention_variant="dsa"``): a
    # lightning indexer beside multi-latent attention scores every key with ``dsa_indexer_n_heads`` heads of
    # ``dsa_indexer_head_dim`` (its first ``qk_pos_emb_head_dim`` dims rotated, rotate-half) and each query
    # attends to the ``dsa_indexer_topk`` best. None: dense attention.
    dsa_indexer_n_heads: int | None = None
    dsa_indexer_head_dim: int | None = None
    dsa_indexer_topk: int | None = None
    # The indexer rotates its rotary dims as interleaved pairs (GLM-5) rather than rotate-half (DeepSeek-V3.2).
    dsa_indexer_rope_interleaved: bool = False
    # Gated attention (megatron-core's attention_output_gate): each query head has a gate head of its
    # own in linear_qkv (per query group ``[q heads; gate heads; k; v]``), and the attention's output is
    # multiplied by sigmoid(gate) before linear_proj.
    attention_output_gate: bool = False
    # q and k RMS-normalized per head without a weight (megatron-core's L2Norm, Llama 4's use_qk_norm), on the
    # layers with RoPE only (Megatron-Bridge's Llama 4 layer spec, as transformers).
    qk_l2_norm: bool = False

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
        """Rows of the fused QKV weight: every query head (and its gate head, with the output gate) plus
        one key and one value head per group."""
        rows = (self.num_attention_heads + 2 * self.query_groups) * self.head_dim
        return rows + self.num_attention_heads * self.head_dim if self.attention_output_gate else rows

    @property
    def sparse(self) -> bool:
        """Whether a DeepSeek Sparse Attention indexer chooses the keys each query attends to."""
        return self.dsa_indexer_n_heads is not None

    @property
    def q_head_dim(self) -> int:
        """Multi-latent attention: one query (and key) head, its no-position part then its rotary part."""
        return self.qk_head_dim + self.qk_pos_emb_head_dim


@dataclass(frozen=True)
class MLPConfig:
    """The dense MLP (and the shape of every expert's): size, gating, activation."""

    ffn_hidden_size: int
    gated_linear_unit: bool = True
    activation: str = "silu"
    # GPT-OSS's clamped GLU ``act(clamp(gate, max=c)) * (clamp(up, -c, c) + offset)``.
    glu_linear_offset: float = 0.0
    activation_func_clamp_value: float | None = None

    @property
    def fc1_rows(self) -> int:
        return self.ffn_hidden_size * (2 if self.gated_linear_unit else 1)


@dataclass(frozen=True)
class MoEConfig:
    """Mixture of experts: experts, router, shared experts (megatron-core's names, ``moe_`` kept)."""

    num_experts: int | None = None
    moe_ffn_hidden_size: int | None = None
    # Which layers are MoE layers: every k-th (an int) or a 0/1 per layer.
    moe_layer_freq: int | tuple[int, ...] = 1
    moe_router_topk: int = 2
    moe_shared_expert_intermediate_size: int | None = None
    moe_shared_expert_gate: bool = False
    moe_router_enable_expert_bias: bool = False
    # Only key names: grouped GEMM (``experts.linear_fc1.weight{j}``) vs SequentialMLP.
    moe_grouped_gemm: bool = False
    moe_router_score_function: str = "softmax"
    moe_router_pre_softmax: bool = False
    moe_router_topk_scaling_factor: float | None = None
    moe_aux_loss_coeff: float = 0.0
    # Group-limited routing.
    moe_router_num_groups: int | None = None
    moe_router_group_topk: int | None = None
    # The router's probability scales the routed expert's input instead of its output (top-1 only).
    moe_apply_probs_on_input: bool = False


@dataclass(frozen=True)
class PositionConfig:
    """Positions: learned or rotary embeddings, RoPE's base, fraction, scaling and YaRN, NoPE layers."""

    position_embedding_type: str = "rope"
    max_position_embeddings: int | None = None
    rotary_base: float = 10000.0
    rotary_percent: float = 1.0
    rotary_interleaved: bool = False
    rope_scaling: str | None = None
    rope_scaling_factor: float = 1.0
    # YaRN (rope_scaling="yarn", its factor in rope_scaling_factor): megatron-core's YarnRotaryEmbedding
    # parameters, defaults as Megatron-LM's (argument_utils._apply_yarn_config_from_args).
    yarn_original_max_position_embeddings: int = 4096
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    yarn_mscale: float = 1.0
    yarn_mscale_all_dim: float = 0.0
    yarn_correction_range_round_to_int: bool = True
    # The RoPE base of the sliding-window layers where it differs from rotary_base (Gemma 3).
    rotary_base_local: float | None = None
    # 0/1 per layer (1: no RoPE, megatron-core's no_rope_freq), None: RoPE on every layer.
    no_rope_layers: tuple[int, ...] | None = None
    # Multimodal RoPE (Qwen2.5-VL, ``position_embedding_type='mrope'``): the rotary frequencies given to the
    # temporal, height and width position ids (megatron-core's ``mrope_section``); None: one position id. A
    # text-only input gives the three the same ids, which computes plain RoPE.
    mrope_section: tuple[int, ...] | None = None


@dataclass(frozen=True)
class VisionConfig:
    """The vision part of a vision-language model (pgconvert.model.vision): HF's ``vision_config`` as JSON
    text (keys sorted), from which the tower's and projector's tensors follow, and the top-level settings
    of config.json that tie the two parts (image and video token ids; Gemma 3's image tokens per image too) as
    JSON text; None: a text model."""

    vision_config: str | None = None
    vision_token_ids: str | None = None


@dataclass(frozen=True)
class NormConfig:
    """The norms: type, epsilon, zero-centred gamma, and where they sit around the sublayers."""

    normalization: str = "RMSNorm"
    norm_epsilon: float = 1e-5
    layernorm_zero_centered_gamma: bool = False
    # Norms before the sublayers (off in OLMo 2), and of the attention (MLP) output before its residual
    # add (Gemma 2/3, OLMo 2, GLM-4).
    pre_layernorms: bool = True
    post_self_attn_layernorm: bool = False
    post_mlp_layernorm: bool = False


@dataclass(frozen=True)
class MambaConfig:
    """The Mamba-2 mixers of a hybrid model (megatron-core's TransformerConfig names and defaults).

    ``mamba_num_heads`` None: megatron-core's ``hidden_size * 2 // mamba_head_dim`` (MambaMixer's
    ``expand=2``; ModelConfig fills it in for a hybrid model). The convolution is megatron-core's
    fixed ``d_conv=4`` wide, with a bias.
    """

    mamba_state_dim: int = 128
    mamba_head_dim: int = 64
    mamba_num_groups: int = 8
    mamba_num_heads: int | None = None

    @property
    def num_heads(self) -> int:
        assert self.mamba_num_heads is not None
        return self.mamba_num_heads

    @property
    def d_inner(self) -> int:
        """The mixer's inner width: heads × head dim (the rows of x, z and the gated norm)."""
        return self.num_heads * self.mamba_head_dim

    @property
    def group_state_rows(self) -> int:
        """The rows of B (and of C): one state per group."""
        return self.mamba_num_groups * self.mamba_state_dim

    @property
    def conv_rows(self) -> int:
        """The channels of the convolution: x, B and C."""
        return self.d_inner + 2 * self.group_state_rows


@dataclass(frozen=True)
class LinearAttentionConfig:
    """Gated delta net layers beside self-attention (megatron-core's TransformerConfig names and defaults).

    ``experimental_attention_variant`` "gated_delta_net" makes the layers ``linear_attention_freq`` marks
    gated delta net mixers (pgconvert.model.layers): an int N makes every N-th layer self-attention and
    the others linear, a 0/1 list gives each layer (1: linear). None: no linear attention.
    """

    experimental_attention_variant: str | None = None
    linear_attention_freq: int | tuple[int, ...] | None = None
    linear_conv_kernel_dim: int = 4
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32

    @property
    def key_dim(self) -> int:
        """The rows of q (and of k): every key head."""
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def value_dim(self) -> int:
        """The rows of v (and of the output gate z): every value head."""
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_rows(self) -> int:
        """The channels of the convolution: q, k and v."""
        return 2 * self.key_dim + self.value_dim


# The layer symbols of megatron-core's hybrid_override_pattern (ssm/mamba_hybrid_layer_allocation.py).
HYBRID_SYMBOLS = tuple(HYBRID_LAYER_KINDS)


@dataclass(frozen=True)
class CarriedConfig:
    """Settings megatron-core's TransformerConfig has no field for, carried in Megatron args and
    pgconvert.json so that a model converts back to the same HF config (pgconvert.semantics)."""

    # Granite's muP multipliers (1.0: none); HF divides the logits by logits_scaling.
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0
    # Embeddings times sqrt(hidden_size) (Gemma) and tanh soft-capping of the final logits.
    embedding_scale_sqrt_hidden: bool = False
    final_logit_softcapping: float | None = None
    # HF RoPE parameters (JSON text) of a type megatron-core cannot compute (Phi-3's longrope).
    hf_rope_parameters: str | None = None
    # transformers' Nemotron-H clamps each Mamba time step (softplus(dt + dt_bias)) below at this; 0.0 clamps
    # nothing, which is what megatron-core's MambaMixer computes.
    time_step_min: float = 0.0
    # Attention and MLP side by side on the layer's input, x + attn(ln1(x)) + mlp(ln2(x)) (GPT-NeoX's
    # use_parallel_residual); megatron-core's TransformerLayer runs the MLP on the attention's output.
    use_parallel_residual: bool = False
    # With it, one norm for both sublayers, x + attn(ln(x)) + mlp(ln(x)) (Cohere): no pre_mlp_layernorm.
    shared_input_layernorm: bool = False
    # LayerNorms without a bias (Cohere's CohereLayerNorm); megatron-core's LayerNorm always has one.
    layernorm_bias: bool = True
    # The logits multiplied by it (Cohere's logit_scale).
    logit_scale: float = 1.0
    # The q/k norms applied after RoPE (HunYuan's query_layernorm / key_layernorm); megatron-core applies its
    # q_layernorm / k_layernorm before (SelfAttention.get_query_key_value_tensors, then the rotary in Attention.forward).
    qk_layernorm_after_rope: bool = False
    # Llama 4: attention within blocks of this many tokens on the RoPE layers (None: none), and the NoPE layers'
    # queries scaled by 1 + attn_scale * log1p(floor((position + 1) / floor_scale)) where attn_temperature_tuning.
    attention_chunk_size: int | None = None
    attn_temperature_tuning: bool = False
    floor_scale: int = 8192
    attn_scale: float = 0.1


# The sub-configs, by their attribute on ModelConfig.
GROUPS: dict[str, type] = {
    "attention": AttentionConfig, "mlp": MLPConfig, "moe": MoEConfig, "positions": PositionConfig,
    "norms": NormConfig, "carried": CarriedConfig, "mamba": MambaConfig,
    "linear_attention": LinearAttentionConfig, "vision": VisionConfig,
}

# Every setting, in the order to_dict (pgconvert.json, inspect --json) lists them, and where it lives:
# the ModelConfig attribute of its sub-config, or None for a setting of ModelConfig itself.
SETTING_GROUPS: dict[str, str | None] = {
    "num_layers": None, "hidden_size": None, "num_attention_heads": "attention", "ffn_hidden_size": "mlp",
    "num_query_groups": "attention", "kv_channels": "attention", "vocab_size": None,
    "make_vocab_size_divisible_by": None, "gated_linear_unit": "mlp", "activation": "mlp",
    "normalization": "norms", "norm_epsilon": "norms", "add_bias_linear": None, "add_qkv_bias": "attention",
    "qk_layernorm": "attention", "tie_embeddings": None, "position_embedding_type": "positions",
    "max_position_embeddings": "positions", "rotary_base": "positions", "params_dtype": None,
    "transformer_impl": None, "num_experts": "moe", "moe_ffn_hidden_size": "moe", "moe_layer_freq": "moe",
    "moe_router_topk": "moe", "moe_shared_expert_intermediate_size": "moe", "moe_shared_expert_gate": "moe",
    "moe_router_enable_expert_bias": "moe", "moe_grouped_gemm": "moe", "rotary_percent": "positions",
    "rotary_interleaved": "positions", "rope_scaling": "positions", "rope_scaling_factor": "positions",
    "sliding_window": "attention", "window_layers": "attention", "layernorm_zero_centered_gamma": "norms",
    "attention_dropout": "attention", "hidden_dropout": None, "moe_router_score_function": "moe",
    "moe_router_pre_softmax": "moe", "moe_router_topk_scaling_factor": "moe", "moe_aux_loss_coeff": "moe",
    "yarn_original_max_position_embeddings": "positions", "yarn_beta_fast": "positions",
    "yarn_beta_slow": "positions", "yarn_mscale": "positions", "yarn_mscale_all_dim": "positions",
    "yarn_correction_range_round_to_int": "positions", "multi_latent_attention": "attention",
    "q_lora_rank": "attention", "kv_lora_rank": "attention", "qk_head_dim": "attention",
    "qk_pos_emb_head_dim": "attention", "v_head_dim": "attention", "dsa_indexer_n_heads": "attention",
    "dsa_indexer_head_dim": "attention", "dsa_indexer_topk": "attention", "dsa_indexer_rope_interleaved": "attention",
    "moe_router_num_groups": "moe",
    "moe_router_group_topk": "moe", "embedding_multiplier": "carried", "residual_multiplier": "carried",
    "logits_scaling": "carried", "no_rope_layers": "positions", "hf_rope_parameters": "carried",
    "post_self_attn_layernorm": "norms", "post_mlp_layernorm": "norms", "pre_layernorms": "norms",
    "embedding_scale_sqrt_hidden": "carried", "attn_logit_softcapping": "attention",
    "final_logit_softcapping": "carried", "rotary_base_local": "positions",
    "qk_layernorm_across_heads": "attention", "softmax_type": "attention", "glu_linear_offset": "mlp",
    "activation_func_clamp_value": "mlp", "softmax_scale": "attention", "mtp_num_layers": None,
    "mtp_layer_module": None, "hybrid_override_pattern": None, "mamba_state_dim": "mamba",
    "mamba_head_dim": "mamba", "mamba_num_groups": "mamba", "mamba_num_heads": "mamba", "time_step_min": "carried",
    "use_parallel_residual": "carried", "shared_input_layernorm": "carried", "layernorm_bias": "carried",
    "logit_scale": "carried", "qk_layernorm_after_rope": "carried",
    "attention_output_gate": "attention", "experimental_attention_variant": "linear_attention",
    "linear_attention_freq": "linear_attention", "linear_conv_kernel_dim": "linear_attention",
    "linear_key_head_dim": "linear_attention", "linear_value_head_dim": "linear_attention",
    "linear_num_key_heads": "linear_attention", "linear_num_value_heads": "linear_attention",
    "mrope_section": "positions", "vision_config": "vision", "vision_token_ids": "vision",
    "qk_l2_norm": "attention", "moe_apply_probs_on_input": "moe", "attention_chunk_size": "carried",
    "attn_temperature_tuning": "carried", "floor_scale": "carried", "attn_scale": "carried",
}


# Values derived within one sub-config that SettingsByName also gives on ModelConfig itself.
_DERIVED_IN_GROUPS = {"query_groups": "attention", "head_dim": "attention", "qkv_rows": "attention",
                      "q_head_dim": "attention", "fc1_rows": "mlp"}


class SettingsByName:
    """ModelConfig's settings by their flat names: the stable interface of third-party format plugins
    (ModelConfig reaches them through the ``pgconvert.formats`` Loader/Saver contract) and of tests.

    * ``ModelConfig(**settings)`` takes flat setting names (and so does ``dataclasses.replace``);
    * ``config.<setting>`` reads a setting of a sub-config, ``config.query_groups``, ``head_dim``,
      ``qkv_rows``, ``q_head_dim`` and ``fc1_rows`` its derived values;
    * ``config.is_moe_layer(i)`` and ``config.is_window_layer(i)`` say what layer ``i`` is.

    pgconvert's own code reads the groups, so that it shows where each setting lives
    (``SETTING_GROUPS``): ``config.<group>.<setting>``, ``config.setting(name)`` for a name held in a
    variable, ``config.attention.head_dim``, ``config.layers[i].moe``; it builds configs with
    ``ModelConfig.from_settings`` or the grouped constructor and copies them with ``config.replace``
    (tests/test_model_config_groups.py checks it).
    """

    def __init__(self, **settings: Any) -> None:
        values = _fields_from(settings)
        for item in dataclasses.fields(self):  # type: ignore[arg-type]
            if item.name not in values:
                values[item.name] = _default(item)
        for name, value in values.items():
            object.__setattr__(self, name, value)
        self.__post_init__()  # type: ignore[attr-defined]

    def __getattr__(self, name: str) -> Any:
        group = SETTING_GROUPS.get(name) or _DERIVED_IN_GROUPS.get(name)
        if group is None:
            raise AttributeError(f"'{type(self).__name__}' object has no attribute {name!r}")
        return getattr(getattr(self, group), name)

    def is_moe_layer(self, layer: int) -> bool:
        return self.layers[layer].moe  # type: ignore[attr-defined, no-any-return]

    def is_window_layer(self, layer: int) -> bool:
        return self.layers[layer].window  # type: ignore[attr-defined, no-any-return]


@dataclass(frozen=True, init=False)
class ModelConfig(SettingsByName):
    """The architecture: everything needed to know every tensor's global name and shape.

    ``vocab_size`` is the true (tokenizer) vocabulary, ``None`` when unknown; padding is a
    property of a layout (see ``ParallelLayout.padded_vocab_size``).
    """

    num_layers: int
    hidden_size: int
    attention: AttentionConfig
    mlp: MLPConfig
    moe: MoEConfig = field(default_factory=MoEConfig)
    positions: PositionConfig = field(default_factory=PositionConfig)
    norms: NormConfig = field(default_factory=NormConfig)
    carried: CarriedConfig = field(default_factory=CarriedConfig)
    mamba: MambaConfig = field(default_factory=MambaConfig)
    linear_attention: LinearAttentionConfig = field(default_factory=LinearAttentionConfig)
    vision: VisionConfig = field(default_factory=VisionConfig)
    vocab_size: int | None = None
    make_vocab_size_divisible_by: int = 128
    tie_embeddings: bool = False
    params_dtype: str = "bfloat16"
    # Megatron's layer spec, "local" or "transformer_engine": how rank files name the fused norms.
    transformer_impl: str = "local"
    # Biases on every linear layer (megatron-core's add_bias_linear; q/k/v also take add_qkv_bias).
    add_bias_linear: bool = False
    hidden_dropout: float = 0.0
    # Multi-token-prediction layers (megatron-core's mtp_num_layers; HF's num_nextn_predict_layers),
    # kept on the last pipeline stage as ``mtp.layers.{i}.*`` (pgconvert.families.mtp).
    mtp_num_layers: int = 0
    # How per-rank files spell an MTP layer's inner transformer layer (pgconvert.formats.mtp_naming).
    mtp_layer_module: str = "transformer_layer"
    # A hybrid model's layers, one symbol each (megatron-core's hybrid_override_pattern): M a Mamba-2
    # mixer, * self-attention, - a dense MLP, E a mixture of experts. None: every layer attention + MLP.
    hybrid_override_pattern: str | None = None

    def __post_init__(self) -> None:
        _check_computation_settings(self)
        if not isinstance(self.mtp_num_layers, int) or isinstance(self.mtp_num_layers, bool) or self.mtp_num_layers < 0:
            raise ConfigError(f"mtp_num_layers={self.mtp_num_layers!r}: expected an integer >= 0")
        for name, value in (("num_layers", self.num_layers), ("hidden_size", self.hidden_size),
                            ("num_attention_heads", self.attention.num_attention_heads),
                            ("ffn_hidden_size", self.mlp.ffn_hidden_size),
                            ("make_vocab_size_divisible_by", self.make_vocab_size_divisible_by)):
            _require_positive(name, value)
        _require_finite("norm_epsilon", self.norms.norm_epsilon)
        if self.positions.position_embedding_type in ROTARY_TYPES:
            _require_positive_number("rotary_base", self.positions.rotary_base)
        _require_finite("rotary_base", self.positions.rotary_base)
        _check_heads(self)
        if self.vocab_size is not None:
            _require_positive("vocab_size", self.vocab_size)
        _require_choice("normalization", self.norms.normalization, NORMALIZATIONS)
        _require_choice("position_embedding_type", self.positions.position_embedding_type, POSITION_EMBEDDING_TYPES)
        _require_choice("activation", self.mlp.activation, ACTIVATIONS)
        _require_choice("transformer_impl", self.transformer_impl, TRANSFORMER_IMPLS)
        _require_choice("mtp_layer_module", self.mtp_layer_module, MTP_LAYER_MODULES)
        _require_choice("params_dtype", self.params_dtype, DTYPES)
        positions = self.positions
        if positions.position_embedding_type == "learned_absolute" and positions.max_position_embeddings is None:
            raise ConfigError("max_position_embeddings: required when position_embedding_type='learned_absolute'")
        # Checked with RoPE too: it is written into every output's config (a fuzz find).
        if positions.max_position_embeddings is not None:
            _require_positive("max_position_embeddings", positions.max_position_embeddings)
        _check_moe(self)
        _check_hybrid(self)
        _check_linear_attention(self)
        _check_vision(self)

    def _set(self, group: str, **changes: Any) -> None:
        """Replace sub-config ``group`` with a copy holding ``changes`` (a default filled in, a list
        made a tuple) while validating."""
        object.__setattr__(self, group, dataclasses.replace(getattr(self, group), **changes))

    @cached_property
    def layers(self) -> tuple[LayerSpec, ...]:
        """Every decoder layer's spec: which kinds it is made of, and its per-layer settings."""
        return layer_specs(self)

    @cached_property
    def mtp_layers(self) -> tuple[MTPLayerSpec, ...]:
        """Every MTP layer's spec (``mtp_num_layers`` of them)."""
        return mtp_layer_specs(self)

    @property
    def has_norm_bias(self) -> bool:
        """The norms have a bias: LayerNorm, unless carried without one (Cohere)."""
        return self.norms.normalization == "LayerNorm" and self.carried.layernorm_bias

    @property
    def has_qkv_bias(self) -> bool:
        return self.add_bias_linear or self.attention.add_qkv_bias

    @property
    def expert_ffn_size(self) -> int:
        """FFN size of one routed expert (``moe_ffn_hidden_size``, defaulting to ``ffn_hidden_size``)."""
        return self.moe.moe_ffn_hidden_size or self.mlp.ffn_hidden_size

    @classmethod
    def setting_names(cls) -> tuple[str, ...]:
        """The name of every setting (megatron-core's ``TransformerConfig`` name where it has one), in the
        order ``to_dict`` lists them."""
        return tuple(SETTING_GROUPS)

    @classmethod
    def from_settings(cls, settings: Mapping[str, Any]) -> ModelConfig:
        """A config from settings by name (``ModelConfig.setting_names()``); a sub-config may also be
        given whole, under its attribute name."""
        return cls(**_fields_from(settings))

    def setting(self, name: str) -> Any:
        """The value of setting ``name``."""
        group = SETTING_GROUPS[name]
        return getattr(self if group is None else getattr(self, group), name)

    def replace(self, **changes: Any) -> ModelConfig:
        """A copy with ``changes``: settings by name, or sub-configs whole."""
        return dataclasses.replace(self, **_fields_from(changes, self))

    def to_dict(self) -> dict[str, Any]:
        """Every setting by name, in ``SETTING_GROUPS`` order (what pgconvert.json records)."""
        return {name: self.setting(name) for name in SETTING_GROUPS}


def _fields_from(settings: Mapping[str, Any], base: ModelConfig | None = None) -> dict[str, Any]:
    """ModelConfig's fields from ``settings``: its own fields as given, and each setting of a
    sub-config applied to that sub-config (the one given, else ``base``'s, else a new one)."""
    values: dict[str, Any] = {}
    changes: dict[str, dict[str, Any]] = {}
    for name, value in settings.items():
        group = SETTING_GROUPS.get(name)
        if group is not None:
            changes.setdefault(group, {})[name] = value
        elif name in SETTING_GROUPS or name in GROUPS:
            values[name] = value
        else:
            raise TypeError(f"ModelConfig() got an unexpected keyword argument {name!r}")
    for group, group_changes in changes.items():
        current = values.get(group, getattr(base, group) if base is not None else None)
        values[group] = (GROUPS[group](**group_changes) if current is None
                         else dataclasses.replace(current, **group_changes))
    return values


def _default(item: dataclasses.Field[Any]) -> Any:
    """A field's default; a required sub-config is built from no settings, which names the missing one."""
    if item.default is not dataclasses.MISSING:
        return item.default
    if item.default_factory is not dataclasses.MISSING:
        return item.default_factory()
    if item.name in GROUPS:
        return GROUPS[item.name]()
    raise TypeError(f"ModelConfig() missing required setting {item.name!r}")


def _check_heads(config: ModelConfig) -> None:
    """Query groups and head size: defaulted (one group per head, hidden_size / heads), positive, the
    groups dividing the heads; a softmax scale equal to megatron-core's default is read as the default."""
    attention = config.attention
    if attention.num_query_groups is None:
        config._set("attention", num_query_groups=attention.num_attention_heads)
    if attention.kv_channels is None:
        if config.hidden_size % attention.num_attention_heads:
            raise ConfigError(
                f"kv_channels: not given and hidden_size={config.hidden_size} is not divisible "
                f"by num_attention_heads={attention.num_attention_heads}"
            )
        config._set("attention", kv_channels=config.hidden_size // attention.num_attention_heads)
    attention = config.attention
    _require_positive("num_query_groups", attention.num_query_groups)
    _require_positive("kv_channels", attention.kv_channels)
    if attention.softmax_scale is not None and attention.softmax_scale == 1 / math.sqrt(attention.head_dim):
        config._set("attention", softmax_scale=None)
    if attention.num_attention_heads % attention.query_groups:
        raise _violates("num_query_groups", attention.query_groups,
                        f"num_attention_heads={attention.num_attention_heads} must be a multiple of it")


def _check_moe(config: ModelConfig) -> None:
    """The MoE settings' ranges (when there are experts)."""
    moe = config.moe
    if moe.num_experts is None:
        return
    _require_positive("num_experts", moe.num_experts)
    if moe.moe_ffn_hidden_size is not None:
        _require_positive("moe_ffn_hidden_size", moe.moe_ffn_hidden_size)
    if moe.moe_shared_expert_intermediate_size is not None:
        _require_positive("moe_shared_expert_intermediate_size", moe.moe_shared_expert_intermediate_size)
    _require_positive("moe_router_topk", moe.moe_router_topk)
    if config.add_bias_linear and moe.moe_shared_expert_intermediate_size is not None:
        # Expert and router biases are tensor kinds; shared-expert biases are not.
        raise ConfigError("add_bias_linear=True with shared experts: shared-expert biases are not supported")
    if isinstance(moe.moe_layer_freq, list):
        config._set("moe", moe_layer_freq=tuple(moe.moe_layer_freq))
    freq = config.moe.moe_layer_freq
    if isinstance(freq, tuple):
        if len(freq) != config.num_layers or set(freq) - {0, 1}:
            raise ConfigError(
                f"moe_layer_freq={list(freq)}: must list 0 or 1 for each of the {config.num_layers} layers"
            )
    else:
        _require_positive("moe_layer_freq", freq)
    if config.moe.moe_apply_probs_on_input and config.moe.moe_router_topk != 1:
        # megatron-core's experts assert it (transformer/moe/experts.py:229).
        raise _violates("moe_apply_probs_on_input", True, f"needs moe_router_topk=1, not {config.moe.moe_router_topk}")


def _check_hybrid(config: ModelConfig) -> None:
    """A hybrid pattern: one known symbol per layer, experts for its E layers; the Mamba sizes
    positive, the heads defaulted as megatron-core does and divided into the groups."""
    pattern = config.hybrid_override_pattern
    if pattern is None:
        return
    if not isinstance(pattern, str) or set(pattern) - set(HYBRID_SYMBOLS) or len(pattern) != config.num_layers:
        raise _violates("hybrid_override_pattern", pattern,
                        f"must be one of {' '.join(HYBRID_SYMBOLS)} for each of the {config.num_layers} layers")
    if "E" in pattern and config.moe.num_experts is None:
        raise _violates("hybrid_override_pattern", pattern, "E (MoE) layers need num_experts")
    if config.mtp_num_layers:
        raise _violates("mtp_num_layers", config.mtp_num_layers, "a hybrid model's MTP layers are not supported")
    mamba = config.mamba
    for name in ("mamba_state_dim", "mamba_head_dim", "mamba_num_groups"):
        _require_positive(name, getattr(mamba, name))
    if mamba.mamba_num_heads is None:
        config._set("mamba", mamba_num_heads=config.hidden_size * 2 // mamba.mamba_head_dim)
    _require_positive("mamba_num_heads", config.mamba.mamba_num_heads)
    if config.mamba.num_heads % mamba.mamba_num_groups:
        raise _violates("mamba_num_groups", mamba.mamba_num_groups,
                        f"mamba_num_heads={config.mamba.num_heads} must be a multiple of it")


# megatron-core 0.16.1's experimental_attention_variant values pgconvert has a layer kind for.
LINEAR_ATTENTION_VARIANTS = ("gated_delta_net",)


def _check_linear_attention(config: ModelConfig) -> None:
    """Gated delta net layers: a known variant, one 0/1 per layer or a positive interval, positive
    sizes, the value heads a multiple of the key heads (megatron-core's TransformerConfig asserts it),
    the Transformer Engine spec (the only one megatron-core builds them with)."""
    linear = config.linear_attention
    if linear.experimental_attention_variant is None:
        return
    _require_choice("experimental_attention_variant", linear.experimental_attention_variant, LINEAR_ATTENTION_VARIANTS)
    if config.hybrid_override_pattern is not None:
        raise _violates("experimental_attention_variant", linear.experimental_attention_variant,
                        "a hybrid_override_pattern model has no gated delta net layers")
    freq = linear.linear_attention_freq
    if isinstance(freq, list):
        freq = tuple(freq)
        config._set("linear_attention", linear_attention_freq=freq)
    if isinstance(freq, tuple):
        if len(freq) != config.num_layers or set(freq) - {0, 1}:
            raise _violates("linear_attention_freq", list(freq),
                            f"must list 0 or 1 for each of the {config.num_layers} layers")
    else:
        _require_positive("linear_attention_freq", freq)
    for name in ("linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim",
                 "linear_num_key_heads", "linear_num_value_heads"):
        _require_positive(name, getattr(linear, name))
    if linear.linear_num_value_heads % linear.linear_num_key_heads:
        raise _violates("linear_num_key_heads", linear.linear_num_key_heads,
                        f"linear_num_value_heads={linear.linear_num_value_heads} must be a multiple of it")
    if config.transformer_impl != "transformer_engine":
        raise _violates("transformer_impl", config.transformer_impl,
                        "gated delta net layers need 'transformer_engine' (megatron-core builds them with "
                        "the Transformer Engine spec only)")


def _check_vision(config: ModelConfig) -> None:
    """The vision part: a tower pgconvert describes, its sizes valid, token ids as a JSON object; multimodal
    RoPE sections as positive integers."""
    vision = config.vision
    if vision.vision_config is not None:
        tower_tensors(vision.vision_config, config.hidden_size)
        check_projector_width(vision.vision_config, config.hidden_size)
    if vision.vision_token_ids is not None:
        if vision.vision_config is None:
            raise _violates("vision_token_ids", vision.vision_token_ids, "given without a vision_config")
        parse_json_object("vision_token_ids", vision.vision_token_ids)
    section = config.positions.mrope_section
    if isinstance(section, list):
        section = tuple(section)
        config._set("positions", mrope_section=section)
    if section is not None and (not section or not all(
            isinstance(value, int) and not isinstance(value, bool) and value > 0 for value in section)):
        raise _violates("mrope_section", section, "must list positive integers")
    if (section is not None) != (config.positions.position_embedding_type == "mrope"):
        raise _violates("mrope_section", section, "given exactly with position_embedding_type='mrope'")


def parse_json_object(name: str, text: str) -> dict[str, Any]:
    """A setting held as JSON text of an object."""
    try:
        value = json.loads(text)
    except (TypeError, ValueError):
        value = None
    if not isinstance(value, dict):
        raise _violates(name, text, "must be JSON text of an object")
    return value


def _check_computation_settings(config: ModelConfig) -> None:
    """The settings of pgconvert.semantics (they change the computation, not the shapes): types and ranges."""
    positions, attention = config.positions, config.attention
    for name, value in (("rotary_percent", positions.rotary_percent),
                        ("rope_scaling_factor", positions.rope_scaling_factor),
                        ("attention_dropout", attention.attention_dropout), ("hidden_dropout", config.hidden_dropout),
                        ("moe_aux_loss_coeff", config.moe.moe_aux_loss_coeff)):
        _require_finite(name, value)
    if not 0 < positions.rotary_percent <= 1:
        raise _violates("rotary_percent", positions.rotary_percent, "must be in (0, 1]")
    for name, value in (("attention_dropout", attention.attention_dropout), ("hidden_dropout", config.hidden_dropout)):
        if not 0 <= value < 1:
            raise _violates(name, value, "must be in [0, 1)")
    if positions.rope_scaling is not None:
        _require_choice("rope_scaling", positions.rope_scaling, ROPE_SCALINGS)
        if positions.rope_scaling_factor <= 0:
            raise _violates("rope_scaling_factor", positions.rope_scaling_factor, "must be > 0")
    _require_choice("moe_router_score_function", config.moe.moe_router_score_function, MOE_SCORE_FUNCTIONS)
    _check_yarn(positions)
    _check_mla(attention)
    _check_router_groups(config.moe)
    if config.moe.moe_router_topk_scaling_factor is not None:
        _require_finite("moe_router_topk_scaling_factor", config.moe.moe_router_topk_scaling_factor)
    _require_choice("softmax_type", attention.softmax_type, SOFTMAX_TYPES)
    _require_finite("glu_linear_offset", config.mlp.glu_linear_offset)
    if config.mlp.activation_func_clamp_value is not None:
        _require_finite("activation_func_clamp_value", config.mlp.activation_func_clamp_value)
    if attention.sliding_window is not None:
        _require_positive("sliding_window", attention.sliding_window)
    for name, value in (("softmax_scale", attention.softmax_scale),
                        ("attn_logit_softcapping", attention.attn_logit_softcapping),
                        ("final_logit_softcapping", config.carried.final_logit_softcapping),
                        ("rotary_base_local", positions.rotary_base_local)):
        if value is not None:
            _require_positive_number(name, value)
    _check_windows(config)
    _check_carried(config.carried)
    if config.carried.shared_input_layernorm and config.moe.num_experts is not None:
        raise _violates("shared_input_layernorm", True, "an MoE layer keeps its pre_mlp_layernorm")
    if config.carried.qk_layernorm_after_rope and not config.attention.qk_layernorm:
        raise _violates("qk_layernorm_after_rope", True, "needs qk_layernorm (q/k norms to apply)")
    _check_no_rope_layers(config)
    if attention.qk_l2_norm and attention.qk_layernorm:
        # megatron-core's layer specs build L2Norm in place of the q/k norms (gpt_layer_specs.py:148).
        raise _violates("qk_l2_norm", True, "excludes qk_layernorm (the L2 norm takes the q/k norms' place)")


def _check_windows(config: ModelConfig) -> None:
    """The window layers: given with a window, a 0/1 per layer."""
    if isinstance(config.attention.window_layers, list):
        config._set("attention", window_layers=tuple(config.attention.window_layers))
    window_layers = config.attention.window_layers
    if window_layers is not None:
        if config.attention.sliding_window is None:
            raise ConfigError("window_layers: given without a sliding_window")
        if len(window_layers) != config.num_layers or set(window_layers) - {0, 1}:
            raise ConfigError(f"window_layers={quote(list(window_layers))}: must list 0 or 1 for "
                              f"each of the {config.num_layers} layers")


def _check_yarn(positions: PositionConfig) -> None:
    """The YaRN parameters: finite numbers, a positive original context, a boolean rounding."""
    _require_positive("yarn_original_max_position_embeddings", positions.yarn_original_max_position_embeddings)
    for name in ("yarn_beta_fast", "yarn_beta_slow", "yarn_mscale", "yarn_mscale_all_dim"):
        _require_finite(name, getattr(positions, name))
    if not isinstance(positions.yarn_correction_range_round_to_int, bool):
        raise ConfigError(f"yarn_correction_range_round_to_int={quote(positions.yarn_correction_range_round_to_int)}: "
                          "must be true or false")


def _check_mla(attention: AttentionConfig) -> None:
    """Multi-latent attention's dimensions: positive."""
    if attention.multi_latent_attention:
        for name in ("kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim"):
            _require_positive(name, getattr(attention, name))
        if attention.q_lora_rank is not None:
            _require_positive("q_lora_rank", attention.q_lora_rank)
    _check_sparse_attention(attention)


# The DeepSeek Sparse Attention settings: all given (an indexer) or none.
DSA_SETTINGS = ("dsa_indexer_n_heads", "dsa_indexer_head_dim", "dsa_indexer_topk")


def _check_sparse_attention(attention: AttentionConfig) -> None:
    """DeepSeek Sparse Attention: all three sizes or none, positive; an indexer beside multi-latent attention
    with a q down projection (its queries are the q latent), its head at least the rotary dims."""
    given = {name: getattr(attention, name) for name in DSA_SETTINGS}
    if not isinstance(attention.dsa_indexer_rope_interleaved, bool):
        raise _violates("dsa_indexer_rope_interleaved", attention.dsa_indexer_rope_interleaved, "must be true or false")
    if all(value is None for value in given.values()):
        if attention.dsa_indexer_rope_interleaved:
            raise _violates("dsa_indexer_rope_interleaved", True, "needs a sparse attention indexer")
        return
    for name, value in given.items():
        _require_positive(name, value)
    if not attention.multi_latent_attention or attention.q_lora_rank is None:
        raise _violates("dsa_indexer_n_heads", attention.dsa_indexer_n_heads,
                        "a sparse attention indexer needs multi-latent attention with a q_lora_rank (its queries "
                        "are the q latent)")
    assert attention.dsa_indexer_head_dim is not None
    if attention.dsa_indexer_head_dim < attention.qk_pos_emb_head_dim:
        # Named as the rotated dims, which a config.json names either way (a huge one is what is wrong there).
        raise _violates("qk_pos_emb_head_dim", attention.qk_pos_emb_head_dim,
                        f"must be at most dsa_indexer_head_dim={attention.dsa_indexer_head_dim} (an indexer head "
                        "holds the rotated dims)")


def _check_router_groups(moe: MoEConfig) -> None:
    """Group-limited routing: both settings or neither, positive, the groups dividing the experts."""
    groups, topk = moe.moe_router_num_groups, moe.moe_router_group_topk
    if (groups is None) != (topk is None):
        raise ConfigError(f"moe_router_num_groups={quote(groups)}, moe_router_group_topk={quote(topk)}: "
                          "give both or neither")
    if groups is not None:
        _require_positive("moe_router_num_groups", groups)
        _require_positive("moe_router_group_topk", topk)
        assert topk is not None
        experts = moe.num_experts or 0
        if experts % groups or topk > groups:
            raise ConfigError(f"moe_router_num_groups={groups}, moe_router_group_topk={topk}: the groups must "
                              f"divide num_experts={experts} and at most all of them be chosen")


def _check_carried(carried: CarriedConfig) -> None:
    """Granite's multipliers and Cohere's logit scale: positive finite numbers; the parallel layer's switches and
    the norm bias: flags, one shared norm only in a parallel layer."""
    for name in ("embedding_multiplier", "residual_multiplier", "logits_scaling", "logit_scale"):
        _require_positive_number(name, getattr(carried, name))
    for name in ("use_parallel_residual", "shared_input_layernorm", "layernorm_bias", "qk_layernorm_after_rope"):
        if not isinstance(getattr(carried, name), bool):
            raise _violates(name, getattr(carried, name), "must be true or false")
    if carried.attention_chunk_size is not None:
        _require_positive("attention_chunk_size", carried.attention_chunk_size)
    _require_positive("floor_scale", carried.floor_scale)
    _require_finite("attn_scale", carried.attn_scale)
    if not isinstance(carried.attn_temperature_tuning, bool):
        raise _violates("attn_temperature_tuning", carried.attn_temperature_tuning, "must be true or false")
    if carried.shared_input_layernorm and not carried.use_parallel_residual:
        raise _violates("shared_input_layernorm", True, "needs use_parallel_residual (the MLP reads the attention's "
                                                        "input norm only in a parallel layer)")


def _check_no_rope_layers(config: ModelConfig) -> None:
    """The NoPE layers: a 0/1 per layer."""
    if isinstance(config.positions.no_rope_layers, list):
        config._set("positions", no_rope_layers=tuple(config.positions.no_rope_layers))
    no_rope = config.positions.no_rope_layers
    if no_rope is not None and (len(no_rope) != config.num_layers or set(no_rope) - {0, 1}):
        raise ConfigError(f"no_rope_layers={quote(list(no_rope))}: must list 0 or 1 for "
                          f"each of the {config.num_layers} layers")


def _violates(name: str, value: object, constraint: str) -> ConfigError:
    """The error for one setting's value that breaks ``constraint``."""
    return ConfigError(f"{name}={quote(value)}: {constraint}", setting=name, constraint=constraint)


def _require_positive(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise _violates(name, value, "must be a positive integer")


def _require_finite(name: str, value: object) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise _violates(name, value, "must be a finite number")


def _require_positive_number(name: str, value: object) -> None:
    _require_finite(name, value)
    assert isinstance(value, (int, float))
    if value <= 0:
        raise _violates(name, value, "must be > 0")


def _require_choice(name: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise _violates(name, value, f"must be one of {', '.join(choices)}")
