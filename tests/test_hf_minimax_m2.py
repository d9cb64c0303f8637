"""MiniMax-M2 (MiniMaxM2ForCausalLM): HF <-> Megatron / torch_dist is bit-exact, and the model survives.

The source is a tiny transformers model in the release's configuration (tests/support/minimax_m2_helpers.py):
q/k norms over the whole projection, RoPE on half of each head (``rotary_dim``), every layer MoE with
a sigmoid router and a non-zero e_score_correction_bias, no shared expert, and the keys
MiniMaxM2Config ignores set as the release sets them.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from support.glm4_moe_gpt_oss_helpers import assert_same_release
from support.hf_helpers import assert_same_hf_tensors, edit_json, hf_logits, input_ids, load_hf_tensors
from support.hf_helpers import read_megatron_tp_ranks
from support.megatron_fixtures import load_for_test
from support.minimax_m2_helpers import LAYERS, MINIMAX_M2_KWARGS, minimax_m2_tp_logits, save_minimax_m2

import pgconvert
from pgconvert.errors import CheckpointError

VOCAB = MINIMAX_M2_KWARGS["vocab_size"]


def _args(root: Path) -> Any:
    """The Megatron args of the first rank file at ``root``."""
    return load_for_test(sorted(root.glob("iter_*/mp_rank_*/model_optim_rng.pt"))[0])["args"]


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_minimax_m2(tmp_path_factory.mktemp("minimax_m2") / "src", seed=3)


@pytest.fixture(scope="module")
def megatron(source: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The source as Megatron rank files at TP2/PP2/EP2."""
    root = tmp_path_factory.mktemp("minimax_m2_megatron") / "megatron"
    pgconvert.convert(source, root, dst_format="megatron", dst_tp=2, dst_pp=2, dst_ep=2, strict=True)
    return root


@pytest.fixture(scope="module")
def megatron_tp2_ep2(source: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The source as Megatron rank files at TP2/EP2 (PP1: the reference forward reads one stage)."""
    root = tmp_path_factory.mktemp("minimax_m2_tp2ep2") / "megatron"
    pgconvert.convert(source, root, dst_format="megatron", dst_tp=2, dst_ep=2)
    return root


def test_minimax_m2_to_megatron_tp2_pp2_ep2_and_back_is_bit_exact_with_the_same_logits(
        source: Path, megatron: Path, tmp_path: Path) -> None:
    back = pgconvert.convert(megatron, tmp_path / "hf", dst_format="hf", strict=True)

    assert not [notice for notice in back.notices if "not carried" in notice]
    assert len(list(megatron.glob("iter_0000000/mp_rank_*/model_optim_rng.pt"))) == 8
    assert_same_release(source, tmp_path / "hf", VOCAB)


def test_minimax_m2_to_torch_dist_and_back_is_bit_exact(source: Path, tmp_path: Path) -> None:
    pgconvert.convert(source, tmp_path / "dist", dst_format="torch_dist", dst_tp=2, dst_ep=2)
    pgconvert.convert(tmp_path / "dist", tmp_path / "hf", dst_format="hf")

    assert_same_release(source, tmp_path / "hf", VOCAB)


def test_megatron_args_hold_minimax_m2s_settings(megatron: Path) -> None:
    """Sigmoid routing with the expert bias, no scaling and no shared expert; q/k norms over the
    whole projection (heads × head_dim, replicated); RoPE on half of each head, base 5e6."""
    args = _args(megatron)

    assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
            args.expert_model_parallel_size) == (2, 2, 2)
    assert (args.moe_router_score_function, args.moe_router_enable_expert_bias, args.moe_router_topk,
            args.moe_router_topk_scaling_factor, args.moe_shared_expert_intermediate_size) == (
        "sigmoid", True, 4, None, None)
    assert (args.num_experts, args.moe_ffn_hidden_size, args.moe_layer_freq) == (8, 48, 1)
    assert (args.qk_layernorm, args.qk_layernorm_across_heads, args.rotary_percent, args.rotary_base) == (
        True, True, 0.5, 5e6)
    assert (args.kv_channels, args.num_query_groups, args.norm_epsilon) == (16, 2, 1e-6)
    assert not args.add_bias_linear and not args.add_qkv_bias and args.untie_embeddings_and_output_weights


def test_megatron_tp2_ep2_rank_files_compute_the_hf_logits(source: Path, megatron_tp2_ep2: Path) -> None:
    """Independent forward over the TP-sharded rank files (not pgconvert's merge) against transformers:
    megatron-core's own forward (tests/test_megatron_core_families.py) needs a stand-in for the q/k
    norms over the whole projection and runs at TP1 only."""
    config = json.loads((source / "config.json").read_text())
    ids = input_ids(VOCAB)
    ranks = read_megatron_tp_ranks(megatron_tp2_ep2)

    actual = minimax_m2_tp_logits(ranks, config, ids)

    torch.testing.assert_close(actual, hf_logits(source, ids).to(torch.float64), rtol=1e-5, atol=1e-5)
    heads_x_dim = MINIMAX_M2_KWARGS["num_attention_heads"] * MINIMAX_M2_KWARGS["head_dim"]
    assert all(rank["decoder.layers.0.self_attention.q_layernorm.weight"].shape == (heads_x_dim,) for rank in ranks)
    bias = load_hf_tensors(source)["model.layers.1.block_sparse_moe.e_score_correction_bias"]
    assert bias.dtype == torch.float32 and bool(bias.abs().min() > 0)


@pytest.mark.parametrize("change", ["expert_bias", "rotary_dim"])
def test_reference_forward_depends_on_each_minimax_setting(source: Path, megatron_tp2_ep2: Path, change: str) -> None:
    """The check above is sensitive: drop the expert bias or rotate whole heads and the logits differ."""
    config = json.loads((source / "config.json").read_text())
    ranks = read_megatron_tp_ranks(megatron_tp2_ep2)
    rotary_dim = None
    if change == "expert_bias":
        for model in ranks:
            for key in [k for k in model if k.endswith("expert_bias")]:
                model[key] = torch.zeros_like(model[key])
    else:
        rotary_dim = MINIMAX_M2_KWARGS["head_dim"]
    ids = input_ids(VOCAB)

    actual = minimax_m2_tp_logits(ranks, config, ids, rotary_dim)

    assert not torch.allclose(actual, hf_logits(source, ids).to(torch.float64), rtol=1e-4, atol=1e-4)


def test_megatron_minimax_m2_without_a_carried_config_is_written_as_minimax_m2(
        source: Path, megatron: Path, tmp_path: Path) -> None:
    """From Megatron args alone (no hf/ folder) the family is inferred and config.json built from the
    table, with the release's keys: transformers then computes the same logits."""
    native = Path(shutil.copytree(megatron, tmp_path / "megatron"))
    shutil.rmtree(native / "hf")

    report = pgconvert.convert(native, tmp_path / "hf", dst_format="hf", strict=True)

    written = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert written["architectures"] == ["MiniMaxM2ForCausalLM"]
    assert {key: written[key] for key in ("rotary_dim", "num_local_experts", "num_experts_per_tok", "use_qk_norm",
                                          "qk_norm_type", "scoring_func", "use_routing_bias",
                                          "shared_intermediate_size", "attn_type_list")} == {
        "rotary_dim": 8, "num_local_experts": 8, "num_experts_per_tok": 4, "use_qk_norm": True,
        "qk_norm_type": "per_layer", "scoring_func": "sigmoid", "use_routing_bias": True,
        "shared_intermediate_size": 0, "attn_type_list": [1] * LAYERS}
    assert written["rope_parameters"]["partial_rotary_factor"] == 0.5
    assert not [notice for notice in report.notices if "not carried" in notice]
    assert_same_hf_tensors(source, tmp_path / "hf")
    ids = input_ids(VOCAB)
    torch.testing.assert_close(hf_logits(tmp_path / "hf", ids), hf_logits(source, ids), rtol=1e-5, atol=1e-5)


# Keys MiniMaxM2Config does not read: another value describes a model transformers does not build.
IGNORED_KEYS: dict[str, tuple[dict[str, Any], str]] = {
    "routing-bias-off": ({"use_routing_bias": False}, "use_routing_bias=False: MiniMaxM2ForCausalLM is converted "
                                                      "only with use_routing_bias=True"),
    "qk-norm-off": ({"use_qk_norm": False}, "use_qk_norm=False: MiniMaxM2ForCausalLM is converted only with "
                                            "use_qk_norm=True"),
    "qk-norm-per-head": ({"qk_norm_type": "per_head"}, "qk_norm_type='per_head': MiniMaxM2ForCausalLM is converted "
                                                       "only with qk_norm_type='per_layer'"),
    "softmax-scores": ({"scoring_func": "softmax"}, "scoring_func='softmax': MiniMaxM2ForCausalLM is converted only "
                                                    "with scoring_func='sigmoid'"),
    "shared-expert": ({"shared_intermediate_size": 64}, "shared_intermediate_size=64: MiniMaxM2ForCausalLM is "
                                                        "converted only with shared_intermediate_size=0"),
    "lightning-attention": ({"attn_type_list": [0, 1, 1, 1]}, "attn_type_list=[0, 1, 1, 1]: MiniMaxM2ForCausalLM "
                                                              "computes softmax attention (1) in every layer"),
    "top-1": ({"num_experts_per_tok": 1}, "num_experts_per_tok=1: transformers renormalizes the one chosen sigmoid "
                                          "score to 1"),
}


@pytest.mark.parametrize("case", sorted(IGNORED_KEYS))
def test_a_setting_minimax_m2_cannot_carry_is_refused_by_name(source: Path, tmp_path: Path, case: str) -> None:
    change, message = IGNORED_KEYS[case]
    src = Path(shutil.copytree(source, tmp_path / "src"))
    edit_json(src / "config.json", lambda doc: doc.update(change))

    with pytest.raises(CheckpointError, match=re.escape(f"{src / 'config.json'}: {message}")):
        pgconvert.convert(src, tmp_path / "megatron", dst_format="megatron")
    assert not (tmp_path / "megatron").exists()


def _as_released(doc: dict[str, Any], rotary_dim: int) -> None:
    """config.json as the release spells RoPE (transformers 4 remote code): a top-level rope_theta and
    rotary_dim, no rope_parameters."""
    doc["rope_theta"] = doc.pop("rope_parameters")["rope_theta"]
    doc["rotary_dim"] = rotary_dim


@pytest.mark.parametrize("rotary_dim", [8, 16])
def test_the_releases_rotary_dim_is_the_partial_rotary_transformers_computes(source: Path, tmp_path: Path,
                                                                             rotary_dim: int) -> None:
    from transformers import AutoConfig

    src = Path(shutil.copytree(source, tmp_path / "src"))
    edit_json(src / "config.json", lambda doc: _as_released(doc, rotary_dim))

    pgconvert.convert(src, tmp_path / "megatron", dst_format="megatron", dst_tp=2, dst_ep=2)

    hf = AutoConfig.from_pretrained(src)
    assert hf.rope_parameters.get("partial_rotary_factor", 1.0) == rotary_dim / 16
    args = _args(tmp_path / "megatron")
    assert args.rotary_percent == rotary_dim / 16
