"""StarCoder2 (``Starcoder2ForCausalLM``, bigcode/starcoder2-3b, -7b, -15b): a GPT-style decoder with RoPE.

transformers' Starcoder2 normalizes with ``nn.LayerNorm`` (weight and bias; ``norm_epsilon``), runs a non-gated
MLP ``c_fc`` -> ``gelu_pytorch_tanh`` -> ``c_proj`` (megatron-core's plain ``linear_fc1`` / ``linear_fc2`` with the tanh
GELU, pgconvert's ``gelu_tanh``), biases every linear layer but the output by ``use_bias`` (megatron-core's
``add_bias_linear``), attends with GQA and RoPE over the whole head, and windows every layer by
``sliding_window`` (the releases: 4096; the class: none). Its ``residual_dropout`` (attention and MLP outputs)
and ``embedding_dropout`` are megatron-core's ``hidden_dropout``, which drops out both: they must agree.
"""

from __future__ import annotations

from collections.abc import Mapping

from pgconvert.families.llama import (
    ATTENTION_ROWS,
    EMBEDDING_ROWS,
    ROPE_DEFAULT,
    ROPE_RULE,
    head_dim_field,
    query_groups_field,
    rotary_base_field,
)
from pgconvert.families.sliding_window import EVERY_LAYER_WINDOW
from pgconvert.families.table import DROPPED, ConfigField, ConfigRule, Family, TensorMapping, TensorTable
from pgconvert.io.limits import quote
from pgconvert.model.config import POSTNORM_OFF, ModelConfig

_L = "model.layers.{}."
_D = "decoder.layers.{}."
# Llama's attention rows (q/k/v and o with their biases, both norms' weights) and the LayerNorms' biases.
STARCODER2_TENSORS = TensorTable((
    *EMBEDDING_ROWS,
    *ATTENTION_ROWS,
    TensorMapping(_D + "input_layernorm.bias", (_L + "input_layernorm.bias",)),
    TensorMapping(_D + "pre_mlp_layernorm.bias", (_L + "post_attention_layernorm.bias",)),
    TensorMapping(_D + "mlp.linear_fc1.weight", (_L + "mlp.c_fc.weight",)),
    TensorMapping(_D + "mlp.linear_fc1.bias", (_L + "mlp.c_fc.bias",)),
    TensorMapping(_D + "mlp.linear_fc2.weight", (_L + "mlp.c_proj.weight",)),
    TensorMapping(_D + "mlp.linear_fc2.bias", (_L + "mlp.c_proj.bias",)),
    TensorMapping("decoder.final_layernorm.weight", ("model.norm.weight",)),
    TensorMapping("decoder.final_layernorm.bias", ("model.norm.bias",)),
    TensorMapping("output_layer.weight", ("lm_head.weight",)),
    TensorMapping(None, ("model.rotary_emb.inv_freq",), DROPPED),
))

_DROPOUTS = ("residual_dropout", "embedding_dropout")


def _read_dropout(present: Mapping[str, object], model: Mapping[str, object]) -> Mapping[str, object]:
    """``residual_dropout`` and ``embedding_dropout`` (Starcoder2Config's 0.0 where absent): one
    ``hidden_dropout`` in megatron-core, applied to the embeddings and both sublayers' outputs alike."""
    values = {}
    for key in _DROPOUTS:
        value = present.get(key, 0.0)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 <= value <= 1:
            raise ValueError(f"{key}={quote(value)}: expected a probability")
        values[key] = float(value)
    if values["residual_dropout"] != values["embedding_dropout"]:
        raise ValueError(f"residual_dropout={values['residual_dropout']}, embedding_dropout="
                         f"{values['embedding_dropout']}: megatron-core's hidden_dropout drops out the embeddings and "
                         "the sublayers' outputs by one probability (training only); set them equal to convert")
    return {"hidden_dropout": values["residual_dropout"]}


def _write_dropout(config: ModelConfig) -> Mapping[str, object]:
    return {key: config.setting("hidden_dropout") for key in _DROPOUTS}


STARCODER2 = Family(
    architecture="Starcoder2ForCausalLM",
    model_type="starcoder2",
    tensors=STARCODER2_TENSORS,
    fields=(
        ConfigField(("hidden_size",), "hidden_size", int),
        ConfigField(("num_hidden_layers",), "num_layers", int),
        ConfigField(("num_attention_heads",), "num_attention_heads", int),
        query_groups_field(2),
        # Starcoder2Config has no head_dim: getattr(config, "head_dim", None) or hidden // heads.
        head_dim_field(nullable=True),
        ConfigField(("norm_epsilon",), "norm_epsilon", float, default=1e-5),
        rotary_base_field(10000.0),
        ConfigField(("max_position_embeddings",), "max_position_embeddings", int, default=4096),
        ConfigField(("vocab_size",), "vocab_size", int),
        ConfigField(("tie_word_embeddings",), "tie_embeddings", bool, default=True),
        ConfigField(("attention_dropout",), "attention_dropout", float, default=0.0),
        ConfigField(("intermediate_size",), "ffn_hidden_size", int),
        ConfigField(("use_bias",), "add_bias_linear", bool, default=True),
    ),
    rules=(ROPE_RULE, EVERY_LAYER_WINDOW,
           ConfigRule(keys=_DROPOUTS, model_fields=("hidden_dropout",), read=_read_dropout, write=_write_dropout)),
    fixed={**POSTNORM_OFF, "gated_linear_unit": False, "activation": "gelu_tanh", "normalization": "LayerNorm",
           "position_embedding_type": "rope", "multi_latent_attention": False, "num_experts": None,
           "qk_layernorm": False, "add_qkv_bias": False},
    hf_fixed={"hidden_act": "gelu_pytorch_tanh"},
    hf_scratch=ROPE_DEFAULT,
    hf_notes={"normalization": "LayerNorm (fixed; norm_epsilon)", "activation": "gelu_pytorch_tanh, not gated (fixed)",
              "linear biases": "use_bias (every linear layer)", "sliding window": "sliding_window (every layer)",
              "dropout": "attention_dropout; residual_dropout = embedding_dropout (hidden_dropout)"},
)
