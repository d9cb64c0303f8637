"""Families with norms after their sublayers (f17b): Gemma 3 (text), Gemma 2.

They share one mechanism: the tensor kinds ``self_attention.linear_proj.post_layernorm.weight`` and
``mlp.linear_fc2.post_layernorm.weight`` (``pgconvert.provider``, Megatron-Bridge's names) and the
``ModelConfig`` fields ``post_self_attn_layernorm`` / ``post_mlp_layernorm`` / ``pre_layernorms``;
the Megatron args of the settings megatron-core lacks are in ``pgconvert.postnorm_args``.

Gemma's HF norms compute ``x * (1 + w)`` and store ``w``, as megatron-core's zero-centred gamma
(``layernorm_zero_centered_gamma``) does, so the weights are copied unchanged
(``Family.hf_norms_zero_centred``). HF's ``post_attention_layernorm`` is Gemma's norm *after*
attention, not the pre-MLP norm it is in Llama (that one is ``pre_feedforward_layernorm``).
"""

from __future__ import annotations

from collections.abc import Mapping

from pgconvert.config import ModelConfig
from pgconvert.families import (
    DROPPED,
    GATE_UP,
    QKV,
    ConfigField,
    ConfigRule,
    Family,
    TensorMapping,
    TensorTable,
)
from pgconvert.limits import quote

_L = "model.layers.{}."
_D = "decoder.layers.{}."

_SANDWICH_ROWS = (
    TensorMapping("embedding.word_embeddings.weight", ("model.embed_tokens.weight",)),
    TensorMapping(_D + "input_layernorm.weight", (_L + "input_layernorm.weight",)),
    TensorMapping(_D + "self_attention.linear_qkv.weight", (
        _L + "self_attn.q_proj.weight", _L + "self_attn.k_proj.weight", _L + "self_attn.v_proj.weight"), QKV),
    TensorMapping(_D + "self_attention.q_layernorm.weight", (_L + "self_attn.q_norm.weight",)),
    TensorMapping(_D + "self_attention.k_layernorm.weight", (_L + "self_attn.k_norm.weight",)),
    TensorMapping(_D + "self_attention.linear_proj.weight", (_L + "self_attn.o_proj.weight",)),
    TensorMapping(_D + "self_attention.linear_proj.post_layernorm.weight", (_L + "post_attention_layernorm.weight",)),
    TensorMapping(_D + "pre_mlp_layernorm.weight", (_L + "pre_feedforward_layernorm.weight",)),
    TensorMapping(_D + "mlp.linear_fc1.weight", (_L + "mlp.gate_proj.weight", _L + "mlp.up_proj.weight"), GATE_UP),
    TensorMapping(_D + "mlp.linear_fc2.weight", (_L + "mlp.down_proj.weight",)),
    TensorMapping(_D + "mlp.linear_fc2.post_layernorm.weight", (_L + "post_feedforward_layernorm.weight",)),
    TensorMapping("decoder.final_layernorm.weight", ("model.norm.weight",)),
    TensorMapping("output_layer.weight", ("lm_head.weight",)),
    TensorMapping(None, ("model.rotary_emb.inv_freq",), DROPPED),
)
# Gemma 2 and 3: input norm, attention, post-attention norm, pre-FFN norm, MLP, post-FFN norm.
GEMMA_TENSORS = TensorTable(_SANDWICH_ROWS)


def _positive_int(value: object, key: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{key}={quote(value)}: expected a positive integer")
    return value


def _layer_pattern(present: Mapping[str, object], layers: int, period: int) -> tuple[int, ...]:
    """1 per ``sliding_attention`` layer of ``layer_types``; by default transformers' pattern (every
    ``period``-th layer full)."""
    types = present.get("layer_types")
    if types is None:
        return tuple(int((layer + 1) % period != 0) for layer in range(layers))
    if (not isinstance(types, list) or len(types) != layers
            or not all(kind in ("sliding_attention", "full_attention") for kind in types)):
        raise ValueError(f"layer_types={quote(types)}: expected {layers} of 'sliding_attention'/'full_attention'")
    return tuple(int(kind == "sliding_attention") for kind in types)


def _gemma_window_rule(period: int) -> ConfigRule:
    """``sliding_window`` (transformers' default 4096) on the layers ``layer_types`` marks sliding."""

    def read(present: Mapping[str, object], model: Mapping[str, object]) -> Mapping[str, object]:
        layers = model["num_layers"]
        assert isinstance(layers, int)
        pattern = _layer_pattern(present, layers, period)
        window = _positive_int(present.get("sliding_window", 4096), "sliding_window")
        if not any(pattern):
            return {"sliding_window": None, "window_layers": None}
        return {"sliding_window": window, "window_layers": None if all(pattern) else pattern}

    def write(config: ModelConfig) -> Mapping[str, object]:
        return {"sliding_window": config.sliding_window,
                "layer_types": ["sliding_attention" if config.is_window_layer(layer) else "full_attention"
                                for layer in range(config.num_layers)]}

    return ConfigRule(keys=("sliding_window", "layer_types"), model_fields=("sliding_window", "window_layers"),
                      read=read, write=write)


def _theta(params: Mapping[str, object], key: str, default: float) -> float:
    value = params.get("rope_theta", default)
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 < value < float("inf"):
        raise ValueError(f"{key}.rope_theta={quote(value)}: expected a positive number")
    return float(value)


def _rope_type(params: Mapping[str, object], key: str, allowed: tuple[str, ...]) -> str:
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in allowed:
        raise ValueError(f"{key}.rope_type={quote(rope_type)}: pgconvert converts {' or '.join(allowed)} here")
    assert isinstance(rope_type, str)
    return rope_type


def _sub(params: Mapping[str, object], name: str) -> Mapping[str, object]:
    value = params.get(name, {})
    if not isinstance(value, dict):
        raise ValueError(f"rope_parameters.{name}={quote(value)}: expected an object")
    return value


def _read_gemma3_rope(present: Mapping[str, object], model: Mapping[str, object]) -> Mapping[str, object]:
    """Gemma 3's RoPE per layer type: ``full_attention`` (default base 1e6, plain or linear scaling:
    Megatron's rotary_base and rope scaling) and ``sliding_attention`` (base 1e4, plain: rotary_base_local)."""
    params = present.get("rope_parameters", {})
    if not isinstance(params, dict):
        raise ValueError(f"rope_parameters={quote(params)}: expected an object")
    full, local = _sub(params, "full_attention"), _sub(params, "sliding_attention")
    _rope_type(local, "rope_parameters.sliding_attention", ("default",))
    values: dict[str, object] = {
        "rotary_base": _theta(full, "rope_parameters.full_attention", 1_000_000.0),
        "rotary_base_local": _theta(local, "rope_parameters.sliding_attention", 10_000.0),
        "rope_scaling": None, "rope_scaling_factor": 1.0,
    }
    if _rope_type(full, "rope_parameters.full_attention", ("default", "linear")) == "linear":
        factor = full.get("factor")
        if not isinstance(factor, (int, float)) or isinstance(factor, bool) or not 0 < factor < float("inf"):
            raise ValueError(f"rope_parameters.full_attention.factor={quote(factor)}: expected a positive number")
        values.update(rope_scaling="linear", rope_scaling_factor=float(factor))
    return values


def _write_gemma3_rope(config: ModelConfig) -> Mapping[str, object]:
    full: dict[str, object] = {"rope_type": config.rope_scaling or "default", "rope_theta": config.rotary_base}
    if config.rope_scaling is not None:
        full["factor"] = config.rope_scaling_factor
    local = {"rope_type": "default", "rope_theta": config.rotary_base_local}
    return {"rope_parameters": {"sliding_attention": local, "full_attention": full}}


def _refuses_gemma3_rope(config: ModelConfig) -> str | None:
    if config.rotary_base_local is None:
        return "rotary_base_local=None (needs the sliding layers' RoPE base)"
    if config.rope_scaling not in (None, "linear"):
        return f"rope_scaling={config.rope_scaling!r} (needs none or linear)"
    if config.rotary_percent != 1.0:
        return f"rotary_percent={config.rotary_percent} (needs 1.0)"
    return None


_GEMMA3_ROPE = ConfigRule(keys=("rope_parameters",),
                          model_fields=("rotary_base", "rotary_base_local", "rope_scaling", "rope_scaling_factor",
                                        "rotary_percent"),
                          read=lambda present, model: {**_read_gemma3_rope(present, model), "rotary_percent": 1.0},
                          write=_write_gemma3_rope, refuses=_refuses_gemma3_rope)


def _read_plain_rope(present: Mapping[str, object], model: Mapping[str, object]) -> Mapping[str, object]:
    params = present.get("rope_parameters", {})
    if not isinstance(params, dict):
        raise ValueError(f"rope_parameters={quote(params)}: expected an object")
    _rope_type(params, "rope_parameters", ("default",))
    return {"rotary_base": _theta(params, "rope_parameters", 10_000.0), "rope_scaling": None,
            "rope_scaling_factor": 1.0, "rotary_percent": 1.0}


def _write_plain_rope(config: ModelConfig) -> Mapping[str, object]:
    return {"rope_parameters": {"rope_type": "default", "rope_theta": config.rotary_base}}


def _refuses_scaled_rope(config: ModelConfig) -> str | None:
    if config.rope_scaling is not None or config.rotary_percent != 1.0:
        return f"rope_scaling={config.rope_scaling!r}, rotary_percent={config.rotary_percent} (needs plain RoPE)"
    return None


_PLAIN_ROPE = ConfigRule(keys=("rope_parameters",),
                         model_fields=("rotary_base", "rope_scaling", "rope_scaling_factor", "rotary_percent"),
                         read=_read_plain_rope, write=_write_plain_rope, refuses=_refuses_scaled_rope)


def _scalar_as_written(config: ModelConfig) -> object:
    scalar = config.query_pre_attn_scalar
    return int(scalar) if scalar is not None and scalar.is_integer() else scalar


def _gemma_fields(max_positions: int, final_softcap: float | None,
                  attn_softcap: float | None) -> tuple[ConfigField, ...]:
    """config.json fields of Gemma 2/3 (defaults: transformers' class defaults, which
    ``save_pretrained`` leaves out of config.json)."""
    return (
        ConfigField(("hidden_size",), "hidden_size", int, default=2304),
        ConfigField(("num_hidden_layers",), "num_layers", int, default=26),
        ConfigField(("num_attention_heads",), "num_attention_heads", int, default=8),
        ConfigField(("num_key_value_heads",), "num_query_groups", int, default=4),
        ConfigField(("head_dim",), "kv_channels", int, default=256),
        ConfigField(("intermediate_size",), "ffn_hidden_size", int, default=9216),
        ConfigField(("rms_norm_eps",), "norm_epsilon", float, default=1e-6),
        ConfigField(("max_position_embeddings",), "max_position_embeddings", int, default=max_positions),
        ConfigField(("vocab_size",), "vocab_size", int),
        ConfigField(("tie_word_embeddings",), "tie_embeddings", bool, default=True),
        ConfigField(("attention_dropout",), "attention_dropout", float, default=0.0),
        # transformers types it int (its strict config refuses 256.0).
        ConfigField(("query_pre_attn_scalar",), "query_pre_attn_scalar", float, default=256.0,
                    written=_scalar_as_written),
        ConfigField(("final_logit_softcapping",), "final_logit_softcapping", float, default=final_softcap,
                    nullable=True),
        ConfigField(("attn_logit_softcapping",), "attn_logit_softcapping", float, default=attn_softcap,
                    nullable=True),
    )


# Megatron-Bridge's Gemma 2/3 providers: GeGLU (gated tanh-GELU), RMSNorm with zero-centred gamma,
# RoPE, sandwich norms, embeddings times sqrt(hidden).
_GEMMA: dict[str, object] = {
    "gated_linear_unit": True,
    "activation": "gelu_tanh",
    "normalization": "RMSNorm",
    "position_embedding_type": "rope",
    "num_experts": None,
    "add_qkv_bias": False,
    "add_bias_linear": False,
    "layernorm_zero_centered_gamma": True,
    "post_self_attn_layernorm": True,
    "post_mlp_layernorm": True,
    "pre_layernorms": True,
    "embedding_scale_sqrt_hidden": True,
}
_HF_GEMMA: dict[str, object] = {"hidden_activation": "gelu_pytorch_tanh", "attention_bias": False}

GEMMA3 = Family(
    architecture="Gemma3ForCausalLM",
    model_type="gemma3_text",
    tensors=GEMMA_TENSORS,
    fields=_gemma_fields(max_positions=131_072, final_softcap=None, attn_softcap=None),
    # transformers' Gemma3TextConfig: every 6th layer full attention by default.
    rules=(_GEMMA3_ROPE, _gemma_window_rule(period=6)),
    fixed={**_GEMMA, "qk_layernorm": True},
    hf_fixed={**_HF_GEMMA, "use_bidirectional_attention": False},
    hf_norms_zero_centred=True,
)

GEMMA2 = Family(
    architecture="Gemma2ForCausalLM",
    model_type="gemma2",
    tensors=GEMMA_TENSORS,
    fields=_gemma_fields(max_positions=8192, final_softcap=30.0, attn_softcap=50.0),
    # transformers' Gemma2Config: sliding and full attention alternate, sliding first.
    rules=(_PLAIN_ROPE, _gemma_window_rule(period=2)),
    fixed={**_GEMMA, "qk_layernorm": False, "rotary_base_local": None},
    hf_fixed={**_HF_GEMMA, "use_bidirectional_attention": None},
    hf_norms_zero_centred=True,
)

POSTNORM_FAMILIES: tuple[Family, ...] = (GEMMA3, GEMMA2)
# A model from a Megatron source with no HF config is written as the first that fits: Gemma 3
# needs a local RoPE base and qk-norm, Gemma 2 neither.
POSTNORM_INFERENCE_ORDER: tuple[str, ...] = ("Gemma3ForCausalLM", "Gemma2ForCausalLM")
