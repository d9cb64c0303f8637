"""A full disk and short writes in the middle of a conversion, for every destination format and for a conversion that
carries the distributed optimizer's state. The faults are planted in ``os.pwrite``, which ``OutputFile`` writes every
data file with (Megatron rank files and distrib_optim.pt, safetensors shards, torch_dist and fsdp_dtensor data files), as a full disk
gives them: a write that does not fit writes what does, the next one fails with ENOSPC."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
from click.testing import Result
from support.cli_helpers import assert_clean_refusal, run_cli
from support.format_outputs import DISTRIBUTED_OPTIMIZER_RUN, SHARD_SIZE, assert_same_bytes, write_sources
from support.full_disk import FillingDisk

import pgconvert.io.output as output
from pgconvert.io.output import BLOCK, BUFFER_BYTES, BUFFERS
from pgconvert.run.manifest import file_problems, read_manifest

# case: (source, conversion flags, the kind of file the fault hits: ends with)
CASES: dict[str, tuple[str, list[str], str]] = {
    "megatron": ("megatron", ["--dst-tp", "1", "--dst-pp", "2", "--dst-ep", "4"], "model_optim_rng.pt"),
    "hf": ("hf", ["--dst-format", "hf", *SHARD_SIZE], ".safetensors"),
    "torch_dist": ("megatron", ["--dst-format", "torch_dist", *SHARD_SIZE], ".distcp"),
    "fsdp_dtensor": ("hf", ["--dst-format", "fsdp_dtensor", *SHARD_SIZE], ".distcp"),
    "megatron_distributed_optimizer": ("optimizer_run", ["--dst-tp", "1"], "distrib_optim.pt"),
}
# Files that make a directory look like a complete checkpoint: the manifest, Megatron's tracker, the hf index and
# config, torch_dist's index and Megatron's metadata.json.
COMPLETE_MARKERS = ("pgconvert.json", "latest_checkpointed_iteration.txt", "model.safetensors.index.json",
                    "config.json", ".metadata", "metadata.json")
# OutputFile's staging buffers (how many, bytes each): every tiny file fits in one, so the failed write surfaces when
# the file is closed; with one buffer of a block it surfaces in a write the saver makes in the middle of the file,
# inside the saver's own code.
BUFFERING = {"fails-at-close": (BUFFERS, BUFFER_BYTES), "fails-mid-file": (1, BLOCK)}


class ShortWrites:
    """``os.pwrite`` that, once ``after`` bytes are written, writes only the first half of what it is asked (at
    least a byte) and returns that count."""

    def __init__(self, after: int) -> None:
        self.after = after
        self.whole = 0
        self.short = 0
        self._real = os.pwrite
        self._lock = threading.Lock()

    def pwrite(self, fd: int, data: bytes | bytearray | memoryview, offset: int) -> int:
        view = memoryview(data).cast("B")
        with self._lock:
            if self.after > 0:
                self.whole += 1
                written = self._real(fd, view, offset)
                self.after -= written
                return written
            self.short += 1
            return self._real(fd, view[:max(1, len(view) // 2)], offset)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    """Each case's source and its output written by one process with nothing planted."""
    root = tmp_path_factory.mktemp("write_faults")
    sources = {**write_sources(root), "optimizer_run": DISTRIBUTED_OPTIMIZER_RUN}
    made = {}
    for case, (source, flags, _) in CASES.items():
        clean = root / f"{case}_clean"
        result = _convert(sources[source], clean, flags)
        assert result.exit_code == 0, result.output
        made[case] = (sources[source], clean)
    return made


def _convert(src: Path, dst: Path, flags: list[str], *more: str) -> Result:
    return run_cli("-q", *flags, *more, src, dst)


def _output_bytes(root: Path) -> int:
    return sum(path.stat().st_size for path in root.rglob("*") if path.is_file())


@pytest.mark.parametrize("buffering", BUFFERING)
@pytest.mark.parametrize("case", CASES)
def test_a_full_disk_mid_run_names_the_file_leaves_nothing_and_a_rerun_completes(
        runs: dict[str, tuple[Path, Path]], case: str, buffering: str, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    src, clean = runs[case]
    flags, fails_in = CASES[case][1:]
    dst = tmp_path / "dst"
    disk = FillingDisk(_output_bytes(clean) // 2)

    with monkeypatch.context() as patched:
        patched.setattr(os, "pwrite", disk.pwrite)
        patched.setattr(output, "BUFFERS", BUFFERING[buffering][0])
        patched.setattr(output, "BUFFER_BYTES", BUFFERING[buffering][1])
        failed = _convert(src, dst, flags)

    assert disk.failed is not None and disk.failed.endswith(fails_in), disk.files
    assert disk.files.index(disk.failed) > 0  # mid-run: a file was written whole before
    assert_clean_refusal(failed, 1, "No space left on device", disk.failed)
    assert list(tmp_path.iterdir()) == []  # neither DST nor a staging directory

    rerun = _convert(src, dst, flags)

    assert rerun.exit_code == 0, rerun.output
    assert_same_bytes(dst, clean)
    assert list(tmp_path.iterdir()) == [dst]


@pytest.mark.parametrize("case", ["megatron", "hf", "torch_dist", "fsdp_dtensor"])
def test_a_full_disk_in_a_share_leaves_no_complete_looking_output_and_its_rerun_completes(
        runs: dict[str, tuple[Path, Path]], case: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src, clean = runs[case]
    flags = CASES[case][1]
    dst = tmp_path / "dst"
    disk = FillingDisk(_output_bytes(clean) // 4)  # share 0 writes about half

    with monkeypatch.context() as patched:
        patched.setattr(os, "pwrite", disk.pwrite)
        failed = _convert(src, dst, flags, "--shard-index", "0", "--num-shards", "2")
    other = _convert(src, dst, flags, "--shard-index", "1", "--num-shards", "2")

    assert disk.failed is not None and disk.files.index(disk.failed) > 0, disk.files
    assert_clean_refusal(failed, 1, "No space left on device", disk.failed)
    assert other.exit_code == 0, other.output
    staging, = tmp_path.iterdir()  # the shares' shared staging directory, kept for the rerun
    assert staging != dst and ".pgconvert-partial-shared-" in staging.name
    assert sorted(path.name for path in staging.rglob("*") if path.name in COMPLETE_MARKERS) == []

    rerun = _convert(src, dst, flags, "--shard-index", "0", "--num-shards", "2")

    assert rerun.exit_code == 0, rerun.output
    assert_same_bytes(dst, clean)
    assert list(tmp_path.iterdir()) == [dst]


@pytest.mark.parametrize("case", CASES)
def test_short_writes_mid_run_are_continued_to_the_same_output(
        runs: dict[str, tuple[Path, Path]], case: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src, clean = runs[case]
    dst = tmp_path / "dst"
    writes = ShortWrites(after=_output_bytes(clean) // 4)

    with monkeypatch.context() as patched:
        patched.setattr(os, "pwrite", writes.pwrite)
        patched.setattr(output, "BUFFER_BYTES", 16 * BLOCK)  # each file in several writes: short ones begin mid-file
        result = _convert(src, dst, CASES[case][1])

    assert result.exit_code == 0, result.output
    assert writes.whole > 0 and writes.short > 0  # short writes began in the middle of the conversion
    assert_same_bytes(dst, clean)
    manifest = read_manifest(dst)
    assert manifest is not None and file_problems(dst, manifest) == []  # sha256s of the bytes on disk
