"""ERNIE 4.5 MoE (Ernie4_5_MoeForCausalLM): HF -> Megatron TP2/PP2/EP2 -> torch_dist -> HF is bit-exact with the same
logits; the Megatron rank files and their args compute transformers' logits.

The source is baidu/ERNIE-4.5-21B-A3B-PT's config.json shrunk (tests/support/llama_like_helpers.py): a dense first
layer, MoE layers by moe_layer_start_index / end_index / interval, two shared experts, interleaved rotary, and a
softmax router whose choice e_score_correction_bias steers. megatron-core 0.16.1 refuses an expert bias with a
softmax router, so the rank files are computed by the independent reference forward
(llama_like_helpers.reference_logits, driven by the written args), and every Megatron output names the router.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from support.hf_helpers import assert_same_hf_tensors, edit_json, hf_logits, load_hf_tensors, read_megatron_tp_ranks
from support.llama_like_helpers import build_model, input_ids, megatron_args, reference_logits, save_model
from support.round_trips import assert_config_refused, assert_round_trip

import pgconvert
from pgconvert.errors import StrictModeError

ROUTER_NOTICE = "moe_router_enable_expert_bias=True with moe_router_score_function='softmax'"


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_model(build_model("ernie4_5_moe", seed=3), tmp_path_factory.mktemp("ernie_moe") / "src")


@pytest.fixture(scope="module")
def tp2_ep2(source: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    dst = tmp_path_factory.mktemp("ernie_moe_megatron") / "megatron"
    pgconvert.convert(source, dst, dst_format="megatron", dst_tp=2, dst_ep=2)
    return dst


def test_hf_to_megatron_tp2_pp2_ep2_to_torch_dist_to_hf_is_bit_exact(source: Path, tmp_path: Path) -> None:
    report = assert_round_trip(source, tmp_path, input_ids(), dst_tp=2, dst_pp=2, dst_ep=2)

    assert any(ROUTER_NOTICE in notice for notice in report.notices)
    bias = load_hf_tensors(source)["model.layers.1.mlp.moe_statics.e_score_correction_bias"]
    assert bias.shape == (1, 8) and bias.dtype == torch.float32 and bool(bias.abs().min() > 0)


def test_megatron_args_hold_the_layers_router_shared_experts_and_rotary(tp2_ep2: Path) -> None:
    args = megatron_args(tp2_ep2)

    assert (list(args.moe_layer_freq), args.num_experts, args.moe_router_topk) == ([0, 1, 1, 1], 8, 6)
    assert (args.moe_router_score_function, args.moe_router_enable_expert_bias) == ("softmax", True)
    assert (args.moe_router_pre_softmax, args.moe_shared_expert_intermediate_size) == (False, 32)
    assert args.moe_shared_expert_gate is False and args.rotary_interleaved is True
    assert (args.rotary_base, args.kv_channels, args.untie_embeddings_and_output_weights) == (500000, 8, False)


def test_megatron_rank_files_and_args_compute_transformers_logits(source: Path, tp2_ep2: Path) -> None:
    actual = reference_logits(read_megatron_tp_ranks(tp2_ep2), megatron_args(tp2_ep2), input_ids())

    torch.testing.assert_close(actual, hf_logits(source, input_ids()).to(torch.float64), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("change", ["expert_bias", "rotary_interleaved", "shared_experts", "moe_layers"])
def test_reference_forward_sees_each_ernie_setting(source: Path, tp2_ep2: Path, change: str) -> None:
    """Knock one setting out of the rank files or args and the logits differ: the match above sees each."""
    ranks, args = read_megatron_tp_ranks(tp2_ep2), megatron_args(tp2_ep2)
    if change == "expert_bias":
        for model in ranks:
            for key in [key for key in model if key.endswith("router.expert_bias")]:
                model[key] = torch.zeros_like(model[key])
    elif change == "rotary_interleaved":
        args.rotary_interleaved = False
    elif change == "shared_experts":
        args.moe_shared_expert_intermediate_size = None
    else:  # layer 3 computed as dense from its shared experts' weights: the pattern matters
        for model in ranks:
            for key in [key for key in model if key.startswith("decoder.layers.3.mlp.")]:
                value = model.pop(key)
                if ".shared_experts." in key:
                    model[key.replace(".shared_experts.", ".")] = value

    actual = reference_logits(ranks, args, input_ids())

    assert not torch.allclose(actual, hf_logits(source, input_ids()).to(torch.float64), rtol=1e-4, atol=1e-4)


def test_megatron_core_refuses_an_expert_bias_with_a_softmax_router() -> None:
    """Why the check above is a reference forward: megatron-core 0.16.1's TransformerConfig will not build it."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    with pytest.raises(ValueError, match="only supports sigmoid"):
        TransformerConfig(num_layers=2, hidden_size=16, num_attention_heads=2, num_moe_experts=4, moe_router_topk=2,
                          moe_router_enable_expert_bias=True, moe_router_score_function="softmax")


def test_strict_refuses_a_megatron_target_naming_the_router(source: Path, tmp_path: Path) -> None:
    with pytest.raises(StrictModeError, match=ROUTER_NOTICE):
        pgconvert.convert(source, tmp_path / "out", dst_format="megatron", strict=True)
    assert not (tmp_path / "out").exists()


def test_megatron_ernie_moe_without_a_carried_config_is_written_as_ernie_moe(source: Path, tmp_path: Path) -> None:
    """From the args alone, only ERNIE 4.5 MoE fits a softmax router with an expert bias; its layer keys are
    written from moe_layer_freq and transformers computes the same logits."""
    pgconvert.convert(source, tmp_path / "megatron", dst_format="megatron", dst_tp=2, dst_ep=2)
    shutil.rmtree(tmp_path / "megatron" / "hf")

    pgconvert.convert(tmp_path / "megatron", tmp_path / "hf", dst_format="hf")

    written = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert written["architectures"] == ["Ernie4_5_MoeForCausalLM"]
    assert {key: written[key] for key in ("moe_layer_start_index", "moe_layer_end_index", "moe_layer_interval",
                                          "moe_num_shared_experts", "moe_num_experts", "moe_k", "use_bias")} == {
        "moe_layer_start_index": 1, "moe_layer_end_index": 3, "moe_layer_interval": 1,
        "moe_num_shared_experts": 2, "moe_num_experts": 8, "moe_k": 6, "use_bias": False}
    assert_same_hf_tensors(source, tmp_path / "hf")
    ids = input_ids()
    torch.testing.assert_close(hf_logits(tmp_path / "hf", ids), hf_logits(source, ids), rtol=1e-5, atol=1e-5)


def test_moe_layer_interval_and_end_index_are_read_as_transformers_places_the_moe_layers(tmp_path: Path) -> None:
    """interval 2 with the end index -1: MoE on layers 1 and 3 (1-based even layers), as transformers builds them."""
    from pgconvert.formats.hf import model_config_from_hf

    src = save_model(build_model("ernie4_5_moe", seed=3, moe_layer_interval=2, moe_layer_end_index=-1),
                     tmp_path / "src")
    edit_json(src / "config.json", lambda doc: doc.update(moe_layer_end_index=-1))
    path = src / "config.json"
    family, config, _ = model_config_from_hf(json.loads(path.read_text()), path)

    stored = sorted({name.split(".")[2] for name in load_hf_tensors(src) if ".mlp.experts." in name})
    assert stored == ["1", "3"]
    assert [int(config.layers[layer].moe) for layer in range(4)] == [0, 1, 0, 1]
    assert family.rules[0].write(config) == {"moe_layer_start_index": 1, "moe_layer_end_index": 3,
                                             "moe_layer_interval": 2}


@pytest.mark.parametrize("change,expected", [
    ({"use_bias": True}, r"use_bias=True: ERNIE 4.5 MoE biases .* but not the routed experts"),
    ({"moe_norm_min": 0.9}, r"moe_norm_min=0.9: .* clamps nothing"),
    ({"moe_layer_start_index": 4}, r"no layer of 4 is MoE"),
    ({"moe_layer_interval": 0}, r"moe_layer_interval=0: expected an integer >= 1"),
])
def test_settings_megatron_core_cannot_compute_are_refused_naming_the_key(source: Path, tmp_path: Path,
                                                                          change: dict[str, object],
                                                                          expected: str) -> None:
    assert_config_refused(source, tmp_path, change, expected)
