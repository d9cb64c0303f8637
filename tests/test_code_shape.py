"""Functions stay within one screen (~60 lines), so the package keeps reading as small named steps."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = ("pgconvert", "loaders", "savers", "benchmarks", "scripts")
MAX_LINES = 60


def long_functions(root: Path, limit: int = MAX_LINES) -> list[str]:
    """``path:line name (lines)`` of every function or method under ``root`` longer than ``limit``
    (counted from its ``def`` line to its last line, decorators and docstring included)."""
    found = []
    for folder in FOLDERS:
        for path in sorted((root / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    length = (node.end_lineno or node.lineno) - node.lineno
                    if length > limit:
                        found.append(f"{path.relative_to(root)}:{node.lineno} {node.name} ({length})")
    return found


def test_no_function_exceeds_one_screen() -> None:
    assert long_functions(ROOT) == []


def test_the_check_sees_a_long_function(tmp_path: Path) -> None:
    (tmp_path / "pgconvert").mkdir()
    body = "".join(f"        x{i} = {i}\n" for i in range(MAX_LINES + 1))
    (tmp_path / "pgconvert" / "long.py").write_text(f"def short() -> None:\n    pass\n\n\nclass A:\n    def long(self) -> None:\n{body}")
    assert long_functions(tmp_path) == [f"pgconvert/long.py:6 long ({MAX_LINES + 1})"]
