"""Names say what a thing is: no work-item tags (the short labels of the tasks that made the code) in the
package, the tests, the scripts, the benchmarks or the docs."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = ("pgconvert", "loaders", "savers", "tests", "scripts", "benchmarks", "docs")
TOP_FILES = ("README.md", "CHANGELOG.md", "pyproject.toml", ".ci/run")
# Labels that name a task, never a thing: anywhere, as a word (letters and digits on neither side).
TAGS = ("f17a", "f17b", "f17c", "fam17d", "ds16", "mtp16", "opt18", "opt18b", "mlafix", "tdplain", "tdmoe",
        "fsms", "optmem", "mem16", "td15", "verifyopt", "mcfwd", "optcli", "optmoe", "opttd", "dpmoe", "dpvpp",
        "ggemm", "moeplain", "optacc", "optacc2", "dprw")
TAG_WORD = re.compile(r"(?i)(?<![a-z0-9])(" + "|".join(TAGS) + r")(?![a-z0-9])")
BRANCH = re.compile(r"\bwt-[a-z0-9]+\b")
# A reference to the numbered work item that made a thing ("issue 13", "issue #7", "(item 5)").
WORK_ITEM = re.compile(r"(?i)\bissue ?#?\d+\b|\(items? \d+[^)]*\)")
# Ordinary words earlier tasks also used as labels: flagged only where they stand as one, at the start of
# a comment or docstring ("# mtp: ...", '"""tidy: ...') or alone in parentheses ("(mtp)", "(sem; ...)").
LABEL_WORDS = ("mtp", "mla", "tidy", "fp8", "sem", "side", "dest", "harden", "holes", "intr", "perf", "fuzz",
               "mlm", "contract", "buckets", "rules")
LABEL = re.compile(r"(#\s*|\"\"\")(" + "|".join(LABEL_WORDS) + r"):\s|(?<![\w.])\((" + "|".join(LABEL_WORDS) + r")[;)]")
SUFFIXES = {".py", ".md", ".toml", ".txt", ".cfg", ".sh", ""}


def tag_lines(root: Path) -> list[str]:
    """``path:line tag`` of every work-item tag under ``root``."""
    paths = [path for folder in FOLDERS for path in sorted((root / folder).rglob("*"))]
    paths += [root / name for name in TOP_FILES]
    found = []
    for path in paths:
        if not path.is_file() or path.suffix not in SUFFIXES or "data" in path.relative_to(root).parts:
            continue
        if path.resolve() == Path(__file__).resolve():
            continue
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            hits = [m.group(0) for m in TAG_WORD.finditer(line)] + BRANCH.findall(line)
            hits += [m.group(0) for m in WORK_ITEM.finditer(line)]
            hits += [m.group(0).strip() for m in LABEL.finditer(line)]
            found += [f"{path.relative_to(root)}:{number} {hit}" for hit in hits]
    return found


def test_no_work_item_tags() -> None:
    assert tag_lines(ROOT) == []


def test_the_check_sees_a_tag(tmp_path: Path) -> None:
    (tmp_path / "pgconvert").mkdir()
    (tmp_path / "pgconvert" / "x.py").write_text(
        '"""tidy: a docstring label."""\nF17A_DEFAULTS = 1  # mtp: a comment label\nimport a as _f17a\n'
        "# merged from wt-moeplain (sem)\nMTP_ROWS = 'mtp.layers' # the mtp rows: fine\n"
        "# made for issue 13 (item 4)\n")
    assert tag_lines(tmp_path) == [
        'pgconvert/x.py:1 """tidy:', "pgconvert/x.py:2 F17A", "pgconvert/x.py:2 # mtp:", "pgconvert/x.py:3 f17a",
        "pgconvert/x.py:4 moeplain", "pgconvert/x.py:4 wt-moeplain", "pgconvert/x.py:4 (sem)",
        "pgconvert/x.py:6 issue 13", "pgconvert/x.py:6 (item 4)"]
