"""Megatron-FSDP's optimizer state inside an ``fsdp_dtensor`` checkpoint, by canonical parameter (read).

Megatron-LM saves ``optimizer.sharded_state_dict(...)`` with ``distrib_optim_sharding_type='fsdp_dtensor'``:
megatron-core's ``DistributedOptimizer.sharded_param_state_fsdp_dtensor`` (megatron/core/optimizer/
distrib_optimizer.py at d98e8a64) hands over torch Adam's state keyed by parameter name
(``_param_name``: the wrapped model chunk's ``named_parameters()``) and, per parameter, its group's
hyperparameters (``_param_groups_to_param2group_meta``). ``preprocess_fsdp_dtensor_state_dict`` splits a gated
``linear_fc1``'s moments into ``_w``/``_v`` as the weight (``handle_swiglu_in_state_dict``), then DCP flattens it::

    optimizer.state.<wrappers><parameter name>.{exp_avg,exp_avg_sq}   fp32 DTensors, the model key's global shape
    optimizer.state.<wrappers><parameter name>.step                   0-dim fp32 tensor (torch Adam's own step)
    optimizer.param_to_group_meta.<wrappers><parameter name>.<field>  bytes: lr, betas, wd_mult, ... (unsplit name)

``<wrappers>`` is ``module.module.module.`` for a bf16/fp16 run (Float16Module inside Megatron-FSDP's wrappers),
read from the store. The fp32 masters are the ``model.`` entries themselves (Megatron-FSDP's main weights). No
grad scaler is saved (refused for fp16 runs, whose dynamic scaler would be lost). The param groups megatron-core
builds (``pgconvert.optimizer.order``) are rebuilt from the per-parameter hyperparameters: every member of a group
must hold the same ones, and the groups' overrides must be megatron-core's. The state is presented as the
distributed optimizer of a run in the dtype of the stored weights (fp32), as the weights are;
``--dtype bfloat16`` retypes it (``pgconvert.optimizer.retype``).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from pgconvert.io.dcp_plan import TensorStorageMetadata
from pgconvert.formats.fsdp_dtensor import (FSDP_DTENSOR_FORM, OPTIMIZER_GROUP_PREFIX, OPTIMIZER_STATE_PREFIX,
                                            STEP_FIELD, FsdpLocation, fsdp_slots, state_key)
from pgconvert.formats.megatron import run_dtype_args
from pgconvert.io.limits import quote
from pgconvert.model.provider import WORD_EMBEDDINGS
from pgconvert.model.rules import ShardRule
from pgconvert.optimizer.flat import buffer_dtype_key
from pgconvert.optimizer.order import (MEGATRON_CORE_VERSIONS, OptimizerLayoutError, OptimizerRules, OptimizerSlot,
                                       UnsupportedOptimizerError, check_param_groups, check_supported)
from pgconvert.optimizer.source import (ABSENT, FIELDS, FORM_DISTRIBUTED, MOMENTS, OptimizerSource, SourceRank,
                                        StoredCopy)

if TYPE_CHECKING:
    from pgconvert.loaders.fsdp_dtensor.reader import FsdpDtensorSource

_VERSIONS = "megatron-core " + " / ".join(MEGATRON_CORE_VERSIONS)


@dataclass(frozen=True)
class _Owner:
    """Where a parameter's state lies (the store), for messages."""

    path: Path


class FsdpDtensorOptimizerSource(OptimizerSource):
    """The optimizer state of a ``FsdpDtensorSource`` (``open_optimizer``), by canonical name."""

    def __init__(self, source: FsdpDtensorSource) -> None:
        super().__init__()
        self.source = source
        self.config, self.layout, self.vocab_rows = source.config, source.layout, source.vocab_rows
        where = f"{source.directory} (optimizer.*)"
        args = source.megatron_args
        if getattr(args, "fp16", False):
            raise UnsupportedOptimizerError(
                f"{where}: an fp16 run's Megatron-FSDP checkpoint holds no grad scaler (its loss scale and trackers "
                "are not saved): its optimizer state is not carried; pass --skip-optimizer")
        check_supported(self.config, where)
        self.form, self.sharding = FORM_DISTRIBUTED, FSDP_DTENSOR_FORM
        self.rules = OptimizerRules.from_args(args, where)
        self.wrappers = self._wrappers()
        slots = fsdp_slots(self.config, self.layout, self.rules, self.vocab_rows)
        self._owners = {slot.spec.canonical: [(_Owner(source.directory), slot)] for group in slots for slot in group}
        self._check_records()
        self._steps = {name: self._step_of(name) for name in self.names()}
        steps = {float(step) for step in self._steps.values()}
        if len(steps) != 1:
            raise OptimizerLayoutError(f"{where}: the parameters' Adam steps differ ({sorted(steps)}); {_VERSIONS} "
                                       "steps every parameter together")
        step = steps.pop()
        self._settings = self._group_settings(slots, where)
        groups = [dict(settings, params=[slot.position for slot in members], step=step)
                  for settings, members in zip(self._settings, slots)]
        check_param_groups(slots, groups, where, self.rules)
        self._groups = groups
        # the stored weights are Megatron-FSDP's fp32 main weights: the state of a run in their dtype
        run_args = argparse.Namespace(**{**vars(args), **run_dtype_args(torch.float32, args)})
        extra = dict(source.common_entries())
        extra["args"] = run_args
        extra["distributed_entries"] = [{"optimizer": {"param_groups": groups}}]
        self.first = SourceRank(source.directory, extra)
        self.dtype_key = buffer_dtype_key(run_args)
        self.grad_scalers = [None]

    def _wrappers(self) -> str:
        """The wrapper modules' prefix of the parameter names (``module.module.module.`` in a bf16 run), from the
        word embedding's record."""
        suffix = f"{WORD_EMBEDDINGS}.{MOMENTS[0]}"
        found = [key[len(OPTIMIZER_STATE_PREFIX):-len(suffix)] for key in self.source.entry_names()
                 if key.startswith(OPTIMIZER_STATE_PREFIX) and key.endswith(suffix)]
        if len(found) != 1 or any(part != "module" for part in found[0].split(".")[:-1]):
            raise OptimizerLayoutError(f"{self.source.directory}: no single optimizer record "
                                       f"{OPTIMIZER_STATE_PREFIX}<module.>*{suffix} (found {quote(found)}); pass "
                                       "--skip-optimizer to convert the model alone")
        return found[0]

    def state_keys(self, name: str, field: str) -> tuple[str, ...]:
        """The stored keys of ``name``'s ``field`` (``param``: the model entries; a gated fc1: its two halves)."""
        model = self.source.location(name)
        if field == "param":
            return model.keys
        return tuple(state_key(self.wrappers, key, field) for key in model.keys)

    def _check_records(self) -> None:
        """Every record the model needs is there with the model key's global shape (a 0-dim step), and no other."""
        entries = self.source.entry_metadata()
        expected: dict[str, tuple[int, ...]] = {}
        for name in self.names():
            for model_key, key in zip(self.state_keys(name, "param"), self.state_keys(name, MOMENTS[0])):
                shape = tuple(entries[model_key].size)
                base = key[:-len(MOMENTS[0])]
                expected.update({base + field: shape for field in MOMENTS})
                expected[base + STEP_FIELD] = ()
        for key, shape in expected.items():
            held = entries.get(key)
            if not isinstance(held, TensorStorageMetadata):
                raise OptimizerLayoutError(
                    f"{self.source.directory}: no optimizer record {quote(key)} ({FSDP_DTENSOR_FORM} form, "
                    f"{_VERSIONS}); pass --skip-optimizer to convert the model alone")
            if tuple(held.size) != shape:
                raise OptimizerLayoutError(
                    f"{self.source.directory}: {quote(key)} has global shape {list(held.size)}; its parameter's "
                    f"model entry gives {list(shape)}")
            if held.properties.dtype != torch.float32:
                raise OptimizerLayoutError(f"{self.source.directory}: {quote(key)} is {held.properties.dtype}, "
                                           "not the fp32 of Adam's state in Megatron-FSDP")
        extra = sorted(key for key in entries if key.startswith(OPTIMIZER_STATE_PREFIX) and key not in expected)
        if extra:
            raise OptimizerLayoutError(f"{self.source.directory}: optimizer records {quote(extra[:4], 200)} are not "
                                       "of a parameter of the model its args describe")

    def _step_of(self, name: str) -> torch.Tensor:
        keys = [key[:-len(MOMENTS[0])] + STEP_FIELD for key in self.state_keys(name, MOMENTS[0])]
        steps = [self.source.read_whole(key, ()) for key in keys]
        for key, step in zip(keys, steps):
            value = float(step)
            if not (value >= 0 and value == int(value)):
                raise OptimizerLayoutError(f"{self.source.directory}: {key} = {value}: not a step count")
        if any(not torch.equal(steps[0], other) for other in steps[1:]):
            raise OptimizerLayoutError(f"{self.source.directory}: {', '.join(keys)} differ")
        return steps[0]

    def _group_settings(self, slots: list[list[OptimizerSlot]], where: str) -> list[dict[str, Any]]:
        """Per param group, the hyperparameters all its members hold (``param_to_group_meta``)."""
        prefix = OPTIMIZER_GROUP_PREFIX + self.wrappers
        metas = self.source.group_metas(prefix)
        settings = []
        for index, members in enumerate(slots):
            held: dict[str, Any] | None = None
            first = ""
            for slot in members:
                name = slot.spec.local_name
                meta = metas.get(name)
                if meta is None:
                    raise OptimizerLayoutError(f"{where}: no {prefix}{name}.* entries (the param "
                                               f"group of {slot.spec.canonical})")
                if held is None:
                    held, first = meta, name
                elif meta != held:
                    raise OptimizerLayoutError(
                        f"{where}: {prefix}{name} = {quote(meta, 200)} differs from {first}'s "
                        f"{quote(held, 200)}, though {_VERSIONS} puts both in param group {index}")
            settings.append(held or {})
        unknown = sorted(set(metas) - {slot.spec.local_name for group in slots for slot in group})
        if unknown:
            raise OptimizerLayoutError(f"{where}: param_to_group_meta of {quote(unknown[:4], 200)}: not parameters "
                                       "of the model its args describe")
        return settings

    def stored_copies(self) -> list[StoredCopy]:
        values: dict[str, Any] = {key: self.first.extra.get(key, ABSENT) for key in
                                  ("opt_param_scheduler", "num_floating_point_operations_so_far", "iteration")}
        values["optimizer.param_groups"] = self._groups
        values["optimizer.grad_scaler"] = None
        values["dtype_key"] = [self.dtype_key]
        return [StoredCopy(f"{self.source.directory} (optimizer.*, opt_param_scheduler.*)", values)]

    def step(self, name: str) -> torch.Tensor:
        return self._steps[name].clone()

    def _read(self, name: str, field: str, rule: ShardRule, size: int, rank: int, rows: int | None) -> torch.Tensor:
        return self.source.read_state_piece(name, FsdpLocation(self.state_keys(name, field)), rule, size, rank, rows)

    def stored_parts(self, name: str, key: str) -> list[tuple[str, torch.Tensor]]:
        return [(f"{self.source.directory}: {', '.join(self.state_keys(name, key))}",
                 self._read(name, key, self.rule(name), 1, 0, None))]

    def _parameter(self, name: str) -> dict[str, torch.Tensor]:
        merged = {key: self._read(name, key, self.rule(name), 1, 0, None) for key in FIELDS}
        merged[STEP_FIELD] = self.step(name)
        return merged

    def _piece(self, name: str, key: str, size: int, rank: int, rows: int | None,
               rule: ShardRule | None = None) -> torch.Tensor:
        rule = rule or self.rule(name)
        return self._read(name, key, rule, size, rank, rows if rule.fits_rows else None)

    def _stored_group_settings(self, optimizer: int) -> list[dict[str, Any]] | None:
        """Megatron-FSDP keeps the routed experts in the dense groups: the expert optimizer's are the dense ones'."""
        return [dict(group) for group in self._settings] if optimizer == 0 else None
