"""The format contract is declared: every built-in source and saver answers its attributes directly."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

from pgconvert.formats import Saver
from pgconvert.formats.registry import get_saver
from pgconvert.formats.stream import CanonicalSource

ROOT = Path(__file__).resolve().parent.parent
CONTRACT_ATTRIBUTES = {"layout", "hf_origin", "megatron_args", "parallel", "unrepresentable", "side_files",
                       "training_state_notice", "writes_optimizer", "optimizer_forms", "sharding", "keeps_quantized",
                       "optimizer_partial", "optimizer_in_model_files"}


def test_source_declares_defaults() -> None:
    assert CanonicalSource.layout is None
    assert CanonicalSource.hf_origin is None
    assert CanonicalSource.megatron_args is None
    assert tuple(CanonicalSource.unrepresentable) == ()


def test_saver_declares_parallel() -> None:
    assert Saver.parallel is True
    assert get_saver("hf").parallel is False
    assert get_saver("megatron").parallel is True
    assert get_saver("torch_dist").parallel is True


def test_a_saver_that_writes_optimizer_state_with_its_model_files_writes_it_in_shares() -> None:
    """Each model file holds its own state: a share that writes a model file writes its state too."""
    from pgconvert.formats.names import saver_names

    with_model = [name for name in saver_names() if get_saver(name).optimizer_in_model_files]
    assert with_model == ["megatron"]
    assert all(get_saver(name).optimizer_partial and get_saver(name).writes_optimizer for name in with_model)


def test_contract_attributes_are_not_read_with_getattr() -> None:
    offenders = []
    for folder in ("pgconvert", "loaders", "savers"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                        and node.func.id in ("getattr", "hasattr") and len(node.args) >= 2
                        and isinstance(node.args[1], ast.Constant) and node.args[1].value in CONTRACT_ATTRIBUTES):
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert offenders == []


def _names_a_format(side: ast.expr) -> bool:
    """A format name written out: a string, or a tuple, list or set of strings (cli.py's "auto" and "same"
    option values name no format)."""
    if isinstance(side, ast.Constant):
        return isinstance(side.value, str) and side.value not in ("auto", "same")
    return isinstance(side, (ast.Tuple, ast.List, ast.Set)) and any(_names_a_format(item) for item in side.elts)


def _is_format(side: ast.expr) -> bool:
    names = ("src_format", "dst_format", "format_name")
    return isinstance(side, ast.Attribute) and side.attr in names or isinstance(side, ast.Name) and side.id in names


def test_no_format_is_named_outside_the_registry() -> None:
    # Formats plug in through the contract's declared attributes and hooks: no code outside the registry
    # tests which format a source or destination is.
    offenders = []
    for folder in ("pgconvert", "loaders", "savers"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path == ROOT / "pgconvert" / "formats" / "registry.py":
                continue
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                sides = (node.left, *node.comparators) if isinstance(node, ast.Compare) else ()
                if any(map(_is_format, sides)) and any(map(_names_a_format, sides)):
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert offenders == []


def test_base_constructor_takes_no_format_specific_args() -> None:
    # Format-specific facts (Megatron args, HF origin) are declared attributes a loader sets,
    # not parameters of the base every format shares.
    assert list(inspect.signature(CanonicalSource.__init__).parameters) == [
        "self", "config", "vocab_rows", "iteration", "release"]
