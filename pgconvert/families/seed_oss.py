"""Seed-OSS (``SeedOssForCausalLM``, ByteDance-Seed/Seed-OSS-36B): Llama with three bias switches.

transformers' SeedOssConfig biases q, k and v by ``attention_bias``, o by ``attention_out_bias`` and
gate, up and down by ``mlp_bias``. megatron-core has two switches: ``add_qkv_bias`` (q, k, v) and
``add_bias_linear`` (every linear layer, q, k and v included), so ``attention_out_bias`` and
``mlp_bias`` must agree, and with them on ``attention_bias`` must be on too.

The release biases q, k and v only (as Qwen2 does), has head_dim 128 with 5120 hidden and 80 heads
(8 KV heads), RoPE base 1e7, untied embeddings, and dropout 0.1 on the attention probabilities
and on each sublayer's output before its residual add (``residual_dropout``). The latter is
megatron-core's ``hidden_dropout``, which megatron-core also applies to the embeddings
(``LanguageModelEmbedding.embedding_dropout``); both are training only.
"""

from __future__ import annotations

from collections.abc import Mapping

from pgconvert.io.limits import quote
from pgconvert.model.config import ModelConfig
from pgconvert.families.llama import LLAMA, max_positions
from pgconvert.families.table import ConfigField, ConfigRule

# SeedOssConfig's defaults (the release's values).
_BIAS_DEFAULTS = {"attention_bias": True, "attention_out_bias": False, "mlp_bias": False}


def _flag(present: Mapping[str, object], key: str) -> bool:
    value = present.get(key, _BIAS_DEFAULTS[key])
    if not isinstance(value, bool):
        raise ValueError(f"{key}={quote(value)}: expected true or false")
    return value


def _read_biases(present: Mapping[str, object], model: Mapping[str, object]) -> Mapping[str, object]:
    """``attention_bias`` is megatron-core's add_qkv_bias; ``attention_out_bias`` and ``mlp_bias``
    together its add_bias_linear, which biases q, k and v as well."""
    qkv, out, mlp = (_flag(present, key) for key in _BIAS_DEFAULTS)
    if out != mlp:
        raise ValueError(f"attention_out_bias={str(out).lower()}, mlp_bias={str(mlp).lower()}: Megatron biases "
                         "o_proj and the MLP by one setting (add_bias_linear); they must agree")
    if out and not qkv:
        raise ValueError("attention_bias=false with attention_out_bias and mlp_bias true: Megatron's "
                         "add_bias_linear biases q, k and v too")
    return {"add_qkv_bias": qkv, "add_bias_linear": out}


def _write_biases(config: ModelConfig) -> Mapping[str, object]:
    return {"attention_bias": config.has_qkv_bias, "attention_out_bias": config.add_bias_linear,
            "mlp_bias": config.add_bias_linear}


SEED_OSS = LLAMA.derive(
    "SeedOssForCausalLM", "seed_oss",
    fields=(
        max_positions(524288),
        # SeedOssConfig's defaults: 8 KV heads and head_dim 128 when absent; null means one group
        # per head and hidden_size / num_attention_heads.
        ConfigField(("num_key_value_heads",), "num_query_groups", int, default=8, nullable=True),
        ConfigField(("head_dim",), "kv_channels", int, default=128, nullable=True),
        ConfigField(("attention_dropout",), "attention_dropout", float, default=0.1),
        ConfigField(("residual_dropout",), "hidden_dropout", float, default=0.1),
    ),
    rules=(ConfigRule(keys=tuple(_BIAS_DEFAULTS), model_fields=("add_qkv_bias", "add_bias_linear"),
                      read=_read_biases, write=_write_biases),),
    hf_notes={"sliding window": "none",
              "linear biases": "attention_bias (q/k/v), attention_out_bias and mlp_bias (o and the MLP: agree)",
              "dropout": "attention_dropout, residual_dropout (hidden_dropout; megatron-core also drops out "
                         "the embeddings by it)"},
)
