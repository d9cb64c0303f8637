"""Cohere (``CohereForCausalLM``: CohereForAI/c4ai-command-r-v01): Llama's tensors in a parallel layer with one norm;
Cohere2 (``Cohere2ForCausalLM``: c4ai-command-r7b-12-2024, c4ai-command-a-03-2025): the same layer with windows.

transformers' CohereDecoderLayer computes ``x + attn(ln(x)) + mlp(ln(x))``: attention and MLP side by side on one
``input_layernorm`` (no ``post_attention_layernorm``), which megatron-core 0.16.1 has no layer for
(``TransformerLayer.forward`` runs the MLP on the attention's output, transformer/transformer_layer.py:513-518). Its
``CohereLayerNorm`` subtracts the mean and has no bias, where megatron-core's LayerNorm always has one
(transformer/torch_norm.py:38-39); and CohereForCausalLM multiplies the logits by ``logit_scale``, which
megatron-core has no setting for. The three are carried in Megatron args (``use_parallel_residual`` as GPT-NeoX's,
``shared_input_layernorm``, ``layernorm_bias``, ``logit_scale``: ``pgconvert.semantics.carried``), named in a notice
on every Megatron output and refused under ``--strict``.

The rest is megatron-core's: SwiGLU without biases, GQA, RoPE over the whole head with its rotate_half on pairs of
neighbouring channels (cos/sin repeated pairwise: megatron-core's ``rotary_interleaved``, rows kept in HF's order as
ERNIE's), tied embeddings by default. ``attention_bias`` biases q, k, v and o but not the MLP, which megatron-core's
one ``add_bias_linear`` cannot hold (true is refused, named); ``use_qk_norm`` (command-r-plus) normalizes each head
with weights of its own (``[heads, head_dim]``), where megatron-core's q/k norm shares one over ``head_dim``: refused.

Cohere2 has no q/k norm and a ``sliding_window`` (4096) on the layers ``layer_types`` marks (older config.json: every
``sliding_window_pattern``-th layer, 4, full attention; the releases' three local layers to one global). Its
attention rotates q and k only on the layers with a window: the full-attention layers are megatron-core's
``no_rope_freq`` layers (without a window, every layer).
"""

from __future__ import annotations

from collections.abc import Mapping

from pgconvert.families.gpt_neox import PARALLEL_RESIDUAL
from pgconvert.families.llama import (
    HEAD_DIM_NULL,
    HF_SILU,
    LLAMA,
    ROPE_DEFAULT,
    head_dim_field,
    max_positions,
    query_groups_field,
    rotary_base_field,
)
from pgconvert.families.sliding_window import (
    layer_types_of,
    layer_types_window,
    no_rope_of,
    refuses_other_rope,
    window_of,
    windowed_layers,
)
from pgconvert.families.table import ConfigField, ConfigRule
from pgconvert.io.limits import quote
from pgconvert.model.config import ModelConfig
from pgconvert.semantics.arg_values import positive
from pgconvert.semantics.carried import CarriedSetting, read_flag

# CohereConfig's default_theta.
COHERE_ROPE_BASE = 500000.0
_QK_NORM_PER_HEAD = ("CohereLayerNorm over (heads, head_dim) has a weight for each head, where megatron-core's "
                     "q/k norm has one over head_dim for every head")


def _read_qk_norm(present: Mapping[str, object], model: Mapping[str, object]) -> Mapping[str, object]:
    """``use_qk_norm`` (absent or null: off, as CohereAttention tests it for truth): only off converts."""
    value = present.get("use_qk_norm")
    if value is not None and not isinstance(value, bool):
        raise ValueError(f"use_qk_norm={quote(value)}: expected true or false")
    if value:
        raise ValueError(f"use_qk_norm=true: {_QK_NORM_PER_HEAD}")
    return {"qk_layernorm": False}


def _write_qk_norm(config: ModelConfig) -> Mapping[str, object]:
    return {"use_qk_norm": False}


def _refuses_qk_norm(config: ModelConfig) -> str | None:
    return f"qk_layernorm=True ({_QK_NORM_PER_HEAD})" if config.attention.qk_layernorm else None


# Cohere's parallel layer without its use_qk_norm switch (Cohere2Config has none): the two families' common part.
_PARALLEL_LAYER = LLAMA.derive(
    "CohereForCausalLM", "cohere",
    fields=(
        ConfigField(("layer_norm_eps",), "norm_epsilon", float, default=1e-5,
                    null_refused="CohereLayerNorm adds it to the variance as given, and null is no epsilon"),
        max_positions(8192),
        query_groups_field(),
        # CohereConfig has no head_dim: getattr(config, "head_dim", hidden // heads) in its attention.
        head_dim_field(null_refused=HEAD_DIM_NULL),
        rotary_base_field(COHERE_ROPE_BASE),
        ConfigField(("tie_word_embeddings",), "tie_embeddings", bool, default=True),
        ConfigField(("logit_scale",), "logit_scale", float, default=0.0625,
                    null_refused="CohereForCausalLM multiplies the logits by it as given, and null is no factor"),
    ),
    fixed={"normalization": "LayerNorm", "add_bias_linear": False, "rotary_interleaved": True,
           "use_parallel_residual": True, "shared_input_layernorm": True, "layernorm_bias": False},
    hf_fixed={**HF_SILU, "attention_bias": False},
    hf_scratch=ROPE_DEFAULT,
    hf_rotary_interleaved=True,
    megatron_carried=(PARALLEL_RESIDUAL, CarriedSetting("shared_input_layernorm", False, read_flag),
                      CarriedSetting("layernorm_bias", True, read_flag), CarriedSetting("logit_scale", 1.0, positive)),
    hf_notes={"rotary interleaved": "always (HF's own rotary is interleaved: rows kept as they are)",
              "normalization": "LayerNorm without a bias (CohereLayerNorm, fixed)", "norm epsilon": "layer_norm_eps",
              "linear biases": "attention_bias (q, k, v and o only: must be false)",
              "parallel attention and MLP": "always, one shared norm (fixed)",
              "LayerNorm bias": "never (fixed)", "logit scale": "logit_scale"},
)

COHERE = _PARALLEL_LAYER.derive(
    "CohereForCausalLM", "cohere",
    rules=(ConfigRule(keys=("use_qk_norm",), model_fields=("qk_layernorm",), read=_read_qk_norm,
                      write=_write_qk_norm, refuses=_refuses_qk_norm, null_keys=("use_qk_norm",)),),
    hf_notes={"qk-norm": "use_qk_norm (a weight per head: must be false)"},
)


# --- Cohere2: Command R7B, Command A -------------------------------------------------------------

_COHERE2_WINDOW = 4096  # Cohere2Config's sliding_window
_COHERE2_PERIOD = 4  # Cohere2Config's sliding_window_pattern (read where layer_types is absent)


def _read_cohere2_layers(present: Mapping[str, object], model: Mapping[str, object]) -> Mapping[str, object]:
    """The window (4096 where absent) on the layers ``layer_types`` marks sliding, and RoPE on those layers alone
    (Cohere2Attention rotates q and k only where it has a window). A null window is refused: Cohere2Model builds its
    sliding-window mask for every model, and transformers' mask builder needs a size."""
    layers = model["num_layers"]
    assert isinstance(layers, int)
    if window_of(present, _COHERE2_WINDOW) is None:
        raise ValueError("sliding_window=null: Cohere2Model builds a sliding-window mask for every model, whatever "
                         "layer_types says, and transformers' mask builder needs a size")
    window = layer_types_window(present, model, _COHERE2_PERIOD, "sliding_window_pattern", _COHERE2_WINDOW)
    pattern = window["window_layers"] or (int(window["sliding_window"] is not None),) * layers
    assert isinstance(pattern, tuple)
    return {**window, "no_rope_layers": no_rope_of(pattern)}


def _write_cohere2_layers(config: ModelConfig) -> Mapping[str, object]:
    """The layer types and the window; a model without one (every layer full attention) gets the class default,
    which no layer looks through."""
    return {"sliding_window": config.attention.sliding_window or _COHERE2_WINDOW, "layer_types": layer_types_of(config)}


def _refuses_cohere2_layers(config: ModelConfig) -> str | None:
    return refuses_other_rope(config, windowed_layers(config), "RoPE on exactly the windowed layers")


COHERE2_LAYERS = ConfigRule(keys=("sliding_window", "layer_types"),
                            model_fields=("sliding_window", "window_layers", "no_rope_layers"),
                            read=_read_cohere2_layers, write=_write_cohere2_layers,
                            refuses=_refuses_cohere2_layers, null_keys=("sliding_window",),
                            legacy_keys=("sliding_window_pattern",))

# Cohere2Config's RoPE base is transformers' default 10000 (it has no default_theta of its own).
COHERE2 = _PARALLEL_LAYER.derive(
    "Cohere2ForCausalLM", "cohere2",
    fields=(rotary_base_field(10000.0),),
    rules=(COHERE2_LAYERS,),
    hf_notes={"qk-norm": "none (Cohere2Attention has no q/k norm)",
              "sliding window": "sliding_window on the layers layer_types marks (older: every "
                                "sliding_window_pattern-th layer full attention)",
              "NoPE layers": "every layer without a window (always)"},
)
