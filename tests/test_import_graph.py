"""pgconvert's modules import each other without cycles among the orchestration modules, and none
imports the package root (which imports nearly everything): found statically, function-level
imports included, ``if TYPE_CHECKING:`` blocks excluded."""

from __future__ import annotations

import ast
from pathlib import Path

import pgconvert

PACKAGE = Path(pgconvert.__file__).parent
# Modules of the repository folders installed as pgconvert.loaders / pgconvert.savers.
FOLDERS = {"pgconvert": PACKAGE, "pgconvert.loaders": PACKAGE.parent / "loaders",
           "pgconvert.savers": PACKAGE.parent / "savers"}
ORCHESTRATION = {"pgconvert.run.convert", "pgconvert.run.sharded", "pgconvert.run.workers", "pgconvert.run.manifest",
                 "pgconvert.run.batch", "pgconvert.run.inspection", "pgconvert.run.verification", "pgconvert.formats.registry"}


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


def _imports(path: Path) -> set[str]:
    """The pgconvert modules ``path`` imports at run time (``from pgconvert import m`` of a module
    ``m`` names ``pgconvert.m``; of anything else, the package root)."""
    names: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names if alias.name.split(".")[0] == "pgconvert")
        elif isinstance(node, ast.ImportFrom) and node.module == "pgconvert":
            names.update(f"pgconvert.{alias.name}" if (PACKAGE / f"{alias.name}.py").is_file()
                         or (PACKAGE / alias.name / "__init__.py").is_file() else "pgconvert"
                         for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "pgconvert":
            names.add(node.module)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text(encoding="utf-8")))
    return names


def test_no_module_inside_the_package_imports_the_package_root() -> None:
    importers = sorted(name for name, path in _modules().items() if name != "pgconvert" and "pgconvert" in _imports(path))

    assert importers == []


def test_the_orchestration_modules_import_each_other_without_cycles() -> None:
    graph = {name: _imports(path) & ORCHESTRATION for name, path in _modules().items() if name in ORCHESTRATION}
    cycles = []
    for start in sorted(graph):
        stack = [(start, [start])]
        while stack:
            node, trail = stack.pop()
            for target in sorted(graph.get(node, ())):
                if target == start:
                    cycles.append(" -> ".join([*trail, target]))
                elif target not in trail:
                    stack.append((target, [*trail, target]))

    assert cycles == []


# The formats, their loaders and savers, the optimizer state and the runs: no module among them reaches itself.
LAYERED = ("pgconvert.formats", "pgconvert.loaders", "pgconvert.savers", "pgconvert.optimizer", "pgconvert.run")


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


def test_the_format_optimizer_and_run_modules_import_each_other_without_cycles() -> None:
    modules = {name: path for name, path in _modules().items() if name.startswith(LAYERED)}
    graph = {name: {target for target in _imports(path) if target in modules and target != name}
             for name, path in modules.items()}

    assert len(graph) > 40 and sorted(name for name in graph if _reaches_itself(graph, name)) == []
