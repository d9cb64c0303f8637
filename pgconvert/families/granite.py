"""Granite (``GraniteForCausalLM``): Llama with Granite 3's muP multipliers.

* ``attention_multiplier`` is the softmax scale itself (``ModelConfig.attention.softmax_scale``,
  megatron-core's ``TransformerConfig.softmax_scale``: ``pgconvert.semantics.attention_scale``);
* ``embedding_multiplier``, ``residual_multiplier`` and ``logits_scaling``: transformers'
  GraniteModel multiplies the embeddings and each sublayer's output, and GraniteForCausalLM divides
  the logits; megatron-core has none of the three and Megatron-Bridge no Granite bridge, so they
  are carried in Megatron args under transformers' GraniteConfig names
  (``pgconvert.semantics.carried``), and every Megatron output names them in a notice.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Mapping
from pathlib import Path

from pgconvert.io.limits import quote
from pgconvert.model.config import ModelConfig
from pgconvert.families.llama import HEAD_DIM_NULL, LLAMA, head_dim_field
from pgconvert.families.table import ConfigField, ConfigRule
from pgconvert.semantics import attention_scale
from pgconvert.semantics.arg_values import positive
from pgconvert.semantics.carried import CarriedSetting


def _read_attention_multiplier(present: Mapping[str, object], model: Mapping[str, object]) -> Mapping[str, object]:
    """Granite's attention_multiplier is the softmax scale itself (transformers' default 1.0)."""
    value = present.get("attention_multiplier", 1.0)
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"attention_multiplier={quote(value)}: expected a positive number")
    return {"softmax_scale": float(value)}


def _write_attention_multiplier(config: ModelConfig) -> Mapping[str, object]:
    return {"attention_multiplier": attention_scale.effective(config)}


def _positive_number(args: argparse.Namespace, name: str, default: object, path: Path) -> object:
    assert isinstance(default, float)
    return positive(args, name, default, path)


_MULTIPLIERS = ("embedding_multiplier", "residual_multiplier", "logits_scaling")

GRANITE = LLAMA.derive(
    "GraniteForCausalLM", "granite",
    # GraniteConfig has no head_dim, which its attention takes as given.
    fields=(head_dim_field(null_refused=HEAD_DIM_NULL),
            *(ConfigField((name,), name, float, default=1.0) for name in _MULTIPLIERS)),
    rules=(ConfigRule(keys=("attention_multiplier",), model_fields=("softmax_scale",),
                      read=_read_attention_multiplier, write=_write_attention_multiplier),),
    megatron_carried=tuple(CarriedSetting(name, 1.0, _positive_number) for name in _MULTIPLIERS),
    hf_notes={"attention softmax scale": "attention_multiplier",
              "embedding, residual multipliers and logits scaling": ", ".join(_MULTIPLIERS)},
)
