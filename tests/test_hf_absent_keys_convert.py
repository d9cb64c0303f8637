"""A config.json that leaves out a key converts as the model transformers builds from it.

A tiny model saved by transformers has one key deleted from its config.json, where transformers'
config class fills in a default that is not what hidden_size / heads (or no window, or RoPE base 1e4)
would give. HF -> Megatron -> HF by pgconvert, the way back built from the Megatron checkpoint alone
(its carried config.json removed, so the model pgconvert read is what comes back): transformers
computes the source's logits from the result, whose config.json states the value.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from support.hf_helpers import build_hf_model, edit_json, hf_logits, save_hf_model
from support.hf_helpers import input_ids as hf_input_ids
from support.llama_like_helpers import build_model, input_ids, save_model

import pgconvert


def _through_megatron(src: Path, tmp_path: Path) -> dict[str, Any]:
    """``src`` converted to a TP2 Megatron checkpoint and back to HF from the rank files alone."""
    pgconvert.convert(src, tmp_path / "megatron", dst_format="megatron", dst_tp=2)
    shutil.rmtree(tmp_path / "megatron" / "hf")
    pgconvert.convert(tmp_path / "megatron", tmp_path / "hf", dst_format="hf", dst_tp=1, dst_pp=1)
    written: dict[str, Any] = json.loads((tmp_path / "hf" / "config.json").read_text())
    return written


def test_qwen3_without_head_dim_converts_with_qwen3s_head_dim_128(tmp_path: Path) -> None:
    # 8 heads of 128 over hidden 64: Qwen3Config's head_dim, not hidden_size / heads = 8.
    src = save_hf_model(build_hf_model("qwen3", head_dim=128), tmp_path / "src")
    edit_json(src / "config.json", lambda doc: doc.pop("head_dim"))

    written = _through_megatron(src, tmp_path)

    assert (written["architectures"], written["head_dim"]) == (["Qwen3ForCausalLM"], 128)
    ids = hf_input_ids(1000)
    torch.testing.assert_close(hf_logits(tmp_path / "hf", ids), hf_logits(src, ids), rtol=1e-5, atol=1e-5)


def test_smollm3_without_rope_theta_converts_with_smollm3s_base_2e6(tmp_path: Path) -> None:
    src = save_model(build_model("smollm3", seed=3, rope_theta=2_000_000.0), tmp_path / "src")
    edit_json(src / "config.json", lambda doc: doc["rope_parameters"].pop("rope_theta"))

    written = _through_megatron(src, tmp_path)

    assert written["architectures"] == ["SmolLM3ForCausalLM"]
    assert written["rope_parameters"]["rope_theta"] == 2_000_000.0
    ids = input_ids()
    torch.testing.assert_close(hf_logits(tmp_path / "hf", ids), hf_logits(src, ids), rtol=1e-5, atol=1e-5)


def test_mistral_without_sliding_window_converts_with_mistrals_window_4096(tmp_path: Path) -> None:
    src = save_hf_model(build_hf_model("mistral"), tmp_path / "src")
    edit_json(src / "config.json", lambda doc: doc.pop("sliding_window"))

    written = _through_megatron(src, tmp_path)

    # Without the window the model is a Llama, which is what comes back when the window is lost.
    assert (written["architectures"], written.get("sliding_window")) == (["MistralForCausalLM"], 4096)
    ids = hf_input_ids(1030)
    torch.testing.assert_close(hf_logits(tmp_path / "hf", ids), hf_logits(src, ids), rtol=1e-5, atol=1e-5)
