"""Hostile and careless destinations: symlinks,
long names, a killed ``--overwrite``, batch plans whose destinations overlap, interrupts."""

from __future__ import annotations

import fcntl
import importlib
import os
from pathlib import Path

import pytest
import torch
from support.cli_helpers import assert_clean_refusal, run_cli
from support.tiny_models import GQA_SWIGLU
from support.megatron_fixtures import make_full_model, merge_megatron_checkpoint, write_megatron_checkpoint

import pgconvert
import pgconvert.cli
from pgconvert.run.destination import LOCK_SUFFIX, NAME_MAX, RETIRED_MARKER, sibling

convert_module = importlib.import_module("pgconvert.run.convert")  # the package's ``convert`` is the function


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("pristine")
    return write_megatron_checkpoint(root / "src", GQA_SWIGLU, make_full_model(GQA_SWIGLU), 2, 1)


@pytest.fixture
def src(pristine: Path) -> Path:
    return pristine  # never written to: every test converts it elsewhere


def assert_same_model(a: Path, b: Path) -> None:
    left, right = merge_megatron_checkpoint(a, GQA_SWIGLU), merge_megatron_checkpoint(b, GQA_SWIGLU)
    assert sorted(left) == sorted(right)
    for name in left:
        assert torch.equal(left[name], right[name]), name


# ------------------------------------------------------------------------------------ symlinks


def test_dst_that_is_a_symlink_to_a_directory_is_refused_up_front(src: Path, tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.mkdir()
    link = tmp_path / "link"
    link.symlink_to(real)

    result = run_cli(src, link, "--dst-tp", "1")

    assert_clean_refusal(result, 2, f"DST {link} is a symbolic link (to '{real}')")
    assert link.is_symlink() and os.readlink(link) == str(real)
    assert list(real.iterdir()) == []
    assert sorted(path.name for path in tmp_path.iterdir()) == ["link", "real"]


def test_dangling_symlink_dst_is_refused_up_front(src: Path, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    link = tmp_path / "dangling"
    link.symlink_to(tmp_path / "nowhere")
    monkeypatch.setattr(convert_module, "execute", lambda *args, **kwargs: pytest.fail("refused too late"))

    result = run_cli(src, link, "--dst-tp", "1")

    assert_clean_refusal(result, 2, f"DST {link} is a symbolic link", "which does not exist")
    assert sorted(path.name for path in tmp_path.iterdir()) == ["dangling"]


def test_symlinked_parent_directory_is_followed(src: Path, tmp_path: Path) -> None:
    (tmp_path / "real").mkdir()
    (tmp_path / "via").symlink_to(tmp_path / "real")

    result = run_cli(src, tmp_path / "via" / "out", "--dst-tp", "1")

    assert result.exit_code == 0, result.output
    assert_same_model(src, tmp_path / "real" / "out")


# ------------------------------------------------------------------------------------ names


def test_dst_name_near_name_max_converts_with_shortened_sibling_names(src: Path, tmp_path: Path) -> None:
    dst = tmp_path / ("d" * 240)

    result = run_cli(src, dst, "--dst-tp", "1")

    assert result.exit_code == 0, result.output
    assert_same_model(src, dst)
    assert sorted(path.name for path in tmp_path.iterdir()) == [dst.name]
    lock = sibling(dst, ".pgconvert.lock")
    assert len(lock.name.encode()) <= NAME_MAX and lock.name.startswith(".ddd")
    assert sibling(dst, ".x") != sibling(tmp_path / ("d" * 239 + "e"), ".x")


def test_dst_name_over_name_max_is_refused_up_front(src: Path, tmp_path: Path) -> None:
    result = run_cli(src, tmp_path / ("d" * 300), "--dst-tp", "1")

    assert_clean_refusal(result, 2, "is 300 bytes, more than the file system's 255")


# ------------------------------------------------------------------------------------ --overwrite


def _killed_between_renames(src: Path, dst: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An --overwrite run on a system without a one-step swap that dies (SIGKILL: no clean-up) after
    renaming DST aside."""
    import pgconvert.run.destination as destination

    real_retire = destination.retire

    class Killed(BaseException):
        pass

    def retire_then_die(path: Path) -> Path:
        real_retire(path)
        raise Killed

    monkeypatch.setattr(destination, "exchange", lambda first, second: False)  # no one-step swap here
    monkeypatch.setattr(destination, "retire", retire_then_die)
    monkeypatch.setattr(convert_module.shutil, "rmtree", lambda *args, **kwargs: None)  # no clean-up
    with pytest.raises(Killed):
        pgconvert.convert(src, dst, dst_tp=2, overwrite=True)
    monkeypatch.undo()


def test_overwrite_killed_between_its_renames_is_restored_by_the_next_run(src: Path, tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    dst = tmp_path / "out"
    pgconvert.convert(src, dst, dst_tp=1)
    _killed_between_renames(src, dst, monkeypatch)
    assert not dst.exists() and len(list(tmp_path.glob(f".out{RETIRED_MARKER}*"))) == 1

    result = run_cli(src, dst, "--dst-tp", "1")  # no --overwrite: the restored output is kept

    assert_clean_refusal(result, 2, f"DST {dst} exists and is not empty")
    assert_same_model(src, dst)
    assert pgconvert.verify(src, dst).equal
    assert sorted(path.name for path in tmp_path.iterdir()) == ["out"]


def test_retired_output_beside_a_complete_dst_is_removed(src: Path, tmp_path: Path) -> None:
    dst = tmp_path / "out"
    pgconvert.convert(src, dst, dst_tp=1)
    leftover = tmp_path / f".out{RETIRED_MARKER}0123456789ab"
    leftover.mkdir()
    (leftover / "model_optim_rng.pt").write_bytes(b"old")

    pgconvert.convert(src, dst, dst_tp=2, overwrite=True)

    assert sorted(path.name for path in tmp_path.iterdir()) == ["out"]
    assert_same_model(src, dst)


# ------------------------------------------------------------------------------------ interrupts


def test_ctrl_c_while_planning_exits_130_with_one_line(src: Path, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    def interrupted(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(convert_module, "plan", interrupted)

    result = run_cli(src, tmp_path / "dst", "--dst-tp", "1")

    assert result.exit_code == 130, result.output
    assert "interrupted: no output was left behind" in result.output
    assert "Traceback" not in result.output and "Aborted" not in result.output
    assert not (tmp_path / "dst").exists()


def test_interrupt_just_after_the_lock_file_is_made_leaves_no_lock(src: Path, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    real_flock = fcntl.flock
    calls = []

    def interrupted_flock(handle: object, operation: int) -> None:
        calls.append(operation)
        if len(calls) == 1:
            raise KeyboardInterrupt  # a SIGINT between creating the lock file and locking it
        real_flock(handle, operation)  # type: ignore[arg-type]

    monkeypatch.setattr(convert_module.fcntl, "flock", interrupted_flock)

    result = run_cli(src, tmp_path / "dst", "--dst-tp", "1")

    assert result.exit_code == 130, result.output
    assert "interrupted: no output was left behind" in result.output
    assert sorted(path.name for path in tmp_path.iterdir()) == []


def test_lock_held_by_another_process_is_not_removed(src: Path, tmp_path: Path) -> None:
    dst = tmp_path / "dst"
    lock = sibling(dst.absolute(), ".pgconvert.lock")
    with open(lock, "w") as holder:
        holder.write("4242")
        holder.flush()
        fcntl.flock(holder, fcntl.LOCK_EX)
        result = run_cli(src, dst, "--dst-tp", "1")
        assert_clean_refusal(result, 2, "being written by another pgconvert process (pid 4242")
        assert lock.exists()


def _leave_a_stale_lock(dst: Path) -> Path:
    """The lock file of a run killed after its output was complete (its holder is gone)."""
    lock = sibling(dst.absolute(), LOCK_SUFFIX)
    lock.write_text("4242")
    return lock


def test_stale_lock_beside_a_complete_dst_is_removed_when_a_batch_skips_it(src: Path, tmp_path: Path) -> None:
    pgconvert.convert(src, tmp_path / "out", dst_tp=1)
    lock = _leave_a_stale_lock(tmp_path / "out")

    result = run_cli("batch", _plan(tmp_path, src, 'dst = "out"'))

    assert result.exit_code == 0, result.output
    assert "skipped" in result.output
    assert not lock.exists()
    assert sorted(path.name for path in tmp_path.iterdir()) == ["out", "plan.toml"]


def test_stale_lock_is_removed_by_a_run_refused_for_a_complete_dst(src: Path, tmp_path: Path) -> None:
    dst = tmp_path / "out"
    pgconvert.convert(src, dst, dst_tp=1)
    lock = _leave_a_stale_lock(dst)

    result = run_cli(src, dst, "--dst-tp", "1")

    assert_clean_refusal(result, 2, f"DST {dst} exists and is not empty")
    assert not lock.exists()


# ------------------------------------------------------------------------------------ batch plans


def _plan(tmp_path: Path, src: Path, *entries: str) -> Path:
    text = "".join(f'[[convert]]\nsrc = "{src}"\n{entry}\ndst_tp = 1\n' for entry in entries)
    path = tmp_path / "plan.toml"
    path.write_text(text)
    return path


def test_batch_with_nested_destinations_is_refused_before_running(src: Path, tmp_path: Path) -> None:
    plan = _plan(tmp_path, src, 'dst = "out"', 'dst = "out/inner"')

    result = run_cli("batch", plan)

    assert_clean_refusal(result, 2, f"{plan}: entries 1 and 2 write nested destinations",
                         f"{tmp_path / 'out' / 'inner'} is inside {tmp_path / 'out'}")
    assert not (tmp_path / "out").exists()


def test_batch_destinations_equal_after_expansion_name_the_plan(src: Path, tmp_path: Path) -> None:
    plan = _plan(tmp_path, src, 'dst = "out/{iteration:01d}"\niterations = [100]',
                 'dst = "out/{iteration:03d}"\niterations = [100]')

    result = run_cli("batch", plan)

    assert_clean_refusal(result, 2, f"{plan}: entries 1@100 and 2@100 both write {tmp_path / 'out' / '100'}")
    assert not (tmp_path / "out").exists()


def test_batch_placeholder_width_is_bounded(src: Path, tmp_path: Path) -> None:
    plan = _plan(tmp_path, src, 'dst = "out/{iteration:01200000000d}"\niterations = [100]')

    result = run_cli("batch", plan)

    assert_clean_refusal(result, 2, f"{plan} [[convert]] #1: dst = ", "MAX_PLACEHOLDER_WIDTH=255")
