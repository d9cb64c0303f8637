"""Resident memory while joining memory-mapped pieces: one source piece at a time, not all of them.

The resident pages of a file mapping are read from ``/proc/self/smaps`` (Linux only), so these
tests measure what counts in a conversion's peak RSS, not a proxy for it.
"""

from __future__ import annotations

import mmap
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from support.tiny_models import GQA_SWIGLU
from support.megatron_fixtures import make_full_model, write_megatron_checkpoint

import pgconvert.io.memory as memory
from pgconvert.formats import LoadOptions
from pgconvert.io.memory import concat_releasing
from pgconvert.formats.registry import get_loader
from pgconvert.model.rules import COLUMN, GATED, concatenating_with

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


def mapped_pieces(tmp_path: Path, count: int, rows: int) -> tuple[Path, list[torch.Tensor]]:
    pieces = {f"p{i}": torch.randn(rows, 256) for i in range(count)}
    path = tmp_path / "pieces.pt"
    torch.save(pieces, path)
    loaded = torch.load(path, mmap=True, weights_only=True)
    return path, [loaded[f"p{i}"] for i in range(count)]


def test_concat_releasing_equals_cat_and_holds_one_piece_at_a_time(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    path, pieces = mapped_pieces(tmp_path, 4, 8192)  # 8 MiB each
    seen: list[int] = []
    real_release = memory.release_mapped_pages

    def measured_release(tensors):  # type: ignore[no-untyped-def]
        tensors = list(tensors)
        seen.append(resident_bytes([path]))
        real_release(tensors)

    monkeypatch.setattr(memory, "release_mapped_pages", measured_release)
    mapped = {piece.untyped_storage().data_ptr() for piece in pieces}
    # Two views of each piece (the gate and up halves of a SwiGLU fc1), and a zero block that is not mapped.
    halves = [piece.chunk(2, dim=0) for piece in pieces]
    views = [half[0] for half in halves] + [half[1] for half in halves] + [torch.zeros(3, 256)]
    joined = concat_releasing(views, 0, mapped)

    # Each piece is handed back once, after its last view (its up half) is copied.
    assert len(seen) == len(pieces)
    assert resident_bytes([path]) <= SLACK
    assert torch.equal(joined, torch.cat(views, dim=0))
    assert torch.equal(concat_releasing(pieces, 1, mapped), torch.cat(pieces, dim=1))


def test_concat_releasing_of_whole_pieces_holds_one_piece(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path, pieces = mapped_pieces(tmp_path, 4, 8192)
    seen: list[int] = []
    real_release = memory.release_mapped_pages
    monkeypatch.setattr(memory, "release_mapped_pages",
                        lambda tensors: (seen.append(resident_bytes([path])), real_release(tensors)))
    mapped = {piece.untyped_storage().data_ptr() for piece in pieces}

    with concatenating_with(lambda views, dim: concat_releasing(views, dim, mapped)):
        joined = COLUMN.merge(pieces)

    assert torch.equal(joined, torch.cat(pieces, dim=0))
    assert len(seen) == 4 and max(seen) <= pieces[0].nbytes + SLACK


def test_concat_releasing_refuses_what_cat_refuses() -> None:
    with pytest.raises(ValueError, match="cannot concatenate"):
        concat_releasing([torch.zeros(2, 3), torch.zeros(2, 4)], 0, set())
    with pytest.raises(ValueError, match="cannot concatenate"):
        concat_releasing([torch.zeros(2, 3), torch.zeros(2, 3, dtype=torch.float16)], 0, set())


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


def test_megatron_loader_holds_one_rank_piece_while_merging_a_vocab_table(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    # A vocab table of 65536 x 64 float32 (16 MiB) in 4 pieces of 4 MiB.
    model = replace(GQA_SWIGLU, vocab_size=65536)
    src = write_megatron_checkpoint(tmp_path / "src", model, make_full_model(model), 4, 1)
    files = sorted(src.rglob("model_optim_rng.pt"))
    loader = get_loader("megatron")  # imported before the patch: its own releases are not counted
    seen: list[int] = []
    real_release = memory.release_mapped_pages

    def measured_release(tensors):  # type: ignore[no-untyped-def]
        tensors = list(tensors)
        seen.append(resident_bytes(files))
        real_release(tensors)

    monkeypatch.setattr(memory, "release_mapped_pages", measured_release)
    with loader.open(src, LoadOptions()) as source:
        before = resident_bytes(files)
        table = source.load("embedding.word_embeddings.weight")
        after = resident_bytes(files)
        assert table.shape == (65536, 64)
        piece_bytes = table.nbytes // 4
        assert len(seen) == 4 and max(seen) - before <= piece_bytes + SLACK
        # A merged copy does not alias the pieces: their pages are handed back at once, not at the next load.
        assert after - before <= SLACK
