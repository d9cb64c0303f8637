"""Bad input found by the fuzzing layer (tests/test_fuzz.py), one test per cause, in the style of
tests/test_bad_input_catalogue.py: the message names the file, the exit code is 1, no traceback,
nothing is written."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from click.testing import CliRunner, Result
from support.tiny_models import GQA_SWIGLU
from support.megatron_fixtures import load_rank_file, make_full_model, write_megatron_checkpoint

from pgconvert.cli import main


def run_cli(*args: str | Path) -> Result:
    return CliRunner().invoke(main, [str(arg) for arg in args])


@pytest.fixture
def src(tmp_path: Path) -> Path:
    return write_megatron_checkpoint(tmp_path / "src", GQA_SWIGLU, make_full_model(GQA_SWIGLU), 2, 1)


def _assert_named_failure(result: Result, expected: str, dst: Path) -> None:
    assert result.exit_code == 1, result.output
    assert not isinstance(result.exception, Exception) or isinstance(result.exception, SystemExit), result.exception
    assert expected in result.output
    assert not dst.exists()


@pytest.mark.parametrize("content", [b"\xc2\xb2", "100".encode("utf-16"), b"\x9ec", b"9" * 5000])
def test_unreadable_tracker_is_named(src: Path, tmp_path: Path, content: bytes) -> None:
    tracker = src / "latest_checkpointed_iteration.txt"
    tracker.write_bytes(content)

    for command in (["convert", src, tmp_path / "dst", "--dst-tp", "1"], ["inspect", src], ["verify", src, src]):
        result = run_cli(*command)
        _assert_named_failure(result, f"{tracker}: ", tmp_path / "dst")
        # An over-long tracker is refused by its size limit before its text is read.
        expected = "MAX_TRACKER_BYTES" if len(content) > 64 else "expected an iteration number or 'release'"
        assert expected in result.output


def _rewrite(path: Path, change: object) -> None:
    state = load_rank_file(path)
    change(state)  # type: ignore[operator]
    torch.save(state, path)


@pytest.mark.parametrize(("change", "expected"), [
    (lambda state: state.update(model=list(state["model"].values())), "'model' is a list, expected a dict"),
    (lambda state: state["model"].update({7: torch.zeros(2)}), "'model' holds the key 7, expected tensor names"),
])
def test_model_that_is_not_a_dict_of_names_is_named(src: Path, tmp_path: Path, change: object, expected: str) -> None:
    path = src / "iter_0000100" / "mp_rank_01" / "model_optim_rng.pt"
    _rewrite(path, change)

    result = run_cli(src, tmp_path / "dst", "--dst-tp", "1")

    _assert_named_failure(result, f"{path}: {expected}", tmp_path / "dst")


def test_rank_files_disagreeing_on_a_dtype_are_named(src: Path, tmp_path: Path) -> None:
    path = src / "iter_0000100" / "mp_rank_01" / "model_optim_rng.pt"
    name = "decoder.layers.1.input_layernorm.weight"
    _rewrite(path, lambda state: state["model"].update({name: state["model"][name].double()}))

    result = run_cli(src, tmp_path / "dst", "--dst-tp", "1")

    _assert_named_failure(result, f"{name}: ranks disagree on dtype (", tmp_path / "dst")
    assert f"torch.float64 in {path}" in result.output
    assert f"torch.float32 in {src / 'iter_0000100' / 'mp_rank_00' / 'model_optim_rng.pt'}" in result.output
