"""Ctrl-C while the command is still importing torch and pgconvert: one line and exit 130."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

# Installed by Python at start-up (before ``-m`` or a console script imports anything), it makes
# the import of torch raise KeyboardInterrupt, as a Ctrl-C during that import does.
SITECUSTOMIZE = '''
import sys

class _InterruptTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch":
            raise KeyboardInterrupt
        return None

sys.meta_path.insert(0, _InterruptTorch())
'''


def _run(argv: list[str], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    (tmp_path / "sitecustomize.py").write_text(SITECUSTOMIZE)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)


def test_python_m_pgconvert_interrupted_while_starting_exits_130_with_one_line(tmp_path: Path) -> None:
    done = _run([sys.executable, "-m", "pgconvert", "--help"], tmp_path)

    assert done.returncode == 130, done.stderr
    assert "Traceback" not in done.stderr
    assert done.stderr.strip() == "interrupted while starting: nothing was written"


def test_console_script_interrupted_while_starting_exits_130_with_one_line(tmp_path: Path) -> None:
    script = Path(sys.executable).parent / "pgconvert"
    if not script.is_file():
        pytest.skip(f"{script}: no console script installed beside this Python")
    done = _run([sys.executable, str(script), "--help"], tmp_path)

    assert done.returncode == 130, done.stderr
    assert "Traceback" not in done.stderr
    assert done.stderr.strip() == "interrupted while starting: nothing was written"


def test_library_import_interrupted_keeps_the_keyboard_interrupt(tmp_path: Path) -> None:
    # A program that imports pgconvert decides what Ctrl-C means: it must get the exception.
    done = _run([sys.executable, "-c", "import pgconvert"], tmp_path)

    assert done.returncode != 130
    assert "KeyboardInterrupt" in done.stderr
