"""Megatron args of multi-latent attention and group-limited routing <-> ``ModelConfig``.

Names as Megatron-LM's ``_add_mla_args`` and megatron-core's ``MLATransformerConfig`` /
``TransformerConfig`` spell them: ``multi_latent_attention``, ``q_lora_rank`` (None: one q
projection), ``kv_lora_rank``, ``qk_head_dim``, ``qk_pos_emb_head_dim``, ``v_head_dim``,
``rope_type`` (MLA's own rotary: ``rope`` or ``yarn``, the default) and ``moe_router_num_groups`` /
``moe_router_group_topk``. A multi-latent model is written with ``position_embedding_type='rope'``
as Megatron-LM's DeepSeek examples run it (GPTModel then builds no rotary of its own).

DeepSeek Sparse Attention is ``experimental_attention_variant='dsa'`` with megatron-core's TransformerConfig
fields (Megatron-LM turns each into a flag of the same name, ``--dsa-indexer-n-heads`` …):
``dsa_indexer_n_heads``, ``dsa_indexer_head_dim``, ``dsa_indexer_topk``, ``dsa_indexer_rope_interleaved``
(GLM-5's interleaved indexer RoPE; absent: False), and the core_v0.19.0-on settings whose values compute
transformers' DeepSeek-V3.2 and GLM-5 indexers, written as such and refused when a checkpoint holds another:
``dsa_indexer_scoring_relu`` True, ``dsa_indexer_topk_freq`` 1
and ``dsa_indexer_skip_topk_offset`` 0 (no top-k shared across layers), ``dsa_indexer_k_norm_epsilon`` 1e-6
(absent or None: the norm epsilon). ``dsa_indexer_rotate_activation`` (a Hadamard rotation of q and k, which
leaves their products as they are) is not read.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from pgconvert.model.config import ModelConfig
from pgconvert.errors import CheckpointError
from pgconvert.io.limits import quote
from pgconvert.semantics.arg_values import positive_int

# Megatron-LM's argument defaults (arguments.py _add_mla_args).
MEGATRON_MLA_DEFAULTS: dict[str, int | None] = {
    "q_lora_rank": None, "kv_lora_rank": 32, "qk_head_dim": 128, "qk_pos_emb_head_dim": 64, "v_head_dim": 128,
}


SPARSE_VARIANT = "dsa"
DSA_SIZES = ("dsa_indexer_n_heads", "dsa_indexer_head_dim", "dsa_indexer_topk")
# transformers' DeepSeek-V3.2 indexer: its LayerNorm's epsilon, whatever rms_norm_eps is.
DSA_K_NORM_EPSILON = 1e-6
# The indexer settings (megatron-core core_v0.19.0 on) that compute transformers' indexer, at those values; None: absent
# or None in args reads as the value (the settings older megatron-core does not have).
DSA_FIXED: dict[str, object] = {"dsa_indexer_scoring_relu": True, "dsa_indexer_topk_freq": 1,
                                "dsa_indexer_skip_topk_offset": 0}


def _sparse_from_args(args: argparse.Namespace, path: Path) -> dict[str, Any]:
    """The sparse attention indexer's sizes; a setting that computes another indexer is refused by name."""
    if not getattr(args, "multi_latent_attention", False):
        raise CheckpointError(f"{path}: args.experimental_attention_variant='dsa' without multi_latent_attention: "
                              "megatron-core's sparse attention is built on multi-latent attention only")
    interleaved = getattr(args, "dsa_indexer_rope_interleaved", None)
    if interleaved is not None and not isinstance(interleaved, bool):
        raise CheckpointError(f"{path}: args.dsa_indexer_rope_interleaved={quote(interleaved)}: expected true or false")
    sizes: dict[str, Any] = {"dsa_indexer_rope_interleaved": bool(interleaved)}
    for name in DSA_SIZES:
        sizes[name] = positive_int(args, name, None, path)
        if sizes[name] is None:
            raise CheckpointError(f"{path}: args.{name} is missing with experimental_attention_variant='dsa'")
    for name, value in DSA_FIXED.items():
        given = getattr(args, name, None)
        if given is not None and given != value:
            raise CheckpointError(f"{path}: args.{name}={quote(given)}: transformers' sparse attention indexers compute "
                                  f"{name}={value!r}; no HF equivalent")
    epsilon = getattr(args, "dsa_indexer_k_norm_epsilon", None)
    if epsilon is None:
        epsilon = getattr(args, "norm_epsilon", None) or getattr(args, "layernorm_epsilon", None)
    if epsilon != DSA_K_NORM_EPSILON:
        raise CheckpointError(f"{path}: the sparse attention indexer's k_norm epsilon is {quote(epsilon)} "
                              "(args.dsa_indexer_k_norm_epsilon, else the norm epsilon): transformers' sparse attention "
                              f"indexers use {DSA_K_NORM_EPSILON}; no HF equivalent")
    return sizes


def from_args(args: argparse.Namespace, path: Path) -> dict[str, Any]:
    """The MLA, sparse attention and router-group values of a run's args (none for a model without them)."""
    values: dict[str, Any] = {}
    if getattr(args, "multi_latent_attention", False):
        values["multi_latent_attention"] = True
        for name, default in MEGATRON_MLA_DEFAULTS.items():
            values[name] = positive_int(args, name, default, path)
    if getattr(args, "experimental_attention_variant", None) == SPARSE_VARIANT:
        values.update(_sparse_from_args(args, path))
    if getattr(args, "num_experts", None):
        groups = positive_int(args, "moe_router_num_groups", None, path)
        chosen = positive_int(args, "moe_router_group_topk", None, path)
        if groups is not None and chosen is not None:
            values.update(moe_router_num_groups=groups, moe_router_group_topk=chosen)
    return values


def to_args(config: ModelConfig) -> dict[str, Any]:
    """The args of ``config``'s multi-latent attention and router groups."""
    attention = config.attention
    values: dict[str, Any] = {"multi_latent_attention": attention.multi_latent_attention,
                              "moe_router_num_groups": config.moe.moe_router_num_groups,
                              "moe_router_group_topk": config.moe.moe_router_group_topk}
    if attention.multi_latent_attention:
        values.update(
            q_lora_rank=attention.q_lora_rank, kv_lora_rank=attention.kv_lora_rank, qk_head_dim=attention.qk_head_dim,
            qk_pos_emb_head_dim=attention.qk_pos_emb_head_dim, v_head_dim=attention.v_head_dim,
            position_embedding_type="rope", rope_type="yarn" if config.positions.rope_scaling == "yarn" else "rope")
    if attention.sparse:
        values.update(experimental_attention_variant=SPARSE_VARIANT, **DSA_FIXED,
                      dsa_indexer_k_norm_epsilon=DSA_K_NORM_EPSILON,
                      dsa_indexer_rope_interleaved=attention.dsa_indexer_rope_interleaved,
                      **{name: getattr(attention, name) for name in DSA_SIZES})
    return values
