"""The command's start-up: ``--help``, ``--version`` and argument errors answer without importing torch;
Ctrl-C while a command is still importing torch and pgconvert gives one line and exit 130."""

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


@pytest.mark.parametrize("argv,code,expected", [
    (["--help"], 0, "Usage: pgconvert"),
    (["--version"], 0, "pgconvert, version"),
    (["convert", "--help"], 0, "--dst-tp"),
    (["verify", "--help"], 0, "verify [OPTIONS] A B"),
    (["export-adapter", "--help"], 0, "export-adapter [OPTIONS] SRC DST"),
    (["src", "dst", "--dst-tp", "x"], 2, "'x' is not a valid integer"),
    (["src", "dst", "--dtype", "fp7"], 2, "'fp7' is not one of"),
    (["src", "dst", "--src-format", "nope"], 2, "'nope' is not one of"),
])
def test_help_version_and_argument_errors_answer_without_torch(tmp_path: Path, argv: list[str], code: int,
                                                               expected: str) -> None:
    # With torch's import interrupted, any import of it would end the command with exit 130.
    done = _run([sys.executable, "-m", "pgconvert", *argv], tmp_path)

    assert done.returncode == code, done.stderr
    assert expected in done.stdout + done.stderr
    assert "Traceback" not in done.stderr


def test_python_m_pgconvert_interrupted_while_starting_exits_130_with_one_line(tmp_path: Path) -> None:
    done = _run([sys.executable, "-m", "pgconvert", "inspect", str(tmp_path)], tmp_path)

    assert done.returncode == 130, done.stderr
    assert "Traceback" not in done.stderr
    assert done.stderr.strip() == "interrupted: no output was left behind"


def test_console_script_interrupted_while_starting_exits_130_with_one_line(tmp_path: Path) -> None:
    script = Path(sys.executable).parent / "pgconvert"
    if not script.is_file():
        pytest.skip(f"{script}: no console script installed beside this Python")
    (tmp_path / "src").mkdir()
    done = _run([sys.executable, str(script), str(tmp_path / "src"), str(tmp_path / "dst")], tmp_path)

    assert done.returncode == 130, done.stderr
    assert "Traceback" not in done.stderr
    assert done.stderr.strip() == "interrupted: no output was left behind"
    assert sorted(path.name for path in tmp_path.iterdir()) == ["sitecustomize.py", "src"]


def test_library_use_interrupted_keeps_the_keyboard_interrupt(tmp_path: Path) -> None:
    # A program that uses pgconvert decides what Ctrl-C means: it must get the exception.
    done = _run([sys.executable, "-c", "import pgconvert; pgconvert.convert"], tmp_path)

    assert done.returncode != 130
    assert "KeyboardInterrupt" in done.stderr


def test_import_pgconvert_loads_no_torch_until_a_public_name_is_used() -> None:
    code = ("import sys, pgconvert, pgconvert.cli, pgconvert.formats; assert 'torch' not in sys.modules; "
            "pgconvert.verify; from pgconvert.formats import Loader; assert 'torch' in sys.modules; "
            "print(sorted(set(pgconvert.__all__) - set(dir(pgconvert))))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)

    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
