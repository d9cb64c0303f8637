"""The byte-range reader against plain tensor indexing: every rule, dtype and odd shape, batching,
gathering, short reads and truncated files."""

from __future__ import annotations

import os
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import pytest
import torch

import pgconvert.io.ranges as ranges
from pgconvert.errors import CheckpointError
from pgconvert.io.ranges import FileHandles, FileRegion, concat_reading, read_region
from pgconvert.io.torch_input import read_torch_structure, stored_offset
from pgconvert.model.rules import COLUMN, GATED, REPLICATED, ROW, VOCAB, concatenating_with

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.int64]


def _random(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    values = torch.randn(shape, generator=generator) * 4
    return values.to(dtype) if dtype.is_floating_point else values.round().to(dtype)


class Stored:
    """Tensors saved with torch.save and loaded memory-mapped, with a locate function over the file."""

    def __init__(self, path: Path, tensors: dict[str, torch.Tensor]) -> None:
        torch.save(tensors, path)
        self.path = path
        self.loaded = torch.load(path, mmap=True, weights_only=True)
        meta = read_torch_structure(path).meta
        self.starts = {}
        for key, tensor in self.loaded.items():
            offset = stored_offset(meta[key])
            if offset is not None:
                self.starts[tensor.untyped_storage().data_ptr()] = offset - tensor.storage_offset() * tensor.element_size()
        self.handles = FileHandles()

    def locate(self, view: torch.Tensor) -> tuple[int, FileRegion] | None:
        start = self.starts.get(view.untyped_storage().data_ptr())
        if start is None:
            return None
        region = FileRegion(self.path, start + view.storage_offset() * view.element_size(), tuple(view.shape),
                            tuple(view.stride()), view.dtype)
        return self.handles.fd(self.path), region


@pytest.fixture
def stored(tmp_path: Path) -> Iterator[Stored]:
    tensors = {f"{dtype}".replace("torch.", ""): _random((37, 129, 15), dtype, seed)
               for seed, dtype in enumerate(DTYPES)}
    store = Stored(tmp_path / "t.pt", tensors)
    yield store
    store.handles.close()


@pytest.mark.parametrize("dim", [0, 1, 2])
@pytest.mark.parametrize("key", [f"{dtype}".replace("torch.", "") for dtype in DTYPES])
def test_a_window_lands_in_a_strided_target_as_indexing_puts_it(stored: Stored, key: str, dim: int) -> None:
    source = stored.loaded[key]
    size = source.shape[dim]
    start, length = size // 3, size - size // 3 - 1  # odd bounds, away from both ends
    window = source.narrow(dim, start, length)
    out_shape = list(source.shape)
    out_shape[dim] = length + 7
    out = torch.zeros(out_shape, dtype=source.dtype)
    target = out.narrow(dim, 3, length)  # a strided view of a larger buffer, like one rank's columns
    fd, region = stored.locate(window)  # type: ignore[misc]
    read_region(fd, region, target)
    expected = torch.zeros(out_shape, dtype=source.dtype)
    expected.narrow(dim, 3, length).copy_(window)
    assert torch.equal(out.view(torch.uint8), expected.view(torch.uint8))


RULE_CASES = [(COLUMN, 4, 2), (COLUMN, 2, 4), (ROW, 4, 2), (ROW, 2, 3), (GATED, 4, 2), (GATED, 2, 4),
              (REPLICATED, 2, 1)]


@pytest.mark.parametrize("rule,have,want", RULE_CASES, ids=lambda value: getattr(value, "name", str(value)))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float8_e4m3fn])
def test_every_rule_reshards_from_files_as_it_does_in_memory(tmp_path: Path, rule: object, have: int, want: int,
                                                             dtype: torch.dtype) -> None:
    full = _random((480, 360), dtype, 7)  # pieces above the 64 KiB the structure check reads into memory
    pieces = [full.clone()] * have if rule is REPLICATED else rule.split(full, have)  # type: ignore[attr-defined]
    store = Stored(tmp_path / "pieces.pt", {f"p{i}": piece.clone() for i, piece in enumerate(pieces)})
    mapped = [store.loaded[f"p{i}"] for i in range(have)]
    with concatenating_with(partial(concat_reading, locate=store.locate)):
        from_files = [rule.reshard(mapped, want, rank) for rank in range(want)]  # type: ignore[attr-defined]
    in_memory = [rule.reshard(pieces, want, rank) for rank in range(want)]  # type: ignore[attr-defined]
    for got, expected in zip(from_files, in_memory, strict=True):
        assert torch.equal(got.view(torch.uint8), expected.view(torch.uint8))
    store.handles.close()


def test_a_vocab_table_fitted_to_more_rows_reads_the_stored_rows_and_zeros_the_rest(tmp_path: Path) -> None:
    full = _random((40000, 6), torch.bfloat16, 3)
    store = Stored(tmp_path / "vocab.pt", {f"p{i}": piece.clone() for i, piece in enumerate(VOCAB.split(full, 4))})
    mapped = [store.loaded[f"p{i}"] for i in range(4)]
    with concatenating_with(partial(concat_reading, locate=store.locate)):
        last = VOCAB.reshard_rows(mapped, 48000, 37000, 2, 1)
    assert torch.equal(last[:16000], full[24000:]) and not last[16000:].any()
    store.handles.close()


def _counting_preadv_buffers(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Patch ``os.preadv`` to record how many buffers each call fills."""
    calls: list[int] = []
    real = os.preadv
    monkeypatch.setattr(os, "preadv", lambda fd, buffers, offset: (calls.append(len(buffers)), real(fd, buffers, offset))[1])
    return calls


def test_runs_of_more_than_iov_max_rows_take_several_calls(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    full = _random((3000, 256), torch.float32, 5)
    store = Stored(tmp_path / "rows.pt", {"p": full})
    calls = _counting_preadv_buffers(monkeypatch)
    monkeypatch.setattr(ranges, "LONG_RUN", 1024)  # the 1 KiB runs are scattered, not read through the scratch
    out = torch.empty(3000, 512)
    fd, region = store.locate(store.loaded["p"])  # type: ignore[misc]
    read_region(fd, region, out[:, 256:])  # every row lands strided: 3000 runs, contiguous in the file
    assert torch.equal(out[:, 256:], full)
    assert calls == [1024, 1024, 952]
    store.handles.close()


def test_short_runs_of_a_tensor_stored_whole_are_read_through_the_scratch_a_piece_at_a_time(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    full = _random((3000, 256), torch.float32, 5)
    store = Stored(tmp_path / "rows.pt", {"p": full})
    calls = _counting_preadv_buffers(monkeypatch)
    monkeypatch.setattr(ranges, "SCRATCH_BYTES", 1024 * 700)  # 700 rows of 1 KiB a piece
    out = torch.zeros(3000, 512)
    fd, region = store.locate(store.loaded["p"])  # type: ignore[misc]
    read_region(fd, region, out[:, 128:384])
    assert torch.equal(out[:, 128:384], full) and not out[:, :128].any() and not out[:, 384:].any()
    assert calls == [1] * 5  # 700, 700, 700, 700, 200 rows: one call each, not one buffer per row
    store.handles.close()


@pytest.mark.parametrize("scratch", [64, 5000, 1 << 20])
def test_a_piece_wider_than_the_scratch_is_read_a_slice_at_a_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                  scratch: int) -> None:
    full = _random((1, 3, 40, 512), torch.bfloat16, 6)  # a leading unit dim; 1 KiB runs, 40 KiB slices
    store = Stored(tmp_path / "wide.pt", {"p": full})
    monkeypatch.setattr(ranges, "SCRATCH_BYTES", scratch)
    out = torch.zeros(1, 3, 40, 600, dtype=torch.bfloat16)
    fd, region = store.locate(store.loaded["p"])  # type: ignore[misc]
    read_region(fd, region, out[..., 20:532])
    expected = torch.zeros_like(out)
    expected[..., 20:532] = full
    assert torch.equal(out.view(torch.int16), expected.view(torch.int16))
    store.handles.close()


@pytest.mark.parametrize("scratch,calls", [(100 << 10, 24), (1000, 1800)])
def test_a_column_window_of_a_record_is_read_by_its_span_a_piece_at_a_time(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, scratch: int, calls: int) -> None:
    full = _random((600, 1024), torch.float32, 8)
    store = Stored(tmp_path / "cols.pt", {"p": full})
    made = _counting_preadv_buffers(monkeypatch)
    monkeypatch.setattr(ranges, "SCRATCH_BYTES", scratch)  # 25 rows' span a piece; or under one row: its elements
    out = torch.zeros(600, 700)
    fd, region = store.locate(store.loaded["p"][:, 256:768])  # type: ignore[misc]
    read_region(fd, region, out[:, 100:612])
    assert torch.equal(out[:, 100:612], full[:, 256:768]) and not out[:, :100].any() and not out[:, 612:].any()
    assert made == [1] * calls
    store.handles.close()


def test_a_sparse_column_window_is_read_run_by_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    full = _random((300, 4096), torch.float32, 4)  # 1 KiB runs, one in 16 of the span's bytes
    store = Stored(tmp_path / "sparse.pt", {"p": full})
    calls = _counting_preadv_buffers(monkeypatch)
    out = torch.empty(300, 256)
    fd, region = store.locate(store.loaded["p"][:, 1024:1280])  # type: ignore[misc]
    read_region(fd, region, out)
    assert torch.equal(out, full[:, 1024:1280]) and calls == [1] * 300  # not 16 times its bytes read
    store.handles.close()


def test_tiny_runs_are_read_as_one_span_and_gathered(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    full = _random((8000, 6), torch.bfloat16, 9)
    store = Stored(tmp_path / "narrow.pt", {"p": full})
    calls = _counting_preadv_buffers(monkeypatch)
    window = store.loaded["p"][:, 2:5]  # 6-byte runs, 8000 of them
    out = torch.empty(8000, 3, dtype=torch.bfloat16)
    fd, region = store.locate(window)  # type: ignore[misc]
    read_region(fd, region, out)
    assert torch.equal(out, full[:, 2:5]) and calls == [1]
    store.handles.close()


def test_short_reads_are_continued(stored: Stored, monkeypatch: pytest.MonkeyPatch) -> None:
    real = os.preadv

    def trickle(fd: int, buffers: list[memoryview], offset: int) -> int:
        return real(fd, [buffers[0][:1000]], offset)  # the kernel may return fewer bytes than asked

    monkeypatch.setattr(os, "preadv", trickle)
    source = stored.loaded["bfloat16"]
    out = torch.empty(source.shape[0], 200, source.shape[2], dtype=source.dtype)
    fd, region = stored.locate(source)  # type: ignore[misc]
    read_region(fd, region, out[:, 30:159])
    assert torch.equal(out[:, 30:159], source)


def test_a_truncated_file_is_a_named_error(tmp_path: Path) -> None:
    full = _random((256, 256), torch.float32, 1)
    store = Stored(tmp_path / "cut.pt", {"p": full})
    fd, region = store.locate(store.loaded["p"])  # type: ignore[misc]
    os.truncate(store.path, region.offset + 1000)
    with pytest.raises(CheckpointError, match=rf"{store.path}: the file ends at byte {region.offset + 1000}.*truncated"):
        read_region(fd, region, torch.empty(256, 256))
    store.handles.close()


def test_a_region_and_target_of_other_shapes_are_refused(stored: Stored) -> None:
    fd, region = stored.locate(stored.loaded["float32"])  # type: ignore[misc]
    with pytest.raises(ValueError, match="cannot read"):
        read_region(fd, region, torch.empty(37, 129, 14))


@pytest.mark.parametrize("key", ["bfloat16", "float8_e4m3fn", "int64"])
def test_rows_read_into_a_place_of_another_shape_hold_them_in_row_major_order(stored: Stored, key: str) -> None:
    """Rows of a stored tensor read straight into a strided place of another shape with the same element count
    (one query group's heads inside a fused QKV piece): as reshaping the rows and copying them there."""
    tensor = stored.loaded[key]
    _, region = stored.locate(tensor)  # type: ignore[misc]
    rows = region.narrow(0, 5, 12)  # 12 x 129 x 15 elements, contiguous in the file
    grouped = torch.zeros(4, 5, 129 * 15, dtype=tensor.dtype)
    rows.read_into(grouped.view(4, 5, 129 * 15).narrow(1, 1, 3))
    expected = torch.zeros(4, 5, 129 * 15, dtype=tensor.dtype)
    expected.narrow(1, 1, 3).copy_(tensor[5:17].reshape(4, 3, 129 * 15))
    assert torch.equal(grouped.view(torch.uint8), expected.view(torch.uint8))
    with pytest.raises(ValueError, match="cannot view"):  # columns are not contiguous: no other shape
        region.narrow(1, 0, 2).read_into(torch.empty(37 * 2 * 15, dtype=tensor.dtype))


def test_file_handles_keep_at_most_their_limit_open(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    paths = [tmp_path / f"f{i}" for i in range(3)]
    for path in paths:
        path.write_bytes(b"x")
    handles = FileHandles(limit=2)
    closed: list[int] = []
    real_close = os.close
    monkeypatch.setattr(ranges.os, "close", lambda fd: (closed.append(fd), real_close(fd))[1])
    first = handles.fd(paths[0])
    handles.fd(paths[1])
    assert handles.fd(paths[0]) == first  # reused, and now the most recent
    handles.fd(paths[2])  # closes paths[1]'s descriptor, the least recently used
    assert len(closed) == 1 and closed[0] != first
    handles.close()
    assert len(closed) == 3


def test_safetensors_windows_read_only_their_bytes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from safetensors.torch import save_file

    from pgconvert.formats.hf import read_tensor, read_tensor_range

    tensors = {"a": _random((33, 40, 6), torch.bfloat16, 1), "b": _random((70, 9), torch.float8_e4m3fn, 2),
               "c": _random((), torch.float32, 3)}
    path = tmp_path / "model.safetensors"
    save_file(tensors, str(path))
    read: list[int] = []
    real = os.preadv
    monkeypatch.setattr(os, "preadv", lambda fd, buffers, offset: (read.append(real(fd, buffers, offset)), read[-1])[1])
    for name, tensor in tensors.items():
        assert torch.equal(read_tensor(path, name).reshape(-1).view(torch.uint8), tensor.reshape(-1).view(torch.uint8))
    assert sum(read) == sum(tensor.nbytes for tensor in tensors.values())  # each read once, through preadv
    for dim in range(3):
        read.clear()
        window = read_tensor_range(path, "a", dim, 2, 5)
        assert torch.equal(window, tensors["a"].narrow(dim, 2, 3))
        # Rows: only their bytes; runs under SHORT_RUN bytes: the span that holds them, within the tensor.
        assert sum(read) == window.nbytes if dim == 0 else window.nbytes < sum(read) < tensors["a"].nbytes
    assert torch.equal(read_tensor_range(path, "b", 1, 4, 9).view(torch.uint8), tensors["b"][:, 4:9].view(torch.uint8))


def test_a_safetensors_entry_whose_offsets_do_not_fit_its_shape_is_named(tmp_path: Path) -> None:
    import json

    from pgconvert.formats.hf import read_tensor

    header = json.dumps({"w": {"dtype": "F32", "shape": [4, 4], "data_offsets": [0, 60]}}).encode()
    path = tmp_path / "model.safetensors"
    path.write_bytes(len(header).to_bytes(8, "little") + header + bytes(64))
    with pytest.raises(CheckpointError, match=r"model.safetensors: w's data offsets \[0, 60\] do not hold"):
        read_tensor(path, "w")


def test_a_transposed_tensor_is_gathered_without_listing_its_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    full = _random((600, 500), torch.float32, 11)
    store = Stored(tmp_path / "t.pt", {"p": full})
    monkeypatch.setattr(ranges, "_offsets", lambda dims: pytest.fail("listed 300000 one-element runs"))
    transposed = store.loaded["p"].t()  # every run one element long
    out = torch.empty(500, 600)
    fd, region = store.locate(transposed)  # type: ignore[misc]
    read_region(fd, region, out)
    assert torch.equal(out, full.t())
    store.handles.close()
