"""Saver for Hugging Face safetensors checkpoints, loadable with transformers' ``from_pretrained``.

Shards are written one at a time, each bounded by ``max_shard_size``; the parts of one canonical
tensor (q/k/v, gate/up) always land in the same shard, so every source tensor is read once. Each
shard is streamed: its header is computed from shapes and dtypes known in advance, then tensors
are written as they are produced, so only one canonical tensor is in memory, not a whole shard.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, BinaryIO

import torch

from pgconvert import sizes
from pgconvert.durable import fsync_file as _fsync
from pgconvert.errors import CheckpointError, ConfigError, LayoutError, PgconvertError
from pgconvert.families import Family, TensorMapping
from pgconvert.formats import PlannedFile, Progress, SaveOptions, Saver, SaveResult, target_dtype
from pgconvert.hashing import HashingWriter
from pgconvert.hf_format import (
    CONFIG_FILE,
    DEFAULT_MAX_SHARD_SIZE,
    INDEX_FILE,
    SAFETENSORS_DTYPES,
    SINGLE_FILE,
    HFOrigin,
    config_disagreements,
    hf_config_from_model,
    infer_family,
    read_json_object,
    require_family_fits,
    shard_file_name,
    with_dtype,
)
from pgconvert.config import ModelConfig
from pgconvert.hf_side import (
    GENERATION_CONFIG_FILE,
    TOKENIZER_FILES,
    carried_config,
    copy_side_files,
    target_side_files,
)
from pgconvert.layout import ParallelLayout
from pgconvert.semantics import hf_losses, hf_training_notes, lose
from pgconvert.provider import VOCAB_TABLES, WORD_EMBEDDINGS, keep_dtype_names
from pgconvert.stream import CanonicalSource
from pgconvert.strict import fallback

log = logging.getLogger(__name__)

# Canonical norm weights (input, pre-MLP, final, q/k), which --apply-layernorm-1p zero-centres.
ZERO_CENTRED_NORMS = ("layernorm.weight",)


@dataclass(frozen=True)
class _Unit:
    """One canonical tensor and the HF tensors it becomes (their shapes and dtype as written)."""

    canonical: str
    row: TensorMapping
    hf_names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    dtype: torch.dtype
    # f17c: (expert index, experts) for a slice of stacked HF tensors (TensorMapping.stacked)
    stack: tuple[int, int] | None = None

    @property
    def nbytes(self) -> int:
        return sum(sizes.nbytes(shape, self.dtype) for shape in self.shapes)

    @property
    def closes_stack(self) -> bool:
        """Whether the unit's HF tensors are complete once it is written (always, unless stacked)."""
        return self.stack is None or self.stack[0] == self.stack[1] - 1

    def entries(self) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
        """The safetensors entries this unit completes (a stacked tensor's with its last expert)."""
        if not self.closes_stack:
            return []
        lead = (self.stack[1],) if self.stack is not None else ()
        return [(name, self.dtype, (*lead, *shape)) for name, shape in zip(self.hf_names, self.shapes, strict=True)]


@dataclass
class _Shard:
    units: list[_Unit] = field(default_factory=list)
    nbytes: int = 0

    @property
    def tensors(self) -> int:
        return sum(len(unit.entries()) for unit in self.units)


def _rotary_order(config: ModelConfig) -> torch.Tensor:
    """Within one head: the rotated dims' even then odd indices, then the unrotated ones."""
    head, rotated = config.head_dim, int(config.head_dim * config.rotary_percent)
    return torch.cat([torch.arange(0, rotated, 2), torch.arange(1, rotated, 2), torch.arange(rotated, head)])


def rotate_half_order(name: str, full: torch.Tensor, config: ModelConfig) -> torch.Tensor:
    """Megatron's interleaved rotary (``--rotary-interleaved``) rotates the dim pairs (2i, 2i+1) of a
    head; HF's rotate-half rotates (i, i + d/2) at the same frequency. Ordering each query and key
    head's rows (and their q/k-norm weights) evens first, then odds, gives the same attention."""
    order = _rotary_order(config)
    if name.endswith(("self_attention.q_layernorm.weight", "self_attention.k_layernorm.weight")):
        return full.index_select(0, order)
    if not name.endswith(("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias")):
        return full
    head, per_group = config.head_dim, config.num_attention_heads // config.query_groups
    index = torch.arange(full.shape[0])
    for group in range(config.query_groups):
        # A group's rows: its query heads, one key head (both rotated), one value head (kept).
        for position in range(per_group + 1):
            start = (group * (per_group + 2) + position) * head
            index[start:start + head] = start + order
    return full.index_select(0, index)


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
        self.sha256: str | None = None
        self.size: int | None = None
        self._pending = list(entries)
        self._file: BinaryIO = open(path, "wb")
        # The file is hashed on a second thread as it is written, so the manifest need not read it back.
        self._hasher = ThreadPoolExecutor(1)
        self._handle = HashingWriter(self._file, self._hasher)
        self._handle.write(len(encoded).to_bytes(8, "little"))
        self._handle.write(encoded)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        expected_name, dtype, shape = self._pending.pop(0)
        if (name, tensor.dtype, tuple(tensor.shape)) != (expected_name, dtype, shape):
            raise CheckpointError(
                f"{self.path}: the source gave {name} as {tensor.dtype} {list(tensor.shape)}, its metadata said "
                f"{expected_name} {dtype} {list(shape)}"
            )
        if tensor.numel():
            flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
            self._handle.write(flat.numpy().data)

    def __enter__(self) -> _SafetensorsWriter:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        try:
            if kind is None:
                if self._pending:
                    raise AssertionError(f"{self.path}: never written: {[entry[0] for entry in self._pending]}")
                self._file.flush()
                os.fsync(self._file.fileno())
                self.sha256, self.size = self._handle.hexdigest(), self._handle.offset
        finally:
            self._file.close()
            self._hasher.shutdown()




def _write_json(path: Path, doc: dict[str, Any]) -> None:
    path.write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    _fsync(path)


class HFSaver(Saver):
    name = "hf"
    # One unsharded model: the destination never takes a parallel layout.
    parallel = False

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
        self._units(source, options)
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
        if source.config.layernorm_zero_centered_gamma and dtype not in (torch.float32, torch.float64):
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
        family, _, _ = self._target(source, options)
        config = source.config
        assert config.vocab_size is not None
        # Routers keep their dtype (float32 in megatron-core) whatever --dtype says, as on a megatron target.
        kept = keep_dtype_names(config)
        units = []
        unmapped = []
        for name in source.names():
            found = family.tensors.to_hf(name)
            if found is None:
                unmapped.append(name)
                continue
            meta = source.meta(name)
            shape = (config.vocab_size, *meta.shape[1:]) if name in VOCAB_TABLES else meta.shape
            row, hf_names = found
            shapes = tuple(row.transform.part_shapes(tuple(shape), config))
            dtype = meta.dtype if name in kept else _out_dtype(meta.dtype, options)
            index = family.tensors.stack_index(name) if row.stacked else None
            stack = None if index is None else (index, config.num_experts or 0)
            units.append(_Unit(name, row, hf_names, shapes, dtype, stack))
        if unmapped:
            raise ConfigError(f"hf: {family.architecture} has no HF name for {sorted(unmapped)}")
        return units

    def _shards(self, source: CanonicalSource, options: SaveOptions) -> list[_Shard]:
        """transformers' greedy packing, by canonical tensor: a new shard when the next would overflow."""
        limit = options.max_shard_size or DEFAULT_MAX_SHARD_SIZE
        shards = [_Shard()]
        open_stacks: set[str] = set()  # f17c: a stacked HF tensor is never split between shards
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

    @staticmethod
    def _hf_pieces(source: CanonicalSource, unit: _Unit) -> list[torch.Tensor]:
        """The HF tensors (or, for a stacked row, their slices) of one canonical tensor, as written."""
        config = source.config
        assert config.vocab_size is not None
        full = source.load(unit.canonical)
        if unit.canonical in VOCAB_TABLES:
            # Megatron's padding rows are not part of the model.
            full = full.narrow(0, 0, config.vocab_size)
        if config.rotary_interleaved:
            full = rotate_half_order(unit.canonical, full, config)
        if config.layernorm_zero_centered_gamma and unit.canonical.endswith(ZERO_CENTRED_NORMS):
            # megatron-core's norms compute with 1 + gamma (--apply-layernorm-1p); HF's with gamma.
            full = full.to(torch.float32) + 1.0
        return [piece.to(unit.dtype) for piece in unit.row.transform.split(full, config)]

    def plan(self, source: CanonicalSource, options: SaveOptions) -> list[PlannedFile]:
        shards = self._shards(source, options)
        return [
            PlannedFile(name, shard.tensors, shard.nbytes)
            for name, shard in zip(self._file_names(len(shards)), shards, strict=True)
        ]

    def save(self, source: CanonicalSource, out_dir: Path, options: SaveOptions,
             progress: Progress) -> SaveResult:
        config = source.config
        assert config.vocab_size is not None
        family, base, guesses = self._target(source, options)
        shards = self._shards(source, options)
        result = SaveResult()
        for guess in guesses:
            fallback(guess, options.strict, result.notices)
        weight_map: dict[str, str] = {}
        total = 0
        for file_name, shard in zip(self._file_names(len(shards)), shards, strict=True):
            entries = [entry for unit in shard.units for entry in unit.entries()]
            stacks: dict[str, list[torch.Tensor]] = {}
            with _SafetensorsWriter(out_dir / file_name, entries) as writer:
                for unit in shard.units:
                    pieces = self._hf_pieces(source, unit)
                    for hf_name, piece in zip(unit.hf_names, pieces, strict=True):
                        if unit.stack is None:
                            writer.write(hf_name, piece)
                            continue
                        stacks.setdefault(hf_name, []).append(piece)
                        if unit.closes_stack:
                            writer.write(hf_name, torch.stack(stacks.pop(hf_name)))
            weight_map.update({entry[0]: file_name for entry in entries})
            total += writer.nbytes
            result.files.append(PlannedFile(file_name, len(entries), writer.nbytes, sha256=writer.sha256,
                                            size=writer.size))
            progress(writer.nbytes)
        if len(shards) > 1:
            _write_json(out_dir / INDEX_FILE, {
                "metadata": {"total_size": total},
                "weight_map": dict(sorted(weight_map.items())),
            })
        dtype = _out_dtype(source.meta(WORD_EMBEDDINGS).dtype, options)
        doc = with_dtype(base, dtype) if base is not None else hf_config_from_model(family, config, dtype)
        _write_json(out_dir / CONFIG_FILE, doc)
        if base is None:
            assumed = ", ".join(f"{key}={value!r}" for key, value in family.hf_assumed.items())
            result.notices.append(
                f"config.json was built from the model as {family.architecture}; settings Megatron does not "
                "record (token ids) take transformers' defaults"
                + (f", except {assumed}: how megatron-core behaves" if assumed else "")
            )
        result.notices.extend(self._copy_side_files(source, options, out_dir))
        # the local spec's entries are None: nothing is dropped (a torch_dist source reports its own)
        if any(extra.holds_state() for extra in source.extra_states().values()):
            result.notices.append("Transformer Engine _extra_state (FP8 metadata) has no hf equivalent; dropped")
        return result

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
