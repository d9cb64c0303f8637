"""What the vision-language tests share: a conversion that returns its destination, and a rank file of a
conversion's iteration (weights-only, the test allowlist)."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import pgconvert
from support.megatron_fixtures import load_for_test


def converted(src: Path, dst: Path, **options: object) -> Path:
    """``pgconvert.convert(src, dst, **options)``; returns ``dst``."""
    pgconvert.convert(src, dst, **options)
    return dst


def rank_file(root: Path, rank_dir: str) -> dict[str, object]:
    """The rank file ``rank_dir`` of the iteration an HF source converts to (``iter_0000000``)."""
    return load_for_test(root / "iter_0000000" / rank_dir / "model_optim_rng.pt")


def edited_copy(root: Path, copy: Path, rank_dir: str, change: Callable[[dict[str, Any]], object]) -> Path:
    """A copy of the conversion at ``root`` in which rank file ``rank_dir`` (of ``iter_0000000``) is changed by
    ``change`` (called on the loaded state, then saved)."""
    shutil.copytree(root, copy)
    path = copy / "iter_0000000" / rank_dir / "model_optim_rng.pt"
    state = load_for_test(path)
    change(state)
    torch.save(state, path)
    return copy


def config_read_by_transformers(path: Path) -> dict[str, object]:
    """The config transformers reads from ``path``'s config.json (its nested text and vision configs included), as a
    dict without the path it was read from."""
    from transformers import AutoConfig

    return {key: value for key, value in AutoConfig.from_pretrained(path).to_dict().items() if key != "_name_or_path"}
