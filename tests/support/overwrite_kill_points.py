"""Kill ``pgconvert SRC DST --overwrite`` at every file-system step of putting its output in place.

Run as a child job: ``python overwrite_kill_points.py WORK OLD_SRC NEW_SRC MODE`` with MODE
``exchange`` (the one-step swap) or ``two-renames`` (the swap made unavailable). WORK/out/dst starts
as the conversion of OLD_SRC; each run converts NEW_SRC over it and is killed with SIGKILL just
before its k-th file-system operation after the output is complete (k = 1, 2, … until a run
finishes). After each kill the script records what DST holds, which complete output ``pgconvert
verify`` finds it equal to, and the hidden siblings left; then runs the conversion again unkilled
and records whether that run succeeded, DST verified against NEW_SRC, and nothing was left beside
it. One JSON object per kill point goes to stdout.

Every run is a forked child of this process, which imports pgconvert (and torch) once, with the modules a
conversion and a verify import on first use, and never computes with torch itself, so a fork costs no import.
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
import signal
import sys
from pathlib import Path
from typing import Any, Callable

import pgconvert.cli
import pgconvert.run.destination as destination
from pgconvert.formats.registry import get_loader, get_saver

convert_module = importlib.import_module("pgconvert.run.convert")  # the package's ``convert`` is the function

# Audit events of operations that change or open something on disk (fsync needs an open).
FILE_SYSTEM_EVENTS = frozenset({"open", "os.rename", "os.replace", "os.remove", "os.rmdir", "os.mkdir",
                                "os.truncate", "os.chmod", "os.link", "os.symlink", "shutil.rmtree",
                                "ctypes.call_function"})


def in_child(body: Callable[[], int]) -> int:
    """Run ``body`` in a forked child; its exit code, or -signal when a signal ended it."""
    pid = os.fork()
    if pid == 0:
        os.dup2(os.open(os.devnull, os.O_WRONLY), 1)  # stdout carries only this script's records
        try:
            code = body()
        except BaseException:  # noqa: BLE001 - the child must never return into the parent's loop
            code = 99
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def cli(*args: str | Path) -> int:
    try:
        pgconvert.cli.main([str(arg) for arg in args], standalone_mode=False)
    except SystemExit as exc:
        return int(exc.code or 0)
    return 0


def killed_at(step: int, src: Path, dst: Path, mode: str) -> int:
    """In the child: convert ``src`` over ``dst``, killed just before file-system step ``step`` of
    putting the output in place (counted from the start of ``promote``)."""
    if mode == "two-renames":
        destination.exchange = lambda first, second: False  # type: ignore[assignment]
    armed = {"on": False, "count": 0}

    def hook(event: str, args: Any) -> None:
        if armed["on"] and event in FILE_SYSTEM_EVENTS:
            armed["count"] += 1
            if armed["count"] == step:
                os.kill(os.getpid(), signal.SIGKILL)

    real_promote = convert_module.promote

    def promote(*args: Any, **kwargs: Any) -> None:
        armed["on"] = True
        real_promote(*args, **kwargs)

    convert_module.promote = promote
    sys.addaudithook(hook)
    return cli(src, dst, "--dst-tp", "1", "--overwrite", "--quiet")


def leftovers(dst: Path) -> list[str]:
    return sorted(path.name for path in dst.parent.iterdir() if path != dst)


def holds(dst: Path, old_src: Path, new_src: Path) -> str:
    """Which source's complete conversion DST is: ``new``, ``old``, or ``none``."""
    if not dst.is_dir():
        return "missing"
    for name, src in (("new", new_src), ("old", old_src)):
        if in_child(lambda: cli("verify", src, dst)) == 0:
            return name
    return "none"


def import_what_runs_import() -> None:
    """Import here the modules a megatron conversion and a verify import on first use, so that no forked run
    imports them again (an import only: nothing here computes with torch)."""
    importlib.import_module("pgconvert.run.verification")
    get_loader("megatron")
    get_saver("megatron")


def main(work: Path, old_src: Path, new_src: Path, mode: str) -> None:
    import_what_runs_import()
    template = work / "template"
    assert in_child(lambda: cli(old_src, template, "--dst-tp", "1", "--quiet")) == 0
    out = work / "out"
    dst = out / "dst"
    for step in range(1, 1000):
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir()
        shutil.copytree(template, dst)
        code = in_child(lambda: killed_at(step, new_src, dst, mode))
        point: dict[str, Any] = {"step": step, "code": code, "dst": holds(dst, old_src, new_src),
                                 "left": leftovers(dst)}
        point["retired_holds"] = [holds(out / name, old_src, new_src) for name in point["left"]
                                  if destination.RETIRED_MARKER in name]
        point["rerun_code"] = in_child(lambda: cli(new_src, dst, "--dst-tp", "1", "--overwrite", "--quiet"))
        point["rerun_dst"] = holds(dst, old_src, new_src)
        point["rerun_left"] = leftovers(dst)
        print(json.dumps(point), flush=True)
        if code != -signal.SIGKILL:
            return


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]), sys.argv[4])
