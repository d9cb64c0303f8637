"""Spying on how pgconvert reads ``torch.save`` files as their structure (``formats.megatron.safe_torch_structure``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest


def patch_structure_reads(patch: pytest.MonkeyPatch, reading: Callable[..., Any]) -> None:
    """Install ``reading`` in place of ``safe_torch_structure`` wherever pgconvert's readers look it up: each module
    imported the function by name, so patching its home alone would reach none of them."""
    import pgconvert.formats.megatron as megatron_format
    import pgconvert.loaders.megatron as megatron_loader
    import pgconvert.loaders.megatron.distrib_optim as distrib_optim_loader
    import pgconvert.loaders.megatron.optimizer as optimizer_loader

    for module in (megatron_format, megatron_loader, distrib_optim_loader, optimizer_loader):
        patch.setattr(module, "safe_torch_structure", reading)
