"""ERNIE 4.5 (``Ernie4_5ForCausalLM``, baidu/ERNIE-4.5-0.3B): Llama with GLM's interleaved rotary and one bias switch;
ERNIE 4.5 MoE (``Ernie4_5_MoeForCausalLM``, baidu/ERNIE-4.5-21B-A3B-PT): the same attention with dense and MoE layers.

transformers' Ernie4_5 rotates each q/k head's pairs of neighbouring channels (its ``rotate_half`` takes the
even and odd channels, its cos/sin are repeated pairwise): megatron-core's ``rotary_interleaved`` over the
whole head, HF's own order (``Family.hf_rotary_interleaved``: rows kept as they are, as for GLM-4). Its
``use_bias`` biases every linear layer, q/k/v, o and the MLP alike: megatron-core's ``add_bias_linear``
(which biases q, k and v too) with ``add_qkv_bias``. Ernie4_5Config's defaults are the 0.3B release's: 2 KV
heads, head_dim 128, RoPE base 500000, 131072 positions, tied embeddings.

ERNIE 4.5 MoE (transformers' ``models/ernie4_5_moe``): layer i is MoE when ``(i + 1) % moe_layer_interval == 0`` and
``moe_layer_start_index <= i <= moe_layer_end_index`` (-1: the last layer), megatron-core's ``moe_layer_freq`` as a
0/1 per layer; ``moe_num_shared_experts`` shared experts of ``moe_intermediate_size`` each (one shared MLP,
megatron-core's ``moe_shared_expert_intermediate_size``, no gate). Its router takes a softmax over every expert,
chooses the top ``moe_k`` by that softmax plus ``moe_statics.e_score_correction_bias`` (stored [1, experts]: one
group; megatron-core's ``router.expert_bias`` [experts]) and renormalizes the chosen (unbiased) weights, clamping
the sum below at ``moe_norm_min``. megatron-core 0.16.1 computes an expert bias only with its sigmoid router
(``TransformerConfig`` refuses ``moe_router_enable_expert_bias`` with softmax): the args say softmax with the
bias, and every Megatron output names it (``pgconvert.semantics.router_gaps``; ``--strict`` refuses). Megatron-Bridge's
ERNIE bridge writes a sigmoid router instead, which computes other weights. ``use_bias`` biases the attention, the
dense MLPs and the shared experts but not the routed experts, which megatron-core's ``add_bias_linear`` would
bias too: refused.
"""

from __future__ import annotations

from collections.abc import Mapping

from pgconvert.families.deepseek import SHARED_EXPERTS_ROWS, config_count, shared_experts_rule
from pgconvert.families.experts import AUX_LOSS, expert_count, expert_ffn_size, refuses_dense_model
from pgconvert.families.llama import (
    ATTENTION_ROWS,
    DENSE_MLP_ROWS,
    EMBEDDING_ROWS,
    FINAL_ROWS,
    HEAD_DIM_NULL,
    HF_SILU,
    LLAMA,
    ROPE_DEFAULT,
    ROPE_RULE,
    SWIGLU_RMS_ROPE,
    decoder_fields,
    head_dim_field,
    max_positions,
    query_groups_field,
    rotary_base_field,
)
from pgconvert.families.qwen import QWEN_MOE_ROWS
from pgconvert.families.table import (
    LEADING_UNIT_AXIS,
    ConfigField,
    ConfigRule,
    Family,
    TensorMapping,
    TensorTable,
    false_only,
    write_nothing,
)
from pgconvert.io.limits import quote
from pgconvert.model.config import ModelConfig

# Ernie4_5Config's default_theta.
ERNIE_ROPE_BASE = 500000.0


def _read_use_bias(present: Mapping[str, object], model: Mapping[str, object]) -> Mapping[str, object]:
    """``use_bias`` (absent or null: no biases, as ``nn.Linear(bias=None)`` builds none)."""
    value = present.get("use_bias")
    if value is not None and not isinstance(value, bool):
        raise ValueError(f"use_bias={quote(value)}: expected true or false")
    return {"add_qkv_bias": bool(value), "add_bias_linear": bool(value)}


def _write_use_bias(config: ModelConfig) -> Mapping[str, object]:
    return {"use_bias": config.add_bias_linear}


def _refuses_split_biases(config: ModelConfig) -> str | None:
    if config.has_qkv_bias != config.add_bias_linear:
        return (f"add_qkv_bias={config.attention.add_qkv_bias}, add_bias_linear={config.add_bias_linear} (ERNIE's "
                "use_bias biases every linear layer or none)")
    return None


ERNIE4_5 = LLAMA.derive(
    "Ernie4_5ForCausalLM", "ernie4_5",
    fields=(
        max_positions(131072),
        query_groups_field(2),
        head_dim_field(128, nullable=True),
        rotary_base_field(ERNIE_ROPE_BASE),
        ConfigField(("rms_norm_eps",), "norm_epsilon", float, default=1e-5),
        ConfigField(("tie_word_embeddings",), "tie_embeddings", bool, default=True),
    ),
    rules=(ConfigRule(keys=("use_bias",), model_fields=("add_qkv_bias", "add_bias_linear"), read=_read_use_bias,
                      write=_write_use_bias, refuses=_refuses_split_biases, null_keys=("use_bias",)),),
    fixed={"rotary_interleaved": True},
    hf_scratch=ROPE_DEFAULT,
    hf_rotary_interleaved=True,
    hf_notes={"rotary interleaved": "always (HF's own rotary is interleaved: rows kept as they are)",
              "linear biases": "use_bias (every linear layer)"},
)


# --- ERNIE 4.5 MoE ---------------------------------------------------------------------------------

# Ernie4_5_MoeConfig's defaults (the 21B-A3B release's).
_MOE_LAYERS_DEFAULT = {"moe_layer_start_index": 1, "moe_layer_end_index": -1, "moe_layer_interval": 1}
_MOE_NORM_MIN = 1e-12
# Ernie4_5_MoeConfig keeps a null num_key_value_heads (no __post_init__ fills it).
_KV_HEADS_NULL = "transformers' attention divides the heads by num_key_value_heads as given, and null is no count"

ERNIE4_5_MOE_TENSORS = TensorTable((
    *EMBEDDING_ROWS, *ATTENTION_ROWS, *DENSE_MLP_ROWS, *QWEN_MOE_ROWS,
    TensorMapping("decoder.layers.{}.mlp.router.expert_bias",
                  ("model.layers.{}.mlp.moe_statics.e_score_correction_bias",), LEADING_UNIT_AXIS),
    *SHARED_EXPERTS_ROWS, *FINAL_ROWS))


def _moe_layer_pattern(start: int, end: int, interval: int, layers: int) -> tuple[int, ...]:
    """transformers' Ernie4_5_MoeDecoderLayer: MoE where (i + 1) % interval == 0 and start <= i <= end."""
    last = layers - 1 if end == -1 else end
    return tuple(int((layer + 1) % interval == 0 and start <= layer <= last) for layer in range(layers))


def _read_moe_layers(present: Mapping[str, object], model: Mapping[str, object]) -> Mapping[str, object]:
    """``moe_layer_start_index`` / ``_end_index`` / ``_interval`` (absent: the class's 1, -1, 1; null is refused:
    the decoder layer compares and divides by them as given)."""
    values = {}
    for key, default in _MOE_LAYERS_DEFAULT.items():
        value = present.get(key, default)
        if value is None:
            raise ValueError(f"{key}=null: transformers' decoder layer computes with it as given, and null is no index")
        values[key] = config_count(value, key, 1 if key == "moe_layer_interval" else -1)
    layers = model["num_layers"]
    assert isinstance(layers, int)
    pattern = _moe_layer_pattern(*values.values(), layers)
    if not any(pattern):
        written = ", ".join(f"{key}={value}" for key, value in values.items())
        raise ValueError(f"{written}: no layer of {layers} is MoE (a dense ERNIE 4.5 is Ernie4_5ForCausalLM)")
    return {"moe_layer_freq": 1 if all(pattern) else pattern}


def _moe_layer_settings(config: ModelConfig) -> tuple[int, int, int] | None:
    """(start, end, interval) giving the model's MoE layers, None when none does."""
    pattern = tuple(int(config.layers[layer].moe) for layer in range(config.num_layers))
    if not any(pattern):
        return None
    start, end = pattern.index(1), config.num_layers - 1 - pattern[::-1].index(1)
    return next(((start, end, interval) for interval in range(1, config.num_layers + 1)
                 if _moe_layer_pattern(start, end, interval, config.num_layers) == pattern), None)


def _write_moe_layers(config: ModelConfig) -> Mapping[str, object]:
    settings = _moe_layer_settings(config)
    if settings is None:
        return {}
    return dict(zip(_MOE_LAYERS_DEFAULT, settings, strict=True))


def _refuses_moe_layers(config: ModelConfig) -> str | None:
    dense = refuses_dense_model(config)
    if dense is not None:
        return dense
    if _moe_layer_settings(config) is None:
        freq = config.moe.moe_layer_freq
        return (f"moe_layer_freq={list(freq) if isinstance(freq, tuple) else freq!r} (needs the MoE layers every k-th "
                "from a first to a last one: moe_layer_start_index, moe_layer_end_index, moe_layer_interval)")
    return None


def _check_norm_min(present: Mapping[str, object], model: Mapping[str, object]) -> Mapping[str, object]:
    """``moe_norm_min``: transformers divides the chosen weights by their sum clamped below at it (null: clamp
    raises); megatron-core by the sum. The chosen softmax weights sum to at least moe_k / experts, so a minimum up to
    that clamps nothing."""
    value = present.get("moe_norm_min", _MOE_NORM_MIN)
    topk, experts = model["moe_router_topk"], model["num_experts"]
    assert isinstance(topk, int) and isinstance(experts, int)
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 <= value <= topk / experts:
        raise ValueError(f"moe_norm_min={quote(value)}: the chosen weights' sum is clamped below at it, which "
                         f"megatron-core does not do; a minimum in [0, moe_k / moe_num_experts = {topk / experts}] "
                         "clamps nothing")
    return {}


ERNIE4_5_MOE = Family(
    architecture="Ernie4_5_MoeForCausalLM",
    model_type="ernie4_5_moe",
    tensors=ERNIE4_5_MOE_TENSORS,
    fields=(
        # Ernie4_5_MoeConfig has no head_dim: its attention takes getattr(config, "head_dim", hidden // heads).
        *decoder_fields(max_position_embeddings=131072, norm_epsilon=1e-5, rotary_base=ERNIE_ROPE_BASE,
                        query_groups=query_groups_field(4, null_refused=_KV_HEADS_NULL), head_dim=head_dim_field(null_refused=HEAD_DIM_NULL),
                        tie_embeddings=True),
        ConfigField(("intermediate_size",), "ffn_hidden_size", int, default=12288),
        ConfigField(("moe_intermediate_size",), "moe_ffn_hidden_size", int, default=1536, written=expert_ffn_size),
        expert_count("moe_num_experts", 64, "num_experts"),
        ConfigField(("moe_k",), "moe_router_topk", int, default=6, aliases=(("num_experts_per_tok",),),
                    null_refused="transformers' router takes the top-k as given, and null is no count"),
        AUX_LOSS,
    ),
    rules=(
        ConfigRule(keys=tuple(_MOE_LAYERS_DEFAULT), model_fields=("moe_layer_freq",), read=_read_moe_layers,
                   write=_write_moe_layers, refuses=_refuses_moe_layers, null_keys=tuple(_MOE_LAYERS_DEFAULT)),
        shared_experts_rule(default=2, key="moe_num_shared_experts", null_refused=True),
        ConfigRule(keys=("moe_norm_min",), model_fields=(), read=_check_norm_min, write=write_nothing,
                   null_keys=("moe_norm_min",)),
        false_only("use_bias", "ERNIE 4.5 MoE biases the attention, dense MLPs and shared experts but not the "
                               "routed experts; megatron-core's add_bias_linear biases the routed experts too"),
        ROPE_RULE,
    ),
    fixed={
        **SWIGLU_RMS_ROPE,
        "add_bias_linear": False,
        "add_qkv_bias": False,
        "qk_layernorm": False,
        "rotary_interleaved": True,
        "moe_shared_expert_gate": False,
        "moe_router_score_function": "softmax",
        "moe_router_enable_expert_bias": True,
        "moe_router_pre_softmax": False,
        "sliding_window": None,
        "window_layers": None,
    },
    hf_fixed=HF_SILU,
    hf_scratch=ROPE_DEFAULT,
    hf_rotary_interleaved=True,
    hf_notes={"rotary interleaved": "always (HF's own rotary is interleaved: rows kept as they are)",
              "linear biases": "use_bias (false only: the routed experts have none)",
              "moe expert bias": ("always: mlp.moe_statics.e_score_correction_bias [1, experts] (fp32), steering a "
                                  "softmax router's choice (megatron-core computes it with sigmoid only: notice)"),
              "moe pre-softmax": "none (the chosen softmax weights renormalized)",
              "moe top-k": "moe_k"},
)
