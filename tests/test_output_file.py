"""``OutputFile``: the bytes and digest of every size around its block and buffer boundaries, and each
fallback (O_DIRECT refused at open or at a write, short writes), a full disk and a failed block."""

from __future__ import annotations

import errno
import hashlib
import os
import random
from pathlib import Path

import pytest
import xxhash

import pgconvert.io.output as output
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
