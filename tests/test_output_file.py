"""``OutputFile``: the bytes and digest of every size around its block and buffer boundaries, and each
fallback (O_DIRECT refused at open or at a write, short writes), a full disk and a failed block; records
written from their own memory (``write_in_place``) beside staged ones."""

from __future__ import annotations

import errno
import hashlib
import os
import random
import threading
from concurrent.futures import Future
from pathlib import Path

import pytest
import torch
import xxhash

import pgconvert.io.output as output
from pgconvert.io import reuse
from pgconvert.io.reuse import ReusedMemory, new_tensor
from pgconvert.io.output import BLOCK, BUFFER_BYTES, BUFFERED_ENV, OutputFile, digests

SIZES = [0, 1, BLOCK - 1, BLOCK, BLOCK + 1, BUFFER_BYTES - 1, BUFFER_BYTES, 5 * BUFFER_BYTES + 12345]


def _write_in_random_pieces(path: Path, data: bytes, seed: int) -> OutputFile:
    pick = random.Random(seed)
    with OutputFile(path) as out:
        done = 0
        while done < len(data):
            count = pick.randint(1, 3 * BUFFER_BYTES // 2)
            out.write(memoryview(data)[done:done + count])
            done += count
            assert out.tell() == min(done, len(data))
    return out


@pytest.mark.parametrize("size", SIZES)
def test_every_size_is_written_whole_with_its_digest(tmp_path: Path, size: int) -> None:
    data = random.Random(size).randbytes(size)
    out = _write_in_random_pieces(tmp_path / "out.bin", data, size)
    assert (tmp_path / "out.bin").read_bytes() == data
    assert out.digest == "xxh3-128:" + xxhash.xxh3_128(data).hexdigest() and out.size == size
    with digests("sha256"):
        again = _write_in_random_pieces(tmp_path / "again.bin", data, size)
    assert again.digest == "sha256:" + hashlib.sha256(data).hexdigest()


def test_o_direct_refused_at_open_writes_through_the_page_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_open = os.open

    def refusing(path: str, flags: int, mode: int = 0o777) -> int:
        if flags & output._DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, mode)

    monkeypatch.setattr(os, "open", refusing)
    data = random.Random(1).randbytes(BUFFER_BYTES + 999)
    with OutputFile(tmp_path / "out.bin") as out:
        assert not out.direct
        out.write(data)
    assert (tmp_path / "out.bin").read_bytes() == data


def test_o_direct_refused_at_a_write_finishes_through_the_page_cache(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    with OutputFile(tmp_path / "probe.bin") as probe:
        if not probe.direct:
            pytest.skip(f"{tmp_path}'s file system refuses O_DIRECT: nothing to fall back from")
    real_pwrite = os.pwrite
    refused: list[int] = []

    def refusing(fd: int, data: memoryview, offset: int) -> int:
        import fcntl

        if fcntl.fcntl(fd, fcntl.F_GETFL) & output._DIRECT:
            refused.append(offset)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", refusing)
    data = random.Random(2).randbytes(3 * BUFFER_BYTES + 5)
    out = _write_in_random_pieces(tmp_path / "out.bin", data, 2)
    assert (tmp_path / "out.bin").read_bytes() == data and out.size == len(data)
    assert len(refused) == 1  # refused once; every later write went through the page cache


def test_short_writes_are_continued(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_pwrite = os.pwrite
    monkeypatch.setattr(os, "pwrite", lambda fd, data, offset: real_pwrite(fd, memoryview(data)[:3 * BLOCK + 17], offset))
    data = random.Random(3).randbytes(BUFFER_BYTES + 4 * BLOCK + 3)
    _write_in_random_pieces(tmp_path / "out.bin", data, 3)
    assert (tmp_path / "out.bin").read_bytes() == data


def test_a_full_disk_is_an_error_naming_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_pwrite = os.pwrite
    written = 0

    def filling(fd: int, data: memoryview, offset: int) -> int:
        nonlocal written
        if written + len(data) > BUFFER_BYTES:
            raise OSError(errno.ENOSPC, "No space left on device")
        written += len(data)
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", filling)
    path = tmp_path / "out.bin"
    with pytest.raises(OSError) as caught:
        with OutputFile(path) as out:
            out.write(bytes(4 * BUFFER_BYTES))
    assert caught.value.errno == errno.ENOSPC and caught.value.filename == str(path)
    assert out.digest is None


def test_leaving_the_block_with_an_error_gives_no_digest(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="producer failed"):
        with OutputFile(tmp_path / "out.bin") as out:
            out.write(b"x" * 100)
            raise RuntimeError("producer failed")
    assert out.digest is None
    with pytest.raises(RuntimeError, match="once the file is closed"):
        out.hexdigest()


def test_the_environment_switch_writes_through_the_page_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(BUFFERED_ENV, "1")
    with OutputFile(tmp_path / "out.bin") as out:
        assert not out.direct
        out.write(b"abc")
    assert (tmp_path / "out.bin").read_bytes() == b"abc"


def test_an_os_error_raised_inside_the_block_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "out.bin"
    with pytest.raises(OSError) as caught:
        with OutputFile(path) as out:
            out.write(b"x")
            raise OSError(errno.EIO, "Input/output error")
    assert caught.value.errno == errno.EIO and caught.value.filename == str(path)


def _lent(memory: ReusedMemory, data: bytes, phase: int) -> torch.Tensor:
    """``data`` in a block of ``memory`` placed at ``phase`` modulo BLOCK."""
    with memory.lending(len(data), phase=phase):
        tensor = new_tensor((len(data),), torch.uint8)
    return tensor.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))


@pytest.mark.parametrize("buffered", [False, True], ids=["direct", "buffered"])
def test_writes_in_place_and_staged_writes_make_the_same_file_and_digest(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, buffered: bool) -> None:
    """Records lent at their file offset are written from their own memory (under O_DIRECT: their whole
    blocks, head and tail staged); one at another place is staged whole; either way the file and its digest are
    the bytes in order, as writing every piece staged gives."""
    monkeypatch.setattr(reuse, "SMALLEST", 1)
    monkeypatch.setattr(output, "IN_PLACE_SMALLEST", 2 * BLOCK)
    if buffered:
        monkeypatch.setenv(BUFFERED_ENV, "1")
    pick = random.Random(7)
    pieces = [pick.randbytes(size) for size in (13, 5 * BLOCK + 7, 3, BUFFER_BYTES + 2 * BLOCK + 1, BLOCK - 5,
                                                 9 * BLOCK, 2 * BUFFER_BYTES + 11, 1)]
    memory = ReusedMemory(blocks=2)
    held: list[list[Future[None]]] = []
    with OutputFile(tmp_path / "out.bin") as out:
        for index, piece in enumerate(pieces):
            misplaced = index == 3  # lent at the wrong place: staged whole under O_DIRECT
            tensor = _lent(memory, piece, out.offset + (8 if misplaced else 0))
            futures = out.write_in_place(tensor.numpy().data)
            in_place = len(piece) - (-out.offset % BLOCK) >= 2 * BLOCK and (buffered or not misplaced)
            assert bool(futures) == in_place, (index, len(piece))
            assert out.direct != buffered
            held.append(futures)
            if len(held) > 1:
                output.settled(held.pop(0))
    data = b"".join(pieces)
    assert (tmp_path / "out.bin").read_bytes() == data
    assert out.digest == "xxh3-128:" + xxhash.xxh3_128(data).hexdigest() and out.size == len(data)


def test_a_record_written_in_place_is_let_go_of_once_its_futures_are_done(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Nothing the writing threads had keeps the record's memory once its writes are done, so the block is
    lent again to the record after next."""
    monkeypatch.setattr(reuse, "SMALLEST", 1)
    memory = ReusedMemory(blocks=2)
    blocks = []
    with OutputFile(tmp_path / "out.bin") as out:
        writing: list[Future[None]] = []
        for index in range(6):
            tensor = _lent(memory, random.Random(index).randbytes(3 * output.IN_PLACE_SMALLEST), out.offset)
            blocks.append(tensor.untyped_storage().data_ptr())
            written = out.write_in_place(tensor.numpy().data)
            assert written
            del tensor
            output.settled(writing)
            writing = written
    assert len(set(blocks)) == 2, blocks


def test_a_full_disk_while_writing_in_place_is_an_error_naming_the_file(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    real_pwrite = os.pwrite

    def full(fd: int, data: memoryview, offset: int) -> int:
        if len(data) > BLOCK:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", full)
    monkeypatch.setattr(reuse, "SMALLEST", 1)
    path = tmp_path / "out.bin"
    tensor = _lent(ReusedMemory(), bytes(4 * output.IN_PLACE_SMALLEST), 0)
    with pytest.raises(OSError) as caught:
        with OutputFile(path) as out:
            output.settled(out.write_in_place(tensor.numpy().data))
    assert caught.value.errno == errno.ENOSPC and caught.value.filename == str(path)
    assert out.digest is None


def test_short_writes_in_place_are_continued(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_pwrite = os.pwrite
    monkeypatch.setattr(os, "pwrite", lambda fd, data, offset: real_pwrite(fd, memoryview(data)[:5 * BLOCK], offset))
    monkeypatch.setattr(reuse, "SMALLEST", 1)
    data = random.Random(5).randbytes(2 * output.IN_PLACE_SMALLEST + 3)
    with OutputFile(tmp_path / "out.bin") as out:
        out.write(b"head")
        out.write_in_place(_lent(ReusedMemory(), data, out.offset).numpy().data)
    assert (tmp_path / "out.bin").read_bytes() == b"head" + data


def test_a_failed_write_in_place_the_caller_never_waited_for_still_fails_the_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An in-place write that failed while the caller went on to the next record is raised at a later write or
    at the close, never dropped: the file is not fsynced as if complete."""
    real_pwrite = os.pwrite
    failed = threading.Event()

    def failing_once(fd: int, data: memoryview, offset: int) -> int:
        if len(data) > BLOCK and not failed.is_set():
            failed.set()
            raise OSError(errno.EIO, "Input/output error")
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", failing_once)
    monkeypatch.setattr(reuse, "SMALLEST", 1)
    memory = ReusedMemory(blocks=3)
    path = tmp_path / "out.bin"
    with pytest.raises(OSError) as caught:
        with OutputFile(path) as out:
            first = _lent(memory, bytes(2 * output.IN_PLACE_SMALLEST), out.offset)
            out.write_in_place(first.numpy().data)  # its futures never waited for by the caller
            failed.wait(5)
            for index in range(2):
                later = _lent(memory, bytes(2 * output.IN_PLACE_SMALLEST), out.offset)
                out.write_in_place(later.numpy().data)
    assert caught.value.errno == errno.EIO and caught.value.filename == str(path)
    assert out.digest is None
