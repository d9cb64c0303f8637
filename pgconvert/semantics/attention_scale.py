"""The attention softmax scale: one ``ModelConfig`` field, ``softmax_scale``, and its spellings.

``softmax_scale`` is the number the attention scores ``q·k`` are multiplied by before the softmax,
as megatron-core's ``TransformerConfig.softmax_scale`` holds it; None is megatron-core's default,
``1/sqrt(kv_channels)`` (``DotProductAttention``), and ``ModelConfig`` reads a scale equal to that
default as None, so that one computation has one description. Every format converts to and from it
here:

* Megatron args: megatron-core's ``softmax_scale`` itself (Megatron-LM has no flag for it; its
  ``core_transformer_config_from_args`` copies it from args). Megatron-Bridge's Gemma 2 provider
  (``gemma2_provider.py``, ``Gemma2DotProductAttention``: ``1/sqrt(query_pre_attn_scalar)``) spells
  it ``query_pre_attn_scalar``; that spelling is read when ``softmax_scale`` is absent (older
  pgconvert outputs wrote both, which must then agree) and cleared on output.
* Granite's config.json: ``attention_multiplier``, the scale itself (transformers' default 1.0);
  the Granite family (``pgconvert.families.granite``) reads and writes it.
* Gemma 2/3's config.json: ``query_pre_attn_scalar``, the scale's -1/2 power (transformers computes
  ``query_pre_attn_scalar**-0.5``; its strict config types the scalar int); the Gemma families
  (``pgconvert.families.gemma``) read and write it with ``from_scalar``/``to_scalar``.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any

from pgconvert.model.config import ModelConfig
from pgconvert.errors import CheckpointError
from pgconvert.io.limits import quote
from pgconvert.semantics.arg_values import positive

# Megatron-Bridge's Gemma 2 spelling of the scale in args (read, and cleared on output).
BRIDGE_SCALAR_ARG = "query_pre_attn_scalar"
# transformers' q**-0.5 and Megatron-Bridge's 1/sqrt(q) may differ in the last bits of a float64.
_ROUNDING = 4 * 2.0 ** -52


def effective(config: ModelConfig) -> float:
    """The scale ``config`` computes with (megatron-core's default where ``softmax_scale`` is None)."""
    attention = config.attention
    return 1 / math.sqrt(attention.head_dim) if attention.softmax_scale is None else attention.softmax_scale


def from_scalar(scalar: float) -> float:
    """The scale of a Gemma ``query_pre_attn_scalar``, computed as transformers computes it."""
    return float(scalar) ** -0.5


def _same(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=_ROUNDING, abs_tol=0.0)


def to_scalar(scale: float) -> int | float:
    """The ``query_pre_attn_scalar`` whose scale is ``scale``: the integer one when its scale is
    ``scale`` to within float64 rounding (transformers types the scalar int), else the exact float."""
    scalar = scale ** -2
    nearest = round(scalar)
    if nearest > 0 and _same(from_scalar(nearest), scale):
        return nearest
    return scalar


def from_args(args: argparse.Namespace, path: Path) -> dict[str, Any]:
    """``softmax_scale`` from Megatron ``args``: megatron-core's ``softmax_scale``, else Megatron-Bridge's
    ``query_pre_attn_scalar``; both given, they must describe one scale."""
    scale = positive(args, "softmax_scale", None, path)
    scalar = positive(args, BRIDGE_SCALAR_ARG, None, path)
    if scalar is not None:
        if scale is not None and not _same(from_scalar(scalar), scale):
            raise CheckpointError(
                f"{path}: args.softmax_scale={quote(scale)} and args.{BRIDGE_SCALAR_ARG}={quote(scalar)}: the "
                f"attention scale is one setting; softmax_scale must be {BRIDGE_SCALAR_ARG}**-0.5 "
                f"({from_scalar(scalar)!r})")
        if scale is None:
            scale = from_scalar(scalar)
    return {"softmax_scale": scale}


def to_args(config: ModelConfig) -> dict[str, Any]:
    """megatron-core's ``softmax_scale`` (None: its default); a base run's Megatron-Bridge spelling cleared."""
    return {"softmax_scale": config.attention.softmax_scale, BRIDGE_SCALAR_ARG: None}
