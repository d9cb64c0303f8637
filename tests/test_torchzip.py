"""The streaming torch zip writer writes the bytes torch.save writes, holding one tensor at a time."""

from __future__ import annotations

import argparse
import io
import weakref
import zlib
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.utils.serialization
from support.tiny_models import MOE, QK_NORM_TE
from support.megatron_fixtures import make_full_model, write_megatron_checkpoint
from support.in_place import count_in_place
from support.torch_save import torch_crc32, torch_save_bytes

import pgconvert
import pgconvert.savers.megatron as megatron_saver
from pgconvert.io import torchzip
from pgconvert.io.torchzip import PlannedTensor, TensorMismatchError, save_stream


def planned(tensor: torch.Tensor) -> PlannedTensor:
    return PlannedTensor(tuple(tensor.shape), tensor.dtype, lambda: tensor.clone())


def materialised(obj: Any) -> Any:
    """``obj`` with every planned tensor produced: what torch.save would have been given."""
    if isinstance(obj, PlannedTensor):
        return obj.produce()
    if isinstance(obj, dict):
        return type(obj)((key, materialised(value)) for key, value in obj.items())
    return obj


def mixed_state() -> dict[str, Any]:
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    model: OrderedDict[str, Any] = OrderedDict(
        bf16=planned(torch.randn(5, 7).to(torch.bfloat16)),
        float32=planned(torch.randn(3, 4)),
        empty=planned(torch.empty(0, 3)),
        empty_bf16=planned(torch.empty(2, 0, 5, dtype=torch.bfloat16)),
        scalar=planned(torch.tensor(3.5)),
        uint16=planned(torch.arange(4).to(torch.uint16)),  # a dtype torch pickles as UntypedStorage
        fp8=planned(torch.randn(6).to(torch.float8_e4m3fn)),
        flags=planned(torch.tensor([True, False])),
        index=planned(torch.arange(3)),
        transposed=base.t(),  # real tensors: non-contiguous, and two views sharing one storage
        tail_rows=base[1:],
        real_empty=torch.empty(0),
        extra_state=io.BytesIO(b"te fp8 metadata"),
        no_state=None,
    )
    model.update((f"many.{i}", planned(torch.full((2,), float(i)))) for i in range(40))
    return {"args": argparse.Namespace(hidden_size=64, name="x"), "checkpoint_version": 3.0,
            "iteration": 7, "model": model}


@pytest.mark.parametrize("crc32,crc_library", [(False, "zlib"), (True, "zlib"), (True, "isal")],
                         ids=["no-crc", "crc-zlib", "crc-isal"])
def test_stream_writes_torch_saves_bytes(crc32: bool, crc_library: str, monkeypatch: pytest.MonkeyPatch) -> None:
    function = zlib.crc32 if crc_library == "zlib" else pytest.importorskip("isal.isal_zlib").crc32
    monkeypatch.setattr(torchzip, "crc32_function", lambda: function)
    state = mixed_state()
    streamed = io.BytesIO()

    save_stream(state, streamed, crc32=crc32)

    assert streamed.getvalue() == torch_save_bytes(materialised(state), crc32)


@pytest.mark.parametrize("crc_slice", [7, 64, 4096])
def test_a_record_summed_a_slice_at_a_time_has_torchs_crc(crc_slice: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torchzip, "CRC_SLICE", crc_slice)
    state = {"model": OrderedDict(weight=planned(torch.randn(37, 29)), half=planned(torch.randn(3, 333).half()))}
    streamed = io.BytesIO()

    save_stream(state, streamed, crc32=True)

    assert streamed.getvalue() == torch_save_bytes(materialised(state), True)


def test_the_isal_crc_is_used_where_installed() -> None:
    isal_zlib = pytest.importorskip("isal.isal_zlib")  # a test dependency: CI has it
    assert torchzip.crc32_function() is isal_zlib.crc32


def test_stream_file_loads_with_weights_only_and_mmap(tmp_path: Path) -> None:
    state = mixed_state()
    path = tmp_path / "model_optim_rng.pt"
    with open(path, "wb") as handle:
        save_stream(state, handle)

    with torch.serialization.safe_globals([argparse.Namespace, io.BytesIO]):
        loaded = torch.load(path, weights_only=True, mmap=True)
    expected = materialised(state)
    for key, value in expected["model"].items():
        if isinstance(value, torch.Tensor):
            got = loaded["model"][key]
            assert got.dtype == value.dtype and got.shape == value.shape, key
            assert torch.equal(got.contiguous().reshape(-1).view(torch.uint8),
                               value.contiguous().reshape(-1).view(torch.uint8)), key
    plain = {"model": OrderedDict((k, v) for k, v in state["model"].items() if isinstance(v, PlannedTensor))}
    with open(path, "wb") as handle:
        save_stream(plain, handle)
    assert set(torch.load(path, weights_only=True, mmap=True)["model"]) == set(plain["model"])


class _LayoutSink:
    """A writer keeping every byte except the contents of large writes (only their length)."""

    def __init__(self) -> None:
        self.parts: list[bytes | int] = []

    def write(self, data: Any) -> int:
        size = memoryview(data).nbytes
        if size > 1 << 20:
            self.parts.append(size)
        elif self.parts and isinstance(self.parts[-1], bytes):
            self.parts[-1] += bytes(memoryview(data).cast("B"))
        else:
            self.parts.append(bytes(memoryview(data).cast("B")))
        return size

    def flush(self) -> None:
        pass


def test_zip64_records_beyond_4_gib_are_laid_out_as_torch_lays_them_out() -> None:
    try:
        # Never touched: its pages are not read with CRC32 off, so this costs address space only.
        big = torch.empty(4 * 2**30 + 100, dtype=torch.uint8)
        big_after = torch.empty(4 * 2**30, dtype=torch.uint8)  # a big record starting beyond 4 GiB
    except RuntimeError as exc:
        pytest.skip(f"no 8 GiB of address space here: {exc}")
    small = torch.arange(5).to(torch.bfloat16)
    state = {"x": torch.ones(3), "big": big, "after": small, "empty_after": torch.empty(0), "big_after": big_after}
    streamed = _LayoutSink()
    save_stream({"x": state["x"], "big": PlannedTensor(tuple(big.shape), big.dtype, lambda: big),
                 "after": planned(small), "empty_after": planned(state["empty_after"]),
                 "big_after": PlannedTensor(tuple(big_after.shape), big_after.dtype, lambda: big_after)}, streamed)
    reference = _LayoutSink()
    with torch_crc32(False):
        torch.save(state, reference)

    assert streamed.parts == reference.parts
    assert reference.parts[1] == big.numel()


def test_a_producer_returning_another_shape_is_refused() -> None:
    wrong = PlannedTensor((2, 3), torch.float32, lambda: torch.zeros(3, 2))

    with pytest.raises(TensorMismatchError, match=r"planned torch.float32 \(2, 3\)"):
        save_stream({"w": wrong}, io.BytesIO())


@pytest.mark.parametrize("model", [MOE, QK_NORM_TE], ids=["moe_bf16", "te_extra_state"])
def test_rank_files_are_torch_save_of_the_whole_rank_and_hold_one_tensor_at_a_time(
        model: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src = write_megatron_checkpoint(tmp_path / "src", model, make_full_model(model), 2, 1)
    real_save = megatron_saver.save_stream
    expected: dict[str, bytes] = {}
    live: list[weakref.ref[torch.Tensor]] = []
    most_alive = 0

    def tracked(produce: Any) -> Any:
        def produce_one() -> torch.Tensor:
            nonlocal most_alive
            tensor = produce()
            live.append(weakref.ref(tensor))
            most_alive = max(most_alive, sum(ref() is not None for ref in live))
            return tensor
        return produce_one

    def checked_save(obj: dict[str, Any], handle: Any, *args: Any, **kwargs: Any) -> None:
        plans = [value for value in obj["model"].values() if isinstance(value, PlannedTensor)]
        producers = [value.produce for value in plans]
        for value, produce in zip(plans, producers):
            object.__setattr__(value, "produce", tracked(produce))
        real_save(obj, handle, *args, **kwargs)
        for value, produce in zip(plans, producers):
            object.__setattr__(value, "produce", produce)
        rank_dir = Path(handle.path).parent.name
        expected[rank_dir] = torch_save_bytes(materialised(obj), False)

    monkeypatch.setattr(megatron_saver, "save_stream", checked_save)
    pgconvert.convert(src, tmp_path / "tp1", dst_tp=1)

    written = {path.parent.name: path.read_bytes() for path in (tmp_path / "tp1").rglob("model_optim_rng.pt")}
    assert sorted(written) == sorted(expected) == ["mp_rank_00"]
    assert written == expected
    assert len(live) > 20 and most_alive == 1


@pytest.mark.parametrize("buffered", [False, True], ids=["direct", "buffered"])
def test_records_written_from_their_own_memory_make_torch_saves_bytes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, buffered: bool) -> None:
    """With a record in flight, each produced tensor is made at its place in the file and written from there while
    the next is made in the other block: the file is still torch.save's bytes, most of them written in place, and
    two blocks serve every record."""
    from pgconvert.io import output, reuse
    from pgconvert.io.reuse import new_tensor

    monkeypatch.setattr(reuse, "SMALLEST", 1)
    monkeypatch.setattr(output, "IN_PLACE_SMALLEST", output.BLOCK)
    if buffered:
        monkeypatch.setenv(output.BUFFERED_ENV, "1")
    blocks: set[int] = set()

    def lent(values: torch.Tensor) -> PlannedTensor:
        def produce() -> torch.Tensor:
            made = new_tensor(tuple(values.shape), values.dtype).copy_(values)
            blocks.add(made.untyped_storage().data_ptr())
            return made
        return PlannedTensor(tuple(values.shape), values.dtype, produce)

    generator = torch.Generator().manual_seed(5)
    sizes = [5 * 4096 + 3, 5 * 4096 + 1, 5 * 4096, 4096 + 5, 5 * 4096 + 3, 17]  # odd offsets, none larger than the first
    state = {"model": OrderedDict((f"t{i}", lent(torch.randn(n, generator=generator).to(torch.bfloat16)))
                                  for i, n in enumerate(sizes)), "iteration": 3}
    placed = count_in_place(monkeypatch)
    with output.OutputFile(tmp_path / "rank.pt") as handle:
        save_stream(state, handle, in_flight=1)
    lent_blocks = set(blocks)
    assert (tmp_path / "rank.pt").read_bytes() == torch_save_bytes(materialised(state), False)
    assert placed() > sum(sizes) and len(lent_blocks) == 2, (placed(), lent_blocks)  # over half the bytes (2 a value)
