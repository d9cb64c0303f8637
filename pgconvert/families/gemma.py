"""Gemma 3 (text, ``Gemma3ForCausalLM``), Gemma 2 (``Gemma2ForCausalLM``) and Gemma (``GemmaForCausalLM``).

A Gemma layer is input norm, attention, post-attention norm, pre-FFN norm, GeGLU MLP, post-FFN
norm: the tensor kinds ``self_attention.linear_proj.post_layernorm.weight`` and
``mlp.linear_fc2.post_layernorm.weight`` (``pgconvert.model.provider``, Megatron-Bridge's names) and
the ``ModelConfig`` fields ``post_self_attn_layernorm`` / ``post_mlp_layernorm``; the Megatron args
of what megatron-core lacks (the post norms, the embedding scaled by sqrt(hidden), soft-capping,
Gemma 3's second RoPE base) are in ``pgconvert.semantics.postnorm``.

Gemma's HF norms compute ``x * (1 + w)`` and store ``w``, as megatron-core's zero-centred gamma
(``layernorm_zero_centered_gamma``) does, so the weights are copied unchanged
(``Family.hf_norms_zero_centred``). HF's ``post_attention_layernorm`` is Gemma's norm *after*
attention, not the pre-MLP norm it is in Llama (that one is ``pre_feedforward_layernorm``).
``query_pre_attn_scalar`` is the attention softmax scale's -1/2 power
(``pgconvert.semantics.attention_scale``).

Gemma (google/gemma-2b, gemma-7b, gemma-1.1) is Llama's layer (a norm before each sublayer only, HF's
``post_attention_layernorm`` the pre-MLP norm as in Llama) with Gemma's ``(1 + w)`` RMSNorm, embeddings
times sqrt(hidden) and the gated tanh GELU, ``head_dim`` apart from hidden / heads (256), tied
embeddings, one RoPE, no soft-capping, window or qk-norm; gemma-2b has one KV head, gemma-7b one per
head. Its activation is ``hidden_act``: the releases ship ``"gelu"``, which GemmaConfig reads as the
tanh approximation (``gelu_pytorch_tanh``, its default); the ``hidden_activation`` some releases also
hold is read by no transformers 5 Gemma class.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from pgconvert.io.limits import quote
from pgconvert.model.config import POSTNORM_OFF, ModelConfig
from pgconvert.families.llama import DECODER_TENSORS, ROPE_DEFAULT, ROPE_RULE, max_positions, rotary_base_field
from pgconvert.families.sliding_window import layer_types_window_rule
from pgconvert.families.table import DROP, DROPPED, GATE_UP, QKV, ConfigField, ConfigRule, Family
from pgconvert.families.table import TensorMapping, TensorTable
from pgconvert.semantics import attention_scale
from pgconvert.semantics.rope import rope_parameters

_L = "model.layers.{}."
_D = "decoder.layers.{}."

# Input norm, attention, post-attention norm, pre-FFN norm, MLP, post-FFN norm.
SANDWICH_ROWS = (
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
GEMMA_TENSORS = TensorTable(SANDWICH_ROWS)


def rope_theta_of(params: Mapping[str, object], key: str, present: Mapping[str, object], legacy: str,
           default: float) -> float:
    """``rope_theta`` of ``params`` (``key``), else the top-level ``legacy`` key (4.x), else ``default``
    (as transformers' ``setdefault`` fills it; a null is refused: its RoPE has no base for it)."""
    if "rope_theta" in params:
        value, named = params["rope_theta"], f"{key}.rope_theta"
    else:
        value, named = present.get(legacy, default), legacy
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 < value < float("inf"):
        raise ValueError(f"{named}={quote(value)}: expected a positive number (the RoPE base)")
    return float(value)


def _rope_type(params: Mapping[str, object], key: str, allowed: tuple[str, ...]) -> str:
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in allowed:
        raise ValueError(f"{key}.rope_type={quote(rope_type)}: pgconvert converts {' or '.join(allowed)} here")
    assert isinstance(rope_type, str)
    return rope_type


def rope_block(params: Mapping[str, object], name: str) -> Mapping[str, object]:
    value = params.get(name, {})
    if not isinstance(value, dict):
        raise ValueError(f"rope_parameters.{name}={quote(value)}: expected an object")
    return value


def rope_parameters_of(present: Mapping[str, object], key: str = "rope_parameters") -> Mapping[str, object]:
    params = present.get(key, {})
    if not isinstance(params, dict):
        raise ValueError(f"{key}={quote(params)}: expected an object")
    return params


def _read_gemma3_rope(present: Mapping[str, object], model: Mapping[str, object]) -> Mapping[str, object]:
    """Gemma 3's RoPE per layer type: ``full_attention`` (default base 1e6, plain or linear scaling:
    Megatron's rotary_base and rope scaling) and ``sliding_attention`` (base 1e4, plain: rotary_base_local).
    transformers' Gemma3TextConfig also reads 4.x's top-level ``rope_theta``, ``rope_local_base_freq``
    and ``rope_scaling`` (laid over ``full_attention``)."""
    params = rope_parameters_of(present)
    # Without rope_parameters, transformers starts from {"rope_type": "default"} per layer type, so a
    # 4.x rope_scaling spelling its type "type" stays plain.
    full = {**(rope_block(params, "full_attention") if "rope_parameters" in present else {"rope_type": "default"}),
            **rope_parameters_of(present, "rope_scaling")}
    local = rope_block(params, "sliding_attention")
    _rope_type(local, "rope_parameters.sliding_attention", ("default",))
    values: dict[str, object] = {
        "rotary_base": rope_theta_of(full, "rope_parameters.full_attention", present, "rope_theta", 1_000_000.0),
        "rotary_base_local": rope_theta_of(local, "rope_parameters.sliding_attention", present,
                                           "rope_local_base_freq", 10_000.0),
        "rope_scaling": None, "rope_scaling_factor": 1.0, "rotary_percent": 1.0,
    }
    if _rope_type(full, "rope_parameters.full_attention", ("default", "linear")) == "linear":
        factor = full.get("factor")
        if not isinstance(factor, (int, float)) or isinstance(factor, bool) or not 0 < factor < float("inf"):
            raise ValueError(f"rope_parameters.full_attention.factor={quote(factor)}: expected a positive number")
        values.update(rope_scaling="linear", rope_scaling_factor=float(factor))
    return values


def _write_gemma3_rope(config: ModelConfig) -> Mapping[str, object]:
    positions = config.positions
    full: dict[str, object] = {"rope_type": positions.rope_scaling or "default", "rope_theta": positions.rotary_base}
    if positions.rope_scaling is not None:
        full["factor"] = positions.rope_scaling_factor
    local = {"rope_type": "default", "rope_theta": positions.rotary_base_local}
    return {"rope_parameters": {"sliding_attention": local, "full_attention": full}}


def _refuses_gemma3_rope(config: ModelConfig) -> str | None:
    positions = config.positions
    if positions.rotary_base_local is None:
        return "rotary_base_local=None (needs the sliding layers' RoPE base)"
    if positions.rope_scaling not in (None, "linear"):
        return f"rope_scaling={positions.rope_scaling!r} (needs none or linear)"
    if positions.rotary_percent != 1.0:
        return f"rotary_percent={positions.rotary_percent} (needs 1.0)"
    return None


def _read_plain_rope(present: Mapping[str, object], model: Mapping[str, object]) -> Mapping[str, object]:
    """Gemma 2's one plain RoPE: ``rope_parameters`` (4.x: ``rope_scaling``, which transformers takes
    instead when it is given, and a top-level ``rope_theta``)."""
    params = rope_parameters(present)
    _rope_type(params, "rope_parameters", ("default",))
    return {"rotary_base": rope_theta_of(params, "rope_parameters", present, "rope_theta", 10_000.0),
            "rope_scaling": None, "rope_scaling_factor": 1.0, "rotary_percent": 1.0}


def _write_plain_rope(config: ModelConfig) -> Mapping[str, object]:
    return {"rope_parameters": {"rope_type": "default", "rope_theta": config.positions.rotary_base}}


def _refuses_scaled_rope(config: ModelConfig) -> str | None:
    positions = config.positions
    if positions.rope_scaling is not None or positions.rotary_percent != 1.0:
        return f"rope_scaling={positions.rope_scaling!r}, rotary_percent={positions.rotary_percent} (needs plain RoPE)"
    return None


def _read_scalar(present: Mapping[str, object], model: Mapping[str, object]) -> Mapping[str, object]:
    """Gemma's query_pre_attn_scalar (transformers' default 256): the softmax scale is its -1/2 power."""
    value = present.get("query_pre_attn_scalar", 256)
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"query_pre_attn_scalar={quote(value)}: expected a positive number")
    return {"softmax_scale": attention_scale.from_scalar(value)}


def _write_scalar(config: ModelConfig) -> Mapping[str, object]:
    # transformers types it int (its strict config refuses 256.0).
    return {"query_pre_attn_scalar": attention_scale.to_scalar(attention_scale.effective(config))}


def _softcap(key: str, default: float | None) -> ConfigField:
    """A soft-capping value (null: off, not transformers' default)."""
    return ConfigField((key,), key, float, default=default, nullable=True)


# Megatron-Bridge's Gemma providers: GeGLU (gated tanh-GELU), RMSNorm with zero-centred gamma, RoPE,
# no biases (Gemma 2/3 add sandwich norms; all scale the embeddings by sqrt(hidden)).
_GEMMA_DECODER: dict[str, object] = {
    "gated_linear_unit": True,
    "activation": "gelu_tanh",
    "normalization": "RMSNorm",
    "position_embedding_type": "rope",
    "num_experts": None,
    "add_qkv_bias": False,
    "add_bias_linear": False,
    "layernorm_zero_centered_gamma": True,
}
_GEMMA: dict[str, object] = {
    **_GEMMA_DECODER,
    "post_self_attn_layernorm": True,
    "post_mlp_layernorm": True,
    "pre_layernorms": True,
    "embedding_scale_sqrt_hidden": True,
}
_HF_GEMMA: dict[str, object] = {"hidden_activation": "gelu_pytorch_tanh", "attention_bias": False}
_SANDWICH_NOTE = "post_attention_layernorm, post_feedforward_layernorm tensors (always)"

GEMMA3 = Family(
    architecture="Gemma3ForCausalLM",
    model_type="gemma3_text",
    tensors=GEMMA_TENSORS,
    # transformers' class defaults, which save_pretrained leaves out of config.json.
    fields=(
        ConfigField(("hidden_size",), "hidden_size", int, default=2304),
        ConfigField(("num_hidden_layers",), "num_layers", int, default=26),
        ConfigField(("num_attention_heads",), "num_attention_heads", int, default=8),
        ConfigField(("num_key_value_heads",), "num_query_groups", int, default=4),
        ConfigField(("head_dim",), "kv_channels", int, default=256),
        ConfigField(("intermediate_size",), "ffn_hidden_size", int, default=9216),
        ConfigField(("rms_norm_eps",), "norm_epsilon", float, default=1e-6),
        max_positions(131_072),
        ConfigField(("vocab_size",), "vocab_size", int),
        ConfigField(("tie_word_embeddings",), "tie_embeddings", bool, default=True),
        ConfigField(("attention_dropout",), "attention_dropout", float, default=0.0),
        _softcap("final_logit_softcapping", None),
        _softcap("attn_logit_softcapping", None),
    ),
    # transformers' Gemma3TextConfig: every 6th layer full attention by default.
    rules=(ConfigRule(keys=("rope_parameters",),
                      model_fields=("rotary_base", "rotary_base_local", "rope_scaling", "rope_scaling_factor",
                                    "rotary_percent"),
                      read=_read_gemma3_rope, write=_write_gemma3_rope, refuses=_refuses_gemma3_rope,
                      null_keys=("rope_theta", "rope_local_base_freq"),
                      legacy_keys=("rope_theta", "rope_local_base_freq", "rope_scaling")),
           layer_types_window_rule(period=6, period_key="sliding_window_pattern"),
           ConfigRule(keys=("query_pre_attn_scalar",), model_fields=("softmax_scale",),
                      read=_read_scalar, write=_write_scalar)),
    fixed={**_GEMMA, "qk_layernorm": True},
    hf_fixed={**_HF_GEMMA, "use_bidirectional_attention": False},
    hf_norms_zero_centred=True,
    hf_notes={
        "activation": "hidden_activation = gelu_pytorch_tanh (fixed)", "qk-norm": "always",
        "attention softmax scale": "query_pre_attn_scalar (scale**-2)", "post-sublayer norms": _SANDWICH_NOTE,
        "embedding scale": "always", "logit soft-capping": "attn_logit_softcapping, final_logit_softcapping",
        "local rope theta": "rope_parameters.sliding_attention.rope_theta",
    },
)

GEMMA2 = GEMMA3.derive(
    "Gemma2ForCausalLM", "gemma2",
    # Soft-capping on by default.
    fields=(max_positions(8192), _softcap("final_logit_softcapping", 30.0), _softcap("attn_logit_softcapping", 50.0)),
    # transformers' Gemma2Config: sliding and full attention alternate, sliding first; one RoPE base.
    rules=(ConfigRule(keys=("rope_parameters",),
                      model_fields=("rotary_base", "rope_scaling", "rope_scaling_factor", "rotary_percent"),
                      read=_read_plain_rope, write=_write_plain_rope, refuses=_refuses_scaled_rope,
                      null_keys=("rope_theta",), legacy_keys=("rope_theta", "rope_scaling")),
           layer_types_window_rule(period=2)),
    fixed={"qk_layernorm": False, "rotary_base_local": None},
    hf_fixed={"use_bidirectional_attention": None},
    hf_notes={"qk-norm": DROP, "local rope theta": DROP,
              "logit soft-capping": "attn_logit_softcapping, final_logit_softcapping (null: off)"},
)


# GemmaConfig's hidden_act: its default, and the releases' "gelu" (GemmaConfig.__post_init__ reads it as
# the tanh approximation, which those models were trained with).
_GEMMA_ACTIVATIONS = ("gelu_pytorch_tanh", "gelu")


def _read_gemma_activation(present: Mapping[str, object], model: Mapping[str, object]) -> Mapping[str, object]:
    """``hidden_act`` (absent: the tanh GELU); another activation is refused, and a null (GemmaMLP
    builds no activation from it)."""
    value = present.get("hidden_act", _GEMMA_ACTIVATIONS[0])
    if value not in _GEMMA_ACTIVATIONS:
        raise ValueError(f"hidden_act={quote(value)}: Gemma is converted with gelu_pytorch_tanh "
                         "(or 'gelu', which GemmaConfig reads as gelu_pytorch_tanh)")
    return {}


def _write_gemma_activation(config: ModelConfig) -> Mapping[str, object]:
    return {"hidden_act": _GEMMA_ACTIVATIONS[0]}


GEMMA = Family(
    architecture="GemmaForCausalLM",
    model_type="gemma",
    # Llama's layer: HF's post_attention_layernorm is the pre-MLP norm.
    tensors=DECODER_TENSORS,
    # GemmaConfig's class defaults (gemma-7b's), which save_pretrained leaves out of config.json.
    fields=(
        ConfigField(("hidden_size",), "hidden_size", int, default=3072),
        ConfigField(("num_hidden_layers",), "num_layers", int, default=28),
        ConfigField(("num_attention_heads",), "num_attention_heads", int, default=16),
        ConfigField(("num_key_value_heads",), "num_query_groups", int, default=16),
        ConfigField(("head_dim",), "kv_channels", int, default=256),
        ConfigField(("intermediate_size",), "ffn_hidden_size", int, default=24576),
        ConfigField(("rms_norm_eps",), "norm_epsilon", float, default=1e-6),
        rotary_base_field(10_000.0),
        max_positions(8192),
        ConfigField(("vocab_size",), "vocab_size", int, default=256000),
        ConfigField(("tie_word_embeddings",), "tie_embeddings", bool, default=True),
        ConfigField(("attention_dropout",), "attention_dropout", float, default=0.0),
    ),
    rules=(ROPE_RULE,
           ConfigRule(keys=("hidden_act",), model_fields=(), read=_read_gemma_activation,
                      write=_write_gemma_activation, null_keys=("hidden_act",))),
    fixed={**POSTNORM_OFF, **_GEMMA_DECODER, "embedding_scale_sqrt_hidden": True, "multi_latent_attention": False,
           "qk_layernorm": False, "sliding_window": None},
    # attention_bias biases q, k, v and o but not the MLP: Megatron's add_bias_linear biases both.
    hf_fixed={"attention_bias": False, "use_bidirectional_attention": None},
    hf_scratch=ROPE_DEFAULT,
    hf_norms_zero_centred=True,
    hf_notes={"activation": "hidden_act = gelu_pytorch_tanh ('gelu' read as it, as GemmaConfig does)",
              "embedding scale": "always", "sliding window": "none", "linear biases": "none (attention_bias false)"},
)
