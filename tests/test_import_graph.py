"""pgconvert's modules import each other without a cycle, and none imports the package root (which imports
nearly everything): found statically, function-level imports included (a cycle dodged by importing inside a
function is still a cycle), ``if TYPE_CHECKING:`` blocks excluded."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pgconvert

PACKAGE = Path(pgconvert.__file__).parent
# Modules of the repository folders installed as pgconvert.loaders / pgconvert.savers.
FOLDERS = {"pgconvert": PACKAGE, "pgconvert.loaders": PACKAGE.parent / "loaders",
           "pgconvert.savers": PACKAGE.parent / "savers"}


@functools.cache
def _modules() -> dict[str, Path]:
    found = {}
    for package, folder in FOLDERS.items():
        for path in sorted(folder.rglob("*.py")):
            parts = path.relative_to(folder).with_suffix("").parts
            if parts[0] in ("loaders", "savers") and package == "pgconvert":
                continue
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join((package, *parts))] = path
    return found


def _is_type_checking(node: ast.If) -> bool:
    return isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"


def _module_named(name: str, modules: dict[str, Path]) -> str:
    """``name`` if it is a module, else the module that defines it (its longest prefix that is one)."""
    while name not in modules and "." in name:
        name = name.rpartition(".")[0]
    return name


def _imports(path: Path) -> set[str]:
    """The pgconvert modules ``path`` imports at run time (``from pgconvert.x import m`` of a module ``m``
    names ``pgconvert.x.m``; of anything else, ``pgconvert.x``)."""
    modules = _modules()
    names: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            names.update(_module_named(alias.name, modules) for alias in node.names
                         if alias.name.split(".")[0] == "pgconvert")
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "pgconvert":
            assert node.level == 0, f"{path}: relative import"
            names.update(_module_named(f"{node.module}.{alias.name}", modules) for alias in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text(encoding="utf-8")))
    return names


def _import_graph() -> dict[str, set[str]]:
    return {name: _imports(path) - {name} for name, path in _modules().items()}


def test_no_module_inside_the_package_imports_the_package_root() -> None:
    importers = sorted(name for name, path in _modules().items() if name != "pgconvert" and "pgconvert" in _imports(path))

    assert importers == []


def _reaches_itself(graph: dict[str, set[str]], start: str) -> bool:
    seen: set[str] = set()
    todo = list(graph[start])
    while todo:
        node = todo.pop()
        if node == start:
            return True
        if node not in seen:
            seen.add(node)
            todo.extend(graph.get(node, ()))
    return False


def test_no_module_of_the_package_reaches_itself_through_its_imports() -> None:
    graph = _import_graph()

    assert len(graph) > 100 and sorted(name for name in graph if _reaches_itself(graph, name)) == []


def test_the_check_sees_a_cycle_through_a_function_level_import() -> None:
    graph = _import_graph()
    # pgconvert.run.convert imports pgconvert.model.layout; a function-level import back closes a cycle.
    assert "pgconvert.model.layout" in graph["pgconvert.run.convert"]
    graph["pgconvert.model.layout"] = graph["pgconvert.model.layout"] | {"pgconvert.run.convert"}

    assert _reaches_itself(graph, "pgconvert.run.convert") and _reaches_itself(graph, "pgconvert.model.layout")


def test_the_import_reader_follows_imports_inside_functions_and_skips_type_checking(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pgconvert.run import convert\n"
                      "def f() -> None:\n    from pgconvert.model.config import ModelConfig\n"
                      "    import pgconvert.formats.registry\n")

    assert _imports(module) == {"pgconvert.model.config", "pgconvert.formats.registry"}


def test_no_test_imports_another_test_module_or_conftest() -> None:
    tests = Path(__file__).resolve().parent
    importers = []
    for path in sorted(tests.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = ([alias.name for alias in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            importers += [f"{path.relative_to(tests)} imports {name}" for name in names
                          if name.split(".")[0] == "conftest" or name.split(".")[0].startswith("test_")]

    assert importers == []
