"""Mistral (``MistralForCausalLM``) and Ministral (``MinistralForCausalLM``): Llama with a sliding window.

Mistral windows every layer (``sliding_window``, 4096 where config.json leaves it out, as
transformers' MistralConfig); Ministral the layers ``layer_types`` marks (by default every layer
when there is a window, as transformers' MinistralConfig fills it), and needs ``head_dim``.
"""

from __future__ import annotations

from collections.abc import Mapping

from pgconvert.model.config import ModelConfig
from pgconvert.families.llama import HEAD_DIM_NULL, LLAMA, head_dim_field, max_positions, query_groups_field
from pgconvert.families.sliding_window import (
    every_layer_window,
    layer_types,
    layer_types_of,
    window_of,
    window_values_sized,
)
from pgconvert.families.table import DROP, REQUIRED, ConfigRule

# MistralConfig's and MinistralConfig's sliding_window where config.json leaves it out.
MISTRAL_WINDOW = 4096

MISTRAL = LLAMA.derive(
    "MistralForCausalLM", "mistral",
    fields=(max_positions(131072), query_groups_field(8)),
    rules=(every_layer_window(MISTRAL_WINDOW),),
    fixed={"add_bias_linear": False},
    hf_notes={"sliding window": "sliding_window", "linear biases": DROP},
)


def _read_ministral_window(present: Mapping[str, object], model: Mapping[str, object]) -> Mapping[str, object]:
    """Ministral: ``sliding_window`` on the layers ``layer_types`` marks (by default every layer
    when there is a window, as transformers' MinistralConfig fills it)."""
    layers = model["num_layers"]
    assert isinstance(layers, int)
    window = window_of(present, MISTRAL_WINDOW)
    pattern = layer_types(present, layers)
    if pattern is None:
        pattern = (int(window is not None),) * layers
    return window_values_sized(window, pattern)


def _write_ministral_window(config: ModelConfig) -> Mapping[str, object]:
    return {"sliding_window": config.attention.sliding_window, "layer_types": layer_types_of(config)}


MINISTRAL = MISTRAL.derive(
    "MinistralForCausalLM", "ministral",
    # MinistralConfig has no head_dim default and its attention takes head_dim as given.
    fields=(head_dim_field(REQUIRED, null_refused=HEAD_DIM_NULL),),
    rules=(ConfigRule(keys=("sliding_window", "layer_types"), model_fields=("sliding_window", "window_layers"),
                      read=_read_ministral_window, write=_write_ministral_window, null_keys=("sliding_window",)),),
    hf_notes={"sliding window": "sliding_window, layer_types"},
)
