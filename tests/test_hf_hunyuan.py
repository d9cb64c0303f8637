"""HunYuan dense and MoE (HunYuanDenseV1ForCausalLM, HunYuanMoEV1ForCausalLM): HF -> Megatron TP2/PP2 (EP2 for MoE)
-> torch_dist -> HF is bit-exact with the same logits; the Megatron rank files and their args compute transformers'.

The sources are tencent/Hunyuan-7B-Instruct's and Hunyuan-A13B-Instruct's config.json shrunk
(tests/support/llama_like_helpers.py): q/k norms after RoPE, the NTK-alpha RoPE (rope_scaling type dynamic with
alpha 1000), tied embeddings; the MoE model's per-layer lists, a shared MLP in every layer. megatron-core applies q/k
norms before RoPE, so transformers' logits are checked with the independent reference forward over the TP-sharded
rank files (driven by the written args), and megatron-core's own forward of the TP1 file is shown to compute that
reference forward with the norms moved before RoPE, which the Megatron notice names.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from support.hf_helpers import assert_same_hf_tensors, hf_logits, read_megatron_tp_ranks
from support.llama_like_helpers import build_model, input_ids, megatron_args, reference_logits, save_model
from support.round_trips import assert_config_refused, assert_round_trip

import pgconvert
from pgconvert.errors import StrictModeError

FAMILIES = ("hunyuan_dense", "hunyuan_moe")
ARCHITECTURES = {"hunyuan_dense": "HunYuanDenseV1ForCausalLM", "hunyuan_moe": "HunYuanMoEV1ForCausalLM"}
NOTICE = "qk_layernorm_after_rope=True: megatron-core has no such setting"
# transformers' compute_ntk_alpha_rope_parameters with head_dim 8: rope_theta * alpha ** (8 / 6).
NTK_ALPHA_BASE = 10000.0 * 1000.0 ** (8 / 6)


def _layout(family: str, pp: int = 1) -> dict[str, int]:
    return {"dst_tp": 2, "dst_pp": pp, "dst_ep": 2 if family == "hunyuan_moe" else 1}


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hunyuan")
    return {name: save_model(build_model(name, seed=3), root / name) for name in FAMILIES}


@pytest.fixture(scope="module")
def megatron(sources: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hunyuan_megatron")
    for name in FAMILIES:
        pgconvert.convert(sources[name], root / name, dst_format="megatron", **_layout(name))
    return {name: root / name for name in FAMILIES}


@pytest.mark.parametrize("family", FAMILIES)
def test_hf_to_megatron_tp2_pp2_to_torch_dist_to_hf_is_bit_exact(sources: dict[str, Path], tmp_path: Path,
                                                                 family: str) -> None:
    report = assert_round_trip(sources[family], tmp_path, input_ids(), **_layout(family, pp=2))

    assert any(NOTICE in notice for notice in report.notices)


def test_megatron_args_hold_the_ntk_alpha_base_and_the_qk_norm_order(megatron: dict[str, Path]) -> None:
    dense, moe = megatron_args(megatron["hunyuan_dense"]), megatron_args(megatron["hunyuan_moe"])

    for args in (dense, moe):
        assert (args.rotary_base, args.qk_layernorm, args.qk_layernorm_after_rope) == (NTK_ALPHA_BASE, True, True)
        assert (args.kv_channels, args.num_query_groups, args.untie_embeddings_and_output_weights) == (8, 2, False)
    assert (moe.num_experts, moe.moe_router_topk, moe.moe_layer_freq, moe.moe_ffn_hidden_size) == (8, 2, 1, 48)
    assert (moe.moe_shared_expert_intermediate_size, moe.moe_shared_expert_gate) == (48, False)
    assert (moe.moe_router_score_function, moe.moe_router_pre_softmax) == ("softmax", False)


@pytest.mark.parametrize("family", FAMILIES)
def test_megatron_rank_files_and_args_compute_transformers_logits(sources: dict[str, Path],
                                                                  megatron: dict[str, Path], family: str) -> None:
    root = megatron[family]

    actual = reference_logits(read_megatron_tp_ranks(root), megatron_args(root), input_ids())

    torch.testing.assert_close(actual, hf_logits(sources[family], input_ids()).to(torch.float64),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family,change", [
    ("hunyuan_dense", "qk_layernorm_after_rope"), ("hunyuan_dense", "rotary_base"),
    ("hunyuan_moe", "qk_layernorm_after_rope"), ("hunyuan_moe", "shared_experts"),
])
def test_reference_forward_sees_each_hunyuan_setting(sources: dict[str, Path], megatron: dict[str, Path],
                                                     family: str, change: str) -> None:
    """The norms before RoPE, the base without alpha, or no shared MLP: other logits."""
    args = megatron_args(megatron[family])
    if change == "qk_layernorm_after_rope":
        args.qk_layernorm_after_rope = False
    elif change == "rotary_base":
        args.rotary_base = 10000.0
    else:
        args.moe_shared_expert_intermediate_size = None

    actual = reference_logits(read_megatron_tp_ranks(megatron[family]), args, input_ids())

    expected = hf_logits(sources[family], input_ids()).to(torch.float64)
    assert not torch.allclose(actual, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("family", FAMILIES)
def test_megatron_core_computes_the_norms_before_rope_as_the_notice_names(sources: dict[str, Path], tmp_path: Path,
                                                                         family: str) -> None:
    """megatron-core's own forward of the TP1 file (its q/k norms before RoPE) is not transformers', and is the
    reference forward with qk_layernorm_after_rope knocked out: everything else it computes as HunYuan does."""
    pytest.importorskip("megatron.core")
    import support.mcore_helpers as mcore

    pgconvert.convert(sources[family], tmp_path / "megatron", dst_format="megatron", dst_tp=1, dst_pp=1, dst_ep=1)
    args = megatron_args(tmp_path / "megatron")
    ids = input_ids()

    actual = mcore.megatron_core_logits_from_args(tmp_path / "megatron", ids)

    assert not torch.allclose(actual, hf_logits(sources[family], ids), rtol=1e-4, atol=1e-4)
    args.qk_layernorm_after_rope = False
    before_rope = reference_logits(read_megatron_tp_ranks(tmp_path / "megatron"), args, ids)
    torch.testing.assert_close(actual, before_rope.float(), rtol=1e-5, atol=5e-5)


def test_q_k_norms_after_rope_need_q_k_norms() -> None:
    from pgconvert.errors import ConfigError
    from pgconvert.model.config import ModelConfig

    with pytest.raises(ConfigError, match="qk_layernorm_after_rope=True: needs qk_layernorm"):
        ModelConfig(num_layers=2, hidden_size=16, num_attention_heads=2, ffn_hidden_size=32, vocab_size=10,
                    qk_layernorm_after_rope=True)


def test_strict_refuses_a_megatron_target_naming_the_qk_norm_order(sources: dict[str, Path], tmp_path: Path) -> None:
    with pytest.raises(StrictModeError, match=NOTICE):
        pgconvert.convert(sources["hunyuan_dense"], tmp_path / "out", dst_format="megatron", strict=True)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("family", FAMILIES)
def test_megatron_hunyuan_without_a_carried_config_is_written_as_hunyuan(sources: dict[str, Path],
                                                                        megatron: dict[str, Path], tmp_path: Path,
                                                                        family: str) -> None:
    """From the args alone only HunYuan holds q/k norms after RoPE; the NTK-alpha base is written as the plain
    RoPE base it is, and transformers computes the same logits."""
    root = Path(shutil.copytree(megatron[family], tmp_path / "megatron"))
    shutil.rmtree(root / "hf")

    pgconvert.convert(root, tmp_path / "hf", dst_format="hf")

    written = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert written["architectures"] == [ARCHITECTURES[family]]
    assert written["rope_parameters"] == {"rope_type": "default", "rope_theta": NTK_ALPHA_BASE}
    assert_same_hf_tensors(sources[family], tmp_path / "hf")
    ids = input_ids()
    torch.testing.assert_close(hf_logits(tmp_path / "hf", ids), hf_logits(sources[family], ids), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family,change,expected", [
    ("hunyuan_dense", {"rope_scaling": {"type": "dynamic", "factor": 2.0}},
     r"type 'dynamic' without alpha .* megatron-core has no such RoPE"),
    ("hunyuan_dense", {"partial_rotary_factor": 0.5, "rope_scaling": {"type": "linear", "factor": 2.0}},
     r"partial_rotary_factor=0.5 with rope_type 'linear': that type sizes its frequencies by the factor"),
    ("hunyuan_dense", {"use_cla": True}, r"use_cla=True: cross-layer K/V sharing"),
    ("hunyuan_dense", {"use_qk_norm": False}, r"use_qk_norm=False: transformers' HunYuan always applies"),
    ("hunyuan_dense", {"attention_bias": True}, r"attention_bias=True: q/k/v and o biases without MLP biases"),
    ("hunyuan_dense", {"head_dim": None}, r"head_dim"),
    ("hunyuan_moe", {"moe_topk": [2, 2, 1, 2]}, r"moe_topk=\[2, 2, 1, 2\]: megatron-core routes every layer"),
    ("hunyuan_moe", {"moe_intermediate_size": [32] * 4}, r"moe_intermediate_size=\[32, 32, 32, 32\]"),
    ("hunyuan_moe", {"num_shared_expert": [2] * 4}, r"num_shared_expert=\[2, 2, 2, 2\]: .* one shared MLP"),
    ("hunyuan_moe", {"use_mixed_mlp_moe": False}, r"use_mixed_mlp_moe=False"),
])
def test_settings_transformers_or_megatron_core_cannot_compute_are_refused_naming_the_key(
        sources: dict[str, Path], tmp_path: Path, family: str, change: dict[str, object], expected: str) -> None:
    assert_config_refused(sources[family], tmp_path, change, expected)


def test_a_partial_rotary_factor_under_default_rope_is_not_read_as_transformers_rotates_the_whole_head(
        sources: dict[str, Path], tmp_path: Path) -> None:
    src = Path(shutil.copytree(sources["hunyuan_dense"], tmp_path / "src"))
    doc = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**doc, "partial_rotary_factor": 0.5}))
    pgconvert.convert(src, tmp_path / "megatron", dst_format="megatron", dst_tp=2)
    assert megatron_args(tmp_path / "megatron").rotary_percent == 1.0
    pgconvert.convert(tmp_path / "megatron", tmp_path / "hf", dst_format="hf")
    ids = input_ids()
    # transformers' HunYuan computes the same logits with the factor and without it (the back conversion writes none)
    torch.testing.assert_close(hf_logits(tmp_path / "hf", ids), hf_logits(src, ids), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(hf_logits(src, ids), hf_logits(sources["hunyuan_dense"], ids), rtol=0, atol=0)
