"""dots.llm1 (``Dots1ForCausalLM``): HF -> Megatron TP2/PP2/EP2 -> torch_dist -> HF is bit-exact with the same logits
and config; the DeepSeek-V3 router's settings reach the Megatron args; a release config megatron-core cannot compute
(no renormalization, Dots1Config's default) is refused by name. megatron-core's own forward of the TP1 file is in
test_megatron_core_families.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from support.glm4_moe_gpt_oss_helpers import save_dots1
from support.hf_helpers import hf_logits, input_ids
from support.llama_like_helpers import megatron_args
from support.round_trips import assert_config_refused, assert_round_trip

import pgconvert


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("dots1")
    return {"release": save_dots1(root / "release", seed=3),
            "window-groups": save_dots1(root / "window_groups", seed=4, sliding_window=5, max_window_layers=2,
                                        n_group=4, topk_group=2, num_experts_per_tok=4)}


@pytest.mark.parametrize("source", ["release", "window-groups"])
def test_hf_to_megatron_to_torch_dist_to_hf_is_bit_exact(sources: dict[str, Path], tmp_path: Path,
                                                         source: str) -> None:
    assert_round_trip(sources[source], tmp_path, input_ids(1030), dst_tp=2, dst_pp=2, dst_ep=2, strict=True)


def test_megatron_args_hold_the_router_shared_experts_window_and_qk_norm(sources: dict[str, Path],
                                                                        tmp_path: Path) -> None:
    pgconvert.convert(sources["window-groups"], tmp_path / "megatron", dst_format="megatron", dst_tp=2, dst_ep=2)
    args = megatron_args(tmp_path / "megatron")
    assert (args.moe_router_score_function, args.moe_router_enable_expert_bias, args.moe_router_topk) == (
        "sigmoid", True, 4)
    assert (args.moe_router_num_groups, args.moe_router_group_topk, args.moe_router_topk_scaling_factor) == (4, 2, 2.5)
    assert (args.moe_shared_expert_intermediate_size, args.moe_layer_freq) == (32, [0, 1, 1, 1])
    assert (args.qk_layernorm, args.window_size, args.window_attn_skip_freq) == (True, (4, 0), [0, 0, 1, 1])


@pytest.mark.parametrize("change, expected", [
    ({"norm_topk_prob": False}, "norm_topk_prob=False: megatron-core's sigmoid router renormalizes"),
    ({"norm_topk_prob": None}, "norm_topk_prob absent \\(the config class's default false\\)"),
    ({"n_shared_experts": None}, "n_shared_experts is absent or null"),
    ({"attention_bias": True}, "attention_bias=True: Dots1ForCausalLM is converted only with attention_bias=False"),
], ids=["no-renormalization", "renormalization-absent", "shared-experts-absent", "attention-bias"])
def test_settings_megatron_cannot_compute_are_refused_by_name(sources: dict[str, Path], tmp_path: Path,
                                                              change: dict[str, object], expected: str) -> None:
    assert_config_refused(sources["release"], tmp_path, change, expected)


def test_native_megatron_model_without_a_window_is_written_as_glm4_moe_with_the_same_logits(
        sources: dict[str, Path], tmp_path: Path) -> None:
    """Without the carried hf/ folder the family is inferred from the args: GLM-4.5-MoE fits first and computes the
    same (its partial rotary written as the whole head)."""
    import shutil

    src = sources["release"]
    pgconvert.convert(src, tmp_path / "megatron", dst_format="megatron", dst_tp=2, dst_ep=2)
    shutil.rmtree(tmp_path / "megatron" / "hf")
    pgconvert.convert(tmp_path / "megatron", tmp_path / "hf", dst_format="hf", dst_tp=1, dst_ep=1)
    written = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert written["architectures"] == ["Glm4MoeForCausalLM"]
    assert written["rope_parameters"]["partial_rotary_factor"] == 1.0 and written["use_qk_norm"] is True
    ids = input_ids(1030)
    torch.testing.assert_close(hf_logits(tmp_path / "hf", ids), hf_logits(src, ids), rtol=1e-5, atol=1e-5)
