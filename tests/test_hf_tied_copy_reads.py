"""A tied HF checkpoint that also stores the output weight: every read of the embedding checks the
stored copy, so a source answers the same on its second read as on its first."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from support.hf_helpers import build_hf_model, rewrite_as_single_file, save_hf_model

from pgconvert.errors import CheckpointError
from pgconvert.formats import LoadOptions
from pgconvert.loaders.hf import HFLoader
from pgconvert.model.provider import WORD_EMBEDDINGS
from pgconvert.model.rules import VOCAB

MISMATCH = r"lm_head.weight differs from model.embed_tokens.weight, but config.json ties them"


def _store_copy(src: Path, change: float) -> None:
    def store(tensors: dict[str, torch.Tensor]) -> None:
        copy = tensors["model.embed_tokens.weight"].clone()
        copy[-1, 0] += change  # the last true vocab row, on the last TP piece
        tensors["lm_head.weight"] = copy
    rewrite_as_single_file(src, store)


@pytest.fixture
def tied_with_copy(tmp_path: Path) -> Path:
    src = save_hf_model(build_hf_model("qwen2", seed=3), tmp_path / "qwen2")
    _store_copy(src, 0.0)
    return src


def test_every_read_of_a_tied_embedding_checks_the_stored_copy(tied_with_copy: Path) -> None:
    with HFLoader().open(tied_with_copy, LoadOptions()) as source:
        first = source.load(WORD_EMBEDDINGS).clone()
        assert torch.equal(source.load(WORD_EMBEDDINGS), first)

        _store_copy(tied_with_copy, 1.0)

        with pytest.raises(CheckpointError, match=MISMATCH):
            source.load(WORD_EMBEDDINGS)
        with pytest.raises(CheckpointError, match=MISMATCH):
            source.load(WORD_EMBEDDINGS)
        with pytest.raises(CheckpointError, match=MISMATCH):
            source.load_shard(WORD_EMBEDDINGS, VOCAB, 2, 1, rows=source.vocab_rows + 2)


def test_pieces_of_a_tied_embedding_equal_the_full_read(tied_with_copy: Path) -> None:
    with HFLoader().open(tied_with_copy, LoadOptions()) as source:
        rows = source.vocab_rows + 2
        pieces = [source.load_shard(WORD_EMBEDDINGS, VOCAB, 2, rank, rows=rows) for rank in range(2)]
        full = source.load(WORD_EMBEDDINGS)

    joined = torch.cat(pieces)
    assert torch.equal(joined[:full.shape[0]], full)
    assert torch.count_nonzero(joined[full.shape[0]:]) == 0
