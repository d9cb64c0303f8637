"""megatron-core's optimizer state inside a torch_dist checkpoint, by canonical parameter (read).

``DistributedOptimizer.sharded_state_dict`` (megatron/core/optimizer/distrib_optimizer.py) writes the
parameter state in the form ``metadata['distrib_optim_sharding_type']`` names (Megatron-LM:
``dp_reshardable``, or ``fully_reshardable`` with ``--dist-ckpt-optim-fully-reshardable``), and puts
``param_state_sharding_type`` in the common state (keys: ``pgconvert.formats.torch_dist_optimizer``). Read here:

- ``fully_reshardable``: ``optimizer.state.{param,exp_avg,exp_avg_sq}.<model key>``, each a
  ShardedTensor with its model tensor's global shape and chunks; the param groups (with ``step``)
  are common state (``optimizer.optimizer.param_groups``); a MoE run's chained optimizers:
  ``{0: dense, 1: expert}`` there;
- ``fully_sharded_model_space`` (megatron-core <= 0.15.0, Megatron-LM's default up to core_v0.14):
  ``optimizer.state.{fp32_param,exp_avg,exp_avg_sq}.<model key>``, each the model tensor reformulated by
  chunks (``loaders/torch_dist/fs_model_space.py``), read one parameter at a time; the param groups as for
  fully_reshardable. megatron-core 0.16.1 / 0.20.0 can neither save nor load it (flattened_range);
- ``dp_reshardable``: per model-parallel rank ``g`` (``data_parallel_group_idx``: the rank in the
  model-parallel group, ``tp + tp_size * pp``), per buffer and bucket,
  ``optimizer.distributed.dp_group_idx_<g>.gbuf_idx_<i>.dtype_<(param, grad dtype)>.bucket_idx_<b>.<field>``
  of global shape ``(numel_unpadded,)``: the DP-gathered flat buffer without the DP tail padding,
  i.e. ``distrib_optim.pt``'s coalesced buffer, placed with ``pgconvert.optimizer.flat.flat_buffers`` at the
  SOURCE layout; the param groups are the ShardedObject ``optimizer.distributed.dp_group_idx_<g>.optimizer``.
  A MoE run at expert parallel size > 1: every key prefixed ``chained_<i>.`` (0: dense, from EP rank 0;
  1: expert, per TP x EP x PP rank ``g = tp + tp_size * (ep + ep_size * pp)``, buffers counting the model chunks
  that hold experts), each optimizer's param groups from its own ``.optimizer`` object;
- no distributed optimizer (``plain``): megatron-core's plain optimizer's records
  ``optimizer.state.{fp32_param (bf16/fp16 only),exp_avg,exp_avg_sq}.<model key>``, chunked as the model's, and
  ``state.common_step`` / ``param_groups`` in the common state (``loaders/torch_dist/optimizer_forms.py``);
  presented in its per-rank form (``float16`` or ``fp32``: the fp32 master is then the model weight);
- a layer-wise run, Muon or Lion (``OptimizerRules.layer_wise``): each chained optimizer in its own form, the
  layer-wise one's state plain (``chained_0.``-prefixed in dp_reshardable), the distributed Adam's dp_reshardable or
  fully_reshardable over its own buffer (``_shardings``, ``optimizer_forms.layer_wise_shardings``); presented as
  ``layer-wise``.

Each read is one parameter's box (``TorchDistSource.load_state`` / ``load_flat``: in-place record
reads), so memory holds one parameter's state at a time. Every writer takes this source as any
``OptimizerSource``; it presents itself in the ``distributed`` form (or the plain one's).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pgconvert.formats.torch_dist_optimizer import (DP_RESHARDABLE, FS_MODEL_SPACE, MODEL_SPACE_FIELDS, PLAIN,
                                                    PLAIN_FIELDS, bucket_key, chain_prefixes, chained_entries,
                                                    object_key, record_prefix, scaler_key, state_key)
from pgconvert.io.limits import quote
from pgconvert.io.torch_input import StoredTensors
from pgconvert.loaders.torch_dist.fs_model_space import chunk_shape
from pgconvert.loaders.torch_dist.optimizer_forms import (layer_wise_shardings, object_value, plain_form, plain_inner,
                                                          plain_step, sharding_type)
from pgconvert.model.grid import RankCoord
from pgconvert.model.rules import ReplicaMismatchError, ShardRule
from pgconvert.optimizer.data_parallel import dp_size, optimizer_dp, optimizer_ranks
from pgconvert.optimizer.flat import FlatParam, bucket_ranges, buffer_dtype_key, flat_buffers
from pgconvert.optimizer.order import (MEGATRON_CORE_VERSIONS, OptimizerLayoutError, OptimizerRules, OptimizerSlot,
                                       UnsupportedOptimizerError, chained_slots, check_supported, optimizer_count,
                                       optimizer_slots)
from pgconvert.optimizer.scaler import held_scalers
from pgconvert.optimizer.source import (ABSENT, CARRIED_KEYS, FIELDS, FORM_DISTRIBUTED, FORM_FP16, FORM_FP32,
                                        FORM_LAYER_WISE, MasterMemory, OptimizerSource, SourceRank, StoredCopy,
                                        optimizer_label, rounds_to)

_VERSIONS = "megatron-core " + " / ".join(MEGATRON_CORE_VERSIONS)


@dataclass(frozen=True)
class _Owner:
    """One TP piece of a parameter: the source rank it lies on (DP rank 0) and its slot there."""

    path: Path
    coord: RankCoord


class TorchDistOptimizerSource(OptimizerSource):
    """The optimizer state of a ``TorchDistSource`` (``TorchDistSource.open_optimizer``), by canonical name
    (``names``, ``parameter``, ``piece``, ``step``)."""

    def __init__(self, source: Any) -> None:
        super().__init__()
        self.source = source
        self.config = source.config
        self.layout = source.layout
        self.vocab_rows = source.vocab_rows
        where = f"{source.directory} (common state)"
        common = source.common_state
        args = common.get("args")
        self.rules = OptimizerRules.from_args(args, where)
        self._read_forms(common, where)
        check_supported(self.config, where)
        self.args = args
        self._owners = self._index_slots()
        chained = self._chained = self._chained_groups(common, where)
        stepped = [member.stepped for member in self.chained()]
        counted = [group for index, groups in enumerate(chained) if stepped[index] for group in groups]
        self._step: torch.Tensor | None = plain_step(common["optimizer"], self._plain_form, where, stepped) \
            if self.sharding == PLAIN else _one_step(counted, where)
        extra = {key: common[key] for key in (*CARRIED_KEYS, "iteration", "args") if key in common}
        extra["distributed_entries"] = [{"optimizer": {"param_groups": groups}} for groups in chained]
        self.first = SourceRank(source.directory, extra)
        self._settings = [[{k: v for k, v in group.items() if k not in ("params", "step")} for group in groups]
                          for groups in chained]
        self.dtype_key = buffer_dtype_key(args)
        self.grad_scalers = self._grad_scalers(common)
        self._chain_prefixes = chain_prefixes(optimizer_count(self.config, self.layout, self.rules),  # as named
                                              any(key.startswith("chained_0.optimizer.state.")
                                                  for key in source.tensor_keys()))
        self._stored = StoredTensors(source.handles)  # dp_reshardable's pieces, read in place (``_stored_pieces``)
        self._check_stored()
        if self.form != FORM_FP32:  # FP32Optimizer keeps no masters: the weights are
            self._check_masters()

    def _read_forms(self, common: dict[str, Any], where: str) -> None:
        """The stored form: ``sharding`` (the distributed optimizer's, else ``plain``), ``_shardings`` (per chained
        optimizer: a layer-wise run's emerging optimizer's state is stored in the plain form, its Adam state in the
        distributed one's), ``form`` (what the source presents: a plain optimizer its per-rank form) and
        ``_plain_form`` (the form of the records stored plain)."""
        count = optimizer_count(self.config, self.layout, self.rules)
        if self.rules.layer_wise:
            self._shardings = layer_wise_shardings(common, where)
            self.sharding, self.form, self._plain_form = self._shardings[1], FORM_LAYER_WISE, FORM_FP16
            return
        sharding = sharding_type(common, where)
        plain = plain_form(common, where) if sharding is None else None  # the plain optimizer's form
        if sharding is None and plain is None:
            detail = "no optimizer entry (saved with --no-save-optim?)" if "optimizer" not in common else \
                "the optimizer is neither megatron-core's distributed optimizer (no param_state_sharding_type) " \
                "nor its plain one (no state.common_step and param_groups)"
            raise UnsupportedOptimizerError(f"{where}: {detail}: its state is not carried from torch_dist; "
                                            "pass --skip-optimizer")
        self.sharding = sharding or PLAIN
        self._shardings = [self.sharding] * count
        self.form = plain or FORM_DISTRIBUTED  # a plain source presents itself in its per-rank form
        self._plain_form = plain or ""

    def _sharding_of(self, name: str) -> str:
        """The form ``name``'s state is stored in (its chained optimizer's)."""
        return self._shardings[self.optimizer_of(name)]

    def _index_slots(self) -> dict[str, list[tuple[_Owner, OptimizerSlot]]]:
        """Per canonical name its TP pieces (expert TP pieces for an expert), from the first stage holding it: every
        expert-parallel rank's experts, a dense parameter's pieces from EP rank 0. With an expert tensor-parallel
        size other than TP, the experts come from the expert optimizer's own ranks (``optimizer_ranks``)."""
        owners: dict[str, tuple[tuple[int, int, int], list[tuple[_Owner, OptimizerSlot]]]] = {}
        expert = [index for index, member in enumerate(self.chained()) if member.expert]
        apart = self.layout.expert_tp_size != self.layout.tp and bool(expert)
        coords = [RankCoord(tp=tp, pp=pp, ep=ep) for pp, ep, tp in
                  itertools.product(range(self.layout.pp), range(self.layout.ep), range(self.layout.tp))]
        for coord in coords + (optimizer_ranks(self.config, self.layout, expert[0], self.rules) if apart else []):
            for slot in (slot for group in optimizer_slots(self.config, self.layout, coord, self.rules,
                                                           self.vocab_rows) for slot in group):
                if apart and slot.member.expert != (coord.etp is not None):
                    continue
                held = owners.setdefault(slot.spec.canonical, ((coord.pp, slot.chunk, coord.ep), []))
                if held[0] == (coord.pp, slot.chunk, coord.ep):
                    held[1].append((_Owner(self.source.directory, coord), slot))
        return {name: sorted(pieces, key=lambda p: p[1].spec.tp_rank) for name, (_, pieces) in owners.items()}

    def _chained_groups(self, common: dict[str, Any], where: str) -> list[list[dict[str, Any]]]:
        """Per chained optimizer (``order.chain``), its param groups (hyperparameters and
        ``step``): common state for the model-space forms, the ShardedObject of model-parallel rank 0 for
        dp_reshardable (the same on every rank), ``chained_<i>.``-prefixed per optimizer when chained."""
        counts = [len(groups) for groups in chained_slots(self.config, self.layout, RankCoord(0, 0, 0), self.rules,
                                                          self.vocab_rows)]
        entries = chained_entries(common["optimizer"])
        values: list[Any] = list(entries)
        if len(entries) == len(counts):  # dp_reshardable: the optimizer's chained_<i>.-prefixed object
            keys = {index: object_key(self._record_prefix(RankCoord(0, 0, 0), index), "optimizer")
                    for index, sharding in enumerate(self._shardings) if sharding == DP_RESHARDABLE}
            read = self.source.read_objects(list(keys.values()))
            for index, entry in enumerate(entries):
                values[index] = object_value(read[keys[index]]) if index in keys else \
                    plain_inner(entry, self._plain_form) if self._shardings[index] == PLAIN else entry.get("optimizer")
            if keys:
                where = f"{self.source.directory}: {', '.join(keys.values())}"
        if len(values) != len(counts):
            raise OptimizerLayoutError(
                f"{where}: optimizer holds {len(values)} optimizer(s), but {_VERSIONS} chains {len(counts)} for this "
                f"model at {self.layout.describe()} (dense, then expert-parallel at expert parallel size > 1; a Muon "
                "run's Muon optimizers before Adam's)")
        return [self._groups(value, count, where) for value, count in zip(values, counts)]

    def _grad_scalers(self, common: dict[str, Any]) -> list[Any]:
        """Per chained optimizer its grad scaler (None: none): common state in the model-space and plain forms, the
        ShardedObject of model-parallel rank 0 (of each chained optimizer) for dp_reshardable
        (``pgconvert.optimizer.scaler``)."""
        held = held_scalers(chained_entries(common["optimizer"]))
        keys = {index: scaler_key(self._record_prefix(RankCoord(0, 0, 0), index))  # per chained one
                for index, sharding in enumerate(self._shardings) if sharding == DP_RESHARDABLE}
        values = self.source.read_objects([key for key in keys.values() if self.source.holds_entry(key)])
        return [(object_value(values[keys[index]]) if keys[index] in values else None) if index in keys else
                (held[index] if index < len(held) else None) for index in range(len(self._shardings))]

    def _record_prefix(self, coord: RankCoord, optimizer: int) -> str:
        """dp_reshardable: the records' prefix of chained optimizer ``optimizer`` on rank ``coord``."""
        return record_prefix(self.config, self.layout, coord, optimizer, self.rules)

    def stored_copies(self) -> list[StoredCopy]:
        """The common state (the carried counters, the param groups and grad scalers but for dp_reshardable, a
        plain optimizer's step, the buffer key the args give) and, for dp_reshardable, every model-parallel rank's
        param-group and grad-scaler objects."""
        common = self.source.common_state
        values: dict[str, Any] = {key: common.get(key, ABSENT) for key in (*CARRIED_KEYS, "iteration")}
        count = len(self._chained)
        copies = self._rank_objects()
        for index, groups in enumerate(self._chained):
            if self._shardings[index] != DP_RESHARDABLE:
                values[f"{optimizer_label(index, count)}.param_groups"] = groups
                values[f"{optimizer_label(index, count)}.grad_scaler"] = self.grad_scalers[index]
        if self.sharding == PLAIN and self._step is not None:  # None: no chained optimizer counts steps
            values["optimizer.state[*].step"] = [self._step]
        if self.form in (FORM_DISTRIBUTED, FORM_LAYER_WISE):
            values["dtype_key"] = [self.dtype_key]
        return [StoredCopy(f"{self.source.directory} (common state)", values), *copies]

    def _rank_objects(self) -> list[StoredCopy]:
        """dp_reshardable: per chained optimizer, each model-parallel rank's param groups and grad scaler (its
        ShardedObjects ``<prefix>.optimizer`` and ``<prefix>.grad_scaler``)."""
        count = len(self._chained)
        prefixes = [(index, self._record_prefix(coord, index)) for index in range(count)
                    if self._shardings[index] == DP_RESHARDABLE
                    for coord in optimizer_ranks(self.config, self.layout, index, self.rules)]
        scalers = {prefix: scaler_key(prefix) for _, prefix in prefixes if self.source.holds_entry(scaler_key(prefix))}
        read = self.source.read_objects([object_key(prefix, "optimizer") for _, prefix in prefixes]
                                        + list(scalers.values()))
        copies = []
        for index, prefix in prefixes:
            held = object_value(read[object_key(prefix, "optimizer")])
            label = optimizer_label(index, count)
            copies.append(StoredCopy(f"{self.source.directory}: {prefix}", {
                f"{label}.param_groups": held.get("param_groups", ABSENT) if isinstance(held, dict) else held,
                f"{label}.grad_scaler": object_value(read[scalers[prefix]]) if prefix in scalers else None}))
        return copies

    def stored_parts(self, name: str, key: str) -> list[tuple[str, torch.Tensor]]:
        where = self.source.directory
        if self._sharding_of(name) == DP_RESHARDABLE:
            parts = []
            for owner, slot in self._owners[name]:
                record = self._flat_range(owner, slot, key)[0]
                parts.append((f"{where}: {record}", self._flat_piece(owner, slot, key)))
            return parts
        prefix = self._model_space_prefix(key, name)
        read = self.source.load_flattened_state if self._sharding_of(name) == FS_MODEL_SPACE else self.source.load_state
        keys = ", ".join(prefix + key for key in self.source.model_keys(name))
        return [(f"{where}: {keys}", read(name, prefix))]

    @staticmethod
    def _groups(value: Any, count: int, where: str) -> list[dict[str, Any]]:
        groups = value.get("param_groups") if isinstance(value, dict) else None
        if not isinstance(groups, list) or len(groups) != count or not all(isinstance(g, dict) for g in groups):
            raise OptimizerLayoutError(f"{where}: optimizer param_groups = {quote(groups, 160)}; {_VERSIONS} "
                                       f"builds {count} for this model (weight decay, no weight decay)")
        return groups

    def bucket_key(self, coord: RankCoord, chunk: int, field: str, bucket: int = 0, optimizer: int = 0) -> str:
        """The record of buffer ``chunk`` (``gbuf_idx``), bucket and field of chained optimizer ``optimizer`` on rank
        ``coord`` (``record_prefix``: megatron-core's ``data_parallel_group_idx``)."""
        return bucket_key(self._record_prefix(coord, optimizer), chunk, self.dtype_key, bucket, field)

    def _flat_expected(self) -> dict[str, tuple[int, ...]]:
        """dp_reshardable: per chained optimizer and rank storing it, its buffers (``_flat``), and every bucket
        record's key and size (one record per DDP bucket, of the bucket's unpadded size)."""
        where = f"{self.source.directory} (layout {self.layout.describe()})"
        self._flat = {}
        for index in (index for index, sharding in enumerate(self._shardings) if sharding == DP_RESHARDABLE):
            optimizer_dp(self.config, self.layout, dp_size(self.args), self.args, index, where,
                         self.rules)  # refuses by name
            for coord in optimizer_ranks(self.config, self.layout, index, self.rules):
                self._flat[(coord, index)] = flat_buffers(self.config, self.layout, coord, self.rules, self.vocab_rows,
                                                          self.args, dp_size(self.args), index)
        # a buffer's index is not its chunk's where a chunk before it has no parameters
        self._by_position = {(coord, index, item.slot.chunk, item.slot.position): item
                             for (coord, index), buffers in self._flat.items() for placed, _ in buffers
                             for item in placed}
        return {self.bucket_key(coord, chunk, field, bucket, index): (end - start,)
                for (coord, index), buffers in self._flat.items() for chunk, (placed, numel) in enumerate(buffers)
                for bucket, (start, end) in enumerate(bucket_ranges(placed, numel)) for field in FIELDS}

    def _model_space_prefix(self, key: str, name: str) -> str:
        """What the model-space and plain forms put before ``name``'s model key for field ``key``: its chained
        optimizer's prefix (``chain_prefixes``) and ``optimizer.state.<stored field>.``; "" for an fp32 plain
        optimizer's master (the model weight itself)."""
        sharding = self._sharding_of(name)
        if sharding == PLAIN:
            stored = PLAIN_FIELDS[self._plain_form][key]
            if not stored:
                return ""
        else:
            stored = MODEL_SPACE_FIELDS[sharding][key]
        return self._chain_prefixes[self.optimizer_of(name)] + state_key(stored, "")

    def _check_stored(self) -> None:
        """Every record the layout needs is there with the size it derives (refused by name otherwise)."""
        stored = self.source.tensor_keys()
        expected = {self._model_space_prefix(key, name) + model_key: stored[model_key] for name in self.names()
                    if self._sharding_of(name) != DP_RESHARDABLE
                    for model_key in self.source.model_keys(name) for key in self.fields(name)}
        extra = []
        if self.sharding == FS_MODEL_SPACE:  # chunk counts per axis, then one chunk's elements
            for key, shape in expected.items():
                if key in stored:
                    chunk_shape(stored[key], shape, f"{self.source.directory}: {quote(key)}")
            expected = {key: stored.get(key) for key in expected}
        if DP_RESHARDABLE in self._shardings:
            expected.update(self._flat_expected())
            extra = sorted(key for key in stored if key.startswith(("optimizer.", "chained_")) and key not in expected)
        for key, shape in expected.items():
            if key not in stored:
                raise OptimizerLayoutError(
                    f"{self.source.directory}: no optimizer record {quote(key)} ({self.sharding} form, {_VERSIONS}, "
                    f"layout {self.layout.describe()}); pass --skip-optimizer to convert the model alone")
            if stored[key] != shape:
                raise OptimizerLayoutError(
                    f"{self.source.directory}: {quote(key)} has global shape {list(stored[key])}; the model at "
                    f"{self.layout.describe()} gives {list(shape)} ({self.sharding}: " + (
                        "reverse parameter order, 64-element alignment, DDP buckets)" if ".distributed." in key
                        else "the model tensor's global shape)"))
        if extra:
            raise OptimizerLayoutError(
                f"{self.source.directory}: optimizer records {quote(extra[:4], 200)} are not ones the layout "
                f"{self.layout.describe()} derives (several buckets or buffers?) ({_VERSIONS})")

    def _check_masters(self) -> None:
        """megatron-core copies each fp32 master into its model parameter after every step: each master (for
        dp_reshardable: placed by the derived flat-buffer layout) must round to the stored weight (one parameter at
        a time, the weight and the master read into memory reused from one parameter to the next)."""
        memory = MasterMemory()
        for name in self.names():
            wrong = self._unrounded_master(name, memory)
            if wrong is not None:
                raise OptimizerLayoutError(wrong)

    def _unrounded_master(self, name: str, memory: MasterMemory) -> str | None:
        """Why ``name``'s fp32 master does not round to its weight (None: it does)."""
        meta, flat = self.source.meta(name), self._sharding_of(name) == DP_RESHARDABLE
        with memory.weight(meta.shape, meta.dtype):
            model = self.source.load(name)
        with memory.master(meta.shape):
            if not flat:
                ((record, master),) = self.stored_parts(name, "param")
            else:
                master = self._merged(name, "param")  # the master alone, not the moments too
        if rounds_to(master, model):
            return None
        if not flat:
            return (f"{record} does not round to the model's {name}: {_VERSIONS} copies each fp32 master into its "
                    "weight after every step, so the two must agree")
        owner, slot = self._owners[name][0]
        gbuf, placed = self._gbuf_placed(owner.coord, slot)
        key = self.bucket_key(owner.coord, gbuf, "param", placed.bucket, slot.optimizer)
        return (f"{self.source.directory}: {key} at the range pgconvert derives for {name} does not round to the "
                f"model's weight: the flat-buffer layout is not the one {_VERSIONS} uses (several buckets, another "
                "parameter order?)")

    def step(self, name: str) -> torch.Tensor:
        if self._step is None:  # asked only for a parameter whose optimizer counts steps (``stepped``)
            raise OptimizerLayoutError(f"{self.source.directory}: {name}: no chained optimizer counts steps")
        return self._step.clone()

    def _flat_range(self, owner: _Owner, slot: OptimizerSlot, key: str) -> tuple[str, int, int]:
        """Where ``key`` of ``slot``'s piece lies in the flat records: the bucket's key, start and length."""
        gbuf, placed = self._gbuf_placed(owner.coord, slot)
        return (self.bucket_key(owner.coord, gbuf, key, placed.bucket, slot.optimizer),
                placed.start - placed.bucket_start, placed.end - placed.start)

    def _flat_piece(self, owner: _Owner, slot: OptimizerSlot, key: str) -> torch.Tensor:
        return self.source.load_flat(*self._flat_range(owner, slot, key)).view(tuple(slot.spec.local_shape))

    def _placed(self, coord: RankCoord, slot: OptimizerSlot) -> FlatParam:
        return self._gbuf_placed(coord, slot)[1]

    def _gbuf_placed(self, coord: RankCoord, slot: OptimizerSlot) -> tuple[int, FlatParam]:
        """The buffer (``gbuf_idx``: the expert optimizer's count only chunks holding experts) and place of
        ``slot`` (dense: its records are EP rank 0's, the same on every EP rank)."""
        stored = coord if slot.member.expert else RankCoord(tp=coord.tp, pp=coord.pp, ep=0)
        item = self._by_position.get((stored, slot.optimizer, slot.chunk, slot.position))
        if item is not None:
            return item.buffer, item
        raise OptimizerLayoutError(f"{self.source.directory}: {slot.spec.canonical} has no place in the derived "
                                   f"flat buffers of rank {coord} ({_VERSIONS})")

    def _pieces(self, name: str, key: str) -> list[torch.Tensor]:
        return [self._flat_piece(owner, slot, key) for owner, slot in self._owners[name]]

    def _stored_pieces(self, name: str, key: str) -> list[torch.Tensor] | None:
        """dp_reshardable: each TP piece left at its range of its flat record, so that joins read it straight into
        its place; None in the model-space forms, or where a piece's range is not within one stored chunk."""
        if self._sharding_of(name) != DP_RESHARDABLE:
            return None
        pieces = []
        for owner, slot in self._owners[name]:
            stored = self.source.flat_meta(*self._flat_range(owner, slot, key))
            if stored is None:
                return None
            pieces.append(stored.view(tuple(slot.spec.local_shape)))
        return pieces

    def _merged(self, name: str, key: str) -> torch.Tensor:
        """dp_reshardable: the whole ``key`` of ``name``, its TP pieces read from the flat buffers."""
        rule = self.rule(name)
        return self._joined(name, key, rule, rule.merge, own=True)

    def _replicas_differ(self, name: str, key: str, error: ReplicaMismatchError) -> OptimizerLayoutError:
        if self._sharding_of(name) != DP_RESHARDABLE:
            return super()._replicas_differ(name, key, error)
        return OptimizerLayoutError(
            f"{self.source.directory}: {name}: optimizer {key} of a replicated parameter differs "
            f"between TP ranks {error.ranks}: the flat-buffer placement is not the one "
            f"{_VERSIONS} uses")

    def _parameter(self, name: str) -> dict[str, torch.Tensor]:
        sharding = self._sharding_of(name)
        if sharding == DP_RESHARDABLE:
            merged = {key: self._merged(name, key) for key in FIELDS}
        elif sharding == FS_MODEL_SPACE:
            merged = {key: self.source.load_flattened_state(name, self._model_space_prefix(key, name))
                      for key in FIELDS}
        else:
            merged = {key: self.source.load_state(name, self._model_space_prefix(key, name))
                      for key in self.fields(name)}
        if self.stepped(name):
            merged["step"] = self.step(name)
        return merged

    def _piece(self, name: str, key: str, size: int, rank: int, rows: int | None,
               rule: ShardRule | None = None) -> torch.Tensor:
        sharding = self._sharding_of(name)
        if sharding == DP_RESHARDABLE:
            return super()._piece(name, key, size, rank, rows, rule)
        rule = rule or self.rule(name)  # the whole tensor, cut the target's way
        if sharding == FS_MODEL_SPACE:  # the whole parameter's record, cut
            whole = [self.source.load_flattened_state(name, self._model_space_prefix(key, name))]
            if rule.fits_rows and rows is not None:
                return rule.reshard_rows(whole, rows, self.config.vocab_size, size, rank)
            return rule.reshard(whole, size, rank)
        return self.source.load_state_shard(name, self._model_space_prefix(key, name), rule, size, rank,
                                            rows if rule.fits_rows else None)

    def _stored_group_settings(self, optimizer: int) -> list[dict[str, Any]] | None:
        """Chained optimizer ``optimizer``'s groups without params and step."""
        return [dict(group) for group in self._settings[optimizer]]


def _one_step(groups: list[dict[str, Any]], where: str) -> torch.Tensor:
    steps = [group.get("step") for group in groups]
    if not steps or not all(isinstance(step, (int, float)) for step in steps) or len(set(steps)) != 1:
        raise OptimizerLayoutError(f"{where}: optimizer param_groups[*].step = {quote(steps)}: "
                                   "expected one step count")
    return torch.tensor(float(steps[0]))
