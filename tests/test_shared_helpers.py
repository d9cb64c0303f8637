"""The helpers every format shares (one definition each): extra-state emptiness, the target dtype,
the user's --src-* layout check, sizes and fsync."""

from __future__ import annotations

import io
import os
from pathlib import Path

import pytest
import torch
from support.tiny_models import GQA_SWIGLU
from support.megatron_fixtures import make_full_model, write_megatron_checkpoint

import pgconvert
from pgconvert.io.durable import fsync_dir, fsync_file
from pgconvert.errors import LayoutError
from pgconvert.formats import LoadOptions, target_dtype
from pgconvert.model.layout import ParallelLayout
from pgconvert.io.sizes import nbytes, numel
from pgconvert.formats.stream import ExtraState, holds_state


@pytest.mark.parametrize(("values", "expected"), [
    ([], False),
    ([None, torch.empty(0, dtype=torch.uint8), io.BytesIO()], False),
    ([None, torch.ones(1, dtype=torch.uint8)], True),
    ([io.BytesIO(b"fp8")], True),
])
def test_holds_state_ignores_none_and_empty_entries(values: list[object], expected: bool) -> None:
    extra = ExtraState(tp_size=2, by_rank={(index, 0): value for index, value in enumerate(values)})

    assert holds_state(values) is expected
    assert extra.holds_state() is expected


@pytest.mark.parametrize(("source", "requested", "keep", "expected"), [
    (torch.float32, None, False, torch.float32),
    (torch.float32, torch.bfloat16, False, torch.bfloat16),
    (torch.float32, torch.bfloat16, True, torch.float32),
    (torch.int64, torch.bfloat16, False, torch.int64),
])
def test_target_dtype_casts_only_floating_point_tensors_not_kept(
        source: torch.dtype, requested: torch.dtype | None, keep: bool, expected: torch.dtype) -> None:
    assert target_dtype(source, requested, keep) == expected


def test_load_options_check_layout_names_the_flag_the_value_and_the_file() -> None:
    layout = ParallelLayout(tp=2, pp=1, ep=1)

    LoadOptions(src_tp=2).check_layout(layout, Path("x/common.pt"))
    with pytest.raises(LayoutError, match=r"--src-pp 4: the checkpoint's args say 1 \(x/common.pt\)"):
        LoadOptions(src_pp=4).check_layout(layout, Path("x/common.pt"))


def test_a_torch_dist_source_refuses_a_contradicting_src_tp(tmp_path: Path) -> None:
    src = write_megatron_checkpoint(tmp_path / "src", GQA_SWIGLU, make_full_model(GQA_SWIGLU), 2, 1)
    dist = pgconvert.convert(src, tmp_path / "dist", dst_format="torch_dist").dst

    with pytest.raises(LayoutError, match=r"--src-tp 4: the checkpoint's args say 2 \(.*iter_0000100/__0_1\.distcp \(common_state/shard_0_1\)\)"):
        pgconvert.convert(dist, tmp_path / "out", src_tp=4, dst_tp=1)


def test_sizes_and_fsync(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    synced: list[int] = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real_fsync(fd)))
    path = tmp_path / "file"
    path.write_bytes(b"data")

    fsync_file(path)
    fsync_dir(tmp_path)

    assert len(synced) == 2
    assert (numel((3, 4, 5)), numel(())) == (60, 1)
    assert nbytes((3, 4), torch.bfloat16) == 24
