"""ERNIE 4.5 (dense): HF -> Megatron TP2/PP2 -> torch_dist -> HF is bit-exact with the same logits; its interleaved
rotary is carried (rows kept in HF's order, megatron-core's rotary_interleaved) and use_bias is megatron-core's
add_bias_linear with add_qkv_bias. megatron-core's own forward of the TP1 file is in test_megatron_core_families.py.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from support.hf_helpers import assert_same_hf_tensors, hf_logits
from support.llama_like_helpers import build_model, input_ids, megatron_args, save_model
from support.round_trips import assert_round_trip

import pgconvert

@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ernie")
    return {"plain": save_model(build_model("ernie4_5", seed=3), root / "plain"),
            "bias": save_model(build_model("ernie4_5", seed=4, use_bias=True), root / "bias")}


@pytest.mark.parametrize("source", ["plain", "bias"])
def test_hf_to_megatron_to_torch_dist_to_hf_is_bit_exact(sources: dict[str, Path], tmp_path: Path,
                                                         source: str) -> None:
    assert_round_trip(sources[source], tmp_path, input_ids(), dst_tp=2, dst_pp=2)


def test_megatron_args_hold_the_interleaved_rotary_biases_and_release_defaults(sources: dict[str, Path],
                                                                              tmp_path: Path) -> None:
    pgconvert.convert(sources["bias"], tmp_path / "megatron", dst_format="megatron", dst_tp=2)
    args = megatron_args(tmp_path / "megatron")
    assert (args.rotary_interleaved, args.add_bias_linear, args.add_qkv_bias) == (True, True, True)
    assert (args.rotary_base, args.kv_channels, args.num_query_groups) == (500000, 8, 2)
    assert args.untie_embeddings_and_output_weights is False


def test_native_megatron_model_without_the_carried_config_is_written_as_llama_rotate_half(
        sources: dict[str, Path], tmp_path: Path) -> None:
    """Without hf/ a Megatron model with interleaved rotary infers Llama (first in the order), whose HF
    rotary is rotate-half: q/k rows are reordered, and the logits are the same."""
    src = sources["plain"]
    pgconvert.convert(src, tmp_path / "megatron", dst_format="megatron", dst_tp=2)
    shutil.rmtree(tmp_path / "megatron" / "hf")
    pgconvert.convert(tmp_path / "megatron", tmp_path / "hf", dst_format="hf", dst_tp=1)
    written = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert written["architectures"] == ["LlamaForCausalLM"]
    ids = input_ids()
    torch.testing.assert_close(hf_logits(tmp_path / "hf", ids), hf_logits(src, ids), rtol=1e-5, atol=1e-5)
    config = tmp_path / "ernie_config.json"
    config.write_text((src / "config.json").read_text())
    pgconvert.convert(tmp_path / "megatron", tmp_path / "as_ernie", dst_format="hf", dst_tp=1, hf_config=config)
    assert_same_hf_tensors(src, tmp_path / "as_ernie")


def test_biases_megatron_sets_apart_do_not_fit_ernie(sources: dict[str, Path]) -> None:
    """q/k/v biases alone (Qwen2's add_qkv_bias) are not ERNIE's use_bias, which biases every linear layer or none:
    such a model does not fit the family, named."""
    from pgconvert.families import FAMILIES
    from pgconvert.formats.hf import family_mismatches, model_config_from_hf

    path = sources["bias"] / "config.json"
    family, config, _ = model_config_from_hf(json.loads(path.read_text()), path)
    assert family_mismatches(family, config) == []
    qkv_only = config.replace(add_bias_linear=False)
    assert family_mismatches(FAMILIES["Ernie4_5ForCausalLM"], qkv_only) == [
        "add_qkv_bias=True, add_bias_linear=False (ERNIE's use_bias biases every linear layer or none)"]
