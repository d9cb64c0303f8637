"""Granite (``GraniteForCausalLM``): Llama with Granite 3's muP multipliers; Granite MoE (``GraniteMoeForCausalLM``,
granite-3.x-1b-a400m / 3b-a800m): the same with every MLP a mixture of experts.

* ``attention_multiplier`` is the softmax scale itself (``ModelConfig.attention.softmax_scale``,
  megatron-core's ``TransformerConfig.softmax_scale``: ``pgconvert.semantics.attention_scale``);
* ``embedding_multiplier``, ``residual_multiplier`` and ``logits_scaling``: transformers'
  GraniteModel multiplies the embeddings and each sublayer's output, and GraniteForCausalLM divides
  the logits; megatron-core has none of the three and Megatron-Bridge no Granite bridge, so they
  are carried in Megatron args under transformers' GraniteConfig names
  (``pgconvert.semantics.carried``), and every Megatron output names them in a notice.

Granite MoE stores a layer's experts stacked: ``block_sparse_moe.input_linear`` ``[E, 2·I, hidden]`` (each expert's
``[gate; up]``, megatron-core's ``linear_fc1`` as it is) and ``output_linear`` ``[E, hidden, I]``; its router
(``router.layer``) takes the top-k logits and a softmax over them (megatron-core's softmax router without
pre-softmax); ``intermediate_size`` is the experts' FFN.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Mapping
from pathlib import Path

from pgconvert.io.limits import quote
from pgconvert.model.config import ModelConfig
from pgconvert.families.experts import AUX_LOSS, EVERY_LAYER_MOE, ROUTED_EXPERTS_ONLY, expert_count, expert_ffn_size
from pgconvert.families.llama import (
    ATTENTION_ROWS,
    EMBEDDING_ROWS,
    FINAL_ROWS,
    HEAD_DIM_NULL,
    HF_SILU,
    LLAMA,
    ROPE_DEFAULT,
    ROPE_RULE,
    decoder_fields,
    head_dim_field,
)
from pgconvert.families.table import IDENTITY, ConfigField, ConfigRule, Family, TensorMapping, TensorTable
from pgconvert.semantics import attention_scale
from pgconvert.semantics.arg_values import positive
from pgconvert.semantics.carried import CarriedSetting


def _read_attention_multiplier(present: Mapping[str, object], model: Mapping[str, object]) -> Mapping[str, object]:
    """Granite's attention_multiplier is the softmax scale itself (transformers' default 1.0; a null, which
    GraniteMoeConfig keeps, scales by None: refused)."""
    value = present.get("attention_multiplier", 1.0)
    if value is None:
        raise ValueError(f"attention_multiplier=null: {_NULL_MULTIPLIER}")
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"attention_multiplier={quote(value)}: expected a positive number")
    return {"softmax_scale": float(value)}


def _write_attention_multiplier(config: ModelConfig) -> Mapping[str, object]:
    return {"attention_multiplier": attention_scale.effective(config)}


def _positive_number(args: argparse.Namespace, name: str, default: object, path: Path) -> object:
    assert isinstance(default, float)
    return positive(args, name, default, path)


_MULTIPLIERS = ("embedding_multiplier", "residual_multiplier", "logits_scaling")
# GraniteConfig and GraniteMoeConfig have no head_dim, which their attention takes as given.
_GRANITE_HEAD_DIM = head_dim_field(null_refused=HEAD_DIM_NULL)
# GraniteMoeConfig keeps a null multiplier, which its model multiplies by as given.
_NULL_MULTIPLIER = "transformers' Granite models multiply by it as given, and null is no number"
_MULTIPLIER_FIELDS = tuple(ConfigField((name,), name, float, default=1.0, null_refused=_NULL_MULTIPLIER)
                           for name in _MULTIPLIERS)
_ATTENTION_MULTIPLIER = ConfigRule(keys=("attention_multiplier",), model_fields=("softmax_scale",),
                                   read=_read_attention_multiplier, write=_write_attention_multiplier,
                                   null_keys=("attention_multiplier",))
_CARRIED = tuple(CarriedSetting(name, 1.0, _positive_number) for name in _MULTIPLIERS)
_NOTES = {"attention softmax scale": "attention_multiplier",
          "embedding, residual multipliers and logits scaling": ", ".join(_MULTIPLIERS)}

GRANITE = LLAMA.derive(
    "GraniteForCausalLM", "granite",
    fields=(_GRANITE_HEAD_DIM, *_MULTIPLIER_FIELDS),
    rules=(_ATTENTION_MULTIPLIER,),
    megatron_carried=_CARRIED,
    hf_notes=_NOTES,
)

_MOE = "model.layers.{}.block_sparse_moe."
_EXPERT = "decoder.layers.{}.mlp.experts.local_experts.{}."
GRANITE_MOE_TENSORS = TensorTable((
    *EMBEDDING_ROWS,
    *ATTENTION_ROWS,
    TensorMapping("decoder.layers.{}.mlp.router.weight", (_MOE + "router.layer.weight",)),
    TensorMapping(_EXPERT + "linear_fc1.weight", (_MOE + "input_linear.weight",), IDENTITY, stacked=True),
    TensorMapping(_EXPERT + "linear_fc2.weight", (_MOE + "output_linear.weight",), IDENTITY, stacked=True),
    *FINAL_ROWS,
))

# Built from the pieces, as Mixtral is: Granite's dense FFN field would read intermediate_size twice.
GRANITE_MOE = Family(
    architecture="GraniteMoeForCausalLM",
    model_type="granitemoe",
    tensors=GRANITE_MOE_TENSORS,
    fields=(
        *decoder_fields(max_position_embeddings=2048, head_dim=_GRANITE_HEAD_DIM),
        *_MULTIPLIER_FIELDS,
        ConfigField(("intermediate_size",), "moe_ffn_hidden_size", int, default=11008, written=expert_ffn_size),
        expert_count("num_local_experts", 8),
        ConfigField(("num_experts_per_tok",), "moe_router_topk", int, default=2,
                    null_refused="transformers' router takes the top-k as given, and null is no count"),
        AUX_LOSS,
    ),
    rules=(EVERY_LAYER_MOE, ROPE_RULE, _ATTENTION_MULTIPLIER),
    fixed={**ROUTED_EXPERTS_ONLY, "moe_router_score_function": "softmax", "moe_router_pre_softmax": False,
           "qk_layernorm": False, "add_qkv_bias": False, "add_bias_linear": False, "sliding_window": None},
    # attention_bias biases q, k, v and o: Megatron has no o-bias without the experts'.
    hf_fixed={**HF_SILU, "attention_bias": False},
    hf_scratch=ROPE_DEFAULT,
    megatron_carried=_CARRIED,
    hf_notes={**_NOTES, "moe pre-softmax": "none (a softmax over the top-k logits)"},
)
