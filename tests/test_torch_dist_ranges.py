"""torch_dist sources read with positional system calls (``pgconvert/io/dcp_records.py``, ``io.ranges``).

The box a request needs of each stored chunk is a strided region of its ``.distcp`` file, read with
``os.preadv`` straight into its place in the destination piece; no file is memory-mapped. Conversions
from torch_dist sources are compared, tensor by tensor (torch.equal), with the fixtures' independent
writer at the destination layout, with short runs gathered (the default) and read one by one
(``SHORT_RUN`` lowered); single reads are compared with torch.distributed.checkpoint's own reader.
"""

from __future__ import annotations

import io
import mmap
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from support.checkpoint_compare import assert_same_ranks, read_dcp
from support.megatron_fixtures import TinyModel, make_full_model, write_megatron_checkpoint
from support.tiny_models import GQA_SWIGLU, MHA_GELU_TIED, MOE, QK_NORM_TE

import pgconvert
import pgconvert.io.ranges as ranges
from pgconvert.errors import CheckpointError
from pgconvert.formats import LoadOptions
from pgconvert.formats.torch_dist import read_dcp_metadata
from pgconvert.loaders.torch_dist import TorchDistLoader
from pgconvert.io.dcp_records import parse_tensor_record, read_box
from pgconvert.model.rules import COLUMN, ROW

ITERATION_DIR = "iter_0000100"
Layout = tuple[int, int, int]  # tp, pp, ep

# name: (model, the torch_dist source's layout, the destination's)
CONVERSIONS: dict[str, tuple[TinyModel, Layout, Layout]] = {
    # column pieces cut inside stored chunks along dim 0, row-parallel ones along dim 1
    "tp2_to_tp4": (GQA_SWIGLU, (2, 1, 1), (4, 1, 1)),
    # row-parallel chunks read into column windows of the destination piece (a strided target)
    "tp4_to_tp1": (GQA_SWIGLU, (4, 1, 1), (1, 1, 1)),
    # the tied vocab table's padded rows, and stages joined
    "pp2_to_pp1_tied_vocab": (MHA_GELU_TIED, (1, 2, 1), (2, 1, 1)),
    # bf16 records, stages split
    "bf16_pp1_to_pp4": (QK_NORM_TE, (2, 1, 1), (1, 4, 1)),
    # routed experts' stacked chunks regrouped, bf16
    "experts_ep2_to_ep4": (MOE, (2, 1, 2), (1, 2, 4)),
}


def to_torch_dist(model: TinyModel, full: dict[str, torch.Tensor], layout: Layout, root: Path) -> Path:
    tp, pp, ep = layout
    src = write_megatron_checkpoint(root / "src", model, full, tp, pp, ep=ep)
    pgconvert.convert(src, root / "dist", dst_format="torch_dist", dst_tp=tp, dst_pp=pp, dst_ep=ep)
    return root / "dist"


@pytest.mark.parametrize("short_run", [ranges.SHORT_RUN, 1], ids=["gathered", "run_by_run"])
@pytest.mark.parametrize("name", CONVERSIONS)
def test_conversions_from_torch_dist_equal_the_writer_at_the_destination_layout(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, short_run: int) -> None:
    model, source, (tp, pp, ep) = CONVERSIONS[name]
    full = make_full_model(model)
    dist = to_torch_dist(model, full, source, tmp_path)
    monkeypatch.setattr(ranges, "SHORT_RUN", short_run)
    monkeypatch.setattr(ranges, "LONG_RUN", ranges.LONG_RUN if short_run > 1 else 1)  # 1: scattered

    pgconvert.convert(dist, tmp_path / "dst", src_format="torch_dist", dst_format="megatron", dst_tp=tp, dst_pp=pp,
                      dst_ep=ep)

    assert_same_ranks(tmp_path / "dst", write_megatron_checkpoint(tmp_path / "expected", model, full, tp, pp, ep=ep))


# --------------------------------------------------------------------------- bytes through preadv


class Reads:
    """``os.preadv`` counted (calls, bytes), and the file mappings made, while installed."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls = self.bytes = 0
        self.mapped: list[Any] = []
        preadv, mapping = os.preadv, mmap.mmap

        def counting(fd: int, buffers: list[memoryview], offset: int, *flags: int) -> int:
            got = preadv(fd, buffers, offset, *flags)
            self.calls += 1
            self.bytes += got
            return got

        def recording(fileno: int, *args: Any, **kwargs: Any) -> mmap.mmap:
            if fileno != -1:  # anonymous buffers (the output files' staging) are no file mapping
                self.mapped.append(fileno)
            return mapping(fileno, *args, **kwargs)

        monkeypatch.setattr(os, "preadv", counting)
        monkeypatch.setattr(mmap, "mmap", recording)


@pytest.fixture
def dist_tp1(tmp_path: Path) -> Path:
    return to_torch_dist(GQA_SWIGLU, make_full_model(GQA_SWIGLU), (1, 1, 1), tmp_path)


def stored_layer(dist: Path, key: str, layer: int) -> torch.Tensor:
    """Layer ``layer`` of the stacked key ``key``, read by torch.distributed.checkpoint's own reader."""
    return read_dcp(dist / ITERATION_DIR)[1][key][layer]


def test_a_box_contiguous_in_its_chunk_is_one_preadv_of_its_bytes(dist_tp1: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    name = "decoder.layers.2.self_attention.linear_qkv.weight"
    source = TorchDistLoader().open(dist_tp1, LoadOptions())
    reads = Reads(monkeypatch)

    piece = source.load_shard(name, COLUMN, 2, 1)  # rows 64..127 of layer 2 of the stacked [4, 128, 64] key

    assert (reads.calls, reads.bytes, reads.mapped) == (1, piece.nbytes, [])
    assert torch.equal(piece, stored_layer(dist_tp1, source.model_key(name), 2)[64:])


@pytest.mark.parametrize("short_run", [ranges.SHORT_RUN, 1], ids=["gathered", "run_by_run"])
def test_a_box_cut_along_dim_1_reads_its_runs_or_their_span(dist_tp1: Path, monkeypatch: pytest.MonkeyPatch,
                                                            short_run: int) -> None:
    name = "decoder.layers.2.self_attention.linear_proj.weight"
    source = TorchDistLoader().open(dist_tp1, LoadOptions())
    monkeypatch.setattr(ranges, "SHORT_RUN", short_run)
    monkeypatch.setattr(ranges, "LONG_RUN", ranges.LONG_RUN if short_run > 1 else 1)  # 1: scattered
    reads = Reads(monkeypatch)

    piece = source.load_shard(name, ROW, 2, 1)  # columns 32..63 of layer 2's [64, 64]: 64 runs of 128 bytes

    assert piece.shape == (64, 32) and reads.mapped == []
    if short_run == 1:  # each run by itself, straight into its row of the piece
        assert (reads.calls, reads.bytes) == (64, piece.nbytes)
    else:  # one span, from the first run's start to the last run's end, gathered
        assert (reads.calls, reads.bytes) == (1, (63 * 64 + 32) * 4)
    assert torch.equal(piece, stored_layer(dist_tp1, source.model_key(name), 2)[:, 32:])


def test_a_conversion_reads_every_tensor_byte_with_preadv_and_maps_no_file(dist_tp1: Path, tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    tensors = read_dcp(dist_tp1 / ITERATION_DIR)[1]
    reads = Reads(monkeypatch)

    pgconvert.convert(dist_tp1, tmp_path / "dst", src_format="torch_dist", dst_format="megatron", dst_tp=2)

    assert reads.mapped == []
    assert reads.bytes >= sum(tensor.nbytes for tensor in tensors.values())


# --------------------------------------------------------------------------- truncated files


def saved_record(path: Path, tensor: torch.Tensor) -> tuple[int, int]:
    """``tensor`` saved as one record after three other bytes of ``path``: (offset, length)."""
    buffer = io.BytesIO()
    torch.save(tensor, buffer)
    path.write_bytes(b"odd" + buffer.getvalue())
    return 3, len(buffer.getvalue())


def with_fd(path: Path, use: Callable[[int], None]) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        use(fd)
    finally:
        os.close(fd)


def test_a_file_truncated_after_its_record_was_parsed_is_named(tmp_path: Path) -> None:
    path = tmp_path / "__0_0.distcp"
    tensor = torch.arange(4096, dtype=torch.float32).reshape(64, 64)
    offset, length = saved_record(path, tensor)

    def read_after_truncation(fd: int) -> None:
        record = parse_tensor_record(fd, offset, length, "record")
        os.truncate(path, record.data_offset + 1000)  # inside the tensor's bytes
        read_box(fd, path, record, [0, 0], [64, 64], torch.empty(64, 64), "record")

    with pytest.raises(CheckpointError, match=rf"{re.escape(str(path))}: the file ends at byte \d+, but a tensor's bytes run to "
                                              r"byte \d+; the file is truncated"):
        with_fd(path, read_after_truncation)


def test_a_data_file_truncated_between_two_reads_is_named(dist_tp1: Path) -> None:
    name = "decoder.layers.2.self_attention.linear_qkv.weight"
    source = TorchDistLoader().open(dist_tp1, LoadOptions())
    source.load_shard(name, COLUMN, 2, 0)  # the record is parsed and kept
    stored = read_dcp_metadata(dist_tp1 / ITERATION_DIR / ".metadata").storage_data
    info = next(info for index, info in stored.items()  # layer 2's chunk of the stacked key
                if index.fqn == source.model_key(name) and index.offset[0] == 2)
    data = dist_tp1 / ITERATION_DIR / info.relative_path
    os.truncate(data, info.offset + info.length // 2)  # inside the record's tensor bytes

    with pytest.raises(CheckpointError, match=rf"{re.escape(str(data))}: '[^']+' is stored at offset {info.offset}, "
                                              rf"length {info.length}, which does not lie inside the file's "
                                              rf"{info.offset + info.length // 2} bytes"):
        source.load_shard(name, COLUMN, 2, 1)
