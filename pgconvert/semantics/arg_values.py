"""One value of a Megatron run's ``args``, checked: a bad value raises ``CheckpointError`` naming it."""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any

from pgconvert.errors import CheckpointError
from pgconvert.io.limits import quote


def arg(args: argparse.Namespace, name: str, default: Any) -> Any:
    """``args.<name>``, or ``default`` when absent or None."""
    value = getattr(args, name, None)
    return default if value is None else value


def number(args: argparse.Namespace, name: str, default: float, path: Path) -> float:
    """``args.<name>``, a finite number (one value per load-balancing type: the one)."""
    value = arg(args, name, default)
    if isinstance(value, (list, tuple)) and len(value) == 1:
        value = value[0]  # moe_aux_loss_coeff may be one value per load-balancing type
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise CheckpointError(f"{path}: args.{name}={quote(value)}: must be a finite number")
    return float(value)


def flag(args: argparse.Namespace, name: str, path: Path) -> bool:
    """``args.<name>``, True or False (absent: False)."""
    value = arg(args, name, False)
    if not isinstance(value, bool):
        raise CheckpointError(f"{path}: args.{name}={quote(value)}: expected True or False")
    return value


def positive(args: argparse.Namespace, name: str, default: float | None, path: Path) -> float | None:
    """``args.<name>``, a positive finite number, or ``default`` when absent (None)."""
    value = getattr(args, name, None)
    if value is None:
        return default
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value <= 0:
        raise CheckpointError(f"{path}: args.{name}={quote(value)}: must be a positive finite number")
    return float(value)


def positive_int(args: argparse.Namespace, name: str, default: Any, path: Path) -> Any:
    """``args.<name>``, a positive integer; ``default`` when absent or None (Megatron-LM's, for a None it never
    writes: pgconvert.formats.megatron_args names that in a notice)."""
    value = getattr(args, name, None)
    if value is None:
        return default
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise CheckpointError(f"{path}: args.{name}={quote(value)}: must be a positive integer")
    return value
