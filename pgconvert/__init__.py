"""pgconvert: reshard LLM checkpoints between parallel layouts and formats, on fake process groups.

The public names below are imported on first use, so ``import pgconvert`` (and the command's
``--help``, ``--version`` and argument errors) does not load torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from pgconvert.version import __version__

# Public name -> the module that defines it.
_EXPORTS: dict[str, str] = {
    **dict.fromkeys(("BatchReport", "EntryResult", "read_plan", "run_batch", "run_plan"), "pgconvert.run.batch"),
    **dict.fromkeys(("ConvertRequest", "Report", "convert", "convert_request", "plan"), "pgconvert.run.convert"),
    "PgconvertError": "pgconvert.errors",
    **dict.fromkeys(("AdapterExport", "export_adapter"), "pgconvert.run.adapter_export"),
    **dict.fromkeys(("CheckpointInfo", "Problem", "inspect"), "pgconvert.run.inspection"),
    "ParallelLayout": "pgconvert.model.layout",
    "LayoutSpec": "pgconvert.model.layout_spec",
    **dict.fromkeys(("MANIFEST_FILE", "Manifest", "read_manifest"), "pgconvert.run.manifest"),
    **dict.fromkeys(("TensorDifference", "VerifyReport", "verify"), "pgconvert.run.verification"),
}

if TYPE_CHECKING:
    from pgconvert.errors import PgconvertError
    from pgconvert.model.layout import ParallelLayout
    from pgconvert.model.layout_spec import LayoutSpec
    from pgconvert.run.adapter_export import AdapterExport, export_adapter
    from pgconvert.run.batch import BatchReport, EntryResult, read_plan, run_batch, run_plan
    from pgconvert.run.convert import ConvertRequest, Report, convert, convert_request, plan
    from pgconvert.run.inspection import CheckpointInfo, Problem, inspect
    from pgconvert.run.manifest import MANIFEST_FILE, Manifest, read_manifest
    from pgconvert.run.verification import TensorDifference, VerifyReport, verify


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'pgconvert' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})


__all__ = [
    "MANIFEST_FILE", "AdapterExport", "BatchReport", "CheckpointInfo", "ConvertRequest", "EntryResult", "LayoutSpec", "Manifest",
    "ParallelLayout", "PgconvertError", "Problem", "Report", "TensorDifference", "VerifyReport", "__version__",
    "convert", "convert_request", "export_adapter", "inspect", "plan", "read_manifest", "read_plan", "run_batch", "run_plan", "verify",
]
