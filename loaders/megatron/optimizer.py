"""The Megatron optimizer state of a per-rank checkpoint, by canonical parameter.

``MegatronOptimizerSource`` reads the ``optimizer`` entry of every rank file, checks it against the positions
``pgconvert.optimizer.order`` derives, and answers per canonical parameter: the fp32 master weight, ``exp_avg``,
``exp_avg_sq`` and ``step``, whole (``parameter``) or cut for another layout's rank (``piece``) with the
parameter's own ShardRule. Nothing is memory-mapped: the files are read as their structure
(``formats.megatron.safe_torch_structure``), each large tensor left in its file as a meta tensor that knows
where its bytes are, and each parameter's pieces are read with ``preadv`` straight into their place in the
merged or cut result (``io.torch_input.StoredTensors``). Three forms are read:

- FP32Optimizer (fp32 training): ``optimizer = {state, param_groups}``; the master weight is the
  model parameter itself;
- Float16OptimizerWithFloat16Params (``--bf16``/``--fp16``): ``optimizer = {optimizer: {state,
  param_groups}, grad_scaler, fp32_from_fp16_params}``, the fp32 masters per group in params order;
- DistributedOptimizer (``--use-distributed-optimizer``): the rank file holds only the param groups, the state
  is the ``distrib_optim.pt`` beside it (``loaders/megatron/distrib_optim.py``).

A mixture-of-experts run at expert parallel size > 1 chains two optimizers (dense, then expert-parallel):
``optimizer`` is then a list of two entries of the same form, each with its own positions. So does a plain Muon run
(``--optimizer muon`` without the distributed optimizer, megatron-core 0.19.2 and Megatron-LM d98e8a64): Muon's, whose
state per parameter is its ``momentum_buffer`` (no step), then its scalar optimizer Adam's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pgconvert.formats.megatron import DISTRIB_OPTIM_FILE, safe_torch_structure
from pgconvert.io.limits import quote
from pgconvert.io.torch_input import StoredTensors
from pgconvert.loaders.megatron.distrib_optim import read_distributed
from pgconvert.model.grid import RankCoord
from pgconvert.optimizer.order import (MEGATRON_CORE_VERSIONS, OptimizerLayoutError, OptimizerRules, OptimizerSlot,
                                       UnsupportedOptimizerError, chain, chained_slots, check_param_groups,
                                       check_state_shapes)
from pgconvert.optimizer.scaler import held_scalers
from pgconvert.optimizer.source import (ABSENT, CARRIED_KEYS, DISTRIBUTED_SHARDING_TYPES, FORM_DISTRIBUTED,
                                        FORM_FP16, FORM_FP32, MasterMemory, OptimizerSource, SourceRank, StoredCopy,
                                        optimizer_label, rounds_to)


@dataclass
class _RankOptimizer(SourceRank):
    """One rank's optimizers (one, or the dense and expert-parallel ones chained): per optimizer its groups
    of slots, its ``{state, param_groups}`` and its fp32 masters by position."""

    slots: list[list[list[OptimizerSlot]]]
    inners: list[dict[str, Any]]
    masters: list[list[torch.Tensor]]


def chained_entries(optimizer: Any, count: int, path: Path) -> list[Any]:
    """The rank file's optimizer entry per chained optimizer: a list of ``count`` (dense, expert-parallel)
    when megatron-core chains two (ChainedOptimizer.state_dict), else the one entry."""
    if count == 1 and not isinstance(optimizer, list):
        return [optimizer]
    if not isinstance(optimizer, list) or len(optimizer) != count:
        held = f"a list of {len(optimizer)}" if isinstance(optimizer, list) else "one optimizer"
        raise OptimizerLayoutError(
            f"{path}: optimizer holds {held}, but megatron-core {' / '.join(MEGATRON_CORE_VERSIONS)} chains {count} "
            "for this model and layout (dense, then expert-parallel at expert parallel size > 1)")
    return optimizer


def _form_of(optimizer: Any, path: Path) -> str:
    if isinstance(optimizer, dict) and {"state", "param_groups"} <= set(optimizer):
        return FORM_FP32
    if isinstance(optimizer, dict) and "fp32_from_fp16_params" in optimizer \
            and isinstance(optimizer.get("optimizer"), dict):
        return FORM_FP16
    if isinstance(optimizer, dict) and isinstance(optimizer.get("optimizer"), dict) \
            and "state" not in optimizer["optimizer"]:
        _check_distributed(optimizer, path)
        return FORM_DISTRIBUTED
    keys = sorted(map(str, optimizer)) if isinstance(optimizer, dict) else type(optimizer).__name__
    raise OptimizerLayoutError(f"{path}: optimizer has fields {quote(keys, 160)}: not a form of megatron-core "
                               f"{' / '.join(MEGATRON_CORE_VERSIONS)} that pgconvert reads")


def _check_distributed(optimizer: dict[str, Any], path: Path) -> None:
    """A distributed optimizer's rank-file entry (param groups only): its state must be beside it."""
    sharding = optimizer.get("param_state_sharding_type", "dp_reshardable")
    if sharding not in DISTRIBUTED_SHARDING_TYPES:
        raise OptimizerLayoutError(
            f"{path}: optimizer.param_state_sharding_type={quote(sharding)}: unknown sharding type (megatron-core "
            f"{' / '.join(MEGATRON_CORE_VERSIONS)} writes {', '.join(DISTRIBUTED_SHARDING_TYPES)})")
    if not (path.parent / DISTRIB_OPTIM_FILE).is_file():
        raise OptimizerLayoutError(
            f"{path}: the distributed optimizer's state file {path.parent / DISTRIB_OPTIM_FILE} is missing "
            "(the rank file holds only its param groups); pass --skip-optimizer to convert the model alone")
    if sharding != "dp_reshardable":
        raise UnsupportedOptimizerError(
            f"{path}: distributed-optimizer state in the {sharding} form is not carried yet; pass --skip-optimizer")


def _masters(form: str, optimizer: dict[str, Any], state: dict[str, Any], slots: list[list[OptimizerSlot]],
             chunk_keys: Sequence[str], path: Path, stored: StoredTensors) -> list[torch.Tensor]:
    """The fp32 master weight of every position, in position order (as stored: in memory or in the file)."""
    flat = [slot for group in slots for slot in group]
    if form == FORM_FP32:
        return [state[chunk_keys[slot.chunk]][slot.spec.local_name] for slot in flat]
    groups = optimizer["fp32_from_fp16_params"]
    held = isinstance(groups, list) and all(isinstance(g, list) for g in groups)
    if not held or [len(g) for g in groups] != [len(g) for g in slots]:
        sizes = [len(g) for g in groups] if held else quote(groups, 80)
        raise OptimizerLayoutError(f"{path}: optimizer.fp32_from_fp16_params holds {quote(sizes)} masters per "
                                   f"group, but the model gives {[len(g) for g in slots]}")
    masters = [master for group in groups for master in group]
    for slot, master in zip(flat, masters):
        if not isinstance(master, torch.Tensor) or tuple(master.shape) != tuple(slot.spec.local_shape):
            raise OptimizerLayoutError(f"{path}: optimizer.fp32_from_fp16_params[{slot.group}] entry for "
                                       f"{slot.spec.local_name} is not a tensor of shape {slot.spec.local_shape}")
    check_masters_round(state, flat, masters, chunk_keys, path, "optimizer.fp32_from_fp16_params", stored)
    return masters


def check_masters_round(state: dict[str, Any], slots: Sequence[Any], masters: Sequence[torch.Tensor],
                        chunk_keys: Sequence[str], path: Path, field: str, stored: StoredTensors) -> None:
    """megatron-core copies each fp32 master into its model parameter after every step: each master
    must round to the stored weight, or the positions do not map to these parameters (both read from
    their files one parameter at a time, into memory reused from one to the next)."""
    flat = [slot for item in slots for slot in (item if isinstance(item, list) else [item])]
    memory = MasterMemory()
    for slot, master in zip(flat, masters):
        if not _master_rounds(stored, memory, state[chunk_keys[slot.chunk]][slot.spec.local_name], master):
            raise OptimizerLayoutError(
                f"{path}: {field} entry at position {slot.position} (group {slot.group}) does not round to the "
                f"model's {slot.spec.local_name}: the checkpoint's parameter order is not the one megatron-core "
                f"{' / '.join(MEGATRON_CORE_VERSIONS)} builds")


def _master_rounds(stored: StoredTensors, memory: MasterMemory, weight: torch.Tensor, master: torch.Tensor) -> bool:
    """``rounds_to`` of one stored master and weight, each read into ``memory``'s block for it."""
    with memory.weight(weight.shape, weight.dtype):
        held = stored.read(weight)
    with memory.master(master.shape):
        kept = stored.read(master)
    return rounds_to(kept, held)


def _tp_order(pieces: list[tuple[_RankOptimizer, OptimizerSlot]]) -> list[tuple[_RankOptimizer, OptimizerSlot]]:
    return sorted(pieces, key=lambda piece: piece[1].spec.tp_rank)


class MegatronOptimizerSource(OptimizerSource):
    """Every rank's optimizer state of a Megatron per-rank source (``MegatronSource``-like: ``config``,
    ``layout``, ``files`` by RankCoord, ``vocab_rows``)."""

    def __init__(self, source: Any) -> None:
        super().__init__()
        self.config = source.config
        self.layout = source.layout
        self.vocab_rows: int = source.vocab_rows
        self.ranks: dict[RankCoord, _RankOptimizer] = {}
        self.form = ""
        # The source's open rank files, and those beside them, closed with it.
        self._stored = StoredTensors(source.handles)
        chunk_keys = [f"model{i}" for i in range(self.layout.virtual_size)] if self.layout.has_virtual_chunks \
            else ["model"]
        for coord, path in sorted(source.files.items(), key=lambda item: (item[0].pp, item[0].ep, item[0].tp)):
            self.ranks[coord] = self._read_rank(coord, Path(path), chunk_keys)
        self.first = self.ranks[min(self.ranks, key=lambda c: (c.pp, c.ep, c.tp))]
        self.dtype_key = self.first.inners[0].get("dtype_key")
        self.grad_scalers = self.first.extra.get("grad_scalers", [None])
        self.rules = OptimizerRules.from_args(self.first.extra.get("args"), str(self.first.path))
        self._owners = self._index()

    def _read_rank(self, coord: RankCoord, path: Path, chunk_keys: list[str]) -> _RankOptimizer:
        state = safe_torch_structure(path)
        if "optimizer" not in state:
            raise OptimizerLayoutError(f"{path}: no 'optimizer' entry (saved with --no-save-optim?); "
                                       "pass --skip-optimizer")
        rules = OptimizerRules.from_args(state.get("args"), str(path))
        chained = chained_slots(self.config, self.layout, coord, rules, self.vocab_rows)
        entries = chained_entries(state["optimizer"], len(chained), path)
        forms = {_form_of(entry, path) for entry in entries}
        form = forms.pop()
        if forms or (self.form and form != self.form):
            raise OptimizerLayoutError(f"{path}: optimizer form {form} differs from the first rank's {self.form}")
        self.form = form
        extra = {key: state[key] for key in (*CARRIED_KEYS, "iteration", "args") if key in state}
        if form == FORM_DISTRIBUTED:
            extra["distributed_entries"] = entries
            extra["grad_scalers"] = held_scalers(entries)
            views = read_distributed(self.config, self.layout, coord, rules, self.vocab_rows, state, path, entries)
            inners, masters = [], []
            for index, view in enumerate(views):
                if view is None:  # not this rank's to save: its slots are read from expert-parallel rank 0
                    chained[index] = [[] for _ in chained[index]]
                    view = ({"state": {}, "param_groups": []}, {})
                inners.append(view[0])
                masters.append([view[1][slot.position] for group in chained[index] for slot in group])
                check_masters_round(state, chained[index], masters[-1], chunk_keys, path, "distrib_optim.pt param",
                                    self._stored)
            return _RankOptimizer(path, extra, chained, inners, masters)
        inners, masters = [], []
        members = chain(self.config, self.layout, rules)
        for index, (entry, slots) in enumerate(zip(entries, chained)):
            inner = entry if form == FORM_FP32 else entry["optimizer"]
            where = str(path) if len(entries) == 1 else f"{path} optimizer[{index}]"
            check_param_groups(slots, inner.get("param_groups"), where, rules, members[index])
            check_state_shapes(slots, inner.get("state"), where, members[index].state_fields)
            masters.append(_masters(form, entry, state, slots, chunk_keys, path, self._stored))
            inners.append(inner)
        extra["grad_scalers"] = held_scalers(entries)  # per chained optimizer
        return _RankOptimizer(path, extra, chained, inners, masters)

    def _index(self) -> dict[str, list[tuple[_RankOptimizer, OptimizerSlot]]]:
        """Per canonical name, its pieces in TP order, from the first stage/chunk that holds it (a tied
        output layer's copy on the last stage is the same parameter, kept equal by megatron-core); the copies
        other expert-parallel ranks of that stage and chunk hold (a plain optimizer's dense state) in
        ``_replicas``, read by ``parameter`` to check them."""
        owners: dict[str, tuple[tuple[int, int, int], list[tuple[_RankOptimizer, OptimizerSlot]]]] = {}
        held_by: dict[tuple[str, int, int, int], list[tuple[_RankOptimizer, OptimizerSlot]]] = {}
        for coord, rank in self.ranks.items():
            for slot in (slot for groups in rank.slots for group in groups for slot in group):
                where = (coord.pp, slot.chunk, coord.ep)
                held_by.setdefault((slot.spec.canonical, *where), []).append((rank, slot))
                held = owners.get(slot.spec.canonical)
                if held is None or where < held[0]:
                    owners[slot.spec.canonical] = (where, [])
                    held = owners[slot.spec.canonical]
                if held[0] == where:
                    held[1].append((rank, slot))
        self._replicas = {name: [_tp_order(pieces) for (other, pp, chunk, ep), pieces in held_by.items()
                                 if other == name and (pp, chunk) == first[:2] and ep != first[2]]
                          for name, (first, _) in owners.items()}
        return {name: _tp_order(pieces) for name, (_, pieces) in owners.items()}

    def _replica_pieces(self, name: str, key: str) -> list[tuple[str, list[torch.Tensor]]]:
        return [(str(pieces[0][0].path), [self._stored.read(piece) for piece in self._read(pieces, key)])
                for pieces in self._replicas.get(name, [])]

    def stored_copies(self) -> list[StoredCopy]:
        """Per rank file what every rank saves alike (param groups, grad scalers, a plain optimizer's steps, the
        carried counters), and per ``distrib_optim.pt`` its buffers' dtype keys."""
        copies = []
        for rank in self.ranks.values():
            values: dict[str, Any] = {key: rank.extra.get(key, ABSENT) for key in (*CARRIED_KEYS, "iteration")}
            count = len(rank.inners)
            for index in range(count):
                label = optimizer_label(index, count)
                values[f"{label}.param_groups"] = self._stored_groups(rank, index)
                values[f"{label}.grad_scaler"] = rank.extra["grad_scalers"][index]
            if self.form != FORM_DISTRIBUTED:
                values["optimizer.state[*].step"] = [entry.get("step", ABSENT) if isinstance(entry, dict) else entry
                                                     for member, inner in zip(self.chained(), rank.inners)
                                                     if member.stepped for entry in inner["state"].values()]
            copies.append(StoredCopy(str(rank.path), values))
            keys = [key for inner in rank.inners for key in inner.get("dtype_keys", [])]
            if keys:
                copies.append(StoredCopy(str(rank.path.parent / DISTRIB_OPTIM_FILE), {"dtype_key": keys}))
        return copies

    def _stored_groups(self, rank: _RankOptimizer, index: int) -> Any:
        """Chained optimizer ``index``'s param groups as the rank file stores them (the distributed optimizer's
        with their ``step``)."""
        if self.form != FORM_DISTRIBUTED:
            return rank.inners[index]["param_groups"]
        return rank.extra["distributed_entries"][index]["optimizer"].get("param_groups", ABSENT)

    def stored_parts(self, name: str, key: str) -> list[tuple[str, torch.Tensor]]:
        parts = super().stored_parts(name, key)
        if self.form != FORM_DISTRIBUTED:
            return parts
        return [(str(Path(where).parent / DISTRIB_OPTIM_FILE), part) for where, part in parts]

    def _pieces(self, name: str, key: str) -> list[torch.Tensor]:
        return [self._stored.read(piece) for piece in self._read(self._owners[name], key)]

    def _stored_pieces(self, name: str, key: str) -> list[torch.Tensor]:
        """Each rank's piece as its file holds it: in memory, or left in the file (a meta tensor)."""
        return self._read(self._owners[name], key)

    @staticmethod
    def _read(pieces: list[tuple[_RankOptimizer, OptimizerSlot]], key: str) -> list[torch.Tensor]:
        """``key`` of each piece as stored: in memory, or left in its file (a meta tensor)."""
        if key == "param":
            return [rank.masters[slot.optimizer][slot.position] for rank, slot in pieces]
        return [rank.inners[slot.optimizer]["state"][slot.position][key] for rank, slot in pieces]

    def _stored_group_settings(self, optimizer: int) -> list[dict[str, Any]] | None:
        """The first rank's groups of chained optimizer ``optimizer`` without ``params`` (None: a distributed
        optimizer's it does not save)."""
        inner = self.first.inners[optimizer]
        if not inner.get("param_groups") and self.form == FORM_DISTRIBUTED:
            return None
        return [{k: v for k, v in group.items() if k != "params"} for group in inner["param_groups"]]
