"""The installed package claims only ``pgconvert*`` names and works from any working directory."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    target = tmp_path_factory.mktemp("site")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                    "--target", str(target), str(REPO)], check=True, capture_output=True, timeout=300)
    return target


def test_wheel_installs_only_pgconvert_top_level_names(installed: Path) -> None:
    tops = {p.name for p in installed.iterdir()
            if p.name != "bin" and not p.name.endswith((".dist-info", ".egg-info"))}
    assert tops == {"pgconvert"}
    assert (installed / "pgconvert" / "loaders" / "hf" / "__init__.py").is_file()
    assert (installed / "pgconvert" / "savers" / "megatron" / "__init__.py").is_file()


def test_wheel_holds_every_module_of_the_repository(installed: Path) -> None:
    """Every module of pgconvert/, loaders/ and savers/ (subpackages included) is in the wheel."""
    expected = {path.relative_to(REPO).as_posix() for path in (REPO / "pgconvert").rglob("*.py")}
    for folder in ("loaders", "savers"):
        expected |= {f"pgconvert/{path.relative_to(REPO).as_posix()}" for path in (REPO / folder).rglob("*.py")}
    found = {path.relative_to(installed).as_posix() for path in (installed / "pgconvert").rglob("*.py")}

    assert sorted(expected - found) == []


def test_installed_formats_load_from_a_directory_holding_its_own_loaders(installed: Path, tmp_path: Path) -> None:
    (tmp_path / "loaders").mkdir()
    (tmp_path / "loaders" / "__init__.py").write_text("raise ImportError('the wrong loaders package')\n")
    (tmp_path / "savers").mkdir()
    (tmp_path / "savers" / "__init__.py").write_text("raise ImportError('the wrong savers package')\n")
    code = ("import pgconvert.formats.registry as r, pgconvert.formats.names as n; "
            "print(sorted(type(r.get_loader(name)).__module__ for name in n.loader_names()));"
            "print(sorted(type(r.get_saver(name)).__module__ for name in n.saver_names()))")
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True,
                            env={"PYTHONPATH": str(installed), "PATH": "/usr/bin:/bin"}, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "pgconvert.loaders.hf" in result.stdout and "pgconvert.savers.torch_dist" in result.stdout
