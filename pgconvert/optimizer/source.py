"""What every format's optimizer reader gives and every writer takes: ``OptimizerSource``, megatron-core's
optimizer state of one checkpoint by canonical parameter, and the names of its forms and fields.

A loader's source opens it (``CanonicalSource.open_optimizer``); the destination's saver writes it in its own
files (``Saver.save_optimizer``); ``export-optimizer`` and ``verify`` read it per parameter. Nothing here
knows where a format keeps the state.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pgconvert.model.config import ModelConfig
from pgconvert.model.layout import ParallelLayout
from pgconvert.model.rules import ReplicaMismatchError, ShardRule
from pgconvert.optimizer.order import MEGATRON_CORE_VERSIONS, OptimizerLayoutError, OptimizerRules, OptimizerSlot

MOMENTS = ("exp_avg", "exp_avg_sq")
# The per-parameter fields: the fp32 master weight and Adam's moments.
FIELDS = ("param", *MOMENTS)
# The forms of megatron-core's optimizer state: FP32Optimizer (fp32 training; the master is the model weight),
# Float16OptimizerWithFloat16Params (bf16/fp16 training, fp32 masters beside), DistributedOptimizer.
FORM_FP32 = "fp32"
FORM_FP16 = "float16"
FORM_DISTRIBUTED = "distributed"
# megatron-core's DistributedOptimizer param-state formats (distrib_optimizer.py).
DISTRIBUTED_SHARDING_TYPES = ("dp_reshardable", "fully_reshardable", "fully_sharded_model_space",
                              "fully_sharded_bucket_space", "dp_zero_gather_scatter")
# Carried as they are: layout-independent counters of the run.
CARRIED_KEYS = ("opt_param_scheduler", "num_floating_point_operations_so_far")
# Bytes per element: every optimizer tensor pgconvert writes is fp32.
FP32_BYTES = 4
# The consumed-samples counters, carried in ``args``.
COUNTERS = ("consumed_train_samples", "consumed_valid_samples", "skipped_train_samples")
_VERSIONS = "megatron-core " + " / ".join(MEGATRON_CORE_VERSIONS)


@dataclass
class SourceRank:
    """What the writers read of a source's first rank: a path for messages and its carried entries
    (``extra``: the ``CARRIED_KEYS`` present, ``iteration``, ``args``; for the distributed form
    ``distributed_entries``: per chained optimizer the entry a per-rank file's ``optimizer`` holds, its
    param groups with ``step``)."""

    path: Path
    extra: dict[str, Any]


class OptimizerSource:
    """megatron-core's optimizer state of one checkpoint, by canonical parameter.

    Declared by every reader: ``config``, ``layout`` and ``vocab_rows`` (the model's), ``form`` (one of the
    ``FORM_*``), ``sharding`` (the name the format gives its stored form, None where it gives none),
    ``rules`` (what decides the param groups), ``dtype_key`` (the distributed optimizer's buffer key,
    ``(param dtype, grad dtype)``), ``grad_scalers`` (per chained optimizer its grad scaler, None: none) and
    ``first`` (``SourceRank``).

    A reader indexes ``_owners`` (per canonical name, its TP pieces in TP order: ``(owner, slot)``, the owner
    having a ``path``) and implements ``_pieces`` and ``param_group_settings``; ``step``, ``parameter`` and
    ``piece`` then merge or cut those pieces with the parameter's own rule. A reader whose state is stored
    whole overrides them.
    """

    config: ModelConfig
    layout: ParallelLayout
    vocab_rows: int
    form: str = ""
    sharding: str | None = None
    rules: OptimizerRules
    dtype_key: Any = None
    grad_scalers: list[Any]
    first: SourceRank
    _owners: dict[str, list[tuple[Any, OptimizerSlot]]]

    def names(self) -> list[str]:
        """The canonical names of the parameters the state holds, in the model's order."""
        return list(self._owners)

    def group_of(self, name: str) -> int:
        """The param group (0: weight decay, 1: no weight decay) ``name`` is in."""
        return self._owners[name][0][1].group

    def optimizer_of(self, name: str) -> int:
        """The chained optimizer (0: dense, 1: expert-parallel) that holds ``name``."""
        return self._owners[name][0][1].optimizer

    def rule(self, name: str) -> ShardRule:
        """The ShardRule the source's pieces of ``name`` were cut with."""
        return self._owners[name][0][1].spec.rule

    def _pieces(self, name: str, key: str) -> list[torch.Tensor]:
        """The source's TP pieces of ``name``'s ``key`` (param, a moment or step), in TP order."""
        raise NotImplementedError

    def param_group_settings(self, optimizer: int = 0, count: int | None = None) -> list[dict[str, Any]]:
        """The param groups (without ``params``: hyperparameters, lr, wd_mult…) of chained optimizer
        ``optimizer`` (1: expert-parallel) of a target, ``count`` of them: the source's own where it has that
        optimizer, else its dense groups with ``is_expert_parallel`` set (megatron-core builds both from one
        config; they differ only there)."""
        raise NotImplementedError

    def _replicas_differ(self, name: str, key: str, error: ReplicaMismatchError) -> OptimizerLayoutError:
        owners = self._owners[name]
        first, second = (owners[index][0].path for index in error.ranks)
        return OptimizerLayoutError(
            f"{name}: optimizer {key} of a replicated parameter differs between {first} and {second}: the "
            f"positions do not map to the parameters {_VERSIONS} orders there")

    def step(self, name: str) -> torch.Tensor:
        """The Adam step count of ``name`` (the same on all its pieces, or refused)."""
        steps = self._pieces(name, "step")
        if any(not torch.equal(steps[0], other) for other in steps[1:]):
            raise OptimizerLayoutError(f"{self._owners[name][0][0].path}: step of {name} differs between TP ranks")
        return steps[0].clone()

    def parameter(self, name: str) -> dict[str, torch.Tensor]:
        """The whole (source-padded) fp32 master, both moments and the step of ``name``."""
        rule = self.rule(name)
        merged = {}
        for key in FIELDS:
            try:
                merged[key] = rule.merge(self._pieces(name, key)).clone()
            except ReplicaMismatchError as error:
                raise self._replicas_differ(name, key, error) from error
        merged["step"] = self.step(name)
        return merged

    def piece(self, name: str, key: str, size: int, rank: int, rows: int | None,
              rule: ShardRule | None = None) -> torch.Tensor:
        """Piece ``rank`` of ``size`` of ``name``'s ``key`` (param or a moment) cut with ``rule`` (the target's;
        default the source's), fitted to ``rows`` padded vocab rows for vocab tables (new rows zero). The
        source's pieces are merged with the rule of the spec that wrote them where the target's differs (MLA
        down projections: split by rows in the local spec, whole in the Transformer Engine spec)."""
        stored = self.rule(name)
        target = rule or stored
        pieces = self._pieces(name, key)
        try:
            if target != stored:
                pieces = [stored.merge(pieces)]
            if target.fits_rows and rows is not None:
                return target.reshard_rows(pieces, rows, self.config.vocab_size, size, rank)
            return target.reshard(pieces, size, rank)
        except ReplicaMismatchError as error:
            raise self._replicas_differ(name, key, error) from error
