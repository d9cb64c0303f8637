"""Loader for Hugging Face safetensors checkpoints (``config.json`` + ``model*.safetensors``).

Nothing but headers is read when the source is opened; each tensor is read on demand through
its own ``safe_open``, and fused into its canonical form by the family table's transform.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path

import torch

from pgconvert.model.config import ModelConfig
from pgconvert.errors import CheckpointError, ConfigError, LayoutError, ValidationError
from pgconvert.families.table import Family, PartInto, TensorMapping, TensorTable
from pgconvert.formats import Loader, LoadOptions
from pgconvert.formats.hf import (
    CONFIG_FILE,
    INDEX_FILE,
    SINGLE_FILE,
    HFOrigin,
    canonical_shapes,
    described_by,
    family_mismatches,
    family_of,
    model_config_from_hf,
    parse_index,
    read_header,
    read_json_object,
    read_tensor,
    read_tensor_range,
    resolve_inside,
    stored_counts,
    tensor_range_region,
    tensor_region,
)
from pgconvert.formats.hf_side import find_side_files
from pgconvert.families import mtp
from pgconvert.formats.hf_quantized import QuantizedTensors
from pgconvert.model.declared import declaring_settings, shape_settings
from pgconvert.model.provider import OUTPUT_LAYER, WORD_EMBEDDINGS, canonical_names, shape_function
from pgconvert.model.rules import ShardRule, Window, assemble, strided_in_whole
from pgconvert.formats.stream import CanonicalSource, TensorMeta, all_finite
from pgconvert.formats.strict import fallback

log = logging.getLogger(__name__)



class HFLoader(Loader):
    name = "hf"
    keeps_quantized = True

    def detect(self, path: Path) -> bool:
        return path.is_dir() and (path / CONFIG_FILE).is_file() and (
            (path / SINGLE_FILE).is_file() or (path / INDEX_FILE).is_file()
        )

    def open(self, path: Path, options: LoadOptions) -> HFSource:
        return HFSource(path, options)


def _locate_tensors(directory: Path) -> tuple[dict[str, Path], dict[str, TensorMeta]]:
    """Every stored tensor's file and metadata; the index, when there is one, must match the headers."""
    single = directory / SINGLE_FILE
    if single.is_file():
        # transformers prefers the single file too when both exist.
        path = resolve_inside(directory, SINGLE_FILE, directory)
        single_metas = read_header(path)
        return {name: path for name in single_metas}, single_metas
    index_path = directory / INDEX_FILE
    weight_map = parse_index(index_path)
    files: dict[str, Path] = {}
    metas: dict[str, TensorMeta] = {}
    for shard in sorted(set(weight_map.values())):
        path = resolve_inside(directory, shard, index_path)
        if not path.is_file():
            raise CheckpointError(f"{index_path}: names shard {shard}, which is missing from {directory}")
        for name, meta in read_header(path).items():
            if name in files:
                raise CheckpointError(f"{name}: stored twice, in {files[name].name} and {shard}")
            listed = weight_map.get(name)
            if listed != shard:
                where = f"lists it in {listed}" if listed else "does not list it"
                raise CheckpointError(f"{path}: holds {name}, but {index_path.name} {where}")
            files[name] = path
            metas[name] = meta
    absent = sorted(set(weight_map) - set(files))
    if absent:
        raise CheckpointError(
            f"{index_path}: lists tensors that are not in their shards: "
            + ", ".join(f"{name} ({weight_map[name]})" for name in absent)
        )
    return files, metas


def _table_names(family: Family, files: dict[str, Path], stored: dict[str, TensorMeta], directory: Path,
                 ) -> tuple[dict[str, Path], dict[str, TensorMeta], dict[str, str]]:
    """``files`` and ``stored`` by the table's names where a tensor is stored under an older prefix the family
    accepts (``Family.hf_stored_prefixes``), and each such tensor's stored name by its table name."""
    stored_as: dict[str, str] = {}
    for name in stored:
        for older, current in family.hf_stored_prefixes:
            if name.startswith(older):
                stored_as[current + name.removeprefix(older)] = name
                break
    twice = sorted(set(stored_as) & set(stored))
    if twice:
        raise CheckpointError(f"{directory}: stores {twice[0]} twice: under that name and as {stored_as[twice[0]]}")
    table_name = {name: table for table, name in stored_as.items()}
    return ({table_name.get(name, name): path for name, path in files.items()},
            {table_name.get(name, name): meta for name, meta in stored.items()}, stored_as)


class HFSource(CanonicalSource):
    """An HF checkpoint seen as the canonical stream; it has no parallel layout."""

    format_name = "hf"

    def __init__(self, directory: Path, options: LoadOptions) -> None:
        self.directory = directory
        self.layout = None
        config_path = directory / CONFIG_FILE
        doc = read_json_object(config_path)
        family = family_of(doc, config_path)
        self._files, stored = _locate_tensors(directory)
        # Quantized tensors are seen by their logical names (pgconvert.formats.hf_quantized).
        self._quantized = QuantizedTensors.find(doc, config_path, self._files, stored, options.keep_quantized,
                                                options.dequantize_dtype)
        self._files, stored = self._quantized.logical()
        # The table's name of a tensor stored under an older prefix -> its stored name.
        self._files, stored, self._stored_as = _table_names(family, self._files, stored, directory)
        embedding = family.tensors.to_hf(WORD_EMBEDDINGS)
        stored_dtype = stored[embedding[1][0]].dtype if embedding and embedding[1][0] in stored else None
        weights = directory / (SINGLE_FILE if (directory / SINGLE_FILE).is_file() else INDEX_FILE)
        counts = stored_counts(family.tensors, stored, str(weights))
        family, config, notices = model_config_from_hf(doc, config_path, stored_dtype, stored=counts)
        config, mtp_notice = mtp.resolve_hf_count(family, doc, config, stored, config_path)
        mismatches = family_mismatches(family, config)
        if mismatches:  # what the tensors add to config.json (MTP layers) may be a model the family cannot hold
            raise CheckpointError(f"{config_path}: {family.architecture} cannot hold this model: {', '.join(mismatches)}")
        _check_options(options, config, config_path)
        assert config.vocab_size is not None
        super().__init__(config, vocab_rows=config.vocab_size, iteration=None)
        self.notices.extend(notices)
        if mtp_notice is not None:  # declared MTP layers none of which is stored: a guess under --strict
            fallback(mtp_notice, options.strict, self.notices)
        # What a megatron target cannot hold (semantics.check_target; an hf target keeps config.json).
        self.unrepresentable = list(notices)
        self.family = family
        kept = self._quantized if options.keep_quantized and self._quantized else None
        self.hf_origin = HFOrigin(directory=directory, config_json=doc, family=family, quantized=kept)
        quantized_notice = self._quantized.notice(directory)
        if quantized_notice is not None and not options.keep_quantized:
            # Rounding weight * scale to bf16 changes the values: refused under --strict, as a lossy --dtype is.
            fallback(quantized_notice, options.strict, self.notices)
        elif quantized_notice is not None:
            self.notices.append(quantized_notice)
        self.side_files = find_side_files(directory)
        self._order = canonical_names(config)
        self._rows: dict[str, tuple[TensorMapping, tuple[str, ...]]] = {}
        self._metas: dict[str, TensorMeta] = {}
        # Stored copies of a canonical tensor (a tied output weight, MTP layers' embedding and head,
        # mtp): (HF name, why it must equal the tensor), checked on every read of the tensor.
        self._copies: dict[str, list[tuple[str, str]]] = {}
        # Table rows whose transform changed a value (``_notice_changed``), and whether that is refused; the
        # canonical tensors whose load did, with what changed (``inexact``).
        self._changed_rows: set[str] = set()
        self._inexact: dict[str, str] = {}
        self._strict = options.strict
        self._index(family, config, stored)

    def _refuse_mismatch(self, family: Family, config: ModelConfig, missing: list[str], unexpected: list[str],
                         expected: dict[str, str]) -> None:
        """Stored tensors the table does not expect, or expected ones not stored: a named error
        (a family's own reason first)."""
        refused = family.refuse_extra(unexpected, self.hf_origin.config_json) if family.refuse_extra else None
        if refused:  # a family's own reason for extra tensors
            raise CheckpointError(f"{self.directory}: {family.architecture}: {refused}")
        if missing or unexpected:
            needed_by = sorted({expected[name] for name in missing})
            declared = described_by(self.hf_origin.config_json, family, declaring_settings(config, needed_by), config)
            raise CheckpointError(
                f"{self.directory}: tensors do not match {family.architecture} as config.json describes it; "
                f"missing: {missing}; unexpected: {unexpected}"
                + (f"; the missing tensors make up {needed_by}" if needed_by else "")
                + (f", which config.json declares by {declared}" if declared else "")
            )

    def _index(self, family: Family, config: ModelConfig, stored: dict[str, TensorMeta]) -> None:
        table = family.tensors
        unfilled = []
        for canonical in self._order:
            found = mtp.to_hf(family, canonical, config)
            if found is None:
                unfilled.append(canonical)
            else:
                self._rows[canonical] = found
        if unfilled:
            raise CheckpointError(
                f"{self.directory}: {family.architecture}'s table has no HF tensor for {sorted(unfilled)}"
            )
        # The loader's direction is the table inverted over the tensors this config needs.
        expected = {hf: canonical for canonical, (_, names) in self._rows.items() for hf in names}
        self._find_copies(table, config, stored)
        copies = {hf for held in self._copies.values() for hf, _ in held}
        dropped = sorted(name for name in stored if name not in expected and table.is_dropped(name))
        missing = sorted(set(expected) - set(stored))
        unexpected = sorted(set(stored) - set(expected) - set(dropped) - copies)
        self._refuse_mismatch(family, config, missing, unexpected, expected)
        if dropped:
            log.info("%s: skipping %d recomputed rotary buffers (%s, …)", self.directory, len(dropped), dropped[0])
        shapes = canonical_shapes(config)
        for canonical, (row, names) in self._rows.items():
            part_shapes = row.transform.part_shapes(shapes[canonical], config)
            if row.stacked:  # every expert of the layer on dim 0
                part_shapes = [(config.moe.num_experts or 0, *shape) for shape in part_shapes]
            for name, shape in zip(names, part_shapes, strict=True):
                found_shape = stored[name].shape
                if found_shape != shape:
                    raise CheckpointError(
                        f"{self._files[name]}: {self._stored(name)} has shape {list(found_shape)}, expected "
                        f"{list(shape)} from config.json ({self._shape_keys(family, config, canonical, row)})"
                    )
            dtypes = {stored[name].dtype for name in names}
            if len(dtypes) > 1:
                raise CheckpointError(
                    f"{self.directory}: {', '.join(names)} are fused into {canonical} but have different "
                    f"dtypes ({', '.join(sorted(map(str, dtypes)))})"
                )
            self._metas[canonical] = TensorMeta(shapes[canonical], dtypes.pop())
        for canonical, held in self._copies.items():
            main = self._rows[canonical][1][0]
            for copy, why in held:
                if stored[copy] != stored[main]:
                    raise CheckpointError(f"{self._files[copy]}: {copy} {stored[copy]} does not match "
                                          f"{main} {stored[main]}, but {why}")

    def _shape_keys(self, family: Family, config: ModelConfig, canonical: str, row: TensorMapping) -> str:
        """The config.json keys an HF tensor's expected shape is computed from, as written."""
        shape = shape_function(config, canonical)
        settings = shape_settings(lambda c: row.transform.part_shapes(shape(c), c), config)
        return described_by(self.hf_origin.config_json, family, settings + ["num_experts"] * row.stacked, config)

    def _find_copies(self, table: TensorTable, config: ModelConfig, stored: dict[str, TensorMeta]) -> None:
        """The stored copies of the embedding or output layer: a tied checkpoint's output weight, and
        each MTP layer's embed_tokens and shared_head.head."""
        if config.tie_embeddings:
            # Some tied checkpoints also store the output weight; it must be a copy of the embedding.
            output = table.to_hf(OUTPUT_LAYER)
            if output is not None and output[1][0] in stored:
                self._copies.setdefault(WORD_EMBEDDINGS, []).append(
                    (output[1][0], "config.json ties them (tie_word_embeddings=true)"))
        for hf_name, canonical, _ in mtp.copies(table, config):
            if hf_name in stored:
                self._copies.setdefault(canonical, []).append((hf_name, mtp.copy_reason(hf_name, canonical)))

    def names(self) -> list[str]:
        return list(self._order)

    def meta(self, name: str) -> TensorMeta:
        return self._metas[name]

    def describe(self) -> str:
        return str(self.directory)

    def stored_names(self, name: str) -> list[str]:
        _, hf_names = self._rows[name]
        return [part for hf in hf_names for part in self._stored_parts(hf)]

    def inexact(self, name: str) -> str | None:
        return self._inexact.get(name)

    def nonfinite_parts(self, name: str) -> list[str]:
        _, hf_names = self._rows[name]
        found = [part for hf in hf_names for part in self._stored_parts(hf)
                 if not all_finite(self._quantized.read_stored(part) if self._stored(hf) in self._quantized
                                   else read_tensor(self._files[hf], part))]
        return found or self.stored_names(name)  # finite parts that dequantize to Inf: name them all

    def _stored(self, hf: str) -> str:
        """The stored (logical) name of the table's HF tensor ``hf``."""
        return self._stored_as.get(hf, hf)

    def _stored_parts(self, hf: str) -> tuple[str, ...]:
        """An HF tensor's stored tensors: itself, or a quantized one's data and scale."""
        name = self._stored(hf)
        return self._quantized.entries[name].parts if name in self._quantized else (name,)

    def _load(self, name: str) -> torch.Tensor:
        row, hf_names = self._rows[name]
        index = self.family.tensors.stack_index(mtp.table_name(name, self.config)) if row.stacked else None
        if index is not None:  # one expert's slice of the stacked HF tensors
            full = self._fused(name, [self._read_range(hf, 0, index, index + 1)[0] for hf in hf_names])
        elif self._reads_whole_into(name):
            full = self._whole_into(name)
        else:
            full = self._fused(name, [self._read(hf) for hf in hf_names])
        for copy, why in self._copies.get(name, ()):
            self._check_copy(full, self._read(copy), hf_names[0], copy, why)
        return full

    def _reads_whole_into(self, name: str) -> bool:
        """Whether a tensor of several HF parts is read with each part straight into its place (a transform that
        reads windows of its parts places them unchanged)."""
        row, hf_names = self._rows[name]
        shape = self._metas[name].shape
        return len(hf_names) > 1 and bool(shape) and row.transform.reads_window(Window(0, 0, shape[0]), shape,
                                                                                 self.config)

    def _whole_into(self, name: str) -> torch.Tensor:
        """The whole canonical tensor made by reading (or dequantizing) each HF part into its rows, no part held
        apart."""
        row, hf_names = self._rows[name]
        meta = self._metas[name]
        read_into = self._part_into(hf_names)
        return assemble([Window(0, 0, meta.shape[0])],
                        lambda window, out: row.transform.read_window_into(window, meta.shape, self.config, read_into,
                                                                           out),
                        meta.shape, meta.dtype)

    def _fused(self, name: str, parts: list[torch.Tensor]) -> torch.Tensor:
        """The canonical tensor the transform fuses from ``parts``; values it does not keep exactly are named."""
        row, hf_names = self._rows[name]
        full = row.transform.fuse(parts, self.config)
        changed = row.transform.changed_values(parts, full, self.config)
        if changed:
            self._inexact[name] = (f"{', '.join(hf_names)}: {changed} of {full.numel()} values are not kept exactly "
                                   f"by the {row.transform.name} transform")
            self._notice_changed(row, self._inexact[name])
        return full

    def _notice_changed(self, row: TensorMapping, what: str) -> None:
        """A transform that computes in the tensor's dtype changed values (``what``): named once per table row (the
        first tensor), refused under --strict."""
        if row.hf[0] in self._changed_rows:
            return
        self._changed_rows.add(row.hf[0])
        fallback(f"{what} (computed in the tensor's dtype; other tensors of this row may lose bits too)", self._strict,
                 self.notices)

    def _read(self, hf: str) -> torch.Tensor:
        name = self._stored(hf)
        if name in self._quantized:
            return self._quantized.read(name)
        return read_tensor(self._files[hf], name)

    def _read_range(self, hf: str, dim: int, start: int, stop: int) -> torch.Tensor:
        name = self._stored(hf)
        if name in self._quantized:
            return self._quantized.read_range(name, dim, start, stop)
        return read_tensor_range(self._files[hf], name, dim, start, stop)

    def _check_copy(self, tensor: torch.Tensor, stored: torch.Tensor, tensor_name: str, copy: str, why: str) -> None:
        """A stored copy (a tied model's output weight, an MTP layer's embedding or head) must equal
        the rows of the tensor read with it.

        Checked on every read of the tensor (each piece against the same rows of the copy), so
        a source answers the same however often and in whatever pieces it is read.
        """
        if not torch.equal(stored, tensor):
            raise CheckpointError(f"{self._files[copy]}: {copy} differs from {tensor_name}, but {why}")

    def _load_shard(self, name: str, rule: ShardRule, size: int, rank: int, rows: int | None) -> torch.Tensor:
        """A TP piece read straight from the HF tensors' byte ranges where the transform allows.

        The rule names the piece's global windows (rows, gated halves, vocab rows with zero fill);
        the row's transform says whether it reads each window from ranges of its HF parts (and
        reads it); otherwise the piece is cut from the full tensor.
        """
        row, hf_names = self._rows[name]
        if row.stacked:  # read through _load (one expert's slice)
            return super()._load_shard(name, rule, size, rank, rows)
        meta = self._metas[name]
        windows = rule.piece_windows(meta.shape, size, rank, rows, self.config.vocab_size)
        transform = row.transform
        if windows and all(w.zeros or transform.reads_window(w, meta.shape, self.config) for w in windows):
            read_into = self._part_into(hf_names)
            piece = assemble(windows, lambda w, out: transform.read_window_into(w, meta.shape, self.config, read_into,
                                                                                out), meta.shape, meta.dtype)
            for copy_name, why in self._copies.get(name, ()):
                copy = self._part_into((copy_name,))
                stored = assemble(windows, lambda w, out: copy(0, w.dim, w.start, w.start + w.length, out), meta.shape,
                                  meta.dtype)
                self._check_copy(piece, stored, hf_names[0], copy_name, why)
            return piece
        if name in self._copies:
            self._load(name)  # checks the stored copies
        return super()._load_shard(name, rule, size, rank, rows)

    def _shares_piece_reads(self, name: str, rule: ShardRule, size: int, rows: int | None) -> bool:
        """A piece strided in its HF tensor (a row-parallel weight's columns) is read by its whole file span, and
        one the transform cannot read by windows (or one expert's slice of stacked tensors) is cut from the
        whole tensor: either way each piece would read the bytes of all. Not a quantized tensor's strided piece:
        dequantizing its own columns' blocks costs less than the whole tensor dequantized in memory for all."""
        row, hf_names = self._rows[name]
        if row.stacked:
            return True
        meta = self._metas[name]
        windows = rule.piece_windows(meta.shape, size, 0, rows, self.config.vocab_size)
        if not all(window.zeros or row.transform.reads_window(window, meta.shape, self.config) for window in windows):
            return True
        quantized = any(self._stored(hf) in self._quantized for hf in hf_names)
        return not quantized and strided_in_whole(rule, meta.shape, size, rows, self.config.vocab_size)

    def _read_pieces(self, name: str, rule: ShardRule, size: int, pieces: Mapping[int, torch.Tensor],
                     rows: int | None) -> None:
        """Pieces that are columns of a tensor stored as it is (a row-parallel weight) in one pass over its bytes
        (``FileRegion.read_parts_into``); others from the whole tensor."""
        row, hf_names = self._rows[name]
        meta = self._metas[name]
        last = len(meta.shape) - 1
        windows = {rank: rule.piece_windows(meta.shape, size, rank, rows, self.config.vocab_size) for rank in pieces}
        if (row.stacked or name in self._copies or not row.transform.stores_canonical
                or self._stored(hf_names[0]) in self._quantized
                or any(len(cut) != 1 or cut[0].dim != last or cut[0].zeros for cut in windows.values())):
            super()._read_pieces(name, rule, size, pieces, rows)
            return
        region = tensor_region(self._files[hf_names[0]], self._stored(hf_names[0]))
        region.read_parts_into([(windows[rank][0].start, windows[rank][0].length, piece)
                                for rank, piece in pieces.items()])

    def _part_into(self, hf_names: tuple[str, ...]) -> PartInto:
        """Reads rows ``[start, stop)`` along ``dim`` of HF tensor ``hf_names[part]`` into a tensor holding their
        elements (straight from the file where they are stored as they are; dequantized and copied otherwise)."""
        def read_into(part: int, dim: int, start: int, stop: int, out: torch.Tensor) -> None:
            hf = hf_names[part]
            name = self._stored(hf)
            if name in self._quantized:
                self._quantized.read_range_into(name, dim, start, stop, out)
            else:
                tensor_range_region(self._files[hf], name, dim, start, stop).read_into(out)

        return read_into

    def close(self) -> None:
        self._files.clear()
        self._rows.clear()


def _check_options(options: LoadOptions, config: ModelConfig, config_path: Path) -> None:
    if options.true_vocab_size is not None and options.true_vocab_size != config.vocab_size:
        raise ConfigError(
            f"--true-vocab-size {options.true_vocab_size}: {config_path} says vocab_size={config.vocab_size}; "
            "an hf checkpoint's vocab tables have exactly vocab_size rows"
        )
    for flag, given in (("--src-tp", options.src_tp), ("--src-pp", options.src_pp), ("--src-ep", options.src_ep)):
        if given is not None and given != 1:
            raise LayoutError(f"{flag} {given}: an hf checkpoint is not sharded (tp=1, pp=1, ep=1) ({config_path})")
    if options.iteration is not None:
        raise ValidationError(f"--iteration {options.iteration}: an hf checkpoint has no iterations ({config_path})")
