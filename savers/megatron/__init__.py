"""Saver for Megatron-LM per-rank checkpoints (``mp_rank_*/model_optim_rng.pt``).

Each destination rank file is written as a stream (``pgconvert.io.torchzip``): each tensor is cut from
the source when its record is written and dropped after, so memory holds one tensor, not a rank. The
rank files of a TP group are written at once, one thread each, where some of their pieces would each
read the bytes of all (``formats.sibling_pieces``: such a tensor is read once for the group); groups,
and rank files that share nothing, are independent: ``--threads`` writes that many at once
(``pgconvert.io.threads``), each thread holding its own tensor.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Collection
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

import torch

from pgconvert.model.config import ModelConfig
from pgconvert.io.durable import fsync_file
from pgconvert.formats import (TRAINING_STATE_NOT_CARRIED, CarriedOptimizer, OptimizerFile, OptimizerOptions,
                               PlannedFile, Progress, SaveOptions, Saver, SaveResult, target_config, target_dtype)
from pgconvert.model.grid import RankCoord, build_converter_process_groups, iter_ranks
from pgconvert.io.output import RECORDS_IN_FLIGHT, OutputFile, sharing_staging
from pgconvert.io.threads import run_each
from pgconvert.formats.hf_side import carried_for_target, write_carried
from pgconvert.model.layout import ParallelLayout
from pgconvert.formats.megatron import (
    CHECKPOINT_VERSION,
    RANK_FILE,
    TRACKER_FILE,
    args_for_target,
    check_megatron_layout,
    iteration_dir_name,
    params_dtype_for,
    rank_dir_name,
)
from pgconvert.model.provider import (
    LAYER_PREFIX,
    ModelShard,
    TensorSpec,
    canonical_layer,
    is_routed_expert,
    non_layer_chunk,
    provide,
    target_vocab_rows,
    te_extra_state_names,
)
from pgconvert.io.sizes import itemsize
from pgconvert.formats.sibling_pieces import SiblingPieces
from pgconvert.formats.stream import CanonicalSource, ExtraState
from pgconvert.formats.strict import fallback
from pgconvert.formats.mtp_naming import local_mtp_key
from pgconvert.formats.vision_args import wrapped
from pgconvert.io.torchzip import PlannedTensor, save_stream
from pgconvert.optimizer.source import OptimizerSource
from pgconvert.savers.megatron.optimizer import planned_optimizer_files, training_state

log = logging.getLogger(__name__)


def save_durably(state: dict[str, Any], path: Path, in_flight: int | None = None) -> str | None:
    """Write ``state`` in torch.save's format into ``path`` and fsync it; returns the file's digest (None
    when digests are off, ``io.output.digests``).

    ``PlannedTensor`` values are produced one at a time as their records are written, so memory holds one tensor,
    not the file (with ``in_flight``, records are written from their own memory, that many more while the next is
    produced, ``torchzip.save_stream``; None: staged). A failed write surfaces as the OSError behind it, naming the
    file. The records' CRC32 is 0, as torch writes with ``compute_crc32`` off: torch's reader does not check it, and
    the digest recorded in the manifest covers the file.
    """
    with OutputFile(path) as output:
        save_stream(state, output, in_flight=in_flight)  # type: ignore[arg-type]
    return output.hexdigest()


@dataclass
class _RankPlan:
    """One destination rank file: its path and the shard of each model chunk it holds."""

    relpath: str
    coord: RankCoord
    chunks: list[tuple[str, ModelShard]]


# A rank written: its files (the rank file, then any written beside it) and whether a non-empty ``_extra_state`` of
# the source was written empty in it.
_WrittenRank = tuple[list[PlannedFile], bool]


class MegatronSaver(Saver):
    name = "megatron"
    records_in_flight = RECORDS_IN_FLIGHT  # a rank file written alone (a TP group's files: none, ``_write_siblings``)
    # an emerging (Muon, Lion) run's plain optimizers (optimizer.py)
    optimizer_kinds = ("adam", "muon", "lion")

    def validate(self, source: CanonicalSource, options: SaveOptions) -> None:
        check_megatron_layout(options.layout, "dst")
        config = target_config(source.config, options)
        options.layout.validate(config, "dst")
        target_vocab_rows(config, source.vocab_rows, options.layout)
        carried_for_target(source, options)
        if options.strict:
            self._refuse_guesses(source, options, config)

    @staticmethod
    def _refuse_guesses(source: CanonicalSource, options: SaveOptions, config: ModelConfig) -> None:
        """Under --strict, the guesses ``save`` would make are refused before anything is written."""
        layout = options.layout
        for name, extra in source.extra_states().items():
            if not extra.holds_state():
                continue
            if config.transformer_impl != source.config.transformer_impl or (
                    extra.tp_size, extra.ep_size) != (layout.tp, layout.ep) or (
                    is_routed_expert(name) and _expert_naming_changes(source, config)):
                fallback(f"{name}: Transformer Engine _extra_state would be dropped (saved at tp="
                         f"{extra.tp_size}, ep={extra.ep_size})", strict=True)

    def _ranks(self, source: CanonicalSource, options: SaveOptions) -> list[_RankPlan]:
        layout = options.layout
        config = target_config(source.config, options)
        padded = target_vocab_rows(config, source.vocab_rows, layout)
        groups = build_converter_process_groups(layout)
        chunked = layout.has_virtual_chunks
        chunk_keys = [f"model{i}" for i in range(layout.virtual_size)] if chunked else ["model"]
        ranks = []
        for coord in iter_ranks(layout):
            groups.set_coord(coord)
            relpath = f"{rank_dir_name(coord.tp, coord.pp, coord.ep, layout.pp, layout.ep)}/{RANK_FILE}"
            chunks = [
                (key, provide(config, groups, padded_vocab_size=padded, chunk=index if chunked else None))
                for index, key in enumerate(chunk_keys)
            ]
            ranks.append(_RankPlan(relpath, coord, chunks))
        return ranks

    def _extra_keys(self, source: CanonicalSource, shard: ModelShard, config: ModelConfig,
                    layout: ParallelLayout) -> list[tuple[str, str]]:
        """(local key, canonical key) of the opaque extra states this chunk carries.

        Under the source's own naming the source's entries are kept (they name exactly the modules
        of the framework version that wrote them). A switch to the TE spec, or a TE-spec target from a source
        that stores none (Hugging Face), gets TE's standard set: a TE module's ``load_state_dict(strict=True)``
        expects its key; a switch to the local spec gets none (megatron-core fills its own in on load).
        """
        if config.transformer_impl == source.config.transformer_impl and source.extra_states():
            names = list(source.extra_states())
            source_ep = {extra.ep_size for extra in source.extra_states().values()}
            if any(map(is_routed_expert, names)) and (source_ep != {layout.ep}
                                                      or _expert_naming_changes(source, config)):
                # Routed-expert entries are named by local expert index, which means other experts
                # (and another count of them) once EP changes, and by module, which differs between
                # SequentialMLP and grouped GEMM: name them for this layout instead.
                names = [name for name in names if not is_routed_expert(name)] + [
                    name for name in te_extra_state_names(config, shard.layers, layout.ep) if is_routed_expert(name)
                ]
        elif config.transformer_impl == "transformer_engine":
            names = te_extra_state_names(config, shard.layers, layout.ep)
        else:
            return []
        first = shard.pp_rank == 0 and shard.chunk in (None, 0)
        last = shard.pp_rank == layout.pp - 1 and shard.chunk in (None, layout.virtual_size - 1)
        keys = []
        for canonical in names:
            parsed = canonical_layer(canonical)
            if parsed is None:
                owner = non_layer_chunk(canonical)
                if (owner == "first" and first) or (owner == "last" and last):
                    # the target's MTP spelling
                    keys.append((local_mtp_key(canonical, config.mtp_layer_module), canonical))
            elif parsed[0] in shard.layers:
                keys.append((f"{LAYER_PREFIX}{parsed[0] - shard.layers.start}.{parsed[1]}", canonical))
        return keys

    def _dtype(self, source: CanonicalSource, spec: TensorSpec, dtype: torch.dtype | None) -> torch.dtype:
        return target_dtype(source.meta(spec.canonical).dtype, dtype, spec.keep_dtype)

    def plan(self, source: CanonicalSource, options: SaveOptions) -> list[PlannedFile]:
        config = target_config(source.config, options)
        iteration_dir = iteration_dir_name(source.iteration or 0, source.release)
        planned = []
        for rank in self._ranks(source, options):
            nbytes = 0
            count = 0
            for _, shard in rank.chunks:
                for spec in shard.specs:
                    nbytes += spec.numel * itemsize(self._dtype(source, spec, options.dtype))
                count += len(shard.specs) + len(self._extra_keys(source, shard, config, options.layout))
            planned.append(PlannedFile(f"{iteration_dir}/{rank.relpath}", count, nbytes))
        return planned

    supports_partial = True
    threaded = True  # each TP group sharing reads, or each other rank file, is a task of ``options.threads`` threads

    def file_groups(self, source: CanonicalSource, options: SaveOptions) -> list[tuple[str, ...]]:
        padded = target_vocab_rows(target_config(source.config, options), source.vocab_rows, options.layout)
        iteration_dir = iteration_dir_name(source.iteration or 0, source.release)
        return [tuple(f"{iteration_dir}/{rank.relpath}" for rank in members)
                for members, _ in _sibling_groups(source, self._ranks(source, options), padded) if len(members) > 1]

    def save(self, source: CanonicalSource, out_dir: Path, options: SaveOptions,
             progress: Progress, only: Collection[str] | None = None) -> SaveResult:
        """Write every rank file (or those of ``only``, relative paths as ``plan`` names them)."""
        layout = options.layout
        config = target_config(source.config, options)
        result = SaveResult()
        iteration, release = self._iteration(source)
        iteration_dir_relpath = iteration_dir_name(iteration, release)
        padded = target_vocab_rows(config, source.vocab_rows, layout)
        names = source.names()
        dtype = options.dtype or params_dtype_for((source.meta(name).dtype for name in names), config)
        args = args_for_target(config, layout, padded, dtype, iteration, source.megatron_args)
        extra_states = source.extra_states()
        header = {"args": args, "checkpoint_version": CHECKPOINT_VERSION, "iteration": iteration}
        ranks = [rank for rank in self._ranks(source, options)
                 if only is None or f"{iteration_dir_relpath}/{rank.relpath}" in only]
        directory = out_dir / iteration_dir_relpath
        if options.optimizer is None:
            tasks = [partial(self._write_siblings, source, directory, siblings, header, padded, options, progress)
                     for siblings in _sibling_groups(source, ranks, padded)]
            threads = options.threads
        else:  # one rank file at a time, each reading its optimizer state in turn
            tasks = [partial(self._write_alone, source, directory, rank, header, padded, options, progress)
                     for rank in ranks]
            threads = 1
        place = {rank.relpath: index for index, rank in enumerate(ranks)}
        written = sorted((item for group in run_each(tasks, threads) for item in group),
                         key=lambda item: place[item[0][0].relpath])  # in rank order, as planned
        result.files += [replace(files[0], relpath=f"{iteration_dir_relpath}/{files[0].relpath}")
                         for files, _ in written]
        result.files += [beside for files, _ in written for beside in files[1:]]  # each rank's distrib_optim.pt
        dropped_extra = any(dropped for _, dropped in written)
        _notice_renamed_extra_states(source, config, options, result.notices)
        if dropped_extra:
            first = next(iter(extra_states.values()))
            fallback(
                "Transformer Engine _extra_state (FP8 scaling metadata) is only valid at the TP/EP sizes it "
                f"was saved with (tp={first.tp_size}, ep={first.ep_size}); written empty (None) for "
                f"tp={layout.tp}, ep={layout.ep}: FP8 runs re-derive it in their first steps",
                options.strict, result.notices,
            )
        if only is None:
            result.notices += self.finalize(source, out_dir, options)
        return result

    def _write_alone(self, source: CanonicalSource, iteration_dir: Path, rank: _RankPlan, header: dict[str, Any],
                     padded: int, options: SaveOptions, progress: Progress) -> list[_WrittenRank]:
        return [self._write_rank(source, iteration_dir, rank, header, padded, options, progress)]

    def _write_siblings(self, source: CanonicalSource, iteration_dir: Path,
                        siblings: tuple[list[_RankPlan], frozenset[tuple[str, int]]], header: dict[str, Any],
                        padded: int, options: SaveOptions, progress: Progress) -> list[_WrittenRank]:
        """The rank files of one TP group (or one rank file), each as ``_write_rank`` gives it: a group's at
        once, one thread each, taking the tensors they share (``siblings``: the ranks and those tensors) from one
        read (``SiblingPieces``)."""
        members, shared = siblings
        if len(members) == 1:
            return [self._write_rank(source, iteration_dir, members[0], header, padded, options, progress)]
        group = SiblingPieces(source, len(members), shared)

        def write(index: int) -> _WrittenRank:
            try:
                return self._write_rank(source, iteration_dir, members[index], header, padded, options, progress,
                                        (group, index))
            except BaseException:
                group.fail()
                raise

        with sharing_staging(len(members)):  # the group's files hold one file's write buffers together
            return run_each([partial(write, index) for index in range(len(members))], len(members))

    def _write_rank(self, source: CanonicalSource, iteration_dir: Path, rank: _RankPlan, header: dict[str, Any],
                    padded: int, options: SaveOptions, progress: Progress,
                    sibling: tuple[SiblingPieces, int] | None = None) -> _WrittenRank:
        """One rank file (its path relative to the iteration directory) and, with the optimizer state it carries
        (``options.optimizer``), the ``distrib_optim.pt`` beside it (relative to the output root); and whether a
        non-empty ``_extra_state`` of the source was written empty in it. Runs on a ``--threads`` thread, or on one
        of its TP group's threads (``sibling``: the group and this file's place in it)."""
        layout = options.layout
        config = target_config(source.config, options)
        extra_states = source.extra_states()
        dropped_extra = False
        state: dict[str, Any] = dict(header)  # args, checkpoint_version, iteration
        nbytes = 0
        count = 0
        for chunk_key, shard in rank.chunks:
            model: OrderedDict[str, Any] = OrderedDict()
            for spec in shard.specs:
                planned = _planned_piece(source, spec, padded, self._dtype(source, spec, options.dtype), sibling)
                model[spec.local_name] = planned
                nbytes += planned.nbytes
            for local, canonical in self._extra_keys(source, shard, config, layout):
                value, carried = _extra_for(extra_states.get(canonical), layout, rank.coord)
                dropped_extra |= not carried and _holds_state(extra_states.get(canonical))
                model[local] = value
            state[chunk_key] = wrapped(model) if config.vision.vision_config is not None else model
            count += len(model)
        path = iteration_dir / rank.relpath
        path.parent.mkdir(parents=True, exist_ok=True)
        write_beside: Callable[[], list[PlannedFile]] = list  # the files beside the rank file, once it is written
        if options.optimizer is not None:
            carried, write_beside = training_state(options.optimizer, config, layout, rank.coord, padded,
                                                   f"{iteration_dir.name}/{rank.relpath}", path.parent,
                                                   state["args"], save_durably)
            state.update(carried)
        # A file of its own writes a record while it makes the next; a TP group's files, in lockstep, each writes its
        # record before the group makes the next (their memory holds one record each, besides the group's read).
        digest = save_durably(state, path, in_flight=RECORDS_IN_FLIGHT if sibling is None else 0)
        del state
        written = PlannedFile(rank.relpath, count, nbytes, digest=digest, size=path.stat().st_size)
        progress(nbytes)
        return [written, *write_beside()], dropped_extra

    def finalize(self, source: CanonicalSource, out_dir: Path, options: SaveOptions) -> list[str]:
        """What is written once all rank files are: the tracker file Megatron starts from."""
        iteration, release = self._iteration(source)
        tracker = out_dir / TRACKER_FILE
        tracker.write_text("release" if release else str(iteration))
        fsync_file(tracker)
        write_carried(source, options, out_dir)
        notices: list[str] = []
        if source.holds_training_state():
            notices.append(f"{TRAINING_STATE_NOT_CARRIED}: resume with --no-load-optim --no-load-rng (or --finetune)")
        if source.iteration is None and not release:
            notices.insert(0, "the source has no iteration number; writing iteration 0")
        return notices

    @staticmethod
    def _iteration(source: CanonicalSource) -> tuple[int, bool]:
        return (source.iteration if source.iteration is not None else 0), source.release

    # The source's optimizer state, in its own form (plain or distributed), into every rank file.
    writes_optimizer = True

    def plan_optimizer(self, source: CanonicalSource, optimizer: OptimizerSource, form: str, options: SaveOptions,
                       optimizer_options: OptimizerOptions) -> list[OptimizerFile]:
        config = target_config(source.config, options)
        rows = target_vocab_rows(config, source.vocab_rows, options.layout)
        directory = iteration_dir_name(*self._iteration(source))
        return planned_optimizer_files(optimizer, config, options.layout, rows, optimizer_options.dp, directory)

    # A rank's optimizer state goes into its rank file and beside it: a share writes its rank files' own.
    optimizer_partial = True

    # Each rank file holds its optimizer entry, written with the model (``save``, from ``SaveOptions.optimizer``).
    optimizer_in_model_files = True

    def save_optimizer(self, source: CanonicalSource, optimizer: OptimizerSource, form: str, out_dir: Path,
                       options: SaveOptions, optimizer_options: OptimizerOptions,
                       files: list[PlannedFile], only: Collection[str] | None = None) -> CarriedOptimizer:
        """Nothing left to write: ``save`` wrote each rank file (of ``only``, when given) with its optimizer entry,
        and ``distrib_optim.pt`` beside it; ``files`` are what it wrote."""
        if options.optimizer is None or options.optimizer.optimizer is not optimizer:
            raise RuntimeError("the megatron saver writes optimizer state with its rank files: it is decided while "
                               "planning (SaveOptions.optimizer)")
        return CarriedOptimizer(list(files), optimizer.form)

    def finalize_optimizer(self, source: CanonicalSource, optimizer: OptimizerSource, form: str, out_dir: Path,
                           options: SaveOptions, optimizer_options: OptimizerOptions,
                           files: list[PlannedFile]) -> CarriedOptimizer:
        """Nothing: every rank's state is in its own files, which its share wrote."""
        return CarriedOptimizer(list(files), optimizer.form)


def _expert_naming_changes(source: CanonicalSource, config: ModelConfig) -> bool:
    """Whether the routed experts' modules are named otherwise in the target (SequentialMLP's
    ``local_experts.{j}.linear_fc1`` against grouped GEMM's one ``linear_fc1``)."""
    return config.moe.moe_grouped_gemm != source.config.moe.moe_grouped_gemm


def _notice_renamed_extra_states(source: CanonicalSource, config: ModelConfig, options: SaveOptions,
                                 notices: list[str]) -> None:
    """Non-empty ``_extra_state`` entries whose modules the target names otherwise are dropped."""
    held = [name for name, extra in source.extra_states().items() if extra.holds_state()]
    if held and config.transformer_impl != source.config.transformer_impl:
        fallback(f"the target uses {config.transformer_impl}-spec names: {len(held)} non-empty "
                 "_extra_state entries of the source's spec were dropped", options.strict, notices)
        return
    experts = [name for name in held if is_routed_expert(name)]
    if experts and _expert_naming_changes(source, config):
        layout = "grouped GEMM" if config.moe.moe_grouped_gemm else "SequentialMLP"
        fallback(f"the target names its experts as {layout}: {len(experts)} non-empty routed-expert "
                 "_extra_state entries of the source's expert layout were dropped", options.strict, notices)


def _planned_piece(source: CanonicalSource, spec: TensorSpec, padded: int, dtype: torch.dtype,
                   sibling: tuple[SiblingPieces, int] | None = None) -> PlannedTensor:
    """The rank's piece of a tensor, cut from the source only when the writer reaches it (from the tensor its TP
    group reads once, where the group shares it)."""
    rows = padded if spec.rule.fits_rows else None
    shared = sibling is not None and sibling[0].shares(spec.canonical, spec.tp_size)

    def produce() -> torch.Tensor:
        if shared and sibling is not None:
            group, index = sibling
            piece = group.piece(index, spec.canonical, spec.rule, spec.tp_size, spec.tp_rank, rows,
                                tuple(spec.local_shape))
        else:
            piece = source.load_shard(spec.canonical, spec.rule, spec.tp_size, spec.tp_rank, rows)
        return piece.to(dtype)

    return PlannedTensor(tuple(spec.local_shape), dtype, produce)


def _sibling_groups(source: CanonicalSource, ranks: list[_RankPlan],
                    padded: int) -> list[tuple[list[_RankPlan], frozenset[tuple[str, int]]]]:
    """The ranks in groups written together, each with the tensors (and cut sizes) its ranks share: the ranks of a
    TP group (same pipeline stage and expert rank) where they take the same shared tensors in the same order,
    each other rank alone (sharing none)."""
    by_place: dict[tuple[int, int], list[_RankPlan]] = {}
    for rank in ranks:
        by_place.setdefault((rank.coord.pp, rank.coord.ep), []).append(rank)
    groups: list[tuple[list[_RankPlan], frozenset[tuple[str, int]]]] = []
    for members in by_place.values():
        shared = [_shared_sequence(source, rank, padded) for rank in members]
        if len(members) > 1 and shared[0] and all(sequence == shared[0] for sequence in shared):
            groups.append((members, frozenset(shared[0])))
        else:
            groups += [([rank], frozenset()) for rank in members]
    return groups


def _shared_sequence(source: CanonicalSource, rank: _RankPlan, padded: int) -> list[tuple[str, int]]:
    """The tensors (and cut sizes) of a rank file that its TP siblings would share, in the order it writes them."""
    return [(spec.canonical, spec.tp_size) for _, shard in rank.chunks for spec in shard.specs
            if source.shares_piece_reads(spec.canonical, spec.rule, spec.tp_size,
                                         padded if spec.rule.fits_rows else None)]


def _holds_state(extra: ExtraState | None) -> bool:
    return extra is not None and extra.holds_state()


def _extra_for(extra: ExtraState | None, layout: ParallelLayout, coord: RankCoord) -> tuple[object, bool]:
    key = (coord.tp, coord.ep)
    if extra is not None and extra.tp_size == layout.tp and extra.ep_size == layout.ep and key in extra.by_rank:
        return extra.by_rank[key], True
    return None, False
