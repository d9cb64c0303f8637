"""``--help`` (and ``-h``) on every command shows that command's own usage and options.

``pgconvert SRC DST`` runs ``convert`` by default, so a routing mistake would answer
``pgconvert inspect --help`` with convert's help: checking for "Usage:" alone would not see it.
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from pgconvert.cli import CONVERT_HELP_SECTIONS, SectionedCommand, main

ROOT = Path(__file__).resolve().parent.parent
CONVERT_HEADINGS = ["Common options", "Layout", "Source", "Naming", "Output files", "HF output", "Adapters", "Optimizer state",
                    "Safety", "Scale-out"]


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


def _headings(output: str) -> list[str]:
    """The section headings of a help text: unindented lines ending in a colon."""
    return [line[:-1] for line in output.splitlines() if line.endswith(":") and not line.startswith(" ")]


def _listed_options(output: str) -> Counter[str]:
    """How often each option name starts a row of a help text's option lists (the term column only)."""
    rows = [line.strip().split("  ", 1)[0] for line in output.splitlines() if re.match(r"^  -", line)]
    return Counter(name for row in rows for name in re.findall(r"(?<![\w-])--?[A-Za-z][\w-]*", row))


@pytest.mark.parametrize("args, after", [(["--help"], ["Commands"]), (["convert", "--help"], [])],
                         ids=["pgconvert", "convert"])
def test_convert_help_groups_its_options_under_headings_in_order(args: list[str], after: list[str]) -> None:
    result = CliRunner().invoke(main, args, prog_name="pgconvert")

    assert result.exit_code == 0, result.output
    assert _headings(result.output) == CONVERT_HEADINGS + after
    common = result.output.split("Common options:\n", 1)[1].split("\n\n", 1)[0]
    assert all(name in common for name in ("--dst-tp", "--dst-pp", "--dst-format", "--dry-run", "--overwrite"))


@pytest.mark.parametrize("args", [["--help"], ["convert", "--help"]], ids=["pgconvert", "convert"])
def test_convert_help_lists_every_option_exactly_once(args: list[str]) -> None:
    convert = main.commands["convert"]

    result = CliRunner().invoke(main, args, prog_name="pgconvert")

    expected = Counter(opt for param in convert.params if isinstance(param, click.Option) for opt in param.opts)
    listed = _listed_options(result.output)
    assert len(expected) > 30
    assert listed["--help"] == 1
    assert listed - Counter(["--help", "-h"]) == expected


def test_the_help_check_sees_an_option_listed_twice() -> None:
    output = "Common options:\n  --dst-tp N  Size.\n  -q, --quiet  Quiet.\n\nLayout:\n  --dst-tp N  Again.\n"

    assert _listed_options(output) == Counter({"--dst-tp": 2, "-q": 1, "--quiet": 1})


def test_an_option_no_help_section_places_is_an_error() -> None:
    convert = main.commands["convert"]
    params = [*convert.params, click.Option(["--new-option"], is_flag=True)]

    with pytest.raises(ValueError, match=r"not placed \['--new-option'\]"):
        SectionedCommand(name="convert", params=params, sections=CONVERT_HELP_SECTIONS)


@pytest.mark.parametrize("sections, message", [
    ((("A", ("--one",)), ("B", ("--one", "--two"))), r"placed twice \['--one'\]"),
    ((("A", ("--one", "--two", "--three")),), r"not an option \['--three'\]"),
], ids=["twice", "unknown"])
def test_an_option_placed_twice_or_a_name_that_is_no_option_is_an_error(
        sections: tuple[tuple[str, tuple[str, ...]], ...], message: str) -> None:
    params = [click.Option(["--one"], is_flag=True), click.Option(["-t", "--two"], is_flag=True)]

    with pytest.raises(ValueError, match=message):
        SectionedCommand(name="x", params=params, sections=sections)


def _doc_architectures(doc: str) -> list[str]:
    """The architecture column of docs/families.md's "Supported architectures" table."""
    section = doc.split("## Supported architectures\n", 1)[1].split("\n#", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    return [row.split("`")[1] for row in rows]


def test_the_families_doc_lists_every_supported_architecture() -> None:
    """docs/families.md's table names exactly the architectures pgconvert converts."""
    from pgconvert.families import supported_architectures

    doc = (ROOT / "docs" / "families.md").read_text()
    listed = _doc_architectures(doc)

    assert sorted(listed) == supported_architectures()
    assert len(listed) == len(set(listed))


def test_the_families_doc_check_sees_a_missing_architecture() -> None:
    from pgconvert.families import supported_architectures

    doc = (ROOT / "docs" / "families.md").read_text()
    without = "".join(line for line in doc.splitlines(keepends=True) if not line.startswith("| `Gemma2ForCausalLM`"))

    assert "Gemma2ForCausalLM" not in _doc_architectures(without)
    assert sorted(_doc_architectures(without)) != supported_architectures()


def test_the_readme_support_table_counts_the_supported_architectures() -> None:
    """README's support table states how many architectures pgconvert converts; it is their number."""
    import re

    from pgconvert.families import supported_architectures

    readme = (ROOT / "README.md").read_text()
    (row,) = [line for line in readme.splitlines() if line.startswith("| families |")]

    assert re.match(r"\| families \| (\d+) architectures:", row).group(1) == str(len(supported_architectures()))
