"""f17a: Qwen2-MoE, Granite, SmolLM3, Ministral and Phi-3 as ``Family`` values (see pgconvert.families).

Registered into ``pgconvert.families.FAMILIES`` by the two lines at the end of that module. Each
family is rows, fields and rules built from the pieces ``pgconvert.families`` already has; the new
config.json rules are pure functions here.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping, Sequence

import torch

import pgconvert.families as _families
from pgconvert.semantics import attention_scale
from pgconvert.model.config import ModelConfig
from pgconvert.families import (
    _AUX_LOSS,
    _ATTENTION_ROWS,
    _EVERY_LAYER_WINDOW,
    QKV,
    Transform,
    _DENSE_FFN,
    _DENSE_MLP_ROWS,
    _EMBEDDING_ROWS,
    _FINAL_ROWS,
    _HF_SILU,
    _NORM_TOPK_RULE,
    _QWEN_MOE_ROWS,
    _ROPE_DEFAULT,
    _ROPE_RULE,
    _SWIGLU_RMS_ROPE,
    GATE_UP,
    ConfigField,
    DECODER_TENSORS,
    ConfigRule,
    Family,
    TensorMapping,
    TensorTable,
    _decoder_fields,
    _expert_ffn_size,
    _layers_from_sparse_step,
    _refuses_dense_model,
    _sparse_step_from_layers,
    _window,
)
from pgconvert.io.limits import quote
from pgconvert.semantics import rope_parameters, rope_type_of

# --- sliding windows given per layer by layer_types ----------------------------------------------

LayerPattern = Callable[[Mapping[str, object], int], tuple[int, ...]]


def _layer_types(present: Mapping[str, object], layers: int) -> tuple[int, ...] | None:
    """``layer_types`` as a 0/1 per layer (1: sliding), None when absent."""
    types = present.get("layer_types")
    if types is None:
        return None
    if (not isinstance(types, list) or len(types) != layers
            or not all(kind in ("sliding_attention", "full_attention") for kind in types)):
        raise ValueError(f"layer_types={quote(types)}: expected {layers} of 'sliding_attention'/'full_attention'")
    return tuple(int(kind == "sliding_attention") for kind in types)


def _window_values(window: int | None, pattern: tuple[int, ...]) -> Mapping[str, object]:
    if window is None or not any(pattern):
        return {"sliding_window": None, "window_layers": None}
    return {"sliding_window": window, "window_layers": None if all(pattern) else pattern}


def _layer_types_of(config: ModelConfig) -> list[str]:
    return ["sliding_attention" if config.is_window_layer(layer) else "full_attention"
            for layer in range(config.num_layers)]


def _qwen2_moe_default_pattern(present: Mapping[str, object], layers: int) -> tuple[int, ...]:
    """transformers' Qwen2MoeConfig without layer_types: odd 1-based layers below max_window_layers."""
    first = present.get("max_window_layers", 28)
    if not isinstance(first, int) or isinstance(first, bool) or first < 0:
        raise ValueError(f"max_window_layers={quote(first)}: expected a layer count")
    return tuple(int((layer + 1) % 2 == 1 and layer < first) for layer in range(layers))


def _read_qwen2_moe_window(present: Mapping[str, object], model: Mapping[str, object]) -> Mapping[str, object]:
    """Qwen2-MoE: ``use_sliding_window`` turns ``sliding_window`` on for the layers ``layer_types``
    marks (transformers' default pattern when it is absent)."""
    use = present.get("use_sliding_window", False)
    if not isinstance(use, bool):
        raise ValueError(f"use_sliding_window={quote(use)}: expected true or false")
    layers = model["num_layers"]
    assert isinstance(layers, int)
    window = _window(present.get("sliding_window"), "sliding_window") if use else None
    pattern = _layer_types(present, layers)
    if pattern is None:
        pattern = _qwen2_moe_default_pattern(present, layers)
    return _window_values(window, pattern)


def _write_qwen2_moe_window(config: ModelConfig) -> Mapping[str, object]:
    return {"use_sliding_window": config.sliding_window is not None, "sliding_window": config.sliding_window,
            "layer_types": _layer_types_of(config)}


_QWEN2_MOE_WINDOW = ConfigRule(keys=("use_sliding_window", "sliding_window", "layer_types"),
                               model_fields=("sliding_window", "window_layers"),
                               read=_read_qwen2_moe_window, write=_write_qwen2_moe_window)


def _no_values(present: Mapping[str, object], model: Mapping[str, object]) -> Mapping[str, object]:
    return {}


def _no_keys(config: ModelConfig) -> Mapping[str, object]:
    return {}


def _refuses_no_shared_expert(config: ModelConfig) -> str | None:
    if config.num_experts is not None and config.moe_shared_expert_intermediate_size is None:
        return "moe_shared_expert_intermediate_size=None (needs a gated shared expert)"
    return None


# --- Qwen2-MoE ---------------------------------------------------------------------------------------

# transformers' Qwen2MoeSparseMoeBlock: shared_expert (an MLP) scaled by sigmoid(shared_expert_gate(x)),
# which is megatron-core's SharedExpertMLP with moe_shared_expert_gate (gate_weight [1, hidden]).
_QWEN2_SHARED_EXPERT_ROWS = (
    TensorMapping("decoder.layers.{}.mlp.shared_experts.linear_fc1.weight", (
        "model.layers.{}.mlp.shared_expert.gate_proj.weight",
        "model.layers.{}.mlp.shared_expert.up_proj.weight",
    ), GATE_UP),
    TensorMapping("decoder.layers.{}.mlp.shared_experts.linear_fc2.weight",
                  ("model.layers.{}.mlp.shared_expert.down_proj.weight",)),
    TensorMapping("decoder.layers.{}.mlp.shared_experts.gate_weight", ("model.layers.{}.mlp.shared_expert_gate.weight",)),
)
QWEN2_MOE_TENSORS = TensorTable((*_EMBEDDING_ROWS, *_ATTENTION_ROWS, *_DENSE_MLP_ROWS, *_QWEN_MOE_ROWS,
                                 *_QWEN2_SHARED_EXPERT_ROWS, *_FINAL_ROWS))

QWEN2_MOE = Family(
    architecture="Qwen2MoeForCausalLM",
    model_type="qwen2_moe",
    hf_computes=frozenset({"moe_router_pre_softmax"}),  # fam17d
    tensors=QWEN2_MOE_TENSORS,
    fields=(
        *_decoder_fields(max_position_embeddings=32768),
        _DENSE_FFN,
        ConfigField(("moe_intermediate_size",), "moe_ffn_hidden_size", int, default=1408, written=_expert_ffn_size),
        ConfigField(("num_experts",), "num_experts", int, default=60),
        ConfigField(("num_experts_per_tok",), "moe_router_topk", int, default=4),
        ConfigField(("shared_expert_intermediate_size",), "moe_shared_expert_intermediate_size", int, default=5632),
        # q, k and v biases only (o_proj and the MLPs have none): megatron-core's add_qkv_bias.
        ConfigField(("qkv_bias",), "add_qkv_bias", bool, default=True),
        _AUX_LOSS,
    ),
    rules=(ConfigRule(keys=("decoder_sparse_step", "mlp_only_layers"), model_fields=("moe_layer_freq",),
                      read=_layers_from_sparse_step, write=_sparse_step_from_layers,
                      refuses=_refuses_dense_model),
           ConfigRule(keys=(), model_fields=(), read=_no_values, write=_no_keys, refuses=_refuses_no_shared_expert),
           _ROPE_RULE, _QWEN2_MOE_WINDOW, _NORM_TOPK_RULE),
    fixed={**_SWIGLU_RMS_ROPE, "moe_shared_expert_gate": True, "moe_router_enable_expert_bias": False,
           "qk_layernorm": False, "add_bias_linear": False},
    hf_fixed=_HF_SILU,
    hf_scratch=_ROPE_DEFAULT,
)


# --- Granite ---------------------------------------------------------------------------------------

def _read_attention_multiplier(present: Mapping[str, object], model: Mapping[str, object]) -> Mapping[str, object]:
    """Granite's attention_multiplier is the softmax scale itself (transformers' default 1.0;
    pgconvert.semantics.attention_scale)."""
    value = present.get("attention_multiplier", 1.0)
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"attention_multiplier={quote(value)}: expected a positive number")
    return {"softmax_scale": float(value)}


def _write_attention_multiplier(config: ModelConfig) -> Mapping[str, object]:
    return {"attention_multiplier": attention_scale.effective(config)}


GRANITE = Family(
    architecture="GraniteForCausalLM",
    model_type="granite",
    tensors=DECODER_TENSORS,
    fields=(
        *_decoder_fields(max_position_embeddings=2048),
        _DENSE_FFN,
        # As Llama: attention_bias (q, k, v, o) and mlp_bias must agree (one Megatron switch).
        ConfigField(("attention_bias",), "add_bias_linear", bool, default=False),
        ConfigField(("mlp_bias",), "add_bias_linear", bool, default=False),
        # transformers' GraniteModel multiplies the embeddings and each sublayer's output, and
        # GraniteForCausalLM divides the logits; megatron-core has none of the three.
        ConfigField(("embedding_multiplier",), "embedding_multiplier", float, default=1.0),
        ConfigField(("residual_multiplier",), "residual_multiplier", float, default=1.0),
        ConfigField(("logits_scaling",), "logits_scaling", float, default=1.0),
    ),
    rules=(_ROPE_RULE, ConfigRule(keys=("attention_multiplier",), model_fields=("softmax_scale",),
                                  read=_read_attention_multiplier, write=_write_attention_multiplier)),
    fixed={**_SWIGLU_RMS_ROPE, "num_experts": None, "qk_layernorm": False, "add_qkv_bias": False,
           "sliding_window": None},
    hf_fixed=_HF_SILU,
    hf_scratch=_ROPE_DEFAULT,
)


# --- SmolLM3 --------------------------------------------------------------------------------------

def _rope_flags(present: Mapping[str, object], layers: int) -> tuple[int, ...]:
    """SmolLM3's ``no_rope_layers`` (1: the layer uses RoPE), by default every
    ``no_rope_layer_interval``-th (1-based) layer without, as transformers' SmolLM3Config fills it."""
    flags = present.get("no_rope_layers")
    if flags is None:
        interval = present.get("no_rope_layer_interval", 4)
        if not isinstance(interval, int) or isinstance(interval, bool) or interval < 1:
            raise ValueError(f"no_rope_layer_interval={quote(interval)}: expected a positive integer")
        return tuple(int((layer + 1) % interval != 0) for layer in range(layers))
    if (not isinstance(flags, list) or len(flags) != layers
            or not all(v in (0, 1) and not isinstance(v, bool) for v in flags)):
        raise ValueError(f"no_rope_layers={quote(flags)}: expected {layers} of 0 or 1")
    return tuple(flags)


def _read_smollm3_layers(present: Mapping[str, object], model: Mapping[str, object]) -> Mapping[str, object]:
    """NoPE layers (megatron-core's no_rope_freq is the complement of ``no_rope_layers``) and the
    window, on the layers ``layer_types`` marks (by default the NoPE ones) when ``use_sliding_window``."""
    layers = model["num_layers"]
    assert isinstance(layers, int)
    rope = _rope_flags(present, layers)
    use = present.get("use_sliding_window", False)
    if not isinstance(use, bool):
        raise ValueError(f"use_sliding_window={quote(use)}: expected true or false")
    window = _window(present.get("sliding_window"), "sliding_window") if use else None
    pattern = _layer_types(present, layers)
    if pattern is None:
        pattern = tuple(int(not flag) for flag in rope)
    no_rope = tuple(1 - flag for flag in rope)
    return {"no_rope_layers": no_rope if any(no_rope) else None, **_window_values(window, pattern)}


def _write_smollm3_layers(config: ModelConfig) -> Mapping[str, object]:
    no_rope = config.no_rope_layers or (0,) * config.num_layers
    return {"no_rope_layers": [1 - flag for flag in no_rope], "no_rope_layer_interval": 4,
            "use_sliding_window": config.sliding_window is not None, "sliding_window": config.sliding_window,
            "layer_types": _layer_types_of(config)}


SMOLLM3 = Family(
    architecture="SmolLM3ForCausalLM",
    model_type="smollm3",
    tensors=DECODER_TENSORS,
    fields=(
        *(spec for spec in _decoder_fields(max_position_embeddings=32768) if spec.model_field != "tie_embeddings"),
        ConfigField(("tie_word_embeddings",), "tie_embeddings", bool, default=True),
        _DENSE_FFN,
        ConfigField(("attention_bias",), "add_bias_linear", bool, default=False),
        ConfigField(("mlp_bias",), "add_bias_linear", bool, default=False),
    ),
    rules=(_ROPE_RULE, ConfigRule(
        keys=("no_rope_layers", "no_rope_layer_interval", "use_sliding_window", "sliding_window", "layer_types"),
        model_fields=("no_rope_layers", "sliding_window", "window_layers"),
        read=_read_smollm3_layers, write=_write_smollm3_layers)),
    fixed={**_SWIGLU_RMS_ROPE, "num_experts": None, "qk_layernorm": False, "add_qkv_bias": False},
    hf_fixed=_HF_SILU,
    # SmolLM3Config's default token ids (128000…128004) are outside a smaller vocabulary, where
    # transformers then fails to build the model; a Megatron checkpoint does not know its ids.
    hf_scratch={**_ROPE_DEFAULT, "bos_token_id": None, "eos_token_id": None, "pad_token_id": None},
)


# --- Ministral ------------------------------------------------------------------------------------

def _read_ministral_window(present: Mapping[str, object], model: Mapping[str, object]) -> Mapping[str, object]:
    """Ministral: ``sliding_window`` on the layers ``layer_types`` marks (by default every layer
    when there is a window, as transformers' MinistralConfig fills it)."""
    layers = model["num_layers"]
    assert isinstance(layers, int)
    window = _window(present.get("sliding_window"), "sliding_window")
    pattern = _layer_types(present, layers)
    if pattern is None:
        pattern = (1,) * layers
    return _window_values(window, pattern)


def _write_ministral_window(config: ModelConfig) -> Mapping[str, object]:
    return {"sliding_window": config.sliding_window, "layer_types": _layer_types_of(config)}


MINISTRAL = Family(
    architecture="MinistralForCausalLM",
    model_type="ministral",
    tensors=DECODER_TENSORS,
    fields=(*_decoder_fields(max_position_embeddings=131072), _DENSE_FFN),
    rules=(_ROPE_RULE, ConfigRule(keys=("sliding_window", "layer_types"), model_fields=("sliding_window", "window_layers"),
                                  read=_read_ministral_window, write=_write_ministral_window)),
    fixed={**_SWIGLU_RMS_ROPE, "num_experts": None, "qk_layernorm": False, "add_qkv_bias": False,
           "add_bias_linear": False},
    hf_fixed=_HF_SILU,
    hf_scratch=_ROPE_DEFAULT,
)


# --- Phi-3 / Phi-4 ---------------------------------------------------------------------------------

class FuseQKVFromConcat(Transform):
    """Phi-3's ``qkv_proj`` = ``[all q; all k; all v]`` <-> megatron-core's ``linear_qkv``, whose rows
    are grouped per query group (``FuseQKVByGroup``): the one HF tensor is cut into q, k, v first."""

    name = "fuse-qkv-from-concat"
    parts = 1

    @staticmethod
    def _rows(config: ModelConfig) -> list[int]:
        kv_rows = config.query_groups * config.head_dim
        return [config.num_attention_heads * config.head_dim, kv_rows, kv_rows]

    def fuse(self, parts: Sequence[torch.Tensor], config: ModelConfig) -> torch.Tensor:
        return QKV.fuse(list(parts[0].split(self._rows(config), dim=0)), config)

    def split(self, full: torch.Tensor, config: ModelConfig) -> list[torch.Tensor]:
        return [torch.cat(QKV.split(full, config), dim=0)]

    def part_shapes(self, shape: tuple[int, ...], config: ModelConfig) -> list[tuple[int, ...]]:
        return [shape]


QKV_CONCAT = FuseQKVFromConcat()
# Phi3MLP: gate_up_proj is [gate; up] (chunk(2), gate first), megatron-core's linear_fc1 as it is.
PHI3_TENSORS = TensorTable((
    *_EMBEDDING_ROWS,
    TensorMapping("decoder.layers.{}.input_layernorm.weight", ("model.layers.{}.input_layernorm.weight",)),
    TensorMapping("decoder.layers.{}.self_attention.linear_qkv.weight", ("model.layers.{}.self_attn.qkv_proj.weight",),
                  QKV_CONCAT),
    TensorMapping("decoder.layers.{}.self_attention.linear_proj.weight", ("model.layers.{}.self_attn.o_proj.weight",)),
    TensorMapping("decoder.layers.{}.pre_mlp_layernorm.weight", ("model.layers.{}.post_attention_layernorm.weight",)),
    TensorMapping("decoder.layers.{}.mlp.linear_fc1.weight", ("model.layers.{}.mlp.gate_up_proj.weight",)),
    TensorMapping("decoder.layers.{}.mlp.linear_fc2.weight", ("model.layers.{}.mlp.down_proj.weight",)),
    *_FINAL_ROWS,
))
PHI3_ARCHITECTURE = "Phi3ForCausalLM"

# HF RoPE types megatron-core computes none of, carried whole in hf_rope_parameters (fam17d: was
# semantics_more.CARRIED_ROPE_TYPES).
_PHI3_CARRIED_ROPE_TYPES = ("longrope", "su")


def _read_phi3_rope(present: Mapping[str, object], model: Mapping[str, object]) -> Mapping[str, object]:
    """Partial rotary and RoPE scaling as every family reads them; a longrope (``su``) type, which
    megatron-core cannot compute, is carried whole (with ``original_max_position_embeddings``)."""
    values = dict(_ROPE_RULE.read(present, model))
    params = rope_parameters(present)
    carried = None
    if rope_type_of(params) in _PHI3_CARRIED_ROPE_TYPES:
        kept = {key: value for key, value in params.items() if key != "rope_theta"}
        if present.get("original_max_position_embeddings") is not None:
            kept.setdefault("original_max_position_embeddings", present["original_max_position_embeddings"])
        carried = json.dumps(kept, sort_keys=True)
    return {**values, "hf_rope_parameters": carried}


def _write_phi3_rope(config: ModelConfig) -> Mapping[str, object]:
    written = dict(_ROPE_RULE.write(config))
    params = dict(written["rope_parameters"])  # type: ignore[call-overload]
    if config.hf_rope_parameters is not None:
        params = {**json.loads(config.hf_rope_parameters), "rope_theta": config.rotary_base}
        written["rope_scaling"] = None
    # Phi3 computes partial rotary (megatron-core's rotary_percent): written where transformers reads it.
    params["partial_rotary_factor"] = config.rotary_percent
    original = params.get("original_max_position_embeddings", config.max_position_embeddings)
    return {**written, "rope_parameters": params, "partial_rotary_factor": config.rotary_percent,
            "original_max_position_embeddings": original}


_PHI3_ROPE = ConfigRule(keys=(*_ROPE_RULE.keys, "original_max_position_embeddings"),
                        model_fields=(*_ROPE_RULE.model_fields, "hf_rope_parameters"),
                        read=_read_phi3_rope, write=_write_phi3_rope)

PHI3 = Family(
    architecture=PHI3_ARCHITECTURE,
    model_type="phi3",
    hf_computes=frozenset({"rotary_percent"}),  # fam17d
    hf_rope_types_carried=_PHI3_CARRIED_ROPE_TYPES,
    tensors=PHI3_TENSORS,
    fields=(*_decoder_fields(max_position_embeddings=4096, norm_epsilon=1e-5), _DENSE_FFN),
    rules=(_PHI3_ROPE, _EVERY_LAYER_WINDOW),
    fixed={**_SWIGLU_RMS_ROPE, "num_experts": None, "qk_layernorm": False, "add_qkv_bias": False,
           "add_bias_linear": False},
    hf_fixed=_HF_SILU,
    # Phi3Config's default token ids (32000) are outside a smaller vocabulary (see SmolLM3).
    hf_scratch={**_ROPE_DEFAULT, "bos_token_id": None, "eos_token_id": None, "pad_token_id": None},
)


# --- registration and what a family does not carry ------------------------------------------------

MORE_FAMILIES: tuple[Family, ...] = (QWEN2_MOE, GRANITE, SMOLLM3, MINISTRAL, PHI3)
# Tried after the families of pgconvert.families for a model that names no architecture.
# Ministral before SmolLM3: both express a window on some layers; SmolLM3 is needed for NoPE layers.
MORE_INFERENCE_ORDER: tuple[str, ...] = ("Qwen2MoeForCausalLM", "GraniteForCausalLM", "MinistralForCausalLM",
                                         "SmolLM3ForCausalLM", PHI3_ARCHITECTURE)
_families.FAMILIES.update({family.architecture: family for family in MORE_FAMILIES})
_families.INFERENCE_ORDER += MORE_INFERENCE_ORDER

# The f17a ModelConfig fields and the value a family that does not map them computes as.
F17A_DEFAULTS: dict[str, object] = {
    "embedding_multiplier": 1.0,
    "residual_multiplier": 1.0,
    "logits_scaling": 1.0,
    "no_rope_layers": None,
    "hf_rope_parameters": None,
    "softmax_scale": None,  # tidy: the attention scale (pgconvert.semantics.attention_scale)
}


def _carried_fields(family: Family) -> set[str]:
    return ({spec.model_field for spec in family.fields} | set(family.fixed)
            | {name for rule in family.rules for name in rule.model_fields})


def unmapped_losses(architecture: str, config: ModelConfig) -> list[str]:
    """The f17a settings of ``config`` that ``architecture`` has no config.json key for."""
    family = _families.FAMILIES.get(architecture)
    carried = _carried_fields(family) if family is not None else set()
    return [f"{name}={getattr(config, name)!r}: {architecture} has no such setting"
            for name, default in F17A_DEFAULTS.items()
            if name not in carried and getattr(config, name) != default]
