"""Saver for Megatron-LM per-rank checkpoints (``mp_rank_*/model_optim_rng.pt``).

One destination rank is built and written at a time: the format needs a whole rank in memory for
``torch.save``, and nothing more is held.
"""

from __future__ import annotations

import logging
import os
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch

from pgconvert.formats import PlannedFile, Progress, Saver, SaveOptions, SaveResult
from pgconvert.grid import build_converter_process_groups, iter_ranks
from pgconvert.megatron_format import (
    CHECKPOINT_VERSION,
    RANK_FILE,
    TRACKER_FILE,
    args_for_target,
    iteration_dir_name,
    rank_dir_name,
)
from pgconvert.provider import (
    LAYER_PREFIX,
    ModelShard,
    TensorSpec,
    canonical_layer,
    provide,
    target_vocab_rows,
)
from pgconvert.rules import VocabParallel, fit_vocab_rows
from pgconvert.stream import CanonicalSource, ExtraState

log = logging.getLogger(__name__)


def _cast(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    if dtype is not None and tensor.is_floating_point() and tensor.dtype != dtype:
        return tensor.to(dtype)
    return tensor


def _owned(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor with storage of its own: torch.save writes a view's whole storage."""
    return tensor.clone(memory_format=torch.contiguous_format)


def fsync_file(path: Path) -> None:
    with open(path, "rb") as handle:
        os.fsync(handle.fileno())


class MegatronSaver(Saver):
    name = "megatron"

    def validate(self, source: CanonicalSource, options: SaveOptions) -> None:
        options.layout.validate(source.config, "dst")
        target_vocab_rows(source.config, source.vocab_rows, options.layout)

    def _shards(self, source: CanonicalSource, options: SaveOptions) -> list[tuple[str, ModelShard]]:
        layout = options.layout
        padded = target_vocab_rows(source.config, source.vocab_rows, layout)
        groups = build_converter_process_groups(layout)
        shards = []
        for coord in iter_ranks(layout):
            groups.set_coord(coord)
            relpath = f"{rank_dir_name(coord.tp, coord.pp, coord.ep, layout.pp, layout.ep)}/{RANK_FILE}"
            shards.append((relpath, provide(source.config, groups, padded_vocab_size=padded)))
        return shards

    def _extra_keys(self, source: CanonicalSource, shard: ModelShard) -> list[tuple[str, str]]:
        """(local key, canonical key) of the opaque extra states this rank carries."""
        keys = []
        for canonical in source.extra_states():
            parsed = canonical_layer(canonical)
            if parsed is None:
                keys.append((canonical, canonical))
            elif parsed[0] in shard.layers:
                keys.append((f"{LAYER_PREFIX}{parsed[0] - shard.layers.start}.{parsed[1]}", canonical))
        return keys

    def plan(self, source: CanonicalSource, options: SaveOptions) -> list[PlannedFile]:
        iteration_dir = iteration_dir_name(source.iteration, source.release) if (
            source.iteration is not None or source.release) else iteration_dir_name(0, False)
        planned = []
        for relpath, shard in self._shards(source, options):
            nbytes = 0
            for spec in shard.specs:
                dtype = options.dtype or source.meta(spec.canonical).dtype
                nbytes += spec.numel * torch.empty((), dtype=dtype).element_size()
            count = len(shard.specs) + len(self._extra_keys(source, shard))
            planned.append(PlannedFile(f"{iteration_dir}/{relpath}", count, nbytes))
        return planned

    def save(self, source: CanonicalSource, out_dir: Path, options: SaveOptions,
             progress: Progress) -> SaveResult:
        layout = options.layout
        config = source.config
        result = SaveResult()
        iteration = source.iteration if source.iteration is not None else 0
        release = source.release
        if source.iteration is None and not release:
            result.notices.append("the source has no iteration number; writing iteration 0")
        iteration_dir = out_dir / iteration_dir_name(iteration, release)
        padded = target_vocab_rows(config, source.vocab_rows, layout)
        names = source.names()
        dtype = options.dtype or source.meta(names[0]).dtype
        args, replaced = args_for_target(config, layout, padded, dtype, iteration, source.megatron_args)
        if replaced:
            result.notices.append(
                "args naming framework classes were written as plain values: " + ", ".join(replaced)
            )
        extra_states = source.extra_states()
        dropped_extra = False
        for relpath, shard in self._shards(source, options):
            model: OrderedDict[str, Any] = OrderedDict()
            nbytes = 0
            for spec in shard.specs:
                piece = self._cut(source, spec, padded)
                piece = _owned(_cast(piece, options.dtype))
                model[spec.local_name] = piece
                nbytes += piece.numel() * piece.element_size()
            for local, canonical in self._extra_keys(source, shard):
                value, carried = _extra_for(extra_states[canonical], layout.tp, shard.tp_rank)
                dropped_extra |= not carried
                model[local] = value
            state = {
                "args": args,
                "checkpoint_version": CHECKPOINT_VERSION,
                "iteration": iteration,
                "model": model,
            }
            path = iteration_dir / relpath
            path.parent.mkdir(parents=True, exist_ok=True)
            torch.save(state, path)
            fsync_file(path)
            result.files.append(PlannedFile(str(path.relative_to(out_dir)), len(model), nbytes))
            del model, state
            progress(nbytes)
        tracker = out_dir / TRACKER_FILE
        tracker.write_text("release" if release else str(iteration))
        fsync_file(tracker)
        if dropped_extra:
            result.notices.append(
                "Transformer Engine _extra_state (FP8 scaling metadata) is only valid at the TP size it "
                f"was saved with ({next(iter(extra_states.values())).tp_size}); written empty (None) for "
                f"tp={layout.tp}: FP8 runs re-derive it in their first steps"
            )
        result.notices.append(
            "optimizer, scheduler and RNG state are not carried: resume with --no-load-optim "
            "--no-load-rng (or --finetune)"
        )
        return result

    @staticmethod
    def _cut(source: CanonicalSource, spec: TensorSpec, padded: int) -> torch.Tensor:
        full = source.load(spec.canonical)
        if isinstance(spec.rule, VocabParallel):
            full = fit_vocab_rows(full, padded, source.config.vocab_size)
        return spec.rule.shard(full, spec.tp_size, spec.tp_rank)


def _extra_for(extra: ExtraState, tp_size: int, tp_rank: int) -> tuple[object, bool]:
    if extra.tp_size == tp_size and tp_rank in extra.by_tp_rank:
        return extra.by_tp_rank[tp_rank], True
    return None, False
