"""Settings megatron-core does not compute, carried through Megatron checkpoints under their own names.

A family whose config.json has such a setting (Granite's ``embedding_multiplier``,
``residual_multiplier`` and ``logits_scaling``, Phi-3's longrope parameters) lists it in
``Family.megatron_carried``. Its ``ModelConfig`` field name is its args name; it is written to the
args (and, as a ``ModelConfig`` field, to ``pgconvert.json``) only where the model has it, so other
models' args stay as they are, read back from any Megatron checkpoint, and named in a notice on
every Megatron output (``--strict`` refuses a Megatron target), so that converting back to HF
restores it bit-exactly.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pgconvert.errors import CheckpointError
from pgconvert.io.limits import quote
from pgconvert.model.config import ModelConfig


@dataclass(frozen=True)
class CarriedSetting:
    """One carried setting: its name (``ModelConfig`` field and args name), the value a model
    without it has, and how a value in args is read (``read(args, name, default, path)``: the
    value, ``default`` where absent; a bad one raises ``CheckpointError``)."""

    name: str
    default: object
    read: Callable[[argparse.Namespace, str, Any, Path], object]


def read_flag(args: argparse.Namespace, name: str, default: Any, path: Path) -> bool:
    """A ``CarriedSetting.read`` of a switch: True or False, ``default`` where absent or None."""
    value = getattr(args, name, None)
    if value is None:
        return bool(default)
    if not isinstance(value, bool):
        raise CheckpointError(f"{path}: args.{name}={quote(value)}: expected True or False")
    return value


def from_args(carried: Sequence[CarriedSetting], args: argparse.Namespace, path: Path) -> dict[str, Any]:
    """The carried settings' values ``args`` hold."""
    return {setting.name: setting.read(args, setting.name, setting.default, path) for setting in carried}


def to_args(carried: Sequence[CarriedSetting], config: ModelConfig) -> dict[str, Any]:
    """The args of the carried settings ``config`` has (those at their default are not written)."""
    return {setting.name: config.setting(setting.name) for setting in carried
            if config.setting(setting.name) != setting.default}


def uncomputed(carried: Sequence[CarriedSetting], config: ModelConfig) -> list[str]:
    """``name=value`` of each carried setting the model has."""
    return [f"{name}={value}" for name, value in to_args(carried, config).items()]
