"""Saver for Megatron-FSDP checkpoints (``--use-megatron-fsdp --ckpt-format fsdp_dtensor``), registered as
``fsdp_dtensor``: the store Megatron-LM's ``save_checkpoint`` writes for a GPT model (multi-latent attention, MoE and
MTP layers too; its optimizer state: ``optimizer.py``).

The keys and their layout are ``pgconvert/formats/fsdp_dtensor.py``'s (the loader's): every parameter
``model.module.<name>`` at its global shape with global layer indices, a gated ``linear_fc1`` as its gate
(``weight_w``) and up (``weight_v``) halves, no ``_extra_state``. Megatron-FSDP stores the optimizer's fp32 main
weights as the model, so every floating tensor is written as float32 whatever the source's dtype; ``--dtype``
(else the source run's) is the training precision the args record (``bf16``/``fp16``/``params_dtype``).

One chunk per key, written by a single process: the store is global, torch.distributed.checkpoint reshards
it on load (each rank reads the boxes its DTensor shards hold), so the data-parallel size the run resumes with is
its own choice; the args record the TP size and its layout. The bytes entries ``args``, ``iteration`` and
``checkpoint_version`` (``torch.save`` of each object, as ``dcp.save`` stores a non-tensor) go to a data file of
their own after the model's, written by ``finalize`` with ``.metadata`` (which also records the keys' flattened
paths, ``planner_data``, as Megatron-LM's save does) and the tracker ``latest_checkpointed_iteration.txt``.
The data files are planned and streamed by the DCP store writer the torch_dist saver uses
(``pgconvert/formats/dcp_save.py``): ``save(only=...)`` writes some of them (``--workers``, sharded runs).
"""

from __future__ import annotations

import io
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pgconvert.errors import LayoutError, ValidationError
from pgconvert.formats import (TRAINING_STATE_NOT_CARRIED, CarriedOptimizer, OptimizerFile, OptimizerOptions,
                               PlannedFile, Progress, SaveOptions, Saver, SaveResult, target_config)
from pgconvert.formats.dcp_save import (StateReader, StoredChunk, StreamingPlanner, data_file_name, data_files,
                                        file_numbers, planned_data_files, write_data_files, write_store)
from pgconvert.formats.fsdp_dtensor import (ARGS_KEY, FSDP_DTENSOR_FORM, ITERATION_KEY, MODEL_PREFIX, NO_PIPELINE,
                                            refuse_unknown_keys, tensor_locations)
from pgconvert.formats.hf_side import carried_for_target, write_carried
from pgconvert.formats.megatron import (CHECKPOINT_VERSION, FRAMEWORK_PICKLE, TRACKER_FILE, args_for_target,
                                        iteration_dir_name, params_dtype_for)
from pgconvert.formats.stream import CanonicalSource
from pgconvert.formats.strict import fallback
from pgconvert.io.dcp_writer import ItemKey, WrittenFiles
from pgconvert.formats.dcp_layout import DCP_METADATA_FILE
from pgconvert.io.durable import fsync_file
from pgconvert.io.sizes import dtype_name
from pgconvert.model.provider import canonical_shapes, target_vocab_rows
from pgconvert.optimizer.data_parallel import with_dst_dp
from pgconvert.optimizer.source import OptimizerSource
from pgconvert.savers.fsdp_dtensor.optimizer import (optimizer_entries, run_wrappers, state_chunks, state_paths,
                                                    state_reader)

CHECKPOINT_VERSION_KEY = "checkpoint_version"
# The bytes entries written, in this order, to the data file after the model's.
WRITTEN_ENTRIES = (ARGS_KEY, ITERATION_KEY, CHECKPOINT_VERSION_KEY)
# What Megatron-FSDP stores the model's floating tensors in: the optimizer's main weights.
MAIN_WEIGHTS_DTYPE = torch.float32


class FsdpDtensorSaver(Saver):
    name = "fsdp_dtensor"
    stored_float_dtype = MAIN_WEIGHTS_DTYPE

    def validate(self, source: CanonicalSource, options: SaveOptions) -> None:
        config = target_config(source.config, options)
        refuse_unknown_keys(config, "--dst-format fsdp_dtensor", "written")
        layout = options.layout
        if layout.pp > 1 or layout.vpp:
            raise LayoutError(f"--dst-format fsdp_dtensor: layout {layout.describe()}: pgconvert writes Megatron-FSDP "
                              "checkpoints of tensor- and expert-parallel runs (pp=1, no virtual stages): "
                              f"{NO_PIPELINE}")
        layout.validate(config, "dst")
        target_vocab_rows(config, source.vocab_rows, layout)
        carried_for_target(source, options)
        if options.max_shard_size is not None and options.max_shard_size < 1:
            raise ValidationError(f"max_shard_size={options.max_shard_size}: must be a positive byte count")
        if options.strict and any(extra.holds_state() for extra in source.extra_states().values()):
            fallback("the source's Transformer Engine _extra_state would be dropped (fsdp_dtensor stores none)",
                     strict=True)

    def _chunks(self, source: CanonicalSource, options: SaveOptions) -> tuple[list[StoredChunk], int]:
        """One chunk per key at its global shape, in stream order (a gated fc1's halves consecutive), and the
        padded vocab rows."""
        config = target_config(source.config, options)
        rows = target_vocab_rows(config, source.vocab_rows, options.layout)
        shapes = canonical_shapes(config, rows)
        chunks = []
        for name, location in tensor_locations(config, rows).items():
            shape = shapes[name]
            stored = source.meta(name).dtype
            dtype = MAIN_WEIGHTS_DTYPE if stored.is_floating_point else stored
            whole = len(location.keys) == 1
            for key, first, count in location.parts(shape[0]):
                sizes = shape if whole else (count, *shape[1:])
                chunks.append(StoredChunk(name, key, (0,) * len(shape), sizes, sizes, dtype,
                                          None if whole else first, None if whole else count))
        return chunks, rows

    @staticmethod
    def _iteration(source: CanonicalSource) -> tuple[int, bool]:
        return (source.iteration if source.iteration is not None else 0), source.release

    def plan(self, source: CanonicalSource, options: SaveOptions) -> list[PlannedFile]:
        chunks, _ = self._chunks(source, options)
        return _files(iteration_dir_name(*self._iteration(source)), data_files(chunks, options))

    supports_partial = True

    def save(self, source: CanonicalSource, out_dir: Path, options: SaveOptions,
             progress: Progress, only: Collection[str] | None = None) -> SaveResult:
        """Write every model data file (or those of ``only``); with every one, also what ``finalize`` writes."""
        directory = iteration_dir_name(*self._iteration(source))
        chunks, rows = self._chunks(source, options)
        files = data_files(chunks, options)
        written = write_data_files(out_dir, directory, chunks, files, {}, source, rows, progress, only)
        planned = _files(directory, files, written)
        if only is not None:
            return SaveResult(files=[item for item in planned if item.size is not None])
        return SaveResult(files=planned, notices=self.finalize(source, out_dir, options))

    def finalize(self, source: CanonicalSource, out_dir: Path, options: SaveOptions) -> list[str]:
        """The bytes entries' data file, ``.metadata`` (from the plan), the tracker and the carried HF files."""
        iteration, release = self._iteration(source)
        store = self._store(source, options)
        self._write(source, out_dir, store, (store.entries_file,), True)
        tracker = out_dir / TRACKER_FILE
        tracker.write_text("release" if release else str(iteration))
        fsync_file(tracker)
        write_carried(source, options, out_dir)
        return self._notices(source, options)

    def _store(self, source: CanonicalSource, options: SaveOptions, optimizer: OptimizerSource | None = None,
               dst_dp: int | None = None) -> _Store:
        """Every chunk and bytes entry of the store (with ``optimizer``: its state too) and their paths; ``dst_dp``
        (``--dst-dp``): the data-parallel size the args record (the store itself is the same at any)."""
        chunks, rows = self._chunks(source, options)
        files = data_files(chunks, options)
        args = self._args(source, options, rows)
        if dst_dp is not None:
            args = with_dst_dp(args, options.layout, dst_dp)
        values = (args, self._iteration(source)[0], CHECKPOINT_VERSION)
        entries = {key: _object_bytes(value) for key, value in zip(WRITTEN_ENTRIES, values, strict=True)}
        paths = _planner_data(chunks, entries)
        if optimizer is None:
            return _Store(chunks, files, [], entries, paths, rows, None)
        config = target_config(source.config, options)
        wrappers = run_wrappers(self._run_dtype(source, options))
        state = state_chunks(optimizer, chunks, wrappers)
        added, added_paths = optimizer_entries(optimizer, config, options.layout, rows, wrappers, _object_bytes)
        return _Store(chunks + state, files, data_files(state, options), {**entries, **added},
                      {**paths, **state_paths(state), **added_paths}, rows, state_reader(optimizer, rows))

    def _write(self, source: CanonicalSource, out_dir: Path, store: _Store, writes: Collection[int],
               index: bool) -> WrittenFiles:
        """The store's data files numbered ``writes`` (the others' offsets planned) and, with ``index``,
        ``.metadata``; returns the files written."""
        iteration_dir = out_dir / iteration_dir_name(*self._iteration(source))
        iteration_dir.mkdir(parents=True, exist_ok=True)
        planner = StreamingPlanner(store.chunks, store.entries, source, store.rows, lambda nbytes: None, store.paths,
                                   store.state)
        first = iteration_dir / (data_file_name(min(writes)) if writes else DCP_METADATA_FILE)
        return write_store(iteration_dir, planner, store.numbers(), writes, index, first).written

    # Megatron-FSDP's optimizer state (``optimizer.py``); the model entries are then the optimizer's fp32 masters.
    writes_optimizer = True
    stores_masters = True

    def optimizer_refusal(self, source: CanonicalSource, options: SaveOptions,
                          optimizer_options: OptimizerOptions) -> str | None:
        if self._run_dtype(source, options) == torch.float16:
            return ("optimizer state not carried: fsdp_dtensor holds no grad scaler, so an fp16 run's state (its loss "
                    "scale and trackers) cannot be written; pass --skip-optimizer, or --dtype bf16")
        return None

    def optimizer_form(self, optimizer: OptimizerSource, optimizer_options: OptimizerOptions) -> str:
        return FSDP_DTENSOR_FORM

    def plan_optimizer(self, source: CanonicalSource, optimizer: OptimizerSource, form: str, options: SaveOptions,
                       optimizer_options: OptimizerOptions) -> list[OptimizerFile]:
        store = self._store(source, options, optimizer)
        directory = iteration_dir_name(*self._iteration(source))
        what = (f"optimizer state ({optimizer.form}, {form}; param groups and scheduler added to the bytes entries' "
                "file and .metadata)")
        return [OptimizerFile(f"{directory}/{data_file_name(number)}", what, len(chunks),
                              sum(chunk.nbytes for chunk in chunks))
                for number, chunks in zip(store.state_numbers, store.state_files)]

    # The state's data files are written on their own (``save_optimizer(only=...)``), the bytes entries' file and
    # ``.metadata`` once (``finalize_optimizer``).
    optimizer_partial = True

    def save_optimizer(self, source: CanonicalSource, optimizer: OptimizerSource, form: str, out_dir: Path,
                       options: SaveOptions, optimizer_options: OptimizerOptions,
                       files: list[PlannedFile], only: Collection[str] | None = None) -> CarriedOptimizer:
        """The state's data files (those ``only`` names; None: all, and then what ``finalize_optimizer`` writes)."""
        store = self._store(source, options, optimizer, optimizer_options.dp)
        directory = iteration_dir_name(*self._iteration(source))
        writes = [number for number in store.state_numbers
                  if only is None or f"{directory}/{data_file_name(number)}" in only]
        if only is None:
            writes.append(store.entries_file)
        written = self._write(source, out_dir, store, writes, only is None)
        added = [PlannedFile(f"{directory}/{data_file_name(number)}", len(chunks),
                             sum(chunk.nbytes for chunk in chunks), *written[data_file_name(number)])
                 for number, chunks in zip(store.state_numbers, store.state_files)
                 if data_file_name(number) in written]
        kept = _rewritten(files, directory, store) if only is None else files
        return CarriedOptimizer(kept + added, f"{optimizer.form}, {form}")

    def finalize_optimizer(self, source: CanonicalSource, optimizer: OptimizerSource, form: str, out_dir: Path,
                           options: SaveOptions, optimizer_options: OptimizerOptions,
                           files: list[PlannedFile]) -> CarriedOptimizer:
        """The bytes entries' file with the optimizer's entries, and ``.metadata`` with every record (from the plan)."""
        store = self._store(source, options, optimizer, optimizer_options.dp)
        self._write(source, out_dir, store, (store.entries_file,), True)
        return CarriedOptimizer(_rewritten(files, iteration_dir_name(*self._iteration(source)), store),
                                f"{optimizer.form}, {form}")

    def _args(self, source: CanonicalSource, options: SaveOptions, rows: int) -> Any:
        """The target's Megatron args: the layout, and the run's precision (``--dtype``, else the source run's)."""
        config = target_config(source.config, options)
        args = args_for_target(config, options.layout, rows, self._run_dtype(source, options),
                               self._iteration(source)[0], source.megatron_args)
        args.ckpt_format = FSDP_DTENSOR_FORM
        args.use_megatron_fsdp = True
        args.use_dist_ckpt = True
        return args

    @staticmethod
    def _run_dtype(source: CanonicalSource, options: SaveOptions) -> torch.dtype:
        """The precision the run trains in: ``--dtype``; else the source run's args' (an fsdp_dtensor or
        distributed-optimizer source stores fp32 masters of a bf16 run); else the source's tensors'."""
        if options.dtype is not None:
            return options.dtype
        base = source.megatron_args
        if base is not None and (getattr(base, "bf16", False) or getattr(base, "fp16", False)):
            return torch.bfloat16 if getattr(base, "bf16", False) else torch.float16
        return params_dtype_for((source.meta(name).dtype for name in source.names()), source.config)

    def _notices(self, source: CanonicalSource, options: SaveOptions) -> list[str]:
        notices = []
        if source.iteration is None and not source.release:
            notices.append("the source has no iteration number; writing iteration 0")
        masters = source.masters if source.masters is not None else ()
        narrower = sorted({dtype_name(source.meta(name).dtype) for name in source.names()
                           if source.meta(name).dtype.is_floating_point and name not in masters
                           and source.meta(name).dtype.itemsize < MAIN_WEIGHTS_DTYPE.itemsize})
        if narrower:
            notices.append(f"fsdp_dtensor stores fp32 main weights: the source's {', '.join(narrower)} values are "
                           "written widened to float32, not the fp32 masters of the run that trained them")
        if any(extra.holds_state() for extra in source.extra_states().values()):
            notices.append("Transformer Engine _extra_state (FP8 scaling metadata) of the source is not carried: "
                           "Megatron-FSDP checkpoints store none; FP8 runs re-derive it in their first steps")
        config = target_config(source.config, options)
        if config.mtp_num_layers:
            notices.append("MTP layers: the model and state keys name the inner layer transformer_layer (as "
                           "Megatron-LM's save renames it); param_to_group_meta, when the optimizer state is written, "
                           f"names it {config.mtp_layer_module!r}, the module a Megatron-LM load looks parameters "
                           "up by (mtp_model_layer in Megatron-LM d98e8a64, transformer_layer before: "
                           "--dst-mtp-layer-name)")
        written = (f"fsdp_dtensor written with the layout {options.layout.describe()} recorded in its args "
                   "(any data-parallel size may load it: the store is global)")
        if source.holds_training_state():
            written += f"; {TRAINING_STATE_NOT_CARRIED}: resume with --no-load-optim --no-load-rng (or --finetune)"
        notices.append(written)
        return notices


@dataclass(frozen=True)
class _Store:
    """What one store holds: the chunks (the model's, then the optimizer state's), the model's data files, the
    optimizer state's (numbered after the bytes entries' file), the bytes entries, each key's path in Megatron-LM's
    nested state dict, the padded vocab rows, and where the optimizer state's chunks are read from."""

    chunks: list[StoredChunk]
    files: list[list[StoredChunk]]
    state_files: list[list[StoredChunk]]
    entries: dict[str, bytes]
    paths: dict[str, tuple[str, ...]]
    rows: int
    state: StateReader | None

    @property
    def entries_file(self) -> int:
        return len(self.files)

    @property
    def state_numbers(self) -> list[int]:
        return [self.entries_file + 1 + number for number in range(len(self.state_files))]

    def numbers(self) -> dict[ItemKey, int]:
        numbers = file_numbers(self.files)
        numbers.update({(key, None): self.entries_file for key in self.entries})
        numbers.update({key: self.entries_file + 1 + number for key, number in file_numbers(self.state_files).items()})
        return numbers


def _rewritten(files: list[PlannedFile], directory: str, store: _Store) -> list[PlannedFile]:
    """The model saver's files with the bytes entries' file and ``.metadata`` as written again (no digest: the
    manifest computes it)."""
    again = {f"{directory}/{data_file_name(store.entries_file)}": len(store.entries),
             f"{directory}/{DCP_METADATA_FILE}": 0}
    return [PlannedFile(item.relpath, again[item.relpath], item.nbytes) if item.relpath in again else item
            for item in files]


def _object_bytes(value: object) -> bytes:
    """A bytes entry as ``dcp.save`` stores a non-tensor value: its ``torch.save`` (Megatron's own classes for
    the args' framework enums)."""
    buffer = io.BytesIO()
    torch.save(value, buffer, pickle_module=FRAMEWORK_PICKLE)
    return bytes(buffer.getbuffer())


def _planner_data(chunks: list[StoredChunk], entries: dict[str, bytes]) -> dict[str, tuple[str, ...]]:
    """Each key's path in Megatron-LM's nested state dict (``model`` -> ``module.<name>``), as the flattening
    ``dcp.save`` records it."""
    paths: dict[str, tuple[str, ...]] = {key: (key,) for key in entries}
    model = MODEL_PREFIX.partition(".")[0]
    paths.update({chunk.key: (model, chunk.key.removeprefix(f"{model}.")) for chunk in chunks})
    return paths


def _files(iteration_dir: str, files: list[list[StoredChunk]],
           written: WrittenFiles | None = None) -> list[PlannedFile]:
    """The model's data files (each one's digest and size when ``written`` names it), the bytes entries' file
    after them, and ``.metadata``."""
    return [*planned_data_files(iteration_dir, files, written or {}),
            PlannedFile(f"{iteration_dir}/{data_file_name(len(files))}", len(WRITTEN_ENTRIES), 0),
            PlannedFile(f"{iteration_dir}/{DCP_METADATA_FILE}", 0, 0)]
