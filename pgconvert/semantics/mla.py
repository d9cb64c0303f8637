"""Megatron args of multi-latent attention and group-limited routing <-> ``ModelConfig``.

Names as Megatron-LM's ``_add_mla_args`` and megatron-core's ``MLATransformerConfig`` /
``TransformerConfig`` spell them: ``multi_latent_attention``, ``q_lora_rank`` (None: one q
projection), ``kv_lora_rank``, ``qk_head_dim``, ``qk_pos_emb_head_dim``, ``v_head_dim``,
``rope_type`` (MLA's own rotary: ``rope`` or ``yarn``, the default) and ``moe_router_num_groups`` /
``moe_router_group_topk``. A multi-latent model is written with ``position_embedding_type='rope'``
as Megatron-LM's DeepSeek examples run it (GPTModel then builds no rotary of its own).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from pgconvert.model.config import ModelConfig
from pgconvert.errors import CheckpointError
from pgconvert.io.limits import quote

# Megatron-LM's argument defaults (arguments.py _add_mla_args).
MEGATRON_MLA_DEFAULTS: dict[str, int | None] = {
    "q_lora_rank": None, "kv_lora_rank": 32, "qk_head_dim": 128, "qk_pos_emb_head_dim": 64, "v_head_dim": 128,
}


def _optional_int(args: argparse.Namespace, name: str, default: int | None, path: Path) -> int | None:
    """``args.<name>``, a positive integer; ``default`` when absent or None (Megatron-LM's, for a None it
    never writes: pgconvert.formats.megatron_args names that in a notice)."""
    value = getattr(args, name, None)
    if value is None:
        return default
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise CheckpointError(f"{path}: args.{name}={quote(value)}: must be a positive integer")
    return value


def from_args(args: argparse.Namespace, path: Path) -> dict[str, Any]:
    """The MLA and router-group values of a run's args (none for a model without them)."""
    values: dict[str, Any] = {}
    if getattr(args, "multi_latent_attention", False):
        values["multi_latent_attention"] = True
        for name, default in MEGATRON_MLA_DEFAULTS.items():
            values[name] = _optional_int(args, name, default, path)
    if getattr(args, "num_experts", None):
        groups = _optional_int(args, "moe_router_num_groups", None, path)
        chosen = _optional_int(args, "moe_router_group_topk", None, path)
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
    return values
