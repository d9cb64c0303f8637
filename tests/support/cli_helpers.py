"""Running the CLI in-process and checking a clean refusal: shared by the hostile-input tests."""

from __future__ import annotations

from pathlib import Path

from click.testing import CliRunner, Result

from pgconvert.cli import main


def run_cli(*args: str | Path) -> Result:
    return CliRunner().invoke(main, [str(arg) for arg in args])


def assert_clean_refusal(result: Result, code: int, *fragments: str) -> None:
    """Exit ``code``, no exception but SystemExit, no traceback, and every fragment in the output."""
    assert result.exit_code == code, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert "Traceback" not in result.output
    for fragment in fragments:
        assert fragment in result.output, result.output
