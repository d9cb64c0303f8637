"""The Megatron args of norms after the sublayers and of the other layers only Megatron-Bridge builds.

The families that have them are Gemma 2/3, OLMo 2, OLMoE and GLM-4, and Gemma (its embedding scale; their
modules under ``pgconvert.families``); Megatron knows them by these settings, whichever family a model came from.

megatron-core 0.16 expresses a zero-centred norm gamma (``layernorm_zero_centered_gamma``), the
attention ``softmax_scale`` (Gemma's ``query_pre_attn_scalar``: pgconvert.semantics.attention_scale) and a
gated tanh GELU (``gated_linear_unit`` with ``activation_func=openai_gelu``; pgconvert's args spell it
``gated_linear_unit`` with ``openai_gelu``, which Megatron-LM's core_transformer_config_from_args does not
read), but not
norms after the sublayers, an embedding scaled by sqrt(hidden), soft-capping or a second RoPE base
for the sliding-window layers. Megatron-Bridge builds those with custom layers and keeps the
numeric settings under these names (NVIDIA-NeMo/Megatron-Bridge src/megatron/bridge/models/gemma/
gemma2_provider.py: ``attn_logit_softcapping``, ``final_logit_softcapping``;
gemma3_provider.py: ``rotary_base_local`` of ``Gemma3RotaryEmbedding``, the post norms inside
``TERowParallelLinearLayerNorm``, the sqrt(hidden) of ``Gemma3LanguageModelEmbedding``; olmoe/
olmoe_provider.py: ``OLMoESelfAttention``'s q/k norms over all heads); the switches it takes from
its layer specs get pgconvert's own names, the ``ModelConfig`` field names (``PGCONVERT_ARGS``). They are
written to the args (and, as ``ModelConfig`` fields, to ``pgconvert.json``), read back, and named in a
notice on every Megatron output.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any

from pgconvert.model.config import POSTNORM_OFF, ModelConfig
from pgconvert.errors import CheckpointError
from pgconvert.io.limits import quote

# Megatron-Bridge's names (the module docstring cites them; query_pre_attn_scalar, its Gemma 2 spelling
# of the softmax scale, is read by pgconvert.semantics.attention_scale), and the ones with no Megatron spelling
# at all, pgconvert's own: Megatron-Bridge builds these from the layer spec, not from a setting.
BRIDGE_ARGS = frozenset({"query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping",
                         "rotary_base_local"})
PGCONVERT_ARGS = frozenset({"post_self_attn_layernorm", "post_mlp_layernorm", "pre_layernorms",
                            "embedding_scale_sqrt_hidden", "qk_layernorm_across_heads"})
_FLAGS = ("post_self_attn_layernorm", "post_mlp_layernorm", "pre_layernorms", "embedding_scale_sqrt_hidden",
          "qk_layernorm_across_heads")
_NUMBERS = ("attn_logit_softcapping", "final_logit_softcapping", "rotary_base_local")


def postnorm_to_args(config: ModelConfig) -> dict[str, Any]:
    """The args of the settings (every one written, so a base run's stale values are replaced)."""
    return {name: config.setting(name) for name in (*_FLAGS, *_NUMBERS)}


def postnorm_from_args(args: argparse.Namespace, path: Path) -> dict[str, Any]:
    """The settings ``args`` record; absent ones take the plain pre-norm decoder's values."""
    values: dict[str, Any] = {}
    for name in _FLAGS:
        value = getattr(args, name, None)
        if value is None:
            value = POSTNORM_OFF[name]
        if not isinstance(value, bool):
            raise CheckpointError(f"{path}: args.{name}={quote(value)}: expected True or False")
        values[name] = value
    for name in _NUMBERS:
        value = getattr(args, name, None)
        if value is not None and (not isinstance(value, (int, float)) or isinstance(value, bool)
                                  or not math.isfinite(value) or value <= 0):
            raise CheckpointError(f"{path}: args.{name}={quote(value)}: expected a positive number or None")
        values[name] = None if value is None else float(value)
    return values


def megatron_core_gaps(config: ModelConfig) -> tuple[list[str], list[str]]:
    """(settings megatron-core alone does not compute but Megatron-Bridge's layers do: notices,
    settings no Megatron layer computes: refused under --strict)."""
    bridge = [f"{name}={config.setting(name)!r}" for name in _NUMBERS if config.setting(name) is not None]
    bridge += [f"{name}=True" for name in ("post_self_attn_layernorm", "post_mlp_layernorm",
                                           "embedding_scale_sqrt_hidden", "qk_layernorm_across_heads")
               if config.setting(name)]
    notices = []
    if bridge:
        notices.append(
            f"args {', '.join(bridge)}: megatron-core's GPTModel does not compute these; Megatron-Bridge's custom "
            "layers do (its Gemma, Gemma 2/3 and OLMoE providers), so build the model with them; the args and pgconvert.json carry them")
    if config.mlp.activation == "gelu_tanh":
        notices.append(
            "args.openai_gelu=True (the tanh GELU): Megatron-LM's core_transformer_config_from_args does not read it "
            "and builds F.gelu; set TransformerConfig.activation_func to the tanh GELU (Megatron-Bridge's providers do)")
    positions = config.positions
    if positions.rotary_base_local is not None and positions.rope_scaling == "linear":
        notices.append(
            f"args.rotary_seq_len_interpolation_factor={positions.rope_scaling_factor}: with rotary_base_local it scales "
            "the full-attention layers' RoPE only (Megatron-Bridge's Gemma3RotaryEmbedding takes it as "
            "rope_scaling_factor); the sliding layers' RoPE is unscaled")
    if config.attention.qk_l2_norm and config.positions.no_rope_layers:
        notices.append(
            "args.qk_l2_norm=True with no_rope_freq: megatron-core's layer specs put the L2 norm in every layer "
            "(models/gpt/gpt_layer_specs.py:148), transformers' Llama 4 only in the layers with RoPE, as Megatron-Bridge's "
            "get_llama4_layer_spec does, so build the model with that spec")
    refused = [] if config.norms.pre_layernorms else [
        "pre_layernorms=False (norms after the sublayers only, OLMo 2): no megatron-core or Megatron-Bridge layer "
        "spec computes it; the args and pgconvert.json carry it"]
    return notices, refused
