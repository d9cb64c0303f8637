"""ERNIE 4.5 (``Ernie4_5ForCausalLM``, baidu/ERNIE-4.5-0.3B): Llama with GLM's interleaved rotary and one bias switch.

transformers' Ernie4_5 rotates each q/k head's pairs of neighbouring channels (its ``rotate_half`` takes the
even and odd channels, its cos/sin are repeated pairwise): megatron-core's ``rotary_interleaved`` over the
whole head, HF's own order (``Family.hf_rotary_interleaved``: rows kept as they are, as for GLM-4). Its
``use_bias`` biases every linear layer, q/k/v, o and the MLP alike: megatron-core's ``add_bias_linear``
(which biases q, k and v too) with ``add_qkv_bias``. Ernie4_5Config's defaults are the 0.3B release's: 2 KV
heads, head_dim 128, RoPE base 500000, 131072 positions, tied embeddings.
"""

from __future__ import annotations

from collections.abc import Mapping

from pgconvert.families.llama import (
    LLAMA,
    ROPE_DEFAULT,
    head_dim_field,
    max_positions,
    query_groups_field,
    rotary_base_field,
)
from pgconvert.families.table import ConfigField, ConfigRule
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
