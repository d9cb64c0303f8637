"""Resident memory while joining pieces of memory-mapped files: read from the files, never faulted in.

The resident pages of a file mapping are read from ``/proc/self/smaps`` (Linux only), so these
tests measure what counts in a conversion's peak RSS, not a proxy for it.
"""

from __future__ import annotations

import mmap
import os
import sys
from dataclasses import replace
from functools import partial
from pathlib import Path

import pytest
import torch
from support.tiny_models import GQA_SWIGLU
from support.megatron_fixtures import make_full_model, write_megatron_checkpoint

from pgconvert.formats import LoadOptions
from pgconvert.formats.registry import get_loader
from pgconvert.io.ranges import FileHandles, FileRegion, Locate, concat_reading
from pgconvert.io.torch_input import read_torch_structure, stored_offset
from pgconvert.model.rules import COLUMN, GATED, VOCAB, concatenating_with

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/smaps")

# A fault maps the whole page-cache folio around it (up to 2 MiB on kernels with large folios),
# or up to 64 KiB of neighbouring pages (fault-around); a piece's first and last folio may hold
# its neighbours' bytes.
FOLIO = max(2 * 2**20, mmap.PAGESIZE)
SLACK = 2 * FOLIO + 64 * 1024


def resident_bytes(paths: list[Path]) -> int:
    """Resident bytes of this process's mappings of ``paths``."""
    wanted = {str(path.resolve()) for path in paths}
    total = 0
    current = None
    with open("/proc/self/smaps") as handle:
        for line in handle:
            fields = line.split()
            if "-" in fields[0] and len(fields) >= 5 and not fields[0].endswith(":"):
                current = fields[5] if len(fields) >= 6 else None
            elif fields[0] == "Rss:" and current in wanted:
                total += int(fields[1]) * 1024
    return total


def mapped_pieces(tmp_path: Path, count: int, rows: int) -> tuple[Path, list[torch.Tensor], Locate]:
    """``count`` float32 pieces of ``rows`` x 256 saved in one file, loaded memory-mapped, and where each
    piece's bytes are in the file (as the Megatron loader learns it from the file's structure)."""
    pieces = {f"p{i}": torch.randn(rows, 256) for i in range(count)}
    path = tmp_path / "pieces.pt"
    torch.save(pieces, path)
    loaded = torch.load(path, mmap=True, weights_only=True)
    meta = read_torch_structure(path).meta
    starts = {loaded[key].untyped_storage().data_ptr(): stored_offset(meta[key]) for key in pieces}
    handles = FileHandles()

    def locate(view: torch.Tensor) -> tuple[int, FileRegion] | None:
        start = starts.get(view.untyped_storage().data_ptr())
        if start is None:
            return None
        offset = start + view.storage_offset() * view.element_size()
        return handles.fd(path), FileRegion(path, offset, tuple(view.shape), tuple(view.stride()), view.dtype)

    return path, [loaded[f"p{i}"] for i in range(count)], locate


def test_concat_reading_equals_cat_and_faults_nothing_in(tmp_path: Path) -> None:
    path, pieces, locate = mapped_pieces(tmp_path, 4, 8192)  # 8 MiB each
    # Two views of each piece (the gate and up halves of a SwiGLU fc1), and a zero block that is not mapped.
    halves = [piece.chunk(2, dim=0) for piece in pieces]
    views = [half[0] for half in halves] + [half[1] for half in halves] + [torch.zeros(3, 256)]
    joined = concat_reading(views, 0, locate)
    across = concat_reading(pieces, 1, locate)  # a row-parallel join: each piece lands strided

    # The pieces' bytes came from the file, not through the mapping: none of its pages became resident.
    assert resident_bytes([path]) <= SLACK
    assert torch.equal(joined, torch.cat(views, dim=0))
    assert torch.equal(across, torch.cat(pieces, dim=1))


def test_rules_join_through_concat_reading_without_faulting(tmp_path: Path) -> None:
    path, pieces, locate = mapped_pieces(tmp_path, 4, 8192)

    with concatenating_with(partial(concat_reading, locate=locate)):
        joined = COLUMN.merge(pieces)
        gated = GATED.reshard(pieces, 2, 1)
    resident = resident_bytes([path])

    assert resident <= SLACK
    assert torch.equal(joined, torch.cat(pieces, dim=0))
    assert torch.equal(gated, GATED.reshard([piece.clone() for piece in pieces], 2, 1))


def test_concat_reading_refuses_what_cat_refuses() -> None:
    with pytest.raises(ValueError, match="cannot concatenate"):
        concat_reading([torch.zeros(2, 3), torch.zeros(2, 4)], 0, lambda view: None)
    with pytest.raises(ValueError, match="cannot concatenate"):
        concat_reading([torch.zeros(2, 3), torch.zeros(2, 3, dtype=torch.float16)], 0, lambda view: None)


def test_rules_join_with_torch_cat_outside_the_block() -> None:
    pieces = [torch.randn(8, 4) for _ in range(2)]
    calls: list[int] = []

    def counting(views: list[torch.Tensor], dim: int) -> torch.Tensor:
        calls.append(dim)
        return torch.cat(views, dim=dim)

    with concatenating_with(counting):
        inside = GATED.merge(pieces)
    outside = GATED.merge(pieces)
    assert calls == [0] and torch.equal(inside, outside)


def test_megatron_loader_reads_a_vocab_table_without_faulting_its_pieces_in(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    # A vocab table of 65536 x 64 float32 (16 MiB) in 4 pieces of 4 MiB.
    model = replace(GQA_SWIGLU, vocab_size=65536)
    full = make_full_model(model)
    src = write_megatron_checkpoint(tmp_path / "src", model, full, 4, 1)
    files = sorted(src.rglob("model_optim_rng.pt"))
    read: list[int] = []
    real_preadv = os.preadv

    def counting_preadv(fd: int, buffers: list[memoryview], offset: int) -> int:
        read.append(real_preadv(fd, buffers, offset))
        return read[-1]

    monkeypatch.setattr(os, "preadv", counting_preadv)
    with get_loader("megatron").open(src, LoadOptions()) as source:
        before = resident_bytes(files)
        table = source.load("embedding.word_embeddings.weight")
        piece = source.load_shard("embedding.word_embeddings.weight", VOCAB, 2, 1, 65536)
        after = resident_bytes(files)
    assert torch.equal(table, full["embedding.word_embeddings.weight"])
    assert torch.equal(piece, full["embedding.word_embeddings.weight"][32768:])
    # Read from the files into the results (every byte of both), no page of the mappings made resident.
    assert sum(read) == table.nbytes + piece.nbytes
    assert after - before <= SLACK
