"""Vocab tables fitted to the target's padding through real conversions (the production path):
padding rows pgconvert adds are zeros, source padding rows are kept where the target has room."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from support.checkpoint_compare import read_dcp
from support.tiny_models import GQA_SWIGLU
from support.hf_helpers import build_hf_model, load_hf_tensors, save_hf_model
from support.megatron_fixtures import load_for_test, make_full_model, write_megatron_checkpoint

import pgconvert

EMBEDDING = "embedding.word_embeddings.weight"
OUTPUT = "output_layer.weight"
# 300 true rows, padded to a multiple of 64·tp: 320 at tp=1, 384 at tp=2, 512 at tp=4.
SMALL_VOCAB = replace(GQA_SWIGLU, vocab_size=300, make_vocab_size_divisible_by=64)


def _megatron_table(root: Path, name: str) -> torch.Tensor:
    """The global table ``name`` of a pp=1 or last-stage megatron output, TP pieces joined in rank order."""
    pieces: dict[int, torch.Tensor] = {}
    for path in sorted(root.glob("iter_*/mp_rank_*/model_optim_rng.pt")):
        model = load_for_test(path)["model"]
        if name in model:
            pieces.setdefault(int(path.parent.name.split("_")[2]), model[name])
    return torch.cat([pieces[rank] for rank in sorted(pieces)], dim=0)


@pytest.fixture(scope="module")
def llama_hf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_hf_model(build_hf_model("llama"), tmp_path_factory.mktemp("hf") / "llama")


@pytest.mark.parametrize(("hf_name", "megatron_name"), [("model.embed_tokens.weight", EMBEDDING),
                                                          ("lm_head.weight", OUTPUT)])
def test_padding_rows_written_to_megatron_from_an_hf_source_are_zeros(
        llama_hf: Path, tmp_path: Path, hf_name: str, megatron_name: str) -> None:
    pgconvert.convert(llama_hf, tmp_path / "tp4", dst_format="megatron", dst_tp=4)

    table = _megatron_table(tmp_path / "tp4", megatron_name)
    source = load_hf_tensors(llama_hf)[hf_name]
    assert table.shape == (1024, source.shape[1])  # 1000 rows, padded to a multiple of 128·4
    assert torch.equal(table[:1000], source)
    assert torch.count_nonzero(table[1000:]) == 0


def test_padding_rows_written_to_torch_dist_from_an_hf_source_are_zeros(llama_hf: Path, tmp_path: Path) -> None:
    pgconvert.convert(llama_hf, tmp_path / "dist", dst_format="torch_dist", dst_tp=2)

    _, tensors = read_dcp(next((tmp_path / "dist").glob("iter_*")))
    source = load_hf_tensors(llama_hf)
    for key, hf_name in ((EMBEDDING, "model.embed_tokens.weight"), (OUTPUT, "lm_head.weight")):
        table = tensors[key]
        assert table.shape == (1024, 64), key
        assert torch.equal(table[:1000], source[hf_name]), key
        assert torch.count_nonzero(table[1000:]) == 0, key


@pytest.mark.parametrize("dst_tp", [1, 4])
def test_vocab_tables_fit_another_padding_keeping_source_padding_that_fits(tmp_path: Path, dst_tp: int) -> None:
    full = make_full_model(SMALL_VOCAB)
    src = write_megatron_checkpoint(tmp_path / "src", SMALL_VOCAB, full, 2, 1)
    # Megatron-LM's converter pads by repeating the last row: the source's padding is not zero.
    for path in sorted(src.glob("iter_*/mp_rank_*/model_optim_rng.pt"))[1:]:
        state = load_for_test(path)
        for name in (EMBEDDING, OUTPUT):
            state["model"][name][300 - 192:] = 7.0
        torch.save(state, path)
    source_table = _megatron_table(src, EMBEDDING)
    assert source_table.shape[0] == 384 and torch.equal(source_table[:300], full[EMBEDDING])

    pgconvert.convert(src, tmp_path / "dst", dst_tp=dst_tp)

    for name in (EMBEDDING, OUTPUT):
        table = _megatron_table(tmp_path / "dst", name)
        if dst_tp == 1:
            assert torch.equal(table, _megatron_table(src, name)[:320]), name
        else:
            assert table.shape[0] == 512, name
            assert torch.equal(table[:384], _megatron_table(src, name)), name
            assert torch.count_nonzero(table[384:]) == 0, name
