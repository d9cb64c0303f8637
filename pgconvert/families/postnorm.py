"""Families with norms after their sublayers (f17b): Gemma 3 (text), Gemma 2, OLMo 2, OLMoE, GLM-4.

They share one mechanism: the tensor kinds ``self_attention.linear_proj.post_layernorm.weight`` and
``mlp.linear_fc2.post_layernorm.weight`` (``pgconvert.model.provider``, Megatron-Bridge's names) and the
``ModelConfig`` fields ``post_self_attn_layernorm`` / ``post_mlp_layernorm`` / ``pre_layernorms``;
the Megatron args of the settings megatron-core lacks are in ``pgconvert.semantics.postnorm``.

Gemma's HF norms compute ``x * (1 + w)`` and store ``w``, as megatron-core's zero-centred gamma
(``layernorm_zero_centered_gamma``) does, so the weights are copied unchanged
(``Family.hf_norms_zero_centred``). HF's ``post_attention_layernorm`` is Gemma's norm *after*
attention, not the pre-MLP norm it is in Llama (that one is ``pre_feedforward_layernorm``).
OLMo 2 has the post norms and no pre norms (``pre_layernorms=False``); OLMo 2 and OLMoE normalize q
and k over the whole projection (``qk_layernorm_across_heads``); GLM-4 has both norms around each
sublayer, HF's own interleaved partial rotary (``Family.hf_rotary_interleaved``) and a fused
``gate_up_proj`` that is megatron-core's ``linear_fc1`` as it is.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from pgconvert.semantics import attention_scale
from pgconvert.model.config import ModelConfig
from pgconvert.families import (
    _AUX_LOSS,
    _DENSE_FFN,
    _NORM_TOPK_RULE,
    _ROPE_RULE,
    DROPPED,
    GATE_UP,
    IDENTITY,
    QKV,
    QWEN3_MOE_TENSORS,
    ConfigField,
    ConfigRule,
    Family,
    TensorMapping,
    TensorTable,
    _decoder_fields,
    _every_layer_moe,
    _no_keys,
    _read_rope,
    _refuses_dense_layers,
    _write_rope,
)
from pgconvert.io.limits import quote

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
        "rope_scaling": None, "rope_scaling_factor": 1.0, "rotary_percent": 1.0,
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
                          read=_read_gemma3_rope,
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


def _read_scalar(present: Mapping[str, object], model: Mapping[str, object]) -> Mapping[str, object]:
    """Gemma's query_pre_attn_scalar (transformers' default 256): the softmax scale is its -1/2 power
    (pgconvert.semantics.attention_scale)."""
    value = present.get("query_pre_attn_scalar", 256)
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"query_pre_attn_scalar={quote(value)}: expected a positive number")
    return {"softmax_scale": attention_scale.from_scalar(value)}


def _write_scalar(config: ModelConfig) -> Mapping[str, object]:
    # transformers types it int (its strict config refuses 256.0).
    return {"query_pre_attn_scalar": attention_scale.to_scalar(attention_scale.effective(config))}


_SCALAR_RULE = ConfigRule(keys=("query_pre_attn_scalar",), model_fields=("softmax_scale",),
                          read=_read_scalar, write=_write_scalar)


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
    rules=(_GEMMA3_ROPE, _gemma_window_rule(period=6), _SCALAR_RULE),
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
    rules=(_PLAIN_ROPE, _gemma_window_rule(period=2), _SCALAR_RULE),
    fixed={**_GEMMA, "qk_layernorm": False, "rotary_base_local": None},
    hf_fixed={**_HF_GEMMA, "use_bidirectional_attention": None},
    hf_norms_zero_centred=True,
)

# OLMo 2 / OLMoE: Gemma's rows without the pre-norms (norms only after attention and the MLP).
_PRE_NORMS = (_D + "input_layernorm.weight", _D + "pre_mlp_layernorm.weight")
_OLMO2_TENSORS = TensorTable(tuple(row for row in _SANDWICH_ROWS if row.canonical not in _PRE_NORMS))
# GLM-4: input norm, attention (q/k/v biases), post-attention norm, pre-MLP norm (HF's
# post_attention_layernorm, as in Llama), MLP, post-MLP norm.
_GLM4_TENSORS = TensorTable((
    TensorMapping("embedding.word_embeddings.weight", ("model.embed_tokens.weight",)),
    TensorMapping(_D + "input_layernorm.weight", (_L + "input_layernorm.weight",)),
    TensorMapping(_D + "self_attention.linear_qkv.weight", (
        _L + "self_attn.q_proj.weight", _L + "self_attn.k_proj.weight", _L + "self_attn.v_proj.weight"), QKV),
    TensorMapping(_D + "self_attention.linear_qkv.bias", (
        _L + "self_attn.q_proj.bias", _L + "self_attn.k_proj.bias", _L + "self_attn.v_proj.bias"), QKV),
    TensorMapping(_D + "self_attention.linear_proj.weight", (_L + "self_attn.o_proj.weight",)),
    TensorMapping(_D + "self_attention.linear_proj.post_layernorm.weight", (_L + "post_self_attn_layernorm.weight",)),
    TensorMapping(_D + "pre_mlp_layernorm.weight", (_L + "post_attention_layernorm.weight",)),
    # HF's fused [gate; up] is linear_fc1 row for row.
    TensorMapping(_D + "mlp.linear_fc1.weight", (_L + "mlp.gate_up_proj.weight",), IDENTITY),
    TensorMapping(_D + "mlp.linear_fc2.weight", (_L + "mlp.down_proj.weight",)),
    TensorMapping(_D + "mlp.linear_fc2.post_layernorm.weight", (_L + "post_mlp_layernorm.weight",)),
    TensorMapping("decoder.final_layernorm.weight", ("model.norm.weight",)),
    TensorMapping("output_layer.weight", ("lm_head.weight",)),
    TensorMapping(None, ("model.rotary_emb.inv_freq",), DROPPED),
))

# SwiGLU, RMSNorm (w, not 1 + w), RoPE; what each family adds is in its own fixed values.
_PLAIN: dict[str, object] = {
    "gated_linear_unit": True, "activation": "silu", "normalization": "RMSNorm", "position_embedding_type": "rope",
    "add_bias_linear": False, "layernorm_zero_centered_gamma": False, "embedding_scale_sqrt_hidden": False,
    "attn_logit_softcapping": None, "final_logit_softcapping": None,
    "rotary_base_local": None, "sliding_window": None,
}
_MOE_OFF: dict[str, object] = {"moe_shared_expert_intermediate_size": None, "moe_router_enable_expert_bias": False}
_HF_OLMO: dict[str, object] = {"hidden_act": "silu", "attention_bias": False}
_ROPE_DEFAULT: dict[str, object] = {"rope_parameters": {"rope_type": "default"}}

OLMO2 = Family(
    architecture="Olmo2ForCausalLM",
    model_type="olmo2",
    tensors=_OLMO2_TENSORS,
    fields=(*_decoder_fields(max_position_embeddings=2048, norm_epsilon=1e-5), _DENSE_FFN),
    rules=(_ROPE_RULE,),
    fixed={**_PLAIN, "num_experts": None, "add_qkv_bias": False, "qk_layernorm": True, "qk_layernorm_across_heads": True,
           "pre_layernorms": False, "post_self_attn_layernorm": True, "post_mlp_layernorm": True},
    hf_fixed=_HF_OLMO,
    hf_scratch=_ROPE_DEFAULT,
)


def _expert_ffn(config: ModelConfig) -> int:
    return config.expert_ffn_size


OLMOE = Family(
    architecture="OlmoeForCausalLM",
    model_type="olmoe",
    hf_computes=frozenset({"moe_router_pre_softmax"}),  # fam17d
    tensors=QWEN3_MOE_TENSORS,
    fields=(
        *_decoder_fields(max_position_embeddings=4096, norm_epsilon=1e-5),
        ConfigField(("intermediate_size",), "moe_ffn_hidden_size", int, default=2048, written=_expert_ffn),
        ConfigField(("num_experts",), "num_experts", int, default=64, legacy=(("num_local_experts",),)),
        ConfigField(("num_experts_per_tok",), "moe_router_topk", int, default=8),
        _AUX_LOSS,
    ),
    rules=(ConfigRule(keys=(), model_fields=("ffn_hidden_size", "moe_layer_freq"), read=_every_layer_moe,
                      write=_no_keys, refuses=_refuses_dense_layers), _ROPE_RULE, _NORM_TOPK_RULE),
    fixed={**_PLAIN, **_MOE_OFF, "add_qkv_bias": False, "qk_layernorm": True, "qk_layernorm_across_heads": True,
           "pre_layernorms": True, "post_self_attn_layernorm": False, "post_mlp_layernorm": False},
    # clip_qkv clamps q, k and v: no Megatron layer does.
    hf_fixed={**_HF_OLMO, "clip_qkv": None},
    hf_scratch=_ROPE_DEFAULT,
)


def _read_glm4_rope(present: Mapping[str, object], model: Mapping[str, object]) -> Mapping[str, object]:
    """As Llama's, but a missing partial_rotary_factor is GLM-4's 0.5 (Glm4Config's default)."""
    params = present.get("rope_parameters")
    if "partial_rotary_factor" not in present and not (isinstance(params, dict) and "partial_rotary_factor" in params):
        present = {**present, "partial_rotary_factor": 0.5}
    return _read_rope(present, model)


def _write_glm4_rope(config: ModelConfig) -> Mapping[str, object]:
    written = dict(_write_rope(config))
    params = dict(written["rope_parameters"])  # type: ignore[arg-type]
    params["partial_rotary_factor"] = config.rotary_percent
    return {**written, "rope_parameters": params}


GLM4 = Family(
    architecture="Glm4ForCausalLM",
    model_type="glm4",
    hf_computes=frozenset({"rotary_percent"}),  # fam17d
    tensors=_GLM4_TENSORS,
    fields=(
        *_decoder_fields(max_position_embeddings=131072, norm_epsilon=1.5625e-07),
        _DENSE_FFN,
        # GLM-4's attention_bias biases q, k and v (not o_proj): Megatron's add_qkv_bias.
        ConfigField(("attention_bias",), "add_qkv_bias", bool, default=True),
    ),
    rules=(ConfigRule(keys=_ROPE_RULE.keys, model_fields=_ROPE_RULE.model_fields, read=_read_glm4_rope,
                      write=_write_glm4_rope),),
    fixed={**_PLAIN, "num_experts": None, "qk_layernorm": False, "qk_layernorm_across_heads": False,
           "pre_layernorms": True, "post_self_attn_layernorm": True, "post_mlp_layernorm": True,
           "rotary_interleaved": True},
    hf_fixed={"hidden_act": "silu"},
    # Glm4Config's pad id 151329 is a padding_idx transformers refuses for a smaller vocab: a config
    # built from the model alone (token ids unknown) says none.
    hf_scratch={**_ROPE_DEFAULT, "pad_token_id": None, "eos_token_id": None},
    hf_rotary_interleaved=True,
)

POSTNORM_FAMILIES: tuple[Family, ...] = (GEMMA3, GEMMA2, OLMO2, OLMOE, GLM4)
# A model from a Megatron source with no HF config is written as the first that fits: Gemma 3
# needs a local RoPE base and qk-norm, Gemma 2 neither; OLMo 2 has no pre-norms, OLMoE experts,
# GLM-4 interleaved rotary.
POSTNORM_INFERENCE_ORDER: tuple[str, ...] = ("Gemma3ForCausalLM", "Gemma2ForCausalLM", "Olmo2ForCausalLM",
                                             "OlmoeForCausalLM", "Glm4ForCausalLM")
