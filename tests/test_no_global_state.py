"""A conversion never touches torch.distributed and keeps no rank in module globals."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import torch
import torch.distributed
from support.tiny_models import GQA_SWIGLU
from support.megatron_fixtures import make_full_model, write_megatron_checkpoint

import pgconvert


def _project_modules() -> list[types.ModuleType]:
    return [module for name, module in sorted(sys.modules.items())
            if module is not None and name.split(".")[0] in ("pgconvert", "loaders", "savers")]


def test_full_conversion_leaves_torch_distributed_uninitialised(tmp_path: Path) -> None:
    src = write_megatron_checkpoint(tmp_path / "src", GQA_SWIGLU, make_full_model(GQA_SWIGLU), 8, 1)

    pgconvert.convert(src, tmp_path / "tp2pp2", dst_tp=2, dst_pp=2)
    pgconvert.convert(tmp_path / "tp2pp2", tmp_path / "tp4", dst_tp=4, dst_pp=1)

    assert torch.distributed.is_available()
    assert not torch.distributed.is_initialized()
    modules = _project_modules()
    assert {"pgconvert.loaders.megatron", "pgconvert.savers.megatron", "pgconvert.model.grid", "pgconvert.model.provider"} <= {m.__name__ for m in modules}
    rank_globals = [
        f"{module.__name__}.{name}"
        for module in modules
        for name, value in vars(module).items()
        if "rank" in name.lower() and isinstance(value, int) and not isinstance(value, bool)
    ]
    assert rank_globals == []
