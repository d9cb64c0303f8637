"""A torch.distributed.checkpoint store (``.metadata`` + ``*.distcp``) read with no process group.

What the torch_dist and fsdp_dtensor sources share: both formats are one DCP store of global tensors (and
pickled objects); they differ in the keys and in where the args live. A request fills buffers of exactly the
requested boxes: each box is cut into its overlaps with the stored chunks (``chunk_reads``, as torch's
``create_read_items_for_chunk_list`` plans a ``dcp.load``), and ``SafeReader`` reads only each overlap's bytes,
with ``os.preadv`` straight into their place (``pgconvert/io/dcp_records.py``), so no page of the file is mapped.
torch.distributed.checkpoint is not imported (most of a second): ``.metadata`` is read through an allowlist of
torch's metadata classes into ``pgconvert.io.dcp_plan``'s types (``formats.torch_dist.read_dcp_metadata``), and
bytes entries with ``weights_only=True`` and the allowlist. A record torch stored transformed (compressed) is
refused by name.
"""

from __future__ import annotations

import io
import math
import os
import pickle
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pgconvert.errors import CheckpointError, PgconvertError, UnsafePickleError
from pgconvert.formats.contract import LoadOptions
from pgconvert.formats.megatron import SAFE_GLOBALS, check_vocab_multiple, config_from_args, layout_from_args
from pgconvert.formats.megatron_args import MEGATRON_DEFAULTS
from pgconvert.formats.stream import ExtraState
from pgconvert.formats.strict import fallback
from pgconvert.formats.dcp_layout import DCP_METADATA_FILE
from pgconvert.io.dcp_plan import MetadataIndex, Metadata, TensorStorageMetadata
from pgconvert.io.dcp_records import TensorRecord, check_extent, parse_tensor_record, read_box, read_bytes
from pgconvert.io.limits import quote
from pgconvert.io.paths import ensure_within
from pgconvert.io.ranges import FileRegion
from pgconvert.io.reuse import new_tensor
from pgconvert.io.sizes import itemsize
from pgconvert.io.torch_input import check_torch_stream
from pgconvert.model.config import TRANSFORMER_IMPLS, ModelConfig
from pgconvert.model.layout import ParallelLayout
from pgconvert.model.provider import WORD_EMBEDDINGS, te_extra_state_names
from pgconvert.model.rules import ShardRule, piece_targets

# Megatron-LM's default --transformer-impl, for args that do not record one.
DEFAULT_TRANSFORMER_IMPL = MEGATRON_DEFAULTS["transformer_impl"]


@dataclass(frozen=True)
class Region:
    """A box of a canonical tensor: ``starts``/``lengths`` per dimension of the canonical shape."""

    starts: tuple[int, ...]
    lengths: tuple[int, ...]


@dataclass(frozen=True)
class ChunkRead:
    """One stored chunk's overlap with a requested box: ``lengths`` values from ``storage_offsets`` into the chunk
    ``index`` names, to ``dest_offsets`` of the box's buffer ``target``; a bytes entry has no box (``target`` None)."""

    index: MetadataIndex
    target: torch.Tensor | None = None
    dest_offsets: tuple[int, ...] = ()
    storage_offsets: tuple[int, ...] = ()
    lengths: tuple[int, ...] = ()


def chunk_reads(key: str, md: TensorStorageMetadata, offsets: tuple[int, ...], buffer: torch.Tensor,
                where: str) -> list[ChunkRead]:
    """The reads that fill ``buffer``, the box of ``key``'s global tensor at ``offsets``: one per stored chunk it
    overlaps. The chunks must cover the box exactly once."""
    reads = []
    sizes = tuple(buffer.shape)
    for number, chunk in enumerate(md.chunks):
        starts = [max(o, c) for o, c in zip(offsets, chunk.offsets, strict=True)]
        ends = [min(o + n, c + m) for o, n, c, m in zip(offsets, sizes, chunk.offsets, chunk.sizes, strict=True)]
        if any(end <= start for start, end in zip(starts, ends)):
            continue
        reads.append(ChunkRead(MetadataIndex(key, chunk.offsets, index=number), buffer,
                               tuple(s - o for s, o in zip(starts, offsets)),
                               tuple(s - c for s, c in zip(starts, chunk.offsets)),
                               tuple(e - s for s, e in zip(starts, ends))))
    covered = sum(math.prod(read.lengths) for read in reads)
    if covered != buffer.numel():
        raise CheckpointError(f"{where}: {key} at offsets {list(offsets)}: the stored chunks cover {covered} of its "
                              f"{buffer.numel()} values")
    return reads


class SafeReader:
    """A store's records read in place (``pgconvert/io/dcp_records.py``): only the bytes each request needs, with
    positional reads straight into the request's buffers; each tensor record parsed once per place."""

    def __init__(self, directory: Path, metadata: Metadata, root: Path | None = None) -> None:
        self._metadata = metadata
        self._directory = directory
        self._root = root or directory
        self.storage_data = metadata.storage_data
        self._records: dict[tuple[str, int, int], TensorRecord] = {}

    def read_data(self, reads: list[ChunkRead], load_bytes: Callable[[str, io.BytesIO], None]) -> None:
        """Every read, file by file in offset order; a bytes entry's bytes handed to ``load_bytes``."""
        per_file: dict[str, list[ChunkRead]] = {}
        for read in reads:
            info = self.storage_data.get(read.index)
            if info is None:
                raise CheckpointError(f"{self._directory}: {quote(read.index.fqn)} at {list(read.index.offset or [])} "
                                      f"has no storage entry in {DCP_METADATA_FILE}")
            if getattr(info, "transform_descriptors", None):
                raise CheckpointError(f"{self._directory / info.relative_path}: {quote(read.index.fqn)} is stored "
                                      f"transformed ({quote(info.transform_descriptors)}); pgconvert reads the "
                                      "records torch.distributed.checkpoint stores as they are (no compression)")
            per_file.setdefault(info.relative_path, []).append(read)
        for relative, items in per_file.items():
            self._read_file(relative, sorted(items, key=lambda read: self.storage_data[read.index].offset),
                            load_bytes)

    def _read_file(self, relative: str, reads: list[ChunkRead], load_bytes: Callable[[str, io.BytesIO], None]) -> None:
        path = ensure_within(self._root, self._directory / relative)
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        try:
            size = os.fstat(fd).st_size
            for read in reads:
                info = self.storage_data[read.index]
                check_extent(path, read.index.fqn, info.offset, info.length, size)
            for read in reads:
                self._read_item(fd, path, read, load_bytes)
        finally:
            os.close(fd)

    def _read_item(self, fd: int, path: Path, read: ChunkRead, load_bytes: Callable[[str, io.BytesIO], None]) -> None:
        info = self.storage_data[read.index]
        label = f"{path}: {quote(read.index.fqn)} (offset {info.offset}, length {info.length})"
        if read.target is None:
            load_bytes(read.index.fqn, io.BytesIO(read_bytes(fd, info.offset, info.length, label)))
            return
        record = self.record(path, read.index, info, fd)
        target = read.target.detach()
        for dim, (start, length) in enumerate(zip(read.dest_offsets, read.lengths)):
            target = target.narrow(dim, start, length)
        read_box(fd, path, record, list(read.storage_offsets), list(read.lengths), target, label)

    def record(self, path: Path, index: MetadataIndex, info: Any, fd: int | None = None) -> TensorRecord:
        """The layout of the tensor record of chunk ``index`` (stored as ``info`` says) in ``path``, open as ``fd``
        or opened here (its extent checked): parsed once per place, and checked to hold the chunk the index
        describes."""
        where = (info.relative_path, info.offset, info.length)
        label = f"{path}: {quote(index.fqn)} (offset {info.offset}, length {info.length})"
        record = self._records.get(where)
        if record is None and fd is not None:
            record = self._records[where] = parse_tensor_record(fd, info.offset, info.length, label)
        elif record is None:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
            try:
                check_extent(path, index.fqn, info.offset, info.length, os.fstat(fd).st_size)
                record = self._records[where] = parse_tensor_record(fd, info.offset, info.length, label)
            finally:
                os.close(fd)
        self._check_record(record, index, label)  # for every chunk: two index entries may name one record
        return record

    def _check_record(self, record: TensorRecord, index: MetadataIndex, label: str) -> None:
        """A record holds the chunk the index says it does: its shape and dtype."""
        md = self._metadata.state_dict_metadata.get(index.fqn)
        offset = tuple(index.offset or ())
        sizes = next((tuple(chunk.sizes) for chunk in getattr(md, "chunks", []) if tuple(chunk.offsets) == offset), None)
        dtype = md.properties.dtype if isinstance(md, TensorStorageMetadata) else None
        if record.size != sizes or record.dtype != dtype:
            raise CheckpointError(f"{label}: stored as {record.dtype} {list(record.size)}, but the index describes "
                                  f"the chunk at {list(offset)} as {dtype} {list(sizes) if sizes else sizes}")


class DcpStore:
    """One store's index and data files: ``read`` boxes of global tensors and stored objects."""

    def __init__(self, directory: Path, metadata: Metadata, root: Path | None = None) -> None:
        self.directory = directory
        self.metadata = metadata
        self.root = root or directory
        # Each thread's reader (``--threads``), with the tensor records it parsed.
        self._readers = threading.local()

    def check_files(self, metadata_path: Path) -> None:
        """Every chunk's file exists inside the checkpoint and is long enough to hold it."""
        storage = self.metadata.storage_data
        if not isinstance(storage, dict):
            raise CheckpointError(f"{metadata_path}: no storage index (storage_data)")
        needed: dict[str, int] = {}
        furthest: dict[str, str] = {}
        for index, info in storage.items():
            relative = getattr(info, "relative_path", None)
            if not isinstance(relative, str):
                raise CheckpointError(f"{metadata_path}: a chunk has no file name ({quote(info)})")
            if int(info.offset) + int(info.length) > needed.get(relative, -1):
                needed[relative] = int(info.offset) + int(info.length)
                furthest[relative] = f"{quote(index.fqn)} at offset {info.offset}, length {info.length}"
        referenced = {key.fqn for key in storage}
        unstored = sorted(key for key in self.metadata.state_dict_metadata if key not in referenced)
        if unstored:
            raise CheckpointError(f"{metadata_path}: no stored data for {unstored}")
        missing = []
        for relative, end in sorted(needed.items()):
            path = ensure_within(self.root, self.directory / relative)
            if not path.is_file():
                missing.append(relative)
            elif path.stat().st_size < end:
                raise CheckpointError(f"{path}: truncated ({path.stat().st_size} bytes, the index needs {end}: "
                                      f"{furthest[relative]})")
        if missing:
            raise CheckpointError(f"{self.directory}: missing data files named by {DCP_METADATA_FILE}: {', '.join(missing)}")

    def _reader(self) -> SafeReader:
        """This thread's reader of the checkpoint's data files."""
        reader: SafeReader | None = getattr(self._readers, "reader", None)
        if reader is None:
            reader = self._readers.reader = SafeReader(self.directory, self.metadata, self.root)
        return reader

    def flat_region(self, key: str, start: int, length: int) -> FileRegion | None:
        """Elements ``[start, start + length)`` of the one-dimensional tensor ``key`` as a region of its data file,
        where one stored chunk holds them as they are (None where none does, or its record is transformed: read
        them with ``read``). The chunk's record is parsed and checked once, by this thread's reader (``record``)."""
        md = self.metadata.state_dict_metadata.get(key)
        if not isinstance(md, TensorStorageMetadata) or len(md.size) != 1:
            return None
        chunk = next((chunk for chunk in md.chunks if len(chunk.offsets) == 1
                      and chunk.offsets[0] <= start and start + length <= chunk.offsets[0] + chunk.sizes[0]), None)
        index = None if chunk is None else MetadataIndex(key, chunk.offsets)
        info = None if index is None else self.metadata.storage_data.get(index)
        if chunk is None or index is None or info is None or getattr(info, "transform_descriptors", None):
            return None
        path = ensure_within(self.root, self.directory / info.relative_path)
        record = self._reader().record(path, index, info)
        if record.stride != (1,):
            return None
        offset = record.data_offset + (record.storage_offset + start - chunk.offsets[0]) * itemsize(record.dtype)
        return FileRegion.contiguous(path, offset, (length,), record.dtype)

    def read(self, regions: dict[str, list[tuple[tuple[int, ...], torch.Tensor]]],
             objects: list[str]) -> dict[str, Any]:
        """Fill each ``(offsets, buffer)`` box of each key's global tensor; unpickle ``objects``."""
        where = str(self.directory)
        entries = self.metadata.state_dict_metadata
        reads = []
        for key, pairs in regions.items():
            md = entries.get(key)
            if not isinstance(md, TensorStorageMetadata):
                raise CheckpointError(f"{where}: {quote(key)} is not a tensor in {DCP_METADATA_FILE}")
            for offsets, buffer in pairs:
                reads += chunk_reads(key, md, offsets, buffer, where)
        for key in objects:
            if key not in entries or isinstance(entries[key], TensorStorageMetadata):
                raise CheckpointError(f"{where}: {quote(key)} is not a bytes entry in {DCP_METADATA_FILE}")
            reads.append(ChunkRead(MetadataIndex(key)))
        loaded: dict[str, Any] = {}
        try:
            self._reader().read_data(reads, lambda key, value: loaded.update({key: load_object(where, key, value)}))
        except (PgconvertError, OSError):
            raise
        except Exception as exc:  # a corrupt chunk: name the checkpoint
            raise CheckpointError(f"{self.directory}: reading failed: {type(exc).__name__}: {quote(str(exc), 200)}") from exc
        return loaded


def load_object(where: str, key: str, value: io.BytesIO) -> Any:
    """A bytes entry's object (``torch.save`` of it), unpickled through the allowlist: nothing from the file runs."""
    try:
        with torch.serialization.safe_globals(SAFE_GLOBALS):
            check_torch_stream(value, f"{where}: {key}")
            return torch.load(value, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        raise UnsafePickleError(f"{where}: {key}: refuses to unpickle it ({quote(str(exc).strip()[:400], 200)}); "
                                "nothing from the file was executed") from exc
    except (RuntimeError, EOFError, ValueError) as exc:
        raise CheckpointError(f"{where}: {key}: not a readable object ({quote(str(exc), 200)})") from exc


def region_box(shape: tuple[int, ...], dim: int, start: int, length: int) -> Region:
    """The box of ``shape`` that is ``length`` indices of ``dim`` from ``start``, whole along the others."""
    starts = [0] * len(shape)
    lengths = list(shape)
    starts[dim], lengths[dim] = start, length
    return Region(tuple(starts), tuple(lengths))


def model_from_args(args: Any, where: Path, options: LoadOptions,
                    notices: list[str]) -> tuple[ParallelLayout, ModelConfig]:
    """The layout and model a store's Megatron ``args`` describe (torch_dist, fsdp_dtensor)."""
    layout = layout_from_args(args, where, options.strict, notices)
    options.check_layout(layout, where)
    impl = getattr(args, "transformer_impl", None)
    if impl not in TRANSFORMER_IMPLS:
        if impl is not None or not hasattr(args, "transformer_impl"):  # None: layout_from_args names it
            fallback(f"{where}: args.transformer_impl={impl!r}; assuming Megatron-LM's default "
                     f"{DEFAULT_TRANSFORMER_IMPL!r} for the key names", options.strict, notices)
        impl = DEFAULT_TRANSFORMER_IMPL
    config = config_from_args(args, where, impl, options.true_vocab_size,
                              grouped_gemm=bool(getattr(args, "moe_grouped_gemm", False)))
    return layout, config


def check_vocab_rows(args: Any, layout: ParallelLayout, config: ModelConfig, rows: int, where: Path,
                     metadata_path: Path, options: LoadOptions, notices: list[str]) -> None:
    """The stored vocab tables' ``rows`` against the args' padding multiple and true vocab size."""
    check_vocab_multiple(args, layout.tp, rows, where)
    if config.vocab_size is None:
        fallback(f"{where}: the true vocab size is unknown (no args.vocab_size, no --true-vocab-size); "
                 f"keeping the padded table of {rows} rows as the vocabulary", options.strict, notices)
    elif config.vocab_size > rows:
        given = "--true-vocab-size" if options.true_vocab_size is not None else "args.vocab_size"
        raise CheckpointError(f"{metadata_path}: true vocab size {given}={config.vocab_size} exceeds the {rows} "
                              f"rows of {WORD_EMBEDDINGS}")


def read_piece(shape: tuple[int, ...], rule: ShardRule, size: int, rank: int, rows: int | None,
               vocab_size: int | None, dtype: torch.dtype,
               read_boxes: Callable[[list[Region], list[torch.Tensor]], object]) -> torch.Tensor:
    """Piece ``rank`` of ``size`` of a global tensor of ``shape`` under ``rule``: the boxes of the rule's
    windows read in one request (``read_boxes``) straight into their places in the piece, zero windows (new
    vocab rows) filled."""
    windows = rule.piece_windows(shape, size, rank, rows, vocab_size)
    if not windows:  # a 0-dim tensor: the whole of it
        piece = new_tensor(shape, dtype)
        read_boxes([Region((0,) * len(shape), shape)], [piece])
        return piece
    piece, targets = piece_targets(windows, shape, dtype)
    boxes = [region_box(shape, window.dim, window.start, window.length) for window, _ in targets]
    places = [target if target.is_contiguous() else new_tensor(target.shape, dtype) for _, target in targets]
    if boxes:
        read_boxes(boxes, places)
    for (_, target), place in zip(targets, places, strict=True):
        if place is not target:
            target.copy_(place)
    return piece


def te_extra_states(config: ModelConfig, layout: ParallelLayout) -> dict[str, ExtraState]:
    """The Transformer Engine modules' entries, empty: a store keeps none per rank (torch_dist one per module,
    not carried; fsdp_dtensor none), and naming the modules gives a TE-spec per-rank target the entries its
    state dicts require. The local spec's linears need none (megatron-core fills them in on load)."""
    if config.transformer_impl != "transformer_engine":
        return {}
    names = te_extra_state_names(config, range(config.num_layers), layout.ep)
    return {name: ExtraState(tp_size=layout.tp, ep_size=layout.ep) for name in names}
