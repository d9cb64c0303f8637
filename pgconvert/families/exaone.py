"""EXAONE 4.0 (``Exaone4ForCausalLM``): OLMo 2's layers (norms after attention and the MLP, none before them)
with q/k norms per head, and hybrid attention.

Exaone4Config's ``sliding_window`` (4096 by default; null: none) applies to the layers ``layer_types`` marks
``sliding_attention``; without ``layer_types`` the class marks every ``sliding_window_pattern``-th layer (4 by
default, LGAI-EXAONE/EXAONE-4.0-32B's three local layers to one global) full attention. Its attention rotates
q and k only on the sliding layers when there is a window ("global NoPE"): the full-attention layers of a
windowed model are megatron-core's ``no_rope_freq`` layers. Without a window (EXAONE-4.0-1.2B) every layer
rotates. Both releases scale the RoPE as Llama 3 does (``rope_scaling`` llama3, factor 16 over 8192 positions).
"""

from __future__ import annotations

from collections.abc import Mapping

from pgconvert.io.limits import quote
from pgconvert.model.config import ModelConfig
from pgconvert.families.llama import query_groups_field
from pgconvert.families.olmo import OLMO2
from pgconvert.families.sliding_window import (
    layer_types,
    layer_types_of,
    no_rope_of,
    period_of,
    periodic_layers,
    refuses_other_rope,
    window_of,
    window_values_sized,
    windowed_layers,
)
from pgconvert.families.table import DROP, ConfigRule

_WINDOW = 4096  # Exaone4Config's sliding_window
_PERIOD = 4  # Exaone4Config's sliding_window_pattern


def _sliding_layers(present: Mapping[str, object], layers: int, window: int | None) -> tuple[int, ...]:
    """``layer_types`` as a 0/1 per layer (1: sliding), else as Exaone4Config fills it: every
    ``sliding_window_pattern``-th layer full attention, which it computes only from an integer period (a null
    window sets the period to 0)."""
    pattern = layer_types(present, layers)
    if pattern is not None:
        return pattern
    if window is None:
        raise ValueError("sliding_window=null without layer_types: Exaone4Config then sets sliding_window_pattern "
                         "to 0 and cannot fill layer_types (a division by zero); give layer_types")
    period = present.get("sliding_window_pattern", _PERIOD)
    if not isinstance(period, int) or isinstance(period, bool) or period < 1:
        raise ValueError(f"sliding_window_pattern={quote(period)} without layer_types: Exaone4Config fills "
                         "layer_types only from a positive integer period; give layer_types")
    return periodic_layers(layers, period)


def _read_layers(present: Mapping[str, object], model: Mapping[str, object]) -> Mapping[str, object]:
    """The window on the sliding layers, and with a window no RoPE on the full-attention ones."""
    layers = model["num_layers"]
    assert isinstance(layers, int)
    window = window_of(present, _WINDOW)
    pattern = _sliding_layers(present, layers, window)
    return {**window_values_sized(window, pattern), "no_rope_layers": no_rope_of(pattern if window else (1,) * layers)}


def _unrotated_everywhere(config: ModelConfig) -> bool:
    """No window and no layer rotated: config.json says so as a window that no layer looks through."""
    no_rope = config.positions.no_rope_layers
    return config.attention.sliding_window is None and no_rope is not None and all(no_rope)


def _write_layers(config: ModelConfig) -> Mapping[str, object]:
    types = layer_types_of(config)
    window = _WINDOW if _unrotated_everywhere(config) else config.attention.sliding_window
    period = period_of(tuple(int(kind == "sliding_attention") for kind in types))
    return {"sliding_window": window, "layer_types": types, "sliding_window_pattern": period if window else 0}


def _refuses(config: ModelConfig) -> str | None:
    """EXAONE 4 rotates every layer without a window and, with one, the sliding layers alone."""
    if _unrotated_everywhere(config):
        return None
    rotated = windowed_layers(config) if config.attention.sliding_window is not None else (1,) * config.num_layers
    return refuses_other_rope(config, rotated, "no RoPE on exactly the full-attention layers of a windowed model")


LAYERS_RULE = ConfigRule(keys=("sliding_window", "sliding_window_pattern", "layer_types"),
                         model_fields=("sliding_window", "window_layers", "no_rope_layers"),
                         read=_read_layers, write=_write_layers, refuses=_refuses,
                         null_keys=("sliding_window", "sliding_window_pattern"))

# Exaone4Config's 2048 positions, RMS eps 1e-5, untied embeddings, RoPE base 10000 and head_dim hidden / heads
# where absent are OLMo 2's, its 32 KV heads not; its attention has no bias switch.
EXAONE4 = OLMO2.derive(
    "Exaone4ForCausalLM", "exaone4",
    fields=(query_groups_field(32),),
    rules=(LAYERS_RULE,),
    fixed={"qk_layernorm_across_heads": False},
    hf_fixed={"attention_bias": DROP},
    hf_notes={"qk-norm": "always, per head (q_norm, k_norm over head_dim)",
              "sliding window": "sliding_window on the layers layer_types marks (by default every "
                                "sliding_window_pattern-th layer full attention)",
              "NoPE layers": "the full-attention layers of a windowed model (always)"},
)
