"""The Megatron loader reads rank files as their structure: tensors over 64 KiB stay in their files until a merge
reads them into place. No ``torch.load`` of a rank file, no mapping; copies compared a slab at a time; a file cut
short after it was opened is a named error."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from support.cli_helpers import assert_clean_refusal, run_cli
from support.megatron_fixtures import load_for_test, make_full_model, write_megatron_checkpoint
from support.tiny_models import GQA_SWIGLU, MHA_GELU_TIED

import pgconvert
import pgconvert.io.torch_input as torch_input
from pgconvert.errors import CheckpointError
from pgconvert.io.ranges import FileRegion
from pgconvert.run.convert import execute

ITER = "iter_0000100"
EMBEDDING = "embedding.word_embeddings.weight"


def _rank_file(root: Path, rank_dir: str) -> Path:
    return root / ITER / rank_dir / "model_optim_rng.pt"


def test_a_tp_merge_reads_no_rank_file_with_torch_load(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    full = make_full_model(GQA_SWIGLU)
    src = write_megatron_checkpoint(tmp_path / "src", GQA_SWIGLU, full, 2, 1)
    loads: list[str] = []
    real_load = torch.load

    def refusing(path: object, *args: object, **kwargs: object) -> object:
        loads.append(str(path))
        return real_load(path, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(torch, "load", refusing)
    monkeypatch.setattr(torch.serialization, "load", refusing)
    result = run_cli(src, tmp_path / "dst", "--dst-tp", "1", "-q")
    monkeypatch.undo()

    assert result.exit_code == 0, result.output
    assert not [path for path in loads if path.endswith("model_optim_rng.pt")], loads
    model = load_for_test(_rank_file(tmp_path / "dst", "mp_rank_00"))["model"]
    assert isinstance(model, dict)
    # The embedding (256 KB) was left in the files; its rows come back in order from both.
    assert full[EMBEDDING].nbytes > 64 << 10
    assert torch.equal(model[EMBEDDING][:GQA_SWIGLU.vocab_size], full[EMBEDDING])
    for name in ("decoder.layers.0.self_attention.linear_proj.weight", "decoder.layers.3.mlp.linear_fc2.weight"):
        assert torch.equal(model[name], full[name]), name


@pytest.fixture
def tied_pp2(tmp_path: Path) -> Path:
    """Tied embeddings over two stages: the last stage holds the output layer's copy of the embedding."""
    return write_megatron_checkpoint(tmp_path / "tied", MHA_GELU_TIED, make_full_model(MHA_GELU_TIED), 1, 2)


@pytest.mark.parametrize("row", [0, -1], ids=["first-slab", "last-slab"])
def test_a_copy_that_differs_in_any_slab_is_refused(tied_pp2: Path, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch, row: int) -> None:
    last = _rank_file(tied_pp2, "mp_rank_00_001")
    state = load_for_test(last)
    copy = state["model"]["output_layer.weight"]  # type: ignore[index]
    assert copy.nbytes > 64 << 10  # left in its file: compared by reading it
    copy[row, 5] += 1.0
    torch.save(state, last)
    monkeypatch.setattr(torch_input, "SLAB_BYTES", 4096)  # 16 rows of 64 fp32 values a slab: 64 slabs

    result = run_cli(tied_pp2, tmp_path / "dst", "--dst-pp", "1")

    assert_clean_refusal(result, 1, f"{EMBEDDING}: the copies in", str(last), "differ")
    assert not (tmp_path / "dst").exists()


def test_identical_copies_compared_in_slabs_convert(tied_pp2: Path, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    compared: list[tuple[bool, ...]] = []
    real = torch_input.stored_differing

    def spying(first: torch.Tensor, others: list[torch.Tensor], stored: torch_input.StoredTensors) -> int | None:
        compared.append((first.device.type == "meta", *(other.device.type == "meta" for other in others)))
        return real(first, others, stored)

    import pgconvert.loaders.megatron as megatron_loader

    monkeypatch.setattr(megatron_loader, "stored_differing", spying)
    monkeypatch.setattr(torch_input, "SLAB_BYTES", 4096)
    result = run_cli(tied_pp2, tmp_path / "dst", "--dst-pp", "1", "-q")

    assert result.exit_code == 0, result.output
    assert (True, True) in compared  # the two embedding copies, both read from their files
    model = load_for_test(_rank_file(tmp_path / "dst", "mp_rank_00"))["model"]
    assert isinstance(model, dict) and "output_layer.weight" not in model  # tied: one table at PP1


def test_stored_differing_reads_each_copy_once_a_slab_at_a_time(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    rows, columns = 40, 16
    table = torch.randn(rows, columns, generator=torch.Generator().manual_seed(3))
    changed = table.clone()
    changed[rows - 1, 0] += 1.0  # the last slab only
    path = tmp_path / "copies.bin"
    path.write_bytes(b"".join(t.numpy().tobytes() for t in (table, table, changed)))
    nbytes = table.nbytes
    left = [torch_input.meta_at(FileRegion.contiguous(path, k * nbytes, (rows, columns), torch.float32))
            for k in range(3)]
    stored = torch_input.StoredTensors()
    reads: list[tuple[int, ...]] = []
    read = stored.read

    def counting(tensor: torch.Tensor) -> torch.Tensor:
        reads.append(tuple(tensor.shape))
        return read(tensor)

    monkeypatch.setattr(stored, "read", counting)
    monkeypatch.setattr(torch_input, "SLAB_BYTES", 8 * columns * 4)  # 8 rows: 5 slabs

    assert torch_input.stored_differing(left[0], [left[1], table], stored) is None
    assert len(reads) == 5 * 3  # each slab of the reference read once, not once per copy
    assert torch_input.stored_differing(left[0], [left[1], left[2], table], stored) == 1  # in the last slab
    assert torch_input.stored_differing(table, [changed], stored) == 0
    assert torch_input.stored_differing(left[0], [table, table.double()], stored) == 1  # a dtype differs
    assert torch_input.stored_differing(left[0], [table[:-1]], stored) == 0  # a shape differs
    assert torch_input.stored_differing(torch.tensor(2.0), [torch.tensor(2.0), torch.tensor(-2.0)], stored) == 1
    stored.close()


def test_a_rank_file_cut_short_after_planning_is_a_named_error(tmp_path: Path) -> None:
    src = write_megatron_checkpoint(tmp_path / "src", GQA_SWIGLU, make_full_model(GQA_SWIGLU), 2, 1)
    conversion = pgconvert.plan(pgconvert.ConvertRequest(src=src, dst=tmp_path / "dst", dst_tp=1))
    cut = _rank_file(src, "mp_rank_01")
    os.truncate(cut, cut.stat().st_size // 2)

    with pytest.raises(CheckpointError, match=f"{cut}: the file ends at byte .* the file is truncated"):
        execute(conversion)
    assert not (tmp_path / "dst").exists()
