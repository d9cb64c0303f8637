"""``verify``'s relative tolerance and its vocab-row boundary, through the CLI and the API."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from support.tiny_models import GQA_SWIGLU
from support.megatron_fixtures import load_for_test, make_full_model, write_megatron_checkpoint

import pgconvert
from pgconvert.cli import main

WEIGHT = "decoder.layers.1.mlp.linear_fc2.weight"
EMBEDDING = "embedding.word_embeddings.weight"
# GQA_SWIGLU at tp=2: 1000 true rows padded to 1024, rows 512.. on tp rank 1.
TRUE_VOCAB = GQA_SWIGLU.vocab_size
ROWS_PER_RANK = 512


def _rank_file(root: Path, tp_rank: int) -> Path:
    return root / "iter_0000100" / f"mp_rank_{tp_rank:02d}" / "model_optim_rng.pt"


def _edit(root: Path, tp_rank: int, name: str, index: tuple[int, int], value: float | None = None,
          add: float = 0.0) -> None:
    path = _rank_file(root, tp_rank)
    state = load_for_test(path)
    tensor = state["model"][name]
    tensor[index] = value if value is not None else tensor[index] + add
    torch.save(state, path)


@pytest.fixture
def pair(tmp_path: Path) -> tuple[Path, Path]:
    a = write_megatron_checkpoint(tmp_path / "a", GQA_SWIGLU, make_full_model(GQA_SWIGLU), 2, 1)
    b = Path(shutil.copytree(a, tmp_path / "b"))
    return a, b


def test_verify_rtol_scales_with_the_magnitude_of_the_values(pair: tuple[Path, Path]) -> None:
    a, b = pair
    _edit(a, 0, WEIGHT, (3, 5), value=100.0)
    _edit(b, 0, WEIGHT, (3, 5), value=100.1)  # 1e-3 relative, 0.1 absolute

    exact = CliRunner().invoke(main, ["verify", str(a), str(b)])
    loose = CliRunner().invoke(main, ["verify", "--rtol", "1e-2", str(a), str(b)])
    tight = CliRunner().invoke(main, ["verify", "--rtol", "1e-4", str(a), str(b)])

    assert exact.exit_code == 1, exact.output
    assert loose.exit_code == 0, loose.output
    assert "(rtol=0.01, atol=0.0): equal" in loose.output
    assert tight.exit_code == 1, tight.output
    assert f"differs: {WEIGHT}: 1 of" in tight.output
    report = pgconvert.verify(a, b, rtol=1e-4)
    assert [(d.name, d.differing) for d in report.differences] == [(WEIGHT, 1)]
    assert report.differences[0].max_abs_diff == pytest.approx(0.1, rel=1e-3)


def test_verify_compares_the_last_true_vocab_row(pair: tuple[Path, Path]) -> None:
    a, b = pair
    _edit(b, 1, EMBEDDING, (TRUE_VOCAB - 1 - ROWS_PER_RANK, 7), add=1.0)

    report = pgconvert.verify(a, b)
    result = CliRunner().invoke(main, ["verify", str(a), str(b)])

    assert [(d.name, d.kind, d.differing) for d in report.differences] == [(EMBEDDING, "values", 1)]
    assert report.padding_differences == []
    assert result.exit_code == 1, result.output


def test_verify_reports_the_first_padding_row_apart(pair: tuple[Path, Path]) -> None:
    a, b = pair
    _edit(b, 1, EMBEDDING, (TRUE_VOCAB - ROWS_PER_RANK, 7), add=1.0)

    report = pgconvert.verify(a, b)

    assert report.equal and report.differences == []
    assert [(d.name, d.differing) for d in report.padding_differences] == [(EMBEDDING, 1)]
