"""Functions stay within one screen (~60 lines), so the package keeps reading as small named steps."""

from __future__ import annotations

import ast
import re
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


# Where the rules and transforms are defined; everywhere else asks them (``fits_rows``,
# ``piece_windows``, ``reads_window`` …) and never tests which one it holds.
DEFINERS = {"pgconvert/model/rules.py", "pgconvert/families/table.py"}
# The owners of tensor names: the layer kinds' tables define them, the provider (which re-exports them)
# answers whether a name is a routed expert's, a fused norm's, …
NAME_OWNERS = re.compile(r"pgconvert/model/(provider|vision|kinds/\w+)\.py")
PACKAGE_FOLDERS = ("pgconvert", "loaders", "savers")


def _rule_and_transform_names() -> set[str]:
    """The rule and transform classes (their bases aside: being a rule at all is no type test) and
    their module-level instances."""
    from pgconvert.families import table
    from pgconvert.model import rules

    names = set()
    for module, base in ((rules, rules.ShardRule), (table, table.Transform)):
        for name, value in vars(module).items():
            if (isinstance(value, type) and issubclass(value, base) and value is not base) or isinstance(value, base):
                names.add(name)
    return names


def type_tests(root: Path, names: set[str]) -> list[str]:
    """``path:line code`` of every ``isinstance(x, Rule)`` and ``x is RULE``/``==``/``!=`` comparison
    (``type(x) is Rule`` included) against a rule or transform outside the modules that define them."""
    found = []
    for folder in PACKAGE_FOLDERS:
        for path in sorted((root / folder).rglob("*.py")):
            if path.relative_to(root).as_posix() in DEFINERS:
                continue
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "isinstance":
                    classes = node.args[1:] and node.args[1]
                    members = classes.elts if isinstance(classes, ast.Tuple) else [classes]
                    hit = any(isinstance(m, ast.Name) and m.id in names for m in members)
                elif isinstance(node, ast.Compare):
                    sides = [node.left, *node.comparators]
                    hit = any(isinstance(s, ast.Name) and s.id in names for s in sides)
                else:
                    continue
                if hit:
                    found.append(f"{path.relative_to(root)}:{node.lineno} {ast.unparse(node)}")
    return found


def test_rules_and_transforms_are_asked_never_typed() -> None:
    assert type_tests(ROOT, _rule_and_transform_names()) == []


def test_the_type_check_sees_a_type_test(tmp_path: Path) -> None:
    (tmp_path / "loaders").mkdir()
    (tmp_path / "loaders" / "x.py").write_text(
        "def f(rule, row):\n    a = isinstance(rule, (int, VocabParallel))\n    b = row.transform is QKV\n"
        "    c = type(rule) is Chunked\n    return rule is not None and type(rule) is not int\n")

    assert type_tests(tmp_path, {"VocabParallel", "QKV", "Chunked"}) == [
        "loaders/x.py:2 isinstance(rule, (int, VocabParallel))", "loaders/x.py:3 row.transform is QKV",
        "loaders/x.py:4 type(rule) is Chunked"]


def _provider_name_constants() -> set[str]:
    """provider.py's name fragments (prefixes and suffixes of tensor names)."""
    from pgconvert.model import provider

    return {name for name, value in vars(provider).items()
            if name.isupper() and isinstance(value, str) and not name.startswith("_")}


def name_substring_tests(root: Path, constants: set[str]) -> list[str]:
    """``path:line code`` of every ``CONSTANT in name`` test of a provider name fragment outside
    the name owners: whether a name is an expert's (or any kind's) is asked of the provider."""
    found = []
    for folder in PACKAGE_FOLDERS:
        for path in sorted((root / folder).rglob("*.py")):
            if NAME_OWNERS.fullmatch(path.relative_to(root).as_posix()):
                continue
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if (isinstance(node, ast.Compare) and isinstance(node.left, ast.Name) and node.left.id in constants
                        and any(isinstance(op, (ast.In, ast.NotIn)) for op in node.ops)):
                    found.append(f"{path.relative_to(root)}:{node.lineno} {ast.unparse(node)}")
    return found


def test_tensor_names_are_classified_by_the_provider() -> None:
    assert name_substring_tests(ROOT, _provider_name_constants()) == []


def test_the_name_check_sees_a_substring_test(tmp_path: Path) -> None:
    (tmp_path / "savers").mkdir()
    (tmp_path / "savers" / "x.py").write_text("def f(name):\n    return EXPERT_PREFIX not in name\n")

    assert name_substring_tests(tmp_path, {"EXPERT_PREFIX"}) == ["savers/x.py:2 EXPERT_PREFIX not in name"]


def test_provider_constants_are_defined_once() -> None:
    """A name fragment of tensor names is imported from provider.py (or a kind's module), never restated."""
    constants = _provider_name_constants() | {"VOCAB_TABLES", "FUSED_NORM_NAMES"}
    restated = []
    for folder in PACKAGE_FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            if NAME_OWNERS.fullmatch(path.relative_to(ROOT).as_posix()):
                continue
            for node in ast.parse(path.read_text()).body:
                targets = node.targets if isinstance(node, ast.Assign) else (
                    [node.target] if isinstance(node, ast.AnnAssign) else [])
                restated += [f"{path.relative_to(ROOT)}:{node.lineno} {t.id}" for t in targets
                             if isinstance(t, ast.Name) and t.id in constants]

    assert restated == []


# An architecture name ("...ForCausalLM") is family data: it is spelled only in the modules of the
# family lineages (not the table types, not the registry); everywhere else asks a ``Family`` (its
# fields) and never branches on the name.
ARCHITECTURE_NAME = re.compile(r"\w+ForCausalLM\b")
ARCHITECTURE_OWNERS = re.compile(r"pgconvert/families/(?!table\.py|__init__\.py)\w+\.py")


def architecture_names(root: Path) -> list[str]:
    """``path:line name`` of every architecture name in a string literal or keyword argument of the
    package outside the family modules."""
    found = []
    for folder in PACKAGE_FOLDERS:
        for path in sorted((root / folder).rglob("*.py")):
            relative = path.relative_to(root).as_posix()
            if ARCHITECTURE_OWNERS.fullmatch(relative):
                continue
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Constant) and isinstance(node.value, str):
                    text = node.value
                elif isinstance(node, ast.keyword) and node.arg is not None:
                    text = node.arg
                else:
                    continue
                found += [f"{relative}:{node.lineno} {name}" for name in ARCHITECTURE_NAME.findall(text)]
    return found


def test_architecture_names_live_in_the_family_tables() -> None:
    assert architecture_names(ROOT) == []


def test_the_architecture_check_sees_a_name(tmp_path: Path) -> None:
    for folder in PACKAGE_FOLDERS:
        (tmp_path / folder).mkdir()
    (tmp_path / "savers" / "x.py").write_text(
        "def f(family):\n    return family.architecture == 'Gemma2ForCausalLM'\n")
    (tmp_path / "pgconvert" / "semantics").mkdir()
    (tmp_path / "pgconvert" / "semantics" / "__init__.py").write_text(
        "SEMANTICS = (dict(LlamaForCausalLM='x'), 'QwenForCausalLM')\n"
        "ODD = {'Qwen3MoeForCausalLM', 'OlmoeForCausalLM'}\nf(Glm4ForCausalLM=1)\n")
    (tmp_path / "pgconvert" / "families").mkdir()
    (tmp_path / "pgconvert" / "families" / "new.py").write_text("A = 'NewForCausalLM'\n")
    (tmp_path / "pgconvert" / "families" / "table.py").write_text("B = 'TableForCausalLM'\n")
    (tmp_path / "loaders" / "y.py").write_text("'''Reads LlamaForCausalLM files.'''\n")

    assert sorted(architecture_names(tmp_path)) == [
        "loaders/y.py:1 LlamaForCausalLM", "pgconvert/families/table.py:1 TableForCausalLM",
        "pgconvert/semantics/__init__.py:1 LlamaForCausalLM", "pgconvert/semantics/__init__.py:1 QwenForCausalLM",
        "pgconvert/semantics/__init__.py:2 OlmoeForCausalLM", "pgconvert/semantics/__init__.py:2 Qwen3MoeForCausalLM",
        "pgconvert/semantics/__init__.py:3 Glm4ForCausalLM", "savers/x.py:2 Gemma2ForCausalLM"]
