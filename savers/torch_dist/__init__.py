"""Saver for Megatron distributed checkpoints (``torch_dist``), as megatron-core's ``dist_checkpointing.save`` writes
them for a single-rank (TP1, PP1, EP1) job.

The files are what torch.distributed.checkpoint's ``dcp.save(no_dist=True)`` with its ``FileSystemWriter`` writes:
the plan (keys, global shapes, chunks) is computed from the source's metadata alone, and each chunk's data is
produced only when the writer asks for it (``resolve_data``), so one canonical tensor is in memory at a time: peak
memory is the largest canonical tensor plus its copy in the target dtype (and, for a vocab table whose padding
changes, the refitted table), plus the plan (a few hundred bytes per chunk).

The chunks go to data files ``__0_0.distcp``, ``__0_1.distcp``, … of at most ``max_shard_size`` bytes of values each
(``--max-shard-size``, default 5 GB; one canonical tensor's chunks stay in one file), decided from the plan alone.
``save(only=...)`` writes some of them (``--workers``, sharded runs: each process its share), and ``finalize``
writes the common state (``common.pt``, or ``--dst-torch-dist-common store``: its own data file after the model's),
``.metadata`` (from the plan: every record's offset is known from its shape and dtype,
``dcp_writer.archive_length``), ``metadata.json`` and the tracker, so every split gives the same bytes; ``seal``
writes ``integrity.json`` (store, ``SaveOptions.integrity_manifest``) after the optimizer state.

The data files are written by ``StreamingWriter`` (``pgconvert/io/dcp_writer.py``, through
``pgconvert/formats/dcp_save.py``, which the fsdp_dtensor saver shares), not by torch's
``FileSystemWriter.write_data``, and with no import of torch.distributed.checkpoint (``pgconvert/io/dcp_plan.py``):
torch's loop keeps every tensor it wrote in a dict until the file is closed (one per key, so a stacked model's
embedding, output layer and one layer of each key stay alive), which made the peak about three canonical tensors.
The bytes are the same: the items in torch's order (``_write_order``), each the ``torch.save`` archive of its chunk
(``pgconvert.io.torchzip``, CRC32s included), and the same ``WriteResult`` offsets, and ``.metadata`` pickled as
torch pickles it. The file is hashed on the way, so the manifest does not read it back. The layout is not in the
files: it is the one recorded in common state's args (``SaveOptions.layout``), what Megatron-LM reads back as the
run's.
"""

from __future__ import annotations

import io
import logging
from collections.abc import Collection
from pathlib import Path
from typing import Any

import torch

from pgconvert.errors import ValidationError
from pgconvert.formats import (TRAINING_STATE_NOT_CARRIED, CarriedOptimizer, OptimizerFile, OptimizerOptions,
                               PlannedFile, Progress, SaveOptions, Saver, SaveResult, target_config, target_dtype)
from pgconvert.formats.dcp_save import (StoredChunk, StreamingPlanner, data_file_name, data_files, file_numbers,
                                        layer_rules, planned_data_files, row_runs, write_data_files, write_store)
from pgconvert.formats.hf_side import carried_for_target, write_carried
from pgconvert.formats.megatron import (CHECKPOINT_VERSION, FRAMEWORK_PICKLE, TRACKER_FILE, args_for_target,
                                       iteration_dir_name, params_dtype_for)
from pgconvert.formats.stream import CanonicalSource
from pgconvert.formats.names import COMMON_IN_STORE
from pgconvert.formats.strict import fallback
from pgconvert.formats.dcp_layout import CHECKPOINT_CONFIG_FILE, DCP_METADATA_FILE
from pgconvert.formats.torch_dist import (
    COMMON_FILE,
    COMMON_STATE_KEY,
    CONTENT_METADATA,
    SHARDED_BACKEND,
    empty_extra_state,
    extra_state_keys,
    tensor_locations,
    write_checkpoint_config,
)
from pgconvert.formats.torch_dist_integrity import INTEGRITY_ALGORITHM, INTEGRITY_FILE, write_integrity_manifest
from pgconvert.io.dcp_writer import DEFAULT_MAX_DATA_FILE_SIZE, WrittenFiles
from pgconvert.io.digest import hex_of
from pgconvert.io.durable import fsync_file
from pgconvert.model.provider import (
    canonical_shapes,
    keep_dtype_names,
    target_vocab_rows,
)
from pgconvert.optimizer.source import OptimizerSource
from pgconvert.savers.torch_dist.common_state import common_bytes
from pgconvert.savers.torch_dist.optimizer import DST_FORMS, planned_records, write_optimizer, written_form
from pgconvert.savers.torch_dist.optimizer_records import RecordsShare

log = logging.getLogger(__name__)

# torch.distributed.checkpoint names rank 0's data files __0_<n>.distcp; the first holds the _extra_state entries.
DATA_FILE = data_file_name(0)


class TorchDistSaver(Saver):
    name = "torch_dist"

    def validate(self, source: CanonicalSource, options: SaveOptions) -> None:
        config = target_config(source.config, options)
        options.layout.validate(config, "dst")
        target_vocab_rows(config, source.vocab_rows, options.layout)
        carried_for_target(source, options)
        if options.max_shard_size is not None and options.max_shard_size < 1:
            raise ValidationError(f"max_shard_size={options.max_shard_size}: must be a positive byte count")
        if not options.strict:
            return
        if any(extra.holds_state() for extra in source.extra_states().values()):
            fallback("the source's Transformer Engine _extra_state would be written empty", strict=True)

    def _chunks(self, source: CanonicalSource, options: SaveOptions) -> tuple[list[StoredChunk], list[str], int]:
        """The data chunks in stream order, the ``_extra_state`` entries, and the padded vocab rows."""
        config = target_config(source.config, options)
        rows = target_vocab_rows(config, source.vocab_rows, options.layout)
        shapes = canonical_shapes(config, rows)
        keep = keep_dtype_names(config)
        rules = layer_rules(config)
        chunks = []
        for name, location in tensor_locations(config).items():
            shape = shapes[name]
            dtype = target_dtype(source.meta(name).dtype, options.dtype, name in keep)
            global_shapes = location.key_shapes(shape)
            # megatron-core's SwiGLU factory saves the gate and up halves as separate chunks; a tensor stored as
            # segments (Mamba's in_proj) has one key per segment.
            for start, count in row_runs(rules.get(name), shape):
                starts = (0,) * len(shape) if start is None else (start, *(0,) * (len(shape) - 1))
                lengths = shape if count is None else (count, *shape[1:])
                pieces = location.pieces(starts, lengths)
                for piece in pieces:
                    first, count_of = (start, count) if len(pieces) == 1 else ((start or 0) + piece.row, piece.rows)
                    chunks.append(StoredChunk(name, piece.key, piece.offsets, piece.sizes, global_shapes[piece.key], dtype,
                                         first, count_of))
        _check_one_dtype_per_key(chunks, source)
        return chunks, extra_state_keys(config), rows

    def plan(self, source: CanonicalSource, options: SaveOptions) -> list[PlannedFile]:
        chunks, objects, _ = self._chunks(source, options)
        directory = iteration_dir_name(*self._iteration(source))
        return _files(directory, data_files(chunks, options), objects, options)

    def _args(self, source: CanonicalSource, options: SaveOptions, rows: int) -> Any:
        """The target's Megatron args, as the common state holds them."""
        config = target_config(source.config, options)
        dtype = options.dtype or params_dtype_for((source.meta(name).dtype for name in source.names()), config)
        args = args_for_target(config, options.layout, rows, dtype, self._iteration(source)[0], source.megatron_args)
        args.ckpt_format = SHARDED_BACKEND
        return args

    @staticmethod
    def _iteration(source: CanonicalSource) -> tuple[int, bool]:
        return (source.iteration if source.iteration is not None else 0), source.release

    # Each data file is written on its own (``save(only=...)``); ``finalize`` writes the rest once.
    supports_partial = True

    def save(self, source: CanonicalSource, out_dir: Path, options: SaveOptions,
             progress: Progress, only: Collection[str] | None = None) -> SaveResult:
        """Write every data file (or those of ``only``, relative paths as ``plan`` names them); with every one,
        also what ``finalize`` writes."""
        directory = iteration_dir_name(*self._iteration(source))
        chunks, objects, rows = self._chunks(source, options)
        files = data_files(chunks, options)
        written = write_data_files(out_dir, directory, chunks, files, _empty_extra_states(objects), source, rows,
                                   progress, only)
        planned = _files(directory, files, objects, options, written)
        if only is not None:
            return SaveResult(files=[item for item in planned if item.size is not None])
        return SaveResult(files=planned, notices=self.finalize(source, out_dir, options))

    def finalize(self, source: CanonicalSource, out_dir: Path, options: SaveOptions) -> list[str]:
        """What is written once every data file is, all from the plan: the common state (the args; common.pt, or
        its own data file in the store), ``.metadata`` (every record's file, offset and length), ``metadata.json``,
        the tracker and the carried HF files. ``seal`` writes the integrity manifest after the optimizer state."""
        layout = options.layout
        notices: list[str] = []
        iteration, release = self._iteration(source)
        if source.iteration is None and not release:
            notices.append("the source has no iteration number; writing iteration 0")
        iteration_dir = out_dir / iteration_dir_name(iteration, release)
        iteration_dir.mkdir(parents=True, exist_ok=True)
        chunks, objects, rows = self._chunks(source, options)
        args = self._args(source, options, rows)
        common = {"args": args, "checkpoint_version": CHECKPOINT_VERSION, "iteration": iteration,
                  "content_metadata": dict(CONTENT_METADATA)}
        self._write_index(iteration_dir, chunks, objects, source, rows, options, common)
        # megatron-core writes metadata.json last: a directory without it is an incomplete checkpoint to every reader.
        write_checkpoint_config(iteration_dir, options.torch_dist_common)
        fsync_file(iteration_dir / CHECKPOINT_CONFIG_FILE)
        tracker = out_dir / TRACKER_FILE
        tracker.write_text("release" if release else str(iteration))
        fsync_file(tracker)
        write_carried(source, options, out_dir)
        if any(extra.holds_state() for extra in source.extra_states().values()):
            notices.append("Transformer Engine _extra_state (FP8 scaling metadata) of the source is not "
                           "carried; written empty: FP8 runs re-derive it in their first steps")
        place = "the common_state entry" if options.torch_dist_common == COMMON_IN_STORE else COMMON_FILE
        written = f"torch_dist written with the layout {layout.describe()} recorded in {place}'s args"
        if source.holds_training_state():
            written += (f"; {TRAINING_STATE_NOT_CARRIED}: resume with --no-load-optim --no-load-rng "
                        "(or --finetune)")
        notices.append(written)
        return notices

    @staticmethod
    def _write_index(iteration_dir: Path, chunks: list[StoredChunk], objects: list[str], source: CanonicalSource,
                     rows: int, options: SaveOptions, common: dict[str, object]) -> None:
        """The common state and ``.metadata``: in the store, the common state is its own data file after the
        model's (written here, never by ``save``); else common.pt."""
        files = data_files(chunks, options)
        numbers = file_numbers(files)
        writes: tuple[int, ...] = ()
        entries = _empty_extra_states(objects)
        if options.torch_dist_common == COMMON_IN_STORE:
            entries[COMMON_STATE_KEY] = common_bytes(common)
            writes = (len(files),)
            numbers[(COMMON_STATE_KEY, None)] = len(files)
        else:
            _write_common(iteration_dir / COMMON_FILE, common)
        planner = StreamingPlanner(chunks, entries, source, rows, lambda nbytes: None)
        write_store(iteration_dir, planner, numbers, writes, True, iteration_dir / DCP_METADATA_FILE)

    def seal(self, source: CanonicalSource, out_dir: Path, options: SaveOptions,
             files: list[PlannedFile]) -> None:
        """With ``integrity_manifest`` (the common state in the store), megatron-core's ``integrity.json`` of the
        iteration directory, after every other file of it (the optimizer state's included) is final; digests
        computed while writing are reused."""
        if not _writes_integrity(options):
            return
        directory = iteration_dir_name(*self._iteration(source))
        known = {}
        for item in files:
            if Path(item.relpath).parent.as_posix() != directory or item.digest is None or item.size is None:
                continue
            sha256 = hex_of(item.digest, INTEGRITY_ALGORITHM)
            if sha256 is not None:
                known[Path(item.relpath).name] = (sha256, item.size)
        write_integrity_manifest(out_dir / directory, known)

    def file_digest(self, options: SaveOptions) -> str | None:
        """sha256 with ``integrity_manifest``: ``integrity.json`` records it, and the files are hashed as written."""
        return INTEGRITY_ALGORITHM if _writes_integrity(options) else None

    # The source's optimizer state, as megatron-core's DistributedOptimizer (or plain optimizer) saves it.
    writes_optimizer = True
    optimizer_forms = DST_FORMS
    # an emerging (Muon, Lion) run's plain optimizers in the plain form (optimizer_plain.py), its layer-wise one's too
    optimizer_kinds = ("adam", "muon", "lion", "muon layer-wise", "lion layer-wise")

    def optimizer_form(self, optimizer: OptimizerSource, optimizer_options: OptimizerOptions) -> str:
        return written_form(optimizer, optimizer_options.form)

    def plan_optimizer(self, source: CanonicalSource, optimizer: OptimizerSource, form: str, options: SaveOptions,
                       optimizer_options: OptimizerOptions) -> list[OptimizerFile]:
        chunks, _, rows = self._chunks(source, options)
        directory = iteration_dir_name(*self._iteration(source))
        return planned_records(source, optimizer, form, options, optimizer_options.dp, chunks, rows, directory,
                               self._args(source, options, rows))

    # The records files are written on their own (``save_optimizer(only=...)``), their index and the common state
    # once (``finalize_optimizer``).
    optimizer_partial = True

    def save_optimizer(self, source: CanonicalSource, optimizer: OptimizerSource, form: str, out_dir: Path,
                       options: SaveOptions, optimizer_options: OptimizerOptions,
                       files: list[PlannedFile], only: Collection[str] | None = None) -> CarriedOptimizer:
        """The optimizer records beside the model's in ``form``; the common state and ``.metadata`` updated (with
        ``only``: the records files it names alone)."""
        limit = options.max_shard_size or DEFAULT_MAX_DATA_FILE_SIZE
        if only is None:
            return self._write_optimizer(source, optimizer, form, out_dir, options, optimizer_options, files,
                                         RecordsShare(limit))
        directory = iteration_dir_name(*self._iteration(source))
        names = {relpath.removeprefix(f"{directory}/") for relpath in only if relpath.startswith(f"{directory}/")}
        return self._write_optimizer(source, optimizer, form, out_dir, options, optimizer_options, files,
                                     RecordsShare(limit, names, shared=False))

    def finalize_optimizer(self, source: CanonicalSource, optimizer: OptimizerSource, form: str, out_dir: Path,
                           options: SaveOptions, optimizer_options: OptimizerOptions,
                           files: list[PlannedFile]) -> CarriedOptimizer:
        """The records' index merged into ``.metadata`` (from the plan) and the common state updated, after
        ``finalize``."""
        share = RecordsShare(options.max_shard_size or DEFAULT_MAX_DATA_FILE_SIZE, (), shared=True)
        return self._write_optimizer(source, optimizer, form, out_dir, options, optimizer_options, files, share)

    def _write_optimizer(self, source: CanonicalSource, optimizer: OptimizerSource, form: str, out_dir: Path,
                         options: SaveOptions, optimizer_options: OptimizerOptions, files: list[PlannedFile],
                         share: RecordsShare) -> CarriedOptimizer:
        chunks, _, rows = self._chunks(source, options)
        iteration_dir = out_dir / iteration_dir_name(*self._iteration(source))
        iteration_dir.mkdir(parents=True, exist_ok=True)
        return write_optimizer(source, optimizer, form, iteration_dir, options, optimizer_options.dp, chunks, rows,
                               self._args(source, options, rows), files, share)


def _empty_extra_states(keys: list[str]) -> dict[str, bytes]:
    """The ``_extra_state`` bytes entries, each empty as megatron-core writes a module's with no FP8 state."""
    return {key: empty_extra_state().getvalue() for key in keys}


def _write_common(path: Path, common: dict[str, object]) -> None:
    """``common.pt``, pickled in memory and written by Python: a full disk is then an OSError naming the file,
    not torch's "PytorchStreamWriter failed writing file"."""
    buffer = io.BytesIO()
    torch.save(common, buffer, pickle_module=FRAMEWORK_PICKLE)
    path.write_bytes(buffer.getbuffer())
    fsync_file(path)


def _files(iteration_dir: str, files: list[list[StoredChunk]], objects: list[str], options: SaveOptions,
           written: WrittenFiles | None = None) -> list[PlannedFile]:
    """The files of one iteration; the first data file holds the ``_extra_state`` entries too (each data file's
    digest and size when ``written`` names it). The common state is common.pt, or (``torch_dist_common`` "store")
    a data file of its own after the model's, then the integrity manifest where ``integrity_manifest`` asks."""
    data = planned_data_files(iteration_dir, files, written or {}, len(objects))
    if options.torch_dist_common != COMMON_IN_STORE:
        return [PlannedFile(f"{iteration_dir}/{COMMON_FILE}", 0, 0), *data,
                PlannedFile(f"{iteration_dir}/{DCP_METADATA_FILE}", 0, 0),
                PlannedFile(f"{iteration_dir}/{CHECKPOINT_CONFIG_FILE}", 0, 0)]
    manifest = [PlannedFile(f"{iteration_dir}/{INTEGRITY_FILE}", 0, 0)] if _writes_integrity(options) else []
    return [*data, PlannedFile(f"{iteration_dir}/{data_file_name(len(files))}", 1, 0),
            PlannedFile(f"{iteration_dir}/{DCP_METADATA_FILE}", 0, 0),
            PlannedFile(f"{iteration_dir}/{CHECKPOINT_CONFIG_FILE}", 0, 0), *manifest]


def _writes_integrity(options: SaveOptions) -> bool:
    """Whether the output has megatron-core's ``integrity.json``: asked for, in the form that has one (megatron-core
    0.19's, the common state in the store)."""
    return options.integrity_manifest and options.torch_dist_common == COMMON_IN_STORE


def _check_one_dtype_per_key(chunks: list[StoredChunk], source: CanonicalSource) -> None:
    """A torch_dist key has one dtype, but several canonical tensors may share it (the layers of a
    stacked key): tensors stored in different dtypes cannot be written faithfully."""
    first: dict[str, StoredChunk] = {}
    for chunk in chunks:
        other = first.setdefault(chunk.key, chunk)
        if other.dtype != chunk.dtype:
            raise ValidationError(
                f"{source.describe()}: {other.canonical} is {other.dtype} but {chunk.canonical} is {chunk.dtype}; "
                f"torch_dist stores both in the one key {chunk.key} of a single dtype: convert to another "
                "format, or pass --dtype to cast floating tensors to one dtype")
