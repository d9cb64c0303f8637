"""``--threads``: a conversion's independent destination files written on a pool of threads give the one-thread
output byte for byte, from every source format (whose readers are then used by two threads at once); each file
is produced in a copy of the caller's context (``--digest none`` hashes nothing); a failed file fails the run,
named, stops the other thread and leaves nothing complete-looking."""

from __future__ import annotations

import contextvars
import errno
import json
import os
import threading
import warnings
from pathlib import Path

import pytest
from click.testing import CliRunner
from support.format_outputs import SHARD_SIZE, assert_same_bytes, write_sources

from pgconvert.cli import main
from pgconvert.formats.torch_dist import single_process_calls
from pgconvert.io import output as output_module
from pgconvert.io import ranges
from pgconvert.io.digest import Hasher
from pgconvert.io.output import OutputFile
from pgconvert.io.ranges import FileHandles
from pgconvert.io.threads import run_each, spread
from pgconvert.run.convert import convert

WAIT = 30.0  # seconds a test waits for another thread before it gives up (never reached when all is well)

# (source, destination format, flags): per-rank TP/PP/EP changes from each source format, and hf shards.
CASES = {
    "megatron to tp1 pp2": ("megatron", "megatron", ["--dst-tp", "1", "--dst-pp", "2", "--dst-ep", "1"]),
    "megatron to tp2 pp2 ep2": ("megatron", "megatron", ["--dst-tp", "2", "--dst-pp", "2"]),
    "torch_dist to tp1 pp2": ("torch_dist", "megatron", ["--dst-tp", "1", "--dst-pp", "2", "--dst-ep", "1"]),
    "hf to tp2 pp2": ("hf", "megatron", ["--dst-tp", "2", "--dst-pp", "2"]),
    "hf to hf shards": ("hf", "hf", SHARD_SIZE),
}


def _convert(src: Path, dst: Path, dst_format: str, *flags: str) -> None:
    result = CliRunner().invoke(main, ["-q", "--dst-format", dst_format, *flags, str(src), str(dst)])
    assert result.exit_code == 0, result.output


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A TP2 EP2 Megatron checkpoint with experts, the same model as torch_dist, and a tiny HF model."""
    root = tmp_path_factory.mktemp("sources")
    made = write_sources(root)
    _convert(made["megatron"], root / "torch_dist_src", "torch_dist")
    made["torch_dist"] = root / "torch_dist_src"
    return made


def _data_files(root: Path) -> list[Path]:
    return sorted([*root.rglob("*.pt"), *root.rglob("*.safetensors")])


@pytest.mark.parametrize("case", list(CASES))
def test_two_threads_write_the_one_thread_output(sources: dict[str, Path], case: str, tmp_path: Path) -> None:
    source, dst_format, flags = CASES[case]
    _convert(sources[source], tmp_path / "one", dst_format, *flags, "--threads", "1")

    _convert(sources[source], tmp_path / "two", dst_format, *flags, "--threads", "2")

    assert len(_data_files(tmp_path / "one")) >= 2  # files to share between the threads
    assert_same_bytes(tmp_path / "two", tmp_path / "one")


def test_digest_none_under_threads_hashes_nothing_and_records_sizes(sources: dict[str, Path], tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    hashed: list[int] = []
    real = output_module.new_hasher

    def counting_hasher(algorithm: str) -> Hasher:
        hashed.append(threading.get_ident())
        return real(algorithm)

    monkeypatch.setattr(output_module, "new_hasher", counting_hasher)
    convert(sources["megatron"], tmp_path / "hashed", dst_tp=1, dst_pp=2, dst_ep=1, threads=2)
    assert len(hashed) >= 2  # the counter sees the files' hashes when there are any
    hashed.clear()

    convert(sources["megatron"], tmp_path / "sizes", dst_tp=1, dst_pp=2, dst_ep=1, threads=2, digest="none")

    assert hashed == []
    records = json.loads((tmp_path / "sizes" / "pgconvert.json").read_text())["files"]
    assert records and all(record["digest"] is None and record["size"] > 0 for record in records)
    assert_same_bytes(tmp_path / "sizes", tmp_path / "hashed")


def test_a_failed_file_fails_the_run_names_it_and_stops_the_other_thread(
        sources: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Four rank files on two threads: the first fails at its first write to disk once the second has begun;
    the second stops at its next write (never fsynced), the other two never start."""
    dst = tmp_path / "dst"
    failing, other = "mp_rank_00_000/", "mp_rank_01_000/"
    other_started, failed = threading.Event(), threading.Event()
    opened: list[str] = []
    synced: list[str] = []
    real_init, real_write, real_pwrite, real_fsync = OutputFile.__init__, OutputFile.write, os.pwrite, os.fsync
    paths_by_fd: dict[int, str] = {}

    def init(self: OutputFile, path: Path) -> None:
        real_init(self, path)
        opened.append(str(path))
        paths_by_fd[self._fd] = str(path)

    def write(self: OutputFile, data: bytes | bytearray | memoryview) -> int:
        if other in str(self.path) and not other_started.is_set():
            other_started.set()
            failed.wait(WAIT)  # written only once the first file has failed
        return real_write(self, data)

    def pwrite(fd: int, data: memoryview, offset: int) -> int:
        if failing in paths_by_fd.get(fd, ""):
            other_started.wait(WAIT)
            failed.set()
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_pwrite(fd, data, offset)

    def fsync(fd: int) -> None:
        synced.append(paths_by_fd.get(fd, ""))
        real_fsync(fd)

    monkeypatch.setattr(OutputFile, "__init__", init)
    monkeypatch.setattr(OutputFile, "write", write)
    monkeypatch.setattr(os, "pwrite", pwrite)
    monkeypatch.setattr(os, "fsync", fsync)

    result = CliRunner().invoke(main, ["-q", "--dst-tp", "2", "--dst-pp", "2", "--dst-ep", "1", "--threads", "2",
                                       str(sources["megatron"]), str(dst)])

    assert result.exit_code == 1, result.output
    assert "No space left on device" in result.output and f"{failing}model_optim_rng.pt" in result.output
    assert "Traceback" not in result.output
    assert sorted(Path(path).parent.name + "/" for path in opened) == sorted([failing, other])
    assert not any(failing in path or other in path for path in synced)
    assert not dst.exists() and list(tmp_path.iterdir()) == []  # nothing left that looks complete, or at all


def test_tasks_run_in_a_copy_of_the_submitting_context() -> None:
    setting: contextvars.ContextVar[str] = contextvars.ContextVar("setting", default="unset")
    setting.set("caller's")
    both_running = threading.Barrier(2, timeout=WAIT)

    def task(mine: str) -> tuple[str, str, int]:
        seen = setting.get()
        setting.set(mine)
        both_running.wait()  # the two tasks on two threads at once, each after setting its own value
        return seen, setting.get(), threading.get_ident()

    results = run_each([lambda: task("first"), lambda: task("second")], threads=2)

    assert [result[:2] for result in results] == [("caller's", "first"), ("caller's", "second")]
    assert results[0][2] != results[1][2] != threading.get_ident()
    assert setting.get() == "caller's"


def test_run_each_raises_the_failed_task_and_cancels_the_rest() -> None:
    started: list[int] = []

    def task(index: int) -> int:
        started.append(index)
        if index == 0:
            raise ValueError("the first task failed")
        return index

    with pytest.raises(ValueError, match="the first task failed"):
        run_each([lambda index=index: task(index) for index in range(50)], threads=1 + 1)

    assert len(started) < 50


def test_file_handles_of_one_thread_outlive_another_threads_evictions(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    paths = [tmp_path / f"file{i}" for i in range(3)]
    for index, path in enumerate(paths):
        path.write_bytes(bytes([index]) * 16)
    handles = FileHandles(limit=1)
    mine = handles.fd(paths[0])
    closed: list[int] = []
    real_close = os.close
    monkeypatch.setattr(ranges.os, "close", lambda fd: (closed.append(fd), real_close(fd))[1])

    other = threading.Thread(target=lambda: [handles.fd(path) for path in paths[1:]])  # evicts in its own set
    other.start()
    other.join()

    assert mine not in closed
    assert os.pread(mine, 16, 0) == bytes([0]) * 16
    handles.close()
    assert mine in closed and len(closed) == 3


def test_single_process_calls_on_two_threads_leave_the_warning_filters_as_they_were() -> None:
    before = list(warnings.filters)
    first_inside, second_inside, first_left = threading.Event(), threading.Event(), threading.Event()

    def first() -> None:
        with single_process_calls():
            first_inside.set()
            second_inside.wait(WAIT)
        first_left.set()

    def second() -> None:
        first_inside.wait(WAIT)
        with single_process_calls():
            second_inside.set()
            first_left.wait(WAIT)  # the first thread leaves before this one: out of order

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    assert warnings.filters == before


def _dry_run_memory_line(src: Path, dst: Path, *flags: str) -> str:
    result = CliRunner().invoke(main, ["--dry-run", *flags, str(src), str(dst)])
    assert result.exit_code == 0, result.output
    return next(line for line in result.output.splitlines() if line.startswith("memory in flight:"))


def test_dry_run_counts_the_memory_of_each_thread(sources: dict[str, Path], tmp_path: Path) -> None:
    from pgconvert.io.output import OUTPUT_STAGING_BYTES
    from pgconvert.run.convert import convert_request, plan

    conversion = plan(convert_request(sources["megatron"], tmp_path / "dst", dst_tp=1, dst_pp=2, dst_ep=1, threads=2))
    conversion.source.close()
    largest = conversion.largest_tensor
    assert largest > 0 and conversion.files_at_once == 2
    assert conversion.memory_in_flight == 2 * (2 * largest + OUTPUT_STAGING_BYTES)  # a record written, one made
    flags = ["--dst-tp", "1", "--dst-pp", "2", "--dst-ep", "1"]

    one = _dry_run_memory_line(sources["megatron"], tmp_path / "dst", *flags, "--threads", "1")
    two = _dry_run_memory_line(sources["megatron"], tmp_path / "dst", *flags, "--threads", "2")
    more_than_files = _dry_run_memory_line(sources["megatron"], tmp_path / "dst", *flags, "--threads", "8")
    one_pass = _dry_run_memory_line(sources["megatron"], tmp_path / "dst", "--dst-format", "torch_dist", "--threads", "2")

    assert "1 file at once" in one and "2 files at once" in two and "2 files at once" in more_than_files
    assert "1 file at once" in one_pass  # torch_dist writes its data files in one pass


def test_dry_run_counts_the_record_an_hf_shard_writes_while_it_makes_the_next(sources: dict[str, Path],
                                                                               tmp_path: Path) -> None:
    from pgconvert.io.output import OUTPUT_STAGING_BYTES, RECORDS_IN_FLIGHT
    from pgconvert.run.convert import convert_request, plan

    conversion = plan(convert_request(sources["hf"], tmp_path / "dst", dst_format="hf", threads=2))
    conversion.source.close()
    largest, at_once = conversion.largest_tensor, conversion.files_at_once
    assert largest > 0 and RECORDS_IN_FLIGHT == 1 and conversion.saver.records_in_flight == RECORDS_IN_FLIGHT
    assert conversion.memory_in_flight == at_once * (2 * largest + OUTPUT_STAGING_BYTES)
    line = _dry_run_memory_line(sources["hf"], tmp_path / "dst", "--dst-format", "hf")
    assert "2 tensors as large as its largest" in line and "one is written while the next is made" in line


@pytest.mark.parametrize("threads", [0, -1, True, 1.5])
def test_a_thread_count_below_one_or_not_whole_is_refused(sources: dict[str, Path], tmp_path: Path,
                                                         threads: object) -> None:
    from pgconvert.errors import ValidationError

    with pytest.raises(ValidationError, match=r"--threads .*: must be a whole number of at least 1"):
        convert(sources["megatron"], tmp_path / "dst", dst_tp=1, threads=threads)
    assert not (tmp_path / "dst").exists()


@pytest.mark.parametrize("count", [1, 2, 5])
def test_spread_calls_each_index_once_and_returns_when_all_have_returned(count: int) -> None:
    calls: list[tuple[int, int, str]] = []
    lock = threading.Lock()

    def work(index: int, total: int) -> None:
        with lock:
            calls.append((index, total, threading.current_thread().name))

    spread(work, count)
    assert sorted(call[:2] for call in calls) == [(index, count) for index in range(count)]
    assert [name for index, _, name in calls if index == 0] == [threading.current_thread().name]


@pytest.mark.parametrize("failing", [0, 1])
def test_spread_raises_a_calls_error_only_once_every_call_has_ended(failing: int) -> None:
    """A failure on this thread or a helper is raised here, after the other call has finished (it may be writing
    into memory the caller owns)."""
    finished = threading.Event()

    def work(index: int, total: int) -> None:
        if index == failing:
            raise ValueError(f"call {index} failed")
        threading.Event().wait(0.2)
        finished.set()

    with pytest.raises(ValueError, match=f"call {failing} failed"):
        spread(work, 2)
    assert finished.is_set()
