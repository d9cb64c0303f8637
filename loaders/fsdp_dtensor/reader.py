"""Reading Megatron-FSDP checkpoints (``fsdp_dtensor``: one DCP store, the args inside it).

The keys and what they hold are in ``pgconvert/formats/fsdp_dtensor.py``. Tensors are read from the store
with no process group (``pgconvert/formats/dcp_store.py``, as torch_dist's are): each request is a box of a
canonical tensor read straight into its buffer; a gated ``linear_fc1``'s box is read from the gate key and
the up key into the two row ranges of one buffer.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from pgconvert.io.dcp_plan import BytesStorageMetadata, TensorStorageMetadata
from pgconvert.errors import CheckpointError, LayoutError
from pgconvert.formats import LoadOptions
from pgconvert.formats.dcp_store import (DcpStore, Region, check_vocab_rows, model_from_args, read_piece,
                                         te_extra_states)
from pgconvert.formats.fsdp_dtensor import (ARGS_KEY, COMMON_KEYS, FLOPS_KEY, FSDP_DTENSOR_FORM, ITERATION_KEY,
                                            MODEL_PREFIX, OPTIMIZER_GROUP_PREFIX, OPTIMIZER_STATE_PREFIX,
                                            NO_PIPELINE, SCHEDULER_PREFIX, FsdpLocation, is_training_state,
                                            refuse_unknown_keys, tensor_locations)
from pgconvert.formats.hf_side import carried_side_files
from pgconvert.formats.megatron import arg_name, validate_source_layout
from pgconvert.formats.mtp_naming import mtp_module_of
from pgconvert.formats.stream import CanonicalSource, ExtraState, TensorMeta
from pgconvert.formats.dcp_layout import DCP_METADATA_FILE
from pgconvert.formats.torch_dist import read_dcp_metadata
from pgconvert.io.limits import quote
from pgconvert.io.paths import ensure_within
from pgconvert.io.reuse import new_tensor
from pgconvert.model.config import ModelConfig
from pgconvert.model.declared import StoredCounts, check_declared_counts
from pgconvert.model.provider import (MTP_PREFIX, VOCAB_TABLES, WORD_EMBEDDINGS, canonical_layer, canonical_shapes,
                                      expert_of_key)
from pgconvert.model.rules import ShardRule
from pgconvert.optimizer.order import UnsupportedOptimizerError

if TYPE_CHECKING:
    from pgconvert.optimizer.source import OptimizerSource


class FsdpDtensorSource(CanonicalSource):
    """One iteration of a Megatron-FSDP checkpoint: its index is read up front, tensors on demand."""

    format_name = "fsdp_dtensor"

    def __init__(self, iteration_dir: Path, iteration: int | None, release: bool, options: LoadOptions,
                 root: Path | None = None) -> None:
        self.directory = iteration_dir
        self.root = root or iteration_dir
        notices: list[str] = []
        metadata_path = ensure_within(self.root, iteration_dir / DCP_METADATA_FILE)
        self._metadata = read_dcp_metadata(metadata_path)
        self._store = DcpStore(iteration_dir, self._metadata, self.root)
        self._store.check_files(metadata_path)
        common = self._read_common(metadata_path)
        args = common[ARGS_KEY]
        where = iteration_dir / ARGS_KEY
        self.layout, config = model_from_args(args, where, options, notices)
        if self.layout.pp > 1 or self.layout.vpp:
            raise LayoutError(f"{where}: pipeline_model_parallel_size={self.layout.pp}, virtual stages "
                              f"{self.layout.vpp}: not read: {NO_PIPELINE}")
        refuse_unknown_keys(config, str(where))
        config = self._with_mtp_spelling(config, metadata_path)
        check_declared_counts(config.to_dict(), self._stored_counts(metadata_path), str(where), arg_name)
        validate_source_layout(self.layout, config, where)
        rows = self._vocab_rows(metadata_path)
        self._locations = tensor_locations(config, rows)
        training_entries = self._index(config, rows, metadata_path)
        check_vocab_rows(args, self.layout, config, rows, where, metadata_path, options, notices)
        if iteration is None and isinstance(common.get(ITERATION_KEY), int) and not release:
            iteration = common[ITERATION_KEY]
        super().__init__(config, rows, iteration, release)
        self.megatron_args = args
        self.side_files = carried_side_files(self.root, iteration_dir)
        self.notices.extend(notices)
        self._shapes = canonical_shapes(config, rows)
        self._training_entries = training_entries
        self._note_main_weights(args)
        if training_entries:
            self.training_state_notice = (f"{training_entries} optimizer/scheduler/RNG entries of the source are "
                                          "not converted: resume with --no-load-optim --no-load-rng (or --finetune)")
            self.notices.append(self.training_state_notice)

    def _note_main_weights(self, args: argparse.Namespace) -> None:
        """Megatron-FSDP saves the optimizer's main weights (fp32) as the model even in a bf16/fp16 run; a
        conversion keeps their dtype unless ``--dtype`` asks for the run's."""
        run_dtype = "bf16" if getattr(args, "bf16", False) else "fp16" if getattr(args, "fp16", False) else None
        stored = {self.meta(name).dtype for name in self.names()}
        if run_dtype and stored == {torch.float32}:
            self.notices.append(f"{self.directory}: the run trained in {run_dtype} (--{run_dtype}), but Megatron-FSDP "
                                f"stores its fp32 main weights: they are written as fp32 unless --dtype {run_dtype} "
                                "asks for the run's dtype")

    def _read_common(self, metadata_path: Path) -> dict[str, Any]:
        """``args`` and ``iteration``, the store's own bytes entries; a store without Megatron-FSDP's model
        keys (torch_dcp, a plain DCP save) is named as such."""
        entries = self._metadata.state_dict_metadata
        if not any(key.startswith(MODEL_PREFIX) for key in entries):
            raise CheckpointError(f"{metadata_path}: no {MODEL_PREFIX}* entries: a DCP store, but not one of "
                                  "Megatron-FSDP (--ckpt-format fsdp_dtensor); torch_dcp checkpoints are not read")
        if not isinstance(entries.get(ARGS_KEY), BytesStorageMetadata):
            raise CheckpointError(f"{metadata_path}: no {ARGS_KEY!r} entry; cannot determine the model and layout")
        common = self._store.read({}, [key for key in (ARGS_KEY, ITERATION_KEY) if key in entries])
        if not isinstance(common[ARGS_KEY], argparse.Namespace):
            raise CheckpointError(f"{self.directory}: {ARGS_KEY!r} is {quote(type(common[ARGS_KEY]).__name__)}, "
                                  "not Megatron's argparse.Namespace")
        return common

    def _with_mtp_spelling(self, config: ModelConfig, metadata_path: Path) -> ModelConfig:
        """The config naming an MTP layer's inner layer as the optimizer's ``param_to_group_meta`` does: the live
        module's name (``mtp_model_layer`` in Megatron-LM d98e8a64), which the model and state keys do not keep
        (``handle_mtp_in_state_dict`` renames those to ``transformer_layer``) and a load looks its parameters up by."""
        names = []
        for key in self._metadata.state_dict_metadata:
            at = key.find(MTP_PREFIX) if key.startswith(OPTIMIZER_GROUP_PREFIX) else -1
            if at >= 0:
                names.append(key[at:])
        spelling = mtp_module_of(names, metadata_path)
        return config.replace(mtp_layer_module=spelling) if spelling else config

    def _stored_counts(self, metadata_path: Path) -> StoredCounts:
        """The decoder layers and MTP layers the model keys hold, and the most routed experts one layer holds
        (Megatron-LM stores each expert under its global index)."""
        layers: set[int] = set()
        mtp: set[str] = set()
        experts: dict[str, set[int]] = {}
        for key in (key[len(MODEL_PREFIX):] for key in self._metadata.state_dict_metadata
                    if key.startswith(MODEL_PREFIX)):
            layer = canonical_layer(key)
            if layer is not None:
                layers.add(layer[0])
            elif key.startswith(MTP_PREFIX) and key[len(MTP_PREFIX):].partition(".")[0].isdigit():
                mtp.add(key[len(MTP_PREFIX):].partition(".")[0])
            found = expert_of_key(key)
            if found is not None:
                experts.setdefault(found[0], set()).add(found[1])
        return StoredCounts(str(metadata_path), len(layers), max(map(len, experts.values()), default=0), len(mtp))

    def _vocab_rows(self, metadata_path: Path) -> int:
        md = self._metadata.state_dict_metadata.get(MODEL_PREFIX + WORD_EMBEDDINGS)
        if not isinstance(md, TensorStorageMetadata) or len(md.size) != 2:
            raise CheckpointError(f"{metadata_path}: no {MODEL_PREFIX + WORD_EMBEDDINGS} matrix; "
                                  "not a GPT model checkpoint")
        return md.size[0]

    def _index(self, config: ModelConfig, rows: int, metadata_path: Path) -> int:
        """Every key against the model the args describe: the missing and unexpected ones, and shapes.
        Returns the number of training-state entries (accounted for, not converted)."""
        entries = self._metadata.state_dict_metadata
        expected: dict[str, tuple[int, ...]] = {}
        for name, shape in canonical_shapes(config, rows).items():
            location = self._locations[name]
            for key, _, length in location.parts(shape[0]):
                expected[key] = (length, *shape[1:])
        training = [key for key in entries if key not in expected and is_training_state(key)]
        missing = sorted(set(expected) - set(entries))
        unexpected = sorted(set(entries) - set(expected) - set(training) - set(COMMON_KEYS))
        if missing or unexpected:
            raise CheckpointError(f"{metadata_path}: keys do not match the model described by its args "
                                  f"(transformer_impl={config.transformer_impl}, swiglu={config.gated_linear_unit}); "
                                  f"missing: {missing}; unexpected: {unexpected}")
        for key, shape in expected.items():
            md = entries[key]
            found = tuple(md.size) if isinstance(md, TensorStorageMetadata) else None
            if found != shape:
                raise CheckpointError(f"{metadata_path}: {key} has global shape {quote(found and list(found))}, "
                                      f"expected {list(shape)} for the model described by its args")
        for name in VOCAB_TABLES:
            if name in self._locations and expected[self._locations[name].keys[0]][0] != rows:
                raise CheckpointError(f"{metadata_path}: {name} and {WORD_EMBEDDINGS} differ in rows")
        self._check_halves(metadata_path)
        return len(training)

    def _check_halves(self, metadata_path: Path) -> None:
        for location in self._locations.values():
            dtypes = {self._dtype(key) for key in location.keys}
            if len(dtypes) > 1:
                raise CheckpointError(f"{metadata_path}: {', '.join(location.keys)} are stored in different "
                                      f"dtypes ({sorted(map(str, dtypes))})")

    def _dtype(self, key: str) -> torch.dtype:
        md = self._metadata.state_dict_metadata[key]
        assert isinstance(md, TensorStorageMetadata)
        return md.properties.dtype

    def _read_boxes(self, name: str, boxes: list[Region], location: FsdpLocation | None = None,
                    dtype: torch.dtype | None = None, into: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
        """The given boxes of canonical tensor ``name`` (or of what ``location``'s keys hold of it: its optimizer
        state), each read into its tensor of ``into`` (contiguous) or a fresh one; a box spanning a gated fc1's
        halves is read from both keys into its two row ranges."""
        location = location or self._locations[name]
        rows = self._shapes[name][0]
        regions: dict[str, list[tuple[tuple[int, ...], torch.Tensor]]] = {}
        buffers = []
        for index, box in enumerate(boxes):
            buffer = new_tensor(box.lengths, dtype or self.meta(name).dtype) if into is None else into[index]
            buffers.append(buffer)
            first, last = box.starts[0], box.starts[0] + box.lengths[0]
            for key, start, length in location.parts(rows):
                low, high = max(first, start), min(last, start + length)
                if low < high:
                    offsets = (low - start, *box.starts[1:])
                    regions.setdefault(key, []).append((offsets, buffer.narrow(0, low - first, high - low)))
        self._store.read(regions, [])
        return buffers

    def names(self) -> list[str]:
        return list(self._locations)

    def meta(self, name: str) -> TensorMeta:
        return TensorMeta(self._shapes[name], self._dtype(self._locations[name].keys[0]))

    def describe(self) -> str:
        return str(self.directory)

    def stored_names(self, name: str) -> list[str]:
        return list(self._locations[name].keys)

    def extra_states(self) -> dict[str, ExtraState]:
        """None stored (Megatron-LM drops every ``_extra_state`` before saving); a Transformer Engine target
        gets the entries its state dicts require, empty, as from torch_dist."""
        assert self.layout is not None
        return te_extra_states(self.config, self.layout)

    def holds_training_state(self) -> bool:
        return self._training_entries > 0

    def holds_optimizer(self) -> bool:
        return any(key.startswith(OPTIMIZER_STATE_PREFIX) for key in self._metadata.state_dict_metadata)

    def stored_optimizer_form(self) -> str | None:
        return FSDP_DTENSOR_FORM if self.holds_optimizer() else None

    def open_optimizer(self) -> OptimizerSource:
        from pgconvert.loaders.fsdp_dtensor.optimizer import FsdpDtensorOptimizerSource

        if not self.holds_optimizer():
            raise UnsupportedOptimizerError(f"{self.directory}: no optimizer.* entries (saved with --no-save-optim?): "
                                            "no optimizer state to carry; pass --skip-optimizer")
        return FsdpDtensorOptimizerSource(self)

    # What the optimizer reader (``loaders/fsdp_dtensor/optimizer.py``) reads of the store.
    def entry_metadata(self) -> dict[str, Any]:
        return self._metadata.state_dict_metadata

    def entry_names(self) -> list[str]:
        return list(self._metadata.state_dict_metadata)

    def location(self, name: str) -> FsdpLocation:
        return self._locations[name]

    def read_whole(self, key: str, shape: tuple[int, ...]) -> torch.Tensor:
        """Tensor entry ``key`` (of global ``shape``, fp32) whole."""
        buffer = new_tensor(shape, torch.float32)
        self._store.read({key: [((0,) * len(shape), buffer)]}, [])
        return buffer

    def group_metas(self, prefix: str) -> dict[str, dict[str, Any]]:
        """Per parameter name, its ``prefix<name>.<field>`` bytes entries as ``{field: value}``."""
        keys = [key for key, md in self.entry_metadata().items()
                if key.startswith(prefix) and isinstance(md, BytesStorageMetadata)]
        metas: dict[str, dict[str, Any]] = {}
        for key, value in self._store.read({}, keys).items():
            name, _, field = key[len(prefix):].rpartition(".")
            metas.setdefault(name, {})[field] = value
        return metas

    def common_entries(self) -> dict[str, Any]:
        """The carried counters: ``iteration``, ``num_floating_point_operations_so_far`` and the scheduler (its
        ``opt_param_scheduler.<field>`` entries as one dict), where stored."""
        entries = self.entry_metadata()
        keys = [key for key in entries if key in (ITERATION_KEY, FLOPS_KEY) or key.startswith(SCHEDULER_PREFIX)]
        read = self._store.read({}, keys)
        common = {key: read[key] for key in (ITERATION_KEY, FLOPS_KEY) if key in read}
        scheduler = {key[len(SCHEDULER_PREFIX):]: value for key, value in read.items()
                     if key.startswith(SCHEDULER_PREFIX)}
        if scheduler:
            common["opt_param_scheduler"] = scheduler
        return common

    def read_state_piece(self, name: str, location: FsdpLocation, rule: ShardRule, size: int, rank: int,
                         rows: int | None) -> torch.Tensor:
        """Piece ``rank`` of ``size`` (cut with ``rule``) of what ``location``'s keys hold of ``name`` (fp32)."""
        return read_piece(self._shapes[name], rule, size, rank, rows, self.config.vocab_size, torch.float32,
                          lambda boxes, into: self._read_boxes(name, boxes, location, torch.float32, into))

    def _load(self, name: str) -> torch.Tensor:
        shape = self._shapes[name]
        return self._read_boxes(name, [Region((0,) * len(shape), shape)])[0]

    def _load_shard(self, name: str, rule: ShardRule, size: int, rank: int, rows: int | None) -> torch.Tensor:
        return read_piece(self._shapes[name], rule, size, rank, rows, self.config.vocab_size, self.meta(name).dtype,
                          lambda boxes, into: self._read_boxes(name, boxes, into=into))
