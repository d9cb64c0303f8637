"""Megatron optimizer state through a reshard: the position -> parameter map, the per-parameter form
and the per-rank plain optimizer at a new layout, on goldens written by Megatron-LM itself."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from loaders.megatron import MegatronSource
from pgconvert.formats import LoadOptions
from pgconvert.megatron_format import safe_torch_load
from pgconvert.optimizer_map import (OptimizerLayoutError, OptimizerRules, UnsupportedOptimizerError,
                                     check_param_groups, check_state_shapes, optimizer_slots)

GOLDENS = Path(__file__).parent / "data" / "megatron_lm"
PLAIN = GOLDENS / "train_tp2pp2_torch"
PLAIN_ITER = PLAIN / "iter_0000002"


def _source(iteration_dir: Path = PLAIN_ITER) -> MegatronSource:
    return MegatronSource(iteration_dir, 2, False, LoadOptions())


def test_positions_map_to_parameters_of_the_same_shape_on_every_rank() -> None:
    source = _source()
    assert len(source.files) == 4
    for coord, path in source.files.items():
        state = safe_torch_load(path)
        slots = optimizer_slots(source.config, source.layout, coord, OptimizerRules.from_args(state["args"], str(path)),
                                source.vocab_rows)
        check_param_groups(slots, state["optimizer"]["param_groups"], str(path))
        check_state_shapes(slots, state["optimizer"]["state"], str(path))
        names = [slot.spec.local_name for group in slots for slot in group]
        # megatron-core's order: linear_proj is registered before linear_qkv; norms in group 1.
        assert names.index("decoder.layers.0.self_attention.linear_proj.weight") < \
            names.index("decoder.layers.0.self_attention.linear_qkv.weight")
        assert all(len(slot.spec.local_shape) == 1 for slot in slots[1])


def test_a_missing_parameter_or_a_wrong_shape_is_refused_naming_the_field() -> None:
    source = _source()
    coord, path = next(iter(source.files.items()))
    state = safe_torch_load(path)
    slots = optimizer_slots(source.config, source.layout, coord, padded_vocab_size=source.vocab_rows)
    groups = [dict(group) for group in state["optimizer"]["param_groups"]]
    groups[1]["params"] = groups[1]["params"][:-1]
    with pytest.raises(OptimizerLayoutError, match=r"param_groups\[1\]\.params"):
        check_param_groups(slots, groups, str(path))
    tampered = dict(state["optimizer"]["state"])
    tampered[1] = dict(tampered[1], exp_avg=torch.zeros(3))
    with pytest.raises(OptimizerLayoutError, match=r"state\[1\]\.exp_avg has shape \(3,\)"):
        check_state_shapes(slots, tampered, str(path))


def test_the_transformer_engine_spec_and_decoupled_lr_are_refused_naming_the_field() -> None:
    source = _source()
    config = dataclasses.replace(source.config, transformer_impl="transformer_engine")
    with pytest.raises(UnsupportedOptimizerError, match="transformer_impl='transformer_engine'.*megatron-core 0.16.1"):
        optimizer_slots(config, source.layout, next(iter(source.files)))
    args = safe_torch_load(next(iter(source.files.values())))["args"]
    args.decoupled_lr = 1e-4
    with pytest.raises(UnsupportedOptimizerError, match="args.decoupled_lr"):
        OptimizerRules.from_args(args, "x")
