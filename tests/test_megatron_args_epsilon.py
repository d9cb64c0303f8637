"""The norm epsilon of a Megatron run is read from ``args.norm_epsilon`` when the args have no
``layernorm_epsilon`` (Megatron-LM renamed the flag), and reaches every target format."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from support.tiny_models import GQA_SWIGLU
from support.megatron_fixtures import load_for_test, make_full_model, write_megatron_checkpoint

import pgconvert

EPSILON = 3e-6  # neither pgconvert's nor Megatron-LM's default


@pytest.fixture
def src(tmp_path: Path) -> Path:
    root = write_megatron_checkpoint(tmp_path / "src", GQA_SWIGLU, make_full_model(GQA_SWIGLU), 2, 1)
    for path in root.glob("iter_*/mp_rank_*/model_optim_rng.pt"):
        state = load_for_test(path)
        args = state["args"]
        assert not hasattr(args, "layernorm_epsilon")
        args.norm_epsilon = EPSILON
        torch.save(state, path)
    return root


def test_norm_epsilon_is_read_from_args_without_layernorm_epsilon(src: Path) -> None:
    info = pgconvert.inspect(src)

    assert info.ok, info.problems
    assert info.model_config is not None
    assert info.model_config["norm_epsilon"] == EPSILON


def test_norm_epsilon_from_args_reaches_hf_config_and_megatron_args(src: Path, tmp_path: Path) -> None:
    pgconvert.convert(src, tmp_path / "hf", dst_format="hf")
    pgconvert.convert(src, tmp_path / "tp1", dst_tp=1)

    hf_config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert hf_config["rms_norm_eps"] == EPSILON
    args = load_for_test(tmp_path / "tp1" / "iter_0000100" / "mp_rank_00" / "model_optim_rng.pt")["args"]
    assert args.norm_epsilon == EPSILON
