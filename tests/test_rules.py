"""Sharding rules: split/merge are inverse, and cut exactly where Megatron cuts."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import pytest
import torch

from pgconvert.run.example import example_config, example_source
from pgconvert.model.provider import WORD_EMBEDDINGS
from pgconvert.model.rules import (COLUMN, GATED, REPLICATED, ROW, VOCAB, Chunked, ReplicaMismatchError, Segmented,
                                   ShardRule, Window, assemble)


def filled(*shape: int) -> torch.Tensor:
    return torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape)


# Segments of unequal rows, each a multiple of 8 (the largest size the tests cut by): a Mamba in_proj's shape.
SEGMENTED = Segmented((16, 8, 8))


@pytest.mark.parametrize("size", [1, 2, 4])
@pytest.mark.parametrize("rule", [COLUMN, ROW, GATED, VOCAB, Segmented((8, 4, 4))],
                         ids=["column", "row", "gated", "vocab", "segmented"])
def test_merge_of_split_is_identity(rule: object, size: int) -> None:
    full = filled(16, 8) + torch.randn(16, 8, generator=torch.Generator().manual_seed(size))

    shards = rule.split(full, size)

    assert len(shards) == size
    assert all(tuple(s.shape) == rule.local_shape(full.shape, size) for s in shards)
    assert torch.equal(rule.merge(shards), full)


@pytest.mark.parametrize("size", [1, 2, 4])
def test_shard_equals_the_matching_piece_of_split(size: int) -> None:
    full = filled(16, 8)
    for rule in (COLUMN, ROW, GATED):
        pieces = rule.split(full, size)
        for rank in range(size):
            assert torch.equal(rule.shard(full, size, rank), pieces[rank])


def test_gated_rank_holds_its_gate_rows_then_its_up_rows() -> None:
    gate = filled(8, 2)
    up = filled(8, 2) + 1000
    full = torch.cat([gate, up])

    shards = GATED.split(full, 2)

    assert torch.equal(shards[0], torch.cat([gate[:4], up[:4]]))
    assert torch.equal(shards[1], torch.cat([gate[4:], up[4:]]))
    # A plain concat of the shards is not the full tensor: the rule is what makes it right.
    assert not torch.equal(torch.cat(shards), full)


def test_row_rule_cuts_columns() -> None:
    full = filled(4, 6)

    shards = ROW.split(full, 3)

    assert [tuple(s.shape) for s in shards] == [(4, 2)] * 3
    assert torch.equal(shards[2], full[:, 4:])


def test_replicated_merge_checks_every_replica() -> None:
    full = filled(5)
    replicas = [full.clone(), full.clone(), full.clone()]
    replicas[2][1] += 1

    with pytest.raises(ReplicaMismatchError) as caught:
        REPLICATED.merge(replicas)

    assert caught.value.ranks == (0, 2)
    assert torch.equal(REPLICATED.merge([full, full.clone()]), full)


@pytest.mark.parametrize("src_size", [1, 2, 4, 8])
@pytest.mark.parametrize("dst_size", [1, 2, 4, 8])
@pytest.mark.parametrize("rule", [COLUMN, ROW, GATED, REPLICATED, SEGMENTED],
                         ids=["column", "row", "gated", "replicated", "segmented"])
def test_reshard_equals_shard_of_merge_without_aliasing(rule: object, src_size: int, dst_size: int) -> None:
    full = filled(32, 16)
    pieces = [piece.clone() for piece in rule.split(full, src_size)]

    for rank in range(dst_size):
        direct = rule.reshard(pieces, dst_size, rank)

        assert torch.equal(direct, rule.shard(full, dst_size, rank).contiguous())
        assert direct.is_contiguous()
        assert all(direct.untyped_storage().data_ptr() != p.untyped_storage().data_ptr() for p in pieces)


@pytest.mark.parametrize("rows", [12, 16, 24])
@pytest.mark.parametrize(("src_size", "dst_size"), [(1, 4), (4, 2), (2, 4), (4, 4)])
def test_vocab_reshard_rows_keeps_rows_that_fit_and_zero_fills_the_rest(rows: int, src_size: int,
                                                                       dst_size: int) -> None:
    table = filled(16, 3) + 1
    pieces = [piece.clone() for piece in VOCAB.split(table, src_size)]
    fitted = torch.cat([table[:rows], torch.zeros(max(rows - 16, 0), 3)])
    step = rows // dst_size

    for rank in range(dst_size):
        direct = VOCAB.reshard_rows(pieces, rows, 10, dst_size, rank)

        assert torch.equal(direct, fitted[rank * step:(rank + 1) * step])


def test_vocab_reshard_rows_refuses_fewer_rows_than_the_true_vocab() -> None:
    with pytest.raises(ValueError, match="padded size 8 is smaller than the true vocab 10"):
        VOCAB.reshard_rows([filled(16, 3)], 8, 10, 1, 0)


# --- piece_windows: the windows the readers cut a destination piece from ---------------------------

def test_piece_windows_chunked_column_and_row() -> None:
    assert COLUMN.piece_windows((12, 4), 3, 1) == (Window(0, 4, 4),)
    assert ROW.piece_windows((4, 12), 4, 3) == (Window(1, 9, 3),)
    assert REPLICATED.piece_windows((5, 2), 4, 2) == (Window(0, 0, 5),)


def test_piece_windows_gated_are_gate_r_then_up_r() -> None:
    # global [gate (8 rows); up (8 rows)], tp 4: rank 2 holds gate rows 4..6 and up rows 12..14
    assert GATED.piece_windows((16, 3), 4, 2) == (Window(0, 4, 2), Window(0, 12, 2))
    full = torch.arange(16 * 3).reshape(16, 3)
    piece = assemble(GATED.piece_windows(full.shape, 4, 2), lambda w, out: out.copy_(full.narrow(w.dim, w.start, w.length)),
                     full.shape, full.dtype)
    assert torch.equal(piece, torch.cat([full[4:6], full[12:14]]))
    assert torch.equal(piece, GATED.shard(full, 4, 2))


def test_piece_windows_vocab_zero_fill_past_stored_rows() -> None:
    # 10 stored rows fitted to 16 padded rows over tp 2: rank 0 reads 0..8, rank 1 reads 8..10, zeros 10..16
    assert VOCAB.piece_windows((10, 4), 2, 0, rows=16) == (Window(0, 0, 8),)
    assert VOCAB.piece_windows((10, 4), 2, 1, rows=16) == (Window(0, 8, 2), Window(0, 10, 6, zeros=True))
    # a rank entirely past the stored rows is all zeros
    assert VOCAB.piece_windows((10, 4), 4, 3, rows=16) == (Window(0, 12, 4, zeros=True),)
    # shrinking keeps the first rows (the padding beyond is dropped)
    assert VOCAB.piece_windows((16, 4), 2, 1, rows=12) == (Window(0, 6, 6),)
    full = torch.arange(1.0, 41.0).reshape(10, 4)
    piece = assemble(VOCAB.piece_windows(full.shape, 2, 1, rows=16), lambda w, out: out.copy_(full.narrow(0, w.start, w.length)),
                     full.shape, full.dtype)
    assert torch.equal(piece, torch.cat([full[8:10], torch.zeros(6, 4)]))
    assert torch.equal(piece, VOCAB.reshard_rows([full], 16, 10, 2, 1))
    with pytest.raises(ValueError, match="smaller than the true vocab"):
        VOCAB.piece_windows((10, 4), 2, 0, rows=8, true_rows=10)


# --- what the callers ask the rule instead of testing its type -------------------------------------

@pytest.mark.parametrize("rule", [REPLICATED, COLUMN, ROW, GATED], ids=["replicated", "column", "row", "gated"])
def test_rules_without_padded_rows_reshard_the_same_whatever_rows_are_asked(rule: ShardRule) -> None:
    full = filled(16, 8)
    pieces = [piece.clone() for piece in rule.split(full, 2)]

    for rank in range(4):
        assert torch.equal(rule.reshard_rows(pieces, 24, 10, 4, rank), rule.reshard(pieces, 4, rank))
    assert not rule.fits_rows
    assert rule.replicated == (rule is REPLICATED)


def test_vocab_reshard_rows_without_rows_is_a_plain_reshard() -> None:
    table = filled(16, 3)

    assert VOCAB.fits_rows and not VOCAB.replicated
    assert torch.equal(VOCAB.reshard_rows(VOCAB.split(table, 4), None, 10, 2, 1), table[8:])


@dataclass(frozen=True)
class _PaddedColumn(Chunked):
    """A plugin's rule outside the VocabParallel family that also fits padded rows."""

    fits_rows = True

    def reshard_rows(self, shards: Sequence[torch.Tensor], rows: int | None, true_rows: int | None, size: int,
                     rank: int) -> torch.Tensor:
        return VOCAB.reshard_rows(shards, rows, true_rows, size, rank)


def test_a_source_fits_rows_for_any_rule_that_says_it_fits_rows() -> None:
    config = example_config()
    source = example_source(config)
    table = source.load(WORD_EMBEDDINGS)
    rows = table.shape[0] + 8

    piece = source.load_shard(WORD_EMBEDDINGS, _PaddedColumn(), 2, 1, rows=rows)

    assert piece.shape == (rows // 2, table.shape[1])
    assert torch.equal(piece, torch.cat([table, torch.zeros(8, table.shape[1], dtype=table.dtype)])[rows // 2:])
