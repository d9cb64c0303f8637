"""f17a: the Megatron side of the settings Granite and SmolLM3 add (see pgconvert.semantics' rows).

* Granite's ``attention_multiplier`` is ``ModelConfig.softmax_scale``, megatron-core's
  ``TransformerConfig.softmax_scale`` (pgconvert.semantics.attention_scale carries it for every family);
* ``no_rope_layers`` is megatron-core's ``no_rope_freq`` (0/1 per layer, 1: the layer skips RoPE,
  ``Attention.forward``), which Megatron-LM's ``--no-rope-freq`` sets;
* ``embedding_multiplier``, ``residual_multiplier`` and ``logits_scaling`` have no megatron-core
  setting and no Megatron-Bridge bridge (it has no Granite model): they are carried under
  transformers' GraniteConfig names in the args (and pgconvert.json's model_config), so a Megatron
  checkpoint converts back bit-exactly, and every Megatron output names them in a notice.

Nothing here imports pgconvert.semantics (which imports this module).
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pgconvert.model.config import ModelConfig
from pgconvert.errors import CheckpointError, StrictModeError
from pgconvert.io.limits import quote

# Settings megatron-core does not compute, by ModelConfig field (= args name), with their default.
UNCOMPUTED: dict[str, float] = {"embedding_multiplier": 1.0, "residual_multiplier": 1.0, "logits_scaling": 1.0}
# Every args name here that is neither megatron-core's nor Megatron-LM's.
CARRIED_ARGS: tuple[str, ...] = (*UNCOMPUTED, "hf_rope_parameters")


def positive_arg(args: argparse.Namespace, name: str, default: float | None, path: Path) -> float | None:
    """``args.<name>``, a positive finite number, or ``default`` when absent (None)."""
    value = getattr(args, name, None)
    if value is None:
        return default
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value <= 0:
        raise CheckpointError(f"{path}: args.{name}={quote(value)}: must be a positive finite number")
    return float(value)


def _no_rope_from_args(args: argparse.Namespace, path: Path) -> tuple[int, ...] | None:
    value = getattr(args, "no_rope_freq", None)
    layers = getattr(args, "num_layers", None)
    if value is None or value == 0 or not isinstance(layers, int):
        return None
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        # megatron-core: every value-th layer (1-based) skips RoPE.
        pattern = tuple(int((layer + 1) % value == 0) for layer in range(layers))
    elif isinstance(value, (list, tuple)) and all(v in (0, 1) and not isinstance(v, bool) for v in value):
        pattern = tuple(int(v) for v in value)
    else:
        raise CheckpointError(f"{path}: args.no_rope_freq={quote(value)}: expected an int or a 0/1 list")
    return pattern if any(pattern) else None


def from_args(args: argparse.Namespace, path: Path) -> dict[str, Any]:
    """The f17a ``ModelConfig`` values Megatron ``args`` give."""
    values: dict[str, Any] = {name: positive_arg(args, name, default, path) for name, default in UNCOMPUTED.items()}
    values["no_rope_layers"] = _no_rope_from_args(args, path)
    carried = getattr(args, "hf_rope_parameters", None)
    if carried is not None and not isinstance(carried, str):
        raise CheckpointError(f"{path}: args.hf_rope_parameters={quote(carried)}: expected JSON text")
    values["hf_rope_parameters"] = carried
    return values


def to_args(config: ModelConfig) -> dict[str, Any]:
    """The Megatron args of the f17a settings: megatron-core's always, the carried ones (no
    megatron-core meaning) only where the model has them, so other models' args stay as they were."""
    values: dict[str, Any] = {
        "no_rope_freq": None if config.no_rope_layers is None else list(config.no_rope_layers),
    }
    values.update({name: getattr(config, name) for name, default in UNCOMPUTED.items()
                   if getattr(config, name) != default})
    if config.hf_rope_parameters is not None:
        values["hf_rope_parameters"] = config.hf_rope_parameters
    return values


def uncomputed_settings(config: ModelConfig) -> list[str]:
    """``name=value`` of each setting the model has that megatron-core does not compute."""
    settings = [f"{name}={getattr(config, name)}" for name, default in UNCOMPUTED.items()
                if getattr(config, name) != default]
    if config.hf_rope_parameters is not None:
        settings.append(f"hf_rope_parameters={config.hf_rope_parameters}")
    return settings


def carries_rope(doc: Mapping[str, Any], rope_type: str) -> bool:
    """Whether the family of config.json ``doc`` carries RoPE type ``rope_type`` in hf_rope_parameters."""
    architectures = doc.get("architectures")
    if not isinstance(architectures, list) or not architectures or not isinstance(architectures[0], str):
        return False
    from pgconvert.families import FAMILIES  # fam17d (families imports pgconvert.semantics)

    family = FAMILIES.get(architectures[0])
    return family is not None and rope_type in family.hf_rope_types_carried


def check_megatron_target(config: ModelConfig, strict: bool, notices: list[str]) -> None:
    """A Megatron target of a model megatron-core computes differently: refused under ``strict``,
    else carried with a notice naming each setting."""
    settings = uncomputed_settings(config)
    if not settings:
        return
    message = (f"{', '.join(settings)}: megatron-core has no such setting, so a Megatron run of this checkpoint "
               "computes without it; carried in args (transformers' names) and pgconvert.json, so converting "
               "back to HF restores it")
    if strict:
        raise StrictModeError(f"--strict: refusing a target that computes differently: {message}")
    notices.append(message)
