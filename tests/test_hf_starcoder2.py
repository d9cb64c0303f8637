"""StarCoder2: HF -> Megatron TP2/PP2 -> torch_dist -> HF is bit-exact with the same logits, config and side files;
LayerNorm with biases, the non-gated tanh GELU, use_bias and the window reach the Megatron args, with a notice that
Megatron-LM's argument parser builds F.gelu; dropouts megatron-core cannot hold apart are refused by name.
megatron-core's own forward of the TP1 file (activation_func set to the tanh GELU) is in test_megatron_core_families.py.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from support.hf_helpers import assert_same_hf_tensors
from support.llama_like_helpers import build_model, input_ids, megatron_args, save_model
from support.round_trips import assert_config_refused, assert_round_trip

import pgconvert

@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_model(build_model("starcoder2", seed=3), tmp_path_factory.mktemp("starcoder2") / "src")


def test_hf_to_megatron_to_torch_dist_to_hf_is_bit_exact(source: Path, tmp_path: Path) -> None:
    report = assert_round_trip(source, tmp_path, input_ids(), dst_tp=2, dst_pp=2)
    assert any("args.openai_gelu=True (the tanh GELU)" in notice for notice in report.notices), report.notices


def test_megatron_args_hold_layernorm_biases_tanh_gelu_window_and_dropout(source: Path, tmp_path: Path) -> None:
    pgconvert.convert(source, tmp_path / "megatron", dst_format="megatron", dst_tp=2)
    args = megatron_args(tmp_path / "megatron")
    assert (args.normalization, args.add_bias_linear, args.swiglu, args.openai_gelu) == ("LayerNorm", True, False, True)
    assert (args.window_size, args.hidden_dropout, args.attention_dropout) == ((4, 0), 0.1, 0.1)
    assert (args.num_query_groups, args.untie_embeddings_and_output_weights) == (2, False)


def test_native_megatron_model_without_the_carried_config_is_written_as_starcoder2(source: Path,
                                                                                  tmp_path: Path) -> None:
    pgconvert.convert(source, tmp_path / "megatron", dst_format="megatron", dst_tp=2)
    shutil.rmtree(tmp_path / "megatron" / "hf")
    pgconvert.convert(tmp_path / "megatron", tmp_path / "hf", dst_format="hf", dst_tp=1)
    written = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert written["architectures"] == ["Starcoder2ForCausalLM"]
    assert (written["hidden_act"], written["use_bias"], written["sliding_window"]) == ("gelu_pytorch_tanh", True, 5)
    assert_same_hf_tensors(source, tmp_path / "hf")


@pytest.mark.parametrize("change, expected", [
    ({"embedding_dropout": 0.0}, "residual_dropout=0.1, embedding_dropout=0.0: megatron-core's hidden_dropout"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu': Starcoder2ForCausalLM is converted only with "
                             "hidden_act='gelu_pytorch_tanh'"),
], ids=["dropouts-apart", "exact-gelu"])
def test_settings_megatron_cannot_hold_are_refused_by_name(source: Path, tmp_path: Path, change: dict[str, object],
                                                           expected: str) -> None:
    assert_config_refused(source, tmp_path, change, expected)
