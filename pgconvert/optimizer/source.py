"""What every format's optimizer reader gives and every writer takes: ``OptimizerSource``, megatron-core's
optimizer state of one checkpoint by canonical parameter, and the names of its forms and fields.

A loader's source opens it (``CanonicalSource.open_optimizer``); the destination's saver writes it in its own
files (``Saver.save_optimizer``); ``export-optimizer`` and ``verify`` read it per parameter. Nothing here
knows where a format keeps the state.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager as ContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pgconvert.formats.stream import apply_finite_policy, nonfinite_text
from pgconvert.io import sizes
from pgconvert.io.limits import quote
from pgconvert.io.reuse import ReusedMemory
from pgconvert.io.torch_input import StoredTensors, stored_region
from pgconvert.model.config import ModelConfig
from pgconvert.model.layout import ParallelLayout
from pgconvert.model.rules import ReplicaMismatchError, ShardRule, bitwise_equal, concatenating_with, shares_memory
from pgconvert.optimizer.order import (ADAM_FIELDS, MEGATRON_CORE_VERSIONS, ChainMember, OptimizerLayoutError,
                                       OptimizerRules, OptimizerSlot, chain, group_experts, group_overrides)

MOMENTS = ("exp_avg", "exp_avg_sq")
# The per-parameter fields of an Adam optimizer: the fp32 master weight and Adam's moments (a Muon run's Muon
# parameters: ``order.MUON_FIELDS``, ``OptimizerSource.fields``).
FIELDS = ADAM_FIELDS
# Each field as messages name it.
FIELD_NAMES = {"param": "fp32 param", "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq",
               "momentum_buffer": "momentum_buffer"}
# The forms of megatron-core's optimizer state: FP32Optimizer (fp32 training; the master is the model weight),
# Float16OptimizerWithFloat16Params (bf16/fp16 training, fp32 masters beside), DistributedOptimizer.
FORM_FP32 = "fp32"
FORM_FP16 = "float16"
FORM_DISTRIBUTED = "distributed"
# LayerWiseDistributedOptimizer of a Muon run chained with a DistributedOptimizer: Muon's state in model space with
# its fp32 masters (Float16OptimizerWithFloat16Params over whole parameters), Adam's as the distributed optimizer's.
FORM_LAYER_WISE = "layer-wise"
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


class _Absent:
    """A value a stored copy does not hold (a rank file without a scheduler entry, a rank without a grad scaler)."""

    def __repr__(self) -> str:
        return "absent"


ABSENT = _Absent()


@dataclass(frozen=True)
class StoredCopy:
    """One stored copy of what every rank saves alike (a rank file, a ``distrib_optim.pt``, a model-parallel rank's
    records, a torch_dist common state): ``where`` it lies and its ``values`` by name, checked by
    ``pgconvert.optimizer.checks``: ``optimizer[.i].param_groups`` (per chained optimizer, their ``params`` aside),
    ``optimizer[.i].grad_scaler``, ``optimizer.state[*].step`` (a plain optimizer's per-parameter steps),
    ``dtype_key`` (the distributed optimizer's buffer keys), the carried counters (``CARRIED_KEYS``, ``iteration``);
    ``ABSENT`` where a copy lacks one."""

    where: str
    values: dict[str, Any]


ROUNDED_AT_ONCE = 1 << 22  # elements of a master that ``rounds_to`` rounds at a time, into one buffer


def rounds_to(master: torch.Tensor, model: torch.Tensor) -> bool:
    """Whether an fp32 master rounds to its model weight (megatron-core copies it there after every step), NaN to
    NaN: a non-finite master is for the NaN/Inf policy to report, not a sign of another parameter order. Rounded a
    slice at a time into one buffer, not into a new tensor of the weight's size."""
    if master.shape != model.shape or not model.is_floating_point():
        return torch.equal(master.to(model.dtype), model)
    masters, weights = master.reshape(-1), model.reshape(-1)
    rounded = torch.empty(min(masters.numel(), ROUNDED_AT_ONCE), dtype=model.dtype)
    for start in range(0, masters.numel(), ROUNDED_AT_ONCE):
        part = rounded[:min(ROUNDED_AT_ONCE, masters.numel() - start)].copy_(masters[start:start + ROUNDED_AT_ONCE])
        weight = weights[start:start + ROUNDED_AT_ONCE]
        if not torch.equal(part, weight) and not bool(((part == weight) | (part.isnan() & weight.isnan())).all()):
            return False
    return True


class MasterMemory:
    """Memory for the master check (``rounds_to`` over every parameter, one at a time), reused from one parameter to
    the next (``io.reuse``: a new tensor's pages cost the kernel about a quarter of a CPU-second per GiB to fault in
    and zero): read a weight inside ``weight(shape, dtype)`` and its fp32 master inside ``master(shape)``, and let both
    go before the next parameter's."""

    def __init__(self) -> None:
        self._weights, self._masters = ReusedMemory(), ReusedMemory()

    def weight(self, shape: Sequence[int], dtype: torch.dtype) -> ContextManager[None]:
        return self._weights.lending(sizes.nbytes(tuple(shape), dtype))

    def master(self, shape: Sequence[int]) -> ContextManager[None]:
        return self._masters.lending(sizes.nbytes(tuple(shape), torch.float32))


def optimizer_label(index: int, count: int) -> str:
    """How messages name chained optimizer ``index`` of ``count``: ``optimizer[1]``, or ``optimizer`` alone."""
    return f"optimizer[{index}]" if count > 1 else "optimizer"


class OptimizerSource:
    """megatron-core's optimizer state of one checkpoint, by canonical parameter.

    Declared by every reader: ``config``, ``layout`` and ``vocab_rows`` (the model's), ``form`` (one of the
    ``FORM_*``), ``sharding`` (the name the format gives its stored form, None where it gives none),
    ``rules`` (what decides the param groups), ``dtype_key`` (the distributed optimizer's buffer key,
    ``(param dtype, grad dtype)``), ``grad_scalers`` (per chained optimizer its grad scaler, None: none) and
    ``first`` (``SourceRank``).

    A reader indexes ``_owners`` (per canonical name, its TP pieces in TP order: ``(owner, slot)``, the owner
    having a ``path``) and implements ``_pieces``, ``param_group_settings`` and ``stored_copies``; ``step``,
    ``parameter`` and ``piece`` then merge or cut those pieces with the parameter's own rule. A reader that can
    leave its pieces in their files also implements ``_stored_pieces`` (and sets ``_stored``), so that each is read
    straight into its place in the piece cut. A reader whose state is stored whole overrides ``_parameter``,
    ``_piece`` and ``stored_parts``.

    Every value ``parameter`` and ``piece`` give is checked for NaN/Inf on the way, under the weights' policy
    (``check_finite``: ``pgconvert.formats.stream.apply_finite_policy``); what is reported is in ``notices``.
    ``pgconvert.optimizer.checks.open_checked`` sets the policy and checks the rest once, when the state is opened.
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
    # Reads the pieces ``_stored_pieces`` leaves in their files (None for a reader that has none).
    _stored: StoredTensors | None = None

    def __init__(self) -> None:
        self.check_finite = "warn"
        self.notices: list[str] = []
        self._nonfinite_seen: set[tuple[str, str]] = set()

    def names(self) -> list[str]:
        """The canonical names of the parameters the state holds, in the model's order."""
        return list(self._owners)

    def group_of(self, name: str) -> int:
        """The param group ``name`` is in (0: weight decay; then with decoupled_lr the embedding and output, then no
        weight decay)."""
        return self._owners[name][0][1].group

    def group_role(self, name: str) -> dict[str, float]:
        """What sets ``name``'s param group apart in its optimizer (``order.group_overrides``: weight decay or not,
        decoupled learning rates), whatever its position: positions follow the layout (an expert optimizer's groups,
        the layer-wise optimizer's expert group at expert parallel > 1)."""
        slot = self._owners[name][0][1]
        return group_overrides(self.rules, slot.member)[slot.group]

    def optimizer_of(self, name: str) -> int:
        """The chained optimizer that holds ``name``: its index in ``chained``."""
        return self._owners[name][0][1].optimizer

    def chained(self) -> tuple[ChainMember, ...]:
        """The optimizers megatron-core chains for the source's model and layout (``order.chain``)."""
        return chain(self.config, self.layout, self.rules)

    def fields(self, name: str) -> tuple[str, ...]:
        """The per-parameter fields of ``name``'s state: the fp32 master and Adam's moments, or a Muon parameter's
        momentum buffer (``ChainMember.fields``)."""
        return self._owners[name][0][1].member.fields

    def stepped(self, name: str) -> bool:
        """Whether ``name``'s optimizer counts steps (``ChainMember.stepped``)."""
        return self._owners[name][0][1].member.stepped

    def rule(self, name: str) -> ShardRule:
        """The ShardRule the source's pieces of ``name`` were cut with."""
        return self._owners[name][0][1].spec.rule

    def _pieces(self, name: str, key: str) -> list[torch.Tensor]:
        """The source's TP pieces of ``name``'s ``key`` (param, a moment or step), in TP order."""
        raise NotImplementedError

    def param_group_settings(self, optimizer: int = 0, count: int | None = None,
                             member: ChainMember | None = None) -> list[dict[str, Any]]:
        """The param groups (without ``params``: hyperparameters, lr, wd_mult…) of the source's chained optimizer
        ``optimizer``, ``count`` of them; or, for a target's chained optimizer ``member``, the source's own of it where
        the source chains one and stores as many groups, else each wanted group from the source's group with the same
        overrides (megatron-core builds them from one config; they differ only there) with ``is_expert_parallel`` set:
        an expert optimizer's from the dense one of its kind, the layer-wise optimizer's expert group from its dense
        one."""
        own = self.chained()
        member = own[optimizer] if member is None else member
        stored = self._stored_group_settings(own.index(member)) if member in own else None
        if stored is not None and (count is None or count <= len(stored)):
            return stored if count is None else stored[:count]
        origin = member if stored else ChainMember(member.kind, False)
        settings = (stored or self._stored_group_settings(own.index(origin))) or []
        held = group_overrides(self.rules, origin)
        wanted = list(zip(group_overrides(self.rules, member), group_experts(self.rules, member)))[:count]
        if len(settings) > len(held) or any(overrides not in held[:len(settings)] for overrides, _ in wanted):
            raise OptimizerLayoutError(f"{self.first.path}: the {member.kind} optimizer's param groups "
                                       f"{quote(settings, 160)} do not give a target's groups {wanted} ({_VERSIONS})")
        return [dict(settings[held.index(overrides)], is_expert_parallel=expert) for overrides, expert in wanted]

    def _stored_group_settings(self, optimizer: int) -> list[dict[str, Any]] | None:
        """The stored param groups of the source's chained optimizer ``optimizer`` without ``params`` (None: not
        stored on the ranks read)."""
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

    def shared_step(self) -> torch.Tensor | None:
        """The step count every stepping parameter shares (megatron-core's ``ChainedOptimizer`` keeps them equal; a
        torch_dist entry stores it once), from the first that counts steps; None where no chained optimizer does
        (Muon with Lion)."""
        stepping = next((name for name in self.names() if self.stepped(name)), None)
        return None if stepping is None else self.step(stepping)

    def group_step(self) -> float:
        """The step a distributed optimizer's param groups record (``shared_step``); refused where no chained
        optimizer counts steps."""
        step = self.shared_step()
        if step is None:
            raise OptimizerLayoutError(f"{self.first.path}: no chained optimizer counts steps, and a distributed "
                                       "optimizer's param groups record one")
        return float(step)

    def stored_copies(self) -> list[StoredCopy]:
        """Every stored copy of what all ranks save alike (``StoredCopy``), for ``pgconvert.optimizer.checks``."""
        raise NotImplementedError

    def stored_parts(self, name: str, key: str) -> list[tuple[str, torch.Tensor]]:
        """The stored tensors ``name``'s ``key`` is read from, each with where it lies (for messages)."""
        return [(str(owner.path), piece) for (owner, _), piece in zip(self._owners[name], self._pieces(name, key))]

    def _finite(self, name: str, key: str, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` (read for ``name``'s ``key``) under the NaN/Inf policy: reported once per parameter and field,
        naming the stored parts that hold them, or refused under --check-finite."""
        if self.check_finite == "off" or (name, key) in self._nonfinite_seen:
            return tensor
        found = nonfinite_text(tensor)
        if found is None:
            return tensor
        held = [f"{text} in {where}" for where, part in self.stored_parts(name, key)
                if (text := nonfinite_text(part)) is not None]
        apply_finite_policy(self.check_finite, f"optimizer state of {name}, {FIELD_NAMES[key]}: "
                            + ("; ".join(held) or f"{found} in {self.first.path}"), self.notices)
        self._nonfinite_seen.add((name, key))
        return tensor

    def parameter(self, name: str) -> dict[str, torch.Tensor]:
        """The whole (source-padded) fp32 master, both moments (or Muon's momentum buffer) and the step (Adam's) of
        ``name``, their values checked, and
        every other stored copy of them (``_replica_pieces``) equal to them, bit for bit."""
        merged = self._parameter(name)
        for key in self.fields(name):
            self._finite(name, key, merged[key])
            for where, pieces in self._replica_pieces(name, key):
                try:
                    copy = self.rule(name).merge(pieces)
                except ReplicaMismatchError as error:
                    raise self._replicas_differ(name, key, error) from error
                if not bitwise_equal(copy, merged[key]):
                    raise OptimizerLayoutError(
                        f"{name}: optimizer {FIELD_NAMES[key]} differs between {self._owners[name][0][0].path} and "
                        f"{where}, which {_VERSIONS} keeps equal (the same parameter's state on every rank that holds "
                        "it)")
        return merged

    def _replica_pieces(self, name: str, key: str) -> list[tuple[str, list[torch.Tensor]]]:
        """The other stored copies of ``name``'s ``key`` (a plain optimizer's dense state, which every
        expert-parallel rank saves): per copy, where it lies and its TP pieces. None by default."""
        return []

    def piece(self, name: str, key: str, size: int, rank: int, rows: int | None,
              rule: ShardRule | None = None) -> torch.Tensor:
        """Piece ``rank`` of ``size`` of ``name``'s ``key`` (param or a moment) cut with ``rule`` (the target's;
        default the source's), fitted to ``rows`` padded vocab rows for vocab tables (new rows zero); its values
        checked."""
        return self._finite(name, key, self._piece(name, key, size, rank, rows, rule))

    def _parameter(self, name: str) -> dict[str, torch.Tensor]:
        rule = self.rule(name)
        merged = {key: self._joined(name, key, rule, rule.merge, own=True) for key in self.fields(name)}
        if self.stepped(name):
            merged["step"] = self.step(name)
        return merged

    def _piece(self, name: str, key: str, size: int, rank: int, rows: int | None,
               rule: ShardRule | None = None) -> torch.Tensor:
        """``piece`` as read. The source's pieces are merged with the rule of the spec that wrote them where the
        target's differs (MLA down projections: split by rows in the local spec, whole in the Transformer Engine
        spec)."""
        stored = self.rule(name)
        target = rule or stored

        def cut(pieces: list[torch.Tensor]) -> torch.Tensor:
            if target != stored:
                pieces = [stored.merge(pieces)]
            if target.fits_rows and rows is not None:
                return target.reshard_rows(pieces, rows, self.config.vocab_size, size, rank)
            return target.reshard(pieces, size, rank)

        def adds_rows(pieces: list[torch.Tensor]) -> bool:
            return _adds_rows(target, pieces, rows, self.config.vocab_size, size, rank)

        return self._joined(name, key, target, cut, adds_rows=adds_rows)

    def _stored_pieces(self, name: str, key: str) -> list[torch.Tensor] | None:
        """The TP pieces of ``name``'s ``key`` as stored: in memory, or left in their files (meta tensors that
        ``io.torch_input.stored_region`` places), read by ``self._stored``; the joins then read each straight into
        its place in the result (``_joined``). None (the default): the reader reads its pieces whole (``_pieces``)."""
        return None

    def _joined(self, name: str, key: str, target: ShardRule, join: Callable[[list[torch.Tensor]], torch.Tensor],
                own: bool = False, adds_rows: Callable[[list[torch.Tensor]], bool] | None = None) -> torch.Tensor:
        """``join(pieces)`` of ``name``'s ``key`` (``target``: the rule it cuts with). Pieces left in their files
        (``_stored_pieces``) are read straight into their place in the result by its concatenations
        (``StoredTensors.concat``), or whole first where the rules do more than concatenate (replicas compared bit
        for bit, new vocab rows of zeros: ``adds_rows``); the result is then a tensor of its own, as with ``own``."""
        stored = self._stored_pieces(name, key)
        try:
            if stored is None:
                pieces = self._pieces(name, key)
                joined = join(pieces)
                return _own(joined, pieces) if own else joined
            assert self._stored is not None  # a reader that leaves pieces in their files reads them with it
            if not (self.rule(name).replicated or target.replicated or (adds_rows is not None and adds_rows(stored))):
                with concatenating_with(self._stored.concat):
                    joined = join(stored)
                if joined.device.type != "meta":
                    return _own(joined, stored)
                if stored_region(joined) is not None:  # one stored piece passed through
                    return self._stored.read(joined)
            pieces = [self._stored.read(piece) for piece in stored]
            return _own(join(pieces), pieces)
        except ReplicaMismatchError as error:
            raise self._replicas_differ(name, key, error) from error


def _adds_rows(rule: ShardRule, pieces: list[torch.Tensor], rows: int | None, true_rows: int | None, size: int,
               rank: int) -> bool:
    """Whether ``rule`` fits piece ``rank`` of ``size`` of a vocab table stored as ``pieces`` to ``rows`` padded rows
    with new rows of zeros (beyond the stored table)."""
    if not rule.fits_rows or rows is None:
        return False
    have = sum(piece.shape[0] for piece in pieces)
    return any(window.zeros for window in rule.piece_windows((have, *pieces[0].shape[1:]), size, rank, rows, true_rows))


def _own(tensor: torch.Tensor, pieces: list[torch.Tensor]) -> torch.Tensor:
    """``tensor``, or a copy where it shares memory with one of ``pieces`` (a piece or replica passed through)."""
    return tensor.clone() if shares_memory(tensor, pieces) else tensor
