"""``--overwrite`` killed at every file-system step of putting the new output in place: DST always names
one complete output (``pgconvert verify`` finds it equal to its source), and the next run cleans up.

The kills run in a child job (tests/support/overwrite_kill_points.py) that forks one conversion per
kill point and sends it SIGKILL just before its k-th file-system operation."""

from __future__ import annotations

import ctypes
import errno
import json
import logging
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from support.megatron_fixtures import make_full_model, write_megatron_checkpoint
from support.tiny_models import GQA_SWIGLU

import pgconvert
import pgconvert.io.exchange as exchange_module
import pgconvert.run.destination as destination
from pgconvert.io.exchange import exchange

SCRIPT = Path(__file__).parent / "support" / "overwrite_kill_points.py"


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("sources")
    old = write_megatron_checkpoint(root / "old", GQA_SWIGLU, make_full_model(GQA_SWIGLU, seed=0), 2, 1)
    new = write_megatron_checkpoint(root / "new", GQA_SWIGLU, make_full_model(GQA_SWIGLU, seed=1), 2, 1)
    return old, new


def kill_points(sources: tuple[Path, Path], work: Path, mode: str) -> list[dict[str, Any]]:
    work.mkdir()
    done = subprocess.run([sys.executable, str(SCRIPT), str(work), str(sources[0]), str(sources[1]), mode],
                          capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    points = [json.loads(line) for line in done.stdout.splitlines()]
    assert len(points) >= 5 and points[-1]["code"] == 0, points  # the last run was never reached: it finished
    for point in points:  # whatever the kill left, the next run puts the new output in place, cleanly
        assert (point["rerun_code"], point["rerun_dst"], point["rerun_left"]) == (0, "new", []), point
    return points[:-1]


def test_overwrite_swapped_in_one_step_never_leaves_dst_without_a_complete_output(
        sources: tuple[Path, Path], tmp_path: Path) -> None:
    killed = kill_points(sources, tmp_path / "work", "exchange")

    assert all(point["code"] == -9 for point in killed)
    held = [point["dst"] for point in killed]
    assert held[0] == "old"  # killed before the swap: the previous output, whole
    assert set(held) == {"old", "new"} and held == sorted(held, key=["old", "new"].index), held
    assert not any(destination.RETIRED_MARKER in name for point in killed for name in point["left"])


def test_overwrite_by_two_renames_is_restored_after_a_kill_between_them(
        sources: tuple[Path, Path], tmp_path: Path) -> None:
    killed = kill_points(sources, tmp_path / "work", "two-renames")

    missing = [point for point in killed if point["dst"] == "missing"]
    assert len(missing) == 1, killed  # only between the two renames
    assert missing[0]["retired_holds"] == ["old"]  # the previous output, whole, under the retired name
    assert {point["dst"] for point in killed} == {"old", "new", "missing"}


@pytest.fixture
def converted(sources: tuple[Path, Path], tmp_path: Path) -> Path:
    dst = tmp_path / "out"
    pgconvert.convert(sources[0], dst, dst_tp=1)
    return dst


def test_the_log_says_the_output_was_swapped_in_one_step(sources: tuple[Path, Path], converted: Path,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="pgconvert.run.destination"):
        pgconvert.convert(sources[1], converted, dst_tp=1, overwrite=True)

    assert f"replaced {converted.absolute()} in one step (renameat2 RENAME_EXCHANGE)" in caplog.text
    assert pgconvert.verify(sources[1], converted).equal
    assert sorted(path.name for path in converted.parent.iterdir()) == ["out"]


def test_the_log_warns_when_the_output_is_replaced_by_two_renames(
        sources: tuple[Path, Path], converted: Path, caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(destination, "exchange", lambda first, second: False)
    with caplog.at_level(logging.INFO, logger="pgconvert.run.destination"):
        pgconvert.convert(sources[1], converted, dst_tp=1, overwrite=True)

    warnings = [record.getMessage() for record in caplog.records if record.levelno == logging.WARNING]
    assert any("with two renames" in message and "absent between them" in message for message in warnings)
    assert pgconvert.verify(sources[1], converted).equal
    assert sorted(path.name for path in converted.parent.iterdir()) == ["out"]


# ------------------------------------------------------------------------------------ the swap itself


def test_exchange_swaps_a_directory_and_a_file(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "inside").write_text("a")
    (tmp_path / "b").write_text("b")

    assert exchange(tmp_path / "a", tmp_path / "b")

    assert (tmp_path / "a").read_text() == "b"
    assert (tmp_path / "b" / "inside").read_text() == "a"


def test_exchange_with_a_missing_path_names_both(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    with pytest.raises(FileNotFoundError) as raised:
        exchange(tmp_path / "a", tmp_path / "missing")
    assert raised.value.filename == str(tmp_path / "a") and raised.value.filename2 == str(tmp_path / "missing")
    assert (tmp_path / "a").is_dir()


def test_exchange_a_file_system_cannot_do_reports_so_and_changes_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def unsupported(*args: object) -> int:
        ctypes.set_errno(errno.EINVAL)
        return -1

    monkeypatch.setattr(exchange_module, "_renameat2", lambda: unsupported)
    (tmp_path / "a").write_text("a")
    (tmp_path / "b").write_text("b")

    assert exchange(tmp_path / "a", tmp_path / "b") is False
    assert ((tmp_path / "a").read_text(), (tmp_path / "b").read_text()) == ("a", "b")
