"""Sliding-window attention in config.json: the pieces the families' window rules share.

A model's window is ``ModelConfig.attention.sliding_window`` with ``window_layers`` (0/1 per layer, None: every
layer). config.json spells it per family: ``sliding_window`` on every layer (Mistral, Mixtral,
Phi-3: ``every_layer_window``), or on the layers ``layer_types`` marks ``sliding_attention``
(transformers' own default pattern where it is absent, which each family's rule gives). An absent
``sliding_window`` is the config class's default; a null is no window, and refused where layers are
marked sliding (transformers cannot build that mask). EXAONE 4 and Cohere2 rotate q and k on their windowed layers
alone: ``windowed_layers``, ``no_rope_of`` and ``refuses_other_rope`` give and check their ``no_rope_layers``.
"""

from __future__ import annotations

from collections.abc import Mapping

from pgconvert.io.limits import quote
from pgconvert.model.config import ModelConfig
from pgconvert.families.table import ConfigRule


def window_or_none(value: object, key: str) -> int | None:
    """A window size from config.json (null: none)."""
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{key}={quote(value)}: expected a positive integer or null")
    return value


def window_of(present: Mapping[str, object], default: int | None) -> int | None:
    """``sliding_window`` as transformers' config class reads it: its class ``default`` where absent,
    none where null (a rule reading it lists it in ``ConfigRule.null_keys``)."""
    return window_or_none(present.get("sliding_window", default), "sliding_window")


def window_values_sized(window: int | None, pattern: tuple[int, ...]) -> Mapping[str, object]:
    """``window_values``, refusing layers marked sliding without a size: transformers' sliding-window
    mask takes ``sliding_window`` as given and builds nothing from None."""
    if window is None and any(pattern):
        raise ValueError("sliding_window=null with layers that layer_types marks 'sliding_attention': "
                         "transformers' sliding-window mask needs a size")
    return window_values(window, pattern)


def layer_types(present: Mapping[str, object], layers: int) -> tuple[int, ...] | None:
    """``layer_types`` as a 0/1 per layer (1: sliding), None when absent."""
    types = present.get("layer_types")
    if types is None:
        return None
    if (not isinstance(types, list) or len(types) != layers
            or not all(kind in ("sliding_attention", "full_attention") for kind in types)):
        raise ValueError(f"layer_types={quote(types)}: expected {layers} of 'sliding_attention'/'full_attention'")
    return tuple(int(kind == "sliding_attention") for kind in types)


def periodic_layers(layers: int, period: int) -> tuple[int, ...]:
    """1 on every layer but each ``period``-th (1-based), which is 0: the configs' "every N-th layer" default (full
    attention among sliding or linear layers, a layer without RoPE)."""
    return tuple(int((layer + 1) % period != 0) for layer in range(layers))


def period_of(pattern: tuple[int, ...]) -> int | None:
    """The period whose ``periodic_layers`` is ``pattern``; None when no period gives it."""
    return next((period for period in range(1, len(pattern) + 1)
                 if pattern == periodic_layers(len(pattern), period)), None)


def sliding_layers(present: Mapping[str, object], layers: int, period: int) -> tuple[int, ...]:
    """``layer_types`` as a 0/1 per layer, by default every ``period``-th layer full attention and
    the others sliding (transformers' Gemma 2/3 and GPT-OSS configs)."""
    pattern = layer_types(present, layers)
    return periodic_layers(layers, period) if pattern is None else pattern


def window_values(window: int | None, pattern: tuple[int, ...]) -> Mapping[str, object]:
    """The ``ModelConfig`` window of ``window`` on the layers ``pattern`` marks."""
    if window is None or not any(pattern):
        return {"sliding_window": None, "window_layers": None}
    return {"sliding_window": window, "window_layers": None if all(pattern) else pattern}


def layer_types_of(config: ModelConfig) -> list[str]:
    """config.json's ``layer_types`` of a model."""
    return ["sliding_attention" if config.layers[layer].window else "full_attention"
            for layer in range(config.num_layers)]


def refuses_partial_window(config: ModelConfig) -> str | None:
    if config.attention.window_layers is not None:
        return f"window_layers={list(config.attention.window_layers)} (needs every layer windowed or none)"
    return None


def _write_every_layer_window(config: ModelConfig) -> Mapping[str, object]:
    return {"sliding_window": config.attention.sliding_window}


def every_layer_window(default: int | None) -> ConfigRule:
    """Mistral, Mixtral, Phi-3: ``sliding_window`` applies to every layer (null: none; absent: the
    config class's ``default``, Mistral's 4096, Mixtral's and Phi-3's none)."""

    def read(present: Mapping[str, object], model: Mapping[str, object]) -> Mapping[str, object]:
        return {"sliding_window": window_of(present, default), "window_layers": None}

    return ConfigRule(keys=("sliding_window",), model_fields=("sliding_window", "window_layers"),
                      read=read, write=_write_every_layer_window, refuses=refuses_partial_window,
                      null_keys=("sliding_window",))


def _period(present: Mapping[str, object], key: str | None, default: int) -> int:
    value = present.get(key, default) if key is not None else default
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{key}={quote(value)}: expected a positive integer")
    return value


def layer_types_window(present: Mapping[str, object], model: Mapping[str, object], period: int,
                       period_key: str | None = None, default_window: int = 4096) -> Mapping[str, object]:
    """``sliding_window`` (the config class's ``default_window``, transformers' 4096 but for GPT-OSS's 128; null:
    none, refused with sliding layers) on the layers ``layer_types`` marks sliding (by default every
    ``period``-th layer full, as Gemma 2/3's, OLMo 3's and GPT-OSS's configs fill it; Gemma 3's also reads the
    period from the older ``sliding_window_pattern``, its ``period_key``)."""
    layers = model["num_layers"]
    assert isinstance(layers, int)
    pattern = sliding_layers(present, layers, _period(present, period_key, period))
    return window_values_sized(window_of(present, default_window), pattern)


def write_layer_types_window(config: ModelConfig) -> Mapping[str, object]:
    return {"sliding_window": config.attention.sliding_window, "layer_types": layer_types_of(config)}


def layer_types_window_rule(period: int, period_key: str | None = None) -> ConfigRule:
    """The rule of ``layer_types_window``: keys ``sliding_window`` and ``layer_types``."""

    def read(present: Mapping[str, object], model: Mapping[str, object]) -> Mapping[str, object]:
        return layer_types_window(present, model, period, period_key)

    return ConfigRule(keys=("sliding_window", "layer_types"), model_fields=("sliding_window", "window_layers"),
                      read=read, write=write_layer_types_window, null_keys=("sliding_window",),
                      legacy_keys=() if period_key is None else (period_key,))


# Mixtral's and Phi-3's: no window unless config.json gives one.
EVERY_LAYER_WINDOW = every_layer_window(None)


# --- RoPE on the windowed layers alone (EXAONE 4's and Cohere2's attention) -------------------------

def windowed_layers(config: ModelConfig) -> tuple[int, ...]:
    """1 for each layer that looks through a window."""
    return tuple(int(config.attention.sliding_window is not None and config.layers[layer].window)
                 for layer in range(config.num_layers))


def no_rope_of(rotated: tuple[int, ...]) -> tuple[int, ...] | None:
    """megatron-core's ``no_rope_freq`` (1: no RoPE) of the layers ``rotated`` marks 1; None where every one is."""
    return None if all(rotated) else tuple(1 - flag for flag in rotated)


def refuses_other_rope(config: ModelConfig, rotated: tuple[int, ...], rule: str) -> str | None:
    """Why ``config`` is not a model that rotates exactly the layers ``rotated`` marks (``rule`` says which those
    are), None when it is."""
    no_rope, needed = config.positions.no_rope_layers, no_rope_of(rotated)
    if no_rope == needed:
        return None
    return (f"no_rope_layers={None if no_rope is None else list(no_rope)} "
            f"(needs {None if needed is None else list(needed)}: {rule})")
