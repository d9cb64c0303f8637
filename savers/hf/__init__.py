"""Saver for Hugging Face safetensors checkpoints, loadable with transformers' ``from_pretrained``.

Shards are written one at a time (or ``--threads`` at a time, each thread with its own tensor), each
bounded by ``max_shard_size``; the parts of one canonical
tensor (q/k/v, gate/up) always land in the same shard, so every source tensor is read once. Each
shard is streamed: its header is computed from shapes and dtypes known in advance, then tensors
are written as they are produced, so only one canonical tensor is in memory, not a whole shard.
Which tensors go to which shard, and where, follows from the source's metadata alone, so each shard file
can be written by another process (``--workers``, sharded runs); ``finalize`` writes the index,
config.json and side files once every shard is.
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Callable, Collection
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from types import TracebackType
from typing import Any

import torch

from pgconvert.io import sizes
from pgconvert.io.durable import fsync_file as _fsync
from pgconvert.errors import CheckpointError, ConfigError, LayoutError, PgconvertError
from pgconvert.families.table import Family, TensorMapping
from pgconvert.formats import PlannedFile, Progress, SaveOptions, Saver, SaveResult, target_dtype
from pgconvert.io.output import RECORDS_IN_FLIGHT, OutputFile
from pgconvert.io.reuse import RecordsInFlight
from pgconvert.io.threads import run_each
from pgconvert.formats.hf import (
    CONFIG_FILE,
    DEFAULT_MAX_SHARD_SIZE,
    INDEX_FILE,
    SAFETENSORS_DTYPES,
    SINGLE_FILE,
    HFOrigin,
    config_disagreements,
    hf_config_from_model,
    hf_losses,
    hf_training_notes,
    infer_family,
    read_json_object,
    require_family_fits,
    shard_file_name,
    with_dtype,
)
from pgconvert.model.config import ModelConfig
from pgconvert.formats.hf_side import (
    GENERATION_CONFIG_FILE,
    TOKENIZER_FILES,
    carried_config,
    copy_side_files,
    target_side_files,
)
from pgconvert.model.layout import ParallelLayout
from pgconvert.semantics import lose
from pgconvert.families import mtp
from pgconvert.model.provider import (VOCAB_TABLES, WORD_EMBEDDINGS, TensorKind, keep_dtype_names, layer_kinds,
                                norm_weight_names)
from pgconvert.formats.hf_quantized import KeepQuantizedError, without_quantization
from pgconvert.formats.stream import CanonicalSource, TensorMeta
from pgconvert.formats.strict import fallback

log = logging.getLogger(__name__)



@dataclass(frozen=True)
class _Unit:
    """One canonical tensor and the HF tensors it becomes (their shapes and dtype as written)."""

    canonical: str
    row: TensorMapping
    hf_names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    dtype: torch.dtype
    # HF tensors written as their stored quantized parts (--keep-fp8), by HF name.
    kept: dict[str, tuple[tuple[str, TensorMeta], ...]] = field(default_factory=dict)
    # (expert index, experts) for a slice of stacked HF tensors (TensorMapping.stacked)
    stack: tuple[int, int] | None = None

    @property
    def nbytes(self) -> int:
        """Bytes this unit adds to its shard (a stacked row's slice; kept parts as stored)."""
        if self.kept:
            return sum(meta.nbytes for _, meta, _ in self.entries())
        return sum(sizes.nbytes(shape, self.dtype) for shape in self.shapes)

    @property
    def closes_stack(self) -> bool:
        """Whether the unit's HF tensors are complete once it is written (always, unless stacked)."""
        return self.stack is None or self.stack[0] == self.stack[1] - 1

    def entries(self) -> list[tuple[str, TensorMeta, str]]:
        """What the unit completes: (tensor name, shape and dtype, the HF tensor it is or is part of);
        a stacked tensor's with its last expert, kept quantized ones as their stored parts (--keep-fp8)."""
        if not self.closes_stack:
            return []
        lead = (self.stack[1],) if self.stack is not None else ()
        written = []
        for hf_name, shape in zip(self.hf_names, self.shapes, strict=True):
            parts = self.kept.get(hf_name, ((hf_name, TensorMeta((*lead, *shape), self.dtype)),))
            written += [(name, meta, hf_name) for name, meta in parts]
        return written


@dataclass
class _Shard:
    units: list[_Unit] = field(default_factory=list)
    nbytes: int = 0

    @property
    def tensors(self) -> int:
        return sum(len(unit.entries()) for unit in self.units)


def _rotary_order(config: ModelConfig) -> torch.Tensor:
    """Within one head: the rotated dims' even then odd indices, then the unrotated ones."""
    head, rotated = config.attention.head_dim, int(config.attention.head_dim * config.positions.rotary_percent)
    return torch.cat([torch.arange(0, rotated, 2), torch.arange(1, rotated, 2), torch.arange(rotated, head)])


def rotate_half_order(rotary: str | None, full: torch.Tensor, config: ModelConfig) -> torch.Tensor:
    """Megatron's interleaved rotary (``--rotary-interleaved``) rotates the dim pairs (2i, 2i+1) of a
    head; HF's rotate-half rotates (i, i + d/2) at the same frequency. Ordering each query and key
    head's rows (and their q/k-norm weights) evens first, then odds, gives the same attention.
    ``rotary`` is the tensor kind's (``provider.TensorKind.rotary``)."""
    order = _rotary_order(config)
    if rotary == "head":
        # Per head, or (qk_layernorm_across_heads) each head's slice of the whole projection's norm.
        return full.view(-1, order.numel()).index_select(1, order).reshape(full.shape)
    if rotary != "qkv":
        return full
    head, per_group = config.attention.head_dim, config.attention.num_attention_heads // config.attention.query_groups
    gates = per_group if config.attention.attention_output_gate else 0
    index = torch.arange(full.shape[0])
    for group in range(config.attention.query_groups):
        # A group's rows: its query heads, their gate heads (kept) with the output gate, one key head
        # (rotated, as the query heads), one value head (kept).
        for position in (*range(per_group), per_group + gates):
            start = (group * (per_group + gates + 2) + position) * head
            index[start:start + head] = start + order
    return full.index_select(0, index)


@dataclass(frozen=True)
class _HFKinds:
    """What the provider says of the model's tensors that changes how HF stores them."""

    layers: dict[str, TensorKind]
    norm_weights: set[str]
    # The family's HF rotary is already interleaved (GLM-4) / its norms already compute 1 + w (Gemma).
    hf_rotary_interleaved: bool = False
    hf_norms_zero_centred: bool = False


def _as_hf(name: str, full: torch.Tensor, config: ModelConfig, kinds: _HFKinds) -> torch.Tensor:
    """A canonical tensor as HF computes with it: the true vocab rows, rotate-half rotary order,
    and plain gamma (megatron-core's norms compute with 1 + gamma under --apply-layernorm-1p)."""
    assert config.vocab_size is not None
    if name in VOCAB_TABLES:
        # Megatron's padding rows are not part of the model.
        full = full.narrow(0, 0, config.vocab_size)
    if config.positions.rotary_interleaved and not kinds.hf_rotary_interleaved:
        kind = kinds.layers.get(name)
        full = rotate_half_order(kind.rotary if kind is not None else None, full, config)
    if config.norms.layernorm_zero_centered_gamma and not kinds.hf_norms_zero_centred and name in kinds.norm_weights:
        full = full.to(torch.float32) + 1.0
    return full


def _origin(source: CanonicalSource) -> HFOrigin | None:
    return source.hf_origin


def _out_dtype(dtype: torch.dtype, options: SaveOptions) -> torch.dtype:
    return target_dtype(dtype, options.dtype)


_SAFETENSORS_NAMES: dict[torch.dtype, str] = {dtype: name for name, dtype in SAFETENSORS_DTYPES.items()}


class _SafetensorsWriter:
    """One safetensors file written tensor by tensor, in the order its header lists them.

    The format is an 8-byte little-endian header length, a JSON header (name -> dtype, shape,
    ``data_offsets`` into the data that follows; padded with spaces to 8 bytes as safetensors does),
    then the raw little-endian bytes of every tensor, back to back.
    """

    def __init__(self, path: Path, entries: list[tuple[str, torch.dtype, tuple[int, ...]]]) -> None:
        if sys.byteorder != "little":
            raise PgconvertError("safetensors files are little-endian; this big-endian host cannot write them")
        header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
        offset = 0
        for name, dtype, shape in entries:
            nbytes = sizes.nbytes(shape, dtype)
            header[name] = {"dtype": _SAFETENSORS_NAMES[dtype], "shape": list(shape),
                            "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
        encoded = json.dumps(header, separators=(",", ":")).encode("utf-8")
        encoded += b" " * (-len(encoded) % 8)
        self.path = path
        self.nbytes = offset
        self.digest: str | None = None
        self.size: int | None = None
        self._pending = list(entries)
        # Hashed as it is written (``OutputFile``), so the manifest need not read it back.
        self._handle = OutputFile(path)
        self._handle.write(len(encoded).to_bytes(8, "little"))
        self._handle.write(encoded)

    @property
    def offset(self) -> int:
        """Where the next tensor's bytes go in the file."""
        return self._handle.offset

    def write(self, name: str, tensor: torch.Tensor) -> list[Future[None]]:
        """Write the next tensor, from its own memory where it can (``OutputFile.write_in_place``): the futures to
        wait for before that memory is changed."""
        return self.write_runs(name, [tensor], tuple(tensor.shape))

    def write_runs(self, name: str, runs: list[torch.Tensor], shape: tuple[int, ...]) -> list[Future[None]]:
        """Write the next tensor, of ``shape``, given as runs of its elements in row-major order (``write``)."""
        expected_name, dtype, expected_shape = self._pending.pop(0)
        dtypes = {run.dtype for run in runs}
        given = dtypes.pop() if len(dtypes) == 1 else dtypes
        if ((name, given, shape) != (expected_name, dtype, expected_shape)
                or sum(run.numel() for run in runs) != sizes.numel(shape)):
            raise CheckpointError(
                f"{self.path}: the source gave {name} as {given} {list(shape)}, its metadata said "
                f"{expected_name} {dtype} {list(expected_shape)}"
            )
        writing: list[Future[None]] = []
        for run in runs:
            if run.numel():
                flat = run.detach().contiguous().reshape(-1).view(torch.uint8)
                writing += self._handle.write_in_place(flat.numpy().data)
        return writing

    def __enter__(self) -> _SafetensorsWriter:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        if kind is None and self._pending:
            self._handle.__exit__(AssertionError, None, None)
            raise AssertionError(f"{self.path}: never written: {[entry[0] for entry in self._pending]}")
        self._handle.__exit__(kind, error, trace)
        if kind is None:
            self.digest, self.size = self._handle.hexdigest(), self._handle.offset




def _write_shard(path: Path, shard: _Shard, source: CanonicalSource, kinds: _HFKinds,
                 progress: Progress) -> PlannedFile:
    """One shard file, its records (a unit's HF tensors, or each stored part a unit keeps) produced in turn into
    blocks of reused memory, each written from its own memory while the next is produced (``RECORDS_IN_FLIGHT``
    at most still being written); runs on a ``--threads`` thread (a stacked tensor is never split between
    shards, so its pieces stay in this task)."""
    entries = _shard_entries(shard)
    stacks: dict[str, list[torch.Tensor]] = {}
    records = RecordsInFlight(RECORDS_IN_FLIGHT)
    with _SafetensorsWriter(path, entries) as writer:
        for unit in shard.units:
            for nbytes, write in _records(writer, unit, source, kinds, stacks):
                with records.lending(nbytes, phase=writer.offset):
                    written = write()
                records.add(written)
    progress(writer.nbytes)
    return PlannedFile(path.name, len(entries), writer.nbytes, digest=writer.digest, size=writer.size)


def _records(writer: _SafetensorsWriter, unit: _Unit, source: CanonicalSource, kinds: _HFKinds,
             stacks: dict[str, list[torch.Tensor]]) -> list[tuple[int, Callable[[], list[Future[None]]]]]:
    """A unit's records, each with the bytes of the tensor it produces first: each stored part of a unit kept
    whole (--keep-fp8), else the unit's canonical tensor as its HF tensors (``_write_unit``)."""
    if not unit.kept.keys() >= set(unit.hf_names):
        return [(source.meta(unit.canonical).nbytes, partial(_write_unit, writer, unit, source, kinds, stacks))]
    return [(meta.nbytes, partial(_write_kept, writer, source, part))
            for hf_name in unit.hf_names for part, meta in unit.kept[hf_name]]


def _write_kept(writer: _SafetensorsWriter, source: CanonicalSource, part: str) -> list[Future[None]]:
    """A stored part of a quantized tensor written as it is (--keep-fp8)."""
    quantized = source.hf_origin.quantized if source.hf_origin is not None else None
    assert quantized is not None
    return writer.write(part, source.checked_stored(part, quantized.read_stored(part)))


def _write_unit(writer: _SafetensorsWriter, unit: _Unit, source: CanonicalSource, kinds: _HFKinds,
                stacks: dict[str, list[torch.Tensor]]) -> list[Future[None]]:
    """One canonical tensor as its HF tensors: kept quantized ones as their stored parts (--keep-fp8), a
    stacked row's slice held in ``stacks`` until its last expert writes the whole. The futures of the writes
    still reading the unit's memory."""
    config = source.config
    full = _as_hf(unit.canonical, source.load(unit.canonical), config, kinds)
    if unit.stack is None and not unit.kept and full.dtype == unit.dtype:
        return _write_runs(writer, unit, unit.row.transform.split_runs(full, config))
    pieces = list(unit.row.transform.split(full, config))
    del full
    writing: list[Future[None]] = []
    for hf_name, piece in zip(unit.hf_names, pieces, strict=True):
        if hf_name in unit.kept:
            for part, _ in unit.kept[hf_name]:
                writing += _write_kept(writer, source, part)
            continue
        if unit.stack is None:
            writing += writer.write(hf_name, piece.to(unit.dtype))
            continue
        stacks.setdefault(hf_name, []).append(piece.to(unit.dtype))
        if unit.closes_stack:
            writing += writer.write(hf_name, torch.stack(stacks.pop(hf_name)))
    return writing


def _write_runs(writer: _SafetensorsWriter, unit: _Unit, parts: list[list[torch.Tensor]]) -> list[Future[None]]:
    """A unit's HF tensors, each written from the runs of the canonical tensor it is made of (no part made apart)."""
    writing: list[Future[None]] = []
    for (name, meta, _), runs in zip(unit.entries(), parts, strict=True):
        writing += writer.write_runs(name, runs, tuple(runs[0].shape) if len(runs) == 1 else meta.shape)
    return writing


def _shard_entries(shard: _Shard) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    """A shard file's tensors in file order: (name, dtype, shape), as its header lists them."""
    return [(name, meta.dtype, meta.shape) for unit in shard.units for name, meta, _ in unit.entries()]


def _write_json(path: Path, doc: dict[str, Any]) -> None:
    path.write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    _fsync(path)


def kept_quantized(source: CanonicalSource, hf_names: tuple[str, ...]) -> dict[str, tuple[tuple[str, TensorMeta], ...]]:
    """The HF tensors of ``hf_names`` that --keep-fp8 writes as their stored quantized parts."""
    quantized = source.hf_origin.quantized if source.hf_origin is not None else None
    if quantized is None:
        return {}
    return {name: quantized.stored_parts(name) for name in hf_names if name in quantized}


def kept_once(units: list[_Unit]) -> list[_Unit]:
    """An HF tensor that several canonical tensors make up (one stacked tensor of many experts)
    has its stored parts written once, with the last of them; the others write nothing for it."""
    last = {name: index for index, unit in enumerate(units) for name in unit.kept}
    return [
        replace(unit, kept={name: parts if last[name] == index else () for name, parts in unit.kept.items()})
        if unit.kept else unit
        for index, unit in enumerate(units)
    ]


def check_all_kept(source: CanonicalSource, units: list[_Unit]) -> None:
    """--keep-fp8 must find every quantized tensor under the same HF name in the target."""
    quantized = source.hf_origin.quantized if source.hf_origin is not None else None
    if quantized is None:
        return
    lost = sorted(set(quantized.entries) - {name for unit in units for name in unit.kept})
    if lost:
        raise KeepQuantizedError(
            f"--keep-fp8: the hf target does not write {lost[0]} (and {len(lost) - 1} more) under its source "
            "name, so its quantized parts cannot be kept; convert without --keep-fp8 to dequantize them")


def _quantization_config(doc: dict[str, Any], source: CanonicalSource, notices: list[str]) -> dict[str, Any]:
    """config.json keeps quantization_config only when the quantized tensors are kept."""
    if source.hf_origin is not None and source.hf_origin.quantized is not None:
        return doc
    updated, notice = without_quantization(doc, CONFIG_FILE)
    if notice is not None:
        notices.append(notice)
    return updated


class HFSaver(Saver):
    name = "hf"
    keeps_quantized = True
    # One unsharded model: the destination never takes a parallel layout.
    parallel = False
    records_in_flight = RECORDS_IN_FLIGHT

    def validate(self, source: CanonicalSource, options: SaveOptions) -> None:
        layout = options.layout
        if layout.describe() != ParallelLayout().describe():
            raise LayoutError(
                f"dst layout {layout.describe()}: the hf format holds one unsharded model; pass --dst-tp 1 "
                "--dst-pp 1 (and --dst-ep 1 for experts): by default the source's layout is kept"
            )
        if source.config.vocab_size is None:
            raise ConfigError(
                f"hf: the source's true vocab size is unknown (its vocab tables have {source.vocab_rows} "
                "padded rows); pass --true-vocab-size so the padding can be stripped"
            )
        if source.vocab_rows < source.config.vocab_size:
            raise ConfigError(
                f"--true-vocab-size {source.config.vocab_size}: larger than the source's "
                f"{source.vocab_rows} vocab rows"
            )
        if options.max_shard_size is not None and options.max_shard_size < 1:
            raise ConfigError(f"max_shard_size={options.max_shard_size}: must be a positive byte count")
        family, _, guesses = self._target(source, options)
        if options.strict and guesses:
            # Refused before anything is written; without --strict, save reports them.
            fallback(guesses[0], strict=True)
        check_all_kept(source, self._units(source, options))
        target_side_files(source.side_files, options)
        self._note_semantic_losses(source, options, family)

    @staticmethod
    def _note_semantic_losses(source: CanonicalSource, options: SaveOptions, family: Family) -> None:
        """Settings the family cannot express: a notice each, refused under --strict (before writing).
        An HF source's own config.json, kept, already expresses everything its model computes."""
        if _origin(source) is not None:
            return
        for message in hf_losses(family.architecture, source.config):
            lose(message, options.strict, source.notices)
        source.notices.extend(hf_training_notes(family.architecture, source.config))
        dtype = _out_dtype(source.meta(WORD_EMBEDDINGS).dtype, options)
        if (source.config.norms.layernorm_zero_centered_gamma and not family.hf_norms_zero_centred
                and dtype not in (torch.float32, torch.float64)):
            lose(f"layernorm_zero_centered_gamma=True: the norm weights are written as 1 + gamma, rounded to {dtype}",
                 options.strict, source.notices)

    def _target(self, source: CanonicalSource,
                options: SaveOptions) -> tuple[Family, dict[str, Any] | None, list[str]]:
        """The family to write, the config.json to start from (None: build it from the model) and
        the guesses made choosing them."""
        config = source.config
        origin = _origin(source)
        carried = source.side_files.get(CONFIG_FILE) if source.side_files is not None else None
        if options.hf_config is not None:
            doc = read_json_object(options.hf_config, error=ConfigError)
            family, differences = config_disagreements(doc, options.hf_config, config)
            where = str(options.hf_config)
        elif origin is not None:
            doc = origin.config_json
            family, differences = config_disagreements(doc, origin.directory / CONFIG_FILE, config)
            where = str(origin.directory / CONFIG_FILE)
        elif carried is not None:
            return carried_config(read_json_object(carried.path), carried.path, config)
        else:
            return infer_family(config), None, []
        if differences:
            raise ConfigError(f"{where}: does not describe the source model: {'; '.join(differences)}")
        require_family_fits(family, config, where)
        return family, doc, []

    def _units(self, source: CanonicalSource, options: SaveOptions) -> list[_Unit]:
        family, base, _ = self._target(source, options)
        config = source.config
        assert config.vocab_size is not None
        mtp.check_hf_target(family, base, config, "hf: the config.json written")
        # A router's expert bias keeps its dtype (a float32 buffer in megatron-core) whatever --dtype says, as on a
        # megatron target.
        kept = keep_dtype_names(config)
        units = []
        unmapped = []
        for name in source.names():
            found = mtp.to_hf(family, name, config)
            if found is None:
                unmapped.append(name)
                continue
            meta = source.meta(name)
            shape = (config.vocab_size, *meta.shape[1:]) if name in VOCAB_TABLES else meta.shape
            row, hf_names = found
            shapes = tuple(row.transform.part_shapes(tuple(shape), config))
            dtype = meta.dtype if name in kept else _out_dtype(meta.dtype, options)
            index = family.tensors.stack_index(mtp.table_name(name, config)) if row.stacked else None
            stack = None if index is None else (index, config.moe.num_experts or 0)
            units.append(_Unit(name, row, hf_names, shapes, dtype, kept_quantized(source, hf_names), stack))
        if unmapped:
            raise ConfigError(f"hf: {family.architecture} has no HF name for {sorted(unmapped)}")
        # Each MTP layer's copies of the embedding and output layer, written from them.
        by_name = {unit.canonical: unit for unit in units}
        units += [replace(by_name[canonical], row=row, hf_names=(hf_name,), kept=kept_quantized(source, (hf_name,)))
                  for hf_name, canonical, row in mtp.copies(family.tensors, config)]
        return kept_once(units)

    def _shards(self, source: CanonicalSource, options: SaveOptions) -> list[_Shard]:
        """transformers' greedy packing, by canonical tensor: a new shard when the next would overflow."""
        limit = options.max_shard_size or DEFAULT_MAX_SHARD_SIZE
        shards = [_Shard()]
        open_stacks: set[str] = set()  # a stacked HF tensor is never split between shards
        for unit in self._units(source, options):
            if shards[-1].units and not open_stacks and shards[-1].nbytes + unit.nbytes > limit:
                shards.append(_Shard())
            if unit.stack is not None:
                (open_stacks.difference_update if unit.closes_stack else open_stacks.update)(unit.hf_names)
            shards[-1].units.append(unit)
            shards[-1].nbytes += unit.nbytes
        return shards

    @staticmethod
    def _file_names(count: int) -> list[str]:
        return [SINGLE_FILE] if count == 1 else [shard_file_name(i + 1, count) for i in range(count)]

    def plan(self, source: CanonicalSource, options: SaveOptions) -> list[PlannedFile]:
        shards = self._shards(source, options)
        return [
            PlannedFile(name, shard.tensors, shard.nbytes)
            for name, shard in zip(self._file_names(len(shards)), shards, strict=True)
        ]

    # Every shard file is written on its own from the plan (``save(only=...)``); the index, config.json and side
    # files are written once by ``finalize``, so --workers and sharded runs split a model by shard files.
    supports_partial = True
    threaded = True  # each rank file or shard is a task of ``options.threads`` threads

    def save(self, source: CanonicalSource, out_dir: Path, options: SaveOptions,
             progress: Progress, only: Collection[str] | None = None) -> SaveResult:
        """Write every shard file (or those of ``only``, names as ``plan`` gives them); with every shard, also what
        ``finalize`` writes."""
        family, _, _ = self._target(source, options)
        shards = self._shards(source, options)
        result = SaveResult()
        kinds = _HFKinds(layer_kinds(source.config), norm_weight_names(source.config), family.hf_rotary_interleaved,
                         family.hf_norms_zero_centred)
        tasks = [partial(_write_shard, out_dir / file_name, shard, source, kinds, progress)
                 for file_name, shard in zip(self._file_names(len(shards)), shards, strict=True)
                 if only is None or file_name in only]
        result.files += run_each(tasks, options.threads)
        if only is None:
            result.notices += self.finalize(source, out_dir, options)
        return result

    def finalize(self, source: CanonicalSource, out_dir: Path, options: SaveOptions) -> list[str]:
        """What is written once every shard file is: the index (from the plan, not from the files), config.json and
        the side files."""
        config = source.config
        family, base, guesses = self._target(source, options)
        notices: list[str] = []
        for guess in guesses:
            fallback(guess, options.strict, notices)
        shards = self._shards(source, options)
        if len(shards) > 1:
            weight_map = {name: file_name for file_name, shard in zip(self._file_names(len(shards)), shards, strict=True)
                          for name, _, _ in _shard_entries(shard)}
            total = sum(sizes.nbytes(shape, dtype) for shard in shards for _, dtype, shape in _shard_entries(shard))
            _write_json(out_dir / INDEX_FILE, {
                "metadata": {"total_size": total},
                "weight_map": dict(sorted(weight_map.items())),
            })
        dtype = _out_dtype(source.meta(WORD_EMBEDDINGS).dtype, options)
        doc, written_as = ((mtp.declared_as_converted(family, with_dtype(base, dtype), config)) if base is not None
                           else (hf_config_from_model(family, config, dtype), None))
        notices.extend([written_as] if written_as else [])
        doc = _quantization_config(doc, source, notices)
        _write_json(out_dir / CONFIG_FILE, doc)
        if base is None:
            assumed = ", ".join(f"{key}={value!r}" for key, value in family.hf_assumed.items())
            notices.append(
                f"config.json was built from the model as {family.architecture}; settings Megatron does not "
                "record (token ids) take transformers' defaults"
                + (f", except {assumed}: how megatron-core behaves" if assumed else "")
            )
        notices.extend(self._copy_side_files(source, options, out_dir))
        # the local spec's entries are None: nothing is dropped (a torch_dist source reports its own)
        if any(extra.holds_state() for extra in source.extra_states().values()):
            notices.append("Transformer Engine _extra_state (FP8 metadata) has no hf equivalent; dropped")
        return notices

    @staticmethod
    def _copy_side_files(source: CanonicalSource, options: SaveOptions, out_dir: Path) -> list[str]:
        """The tokenizer, chat templates and generation config of the source (or the user's)."""
        files = [item for item in target_side_files(source.side_files, options) if item.name != CONFIG_FILE]
        copy_side_files(files, out_dir)
        log.info("copied %s", ", ".join(item.name for item in files) or "no side files")
        names = {item.name for item in files}
        missing = [what for what, present in (
            ("no tokenizer files", names & set(TOKENIZER_FILES)),
            (f"no {GENERATION_CONFIG_FILE}", GENERATION_CONFIG_FILE in names)) if not present]
        if not missing:
            return []
        return [f"{' and '.join(missing)} written: the {source.format_name} source carries none; pass "
                "--tokenizer DIR / --generation-config FILE, or copy them into the output"]
