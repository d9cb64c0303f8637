"""Llama (``LlamaForCausalLM``), and the decoder pieces the families descended from it share.

transformers' Llama names the tensors every Llama-style decoder here uses (embedding, q/k/v/o
projections, gate/up/down MLP, RMSNorms) and its config.json the keys they share (sizes, RoPE,
dropout); which rows a model uses follows from its ``ModelConfig`` (biases, qk-norm, tied output,
which layers are MoE) through ``canonical_names``. The RoPE rule here reads every family's
``rope_parameters`` (4.x: ``rope_scaling``): plain, linear, llama3 and YaRN.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from pgconvert.io.limits import quote
from pgconvert.model.config import POSTNORM_OFF, ModelConfig
from pgconvert.families.table import DROPPED, GATE_UP, QKV, ConfigField, ConfigRule, Family, TensorMapping, TensorTable
from pgconvert.semantics import yarn
from pgconvert.semantics.rope import MEGATRON_LLAMA3, rope_parameters, rope_type_of

EMBEDDING_ROWS = (
    TensorMapping("embedding.word_embeddings.weight", ("model.embed_tokens.weight",)),
)
ATTENTION_ROWS = (
    TensorMapping("decoder.layers.{}.input_layernorm.weight", ("model.layers.{}.input_layernorm.weight",)),
    TensorMapping("decoder.layers.{}.self_attention.linear_qkv.weight", (
        "model.layers.{}.self_attn.q_proj.weight",
        "model.layers.{}.self_attn.k_proj.weight",
        "model.layers.{}.self_attn.v_proj.weight",
    ), QKV),
    TensorMapping("decoder.layers.{}.self_attention.linear_qkv.bias", (
        "model.layers.{}.self_attn.q_proj.bias",
        "model.layers.{}.self_attn.k_proj.bias",
        "model.layers.{}.self_attn.v_proj.bias",
    ), QKV),
    TensorMapping("decoder.layers.{}.self_attention.q_layernorm.weight", ("model.layers.{}.self_attn.q_norm.weight",)),
    TensorMapping("decoder.layers.{}.self_attention.k_layernorm.weight", ("model.layers.{}.self_attn.k_norm.weight",)),
    TensorMapping("decoder.layers.{}.self_attention.linear_proj.weight", ("model.layers.{}.self_attn.o_proj.weight",)),
    TensorMapping("decoder.layers.{}.self_attention.linear_proj.bias", ("model.layers.{}.self_attn.o_proj.bias",)),
    # Dense and MoE layers alike: megatron-core's pre-MLP norm is HF's post-attention norm.
    TensorMapping("decoder.layers.{}.pre_mlp_layernorm.weight",
                  ("model.layers.{}.post_attention_layernorm.weight",)),
)
DENSE_MLP_ROWS = (
    TensorMapping("decoder.layers.{}.mlp.linear_fc1.weight", (
        "model.layers.{}.mlp.gate_proj.weight",
        "model.layers.{}.mlp.up_proj.weight",
    ), GATE_UP),
    TensorMapping("decoder.layers.{}.mlp.linear_fc1.bias", (
        "model.layers.{}.mlp.gate_proj.bias",
        "model.layers.{}.mlp.up_proj.bias",
    ), GATE_UP),
    TensorMapping("decoder.layers.{}.mlp.linear_fc2.weight", ("model.layers.{}.mlp.down_proj.weight",)),
    TensorMapping("decoder.layers.{}.mlp.linear_fc2.bias", ("model.layers.{}.mlp.down_proj.bias",)),
)
FINAL_ROWS = (
    TensorMapping("decoder.final_layernorm.weight", ("model.norm.weight",)),
    TensorMapping("output_layer.weight", ("lm_head.weight",)),
    # Rotary frequencies are recomputed from the config; old transformers versions saved them.
    TensorMapping(None, ("model.layers.{}.self_attn.rotary_emb.inv_freq",), DROPPED),
    TensorMapping(None, ("model.rotary_emb.inv_freq",), DROPPED),
)
DECODER_TENSORS = TensorTable((*EMBEDDING_ROWS, *ATTENTION_ROWS, *DENSE_MLP_ROWS, *FINAL_ROWS))


# Why transformers builds nothing from a null: its RoPE takes the base as given, and the attention of
# a family whose config class has no head_dim takes getattr(config, "head_dim", hidden // heads).
ROPE_BASE_NULL = "transformers computes the RoPE frequencies from rope_theta as given, and null is no base"
HEAD_DIM_NULL = "transformers' attention takes head_dim as given (getattr(config, 'head_dim', ...)), and null is no size"


def query_groups_field(default: int | None = None, null_refused: str | None = None) -> ConfigField:
    """``num_key_value_heads`` (transformers' class ``default`` where absent; a null is one group per
    head, as the config classes' ``__post_init__`` fill it, unless ``null_refused``)."""
    return ConfigField(("num_key_value_heads",), "num_query_groups", int, default=default,
                       nullable=null_refused is None, null_refused=null_refused)


def head_dim_field(default: int | None = None, *, nullable: bool = False,
                   null_refused: str | None = None) -> ConfigField:
    """``head_dim`` (transformers' class ``default`` where absent; None: hidden_size // heads)."""
    return ConfigField(("head_dim",), "kv_channels", int, default=default, nullable=nullable,
                       null_refused=null_refused)


def rotary_base_field(default: float) -> ConfigField:
    """The RoPE base: transformers 5 keeps it under ``rope_parameters``, 4.x as a top-level ``rope_theta``;
    absent, the config class's ``default_theta``."""
    return ConfigField(("rope_parameters", "rope_theta"), "rotary_base", float, default=default,
                       legacy=(("rope_theta",),), null_refused=ROPE_BASE_NULL)


def decoder_fields(max_position_embeddings: int, norm_epsilon: float = 1e-6, rotary_base: float = 10000.0,
                   query_groups: ConfigField | None = None,
                   head_dim: ConfigField | None = None, tie_embeddings: bool = False) -> tuple[ConfigField, ...]:
    """The config.json fields of a Llama-style decoder but its FFN size; defaults are transformers'
    class defaults (``query_groups`` and ``head_dim``: Llama's unless given)."""
    return (
        ConfigField(("hidden_size",), "hidden_size", int),
        ConfigField(("num_hidden_layers",), "num_layers", int),
        ConfigField(("num_attention_heads",), "num_attention_heads", int),
        query_groups or query_groups_field(),
        head_dim or head_dim_field(),
        ConfigField(("rms_norm_eps",), "norm_epsilon", float, default=norm_epsilon),
        rotary_base_field(rotary_base),
        ConfigField(("max_position_embeddings",), "max_position_embeddings", int,
                    default=max_position_embeddings),
        ConfigField(("vocab_size",), "vocab_size", int),
        ConfigField(("tie_word_embeddings",), "tie_embeddings", bool, default=tie_embeddings),
        ConfigField(("attention_dropout",), "attention_dropout", float, default=0.0),
    )


def max_positions(default: int) -> ConfigField:
    """The ``max_position_embeddings`` field with another class default (for ``Family.derive``)."""
    return ConfigField(("max_position_embeddings",), "max_position_embeddings", int, default=default)


DENSE_FFN = ConfigField(("intermediate_size",), "ffn_hidden_size", int)


# --- RoPE: rope_parameters (4.x: rope_scaling) --------------------------------------------------

def _unit_number(value: object, key: str, low_open: bool = True) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 < value <= (1 if low_open else math.inf):
        raise ValueError(f"{key}={quote(value)}: expected a number in {'(0, 1]' if low_open else '(0, inf)'}")
    return float(value)


def read_rope(present: Mapping[str, object], model: Mapping[str, object]) -> Mapping[str, object]:
    """RoPE scaling and partial rotary from ``rope_parameters`` (4.x: ``rope_scaling``); a type
    Megatron cannot compute reads as plain RoPE (``semantics.rope.hf_unrepresentable`` names it)."""
    params = rope_parameters(present)
    partial = params.get("partial_rotary_factor", present.get("partial_rotary_factor"))
    rotary_percent = 1.0 if partial is None else _unit_number(partial, "partial_rotary_factor")
    rope_type = rope_type_of(params)
    if rope_type == "yarn":
        return {**yarn.YARN_DEFAULTS, **yarn.read_hf(params, model), "rotary_percent": rotary_percent}
    if rope_type in ("llama3", "linear"):
        factor = _unit_number(params.get("factor"), "rope_parameters.factor", low_open=False)
        return {**yarn.YARN_DEFAULTS, "rope_scaling": rope_type, "rope_scaling_factor": factor,
                "rotary_percent": rotary_percent}
    return {**yarn.YARN_DEFAULTS, "rope_scaling": None, "rope_scaling_factor": 1.0, "rotary_percent": rotary_percent}


def write_rope(config: ModelConfig) -> Mapping[str, object]:
    positions = config.positions
    params: dict[str, object] = {"rope_type": positions.rope_scaling or "default", "rope_theta": positions.rotary_base}
    if positions.rope_scaling is not None:
        params["factor"] = positions.rope_scaling_factor
    if positions.rope_scaling == "llama3":
        params.update(MEGATRON_LLAMA3)
    if positions.rope_scaling == "yarn":
        params.update(yarn.write_hf(config))
    # transformers 4.x reads the scaling from rope_scaling (5 prefers it too, so the two agree).
    legacy = {key: value for key, value in params.items() if key != "rope_theta"} if positions.rope_scaling else None
    # Partial rotary is not written: a family that computes it writes it (its hf_computes says so).
    return {"rope_parameters": params, "rope_scaling": legacy, "partial_rotary_factor": None}


def write_partial_rope(config: ModelConfig) -> Mapping[str, object]:
    """As ``write_rope``, with the partial rotary in ``rope_parameters`` (for the families that compute it)."""
    written = dict(write_rope(config))
    params = dict(written["rope_parameters"])  # type: ignore[call-overload]
    params["partial_rotary_factor"] = config.positions.rotary_percent
    written["rope_parameters"] = params
    return written


def read_whole_head_rope(present: Mapping[str, object], model: Mapping[str, object]) -> Mapping[str, object]:
    """``read_rope`` for a family whose attention rotates the whole head (transformers' default rotary over
    head_dim, whatever ``partial_rotary_factor`` says): a factor in config.json is not the model's, and is not read
    (as ``write_rope`` writes none). The other RoPE types size their frequencies by it, which such an attention
    cannot run (transformers fails): refused."""
    params = rope_parameters(present)
    partial = params.get("partial_rotary_factor", present.get("partial_rotary_factor"))
    if partial is not None and partial != 1 and rope_type_of(params) != "default":
        raise ValueError(f"partial_rotary_factor={quote(partial)} with rope_type {quote(rope_type_of(params))}: that "
                         "type sizes its frequencies by the factor, and this family's attention rotates the whole head "
                         "(transformers cannot run it)")
    return read_rope({"rope_parameters": {key: value for key, value in params.items()
                                          if key != "partial_rotary_factor"}}, model)


# The families whose attention rotates the whole head; those that compute a partial rotary read it with
# ``read_rope`` (``partial_rope_rule``, GPT-NeoX's, Phi-3's).
ROPE_RULE = ConfigRule(keys=("rope_parameters", "rope_scaling", "partial_rotary_factor"),
                       model_fields=("rope_scaling", "rope_scaling_factor", "rotary_percent", *yarn.YARN_FIELDS),
                       read=read_whole_head_rope, write=write_rope)


def partial_rope_rule(default: float, family: str, top_level_null_refused: str | None = None) -> ConfigRule:
    """As ``ROPE_RULE``, for a config class whose absent ``partial_rotary_factor`` is ``default`` (its
    ``kwargs.setdefault``: GLM-4's, Qwen3-Next's), written in ``rope_parameters``: a top-level null is left
    unset there, so the whole head rotates (refused, saying why, where ``top_level_null_refused``: the family's
    attention needs it there), and a null in ``rope_parameters`` is refused (the family's rotary multiplies
    head_dim by it as given)."""

    def read(present: Mapping[str, object], model: Mapping[str, object]) -> Mapping[str, object]:
        params = rope_parameters(present)
        if "partial_rotary_factor" in params and params["partial_rotary_factor"] is None:
            raise ValueError(f"rope_parameters.partial_rotary_factor=null: {family}'s rotary embedding multiplies "
                             "head_dim by it as given, and null is no fraction")
        if (top_level_null_refused is not None and "partial_rotary_factor" not in params
                and "partial_rotary_factor" in present and present["partial_rotary_factor"] is None):
            raise ValueError(f"partial_rotary_factor=null: {top_level_null_refused}")
        if "partial_rotary_factor" not in params and "partial_rotary_factor" not in present:
            present = {**present, "partial_rotary_factor": default}
        return read_rope(present, model)

    return ConfigRule(keys=ROPE_RULE.keys, model_fields=ROPE_RULE.model_fields, read=read, write=write_partial_rope,
                      null_keys=("partial_rotary_factor",))


# --- what the Llama-style families are in Megatron terms -----------------------------------------

# SwiGLU MLP, RMSNorm, RoPE, norms before the sublayers only (nothing Gemma-specific) and plain
# attention (a multi-latent attention model is written as DeepSeek: pgconvert.families.deepseek).
SWIGLU_RMS_ROPE: dict[str, object] = {
    **POSTNORM_OFF,
    "gated_linear_unit": True,
    "activation": "silu",
    "normalization": "RMSNorm",
    "position_embedding_type": "rope",
    "multi_latent_attention": False,
}
DENSE: dict[str, object] = {**SWIGLU_RMS_ROPE, "num_experts": None}
HF_SILU: dict[str, object] = {"hidden_act": "silu"}
ROPE_DEFAULT: dict[str, object] = {"rope_parameters": {"rope_type": "default"}}

LLAMA = Family(
    architecture="LlamaForCausalLM",
    model_type="llama",
    tensors=DECODER_TENSORS,
    fields=(
        *decoder_fields(max_position_embeddings=2048),
        DENSE_FFN,
        # Llama's attention_bias covers q, k, v and o; mlp_bias covers gate, up and down. Megatron
        # has one switch for all linears, so a model is representable only when the two agree.
        ConfigField(("attention_bias",), "add_bias_linear", bool, default=False),
        ConfigField(("mlp_bias",), "add_bias_linear", bool, default=False),
    ),
    rules=(ROPE_RULE,),
    # A windowed model is written as Mistral.
    fixed={**DENSE, "qk_layernorm": False, "add_qkv_bias": False, "sliding_window": None},
    hf_fixed=HF_SILU,
    hf_scratch=ROPE_DEFAULT,
    hf_notes={"sliding window": "none (a windowed model is written as Mistral)",
              "linear biases": "attention_bias, mlp_bias"},
)
