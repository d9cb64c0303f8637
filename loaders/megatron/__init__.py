"""Loader for Megatron-LM per-rank checkpoints (``mp_rank_*/model_optim_rng.pt``)."""

from __future__ import annotations

import argparse
import logging
import threading
from collections import defaultdict
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pgconvert.model.config import ModelConfig
from pgconvert.errors import CheckpointError, ValidationError
from pgconvert.formats import Iteration, Loader, LoadOptions
from pgconvert.model.grid import RankCoord, build_converter_process_groups, iter_ranks
from pgconvert.formats.hf_side import carried_side_files
from pgconvert.model.layout import ParallelLayout
from pgconvert.io.limits import MAX_LISTED_MISSING, quote
from pgconvert.formats.megatron import (
    ITERATION_DIR_RE,
    RANK_DIR_RE,
    RANK_FILE,
    TRACKER_FILE,
    TRAINING_STATE_KEYS,
    arg_name,
    check_megatron_layout,
    is_adapter_key,
    check_vocab_multiple,
    config_from_args,
    layout_from_args,
    list_megatron_iterations,
    rank_dir_name,
    resolve_megatron_iteration,
    safe_torch_structure,
    validate_source_layout,
)
from pgconvert.loaders.megatron.optimizer import MegatronOptimizerSource
from pgconvert.io.ranges import FileHandles, concat_reading
from pgconvert.io.reuse import nothing_lent
from pgconvert.io.torch_input import StoredTensors, stored_differing
from pgconvert.formats.megatron_args import MEGATRON_DEFAULTS
from pgconvert.formats.mtp_naming import canonical_mtp_key, mtp_module_of
from pgconvert.io.paths import ensure_within
from pgconvert.model.declared import StoredCounts, check_declared_counts, declaring_settings, named_values, shape_settings
from pgconvert.model.provider import (
    EXTRA_STATE_SUFFIX,
    GROUPED_EXPERT_RE,
    LAYER_PREFIX,
    MTP_PREFIX,
    WORD_EMBEDDINGS,
    TensorSpec,
    canonical_layer,
    canonical_names,
    expert_of_key,
    layer_spec_of_key,
    non_layer_chunk,
    provide,
    shape_function,
)
from pgconvert.model.rules import ReplicaMismatchError, ShardRule, concatenating_with, shares_memory, strided_in_whole
from pgconvert.formats.stream import CanonicalSource, ExtraState, TensorMeta
from pgconvert.formats.strict import fallback
from pgconvert.formats.vision_args import is_vision_language, unwrapped

log = logging.getLogger(__name__)

# Rotary frequencies are recomputed from the config by every framework; they are not weights.
IGNORED_SUFFIXES = (".inv_freq",)


@dataclass(frozen=True)
class _Piece:
    """Where one rank's piece of a canonical tensor lives."""

    coord: RankCoord
    chunk: str
    spec: TensorSpec


class MegatronLoader(Loader):
    name = "megatron"

    def detect(self, path: Path) -> bool:
        if not path.is_dir():
            return False
        if _is_distributed_checkpoint(path):
            return False
        if (path / TRACKER_FILE).is_file() or (path / "release").is_dir():
            return True
        if any(ITERATION_DIR_RE.match(child.name) for child in path.iterdir() if child.is_dir()):
            return True
        return any(RANK_DIR_RE.match(child.name) for child in path.iterdir() if child.is_dir())

    def open(self, path: Path, options: LoadOptions) -> MegatronSource:
        iteration_dir, iteration, release = resolve_iteration_dir(path, options.iteration)
        return MegatronSource(iteration_dir, iteration, release, options, root=path)

    def iterations(self, path: Path) -> list[Iteration]:
        return list_megatron_iterations(path, _holds_rank_dirs)


def _is_distributed_checkpoint(path: Path) -> bool:
    """Megatron's torch_dist and fsdp_dtensor layouts share the tracker file and iter_* names but have no rank
    dirs: an iteration is a DCP store (``.metadata``; torch_dist's also ``metadata.json``)."""
    candidates = [path, *(child for child in path.iterdir()
                          if child.is_dir() and (child.name == "release" or ITERATION_DIR_RE.match(child.name)))]
    if not any((candidate / marker).is_file() for candidate in candidates for marker in ("metadata.json", ".metadata")):
        return False
    return not any(RANK_DIR_RE.match(grandchild.name)
                   for candidate in candidates for grandchild in candidate.iterdir() if grandchild.is_dir())


def _holds_rank_dirs(path: Path) -> bool:
    return any(RANK_DIR_RE.match(child.name) for child in path.iterdir() if child.is_dir())


def resolve_iteration_dir(root: Path, iteration: int | None) -> tuple[Path, int | None, bool]:
    """The iteration directory to read: ``--iteration``, else the tracker file, else the only one."""
    return resolve_megatron_iteration(root, iteration, _holds_rank_dirs)


def _detect_impl(model: dict[str, Any], args: argparse.Namespace) -> str:
    # Only the fused norm names tell the specs apart: megatron-core's local-spec linears write
    # ``_extra_state`` entries (None) too.
    specs = {layer_spec_of_key(key) for key in model}
    for impl in ("transformer_engine", "local"):
        if impl in specs:
            return impl
    # Without the field (Megatron-LM before --transformer-impl) the local spec; None (which Megatron-LM never
    # writes; layout_from_args names it) is its default, Transformer Engine.
    recorded = getattr(args, "transformer_impl", "local")
    if recorded is None:
        recorded = MEGATRON_DEFAULTS["transformer_impl"]
    return "transformer_engine" if recorded == "transformer_engine" else "local"


def _detect_grouped_gemm(model: dict[str, Any]) -> bool:
    return any(GROUPED_EXPERT_RE.search(key) for key in model)


def _chunk_keys(layout: ParallelLayout) -> list[str]:
    """Megatron's model keys in a rank file: ``model``, or ``model0…`` with a virtual pipeline."""
    if layout.has_virtual_chunks:
        return [f"model{index}" for index in range(layout.virtual_size)]
    return ["model"]


def _rank_dirs(iteration_dir: Path) -> dict[str, Path]:
    """The ``mp_rank_*`` directories of one iteration, by name."""
    rank_dirs = {
        child.name: child for child in sorted(iteration_dir.iterdir())
        if child.is_dir() and RANK_DIR_RE.match(child.name)
    }
    if not rank_dirs:
        raise CheckpointError(f"{iteration_dir}: no mp_rank_* directories")
    return rank_dirs


def _expected_ranks(iteration_dir: Path, layout: ParallelLayout, rank_dirs: dict[str, Path]) -> dict[str, RankCoord]:
    """The rank directory of each rank of ``layout``; refuses missing or unexpected directories."""
    expected = {
        rank_dir_name(c.tp, c.pp, c.ep, layout.pp, layout.ep): c for c in iter_ranks(layout)
    }
    missing = sorted(set(expected) - set(rank_dirs))
    unexpected = sorted(set(rank_dirs) - set(expected))
    if missing:
        raise CheckpointError(
            f"{iteration_dir}: missing rank files for {layout.describe()} (from args): "
            + ", ".join(f"{name}/{RANK_FILE}" for name in missing)
        )
    if unexpected:
        raise CheckpointError(
            f"{iteration_dir}: unexpected rank directories for {layout.describe()} (from args): "
            + ", ".join(unexpected)
        )
    return expected


def _refuse_adapter(where: str, unexpected: list[str]) -> None:
    """A rank file that holds a LoRA adapter's keys beside the model's: Megatron-Bridge and NeMo save a LoRA run as
    torch_dist (their per-rank ``torch`` format is for local, non-persistent checkpoints), which is where pgconvert
    reads an adapter beside a model."""
    adapter = sorted(key for key in unexpected if is_adapter_key(key))
    if adapter:
        raise ValidationError(f"{where}: holds LoRA adapter keys beside the model ({len(adapter)}, e.g. {adapter[0]}): "
                              "an adapter is read beside its model from a torch_dist checkpoint only (what "
                              "Megatron-Bridge saves); save the run with ckpt_format='torch_dist', or the adapter "
                              "alone, and pass it to --merge-adapter")


class MegatronSource(CanonicalSource):
    """All rank files of one iteration, read as their structure: a tensor over 64 KiB stays in its file (a meta
    tensor that knows its bytes' place, ``io.torch_input.stored_region``) until a merge reads it into place;
    nothing is memory-mapped."""

    format_name = "megatron"
    # megatron-core's plain Muon and Lion optimizers too (loaders/megatron/optimizer.py)
    optimizer_kinds = ("adam", "muon", "lion")

    def __init__(self, iteration_dir: Path, iteration: int | None, release: bool, options: LoadOptions,
                 root: Path | None = None) -> None:
        self.directory = iteration_dir
        self.root = root or iteration_dir
        self._early_notices: list[str] = []
        ensure_within(self.root, iteration_dir)
        rank_dirs = _rank_dirs(iteration_dir)
        first_name = min(rank_dirs)
        # The rank files (and the distributed optimizer's files beside them) open for reading; closed with the source.
        self.handles = FileHandles()
        self._stored = StoredTensors(self.handles)
        first_file, first_state, args = self._read_first(rank_dirs[first_name] / RANK_FILE)
        self._first_keys = set(first_state)  # what the first rank file holds besides the model
        # A VL model's rank files hold the language model under ``language_model.`` (pgconvert.formats.vision_args).
        self._vision_language = is_vision_language(args)
        layout = layout_from_args(args, first_file, options.strict, self._early_notices)
        check_megatron_layout(layout, "src", first_file)
        self.layout = layout
        options.check_layout(layout, first_file)
        _check_sizes_against_files(layout, len(rank_dirs), len(first_state), first_file)
        expected = _expected_ranks(iteration_dir, layout, rank_dirs)
        chunk_keys = _chunk_keys(layout)
        self.files: dict[RankCoord, Path] = {}
        models: dict[tuple[RankCoord, str], dict[str, Any]] = {}
        for name, coord in expected.items():
            state = first_state if name == first_name else None
            self._read_rank(rank_dirs[name] / RANK_FILE, coord, state, chunk_keys, models)
        config = self._config(models, args, first_file, options)
        validate_source_layout(layout, config, first_file)
        padded = self._padded_rows(args, models[(RankCoord(0, 0), chunk_keys[0])], config, first_file, options)
        super().__init__(config, padded, iteration, release)
        self.megatron_args = args
        self.side_files = carried_side_files(self.root, iteration_dir)
        self.notices.extend(self._early_notices)
        self._models = models
        self._pieces: dict[str, list[_Piece]] = defaultdict(list)
        self._extra: dict[str, ExtraState] = {}
        self._verified: set[str] = set()
        # Two files produced at once (``--threads``) may ask for the same tensor: one verifies it, the other waits.
        self._verifying = threading.Lock()
        self._index(padded, chunk_keys)
        self._order = canonical_names(config)
        uncovered = sorted(set(self._order) - set(self._pieces))
        if uncovered:
            raise CheckpointError(f"{iteration_dir}: no rank holds {uncovered}")

    def _read_first(self, first_file: Path) -> tuple[Path, dict[str, Any], argparse.Namespace]:
        """The first rank file, its state and the ``args`` namespace it carries."""
        if not first_file.is_file():
            raise CheckpointError(f"{first_file}: missing rank file")
        ensure_within(self.root, first_file)
        first_state = safe_torch_structure(first_file)
        args = first_state.get("args")
        if not isinstance(args, argparse.Namespace):
            raise CheckpointError(f"{first_file}: no 'args' namespace; cannot determine the model and layout")
        return first_file, first_state, args

    def _read_rank(self, path: Path, coord: RankCoord, read: dict[str, Any] | None,
                   chunk_keys: list[str], models: dict[tuple[RankCoord, str], dict[str, Any]]) -> None:
        """Record rank ``coord``'s file and add its model chunks to ``models`` (``read``: its state, already read)."""
        if not path.is_file():
            raise CheckpointError(f"{path}: missing rank file")
        ensure_within(self.root, path)
        state = safe_torch_structure(path) if read is None else read
        present = sorted(key for key in state if isinstance(key, str)
                         and (key == "model" or (key.startswith("model") and key[5:].isdigit())))
        if present != sorted(chunk_keys):
            raise CheckpointError(
                f"{path}: model chunks {present or 'none'} do not match the layout {self.layout.describe()} "
                f"from args (expected {chunk_keys})"
            )
        self.files[coord] = path
        for chunk_key in chunk_keys:
            models[(coord, chunk_key)] = self._named(_model_dict(state[chunk_key], path, chunk_key), path)

    def _named(self, model: dict[str, Any], path: Path) -> dict[str, Any]:
        """A model chunk by the GPT names pgconvert uses (a VL model's language model unwrapped)."""
        return unwrapped(model, path) if self._vision_language else model

    def _config(self, models: dict[tuple[RankCoord, str], dict[str, Any]], args: argparse.Namespace,
                first_file: Path, options: LoadOptions) -> ModelConfig:
        """The model's config from ``args``, with the layer spec told apart by the TP-rank-0 keys."""
        all_first_keys = [key for (coord, _), model in models.items() if coord.tp == 0 for key in model]
        impl = _detect_impl(dict.fromkeys(all_first_keys), args)
        if not any(layer_spec_of_key(key) for key in all_first_keys):
            fallback(f"{first_file}: no norm keys tell the layer spec apart; assuming "
                     f"transformer_impl={impl!r} from args", options.strict, self._early_notices)
        config = config_from_args(args, first_file, impl, options.true_vocab_size,
                                  grouped_gemm=_detect_grouped_gemm(dict.fromkeys(all_first_keys)))
        stored = _stored_counts(models, self.layout.ep, f"the rank files in {self.directory}")
        check_declared_counts(config.to_dict(), stored, str(first_file), arg_name)
        return _with_mtp_spelling(config, models, self.files)

    def _padded_rows(self, args: argparse.Namespace, first_model: dict[str, Any], config: ModelConfig,
                     first_file: Path, options: LoadOptions) -> int:
        """The vocab tables' global row count: ``args.padded_vocab_size``, else the embedding's."""
        padded = getattr(args, "padded_vocab_size", None)
        embedding = first_model.get(WORD_EMBEDDINGS)
        if not isinstance(padded, int):
            if not isinstance(embedding, torch.Tensor):
                raise CheckpointError(f"{first_file}: no args.padded_vocab_size and no word embeddings")
            padded = embedding.shape[0] * self.layout.tp
        stored = embedding.shape[0] * self.layout.tp if isinstance(embedding, torch.Tensor) and embedding.dim() else padded
        check_vocab_multiple(args, self.layout.tp, stored, first_file)
        if config.vocab_size is not None and config.vocab_size > padded:
            given = "--true-vocab-size" if options.true_vocab_size is not None else "args.vocab_size"
            raise CheckpointError(
                f"{first_file}: true vocab size {given}={config.vocab_size} exceeds the padded vocab {padded}"
            )
        if config.vocab_size is None:
            fallback(f"{first_file}: the true vocab size is unknown (no args.vocab_size, no --true-vocab-size); "
                     f"keeping the padded table of {padded} rows as the vocabulary", options.strict,
                     self._early_notices)
        return padded

    def _index(self, padded: int, chunk_keys: list[str]) -> None:
        groups = build_converter_process_groups(self.layout)
        chunked = self.layout.has_virtual_chunks
        for coord, path in self.files.items():
            groups.set_coord(coord)
            for chunk_index, chunk_key in enumerate(chunk_keys):
                shard = provide(self.config, groups, padded_vocab_size=padded,
                                chunk=chunk_index if chunked else None)
                where = f"{path} [{chunk_key}]" if chunked else str(path)
                self._index_chunk(coord, chunk_key, shard.by_local_name(), shard.layers, where)
        for name, pieces in self._pieces.items():
            dtypes = {self._tensor(p).dtype for p in pieces}
            if len(dtypes) > 1:
                where = {str(self._tensor(p).dtype): self.files[p.coord] for p in pieces}
                raise CheckpointError(f"{name}: ranks disagree on dtype ("
                                      + ", ".join(f"{dtype} in {path}" for dtype, path in sorted(where.items())) + ")")

    def _index_chunk(self, coord: RankCoord, chunk_key: str, specs: dict[str, TensorSpec], layers: range,
                     where: str) -> None:
        model = self._models[(coord, chunk_key)]
        unexpected = []
        for key, value in model.items():
            if key.endswith(EXTRA_STATE_SUFFIX):
                canonical = canonical_mtp_key(_to_global(key, layers.start))  # either MTP spelling
                if canonical_layer(canonical) is None and non_layer_chunk(canonical) is None:
                    unexpected.append(key)
                    continue
                extra = self._extra.setdefault(canonical, ExtraState(tp_size=self.layout.tp, ep_size=self.layout.ep))
                # Carried as it is: a tensor left in its file (over 64 KiB) is read now.
                carried = self._stored.read(value) if isinstance(value, torch.Tensor) else value
                extra.by_rank[(coord.tp, coord.ep)] = carried
                continue
            if key.endswith(IGNORED_SUFFIXES):
                log.info("%s: skipping %s (recomputed buffer, not a weight)", where, key)
                continue
            spec = specs.get(key)
            if spec is None:
                unexpected.append(key)
                continue
            if not isinstance(value, torch.Tensor):
                raise CheckpointError(f"{where}: {key} is a {type(value).__name__}, expected a tensor")
            if tuple(value.shape) != spec.local_shape:
                settings = shape_settings(shape_function(self.config, spec.canonical), self.config)
                raise CheckpointError(
                    f"{where}: {key} has shape {list(value.shape)}, expected {list(spec.local_shape)} "
                    f"for {self.layout.describe()} (global {list(spec.global_shape)} from the checkpoint's args: "
                    f"{named_values(self.config, settings, arg_name)})"
                )
            self._pieces[spec.canonical].append(_Piece(coord, chunk_key, spec))
        missing = sorted(set(specs) - set(model))
        _refuse_adapter(where, unexpected)
        if missing or unexpected:
            declared = declaring_settings(self.config, {specs[name].canonical for name in missing},
                                          {spec.canonical for spec in specs.values()})
            raise CheckpointError(
                f"{where}: state dict does not match the model described by its args "
                f"(transformer_impl={self.config.transformer_impl}"
                f"{', grouped-gemm experts' if self.config.moe.moe_grouped_gemm else ''}); "
                f"missing: {missing}; unexpected: {sorted(unexpected)}"
                + (f"; the args declare them by {named_values(self.config, declared, arg_name)}" if declared else "")
            )

    def _tensor(self, piece: _Piece) -> torch.Tensor:
        return self._models[(piece.coord, piece.chunk)][piece.spec.local_name]

    def names(self) -> list[str]:
        return list(self._order)

    def meta(self, name: str) -> TensorMeta:
        piece = self._pieces[name][0]
        return TensorMeta(tuple(piece.spec.global_shape), self._tensor(piece).dtype)

    def _copies(self, name: str) -> list[list[_Piece]]:
        """The full copies of a canonical tensor, each a TP-ordered list of pieces.

        One copy per (stage, chunk, expert rank, local name): EP ranks each hold the dense tensors,
        and with tied embeddings the last stage holds the output-layer copy of the embedding.
        """
        pieces = self._pieces.get(name)
        if not pieces:
            raise KeyError(name)
        copies: dict[tuple[int, str, int, str], list[_Piece]] = defaultdict(list)
        for piece in pieces:
            copies[(piece.coord.pp, piece.chunk, piece.coord.ep, piece.spec.local_name)].append(piece)
        return [sorted(group, key=lambda p: p.coord.tp) for group in copies.values()]

    def _verify(self, name: str, copies: list[list[_Piece]]) -> None:
        """Once per tensor: every replica and every copy must be bit-identical (read from their files a slab at a
        time, in memory of their own: not a block lent to the record being produced)."""
        if name in self._verified:
            return
        with self._verifying, nothing_lent():
            if name not in self._verified:
                self._verify_copies(name, copies)
                self._verified.add(name)

    def _verify_copies(self, name: str, copies: list[list[_Piece]]) -> None:
        """Each TP rank's replicas of a replicated tensor against its first, each other copy's pieces against the
        first copy's: every piece compared with its reference in one pass over the reference's bytes."""
        # Each reference and what is compared with it: (piece, whether a replica).
        against: dict[_Piece, list[tuple[_Piece, bool]]] = defaultdict(list)
        reference = copies[0]
        for group in copies:
            if group[0].spec.rule.replicated:
                for piece in group[1:]:
                    against[group[0]].append((piece, True))
            if group is not reference:
                for mine, theirs in zip(group, reference, strict=True):
                    against[theirs].append((mine, False))
        for first, pieces in against.items():
            others = [self._tensor(piece) for piece, _ in pieces]
            differing = stored_differing(self._tensor(first), others, self._stored)
            if differing is None:
                continue
            piece, replica = pieces[differing]
            if replica:
                raise ReplicaMismatchError(first.coord.tp, piece.coord.tp, name,
                                           (f"{first.spec.local_name} in {self.files[first.coord]}",
                                            str(self.files[piece.coord])))
            raise CheckpointError(f"{name}: the copies in {self.files[first.coord]} and {self.files[piece.coord]} "
                                  f"({piece.spec.local_name}) differ")

    def describe(self) -> str:
        return str(self.directory)

    def _load(self, name: str) -> torch.Tensor:
        copies = self._copies(name)
        self._verify(name, copies)
        tensors = self._first_copy(copies)
        with self._concatenating(copies[0]):
            return self._owned(copies[0][0].spec.rule.merge(tensors), tensors)

    def _load_shard(self, name: str, rule: ShardRule, size: int, rank: int,
                    rows: int | None) -> torch.Tensor:
        copies = self._copies(name)
        self._verify(name, copies)
        tensors = self._first_copy(copies)
        stored = copies[0][0].spec.rule
        with self._concatenating(copies[0]):
            if stored != rule:
                # the pieces were split by the rule of the spec that wrote them, which may not be the
                # target's (MLA down projections: column-parallel in the local spec, whole in the TE spec).
                tensors = [stored.merge(tensors)]
            return self._owned(rule.reshard_rows(tensors, rows, self.config.vocab_size, size, rank), tensors)

    def _first_copy(self, copies: list[list[_Piece]]) -> list[torch.Tensor]:
        """The first copy's pieces as stored (over 64 KiB: left in their files); of a replicated tensor the first
        replica alone, which ``_verify`` compared the others with."""
        tensors = [self._tensor(piece) for piece in copies[0]]
        return tensors[:1] if copies[0][0].spec.rule.replicated else tensors

    def _owned(self, result: torch.Tensor, pieces: list[torch.Tensor]) -> torch.Tensor:
        """``result`` in memory of its own: a piece passed through (or a window of one) read from its file into
        place, or copied where it is in memory."""
        if not shares_memory(result, pieces):
            return result
        return concat_reading([result], 0, self._stored.locate) if result.dim() else result.clone()

    def _shares_piece_reads(self, name: str, rule: ShardRule, size: int, rows: int | None) -> bool:
        """A piece merged from pieces stored under another rule reads them all, and one strided in a stored piece
        (a row-parallel weight at more TP ranks than stored) reads that piece's whole file span."""
        pieces = self._copies(name)[0]
        spec = pieces[0].spec
        if spec.rule != rule:
            return True
        return size > len(pieces) and strided_in_whole(rule, spec.global_shape, size, rows, self.config.vocab_size)

    def _concatenating(self, pieces: list[_Piece]) -> AbstractContextManager[None]:
        """Joins read each piece's bytes from its file into their place in the result (``concat_reading``), so
        resident memory holds the result alone."""
        return concatenating_with(self._stored.concat)

    def extra_states(self) -> dict[str, ExtraState]:
        return dict(self._extra)

    def _first_rank_keys(self) -> set[Any]:
        return self._first_keys

    def holds_training_state(self) -> bool:
        return any(key in TRAINING_STATE_KEYS for key in self._first_rank_keys())

    def holds_optimizer(self) -> bool:
        return "optimizer" in self._first_rank_keys()

    def open_optimizer(self) -> MegatronOptimizerSource:
        return MegatronOptimizerSource(self)

    def close(self) -> None:
        self._models.clear()
        self.handles.close()
        self._pieces.clear()


def _model_dict(model: object, path: Path, chunk_key: str) -> dict[str, Any]:
    """A rank file's model chunk: a dict of tensor names (anything else is a broken file)."""
    if not isinstance(model, dict):
        raise CheckpointError(f"{path}: {chunk_key!r} is a {type(model).__name__}, expected a dict of tensors")
    for key in model:
        if not isinstance(key, str):
            raise CheckpointError(f"{path}: {chunk_key!r} holds the key {quote(key)}, expected tensor names")
    return model


def _check_sizes_against_files(layout: ParallelLayout, rank_dirs: int, first_entries: int, path: Path) -> None:
    """Sizes from args, bounded by what is on disk before anything is allocated or looped over."""
    ranks = layout.tp * layout.pp * layout.ep
    if ranks > rank_dirs + MAX_LISTED_MISSING:
        raise CheckpointError(f"{path}: args describe {layout.describe()} ({ranks} rank files), but "
                              f"{rank_dirs} mp_rank_* directories are present")
    if layout.has_virtual_chunks and layout.virtual_size > first_entries:
        raise CheckpointError(f"{path}: args describe {layout.virtual_size} virtual pipeline chunks, but the file "
                              f"holds {first_entries} entries")


def _stored_counts(models: dict[tuple[RankCoord, str], dict[str, Any]], ep: int, where: str) -> StoredCounts:
    """The decoder layers, routed experts per layer and MTP layers the rank files store: a stage's
    layers are the local indices its files hold (numbered from 0 per model chunk), a layer's experts
    the local ones of each expert-parallel rank times ``ep``."""
    stage_layers: dict[tuple[int, str], set[int]] = defaultdict(set)
    mtp: set[int] = set()
    experts = 0
    for (coord, chunk), model in models.items():
        local: dict[str, set[int]] = defaultdict(set)
        for key in model:
            layer = canonical_layer(key)
            if layer is not None:
                stage_layers[(coord.pp, chunk)].add(layer[0])
            elif key.startswith(MTP_PREFIX) and key[len(MTP_PREFIX):].partition(".")[0].isdigit():
                mtp.add(int(key[len(MTP_PREFIX):].partition(".")[0]))
            found = expert_of_key(key)
            if found is not None:
                local[found[0]].add(found[1])
        experts = max([experts, *map(len, local.values())])
    return StoredCounts(where, sum(map(len, stage_layers.values())), experts * ep, len(mtp))


def _with_mtp_spelling(config: ModelConfig, models: dict[tuple[RankCoord, str], dict[str, Any]],
                       files: dict[RankCoord, Path]) -> ModelConfig:
    """The config naming the MTP inner layer as the rank files do (``pgconvert.formats.mtp_naming``)."""
    spellings = {mtp_module_of(model, f"{files[coord]} [{chunk}]") for (coord, chunk), model in models.items()}
    spellings.discard(None)
    if len(spellings) > 1:
        raise CheckpointError(f"{next(iter(files.values())).parent.parent}: rank files name the MTP layer's inner layer "
                              f"differently ({' and '.join(sorted(map(str, spellings)))})")
    return config.replace(mtp_layer_module=spellings.pop()) if spellings else config


def _to_global(local_key: str, layer_offset: int) -> str:
    parsed = canonical_layer(local_key)
    if parsed is None:
        return local_key
    index, rest = parsed
    return f"{LAYER_PREFIX}{index + layer_offset}.{rest}"
