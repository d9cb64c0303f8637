"""The command line: help, the README example, dry runs, progress and exit codes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import click
import pytest
from click.testing import CliRunner
from support.tiny_models import GQA_SWIGLU
from support.megatron_fixtures import make_full_model, merge_megatron_checkpoint, write_megatron_checkpoint

from pgconvert.cli import main


@pytest.mark.parametrize("command", [[], ["convert"], ["example"]], ids=["main", "convert", "example"])
def test_help_of_every_command_exits_zero(command: list[str]) -> None:
    result = CliRunner().invoke(main, [*command, "--help"])

    assert result.exit_code == 0, result.output
    assert "Usage:" in result.output


def test_main_help_documents_every_convert_option_and_the_commands() -> None:
    result = CliRunner().invoke(main, ["--help"])
    convert = main.commands["convert"]

    options = [opt for param in convert.params if isinstance(param, click.Option) for opt in param.opts]
    missing = [opt for opt in options if opt not in result.output]
    assert missing == []
    assert "pgconvert [OPTIONS] SRC DST" in result.output
    assert "example" in result.output


def test_example_then_convert_tp8_to_tp2(tmp_path: Path) -> None:
    runner = CliRunner()

    made = runner.invoke(main, ["example", str(tmp_path / "tp8")])
    converted = runner.invoke(main, ["--src-tp", "8", "--dst-tp", "2", str(tmp_path / "tp8"), str(tmp_path / "tp2")])

    assert made.exit_code == 0, made.output
    assert converted.exit_code == 0, converted.output
    assert len(list((tmp_path / "tp8" / "iter_0001000").iterdir())) == 8
    assert sorted(p.name for p in (tmp_path / "tp2" / "iter_0001000").iterdir()) == ["mp_rank_00", "mp_rank_01"]
    # The example model holds no optimizer, scheduler or RNG state: nothing to say it is not carried.
    assert "optimizer, scheduler and RNG state are not carried" not in converted.output
    assert "wrote" in converted.output


def test_dry_run_lists_each_destination_file_and_writes_nothing(tmp_path: Path) -> None:
    src = write_megatron_checkpoint(tmp_path / "src", GQA_SWIGLU, make_full_model(GQA_SWIGLU), 2, 1)

    result = CliRunner().invoke(main, ["--dst-tp", "1", "--dst-pp", "2", "--dry-run", str(src), str(tmp_path / "dst")])

    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[0] == "plan: megatron tp=2,pp=1 -> megatron tp=1,pp=2"
    # Stage 0: embedding + 2 layers x 6 tensors; stage 1: 2 layers x 6 + final norm + output layer.
    assert lines[1].startswith("  iter_0000100/mp_rank_00_000/model_optim_rng.pt  13 tensors  ")
    assert lines[2].startswith("  iter_0000100/mp_rank_00_001/model_optim_rng.pt  14 tensors  ")
    assert lines[3].startswith("total: 2 files")
    assert not (tmp_path / "dst").exists()


def test_dry_run_bytes_match_what_is_written(tmp_path: Path) -> None:
    src = write_megatron_checkpoint(tmp_path / "src", GQA_SWIGLU, make_full_model(GQA_SWIGLU), 2, 1)
    import pgconvert

    conversion = pgconvert.plan(pgconvert.ConvertRequest(src=src, dst=tmp_path / "dst", dst_tp=4))
    planned = [(item.relpath, item.tensors, item.nbytes) for item in conversion.files]
    from pgconvert.run.convert import execute

    report = execute(conversion)

    assert [(item.relpath, item.tensors, item.nbytes) for item in report.files] == planned


def test_quiet_prints_only_the_summary(tmp_path: Path) -> None:
    src = write_megatron_checkpoint(tmp_path / "src", GQA_SWIGLU, make_full_model(GQA_SWIGLU), 2, 1)

    result = CliRunner().invoke(main, ["--quiet", "--dst-tp", "1", str(src), str(tmp_path / "dst")])

    assert result.exit_code == 0
    assert result.output.startswith("wrote ") and result.output.count("\n") == 1


def test_console_script_runs_in_a_subprocess(tmp_path: Path) -> None:
    src = write_megatron_checkpoint(tmp_path / "src", GQA_SWIGLU, make_full_model(GQA_SWIGLU), 4, 1)

    completed = subprocess.run(
        [sys.executable, "-m", "pgconvert", "--dst-tp", "2", "--dst-pp", "2", str(src), str(tmp_path / "dst")],
        capture_output=True, text=True, timeout=120,
    )

    assert completed.returncode == 0, completed.stderr
    assert "converting" in completed.stderr  # the tqdm bar goes to stderr
    merged = merge_megatron_checkpoint(tmp_path / "dst", GQA_SWIGLU)
    assert merged.keys() == make_full_model(GQA_SWIGLU).keys()


def test_validation_error_exit_code_in_a_subprocess(tmp_path: Path) -> None:
    src = write_megatron_checkpoint(tmp_path / "src", GQA_SWIGLU, make_full_model(GQA_SWIGLU), 1, 1)

    completed = subprocess.run(
        [sys.executable, "-m", "pgconvert", "--dst-tp", "3", str(src), str(tmp_path / "dst")],
        capture_output=True, text=True, timeout=120,
    )

    assert completed.returncode == 2
    assert "--dst-tp 3: num_attention_heads=16 is not divisible by 3" in completed.stderr
    assert "Traceback" not in completed.stderr
