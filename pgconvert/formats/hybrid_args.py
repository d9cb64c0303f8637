"""A hybrid (Mamba) model's Megatron ``args``: how Megatron-LM's ``pretrain_mamba.py`` records them.

Megatron-LM core_v0.16.1 (megatron/training/arguments.py, mamba_builders.py): ``--hybrid-override-pattern``
(one symbol per layer, megatron-core's ``Symbols``: M Mamba, * attention, - MLP, E MoE; its length is
``--num-layers``), ``--hybrid-attention-ratio`` / ``--hybrid-mlp-ratio`` (0.0 with a pattern),
``--spec`` (the module and name of the layer spec: megatron-core's TE ``mamba_stack_spec``, the only
one it ships, written for Transformer Engine names; a local-named checkpoint needs a spec of the user's), ``--is-hybrid-model``, and the Mamba sizes as megatron-core's TransformerConfig fields
``mamba_state_dim`` (128), ``mamba_head_dim`` (64), ``mamba_num_groups`` (8), ``mamba_num_heads``
(None: ``hidden_size * 2 // mamba_head_dim``).

Megatron-LM d98e8a64 renamed the pattern ``--hybrid-layer-pattern`` for its HybridModel (a pattern
that may also hold pipeline ``|`` and MTP ``/`` separators, and a MambaMixer whose convolution is the
parameters ``conv1d_weight``/``conv1d_bias``); that field is not read: such a checkpoint is not converted.

A GPT model with gated delta net layers (Qwen3-Next, ``pretrain_gpt.py``) records megatron-core's
TransformerConfig fields under their own names: ``experimental_attention_variant`` ("gated_delta_net"; None: no
linear attention), ``linear_attention_freq`` (an int N or a 0/1 list, Megatron-LM's ``--linear-attention-freq``),
``linear_conv_kernel_dim`` (4), ``linear_key_head_dim`` / ``linear_value_head_dim`` (128),
``linear_num_key_heads`` (16), ``linear_num_value_heads`` (32); and, for any GPT model, ``attention_output_gate``
(False).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from pgconvert.errors import CheckpointError
from pgconvert.io.limits import quote
from pgconvert.model.config import LinearAttentionConfig, MambaConfig, ModelConfig
from pgconvert.semantics.arg_values import arg
from pgconvert.semantics.mla import SPARSE_VARIANT

MAMBA_FIELDS = ("mamba_state_dim", "mamba_head_dim", "mamba_num_groups", "mamba_num_heads")
# megatron-core 0.16.1's TransformerConfig defaults for the Mamba sizes.
MAMBA_DEFAULTS: dict[str, Any] = {name: getattr(MambaConfig(), name) for name in MAMBA_FIELDS}
# Megatron-LM's --spec for a hybrid model: megatron-core's Transformer-Engine Mamba stack.
MAMBA_STACK_SPEC = ["megatron.core.models.mamba.mamba_layer_specs", "mamba_stack_spec"]
LINEAR_ATTENTION_SIZES = ("linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim",
                          "linear_num_key_heads", "linear_num_value_heads")
# megatron-core 0.16.1's TransformerConfig defaults for the gated delta net sizes.
LINEAR_ATTENTION_DEFAULTS: dict[str, Any] = {name: getattr(LinearAttentionConfig(), name)
                                             for name in LINEAR_ATTENTION_SIZES}


def hybrid_from_args(args: argparse.Namespace, path: Path) -> dict[str, Any]:
    """The hybrid pattern and Mamba sizes ``args`` record; nothing for a GPT model."""
    pattern = getattr(args, "hybrid_override_pattern", None)
    if pattern is None:
        return {}
    if not isinstance(pattern, str):
        raise CheckpointError(f"{path}: args.hybrid_override_pattern={quote(pattern)}: expected a string")
    return {"hybrid_override_pattern": pattern,
            **{name: arg(args, name, MAMBA_DEFAULTS[name]) for name in MAMBA_FIELDS}}


def hybrid_to_args(config: ModelConfig) -> dict[str, Any]:
    """The args of a hybrid model as Megatron-LM's pretrain_mamba.py records them; nothing for a GPT model."""
    if config.hybrid_override_pattern is None:
        return {}
    # megatron-core's one Mamba stack spec has Transformer Engine's names; local names have none.
    spec = list(MAMBA_STACK_SPEC) if config.transformer_impl == "transformer_engine" else None
    return {"hybrid_override_pattern": config.hybrid_override_pattern, "hybrid_attention_ratio": 0.0,
            "hybrid_mlp_ratio": 0.0, "is_hybrid_model": True, "spec": spec,
            **{name: config.setting(name) for name in MAMBA_FIELDS}}


def linear_attention_from_args(args: argparse.Namespace, path: Path) -> dict[str, Any]:
    """The output gate, and the gated delta net layers and sizes ``args`` record (none for a model without)."""
    gate = getattr(args, "attention_output_gate", None)
    if gate is not None and not isinstance(gate, bool):
        raise CheckpointError(f"{path}: args.attention_output_gate={quote(gate)}: expected true or false")
    read: dict[str, Any] = {"attention_output_gate": bool(gate)}
    variant = getattr(args, "experimental_attention_variant", None)
    if variant is None or variant == SPARSE_VARIANT:  # sparse attention: pgconvert.semantics.mla
        return read
    freq = getattr(args, "linear_attention_freq", None)
    return {**read, "experimental_attention_variant": variant,
            "linear_attention_freq": tuple(freq) if isinstance(freq, list) else freq,
            **{name: arg(args, name, LINEAR_ATTENTION_DEFAULTS[name]) for name in LINEAR_ATTENTION_SIZES}}


def linear_attention_to_args(config: ModelConfig) -> dict[str, Any]:
    """The output gate and gated delta net settings as Megatron-LM records them (its list for a pattern)."""
    written: dict[str, Any] = {"attention_output_gate": config.attention.attention_output_gate}
    linear = config.linear_attention
    if linear.experimental_attention_variant is None:
        return written
    freq = linear.linear_attention_freq
    return {**written, "experimental_attention_variant": linear.experimental_attention_variant,
            "linear_attention_freq": list(freq) if isinstance(freq, tuple) else freq,
            **{name: config.setting(name) for name in LINEAR_ATTENTION_SIZES}}
