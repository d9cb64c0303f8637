"""One conversion over several processes: --workers, torchrun, and --shard-index/--num-shards."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner
from support.format_outputs import assert_same_bytes
from support.tiny_models import GQA_SWIGLU, MOE
from support.megatron_fixtures import make_full_model, write_megatron_checkpoint
from support.torchrun import run_torchrun
from support.toy_format import register

import pgconvert
from pgconvert.cli import main
from pgconvert.errors import ValidationError
from pgconvert.formats import PlannedFile
from pgconvert.run.sharded import balanced_shares

TESTS = Path(__file__).parent


@pytest.fixture
def src(tmp_path: Path) -> Path:
    return write_megatron_checkpoint(tmp_path / "src", MOE, make_full_model(MOE), 2, 1, ep=2)


@pytest.fixture
def reference(src: Path, tmp_path: Path) -> Path:
    result = CliRunner().invoke(main, ["-q", "--dst-tp", "1", "--dst-pp", "2", "--dst-ep", "4", str(src),
                                       str(tmp_path / "reference")])
    assert result.exit_code == 0, result.output
    return tmp_path / "reference"


FLAGS = ["--dst-tp", "1", "--dst-pp", "2", "--dst-ep", "4"]


def test_balanced_shares_split_by_bytes_deterministically() -> None:
    files = [PlannedFile(f"f{i}", 1, size) for i, size in enumerate([100, 60, 50, 40, 30, 20, 10, 5])]

    shares = balanced_shares(files, 3)

    totals = [sum(next(f.nbytes for f in files if f.relpath == name) for name in share) for share in shares]
    assert sorted(name for share in shares for name in share) == sorted(f.relpath for f in files)
    assert max(totals) - min(totals) <= 20
    assert shares == balanced_shares(list(reversed(files)), 3)


def test_workers_give_the_single_process_output(src: Path, reference: Path, tmp_path: Path) -> None:
    result = CliRunner().invoke(main, ["-q", "--workers", "2", *FLAGS, str(src), str(tmp_path / "workers")])

    assert result.exit_code == 0, result.output
    assert_same_bytes(tmp_path / "workers", reference)
    assert (tmp_path / "workers" / "pgconvert.json").is_file()


def test_a_memory_budget_below_one_file_still_converts_one_file_at_a_time(src: Path, reference: Path,
                                                                          tmp_path: Path) -> None:
    result = CliRunner().invoke(main, ["-q", "--workers", "2", "--max-memory", "1KB", *FLAGS, str(src),
                                       str(tmp_path / "budget")])

    assert result.exit_code == 0, result.output
    assert_same_bytes(tmp_path / "budget", reference)


def test_workers_need_a_format_that_can_be_split(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    register(monkeypatch)  # a plugin format whose saver writes its files in one pass
    src = write_megatron_checkpoint(tmp_path / "src", GQA_SWIGLU, make_full_model(GQA_SWIGLU), 2, 1)

    with pytest.raises(ValidationError, match="the toy saver writes its files in one pass"):
        pgconvert.convert(src, tmp_path / "toy", dst_format="toy", workers=2)

    assert not (tmp_path / "toy").exists()


def test_shards_run_separately_rename_only_when_the_last_one_finishes(src: Path, reference: Path,
                                                                      tmp_path: Path) -> None:
    dst = tmp_path / "sharded"
    runner = CliRunner()

    second = runner.invoke(main, ["--shard-index", "1", "--num-shards", "3", *FLAGS, str(src), str(dst)])
    assert second.exit_code == 0, second.output
    assert not dst.exists()
    first = runner.invoke(main, ["--shard-index", "0", "--num-shards", "3", *FLAGS, str(src), str(dst)])
    assert not dst.exists()
    last = runner.invoke(main, ["--shard-index", "2", "--num-shards", "3", *FLAGS, str(src), str(dst)])

    assert first.exit_code == 0 and last.exit_code == 0, last.output
    assert "every share is complete" in last.output and "every share is complete" not in first.output
    assert_same_bytes(dst, reference)
    assert list(tmp_path.glob(".sharded.pgconvert-partial-*")) == []


def test_a_failed_shard_keeps_the_output_unrenamed_and_a_rerun_of_it_completes(src: Path, reference: Path,
                                                                              tmp_path: Path,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    import pgconvert.savers.megatron as megatron_saver  # rank files go through its stream writer

    dst = tmp_path / "sharded"
    runner = CliRunner()
    real_save = megatron_saver.save_stream

    def broken(obj: object, path: object, *args: object, **kwargs: object) -> None:
        raise OSError(28, "No space left on device", str(path))

    monkeypatch.setattr(megatron_saver, "save_stream", broken)
    failed = runner.invoke(main, ["--shard-index", "0", "--num-shards", "2", *FLAGS, str(src), str(dst)])
    monkeypatch.setattr(megatron_saver, "save_stream", real_save)
    other = runner.invoke(main, ["--shard-index", "1", "--num-shards", "2", *FLAGS, str(src), str(dst)])

    assert failed.exit_code == 1 and "No space left on device" in failed.output
    assert other.exit_code == 0
    assert not dst.exists()

    rerun = runner.invoke(main, ["--shard-index", "0", "--num-shards", "2", *FLAGS, str(src), str(dst)])

    assert rerun.exit_code == 0, rerun.output
    assert_same_bytes(dst, reference)


def test_two_process_torchrun_gives_the_single_process_output(src: Path, reference: Path, tmp_path: Path) -> None:
    done = run_torchrun("-m", "pgconvert", "-q", *FLAGS, str(src), str(tmp_path / "torchrun"))

    assert done.returncode == 0, done.stderr
    assert "every share is complete" in done.stdout
    assert_same_bytes(tmp_path / "torchrun", reference)


def test_a_failing_torchrun_process_fails_the_run_and_nothing_is_renamed(src: Path, tmp_path: Path) -> None:
    dst = tmp_path / "torchrun"

    done = run_torchrun(str(TESTS / "support" / "failing_rank_convert.py"), "1", "-q", *FLAGS, str(src), str(dst))

    assert done.returncode != 0
    assert "Input/output error (injected)" in done.stdout + done.stderr
    assert not dst.exists()
