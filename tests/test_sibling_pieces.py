"""The rank files of a TP group written at once, taking the pieces they would each read whole from one read of the
tensor (``pgconvert.formats.sibling_pieces``): the output is byte for byte the one each file reading its own pieces
writes, every shared tensor is read once per group, the group never holds two whole tensors, a failing sibling
fails the run without leaving the others waiting, and ``--dry-run`` counts the files written at once."""

from __future__ import annotations

import _thread
import os
import threading
from collections import Counter
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from support.format_outputs import assert_same_bytes, write_sources
from support.in_place import count_in_place

from pgconvert.cli import main
from pgconvert.errors import CheckpointError
from pgconvert.formats.stream import CanonicalSource
from pgconvert.io.threads import Stopped, check_running, run_each
from pgconvert.model.rules import Chunked, Replicated, VocabParallel, strided_in_whole
from pgconvert.io.output import OUTPUT_STAGING_BYTES, OutputFile
from pgconvert.run.convert import convert, convert_request, plan

WAIT = 30.0  # seconds a test waits for another thread before it gives up (never reached when all is well)
ROW_PARALLEL = ("self_attention.linear_proj.weight", "mlp.linear_fc2.weight")


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny HF Llama, a TP2 EP2 Megatron checkpoint with experts, and the HF model as TP1 Megatron and torch_dist
    checkpoints."""
    root = tmp_path_factory.mktemp("sources")
    made = write_sources(root)
    convert(made["hf"], root / "tp1", dst_format="megatron", dst_tp=1)
    made["tp1"] = root / "tp1"
    convert(made["tp1"], root / "torch_dist_tp1", dst_format="torch_dist")
    made["torch_dist_tp1"] = root / "torch_dist_tp1"
    return made


# (source, flags): row-parallel pieces strided in HF tensors, with pipeline stages, in a TP1 rank's tensors and a
# TP1 torch_dist store's chunks (cut for four ranks), and in TP2 pieces of a model with experts cut for four.
CASES = {
    "hf to tp4": ("hf", ["--dst-tp", "4"]),
    "hf to tp2 pp2": ("hf", ["--dst-tp", "2", "--dst-pp", "2"]),
    "tp1 to tp4": ("tp1", ["--dst-tp", "4"]),
    "torch_dist tp1 to tp4 pp2": ("torch_dist_tp1", ["--dst-tp", "4", "--dst-pp", "2"]),
    "moe tp2 ep2 to tp4 ep1": ("megatron", ["--dst-tp", "4", "--dst-ep", "1"]),
}


def _convert(src: Path, dst: Path, *flags: str) -> None:
    result = CliRunner().invoke(main, ["-q", "--dst-format", "megatron", *flags, str(src), str(dst)])
    assert result.exit_code == 0, result.output


def _sharing_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(CanonicalSource, "shares_piece_reads", lambda *args, **kwargs: False)


def _recording_reads(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, tuple[int, ...]]]:
    """Each ``read_pieces`` call: the tensor and the ranks whose pieces it filled."""
    calls: list[tuple[str, tuple[int, ...]]] = []
    lock = threading.Lock()
    real = CanonicalSource.read_pieces

    def read_pieces(self: CanonicalSource, name: str, rule: object, size: int, pieces: dict[int, torch.Tensor],
                    rows: int | None = None) -> None:
        with lock:
            calls.append((name, tuple(sorted(pieces))))
        real(self, name, rule, size, pieces, rows)

    monkeypatch.setattr(CanonicalSource, "read_pieces", read_pieces)
    return calls


@pytest.mark.parametrize("case", list(CASES))
def test_a_tp_group_written_in_lockstep_gives_each_files_own_reads_output(
        sources: dict[str, Path], case: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    source, flags = CASES[case]
    calls = _recording_reads(monkeypatch)
    _convert(sources[source], tmp_path / "shared", *flags)
    monkeypatch.undo()
    _sharing_off(monkeypatch)
    _convert(sources[source], tmp_path / "apart", *flags)

    assert any(name.endswith(ROW_PARALLEL) for name, _ in calls)  # the row-parallel weights were shared
    assert Counter(name for name, _ in calls).most_common(1)[0][1] == 1  # each once: one group holds each tensor
    tp = int(flags[flags.index("--dst-tp") + 1])
    assert {ranks for _, ranks in calls} == {tuple(range(tp))}  # every sibling's piece filled by the one read
    assert_same_bytes(tmp_path / "shared", tmp_path / "apart")


@pytest.mark.parametrize("case", ["hf to tp4", "torch_dist tp1 to tp4 pp2"])
def test_a_tp_groups_files_write_their_records_from_their_own_memory_as_staged_files_hold_them(
        sources: dict[str, Path], case: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each sibling's pieces are made at their place in its file and written from there (the group waiting for each
    record's write before it reads the next): most bytes go in place, and the files are those staged writes give."""
    from pgconvert.io import output, reuse

    source, flags = CASES[case]
    monkeypatch.setattr(reuse, "SMALLEST", 1)  # the tiny model's records are lent memory
    monkeypatch.setattr(output, "IN_PLACE_SMALLEST", output.BLOCK)
    calls = _recording_reads(monkeypatch)
    placed = count_in_place(monkeypatch)
    _convert(sources[source], tmp_path / "in_place", *flags)
    monkeypatch.setattr(output.OutputFile, "write_in_place", lambda self, data: self.write(data) and [])
    _convert(sources[source], tmp_path / "staged", *flags)

    assert any(name.endswith(ROW_PARALLEL) for name, _ in calls)  # the files were written as a group
    assert_same_bytes(tmp_path / "in_place", tmp_path / "staged")
    written = sum(path.stat().st_size for path in (tmp_path / "in_place").rglob("model_optim_rng.pt"))
    assert placed() > written / 2, (placed(), written)


def _bytes_read(monkeypatch: pytest.MonkeyPatch, under: Path) -> Counter[str]:
    """Bytes read by ``pread``/``preadv`` from files under ``under`` (counted by descriptor's path)."""
    read: Counter[str] = Counter()
    real_pread, real_preadv = os.pread, os.preadv

    def owner(fd: int) -> str | None:
        path = os.readlink(f"/proc/self/fd/{fd}")
        return path if path.startswith(str(under)) else None

    def pread(fd: int, length: int, offset: int) -> bytes:
        data = real_pread(fd, length, offset)
        if (path := owner(fd)) is not None:
            read[path] += len(data)
        return data

    def preadv(fd: int, buffers: list, offset: int, *flags: int) -> int:
        count = real_preadv(fd, buffers, offset, *flags)
        if (path := owner(fd)) is not None:
            read[path] += count
        return count

    monkeypatch.setattr(os, "pread", pread)
    monkeypatch.setattr(os, "preadv", preadv)
    return read


def test_the_group_reads_each_source_byte_about_once_where_apart_each_file_reads_them_all(
        sources: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    weights = sum(path.stat().st_size for path in sources["hf"].glob("*.safetensors"))
    shared = _bytes_read(monkeypatch, sources["hf"].resolve())
    _convert(sources["hf"], tmp_path / "shared", "--dst-tp", "4")
    shared_total = sum(shared.values())
    monkeypatch.undo()
    _sharing_off(monkeypatch)
    apart = _bytes_read(monkeypatch, sources["hf"].resolve())
    _convert(sources["hf"], tmp_path / "apart", "--dst-tp", "4")

    assert shared_total <= 1.1 * weights, (shared_total, weights)
    assert sum(apart.values()) > 1.5 * weights  # what the group saves: each file reading the spans of all


def test_columns_of_an_hf_tensor_are_read_in_one_pass_without_the_whole_tensor(
        sources: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    wholes: list[str] = []
    real_whole = CanonicalSource.load_base
    monkeypatch.setattr(CanonicalSource, "load_base",
                        lambda self, name: (wholes.append(name), real_whole(self, name))[1])
    calls = _recording_reads(monkeypatch)

    _convert(sources["hf"], tmp_path / "dst", "--dst-tp", "4")

    assert [name for name, _ in calls if name.endswith(ROW_PARALLEL)]
    assert [name for name in wholes if name.endswith(ROW_PARALLEL)] == []  # no whole tensor in memory


def test_a_failing_sibling_fails_the_run_named_and_the_others_stop_waiting(
        sources: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_read = CanonicalSource.read_pieces

    def read_pieces(self: CanonicalSource, name: str, *args: object) -> None:
        if name.endswith("mlp.linear_fc2.weight"):
            raise CheckpointError(f"cannot read {name} for the group")
        real_read(self, name, *args)

    monkeypatch.setattr(CanonicalSource, "read_pieces", read_pieces)
    watchdog = threading.Timer(WAIT, _thread.interrupt_main)  # a run left waiting is interrupted, and fails below
    watchdog.start()
    try:
        result = CliRunner().invoke(main, ["-q", "--dst-format", "megatron", "--dst-tp", "4", str(sources["hf"]),
                                           str(tmp_path / "dst")])
    finally:
        watchdog.cancel()
    assert result.exit_code == 1, result.output
    assert "cannot read" in result.output and "linear_fc2.weight for the group" in result.output
    assert "Traceback" not in result.output
    assert list(tmp_path.iterdir()) == []  # nothing left that looks complete, or at all


def test_dry_run_counts_a_groups_files_and_the_group_shares_one_files_write_buffers(
        sources: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    conversion = plan(convert_request(sources["hf"], tmp_path / "planned", dst_format="megatron", dst_tp=4, threads=2))
    conversion.source.close()
    assert (conversion.files_at_once, conversion.files_together) == (4, 4)  # one group of four: the four files
    assert conversion.memory_in_flight == 2 * conversion.largest_tensor + OUTPUT_STAGING_BYTES
    result = CliRunner().invoke(main, ["--dry-run", "--dst-format", "megatron", "--dst-tp", "4", str(sources["hf"]),
                                       str(tmp_path / "dst")])
    assert result.exit_code == 0, result.output
    assert "memory in flight: 4 files at once, in groups of 4" in result.output
    staged: list[int] = []
    real_init = OutputFile.__init__

    def init(self: OutputFile, path: Path) -> None:
        real_init(self, path)
        staged.append(sum(len(buffer) for buffer in self._buffers))

    monkeypatch.setattr(OutputFile, "__init__", init)
    _convert(sources["hf"], tmp_path / "dst", "--dst-tp", "4")

    assert staged == [OUTPUT_STAGING_BYTES // 4] * 4


def test_a_task_running_a_pool_of_its_own_stops_when_its_outer_pool_stops() -> None:
    inner_waiting = threading.Event()
    both_started = threading.Barrier(2, timeout=WAIT)
    stopped: list[bool] = []

    def inner_task() -> None:
        both_started.wait()
        inner_waiting.set()
        for _ in range(int(WAIT / 0.01)):
            try:
                check_running()
            except Stopped:
                stopped.append(True)
                raise
            threading.Event().wait(0.01)

    def outer_with_pool() -> None:
        run_each([inner_task, inner_task], threads=2)

    def outer_failing() -> None:
        inner_waiting.wait(WAIT)
        raise ValueError("the other file failed")

    with pytest.raises(ValueError, match="the other file failed"):
        run_each([outer_with_pool, outer_failing], threads=2)
    assert stopped == [True, True]


@pytest.mark.parametrize(("rule", "shape", "strided"), [
    (Chunked(dim=1), (8, 16), True),  # a row-parallel weight's columns
    (Chunked(dim=0), (8, 16), False),  # a column-parallel weight's rows: contiguous
    (Chunked(dim=1), (1, 16), False),  # one row: contiguous whatever the cut
    (Replicated(), (8, 16), False),
    (VocabParallel(), (8, 16), False),
])
def test_a_piece_is_strided_when_it_cuts_a_later_dim_of_several_rows(rule: object, shape: tuple[int, int],
                                                                     strided: bool) -> None:
    assert strided_in_whole(rule, shape, 4) is strided


@pytest.mark.parametrize("flags", [["--dst-tp", "2", "--dst-pp", "2"], ["--dst-tp", "1", "--dst-ep", "1"]])
def test_pieces_that_read_apart_without_overlap_are_not_grouped(sources: dict[str, Path], tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch,
                                                                flags: list[str]) -> None:
    """TP2 pieces kept, or merged into TP1: each stored byte is read by one destination file already."""
    calls = _recording_reads(monkeypatch)
    result = CliRunner().invoke(main, ["--dry-run", "--dst-format", "megatron", *flags, str(sources["megatron"]),
                                       str(tmp_path / "dry")])
    assert result.exit_code == 0, result.output
    assert "memory in flight: 1 file at once" in result.output

    _convert(sources["megatron"], tmp_path / "dst", *flags)

    assert calls == []


def test_processes_take_a_tp_group_whole_and_split_it_only_to_give_each_process_work(
        sources: dict[str, Path], tmp_path: Path) -> None:
    """``--workers`` and sharded runs share out the saver's groups (``Plan.file_groups``): one process takes a TP
    group's files whole, so they share their reads there; with more processes than groups the heaviest group is
    halved, each half still one process's."""
    from pgconvert.run.workers import balanced_shares, planned_units

    conversion = plan(convert_request(sources["hf"], tmp_path / "planned", dst_format="megatron", dst_tp=4,
                                      dst_pp=2))
    conversion.source.close()
    stage = {item.relpath: item.relpath.split("/")[1].split("_")[3] for item in conversion.files}  # mp_rank_TT_PPP
    assert sorted(len(group) for group in conversion.file_groups) == [4, 4]
    assert all(len({stage[path] for path in group}) == 1 for group in conversion.file_groups)
    for count, sizes in ((1, [4, 4]), (2, [4, 4]), (3, [2, 2, 4]), (4, [2, 2, 2, 2]), (8, [1] * 8)):
        units = planned_units(conversion, None, count)
        assert sorted(len(unit.relpaths) for unit in units) == sizes, count
        assert sum(unit.nbytes for unit in units) == conversion.total_bytes
        shares = balanced_shares(units, count)
        assert sorted(path for share in shares for path in share) == sorted(stage)
        assert all(set(unit.relpaths) <= set(share) for unit in units for share in shares
                   if set(unit.relpaths) & set(share))  # a unit is never cut between processes


def test_half_a_tp_group_written_by_one_process_shares_its_reads(
        sources: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _recording_reads(monkeypatch)
    conversion = plan(convert_request(sources["hf"], tmp_path / "half", dst_format="megatron", dst_tp=4))
    try:
        (group,) = conversion.file_groups
        conversion.saver.save(conversion.source, tmp_path / "half", conversion.save_options, lambda nbytes: None,
                              only=set(group[:2]))
    finally:
        conversion.source.close()
    assert any(name.endswith(ROW_PARALLEL) for name, _ in calls)
    assert {ranks for _, ranks in calls} == {(0, 1)}  # one read fills both siblings' pieces
