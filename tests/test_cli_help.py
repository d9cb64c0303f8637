"""``--help`` (and ``-h``) on every command shows that command's own usage and options.

``pgconvert SRC DST`` runs ``convert`` by default, so a routing mistake would answer
``pgconvert inspect --help`` with convert's help: checking for "Usage:" alone would not see it.
"""

from __future__ import annotations

import click
import pytest
from click.testing import CliRunner

from pgconvert.cli import main


def _option_names(command: click.Command) -> list[str]:
    return [opt for param in command.params if isinstance(param, click.Option) for opt in param.opts]


@pytest.mark.parametrize("flag", ["--help", "-h"])
@pytest.mark.parametrize("name", sorted(main.commands))
def test_help_of_each_command_shows_its_own_usage_and_every_option(name: str, flag: str) -> None:
    command = main.commands[name]

    result = CliRunner().invoke(main, [name, flag], prog_name="pgconvert")

    assert result.exit_code == 0, result.output
    assert f"Usage: pgconvert {name} [OPTIONS]" in result.output
    arguments = [param.human_readable_name for param in command.params if isinstance(param, click.Argument)]
    usage_line = result.output.splitlines()[0]
    assert all(argument.upper() in usage_line for argument in arguments), usage_line
    assert [opt for opt in _option_names(command) if opt not in result.output] == []
    first_line = (command.help or "").strip().splitlines()[0]
    assert " ".join(first_line.split()[:4]) in " ".join(result.output.split())


def test_help_of_the_group_lists_every_command() -> None:
    result = CliRunner().invoke(main, ["--help"], prog_name="pgconvert")

    assert result.exit_code == 0, result.output
    assert [name for name in main.commands if f"  {name} " not in result.output] == []


def _readme_architectures(readme: str) -> list[str]:
    """The architecture column of the README's "Supported HF architectures" table."""
    section = readme.split("### Supported HF architectures\n", 1)[1].split("\n#", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    return [row.split("`")[1] for row in rows]


def test_readme_family_table_lists_every_supported_architecture() -> None:
    """The README's family table names exactly the architectures pgconvert converts."""
    from pathlib import Path

    from pgconvert.families import supported_architectures

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    listed = _readme_architectures(readme)

    assert sorted(listed) == supported_architectures()
    assert len(listed) == len(set(listed))


def test_the_readme_check_sees_a_missing_architecture() -> None:
    from pathlib import Path

    from pgconvert.families import supported_architectures

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    without = "".join(line for line in readme.splitlines(keepends=True) if not line.startswith("| `Gemma2ForCausalLM`"))

    assert "Gemma2ForCausalLM" not in _readme_architectures(without)
    assert sorted(_readme_architectures(without)) != supported_architectures()
