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
    assert (installed / "pgconvert" / "loaders" / "hf.py").is_file()
    assert (installed / "pgconvert" / "savers" / "megatron.py").is_file()


def test_installed_formats_load_from_a_directory_holding_its_own_loaders(installed: Path, tmp_path: Path) -> None:
    (tmp_path / "loaders").mkdir()
    (tmp_path / "loaders" / "__init__.py").write_text("raise ImportError('the wrong loaders package')\n")
    (tmp_path / "savers").mkdir()
    (tmp_path / "savers" / "__init__.py").write_text("raise ImportError('the wrong savers package')\n")
    code = ("import pgconvert.registry as r; "
            "print(sorted(type(r.get_loader(n)).__module__ for n in r.loader_names()));"
            "print(sorted(type(r.get_saver(n)).__module__ for n in r.saver_names()))")
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True,
                            env={"PYTHONPATH": str(installed), "PATH": "/usr/bin:/bin"}, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "pgconvert.loaders.hf" in result.stdout and "pgconvert.savers.torch_dist" in result.stdout
