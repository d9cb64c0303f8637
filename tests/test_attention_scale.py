"""One attention softmax scale (pgconvert.semantics.attention_scale): Granite's attention_multiplier, Gemma's
query_pre_attn_scalar and megatron-core's softmax_scale are one ModelConfig field, so a Megatron
checkpoint that spells the scale megatron-core's way converts to the same Gemma config.json and
verify sees one scale."""

from __future__ import annotations

import argparse
import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from support.hf_helpers import hf_logits, input_ids
from support.postnorm_helpers import VOCAB, save_postnorm_model

import pgconvert
from pgconvert.semantics.attention_scale import from_scalar, to_scalar
from pgconvert.model.config import ModelConfig
from pgconvert.errors import CheckpointError
from pgconvert.semantics import from_args


def _bridge_style_args(root: Path) -> None:
    """Every rank's args spelling the scale as Megatron-Bridge's Gemma 3 provider does (gemma3_bridge.py:
    ``softmax_scale`` only, no query_pre_attn_scalar); its ``1.0 / math.sqrt(q)`` may be 1 ulp from
    transformers' ``q**-0.5``, which verify would rightly name, so transformers' value is written here."""
    for path in sorted(root.glob("iter_*/mp_rank_*/model_optim_rng.pt")):
        with torch.serialization.safe_globals([argparse.Namespace]):
            state = torch.load(path, map_location="cpu", weights_only=True)
        del state["args"].query_pre_attn_scalar
        state["args"].softmax_scale = 24 ** -0.5
        torch.save(state, path)
    shutil.rmtree(root / "hf")
    (root / "pgconvert.json").unlink()


def test_gemma_megatron_checkpoint_with_only_softmax_scale_converts_to_the_same_config(tmp_path: Path) -> None:
    src = save_postnorm_model("gemma3", tmp_path / "src", seed=3)  # query_pre_attn_scalar=24, head_dim 16
    pgconvert.convert(src, tmp_path / "m", dst_format="megatron", dst_tp=2)
    _bridge_style_args(tmp_path / "m")

    report = pgconvert.verify(src, tmp_path / "m")
    pgconvert.convert(tmp_path / "m", tmp_path / "hf", dst_format="hf", dst_tp=1, strict=True)

    assert [d.name for d in report.differences if d.name.startswith("model_config.")] == []
    written = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert written["query_pre_attn_scalar"] == 24 and type(written["query_pre_attn_scalar"]) is int
    ids = input_ids(VOCAB)
    torch.testing.assert_close(hf_logits(tmp_path / "hf", ids), hf_logits(src, ids), rtol=1e-5, atol=1e-5)


def test_megatron_args_spelling_the_scale_twice_must_agree() -> None:
    agreeing = argparse.Namespace(num_layers=2, softmax_scale=24.0 ** -0.5, query_pre_attn_scalar=24)
    bridge_only = argparse.Namespace(num_layers=2, query_pre_attn_scalar=24)

    assert from_args(agreeing, Path("common.pt"))["softmax_scale"] == 24.0 ** -0.5
    assert from_args(bridge_only, Path("common.pt"))["softmax_scale"] == 24.0 ** -0.5
    with pytest.raises(CheckpointError, match=r"common.pt: args.softmax_scale=0.5 and args.query_pre_attn_scalar=24"):
        from_args(argparse.Namespace(num_layers=2, softmax_scale=0.5, query_pre_attn_scalar=24), Path("common.pt"))


def test_every_integer_scalar_comes_back_and_the_default_scale_is_none() -> None:
    scalars = [*range(1, 4097), 65_536, 1_000_003]
    back = [to_scalar(from_scalar(n)) for n in scalars]
    bridge = [to_scalar(1.0 / math.sqrt(n)) for n in scalars]  # Megatron-Bridge's spelling of the scale
    config = ModelConfig(num_layers=1, hidden_size=64, num_attention_heads=4, ffn_hidden_size=8,
                         softmax_scale=1 / math.sqrt(16))

    assert back == scalars and bridge == scalars and all(type(n) is int for n in back)
    assert to_scalar(0.3) == 0.3 ** -2  # no integer scalar gives 0.3: the exact float
    assert config.softmax_scale is None
