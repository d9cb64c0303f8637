"""pgconvert: reshard LLM checkpoints between parallel layouts and formats, on fake process groups."""

import importlib
import os
import sys


def _started_as_command() -> bool:
    """Whether this import is the start-up of the pgconvert command: its console script, or
    ``python -m pgconvert`` (while the package is imported for ``-m``, ``sys.argv[0]`` is ``-m``)."""
    if sys.argv and os.path.basename(sys.argv[0]) == "pgconvert":
        return True
    argv = list(getattr(sys, "orig_argv", []))
    return any(flag == "-m" and name == "pgconvert" for flag, name in zip(argv, argv[1:])) or "-mpgconvert" in argv


try:
    from pgconvert.version import __version__
    from pgconvert.run.batch import BatchReport, EntryResult, read_plan, run_batch, run_plan
    from pgconvert.run.convert import ConvertRequest, Report, convert, convert_request, plan
    from pgconvert.errors import PgconvertError
    from pgconvert.run.inspection import CheckpointInfo, Problem, inspect
    from pgconvert.model.layout import ParallelLayout
    from pgconvert.model.layout_spec import LayoutSpec
    from pgconvert.run.manifest import MANIFEST_FILE, Manifest, read_manifest
    from pgconvert.run.verification import TensorDifference, VerifyReport, verify
    if _started_as_command():
        importlib.import_module("pgconvert.cli")  # the command's own start-up, under the same guard
except KeyboardInterrupt:
    # Ctrl-C while torch and the rest load: a library user gets the KeyboardInterrupt; the
    # command gets one line and exit 130 (as everywhere else in it), never a traceback.
    if not _started_as_command():
        raise
    sys.stderr.write("interrupted while starting: nothing was written\n")
    raise SystemExit(130) from None

__all__ = [
    "MANIFEST_FILE", "BatchReport", "CheckpointInfo", "ConvertRequest", "EntryResult", "LayoutSpec", "Manifest",
    "ParallelLayout", "PgconvertError", "Problem", "Report", "TensorDifference", "VerifyReport", "__version__",
    "convert", "convert_request", "inspect", "plan", "read_manifest", "read_plan", "run_batch", "run_plan", "verify",
]
