"""pgconvert: reshard LLM checkpoints between parallel layouts and formats, on fake process groups."""

__version__ = "0.1.0"

from pgconvert.convert import ConvertRequest, Report, convert, plan  # noqa: E402
from pgconvert.errors import PgconvertError  # noqa: E402

__all__ = ["ConvertRequest", "PgconvertError", "Report", "__version__", "convert", "plan"]
