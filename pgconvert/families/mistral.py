"""Mistral (``MistralForCausalLM``) and Ministral (``MinistralForCausalLM``): Llama with a sliding window.

Mistral windows every layer (``sliding_window``); Ministral the layers ``layer_types`` marks (by
default every layer when there is a window, as transformers' MinistralConfig fills it).
"""

from __future__ import annotations

from collections.abc import Mapping

from pgconvert.model.config import ModelConfig
from pgconvert.families.llama import LLAMA, max_positions
from pgconvert.families.sliding_window import (
    EVERY_LAYER_WINDOW,
    layer_types,
    layer_types_of,
    window_or_none,
    window_values,
)
from pgconvert.families.table import DROP, ConfigRule

MISTRAL = LLAMA.derive(
    "MistralForCausalLM", "mistral",
    fields=(max_positions(131072),),
    rules=(EVERY_LAYER_WINDOW,),
    fixed={"add_bias_linear": False},
    hf_notes={"sliding window": "sliding_window", "linear biases": DROP},
)


def _read_ministral_window(present: Mapping[str, object], model: Mapping[str, object]) -> Mapping[str, object]:
    """Ministral: ``sliding_window`` on the layers ``layer_types`` marks (by default every layer
    when there is a window, as transformers' MinistralConfig fills it)."""
    layers = model["num_layers"]
    assert isinstance(layers, int)
    window = window_or_none(present.get("sliding_window"), "sliding_window")
    pattern = layer_types(present, layers)
    if pattern is None:
        pattern = (1,) * layers
    return window_values(window, pattern)


def _write_ministral_window(config: ModelConfig) -> Mapping[str, object]:
    return {"sliding_window": config.attention.sliding_window, "layer_types": layer_types_of(config)}


MINISTRAL = MISTRAL.derive(
    "MinistralForCausalLM", "ministral",
    rules=(ConfigRule(keys=("sliding_window", "layer_types"), model_fields=("sliding_window", "window_layers"),
                      read=_read_ministral_window, write=_write_ministral_window),),
    hf_notes={"sliding window": "sliding_window, layer_types"},
)
