"""``pgconvert.json``: what a conversion wrote, from what, and the size and digest of every file.

The manifest is written into the staging directory after the saver finishes and before the final
rename, so it exists only in a complete output: its presence means "pgconvert finished this", and
its file list lets ``verify`` and ``batch`` notice a file changed, truncated or removed afterwards.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any

from pgconvert.model.config import ModelConfig
from pgconvert.errors import CheckpointError
from pgconvert.formats import PlannedFile, target_config
from pgconvert.model.layout import ParallelLayout
from pgconvert.io.digest import algorithm_of, file_digest, labelled
from pgconvert.io.limits import quote, read_json
from pgconvert.io.paths import ensure_within
from pgconvert.version import __version__

if TYPE_CHECKING:
    from pgconvert.run.convert import ConvertRequest, Plan

MANIFEST_FILE = "pgconvert.json"
# The request's options that change what is written (beyond format and layout), recorded so a
# re-run can tell whether an existing output is the one it would write.
OUTPUT_OPTIONS = ("dtype", "dst_transformer_impl", "dst_expert_layout", "true_vocab_size", "max_shard_size",
                  "hf_config", "generation_config", "tokenizer",
                  "keep_fp8",  # quantized tensors kept as stored, or dequantized
                  "dst_mtp_layer_name",  # how per-rank files spell the MTP layer's inner layer
                  "dst_torch_dist_common",  # where a torch_dist DST keeps its common state
                  "merge_adapter")  # the LoRA adapter merged into the model
# What an output whose manifest predates an option's recording was written with (pgconvert wrote only that).
UNRECORDED_OPTIONS = {"dst_torch_dist_common": "legacy"}
MANIFEST_VERSION = 1


@dataclass(frozen=True)
class FileRecord:
    """One written file: its path relative to the output root (POSIX separators), size and labelled digest
    (``<algorithm>:<hex>``, ``pgconvert.io.digest``; None when the conversion ran with ``--digest none``)."""

    path: str
    size: int
    digest: str | None


@dataclass(frozen=True)
class Manifest:
    """The contents of ``pgconvert.json``; layouts are ``ParallelLayout`` fields as a dict."""

    tool_version: str
    created: str
    source_path: str
    source_format: str
    source_layout: dict[str, Any] | None
    source_iteration: int | None
    source_release: bool
    requested_iteration: int | None
    target_format: str
    target_layout: dict[str, Any]
    options: dict[str, Any]
    model_config: dict[str, Any]
    files: tuple[FileRecord, ...]

    @classmethod
    def for_conversion(cls, conversion: Plan, files: list[FileRecord]) -> Manifest:
        request = conversion.request
        source = conversion.source
        return cls(
            tool_version=__version__,
            created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            source_path=str(request.src.resolve()),
            source_format=conversion.src_format,
            source_layout=dataclasses.asdict(conversion.src_layout) if conversion.src_layout else None,
            source_iteration=source.iteration,
            source_release=source.release,
            requested_iteration=request.iteration,
            target_format=conversion.dst_format,
            target_layout=dataclasses.asdict(conversion.save_options.layout),
            options=output_options(request),
            model_config=_written_config(conversion).to_dict(),
            files=tuple(files),
        )

    @property
    def source_parallel_layout(self) -> ParallelLayout | None:
        return ParallelLayout(**self.source_layout) if self.source_layout is not None else None

    @property
    def target_parallel_layout(self) -> ParallelLayout:
        return ParallelLayout(**self.target_layout)

    def to_dict(self) -> dict[str, Any]:
        return {
            "manifest_version": MANIFEST_VERSION,
            "tool": "pgconvert",
            "tool_version": self.tool_version,
            "created": self.created,
            "source": {
                "path": self.source_path,
                "format": self.source_format,
                "layout": self.source_layout,
                "iteration": self.source_iteration,
                "release": self.source_release,
                "requested_iteration": self.requested_iteration,
            },
            "target": {"format": self.target_format, "layout": self.target_layout},
            "options": self.options,
            "model_config": self.model_config,
            "files": [dataclasses.asdict(record) for record in self.files],
        }

    @classmethod
    def from_dict(cls, doc: Any, where: Path) -> Manifest:
        reader = _Reader(where)
        if not isinstance(doc, dict):
            raise CheckpointError(f"{where}: expected a JSON object, found {type(doc).__name__}")
        version = reader.get(doc, "manifest_version", int)
        if version != MANIFEST_VERSION:
            raise CheckpointError(f"{where}: manifest_version {version} is not supported (expected {MANIFEST_VERSION})")
        source = reader.get(doc, "source", dict)
        target = reader.get(doc, "target", dict)
        files = []
        for index, item in enumerate(reader.get(doc, "files", list)):
            if not isinstance(item, dict):
                raise CheckpointError(f"{where}: files[{index}] is not an object")
            files.append(FileRecord(
                path=_confined(reader.get(item, "path", str, f"files[{index}]."), where, index),
                size=reader.get(item, "size", int, f"files[{index}]."),
                digest=_recorded_digest(reader, item, index),
            ))
        return cls(
            tool_version=reader.get(doc, "tool_version", str),
            created=reader.get(doc, "created", str),
            source_path=reader.get(source, "path", str, "source."),
            source_format=reader.get(source, "format", str, "source."),
            source_layout=reader.get(source, "layout", (dict, type(None)), "source."),
            source_iteration=reader.get(source, "iteration", (int, type(None)), "source."),
            source_release=reader.get(source, "release", bool, "source."),
            requested_iteration=reader.get(source, "requested_iteration", (int, type(None)), "source."),
            target_format=reader.get(target, "format", str, "target."),
            target_layout=reader.get(target, "layout", dict, "target."),
            options=reader.get(doc, "options", dict),
            model_config=reader.get(doc, "model_config", dict),
            files=tuple(files),
        )


def hashing(request: ConvertRequest) -> str | None:
    """The digest algorithm the manifest records of the output files (``--digest``; None: sizes only)."""
    return None if request.digest == "none" else request.digest


def writing_digest(conversion: Plan) -> str | None:
    """The digest computed while the output files are written: the format's own (``Saver.file_digest``), else
    ``--digest``'s."""
    return conversion.saver.file_digest(conversion.save_options) or hashing(conversion.request)


def _written_config(conversion: Plan) -> ModelConfig:
    """The model as written: the target's key naming, and the cast dtype when ``dtype`` was given."""
    options = conversion.save_options
    config = target_config(conversion.source.config, options)
    if options.dtype is not None:
        config = config.replace(params_dtype=str(options.dtype).removeprefix("torch."))
    return config


def output_options(request: ConvertRequest) -> dict[str, Any]:
    """``OUTPUT_OPTIONS`` of a request as JSON values (paths absolute)."""
    values: dict[str, Any] = {}
    for name in OUTPUT_OPTIONS:
        value = getattr(request, name, None)
        values[name] = str(Path(value).resolve()) if isinstance(value, os.PathLike) else value
    return values


@dataclass(frozen=True)
class _Reader:
    where: Path

    def get(self, doc: dict[str, Any], key: str, kind: type | tuple[type, ...], prefix: str = "") -> Any:
        if key not in doc:
            raise CheckpointError(f"{self.where}: {prefix}{key} is missing")
        value = doc[key]
        kinds = kind if isinstance(kind, tuple) else (kind,)
        # JSON has no int/bool distinction in Python's eyes: True is an int, and is refused as one.
        if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
            names = " or ".join("null" if k is type(None) else k.__name__ for k in kinds)
            raise CheckpointError(f"{self.where}: {prefix}{key}={value!r} must be {names}")
        return value


def _recorded_digest(reader: _Reader, item: dict[str, Any], index: int) -> str | None:
    """A file's labelled digest; a manifest from before digests named their algorithm has a ``sha256`` field."""
    if "digest" not in item and "sha256" in item:
        legacy = reader.get(item, "sha256", (str, type(None)), f"files[{index}].")
        digest = None if legacy is None else labelled("sha256", legacy)
    else:
        digest = reader.get(item, "digest", (str, type(None)), f"files[{index}].")
    if digest is not None:
        algorithm_of(digest, f"{reader.where}: files[{index}]")
    return digest


def hash_file(path: Path, relpath: str, algorithm: str) -> FileRecord:
    """Size and ``algorithm``'s digest of ``path`` in one streaming pass (constant memory, any file size)."""
    digest, size = file_digest(path, algorithm)
    return FileRecord(relpath, size, digest)


def record_files(root: Path, written: Sequence[PlannedFile] = (), algorithm: str | None = None) -> list[FileRecord]:
    """Every regular file under ``root`` (but the manifest itself), sorted by relative path.

    Files a saver hashed while writing them (``written`` entries with a digest, of any algorithm, and the same
    size on disk) are not read again; the others are hashed with ``algorithm``; without one no file is read
    (sizes only, digest None).
    """
    known = {item.relpath: item for item in written if item.digest is not None and item.size is not None}
    records = []
    for directory, subdirs, names in os.walk(root):
        subdirs.sort()
        for name in sorted(names):
            path = Path(directory) / name
            relpath = path.relative_to(root).as_posix()
            if relpath == MANIFEST_FILE or not path.is_file():
                continue
            item = known.get(relpath)
            if algorithm is None:
                records.append(FileRecord(relpath, path.stat().st_size, None))
            elif item is not None and item.size == path.stat().st_size:
                assert item.digest is not None and item.size is not None
                records.append(FileRecord(relpath, item.size, item.digest))
            else:
                records.append(hash_file(path, relpath, algorithm))
    return records


def write_manifest(root: Path, manifest: Manifest) -> Path:
    path = root / MANIFEST_FILE
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(manifest.to_dict(), handle, indent=2, sort_keys=False)
        handle.write("\n")
        handle.flush()
        os.fsync(handle.fileno())
    return path


def read_manifest(root: Path) -> Manifest | None:
    """The manifest of the output at ``root``; None when it has none (not a pgconvert output)."""
    path = root / MANIFEST_FILE
    if not path.is_file():
        return None
    doc = read_json(path)
    return Manifest.from_dict(doc, path)


def _confined(relpath: str, where: Path, index: int) -> str:
    """A manifest path must name a file inside the checkpoint: relative, no ``..``, no ``.``."""
    parts = relpath.split("/")
    if not relpath or PurePosixPath(relpath).is_absolute() or "\\" in relpath or any(
            part in ("", ".", "..") for part in parts):
        raise CheckpointError(f"{where}: files[{index}].path {quote(relpath)}: must be a relative path inside "
                              "the checkpoint (no '..', not absolute); refusing to read it")
    return relpath


def file_problems(root: Path, manifest: Manifest, hashes: bool = True) -> list[str]:
    """Every listed file that is missing, of another size, or (with ``hashes``) of another digest than the
    one recorded (a file recorded without one, ``--digest none``, is checked by size).

    A listed path that leads outside ``root`` (through a symlink) is refused, never read.
    """
    problems = []
    for record in manifest.files:
        path = root / record.path
        if path.is_symlink() or path.exists():
            ensure_within(root, path)
        if not path.is_file():
            problems.append(f"{record.path}: listed in {MANIFEST_FILE} but missing")
            continue
        size = path.stat().st_size
        if size != record.size:
            problems.append(f"{record.path}: {size} bytes, {MANIFEST_FILE} records {record.size}")
            continue
        if hashes and record.digest is not None:
            actual = hash_file(path, record.path, algorithm_of(record.digest, root / MANIFEST_FILE)).digest
            assert actual is not None
            if actual != record.digest:
                problems.append(f"{record.path}: digest {actual[:24]}… differs from the {record.digest[:24]}… in "
                                f"{MANIFEST_FILE}")
    return problems
