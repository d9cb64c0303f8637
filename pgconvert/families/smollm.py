"""SmolLM3 (``SmolLM3ForCausalLM``): Llama with layers without RoPE (NoPE) and an optional window.

``no_rope_layers`` (1: the layer uses RoPE) is the complement of megatron-core's ``no_rope_freq``
(0/1 per layer, 1: the layer skips RoPE; ``pgconvert.semantics.rope``), which Megatron-LM's
``--no-rope-freq`` sets.
"""

from __future__ import annotations

from collections.abc import Mapping

from pgconvert.io.limits import quote
from pgconvert.model.config import ModelConfig
from pgconvert.families.llama import (
    HEAD_DIM_NULL,
    LLAMA,
    head_dim_field,
    max_positions,
    query_groups_field,
    rotary_base_field,
)
from pgconvert.families.sliding_window import (
    layer_types,
    layer_types_of,
    periodic_layers,
    window_or_none,
    window_values,
    window_values_sized,
)
from pgconvert.families.table import ConfigField, ConfigRule


# SmolLM3Config's and Llama4TextConfig's default no_rope_layer_interval.
NOPE_INTERVAL = 4


def rope_flags(present: Mapping[str, object], layers: int) -> tuple[int, ...]:
    """``no_rope_layers`` (1: the layer uses RoPE), by default every ``no_rope_layer_interval``-th (1-based) layer
    without, as transformers' SmolLM3Config and Llama4TextConfig fill it."""
    flags = present.get("no_rope_layers")
    if flags is None:
        interval = present.get("no_rope_layer_interval", NOPE_INTERVAL)
        if not isinstance(interval, int) or isinstance(interval, bool) or interval < 1:
            raise ValueError(f"no_rope_layer_interval={quote(interval)}: expected a positive integer")
        return periodic_layers(layers, interval)
    if (not isinstance(flags, list) or len(flags) != layers
            or not all(v in (0, 1) and not isinstance(v, bool) for v in flags)):
        raise ValueError(f"no_rope_layers={quote(flags)}: expected {layers} of 0 or 1")
    return tuple(flags)


def _read_layers(present: Mapping[str, object], model: Mapping[str, object]) -> Mapping[str, object]:
    """NoPE layers (megatron-core's no_rope_freq is the complement of ``no_rope_layers``) and the
    window, on the layers ``layer_types`` marks (by default the NoPE ones) when ``use_sliding_window``."""
    layers = model["num_layers"]
    assert isinstance(layers, int)
    rope = rope_flags(present, layers)
    use = present.get("use_sliding_window", False)
    if not isinstance(use, bool):
        raise ValueError(f"use_sliding_window={quote(use)}: expected true or false")
    window = window_or_none(present.get("sliding_window"), "sliding_window") if use else None
    pattern = layer_types(present, layers)
    if pattern is None:
        pattern = tuple(int(window is not None and not flag) for flag in rope)
    no_rope = tuple(1 - flag for flag in rope)
    # Without use_sliding_window, transformers' attention windows no layer whatever layer_types says.
    windowed = window_values_sized(window, pattern) if use else window_values(window, pattern)
    return {"no_rope_layers": no_rope if any(no_rope) else None, **windowed}


def _write_layers(config: ModelConfig) -> Mapping[str, object]:
    no_rope = config.positions.no_rope_layers or (0,) * config.num_layers
    window = config.attention.sliding_window
    return {"no_rope_layers": [1 - flag for flag in no_rope], "no_rope_layer_interval": NOPE_INTERVAL,
            "use_sliding_window": window is not None, "sliding_window": window,
            "layer_types": layer_types_of(config)}


SMOLLM3 = LLAMA.derive(
    "SmolLM3ForCausalLM", "smollm3",
    # SmolLM3Config's 4 KV heads and RoPE base 2e6 where config.json leaves them out; it has no head_dim,
    # which its attention takes as given.
    fields=(query_groups_field(4), head_dim_field(null_refused=HEAD_DIM_NULL), rotary_base_field(2_000_000.0),
            max_positions(32768), ConfigField(("tie_word_embeddings",), "tie_embeddings", bool, default=True)),
    rules=(ConfigRule(
        keys=("no_rope_layers", "no_rope_layer_interval", "use_sliding_window", "sliding_window", "layer_types"),
        model_fields=("no_rope_layers", "sliding_window", "window_layers"),
        read=_read_layers, write=_write_layers, null_keys=("sliding_window",)),),
    # SmolLM3Config's default token ids (128000…128004) are outside a smaller vocabulary, where
    # transformers then fails to build the model; a Megatron checkpoint does not know its ids.
    hf_scratch={"bos_token_id": None, "eos_token_id": None, "pad_token_id": None},
    hf_notes={"NoPE layers": "no_rope_layers (1: RoPE), no_rope_layer_interval",
              "sliding window": "use_sliding_window, sliding_window, layer_types (by default the NoPE layers)"},
)
