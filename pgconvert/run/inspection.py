"""``inspect``: what a checkpoint holds, read through its format's loader, and what is wrong with it.

Everything comes from the registry's loader and the ``CanonicalSource`` it opens (names, metadata,
config, vocab rows, layout); no tensor is loaded. A checkpoint that does not open is not an
exception here but a problem in the result, so the caller can show it next to what is known.
"""

from __future__ import annotations

import dataclasses
import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pgconvert.errors import PgconvertError
from pgconvert.formats import Iteration, LoadOptions
from pgconvert.run.manifest import file_problems, read_manifest
from pgconvert.formats.registry import detect_format, get_loader
from pgconvert.semantics import summary
from pgconvert.formats.stream import CanonicalSource

Severity = Literal["error", "warning"]


@dataclass(frozen=True)
class Problem:
    """Something found wrong (``error``: the checkpoint is unusable as is) or worth knowing (``warning``)."""

    severity: Severity
    kind: str
    message: str


@dataclass
class CheckpointInfo:
    """What ``inspect`` found. ``layout`` is ``ParallelLayout`` fields (None for unsharded formats)."""

    path: str
    format: str | None = None
    iterations: list[Iteration] = field(default_factory=list)
    iteration: int | None = None
    release: bool = False
    layout: dict[str, Any] | None = None
    layout_text: str | None = None
    model_config: dict[str, Any] | None = None
    # The settings that change the computation (pgconvert.semantics), one text per table row.
    semantics: dict[str, str] = field(default_factory=dict)
    vocab_rows: int | None = None
    true_vocab_size: int | None = None
    tensor_count: int = 0
    total_bytes: int = 0
    dtypes: dict[str, int] = field(default_factory=dict)
    manifest: dict[str, Any] | None = None
    # The HF side files the checkpoint carries (pgconvert.formats.hf_side), relative to its root.
    side_files: list[str] = field(default_factory=list)
    notices: list[str] = field(default_factory=list)
    problems: list[Problem] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """No error-severity problem: the checkpoint opened and is consistent."""
        return not any(problem.severity == "error" for problem in self.problems)

    def to_dict(self) -> dict[str, Any]:
        doc = dataclasses.asdict(self)
        doc["ok"] = self.ok
        return doc


def inspect(path: str | Path, iteration: int | None = None) -> CheckpointInfo:
    """Describe the checkpoint at ``path`` (``iteration``: which saved iteration to open).

    Never raises for a broken checkpoint: the error is the first entry of ``problems``.
    """
    path = Path(path)
    info = CheckpointInfo(path=str(path.absolute()))
    try:
        info.format = detect_format(path)
        loader = get_loader(info.format)
        info.iterations = loader.iterations(path)
        source = loader.open(path, LoadOptions(iteration=iteration))
    except PgconvertError as error:
        info.problems.append(Problem("error", "unreadable", str(error)))
        _check_manifest(path, info)
        return info
    try:
        _describe(source, info)
    except PgconvertError as error:
        info.problems.append(Problem("error", "unreadable", str(error)))
    finally:
        source.close()
    _check_manifest(path, info)
    return info


def _describe(source: CanonicalSource, info: CheckpointInfo) -> None:
    info.iteration = source.iteration
    info.release = source.release
    layout = source.layout
    if layout is not None:
        info.layout = dataclasses.asdict(layout)
        info.layout_text = layout.describe()
    config = source.config
    info.model_config = config.to_dict()
    info.semantics = summary(config)
    info.vocab_rows = source.vocab_rows
    info.true_vocab_size = config.vocab_size
    dtypes: Counter[str] = Counter()
    for name in source.names():
        meta = source.meta(name)
        info.tensor_count += 1
        info.total_bytes += meta.nbytes
        dtypes[str(meta.dtype).removeprefix("torch.")] += 1
    info.dtypes = dict(sorted(dtypes.items()))
    info.notices = list(source.notices)
    if source.side_files is not None:
        prefix = os.path.relpath(source.side_files.directory.absolute(), info.path)
        info.side_files = [name if prefix == "." else f"{prefix}/{name}" for name in source.side_files.names()]
    if config.vocab_size is None:
        info.problems.append(Problem(
            "warning", "unknown-true-vocab",
            f"the true vocab size is unknown: the vocab tables have {source.vocab_rows} rows, padding "
            "included; converting to a layout with other padding (or to hf) needs --true-vocab-size",
        ))
    elif source.vocab_rows > config.vocab_size:
        info.problems.append(Problem(
            "warning", "padded-vocab",
            f"the vocab tables have {source.vocab_rows - config.vocab_size} padding rows beyond the true "
            f"vocab size {config.vocab_size} ({source.vocab_rows} rows)",
        ))


def _check_manifest(path: Path, info: CheckpointInfo) -> None:
    """Sizes only: a truncated or missing file shows at once; ``verify`` checks the sha256 too."""
    try:
        manifest = read_manifest(path)
    except PgconvertError as error:
        info.problems.append(Problem("error", "manifest", str(error)))
        return
    if manifest is None:
        return
    info.manifest = {
        "tool_version": manifest.tool_version,
        "created": manifest.created,
        "source_path": manifest.source_path,
        "source_format": manifest.source_format,
        "source_iteration": manifest.source_iteration,
        "files": len(manifest.files),
    }
    for problem in file_problems(path, manifest, hashes=False):
        info.problems.append(Problem("error", "manifest", problem))
