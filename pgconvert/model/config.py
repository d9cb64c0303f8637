"""ModelConfig: the architecture of a GPT-style decoder, validated on construction."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from pgconvert.errors import ConfigError
from pgconvert.io.limits import quote

NORMALIZATIONS = ("RMSNorm", "LayerNorm")
POSITION_EMBEDDING_TYPES = ("rope", "learned_absolute", "none")
# gelu_tanh: the tanh approximation (HF gelu_pytorch_tanh, Megatron-LM --openai-gelu);
# quick_gelu: x * sigmoid(1.702 x) (GPT-OSS, Megatron-LM --quick-geglu).
ACTIVATIONS = ("silu", "gelu", "gelu_tanh", "quick_gelu")
SOFTMAX_TYPES = ("vanilla", "learnable")
# Megatron's two layer specs name the fused norms differently; pgconvert keeps the source's choice.
TRANSFORMER_IMPLS = ("local", "transformer_engine")
# mlafix: the spellings of the MTP layer's inner layer in per-rank files (megatron-core 0.16.1; Megatron-LM d98e8a64).
MTP_LAYER_MODULES = ("transformer_layer", "mtp_model_layer")
DTYPES = ("float32", "bfloat16", "float16")
# RoPE scalings Megatron expresses: llama3 (``--use-rope-scaling``, low/high frequency factors 1 and
# 4 and 8192 original positions, as megatron-core hard-codes them) and linear position interpolation
# (``--rotary-seq-len-interpolation-factor``), yarn (``--position-embedding-type yarn``, MLA's
# ``--rope-type yarn``; parameters in the ``yarn_*`` fields). None: plain RoPE.
ROPE_SCALINGS = ("llama3", "linear", "yarn")
MOE_SCORE_FUNCTIONS = ("softmax", "sigmoid")


# f17b: the values of the post-sublayer-norm fields for a plain pre-norm decoder (families fix them).
POSTNORM_OFF: dict[str, object] = {
    "post_self_attn_layernorm": False, "post_mlp_layernorm": False, "pre_layernorms": True,
    "embedding_scale_sqrt_hidden": False, "attn_logit_softcapping": None,
    "final_logit_softcapping": None, "rotary_base_local": None, "qk_layernorm_across_heads": False,
}


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
    # Settings that change the computation but no tensor shape (see pgconvert.semantics, one row
    # each); the defaults are the model pgconvert described before it carried them.
    rotary_percent: float = 1.0
    rotary_interleaved: bool = False
    rope_scaling: str | None = None
    rope_scaling_factor: float = 1.0
    # HF's window: a query attends to itself and the sliding_window - 1 keys before it (Megatron's
    # window_size (sliding_window - 1, 0)); window_layers, a 0/1 per layer (1: windowed), None: all.
    sliding_window: int | None = None
    window_layers: tuple[int, ...] | None = None
    layernorm_zero_centered_gamma: bool = False
    attention_dropout: float = 0.0
    hidden_dropout: float = 0.0
    moe_router_score_function: str = "softmax"
    moe_router_pre_softmax: bool = False
    moe_router_topk_scaling_factor: float | None = None
    moe_aux_loss_coeff: float = 0.0
    # ds16: YaRN RoPE (rope_scaling="yarn", its factor in rope_scaling_factor): megatron-core's
    # YarnRotaryEmbedding parameters, defaults as Megatron-LM's (argument_utils._apply_yarn_config_from_args).
    yarn_original_max_position_embeddings: int = 4096
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    yarn_mscale: float = 1.0
    yarn_mscale_all_dim: float = 0.0
    yarn_correction_range_round_to_int: bool = True
    # ds16: multi-latent attention (megatron-core's MLATransformerConfig names; q_lora_rank None: one
    # q projection) and group-limited routing (moe_router_num_groups / moe_router_group_topk).
    multi_latent_attention: bool = False
    q_lora_rank: int | None = None
    kv_lora_rank: int = 512
    qk_head_dim: int = 128
    qk_pos_emb_head_dim: int = 64
    v_head_dim: int = 128
    moe_router_num_groups: int | None = None
    moe_router_group_topk: int | None = None
    # f17a: Granite's muP multipliers (1.0: none; its attention_multiplier is softmax_scale below),
    # HF divides the logits by logits_scaling; no_rope_layers, 0/1 per layer (1: no RoPE, megatron-core's
    # no_rope_freq), None: RoPE on every layer.
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0
    no_rope_layers: tuple[int, ...] | None = None
    # f17a: HF RoPE parameters (JSON text) of a type megatron-core cannot compute (Phi-3's longrope),
    # carried as they are so a Megatron checkpoint converts back to the same config.json.
    hf_rope_parameters: str | None = None
    # f17b: norms after the sublayers and the Gemma 2/3, OLMo 2, GLM-4 settings (pgconvert.families.postnorm).
    # A norm of the attention (MLP) output before its residual add; OLMo 2 has these and no pre-norms.
    post_self_attn_layernorm: bool = False
    post_mlp_layernorm: bool = False
    pre_layernorms: bool = True
    # Embeddings times sqrt(hidden_size) (Gemma; its query_pre_attn_scalar is softmax_scale below);
    # tanh soft-capping of attention scores and of the final logits.
    embedding_scale_sqrt_hidden: bool = False
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    # The RoPE base of the sliding-window layers where it differs from rotary_base (Gemma 3).
    rotary_base_local: float | None = None
    # q/k norms over the whole projection (num_heads * head_dim, one RMS over all heads: OLMo 2, OLMoE)
    # instead of per head.
    qk_layernorm_across_heads: bool = False
    # f17c: GPT-OSS (megatron-core TransformerConfig names): attention sinks (softmax_type "learnable":
    # a per-head logit in every softmax's denominator, core_attention.softmax_offset), the clamped
    # GLU ``act(clamp(gate, max=c)) * (clamp(up, -c, c) + offset)`` with quick_gelu ``x·σ(1.702x)``.
    softmax_type: str = "vanilla"
    glu_linear_offset: float = 0.0
    activation_func_clamp_value: float | None = None
    # tidy: the attention softmax scale (megatron-core's TransformerConfig.softmax_scale; Granite's
    # attention_multiplier, Gemma's query_pre_attn_scalar**-0.5: pgconvert.semantics.attention_scale). None:
    # megatron-core's default 1/sqrt(kv_channels), which a scale equal to it is read as.
    softmax_scale: float | None = None
    # mtp: multi-token-prediction layers (megatron-core's mtp_num_layers; HF's num_nextn_predict_layers),
    # kept on the last pipeline stage as ``mtp.layers.{i}.*`` (pgconvert.families.mtp).
    mtp_num_layers: int = 0
    # mlafix: the per-rank key of an MTP layer's inner transformer layer: megatron-core 0.16.1's
    # "transformer_layer", or "mtp_model_layer" as Megatron-LM d98e8a64's state_dict names it (pgconvert.formats.mtp_naming).
    mtp_layer_module: str = "transformer_layer"

    def __post_init__(self) -> None:
        self._check_semantics()
        if not isinstance(self.mtp_num_layers, int) or isinstance(self.mtp_num_layers, bool) or self.mtp_num_layers < 0:
            raise ConfigError(f"mtp_num_layers={self.mtp_num_layers!r}: expected an integer >= 0")
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
        if self.softmax_scale is not None and self.softmax_scale == 1 / math.sqrt(self.kv_channels):
            object.__setattr__(self, "softmax_scale", None)  # tidy: megatron-core's default, one description
        if self.num_attention_heads % self.query_groups:
            raise ConfigError(
                f"num_query_groups={self.query_groups}: num_attention_heads="
                f"{self.num_attention_heads} must be a multiple of it"
            )
        if self.vocab_size is not None:
            _require_positive("vocab_size", self.vocab_size)
        _require_choice("normalization", self.normalization, NORMALIZATIONS)
        _require_choice("position_embedding_type", self.position_embedding_type, POSITION_EMBEDDING_TYPES)
        _require_choice("activation", self.activation, ACTIVATIONS)
        _require_choice("transformer_impl", self.transformer_impl, TRANSFORMER_IMPLS)
        _require_choice("mtp_layer_module", self.mtp_layer_module, MTP_LAYER_MODULES)  # mlafix
        _require_choice("params_dtype", self.params_dtype, DTYPES)
        if self.position_embedding_type == "learned_absolute":
            if self.max_position_embeddings is None:
                raise ConfigError(
                    "max_position_embeddings: required when position_embedding_type='learned_absolute'"
                )
        # Checked with RoPE too: it is written into every output's config (a fuzz find).
        if self.max_position_embeddings is not None:
            _require_positive("max_position_embeddings", self.max_position_embeddings)
        self._check_moe()

    def _check_moe(self) -> None:
        """The MoE settings' ranges (when there are experts)."""
        if self.num_experts is None:
            return
        _require_positive("num_experts", self.num_experts)
        if self.moe_ffn_hidden_size is not None:
            _require_positive("moe_ffn_hidden_size", self.moe_ffn_hidden_size)
        if self.moe_shared_expert_intermediate_size is not None:
            _require_positive("moe_shared_expert_intermediate_size", self.moe_shared_expert_intermediate_size)
        _require_positive("moe_router_topk", self.moe_router_topk)
        if self.add_bias_linear and self.moe_shared_expert_intermediate_size is not None:
            # f17c: expert and router biases are tensor kinds; shared-expert biases are not.
            raise ConfigError("add_bias_linear=True with shared experts: shared-expert biases are not supported")
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

    def _check_semantics(self) -> None:
        """The settings of pgconvert.semantics: types and ranges."""
        for name in ("rotary_percent", "rope_scaling_factor", "attention_dropout", "hidden_dropout",
                     "moe_aux_loss_coeff"):
            _require_finite(name, getattr(self, name))
        if not 0 < self.rotary_percent <= 1:
            raise ConfigError(f"rotary_percent={quote(self.rotary_percent)}: must be in (0, 1]")
        for name in ("attention_dropout", "hidden_dropout"):
            if not 0 <= getattr(self, name) < 1:
                raise ConfigError(f"{name}={quote(getattr(self, name))}: must be in [0, 1)")
        if self.rope_scaling is not None:
            _require_choice("rope_scaling", self.rope_scaling, ROPE_SCALINGS)
            if self.rope_scaling_factor <= 0:
                raise ConfigError(f"rope_scaling_factor={quote(self.rope_scaling_factor)}: must be > 0")
        _require_choice("moe_router_score_function", self.moe_router_score_function, MOE_SCORE_FUNCTIONS)
        self._check_yarn()
        self._check_mla()
        if self.moe_router_topk_scaling_factor is not None:
            _require_finite("moe_router_topk_scaling_factor", self.moe_router_topk_scaling_factor)
        _require_choice("softmax_type", self.softmax_type, SOFTMAX_TYPES)
        _require_finite("glu_linear_offset", self.glu_linear_offset)
        if self.activation_func_clamp_value is not None:
            _require_finite("activation_func_clamp_value", self.activation_func_clamp_value)
        if self.sliding_window is not None:
            _require_positive("sliding_window", self.sliding_window)
        for name in ("softmax_scale", "attn_logit_softcapping", "final_logit_softcapping",
                     "rotary_base_local"):
            value = getattr(self, name)
            if value is not None:
                _require_finite(name, value)
                if value <= 0:
                    raise ConfigError(f"{name}={quote(value)}: must be > 0")
        if isinstance(self.window_layers, list):
            object.__setattr__(self, "window_layers", tuple(self.window_layers))
        if self.window_layers is not None:
            if self.sliding_window is None:
                raise ConfigError("window_layers: given without a sliding_window")
            if len(self.window_layers) != self.num_layers or set(self.window_layers) - {0, 1}:
                raise ConfigError(f"window_layers={quote(list(self.window_layers))}: must list 0 or 1 for "
                                  f"each of the {self.num_layers} layers")
        _check_f17a_fields(self)

    def _check_yarn(self) -> None:
        """The YaRN parameters: finite numbers, a positive original context, a boolean rounding."""
        _require_positive("yarn_original_max_position_embeddings", self.yarn_original_max_position_embeddings)
        for name in ("yarn_beta_fast", "yarn_beta_slow", "yarn_mscale", "yarn_mscale_all_dim"):
            _require_finite(name, getattr(self, name))
        if not isinstance(self.yarn_correction_range_round_to_int, bool):
            raise ConfigError(f"yarn_correction_range_round_to_int={quote(self.yarn_correction_range_round_to_int)}: "
                              "must be true or false")

    def _check_mla(self) -> None:
        """Multi-latent attention's dimensions and the router groups: positive, groups dividing experts."""
        if self.multi_latent_attention:
            for name in ("kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim"):
                _require_positive(name, getattr(self, name))
            if self.q_lora_rank is not None:
                _require_positive("q_lora_rank", self.q_lora_rank)
        if (self.moe_router_num_groups is None) != (self.moe_router_group_topk is None):
            raise ConfigError(f"moe_router_num_groups={quote(self.moe_router_num_groups)}, moe_router_group_topk="
                              f"{quote(self.moe_router_group_topk)}: give both or neither")
        if self.moe_router_num_groups is not None:
            _require_positive("moe_router_num_groups", self.moe_router_num_groups)
            _require_positive("moe_router_group_topk", self.moe_router_group_topk)
            experts = self.num_experts or 0
            if experts % self.moe_router_num_groups or self.moe_router_group_topk > self.moe_router_num_groups:
                raise ConfigError(f"moe_router_num_groups={self.moe_router_num_groups}, moe_router_group_topk="
                                  f"{self.moe_router_group_topk}: the groups must divide num_experts={experts} and "
                                  "at most all of them be chosen")

    @property
    def q_head_dim(self) -> int:
        """Multi-latent attention: one query (and key) head, its no-position part then its rotary part."""
        return self.qk_head_dim + self.qk_pos_emb_head_dim

    def is_window_layer(self, layer: int) -> bool:
        """Whether ``layer`` (0-based) attends through the sliding window."""
        if self.sliding_window is None:
            return False
        return self.window_layers is None or self.window_layers[layer] == 1

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

    @classmethod
    def setting_names(cls) -> tuple[str, ...]:
        """The name of every setting (megatron-core's ``TransformerConfig`` name where it has one), in the
        order ``to_dict`` lists them."""
        return tuple(f.name for f in dataclasses.fields(cls))

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


def _check_f17a_fields(config: ModelConfig) -> None:
    """f17a: Granite's multipliers are positive finite numbers, NoPE layers a 0/1 per layer."""
    for name in ("embedding_multiplier", "residual_multiplier", "logits_scaling"):
        value = getattr(config, name)
        _require_finite(name, value)
        if value <= 0:
            raise ConfigError(f"{name}={quote(value)}: must be > 0")
    if isinstance(config.no_rope_layers, list):
        object.__setattr__(config, "no_rope_layers", tuple(config.no_rope_layers))
    if config.no_rope_layers is not None:
        if len(config.no_rope_layers) != config.num_layers or set(config.no_rope_layers) - {0, 1}:
            raise ConfigError(f"no_rope_layers={quote(list(config.no_rope_layers))}: must list 0 or 1 for "
                              f"each of the {config.num_layers} layers")
