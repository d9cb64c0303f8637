"""Formats: the contract between the orchestrator and format plugins (``contract.py``: ``Loader``,
``Saver``, their options and results), the registry of formats, the canonical stream, and what a
loader and a saver of one format share.

The contract's names are importable from here (``from pgconvert.formats import Loader``), loaded on
first use: the names a command line offers (``names.py``) come without importing torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__all__ = [
    "DTYPE_CHOICES",
    "Progress",
    "RELEASE",
    "Iteration",
    "LoadOptions",
    "SaveOptions",
    "target_dtype",
    "target_config",
    "PlannedFile",
    "SaveResult",
    "TRAINING_STATE_NOT_CARRIED",
    "OptimizerOptions",
    "OptimizerInModelFiles",
    "OptimizerFile",
    "CarriedOptimizer",
    "Loader",
    "Saver",
]
CONTRACT_NAMES = frozenset(__all__)

if TYPE_CHECKING:
    from pgconvert.formats.contract import (
        DTYPE_CHOICES,
        Progress,
        RELEASE,
        Iteration,
        LoadOptions,
        SaveOptions,
        target_dtype,
        target_config,
        PlannedFile,
        SaveResult,
        TRAINING_STATE_NOT_CARRIED,
        OptimizerOptions,
        OptimizerInModelFiles,
        OptimizerFile,
        CarriedOptimizer,
        Loader,
        Saver,
    )


def __getattr__(name: str) -> Any:
    if name not in CONTRACT_NAMES:
        raise AttributeError(f"module 'pgconvert.formats' has no attribute {name!r}")
    value = getattr(importlib.import_module("pgconvert.formats.contract"), name)
    globals()[name] = value
    return value
