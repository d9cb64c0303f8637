"""megatron-core's distributed optimizer state inside a torch_dist checkpoint, by canonical parameter.

``DistributedOptimizer.sharded_state_dict`` (megatron/core/optimizer/distrib_optimizer.py) writes the
parameter state in the form ``metadata['distrib_optim_sharding_type']`` names (Megatron-LM:
``dp_reshardable``, or ``fully_reshardable`` with ``--dist-ckpt-optim-fully-reshardable``), and puts
``param_state_sharding_type`` in the common state. Read here:

- ``fully_reshardable``: ``optimizer.state.{param,exp_avg,exp_avg_sq}.<model key>``, each a
  ShardedTensor with its model tensor's global shape and chunks; the param groups (with ``step``)
  are common state (``optimizer.optimizer.param_groups``);
  tdmoe: a MoE run's chained optimizers: ``{0: dense, 1: expert}`` there (``optimizer_torch_dist_moe``);
- ``fully_sharded_model_space`` (fsms: megatron-core <= 0.15.0, Megatron-LM's default up to core_v0.14):
  ``optimizer.state.{fp32_param,exp_avg,exp_avg_sq}.<model key>``, each the model tensor reformulated by
  chunks (``optimizer_fs_model_space``), read one parameter at a time; the param groups as for
  fully_reshardable. megatron-core 0.16.1 / 0.20.0 can neither save nor load it (flattened_range); written
  by ``optimizer_fs_model_space_save`` for megatron-core 0.15.0 and older;
- ``dp_reshardable``: per model-parallel rank ``g`` (``data_parallel_group_idx``: the rank in the
  model-parallel group, ``tp + tp_size * pp``), per buffer and bucket,
  ``optimizer.distributed.dp_group_idx_<g>.gbuf_idx_<i>.dtype_<(param, grad dtype)>.bucket_idx_<b>.<field>``
  of global shape ``(numel_unpadded,)``: the DP-gathered flat buffer without the DP tail padding,
  i.e. ``distrib_optim.pt``'s coalesced buffer, placed with ``optimizer_map.flat_buffers`` at the
  SOURCE layout; the param groups are the ShardedObject ``optimizer.distributed.dp_group_idx_<g>.optimizer``.
  dpmoe: a MoE run at expert parallel size > 1: every key prefixed ``chained_<i>.`` (0: dense, from EP rank 0;
  1: expert, per TP x EP x PP rank ``g = tp + tp_size * (ep + ep_size * pp)``, buffers counting the model chunks
  that hold experts), each optimizer's param groups from its own ``.optimizer`` object
  (``optimizer_torch_dist_dp.record_prefix``).
- tdplain: no distributed optimizer (``plain``): megatron-core's plain optimizer's records
  ``optimizer.state.{fp32_param (bf16/fp16 only),exp_avg,exp_avg_sq}.<model key>``, chunked as the model's, and
  ``state.common_step`` / ``param_groups`` in the common state (``optimizer_torch_dist_plain``); presented in its
  per-rank form (``float16`` or ``fp32``: the fp32 master is then the model weight).

Each read is one parameter's box (``TorchDistSource.load_state`` / ``load_flat``: in-place record
reads), so memory holds one parameter's state at a time. The writers of ``optimizer_reshard`` take
this source like ``OptimizerSource``; it presents itself in the ``distributed`` form.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pgconvert.model.grid import RankCoord
from pgconvert.io.limits import quote
from pgconvert.optimizer.flat import dp_size
from pgconvert.optimizer.fs_model_space import FIELDS as FS_FIELDS
from pgconvert.optimizer.fs_model_space import FS_MODEL_SPACE, chunk_shape
from pgconvert.optimizer.order import (MEGATRON_CORE_VERSIONS, FlatParam, OptimizerLayoutError, OptimizerRules,
                                     OptimizerSlot, UnsupportedOptimizerError, bucket_ranges, chained_slots,
                                     check_supported, flat_buffers, optimizer_count, optimizer_slots)
from pgconvert.optimizer.scaler import dp_object_key, held_scalers
from pgconvert.optimizer.state import (CARRIED_KEYS, DISTRIBUTED_SHARDING_TYPES, FORM_DISTRIBUTED, MOMENTS,
                                       OptimizerSource)
from pgconvert.optimizer.torch_dist_moe import chained_entries
from pgconvert.optimizer.torch_dist_plain import FIELDS as PLAIN_FIELDS
from pgconvert.optimizer.torch_dist_plain import PLAIN, plain_form, plain_step
from pgconvert.optimizer.torch_dist_plain import inner as plain_inner
from pgconvert.model.rules import ReplicaMismatchError, ShardRule

TORCH_DIST_FORMS = ("dp_reshardable", "fully_reshardable", FS_MODEL_SPACE)
# The stored field of each per-parameter key, per model-space form.
_MODEL_SPACE_FIELDS = {
    "fully_reshardable": {"param": "param", "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"},
    FS_MODEL_SPACE: FS_FIELDS,  # fsms: written by megatron-core <= 0.15.0 (verified with 0.15.0)
}
# fsms: fully_sharded_bucket_space and dp_zero_gather_scatter, deprecated forms, are not read.
_NOT_REPRODUCED: dict[str, str] = {}
_VERSIONS = "megatron-core " + " / ".join(MEGATRON_CORE_VERSIONS)


@dataclass
class _First:
    """What the per-rank writers read of the source's first rank: a path for messages and the carried entries."""

    path: Path
    extra: dict[str, Any]


@dataclass(frozen=True)
class _Owner:
    """One TP piece of a parameter: the source rank it lies on (DP rank 0) and its slot there."""

    path: Path
    coord: RankCoord


def sharding_type(common: dict[str, Any], where: str) -> str | None:
    """The checkpoint's ``param_state_sharding_type`` (None: no distributed optimizer state), checked."""
    if common.get("optimizer") is None:
        return None
    entries = chained_entries(common["optimizer"])  # tdmoe: {0: dense, 1: expert} when chained
    if not all(isinstance(optimizer, dict) for optimizer in entries):
        kinds = sorted({type(optimizer).__name__ for optimizer in entries})
        raise OptimizerLayoutError(f"{where}: optimizer is {quote(kinds)}, not a dict")
    if any("param_state_sharding_type" not in optimizer for optimizer in entries):
        return None
    types = {str(optimizer["param_state_sharding_type"]) for optimizer in entries}
    if len(types) != 1:
        raise OptimizerLayoutError(f"{where}: the chained optimizers' param_state_sharding_type differ: "
                                   f"{quote(sorted(types))}")
    sharding = entries[0]["param_state_sharding_type"]
    if sharding not in DISTRIBUTED_SHARDING_TYPES:
        raise OptimizerLayoutError(
            f"{where}: optimizer.param_state_sharding_type={quote(sharding)}: unknown sharding type ({_VERSIONS} "
            f"writes {', '.join(DISTRIBUTED_SHARDING_TYPES)})")
    if sharding not in TORCH_DIST_FORMS:
        why = _NOT_REPRODUCED.get(str(sharding), "not a form pgconvert reads")
        raise UnsupportedOptimizerError(
            f"{where}: optimizer.param_state_sharding_type={quote(sharding)}: {why}; pgconvert reads "
            f"{', '.join(TORCH_DIST_FORMS)} ({_VERSIONS}); pass --skip-optimizer")
    return str(sharding)


def holds_optimizer(source: Any) -> bool:
    """Whether a torch_dist source (``TorchDistSource``) carries optimizer state."""
    return isinstance(getattr(source, "common_state", None), dict) and "optimizer" in source.common_state


def _object_value(stored: Any) -> Any:
    """A ShardedObject's value: megatron-core stores it as ``torch.save([value])``."""
    return stored[0] if isinstance(stored, list) and len(stored) == 1 else stored


class TorchDistOptimizerSource(OptimizerSource):
    """The distributed optimizer's state of a ``TorchDistSource``, by canonical name (``names``,
    ``parameter``, ``piece``, ``step``) for ``optimizer_reshard``'s writers."""

    def __init__(self, source: Any) -> None:  # noqa: super().__init__ reads per-rank files; not called
        self.source = source
        self.config = source.config
        self.layout = source.layout
        self.vocab_rows = source.vocab_rows
        where = f"{source.directory} (common state)"
        common = source.common_state
        self.sharding = sharding_type(common, where)
        plain = plain_form(common, where) if self.sharding is None else None  # tdplain: the plain optimizer's
        if self.sharding is None and plain is None:
            detail = "no optimizer entry (saved with --no-save-optim?)" if "optimizer" not in common else \
                "the optimizer is neither megatron-core's distributed optimizer (no param_state_sharding_type) " \
                "nor its plain one (no state.common_step and param_groups)"
            raise UnsupportedOptimizerError(f"{where}: {detail}: its state is not carried from torch_dist; "
                                            "pass --skip-optimizer")
        self.sharding = self.sharding or PLAIN
        check_supported(self.config, where)
        args = common.get("args")
        self.rules = OptimizerRules.from_args(args, where)
        self.form = plain or FORM_DISTRIBUTED  # tdplain: a plain source presents itself in its per-rank form
        self.args = args
        self._owners_by_name, self._slots = self._index_slots()
        chained = self._chained_groups(common, where)
        self._step = plain_step(common["optimizer"], plain, where) if plain else \
            _one_step([group for groups in chained for group in groups], where)
        extra = {key: common[key] for key in (*CARRIED_KEYS, "iteration", "args") if key in common}
        extra["distributed_entries"] = [{"optimizer": {"param_groups": groups}} for groups in chained]
        self.first = _First(source.directory, extra)
        self._settings = [[{k: v for k, v in group.items() if k not in ("params", "step")} for group in groups]
                          for groups in chained]
        self.dtype_key = self._dtype_key()
        self.grad_scalers = self._grad_scalers(common)  # optcli
        self._check_stored()
        if self.sharding == "dp_reshardable":
            self._check_masters()

    def _index_slots(self) -> tuple[dict[str, list[tuple[_Owner, OptimizerSlot]]], dict[RankCoord, list]]:
        """Per canonical name its TP pieces (from the first stage holding it), and each rank's slots."""
        owners: dict[str, tuple[tuple[int, int, int], list[tuple[_Owner, OptimizerSlot]]]] = {}
        slots: dict[RankCoord, list] = {}
        # tdmoe: every expert-parallel rank (its experts); a dense parameter's pieces from EP rank 0
        for pp, ep, tp in itertools.product(range(self.layout.pp), range(self.layout.ep), range(self.layout.tp)):
            coord = RankCoord(tp=tp, pp=pp, ep=ep)
            slots[coord] = optimizer_slots(self.config, self.layout, coord, self.rules, self.vocab_rows)
            for slot in (slot for group in slots[coord] for slot in group):
                held = owners.setdefault(slot.spec.canonical, ((pp, slot.chunk, ep), []))
                if held[0] == (pp, slot.chunk, ep):
                    held[1].append((_Owner(self.source.directory, coord), slot))
        return {name: sorted(pieces, key=lambda p: p[1].spec.tp_rank) for name, (_, pieces) in owners.items()}, slots

    def _chained_groups(self, common: dict[str, Any], where: str) -> list[list[dict[str, Any]]]:
        """Per chained optimizer (tdmoe: dense, then expert-parallel), its param groups (hyperparameters and
        ``step``): common state for the model-space forms, the ShardedObject of model-parallel rank 0 for
        dp_reshardable (the same on every rank), dpmoe: ``chained_<i>.``-prefixed per optimizer when chained."""
        counts = [len(groups) for groups in chained_slots(self.config, self.layout, RankCoord(0, 0, 0), self.rules,
                                                          self.vocab_rows)]
        if self.sharding == "dp_reshardable":  # dpmoe: per chained optimizer, its chained_<i>.-prefixed object
            from pgconvert.optimizer.torch_dist_dp import record_prefix

            entries = chained_entries(common["optimizer"])
            if len(entries) == len(counts):
                keys = [f"{record_prefix(self.config, self.layout, RankCoord(0, 0, 0), index)}.optimizer/shard_0_1"
                        for index in range(len(entries))]
                read = self.source.read_objects(keys)
                values = [_object_value(read[key]) for key in keys]
                where = f"{self.source.directory}: {', '.join(keys)}"
            else:
                values = entries
        else:
            values = [plain_inner(entry, self.form) if self.sharding == PLAIN else entry.get("optimizer")
                      for entry in chained_entries(common["optimizer"])]  # tdplain: the torch optimizer's
        if len(values) != len(counts):
            raise OptimizerLayoutError(
                f"{where}: optimizer holds {len(values)} optimizer(s), but {_VERSIONS} chains {len(counts)} for this "
                f"model at {self.layout.describe()} (dense, then expert-parallel at expert parallel size > 1)")
        return [self._groups(value, count, where) for value, count in zip(values, counts)]

    def _grad_scalers(self, common: dict[str, Any]) -> list[Any]:
        """Per chained optimizer its grad scaler (None: none): common state in the model-space forms, the
        ShardedObject of model-parallel rank 0 (of each chained optimizer) for dp_reshardable (``optimizer_scaler``)."""
        if self.sharding != "dp_reshardable":
            return held_scalers(chained_entries(common["optimizer"]))
        from pgconvert.optimizer.torch_dist_dp import record_prefix

        stored = self.source._metadata.state_dict_metadata
        keys = [dp_object_key(record_prefix(self.config, self.layout, RankCoord(0, 0, 0), index))  # dpmoe: chained
                for index in range(optimizer_count(self.config, self.layout))]
        values = self.source.read_objects([key for key in keys if key in stored])
        return [_object_value(values[key]) if key in values else None for key in keys]

    @staticmethod
    def _groups(value: Any, count: int, where: str) -> list[dict[str, Any]]:
        groups = value.get("param_groups") if isinstance(value, dict) else None
        if not isinstance(groups, list) or len(groups) != count or not all(isinstance(g, dict) for g in groups):
            raise OptimizerLayoutError(f"{where}: optimizer param_groups = {quote(groups, 160)}; {_VERSIONS} "
                                       f"builds {count} for this model (weight decay, no weight decay)")
        return groups

    def _dtype_key(self) -> tuple[torch.dtype, torch.dtype]:
        """``distrib_optim.pt``'s buffer key: (model dtype, grad dtype)."""
        param = torch.bfloat16 if getattr(self.args, "bf16", False) else \
            torch.float16 if getattr(self.args, "fp16", False) else torch.float32
        fp32_grads = getattr(self.args, "accumulate_allreduce_grads_in_fp32", False)
        return (param, torch.float32 if fp32_grads else param)

    def bucket_key(self, coord: RankCoord, chunk: int, field: str, bucket: int = 0, optimizer: int = 0) -> str:
        """The record of buffer ``chunk`` (``gbuf_idx``), bucket and field of chained optimizer ``optimizer`` on rank
        ``coord`` (``optimizer_torch_dist_dp.record_prefix``: megatron-core's ``data_parallel_group_idx``)."""
        from pgconvert.optimizer.torch_dist_dp import record_prefix

        dtype = f"({self.dtype_key[0]}, {self.dtype_key[1]})"
        return (f"{record_prefix(self.config, self.layout, coord, optimizer)}.gbuf_idx_{chunk}.dtype_{dtype}"
                f".bucket_idx_{bucket}.{field}")

    def _flat_expected(self) -> dict[str, tuple[int, ...]]:
        """dp_reshardable: per chained optimizer and rank storing it, its buffers (``_flat``), and every bucket
        record's key and size (one record per DDP bucket, of the bucket's unpadded size)."""
        from pgconvert.optimizer.torch_dist_dp import optimizer_dp, optimizer_ranks

        where = f"{self.source.directory} (layout {self.layout.describe()})"
        self._flat = {}
        for index in range(optimizer_count(self.config, self.layout)):
            optimizer_dp(self.config, self.layout, dp_size(self.args), self.args, index, where)  # refuses by name
            for coord in optimizer_ranks(self.config, self.layout, index):
                self._flat[(coord, index)] = flat_buffers(self.config, self.layout, coord, self.rules, self.vocab_rows,
                                                          self.args, dp_size(self.args), index)
        # dpvpp: a buffer's index is not its chunk's where a chunk before it has no parameters
        self._by_position = {(coord, index, item.slot.chunk, item.slot.position): item
                             for (coord, index), buffers in self._flat.items() for placed, _ in buffers
                             for item in placed}
        return {self.bucket_key(coord, chunk, field, bucket, index): (end - start,)
                for (coord, index), buffers in self._flat.items() for chunk, (placed, numel) in enumerate(buffers)
                for bucket, (start, end) in enumerate(bucket_ranges(placed, numel)) for field in ("param", *MOMENTS)}

    def _model_space_prefix(self, key: str) -> str:
        if self.sharding == PLAIN:  # tdplain: "" (fp32): the model weight itself is the master
            stored = PLAIN_FIELDS[self.form][key]
            return f"optimizer.state.{stored}." if stored else ""
        return f"optimizer.state.{_MODEL_SPACE_FIELDS[self.sharding][key]}."

    def _check_stored(self) -> None:
        """Every record the layout needs is there with the size it derives (refused by name otherwise)."""
        stored = self.source.tensor_keys()
        if self.sharding == "dp_reshardable":
            expected = self._flat_expected()
            extra = sorted(key for key in stored if key.startswith(("optimizer.", "chained_")) and key not in expected)
        else:
            model_keys = {self.source._locations[name].key for name in self.names()}
            expected = {self._model_space_prefix(key) + model_key: stored[model_key]
                        for model_key in model_keys for key in ("param", *MOMENTS)}
            extra = []
            if self.sharding == FS_MODEL_SPACE:  # fsms: chunk counts per axis, then one chunk's elements
                for key, shape in expected.items():
                    if key in stored:
                        chunk_shape(stored[key], shape, f"{self.source.directory}: {quote(key)}")
                expected = {key: stored.get(key) for key in expected}
        for key, shape in expected.items():
            if key not in stored:
                raise OptimizerLayoutError(
                    f"{self.source.directory}: no optimizer record {quote(key)} ({self.sharding} form, {_VERSIONS}, "
                    f"layout {self.layout.describe()}); pass --skip-optimizer to convert the model alone")
            if stored[key] != shape:
                raise OptimizerLayoutError(
                    f"{self.source.directory}: {quote(key)} has global shape {list(stored[key])}; the model at "
                    f"{self.layout.describe()} gives {list(shape)} ({self.sharding}: " + (
                        "reverse parameter order, 64-element alignment, DDP buckets)" if self.sharding ==
                        "dp_reshardable" else "the model tensor's global shape)"))  # tdplain
        if extra:
            raise OptimizerLayoutError(
                f"{self.source.directory}: optimizer records {quote(extra[:4], 200)} are not ones the layout "
                f"{self.layout.describe()} derives (several buckets or buffers?) ({_VERSIONS})")

    def _check_masters(self) -> None:
        """megatron-core copies each fp32 master into its model parameter after every step: each master
        placed by the derived flat-buffer layout must round to the stored weight (one parameter at a time)."""
        for name in self.names():
            model = self.source.load(name)
            master = self._merged(name, "param")  # optmem: the master alone, not the moments too
            if not torch.equal(master.to(model.dtype), model):
                owner, slot = self._owners_by_name[name][0]
                gbuf, placed = self._gbuf_placed(owner.coord, slot)
                key = self.bucket_key(owner.coord, gbuf, "param", placed.bucket, slot.optimizer)
                raise OptimizerLayoutError(
                    f"{self.source.directory}: {key} at the range "
                    f"pgconvert derives for {name} does not round to the model's weight: the flat-buffer layout is "
                    f"not the one {_VERSIONS} uses (several buckets, another parameter order?)")

    def names(self) -> list[str]:
        return list(self._owners_by_name)

    def group_of(self, name: str) -> int:
        return self._owners_by_name[name][0][1].group

    def step(self, name: str) -> torch.Tensor:
        return self._step.clone()

    def _flat_piece(self, owner: _Owner, slot: OptimizerSlot, key: str) -> torch.Tensor:
        gbuf, placed = self._gbuf_placed(owner.coord, slot)
        flat = self.source.load_flat(self.bucket_key(owner.coord, gbuf, key, placed.bucket, slot.optimizer),
                                     placed.start - placed.bucket_start, placed.end - placed.start)
        return flat.view(tuple(slot.spec.local_shape))

    def _placed(self, coord: RankCoord, slot: OptimizerSlot) -> FlatParam:
        return self._gbuf_placed(coord, slot)[1]

    def _gbuf_placed(self, coord: RankCoord, slot: OptimizerSlot) -> tuple[int, FlatParam]:
        """The buffer (``gbuf_idx``: dpmoe, the expert optimizer's count only chunks holding experts) and place of
        ``slot`` (dense: its records are EP rank 0's, the same on every EP rank)."""
        stored = coord if slot.optimizer == 1 else RankCoord(tp=coord.tp, pp=coord.pp, ep=0)
        item = self._by_position.get((stored, slot.optimizer, slot.chunk, slot.position))
        if item is not None:
            return item.buffer, item
        raise OptimizerLayoutError(f"{self.source.directory}: {slot.spec.canonical} has no place in the derived "
                                   f"flat buffers of rank {coord} ({_VERSIONS})")

    def _pieces(self, name: str, key: str) -> list[torch.Tensor]:
        return [self._flat_piece(owner, slot, key) for owner, slot in self._owners_by_name[name]]

    def _merged(self, name: str, key: str) -> torch.Tensor:
        """dp_reshardable: the whole ``key`` of ``name``, its TP pieces read from the flat buffers."""
        rule = self._owners_by_name[name][0][1].spec.rule
        try:
            return rule.merge(self._pieces(name, key))
        except ReplicaMismatchError as error:
            raise OptimizerLayoutError(
                f"{self.source.directory}: {name}: optimizer {key} of a replicated parameter differs "
                f"between TP ranks {error.ranks}: the flat-buffer placement is not the one "
                f"{_VERSIONS} uses") from error

    def parameter(self, name: str) -> dict[str, torch.Tensor]:
        """The whole (source-padded) fp32 master, both moments and the step of ``name``."""
        if self.sharding == "dp_reshardable":
            merged = {key: self._merged(name, key) for key in ("param", *MOMENTS)}
        elif self.sharding == FS_MODEL_SPACE:  # fsms
            merged = {key: self.source.load_flattened_state(name, self._model_space_prefix(key))
                      for key in ("param", *MOMENTS)}
        else:
            merged = {key: self.source.load_state(name, self._model_space_prefix(key)) for key in ("param", *MOMENTS)}
        merged["step"] = self.step(name)
        return merged

    def piece(self, name: str, key: str, size: int, rank: int, rows: int | None,
              rule: ShardRule | None = None) -> torch.Tensor:
        """Piece ``rank`` of ``size`` of ``name``'s ``key`` cut with ``rule`` (the target's; default the source's),
        fitted to ``rows`` padded vocab rows."""
        if self.sharding == "dp_reshardable":
            return super().piece(name, key, size, rank, rows, rule)
        rule = rule or self._owners_by_name[name][0][1].spec.rule  # mlafix: the whole tensor, cut the target's way
        if self.sharding == FS_MODEL_SPACE:  # fsms: the whole parameter's record, cut
            whole = [self.source.load_flattened_state(name, self._model_space_prefix(key))]
            if rule.fits_rows and rows is not None:
                return rule.reshard_rows(whole, rows, self.config.vocab_size, size, rank)
            return rule.reshard(whole, size, rank)
        return self.source.load_state_shard(name, self._model_space_prefix(key), rule, size, rank,
                                            rows if rule.fits_rows else None)

    def param_group_settings(self, optimizer: int = 0, count: int | None = None) -> list[dict[str, Any]]:
        """Chained optimizer ``optimizer``'s groups without params and step, ``count`` of them: the source's own
        where it has that optimizer, else its dense groups with ``is_expert_parallel`` set (as
        ``OptimizerSource``)."""
        own = optimizer < len(self._settings)
        settings = [dict(group) for group in self._settings[optimizer if own else 0]]
        if not own:
            settings = [dict(group, is_expert_parallel=optimizer == 1) for group in settings]
        return settings if count is None else settings[:count]

    @property
    def _owners(self) -> dict[str, list[tuple[_Owner, OptimizerSlot]]]:  # OptimizerSource's name for it
        return self._owners_by_name


def _one_step(groups: list[dict[str, Any]], where: str) -> torch.Tensor:
    steps = {group.get("step") for group in groups}
    if len(steps) != 1 or not isinstance(next(iter(steps)), (int, float)):
        raise OptimizerLayoutError(f"{where}: optimizer param_groups[*].step = {quote(sorted(map(str, steps)))}: "
                                   "expected one step count")
    return torch.tensor(float(next(iter(steps))))
