"""Produced tensors are made in memory reused from record to record, never over a tensor still in use."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
import sys
from pathlib import Path

import pytest
import torch
from support.cli_helpers import run_cli
from support.fp8_checkpoints import fp8_checkpoint
from support.in_place import count_in_place
from support.megatron_fixtures import make_full_model, write_megatron_checkpoint
from support.tiny_models import GQA_SWIGLU

from pgconvert.io import reuse
from pgconvert.io.reuse import ReusedMemory, joined, new_tensor
from pgconvert.io.torchzip import PlannedTensor, save_stream


@pytest.fixture(autouse=True)
def lend_every_size(monkeypatch: pytest.MonkeyPatch) -> None:
    """The tiny models' records are far under the size from which memory is lent: lend it for any size."""
    monkeypatch.setattr(reuse, "SMALLEST", 1)


def test_records_under_the_smallest_lent_size_are_left_to_the_allocator(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(reuse, "SMALLEST", 1 << 20)
    memory = ReusedMemory()
    with memory.lending((1 << 20) - 4):
        assert reuse._LENT.get() is None
    with memory.lending(1 << 20):
        made = new_tensor((1 << 18,), torch.float32)
    assert made.untyped_storage().data_ptr() == memory.last_block.data_ptr()


def test_the_first_tensor_of_the_records_size_is_made_in_the_lent_block() -> None:
    memory = ReusedMemory()
    with memory.lending(4096):
        smaller = new_tensor((16,), torch.float32)
        first = new_tensor((32, 32), torch.float32)
        second = new_tensor((1024,), torch.float32)
    block = first.untyped_storage().data_ptr()
    assert block not in (smaller.untyped_storage().data_ptr(), second.untyped_storage().data_ptr())
    del first
    with memory.lending(2048):  # a smaller record (not under an eighth) reuses the same block
        again = new_tensor((1024,), torch.bfloat16)
    assert again.untyped_storage().data_ptr() == block


def test_a_tensor_still_referred_to_is_not_lent_again() -> None:
    memory = ReusedMemory()
    with memory.lending(1024):
        kept = new_tensor((256,), torch.float32).fill_(7.0)
    view = kept[10:]  # only a view survives: the block is still in use
    del kept
    with memory.lending(1024):
        other = new_tensor((256,), torch.float32).fill_(-1.0)
    assert other.untyped_storage().data_ptr() != view.untyped_storage().data_ptr()
    assert torch.equal(view, torch.full((246,), 7.0))


def test_a_stream_whose_producer_keeps_its_tensors_writes_and_keeps_each_intact(tmp_path: Path) -> None:
    """A producer that holds on to what it made (as a stacked expert or a cached tensor is held) gets new
    memory for the next record; the one that does not gets the same block each time."""
    values = [torch.full((64, 64), float(i)) for i in range(4)]
    kept: list[torch.Tensor] = []
    seen: list[int] = []

    def producer(index: int, keep: bool) -> PlannedTensor:
        def produce() -> torch.Tensor:
            made = new_tensor((64, 64), torch.float32).copy_(values[index])
            seen.append(made.untyped_storage().data_ptr())
            if keep:
                kept.append(made)
            return made
        return PlannedTensor((64, 64), torch.float32, produce)

    for keep in (True, False):
        seen.clear()
        path = tmp_path / f"keep-{keep}.pt"
        with path.open("wb") as handle:
            save_stream({f"t{i}": producer(i, keep) for i in range(4)}, handle)
        loaded = torch.load(path, weights_only=True)
        assert all(torch.equal(loaded[f"t{i}"], values[i]) for i in range(4))
        assert len(set(seen)) == (4 if keep else 1)
    assert all(torch.equal(tensor, values[i]) for i, tensor in enumerate(kept))


@pytest.fixture(scope="module")
def tp2_source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("reuse") / "tp2"
    write_megatron_checkpoint(root, GQA_SWIGLU, make_full_model(GQA_SWIGLU), tp=2, pp=1)
    return root


def _files(root: Path) -> dict[str, bytes]:
    return {str(path.relative_to(root)): path.read_bytes() for path in sorted(root.rglob("*"))
            if path.is_file() and path.name != "pgconvert.json"}


@pytest.mark.parametrize("target", [["--dst-tp", "1"], ["--dst-tp", "4"], ["--dst-format", "hf"],
                                    ["--dst-format", "torch_dist", "--dst-tp", "1"]],
                         ids=["tp1", "tp4", "hf", "torch_dist"])
def test_conversions_reuse_memory_and_write_what_new_memory_writes(tp2_source: Path, tmp_path: Path, target: list[str],
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    outcomes: list[bool] = []  # per record: whether its tensor was made in the lent block
    original_lending = ReusedMemory.lending

    @contextmanager
    def watched_lending(self: ReusedMemory, nbytes: int, phase: int | None = None) -> Iterator[None]:
        with original_lending(self, nbytes, phase):
            yield
            outcomes.append(reuse._LENT.get() is None)

    monkeypatch.setattr(ReusedMemory, "lending", watched_lending)
    done = run_cli("-q", "--src-tp", "2", *target, tp2_source, tmp_path / "reused")
    assert done.exit_code == 0, done.output
    assert len(outcomes) > 10 and sum(outcomes) >= 0.9 * len(outcomes), outcomes
    monkeypatch.setattr(reuse, "_use_count", lambda storage: 2)  # nothing reused: new memory every time
    assert run_cli("-q", "--src-tp", "2", *target, tp2_source, tmp_path / "new").exit_code == 0
    assert _files(tmp_path / "reused") == _files(tmp_path / "new")


@pytest.mark.parametrize("shapes,dim", [([(3, 5), (4, 5)], 0), ([(3, 5), (3, 2)], -1), ([(2, 3, 4), (2, 1, 4)], 1)])
@pytest.mark.parametrize("dtypes", [(torch.bfloat16, torch.bfloat16), (torch.float16, torch.float32)])
def test_joined_equals_cat_and_takes_the_lent_block(shapes: list[tuple[int, ...]], dim: int,
                                                    dtypes: tuple[torch.dtype, torch.dtype]) -> None:
    tensors = [torch.randn(shape).to(dtype) for shape, dtype in zip(shapes, dtypes, strict=True)]
    expected = torch.cat(tensors, dim=dim)
    memory = ReusedMemory()
    with memory.lending(expected.numel() * expected.element_size()):
        result = joined(tensors, dim)
        taken = reuse._LENT.get() is None
    assert result.dtype == expected.dtype and torch.equal(result, expected)
    assert taken and result.untyped_storage().data_ptr() == memory.last_block.data_ptr()


def test_joined_keeps_torchs_rules_for_what_cat_refuses_or_skips() -> None:
    legacy = joined([torch.empty(0), torch.ones(2, 3)])  # a 1-d empty tensor is skipped, as torch.cat does
    assert torch.equal(legacy, torch.ones(2, 3))
    with pytest.raises(RuntimeError):
        joined([torch.ones(2, 3), torch.ones(2, 4)], 0)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/smaps_rollup")
def test_a_record_under_an_eighth_of_the_block_hands_the_rest_of_its_pages_back() -> None:
    memory = ReusedMemory()
    with memory.lending(64 << 20):
        new_tensor((64 << 20,), torch.uint8).fill_(1)  # every page of a 64 MiB block resident
    before = _anonymous_bytes()
    with memory.lending(4 << 20):  # under an eighth of the block
        small = new_tensor((4 << 20,), torch.uint8).fill_(2)
    after = _anonymous_bytes()
    assert small.untyped_storage().data_ptr() == memory.last_block.data_ptr()
    assert before - after > 50 << 20, (before, after)
    del small
    with memory.lending(64 << 20):  # the whole block again: the handed-back pages read as zeros
        again = new_tensor((64 << 20,), torch.uint8)
    assert int(again[8 << 20:60 << 20].max()) == 0 and int(again[:4 << 20].min()) == 2  # whole pages only


def _anonymous_bytes() -> int:
    with open("/proc/self/smaps_rollup") as handle:
        for line in handle:
            if line.startswith("Anonymous:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no Anonymous: line")


def test_pages_are_handed_back_once_per_shrink_not_at_every_small_record(monkeypatch: pytest.MonkeyPatch) -> None:
    released: list[int] = []
    monkeypatch.setattr(reuse, "_release_tail", lambda block, keep: released.append(keep))
    memory = ReusedMemory()
    for size in [64, 6, 2, 11, 5, 6, 2, 11, 5]:  # an embedding, then layers of a few sizes (KiB)
        with memory.lending(size << 10):
            new_tensor((size << 10,), torch.uint8)
    assert released == [6 << 10]


@pytest.mark.parametrize("phase", [0, 8, 4094, 4096 + 640])
@pytest.mark.parametrize("dtype", [torch.uint8, torch.bfloat16, torch.float32])
def test_a_record_lent_with_its_place_in_a_file_starts_at_that_place_modulo_a_block(phase: int,
                                                                                   dtype: torch.dtype) -> None:
    memory = ReusedMemory()
    itemsize = torch.empty((), dtype=dtype).element_size()
    with memory.lending(1024 * itemsize, phase=phase):
        made = new_tensor((1024,), dtype)
    assert made.untyped_storage().data_ptr() == memory.last_block.data_ptr()
    if phase % itemsize == 0:
        assert made.data_ptr() % reuse.ALIGNMENT == phase % reuse.ALIGNMENT
    else:  # no element starts there: the block's start
        assert made.data_ptr() == memory.last_block.data_ptr()
    made.fill_(3)  # the whole tensor lies in the block
    assert int(made.sum()) == 3 * 1024


def test_two_blocks_are_lent_in_turn_while_the_other_is_held() -> None:
    """With two blocks, a record held (being written) leaves the other block to the next record; a block too small
    is replaced by a larger one, a free one before a held one."""
    memory = ReusedMemory(blocks=2)
    with memory.lending(4096):
        first = new_tensor((4096,), torch.uint8)
    with memory.lending(4096):
        second = new_tensor((4096,), torch.uint8)
    a, b = first.untyped_storage().data_ptr(), second.untyped_storage().data_ptr()
    assert a != b
    del first
    with memory.lending(2048):
        third = new_tensor((2048,), torch.uint8)
    assert third.untyped_storage().data_ptr() == a
    del second
    with memory.lending(8192):  # larger than both: replaces the free one (b), not the held one (a)
        larger = new_tensor((8192,), torch.uint8)
    assert larger.untyped_storage().data_ptr() not in (a, b)
    assert {block.storage.data_ptr() for block in memory._blocks} == {a, larger.untyped_storage().data_ptr()}


def test_a_reused_memory_has_at_least_one_block() -> None:
    with pytest.raises(ValueError, match="at least one block"):
        ReusedMemory(blocks=0)


@pytest.mark.parametrize("source", ["megatron", "fp8"])
def test_an_hf_target_written_from_its_records_memory_equals_one_written_staged(
        tp2_source: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, source: str) -> None:
    """Safetensors shards written from each record's own memory (lent at its place in the file, one record written
    while the next is produced) hold the bytes of shards whose every byte is staged; most bytes go in place."""
    from pgconvert.io import output

    monkeypatch.setattr(output, "IN_PLACE_SMALLEST", output.BLOCK)
    src, flags = tp2_source, ["--src-tp", "2", "--dst-format", "hf"]
    if source == "fp8":
        src, flags = tmp_path / "fp8", ["--dst-format", "hf"]
        fp8_checkpoint(src, block=(16, 16))
    placed, written = _written_in_place_and_staged(src, flags, "*.safetensors", tmp_path, monkeypatch)
    assert placed > written / 2, (placed, written)


@pytest.mark.parametrize("dtype", [None, "bf16"], ids=["stored dtype", "converted"])
def test_a_torch_dist_target_written_from_its_items_memory_equals_one_written_staged(
        tp2_source: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, dtype: str | None) -> None:
    """Each tensor item of a data file is made at its bytes' place in the file and written from there where its dtype
    can start at that place (about every other item: an item's archive has an odd length): the files hold the bytes
    of files whose every byte is staged, and a good part of them went in place. An item converted to another dtype is
    a copy made apart (staged), from a tensor made in the lent memory."""
    from pgconvert.io import output

    monkeypatch.setattr(output, "IN_PLACE_SMALLEST", output.BLOCK)
    flags = ["--src-tp", "2", "--dst-format", "torch_dist", *(["--dtype", dtype] if dtype else [])]
    placed, written = _written_in_place_and_staged(tp2_source, flags, "*.distcp", tmp_path, monkeypatch)
    assert placed > written / 5 if dtype is None else placed == 0, (placed, written)


def _written_in_place_and_staged(src: Path, flags: list[str], pattern: str, tmp_path: Path,
                                 monkeypatch: pytest.MonkeyPatch) -> tuple[int, int]:
    """Convert ``src`` twice, writing in place where the writers can and then staging every byte; the outputs must be
    the same. Returns the bytes written in place and those of the files matching ``pattern``."""
    from pgconvert.io import output

    placed = count_in_place(monkeypatch)
    assert run_cli("-q", *flags, src, tmp_path / "in_place").exit_code == 0
    monkeypatch.setattr(output.OutputFile, "write_in_place", lambda self, data: self.write(data) and [])
    assert run_cli("-q", *flags, src, tmp_path / "staged").exit_code == 0
    assert _files(tmp_path / "in_place") == _files(tmp_path / "staged")
    return placed(), sum(path.stat().st_size for path in (tmp_path / "in_place").rglob(pattern))
