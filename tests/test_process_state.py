"""A conversion leaves torch's process-wide serialization settings as it found them (no global
``compute_crc32`` / mmap switch, no safe-globals left registered)."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.utils.serialization.config as serialization_config
from support.tiny_models import QK_NORM_TE
from support.megatron_fixtures import make_full_model, write_megatron_checkpoint

import pgconvert


def _torch_settings() -> tuple[object, ...]:
    # torch's own modules register their classes as safe globals when first imported: not ours.
    registered = [entry for entry in torch.serialization.get_safe_globals()
                  if not str(getattr(entry, "__module__", "")).startswith("torch")]
    return (serialization_config.get_config_copy(), torch.serialization.get_crc32_options(),
            torch.serialization.get_default_mmap_options(), registered)


def test_conversions_leave_torch_serialization_settings_unchanged(tmp_path: Path) -> None:
    before = _torch_settings()
    src = write_megatron_checkpoint(tmp_path / "src", QK_NORM_TE, make_full_model(QK_NORM_TE), 2, 1)

    pgconvert.convert(src, tmp_path / "tp1", dst_tp=1)
    pgconvert.convert(tmp_path / "tp1", tmp_path / "dist", dst_format="torch_dist")
    pgconvert.convert(tmp_path / "dist", tmp_path / "back", dst_format="megatron", dst_tp=2)
    pgconvert.verify(src, tmp_path / "back")

    assert _torch_settings() == before
