"""pgconvert reads ModelConfig through its groups.

The flat names (``SettingsByName``: ``config.rotary_base``, ``ModelConfig(rotary_base=...)``,
``config.is_moe_layer(i)``) are the stable interface of format plugins and tests; the package's own
code reads ``config.positions.rotary_base``, ``config.layers[i].moe`` and builds configs with
``ModelConfig.from_settings`` or the grouped constructor. Under the ``package_reads_groups`` fixture
a flat use from a file of pgconvert/, loaders/ or savers/ raises and is recorded (so an error the
package catches still fails the test); conversions of several families through every format,
``inspect`` and ``verify`` then run under it.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType
from typing import Any

import pytest
from support.cli_helpers import run_cli
from support.hf_helpers import build_hf_model, save_hf_model
from support.llama_like_helpers import build_model as build_llama_like, save_model as save_llama_like
from support.mtp_models import with_mtp
from support.postnorm_helpers import save_postnorm_model

import pgconvert
import pgconvert.loaders
import pgconvert.savers
from pgconvert.model.config import SETTING_GROUPS, ModelConfig, SettingsByName
from pgconvert.run.example import example_config

PACKAGE_DIRS = tuple(Path(str(module.__file__)).resolve().parent
                     for module in (pgconvert, pgconvert.loaders, pgconvert.savers))
A_PACKAGE_FILE = str(PACKAGE_DIRS[0] / "model" / "config.py")


class FlatUse(AssertionError):
    """A flat use of ModelConfig from a package file."""


def _package_line(frame: FrameType | None) -> str | None:
    """``file:line`` of the first frame outside ``dataclasses`` (``dataclasses.replace`` calls the
    constructor for its caller), when it lies in a package file."""
    while frame is not None and frame.f_code.co_filename == dataclasses.__file__:
        frame = frame.f_back
    if frame is None:
        return None
    path = Path(frame.f_code.co_filename).resolve()
    return f"{path}:{frame.f_lineno}" if any(path.is_relative_to(root) for root in PACKAGE_DIRS) else None


@pytest.fixture
def package_reads_groups(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """Flat uses from package files raise; the list of them must be empty at the end."""
    uses: list[str] = []
    flat_getattr, flat_init = SettingsByName.__getattr__, SettingsByName.__init__

    def refuse(what: str, frame: FrameType | None) -> None:
        line = _package_line(frame)
        if line is not None:
            uses.append(f"{line}: {what}")
            raise FlatUse(f"{line}: {what}: the package reads ModelConfig through its groups")

    def grouped_getattr(self: SettingsByName, name: str) -> Any:
        value = flat_getattr(self, name)  # an unknown name is an AttributeError, as before
        refuse(f"config.{name}", sys._getframe(1))
        return value

    def grouped_init(self: SettingsByName, **settings: Any) -> None:
        flat = sorted(name for name in settings if SETTING_GROUPS.get(name) is not None)
        if flat:
            refuse(f"ModelConfig({', '.join(flat)}=...)", sys._getframe(1))
        flat_init(self, **settings)

    def layer_question(name: str) -> Callable[[SettingsByName, int], bool]:
        original = getattr(SettingsByName, name)

        def question(self: SettingsByName, layer: int) -> bool:
            refuse(f"config.{name}({layer})", sys._getframe(1))
            return bool(original(self, layer))
        return question

    monkeypatch.setattr(SettingsByName, "__getattr__", grouped_getattr)
    monkeypatch.setattr(SettingsByName, "__init__", grouped_init)
    for name in ("is_moe_layer", "is_window_layer"):
        monkeypatch.setattr(SettingsByName, name, layer_question(name))
    yield uses
    assert not uses, "flat uses of ModelConfig in the package:\n" + "\n".join(uses)


def _run_as_package_file(source: str, config: ModelConfig) -> Any:
    """Evaluate ``source`` as if a line of a package file held it."""
    return eval(compile(source, A_PACKAGE_FILE, "eval"),  # noqa: S307
                {"config": config, "ModelConfig": ModelConfig, "dataclasses": dataclasses})


@pytest.mark.parametrize("source", [
    "config.rotary_base", "config.head_dim", "config.fc1_rows", "config.setting('rotary_base') and config.num_experts",
    "config.is_moe_layer(0)", "config.is_window_layer(0)", "dataclasses.replace(config, rotary_base=5.0)",
    "ModelConfig(num_layers=1, hidden_size=8, num_attention_heads=2, ffn_hidden_size=8)",
])
def test_a_flat_use_from_a_package_file_is_refused(package_reads_groups: list[str], source: str) -> None:
    config = example_config()
    with pytest.raises(FlatUse):
        _run_as_package_file(source, config)
    assert len(package_reads_groups) == 1
    package_reads_groups.clear()


def test_grouped_reads_from_a_package_file_and_flat_reads_from_a_test_pass(package_reads_groups: list[str]) -> None:
    config = example_config()
    assert _run_as_package_file("(config.positions.rotary_base, config.attention.head_dim, config.layers[0].moe, "
                                "config.setting('rotary_base'), config.replace(rotary_base=5.0).positions.rotary_base)",
                                config) == (10000.0, 8, False, 10000.0, 5.0)
    assert (config.rotary_base, config.head_dim, config.is_moe_layer(0)) == (10000.0, 8, False)
    assert dataclasses.replace(config, rotary_base=5.0).rotary_base == 5.0
    assert ModelConfig(num_layers=1, hidden_size=8, num_attention_heads=2, ffn_hidden_size=8).head_dim == 4


def _dense(path: Path) -> Path:
    return save_hf_model(build_hf_model("llama"), path)


def _moe_shared_experts_windows(path: Path) -> Path:
    return save_llama_like(build_llama_like("qwen2_moe"), path)


def _mla_with_mtp(path: Path) -> Path:
    return with_mtp("v3", path)


def _gemma3_windows_softcapping(path: Path) -> Path:
    return save_postnorm_model("gemma3", path)


@pytest.mark.parametrize(("make", "megatron_layout"), [
    (_dense, "tp=2,pp=2"),
    (_moe_shared_experts_windows, "tp=2,pp=2,ep=2"),
    (_mla_with_mtp, "tp=2,pp=2,ep=2"),
    (_gemma3_windows_softcapping, "tp=2,pp=2"),
], ids=["dense", "moe_shared_experts", "mla_mtp", "gemma3"])
def test_conversions_inspect_and_verify_read_the_groups(
        package_reads_groups: list[str], tmp_path: Path, make: Callable[[Path], Path], megatron_layout: str) -> None:
    """HF -> per-rank -> HF -> per-rank -> torch_dist, each inspected, the round trips verified equal."""
    hf = make(tmp_path / "hf")
    pgconvert.convert(hf, tmp_path / "megatron", megatron_layout, dst_format="megatron")
    pgconvert.convert(tmp_path / "megatron", tmp_path / "hf_back", dst_format="hf")
    pgconvert.convert(tmp_path / "hf_back", tmp_path / "megatron_back", megatron_layout, dst_format="megatron")
    pgconvert.convert(tmp_path / "megatron_back", tmp_path / "dist", "tp=1,pp=1,ep=1", dst_format="torch_dist")
    for name in ("hf", "megatron", "hf_back", "megatron_back", "dist"):
        info = pgconvert.inspect(tmp_path / name)
        assert info.ok and info.model_config is not None, (name, info.problems)
    assert pgconvert.verify(hf, tmp_path / "hf_back").equal
    assert pgconvert.verify(tmp_path / "megatron", tmp_path / "megatron_back").equal
    assert pgconvert.verify(tmp_path / "megatron", tmp_path / "dist").equal
    result = run_cli("inspect", tmp_path / "megatron")
    assert result.exit_code == 0, result.output
    assert package_reads_groups == []
