"""The Megatron shards made from an HF model compute that model's logits, rank by rank.

The reference forward pass (hf_helpers.megatron_tp_logits) reads the rank files with torch.load
and never goes back through pgconvert's merge, so a wrong QKV grouping, q-head order, gate/up
order or vocab split fails here even if loader and saver agreed with each other.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from support.hf_helpers import (
    FAMILY_MODELS,
    build_hf_model,
    hf_logits,
    input_ids,
    megatron_tp_logits,
    read_megatron_tp_ranks,
    save_hf_model,
)

import pgconvert


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("family", sorted(FAMILY_MODELS))
def test_megatron_tp_shards_compute_the_hf_models_logits(tmp_path: Path, family: str, tp: int) -> None:
    model = build_hf_model(family, seed=5)
    src = save_hf_model(model, tmp_path / "hf")
    hf_config = json.loads((src / "config.json").read_text())
    ids = input_ids(hf_config["vocab_size"])

    pgconvert.convert(src, tmp_path / "megatron", dst_format="megatron", dst_tp=tp, dst_pp=1)
    ranks = read_megatron_tp_ranks(tmp_path / "megatron")
    actual = megatron_tp_logits(ranks, hf_config, ids)

    assert len(ranks) == tp
    expected = hf_logits(model, ids).to(torch.float64)
    assert actual.shape == expected.shape
    torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-4)


def test_reference_forward_pass_detects_swapped_gate_and_up(tmp_path: Path) -> None:
    """The check is sensitive: exchanging one rank's gate and up halves changes the logits."""
    model = build_hf_model("llama", seed=5)
    src = save_hf_model(model, tmp_path / "hf")
    hf_config = json.loads((src / "config.json").read_text())
    ids = input_ids(hf_config["vocab_size"])
    pgconvert.convert(src, tmp_path / "megatron", dst_format="megatron", dst_tp=2, dst_pp=1)
    ranks = read_megatron_tp_ranks(tmp_path / "megatron")
    key = "decoder.layers.1.mlp.linear_fc1.weight"
    gate, up = ranks[1][key].chunk(2)

    ranks[1][key] = torch.cat([up, gate])
    actual = megatron_tp_logits(ranks, hf_config, ids)

    expected = hf_logits(model, ids).to(torch.float64)
    assert not torch.allclose(actual, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("impl,qk_layernorm,architecture", [
    ("local", False, "LlamaForCausalLM"),
    ("transformer_engine", False, "LlamaForCausalLM"),
    ("transformer_engine", True, "Qwen3ForCausalLM"),
], ids=["local-llama", "te-llama", "te-qwen3"])
def test_native_megatron_checkpoint_becomes_an_hf_model_with_the_same_logits(
        tmp_path: Path, impl: str, qk_layernorm: bool, architecture: str) -> None:
    from support.megatron_fixtures import TinyModel, make_full_model, write_megatron_checkpoint

    tiny = TinyModel(
        num_layers=4, hidden_size=64, num_attention_heads=16, num_query_groups=8, kv_channels=4,
        ffn_hidden_size=128, vocab_size=1000, swiglu=True, normalization="RMSNorm", add_bias_linear=False,
        add_qkv_bias=False, qk_layernorm=qk_layernorm, tied_embeddings=False, position_embedding_type="rope",
        transformer_impl=impl,
    )
    generator = torch.Generator().manual_seed(11)
    full = {  # small values, norms near one: a forward pass that stays in fp32's comfortable range
        name: (1.0 + 0.1 * torch.randn(t.shape, generator=generator)) if "layernorm" in name
        else 0.05 * torch.randn(t.shape, generator=generator)
        for name, t in make_full_model(tiny).items()
    }
    root = write_megatron_checkpoint(tmp_path / "megatron", tiny, full, tp=2, pp=1)
    reference_config = {
        "architectures": [architecture], "hidden_size": 64, "num_attention_heads": 16, "num_key_value_heads": 8,
        "head_dim": 4, "rms_norm_eps": 1e-5, "rope_parameters": {"rope_theta": 10000.0}, "vocab_size": 1000,
        "num_hidden_layers": 4,
    }
    ids = input_ids(1000)

    report = pgconvert.convert(root, tmp_path / "hf", dst_format="hf", dst_tp=1, dst_pp=1)

    written = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert written["architectures"] == [architecture]
    # the fixture's TE _extra_state entries hold nothing, so nothing is dropped and nothing is said
    # (tests/test_megatron_lm_goldens.py and test_extra_state_layouts.py cover states that hold some)
    assert not any("_extra_state" in notice for notice in report.notices)
    expected = megatron_tp_logits(read_megatron_tp_ranks(root), reference_config, ids)
    actual = hf_logits(tmp_path / "hf", ids).to(torch.float64)
    torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-4)
