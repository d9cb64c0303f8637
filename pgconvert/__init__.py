"""pgconvert: reshard LLM checkpoints between parallel layouts and formats, on fake process groups."""

from pgconvert.version import __version__  # noqa: E402
from pgconvert.batch import BatchReport, EntryResult, read_plan, run_batch, run_plan  # noqa: E402
from pgconvert.convert import ConvertRequest, Report, convert, convert_request, plan  # noqa: E402
from pgconvert.errors import PgconvertError  # noqa: E402
from pgconvert.inspection import CheckpointInfo, Problem, inspect  # noqa: E402
from pgconvert.layout import ParallelLayout  # noqa: E402
from pgconvert.layout_spec import LayoutSpec  # noqa: E402
from pgconvert.manifest import MANIFEST_FILE, Manifest, read_manifest  # noqa: E402
from pgconvert.verification import TensorDifference, VerifyReport, verify  # noqa: E402

__all__ = [
    "MANIFEST_FILE", "BatchReport", "CheckpointInfo", "ConvertRequest", "EntryResult", "LayoutSpec", "Manifest",
    "ParallelLayout", "PgconvertError", "Problem", "Report", "TensorDifference", "VerifyReport", "__version__",
    "convert", "convert_request", "inspect", "plan", "read_manifest", "read_plan", "run_batch", "run_plan", "verify",
]
