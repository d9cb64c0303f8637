"""Reading Megatron distributed checkpoints (``torch_dist``: ``.metadata``, ``*.distcp``, ``common.pt``).

The machinery behind ``loaders/torch_dist/__init__.py``, imported only when a torch_dist source is opened:
format detection imports no torch.

Tensors are read from the DCP store with no process group (``pgconvert/formats/dcp_store.py``), one
canonical tensor (or one destination piece of it) per request into a buffer of exactly that size: only
the stored chunks overlapping the request are read, and of them only the overlap's bytes, so a stacked
``[num_layers, …]`` key costs one layer at a time and no page of the file is mapped.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from pgconvert.io.dcp_plan import BytesStorageMetadata, Metadata, TensorStorageMetadata
from pgconvert.model.config import ModelConfig
from pgconvert.errors import CheckpointError
from pgconvert.formats import LoadOptions
from pgconvert.formats.dcp_store import (DcpStore, Region, check_vocab_rows, model_from_args, read_piece, region_box,
                                         te_extra_states)
from pgconvert.formats.hf_side import carried_side_files
from pgconvert.formats.megatron_bridge import RUN_CONFIG_FILE, bridge_args, run_config_beside
from pgconvert.formats.megatron import (
    TRAINING_STATE_KEYS,
    arg_name,
    is_adapter_key,
    safe_torch_load,
    validate_source_layout,
)
from pgconvert.io.limits import quote
from pgconvert.io.ranges import FileHandles
from pgconvert.io.reuse import new_tensor
from pgconvert.io.sizes import numel
from pgconvert.io.torch_input import meta_at
from pgconvert.loaders.torch_dist.fs_model_space import chunk_shape, record_box, unflatten
from pgconvert.loaders.torch_dist.optimizer import TorchDistOptimizerSource
from pgconvert.loaders.torch_dist.optimizer_forms import sharding_type
from pgconvert.io.paths import ensure_within
from pgconvert.model.declared import StoredCounts, check_declared_counts, declaring_settings, named_values, shape_settings
from pgconvert.model.vision import LANGUAGE_MODEL_MODULE
from pgconvert.model.provider import (LAYER_PREFIX, MTP_PREFIX, OUTPUT_LAYER, VOCAB_TABLES, WORD_EMBEDDINGS,
                                      canonical_shapes, shape_function)
from pgconvert.model.rules import ShardRule, strided_in_whole
from pgconvert.formats.stream import CanonicalSource, EmbeddedAdapter, ExtraState, TensorMeta, holds_state
from pgconvert.formats.strict import fallback
from pgconvert.formats.torch_dist_integrity import INTEGRITY_CHECKS, INTEGRITY_FILE, check_integrity, integrity_problems
from pgconvert.formats.dcp_layout import CHECKPOINT_CONFIG_FILE, DCP_METADATA_FILE
from pgconvert.formats.torch_dist import (
    COMMON_FILE,
    COMMON_STATE_KEY,
    EXPERTS_KEY,
    common_state_storage,
    is_extra_state,
    refuse_singleton,
    is_training_state,
    read_checkpoint_config,
    read_dcp_metadata,
    stacked_layers,
    tensor_locations,
)

log = logging.getLogger(__name__)

class TorchDistSource(CanonicalSource):
    """One iteration of a distributed checkpoint: its index is read up front, tensors on demand."""

    format_name = "torch_dist"
    # Megatron-LM's emerging Muon and Lion optimizers too, plain and layer-wise (loaders/torch_dist/optimizer.py)
    optimizer_kinds = ("adam", "muon", "lion", "muon layer-wise", "lion layer-wise")

    def __init__(self, iteration_dir: Path, iteration: int | None, release: bool, options: LoadOptions,
                 root: Path | None = None) -> None:
        self.directory = iteration_dir
        self.root = root or iteration_dir
        early_notices: list[str] = []
        metadata_path = self._check_directory(self.root, iteration_dir, options)
        self._metadata = read_dcp_metadata(metadata_path)
        self._store = DcpStore(iteration_dir, self._metadata, self.root)
        self._store.check_files(metadata_path)
        self.handles = FileHandles()  # the data files its optimizer state's pieces are read from in place
        common, common_path = self._read_common()
        args = common.get("args")
        self.run_config: Path | None = None  # a Megatron-Bridge run's run_config.yaml, where the model is read from
        if not isinstance(args, argparse.Namespace):
            args, common_path = self._run_config_args(common_path, options, early_notices)
            self.run_config = common_path
        content = common.get("content_metadata") or {}
        # megatron-core's singleton_local_shards naming: one key per layer and per expert, gate/up halves apart
        singleton = self._singleton = isinstance(content, dict) and content.get("singleton_local_shards") is True
        self.layout, config = model_from_args(args, common_path, options, early_notices)
        if singleton:
            refuse_singleton(config, str(common_path))
        check_declared_counts(config.to_dict(), _stored_counts(self._metadata, str(metadata_path)), str(common_path),
                              arg_name)
        validate_source_layout(self.layout, config, common_path)
        self._locations = tensor_locations(config, singleton)
        rows, training_entries = self._index(config, metadata_path)
        check_vocab_rows(args, self.layout, config, rows, common_path, metadata_path, options, early_notices)
        if iteration is None and isinstance(common.get("iteration"), int) and not release:
            iteration = common["iteration"]
        super().__init__(config, rows, iteration, release)
        self.megatron_args = args
        self.common_state = common  # the optimizer's param groups and sharding type live here too
        self.side_files = carried_side_files(self.root, iteration_dir)
        self.notices.extend(early_notices)
        self._strict = options.strict
        self._shapes = canonical_shapes(config, rows)
        self._check_extra_states()
        if self._adapter_keys:
            self.embedded_adapter = EmbeddedAdapter(iteration_dir, self._adapter_keys)
        self._training_entries = training_entries
        if training_entries:
            self.training_state_notice = (f"{training_entries} optimizer/RNG/rerun entries of the source are not "
                                          "converted: resume with --no-load-optim --no-load-rng (or --finetune)")
            self.notices.append(self.training_state_notice)

    @staticmethod
    def _check_directory(root: Path, iteration_dir: Path, options: LoadOptions) -> Path:
        """``metadata.json``, then the integrity manifest where there is one, before any other file is parsed (a
        changed byte is named as such, not as the corruption it causes); the ``.metadata`` path."""
        ensure_within(root, iteration_dir)
        read_checkpoint_config(ensure_within(root, iteration_dir / CHECKPOINT_CONFIG_FILE))
        if options.verify_integrity not in INTEGRITY_CHECKS:
            raise ValueError(f"LoadOptions.verify_integrity={options.verify_integrity!r}: one of {INTEGRITY_CHECKS}")
        if options.verify_integrity != "off":
            check_integrity(iteration_dir, data_files=options.verify_integrity == "full")
        return ensure_within(root, iteration_dir / DCP_METADATA_FILE)

    def integrity_problems(self) -> tuple[bool, list[str]]:
        return integrity_problems(self.directory)

    def has_integrity_manifest(self) -> bool:
        return (self.directory / INTEGRITY_FILE).is_file()

    def _read_common(self) -> tuple[dict[str, Any], Path]:
        """The checkpoint's common (non-sharded) state: ``common.pt`` (megatron-core 0.18 and older), or the
        ``common_state`` object stored inside the checkpoint itself (``dist_checkpointing.save`` of 0.19.0 and
        later); as megatron-core's ``load_common_state_dict``, common.pt first when there are both."""
        common_path = ensure_within(self.root, self.directory / COMMON_FILE)
        if common_path.is_file():
            common: Any = safe_torch_load(common_path)
        elif COMMON_STATE_KEY in self._metadata.state_dict_metadata:
            common_path = self._common_state_label()
            common = self._read({}, [COMMON_STATE_KEY])[COMMON_STATE_KEY]
            # saved as the data of a ShardedObject of global shape (1,): a list of one state dict
            if isinstance(common, list) and len(common) == 1:
                common = common[0]
        else:
            raise CheckpointError(f"{common_path}: missing, and {DCP_METADATA_FILE} has no {COMMON_STATE_KEY} "
                                  "entry; one of them holds the args that describe the model")
        if not isinstance(common, dict):
            raise CheckpointError(f"{common_path}: not a dict of common state ({quote(type(common).__name__)})")
        return common, common_path

    def _run_config_args(self, common_path: Path, options: LoadOptions,
                         notices: list[str]) -> tuple[argparse.Namespace, Path]:
        """A Megatron-Bridge run's store keeps no args: its model is its run_config.yaml's (``formats.megatron_bridge``);
        the file named in messages about the model is then that one."""
        run_config = run_config_beside(self.directory)
        if run_config is None:
            raise CheckpointError(f"{common_path}: no 'args' namespace, and no {RUN_CONFIG_FILE} (a Megatron-Bridge "
                                  f"run's configuration) in {self.directory} or its parent; cannot determine the "
                                  "model and layout")
        return bridge_args(run_config, options.strict, notices), run_config

    def _common_state_label(self) -> Path:
        """How messages name the ``common_state`` entry: the data file that holds it, and the entry's key."""
        stored = common_state_storage(self._metadata)
        relative = stored[1].relative_path if stored is not None else None
        where = self.directory / (relative if isinstance(relative, str) else DCP_METADATA_FILE)
        return Path(f"{where} ({COMMON_STATE_KEY})")

    def _index(self, config: ModelConfig, metadata_path: Path) -> tuple[int, int]:
        """Check every key against the model the args describe, and every chunk's file.

        Returns the vocab tables' row count and the number of training-state entries (optimizer,
        RNG) that are accounted for but not converted.
        """
        entries = self._metadata.state_dict_metadata
        tensors = {key: md for key, md in entries.items() if isinstance(md, TensorStorageMetadata)}
        embedding = tensors.get(self._locations[WORD_EMBEDDINGS].key)
        if embedding is None:
            raise CheckpointError(f"{metadata_path}: no {WORD_EMBEDDINGS}; not a GPT model checkpoint")
        rows = embedding.size[0]
        expected: dict[str, tuple[int, ...]] = {}
        holders: dict[str, list[str]] = {}  # the canonical tensors each key holds
        for name, shape in canonical_shapes(config, rows).items():
            for key, global_shape in self._locations[name].key_shapes(shape).items():
                expected.setdefault(key, global_shape)
                holders.setdefault(key, []).append(name)
        missing = sorted(set(expected) - set(tensors))
        training = sorted(key for key in entries if key not in expected and is_training_state(key))
        adapter = {key for key in entries if key not in expected and is_adapter_key(key) and not is_training_state(key)}
        self._adapter_keys = tuple(sorted(key for key in adapter if key in tensors))
        self._extra_keys = sorted(key for key, md in entries.items() if isinstance(md, BytesStorageMetadata)
                                  and is_extra_state(key) and key not in adapter)
        unexpected = sorted(set(entries) - set(expected) - set(training) - set(self._extra_keys) - adapter
                            - {COMMON_STATE_KEY})
        if missing or unexpected:
            declared = declaring_settings(config, [name for key in missing for name in holders[key]])
            raise CheckpointError(
                f"{metadata_path}: keys do not match the model described by common.pt's args "
                f"(transformer_impl={config.transformer_impl}, "
                f"{'layers stacked' if stacked_layers(config) and not self._singleton else 'one key per layer'}"
                f"{', singleton_local_shards' if self._singleton else ''}); "
                f"missing: {missing}; unexpected: {unexpected}"
                + (f"; the args declare them by {named_values(config, declared, arg_name)}" if declared else "")
            )
        vocab_keys = {self._locations[name].key for name in VOCAB_TABLES if name in self._locations}
        for key, shape in expected.items():
            found = tuple(tensors[key].size)
            # Vocab tables may have any padded row count; it is checked against the true vocab below.
            mismatch = found[1:] != shape[1:] if key in vocab_keys else found != shape
            if mismatch:
                settings = [setting for name in holders[key]
                            for setting in shape_settings(shape_function(config, name), config)]
                raise CheckpointError(
                    f"{metadata_path}: {key} has global shape {list(found)}, expected {list(shape)} "
                    f"for the model described by common.pt's args ({named_values(config, dict.fromkeys(settings), arg_name)})"
                )
        output = self._locations.get(OUTPUT_LAYER)
        if output is not None and tuple(tensors[output.key].size)[0] != rows:
            raise CheckpointError(f"{metadata_path}: {OUTPUT_LAYER} has {tensors[output.key].size[0]} rows, "
                                  f"{WORD_EMBEDDINGS} {rows}")
        return rows, len(training)

    def _check_extra_states(self) -> None:
        """Read every ``_extra_state`` entry (small) so dropped Transformer Engine state is reported."""
        objects = self._read({}, self._extra_keys)
        holding = sorted(key for key, value in objects.items()
                         if holds_state(value if isinstance(value, list) else [value]))
        if holding:
            fallback(f"{len(holding)} _extra_state entries hold Transformer Engine state (FP8 scaling "
                     f"metadata, e.g. {holding[0]}); it is not carried: FP8 runs re-derive it in their first "
                     "steps", self._strict, self.notices)

    def _read(self, regions: dict[str, list[tuple[tuple[int, ...], torch.Tensor]]],
              objects: list[str]) -> dict[str, Any]:
        return self._store.read(regions, objects)

    def _read_boxes(self, name: str, boxes: list[Region], prefix: str = "",
                    into: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
        """The given boxes of canonical tensor ``name`` (or of the tensor stored as ``prefix`` + its key,
        chunked like it: optimizer state), each read into its tensor of ``into`` (contiguous) or a fresh one."""
        location = self._locations[name]
        if prefix:
            location = dataclasses.replace(location, key=prefix + location.key)
        dtype = self._stored_dtype(location.key_shapes(self._shapes[name]), name)
        regions: dict[str, list[tuple[tuple[int, ...], torch.Tensor]]] = {}
        buffers = []
        for index, box in enumerate(boxes):
            buffer = new_tensor(box.lengths, dtype) if into is None else into[index]
            for piece in location.pieces(box.starts, box.lengths):
                rows = buffer.narrow(0, piece.row, piece.rows) if box.lengths else buffer
                regions.setdefault(piece.key, []).append((piece.offsets, rows.view(piece.sizes)))
            buffers.append(buffer)
        self._read(regions, [])
        return buffers

    def _stored_dtype(self, keys: dict[str, tuple[int, ...]], name: str) -> torch.dtype:
        """The one dtype the keys of canonical tensor ``name`` (or of its state) are stored in."""
        dtypes = set()
        for key in keys:
            md = self._metadata.state_dict_metadata.get(key)
            if not isinstance(md, TensorStorageMetadata):
                raise CheckpointError(f"{self.directory}: no tensor {quote(key)} (the state of {name})")
            dtypes.add(md.properties.dtype)
        if len(dtypes) > 1:
            raise CheckpointError(f"{self.directory}: the keys {quote(sorted(keys))} of {name} are stored in "
                                  f"different dtypes {sorted(map(str, dtypes))}; they make one tensor")
        return dtypes.pop()

    def names(self) -> list[str]:
        return list(self._locations)

    def meta(self, name: str) -> TensorMeta:
        return TensorMeta(self._shapes[name], self._stored_dtype(self._locations[name].key_shapes(self._shapes[name]),
                                                                 name))

    def describe(self) -> str:
        return str(self.directory)

    def extra_states(self) -> dict[str, ExtraState]:
        """One ``_extra_state`` per module is stored, not per rank, and not carried (``_check_extra_states``)."""
        assert self.layout is not None
        return te_extra_states(self.config, self.layout)

    def holds_training_state(self) -> bool:
        return self._training_entries > 0 or any(key in self.common_state for key in TRAINING_STATE_KEYS)

    def holds_optimizer(self) -> bool:
        return "optimizer" in self.common_state

    def stored_optimizer_form(self) -> str | None:
        """The distributed optimizer's ``param_state_sharding_type`` (None: a plain optimizer's, or none); a
        common state that does not name a form pgconvert reads raises (``open_optimizer`` names it)."""
        return sharding_type(self.common_state, f"{self.directory} (common state)")

    def optimizer_refusal(self) -> str | None:
        """A Megatron-Bridge run's optimizer state is not read (its optimizer settings are its run_config.yaml's, not
        the args the reader reads), nor state saved with singleton local shards."""
        if self.run_config is not None:
            return (f"{self.directory}: a Megatron-Bridge run's optimizer state (its settings in {self.run_config.name}'s "
                    "optimizer section, no args) is not read; pass --skip-optimizer")
        if self._singleton:
            return (f"{self.directory}: optimizer state saved with singleton_local_shards=True (records per expert "
                    "and per gate/up half) is not read; pass --skip-optimizer")
        return None

    def open_optimizer(self) -> TorchDistOptimizerSource:
        return TorchDistOptimizerSource(self)

    def _load(self, name: str, prefix: str = "") -> torch.Tensor:
        shape = self._shapes[name]
        return self._read_boxes(name, [Region((0,) * len(shape), shape)], prefix)[0]

    def _load_shard(self, name: str, rule: ShardRule, size: int, rank: int, rows: int | None,
                    prefix: str = "", dtype: torch.dtype | None = None) -> torch.Tensor:
        return read_piece(self._shapes[name], rule, size, rank, rows, self.config.vocab_size,
                          dtype or self.meta(name).dtype,
                          lambda boxes, into: self._read_boxes(name, boxes, prefix, into))

    def _shares_piece_reads(self, name: str, rule: ShardRule, size: int, rows: int | None) -> bool:
        """A piece strided in the whole tensor whose stored chunks hold more than it (a row-parallel weight saved
        at fewer TP ranks) is read by those chunks' whole file spans."""
        shape = self._shapes[name]
        if not strided_in_whole(rule, shape, size, rows, self.config.vocab_size):
            return False
        needed = overlapped = 0
        for window in rule.piece_windows(shape, size, 0, rows, self.config.vocab_size):
            if window.zeros:
                continue
            box = region_box(shape, window.dim, window.start, window.length)
            for piece in self._locations[name].pieces(box.starts, box.lengths):
                needed += numel(piece.sizes)
                overlapped += sum(numel(chunk.sizes) for chunk in self._metadata.state_dict_metadata[piece.key].chunks
                                  if _overlaps(chunk.offsets, chunk.sizes, piece.offsets, piece.sizes))
        return overlapped > needed

    # Optimizer state read in place, like the model's tensors (loaders/torch_dist/optimizer.py).
    def load_state(self, name: str, prefix: str) -> torch.Tensor:
        """The whole tensor stored as ``prefix`` + ``name``'s key, chunked like the model's."""
        return self._load(name, prefix)

    def load_state_shard(self, name: str, prefix: str, rule: ShardRule, size: int, rank: int,
                         rows: int | None) -> torch.Tensor:
        """Piece ``rank`` of ``size`` of that tensor, cut with ``rule`` (new vocab rows zero)."""
        return self._load_shard(name, rule, size, rank, rows, prefix, torch.float32)

    def load_flattened_state(self, name: str, prefix: str) -> torch.Tensor:
        """The whole tensor stored as ``prefix`` + ``name``'s key in the reformulated form megatron-core
        <= 0.15 gives a flattened_range ShardedTensor (``loaders/torch_dist/fs_model_space.py``): read as the
        record's box of ``name``'s chunks (a stacked key: its layer), then put back in the model tensor's shape."""

        location = self._locations[name]
        key = prefix + location.key
        md = self._metadata.state_dict_metadata.get(key)
        if not isinstance(md, TensorStorageMetadata):
            raise CheckpointError(f"{self.directory}: no tensor {quote(key)} (the state of {name})")
        shape = self._shapes[name]
        where = f"{self.directory}: {quote(key)}"
        local = chunk_shape(tuple(md.size), location.global_shape(shape), where)
        offsets, sizes = record_box(*location.chunk((0,) * len(shape), shape), local, md.size[-1], where)
        buffer = new_tensor(sizes, md.properties.dtype)
        self._read({key: [(offsets, buffer)]}, [])
        return unflatten(buffer, local, location.chunk((0,) * len(shape), shape)[1]).view(shape)

    def load_flat(self, key: str, start: int, length: int) -> torch.Tensor:
        """Elements ``[start, start + length)`` of the one-dimensional tensor ``key``."""
        md = self._metadata.state_dict_metadata.get(key)
        if not isinstance(md, TensorStorageMetadata) or len(md.size) != 1 or start + length > md.size[0]:
            size = list(md.size) if isinstance(md, TensorStorageMetadata) else None
            raise CheckpointError(f"{self.directory}: {quote(key)} has shape {size}; elements "
                                  f"[{start}, {start + length}) are needed")
        buffer = new_tensor((length,), md.properties.dtype)
        self._read({key: [((start,), buffer)]}, [])
        return buffer

    def flat_meta(self, key: str, start: int, length: int) -> torch.Tensor | None:
        """Elements ``[start, start + length)`` of the one-dimensional tensor ``key`` left in their data file (a meta
        tensor ``io.torch_input.StoredTensors`` reads), where one stored chunk holds them as they are; else None."""
        region = self._store.flat_region(key, start, length)
        return None if region is None else meta_at(region)

    def close(self) -> None:
        self.handles.close()

    def tensor_keys(self) -> dict[str, tuple[int, ...]]:
        """Every stored tensor key and its global shape."""
        return {key: tuple(md.size) for key, md in self._metadata.state_dict_metadata.items()
                if isinstance(md, TensorStorageMetadata)}

    def model_key(self, name: str) -> str:
        """The key ``name`` is stored under (a stacked key holds every layer's)."""
        return self._locations[name].key

    def model_keys(self, name: str) -> list[str]:
        """Every key ``name`` is stored in: its key, or one per segment of its rows (a gated delta net's or Mamba
        mixer's ``in_proj``)."""
        return list(self._locations[name].key_shapes(self._shapes[name]))

    def holds_entry(self, key: str) -> bool:
        """Whether the checkpoint's index has the entry ``key`` (a tensor or a stored object)."""
        return key in self._metadata.state_dict_metadata

    def read_objects(self, keys: list[str]) -> dict[str, Any]:
        """Stored objects (ShardedObjects' ``key/shard_...`` entries), unpickled with the allowlist."""
        missing = [key for key in keys if key not in self._metadata.state_dict_metadata]
        if missing:
            raise CheckpointError(f"{self.directory}: no stored object {quote(missing)}")
        return self._read({}, keys)


def _stored_counts(metadata: Metadata, where: str) -> StoredCounts:
    """The decoder layers, routed experts per layer and MTP layers a checkpoint's index holds: one
    key per layer (``decoder.layers.{i}.…``, a VL model's under ``language_model.``) or the leading layer axis of
    stacked keys; the expert axis of the experts' keys (after the layer axis of stacked ones); one key per MTP
    layer."""
    layers: set[int] = set()
    stacked = experts = 0
    mtp: set[int] = set()
    for stored_key, md in metadata.state_dict_metadata.items():
        if not isinstance(md, TensorStorageMetadata) or not md.size:
            continue
        key = stored_key.removeprefix(LANGUAGE_MODEL_MODULE)  # a VL model's language model (pgconvert.model.vision)
        for prefix, indices in ((LAYER_PREFIX, layers), (MTP_PREFIX, mtp)):
            index = key[len(prefix):].partition(".")[0] if key.startswith(prefix) else ""
            if index.isdigit():
                indices.add(int(index))
        layer_axis = key.startswith(LAYER_PREFIX) and not key[len(LAYER_PREFIX):].partition(".")[0].isdigit()
        if layer_axis:
            stacked = max(stacked, md.size[0])
        if EXPERTS_KEY in key and len(md.size) > int(layer_axis):
            experts = max(experts, md.size[int(layer_axis)])
    return StoredCounts(where, max(len(layers), stacked), experts, len(mtp))


def _overlaps(offsets: Sequence[int], sizes: Sequence[int], other_offsets: Sequence[int],
              other_sizes: Sequence[int]) -> bool:
    """Whether two boxes of one tensor share an element."""
    return all(start < other + other_size and other < start + size
               for start, size, other, other_size in zip(offsets, sizes, other_offsets, other_sizes, strict=True))
