"""GLM-4.5-MoE (Glm4MoeForCausalLM): HF <-> Megatron / torch_dist is bit-exact, and the model survives.

The source is a tiny transformers model (tests/support/glm4_moe_gpt_oss_helpers.py) with every GLM-specific option
on: partial rotary (half of each head), qk-norm, q/k/v biases, a dense first layer, a shared expert
of two expert widths, a sigmoid router with a non-zero e_score_correction_bias, scaled routing
weights, and a vocab that is not a multiple of 128.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import pytest
import torch
from support.hf_helpers import assert_same_hf_tensors, edit_json, hf_logits, input_ids, load_hf_tensors, read_megatron_tp_ranks
from support.glm4_moe_gpt_oss_helpers import GLM4_MOE_KWARGS, assert_same_release, first_rank_args, glm4_moe_tp_logits, save_glm4_moe
from safetensors.torch import save_file

import pgconvert
from pgconvert.errors import CheckpointError, StrictModeError

VOCAB = GLM4_MOE_KWARGS["vocab_size"]
LAYOUTS = {"tp2pp2": dict(dst_tp=2, dst_pp=2), "tp2ep2": dict(dst_tp=2, dst_ep=2),
           "tp2ep2pp2-grouped": dict(dst_tp=2, dst_ep=2, dst_pp=2, dst_expert_layout="grouped")}


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_glm4_moe(tmp_path_factory.mktemp("glm4_moe") / "src", seed=3)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_glm4_moe_to_megatron_and_back_is_bit_exact_with_the_same_logits(source: Path, tmp_path: Path,
                                                                         layout: str) -> None:
    pgconvert.convert(source, tmp_path / "megatron", dst_format="megatron", **LAYOUTS[layout])
    back = pgconvert.convert(tmp_path / "megatron", tmp_path / "hf", dst_format="hf")

    assert not [notice for notice in back.notices if "not carried" in notice]
    assert_same_release(source, tmp_path / "hf", VOCAB)


def test_glm4_moe_to_torch_dist_and_back_is_bit_exact(source: Path, tmp_path: Path) -> None:
    pgconvert.convert(source, tmp_path / "megatron", dst_format="megatron", dst_tp=2, dst_ep=2)
    pgconvert.convert(tmp_path / "megatron", tmp_path / "dist", dst_format="torch_dist")
    pgconvert.convert(tmp_path / "dist", tmp_path / "hf", dst_format="hf")

    assert_same_release(source, tmp_path / "hf", VOCAB)


def test_megatron_tp2_ep2_rank_files_compute_the_hf_logits(source: Path, tmp_path: Path) -> None:
    """Independent forward over the TP-sharded rank files (not pgconvert's merge) against transformers."""
    config = json.loads((source / "config.json").read_text())
    ids = input_ids(VOCAB)
    pgconvert.convert(source, tmp_path / "megatron", dst_format="megatron", dst_tp=2, dst_ep=2)
    ranks = read_megatron_tp_ranks(tmp_path / "megatron")

    actual = glm4_moe_tp_logits(ranks, config, ids)

    torch.testing.assert_close(actual, hf_logits(source, ids).to(torch.float64), rtol=1e-5, atol=1e-5)
    # The settings it computes with are the ones the Megatron args carry.
    args = first_rank_args(tmp_path / "megatron")
    assert (args.rotary_percent, args.moe_router_score_function, args.moe_router_topk_scaling_factor) == (
        0.5, "sigmoid", 2.5)
    assert args.moe_router_enable_expert_bias and args.qk_layernorm and args.add_qkv_bias
    assert not args.add_bias_linear
    assert (args.moe_shared_expert_intermediate_size, list(args.moe_layer_freq)) == (64, [0, 1, 1, 1])
    assert ranks[0]["decoder.layers.1.mlp.router.expert_bias"].dtype == torch.float64  # read as float64
    bias = load_hf_tensors(source)["model.layers.1.mlp.gate.e_score_correction_bias"]
    assert bias.dtype == torch.float32 and bool(bias.abs().min() > 0)


@pytest.mark.parametrize("change", ["expert_bias", "rotary_percent", "shared_expert"])
def test_reference_forward_depends_on_each_glm_setting(source: Path, tmp_path: Path, change: str) -> None:
    """The check above is sensitive: drop the expert bias, rotate whole heads or lose the shared expert
    and the logits differ."""
    config = json.loads((source / "config.json").read_text())
    ids = input_ids(VOCAB)
    pgconvert.convert(source, tmp_path / "megatron", dst_format="megatron", dst_tp=2, dst_ep=2)
    ranks = read_megatron_tp_ranks(tmp_path / "megatron")
    if change == "expert_bias":
        for model in ranks:
            for key in [k for k in model if k.endswith("expert_bias")]:
                model[key] = torch.zeros_like(model[key])
    elif change == "rotary_percent":
        config["rope_parameters"]["partial_rotary_factor"] = 1.0
    else:
        for model in ranks:
            for key in [k for k in model if "shared_experts.linear_fc2" in k]:
                model[key] = torch.zeros_like(model[key])

    actual = glm4_moe_tp_logits(ranks, config, ids)

    assert not torch.allclose(actual, hf_logits(source, ids).to(torch.float64), rtol=1e-4, atol=1e-4)


def test_megatron_glm4_moe_without_a_carried_config_is_written_as_glm4_moe(source: Path, tmp_path: Path) -> None:
    """From Megatron args alone (no hf/ folder) the family is inferred and config.json built from the
    table: transformers then computes the same logits."""
    pgconvert.convert(source, tmp_path / "megatron", dst_format="megatron", dst_tp=2, dst_pp=2)
    shutil.rmtree(tmp_path / "megatron" / "hf")

    report = pgconvert.convert(tmp_path / "megatron", tmp_path / "hf", dst_format="hf", strict=False)

    written = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert written["architectures"] == ["Glm4MoeForCausalLM"]
    assert {key: written[key] for key in ("first_k_dense_replace", "n_shared_experts", "n_routed_experts",
                                          "routed_scaling_factor", "use_qk_norm", "attention_bias",
                                          "num_nextn_predict_layers")} == {
        "first_k_dense_replace": 1, "n_shared_experts": 2, "n_routed_experts": 4, "routed_scaling_factor": 2.5,
        "use_qk_norm": True, "attention_bias": True, "num_nextn_predict_layers": 0}
    assert written["rope_parameters"]["partial_rotary_factor"] == 0.5
    assert not [notice for notice in report.notices if "not carried" in notice]
    assert_same_hf_tensors(source, tmp_path / "hf")
    ids = input_ids(VOCAB)
    torch.testing.assert_close(hf_logits(tmp_path / "hf", ids), hf_logits(source, ids), rtol=1e-5, atol=1e-5)


def _copy(source: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(source, tmp_path / "src"))


def test_checkpoint_with_part_of_an_mtp_layer_is_refused_naming_what_is_missing(source: Path, tmp_path: Path) -> None:
    """MTP layers convert (tests/test_mtp.py); one stored in part is a named error."""
    src = _copy(source, tmp_path)
    mtp = {"model.layers.4.eh_proj.weight": torch.zeros(64, 128), "model.layers.4.enorm.weight": torch.ones(64)}
    save_file(mtp, str(src / "mtp.safetensors"), metadata={"format": "pt"})
    edit_json(src / "model.safetensors.index.json",
              lambda doc: doc["weight_map"].update({name: "mtp.safetensors" for name in mtp}))
    edit_json(src / "config.json", lambda doc: doc.update(num_nextn_predict_layers=1))

    with pytest.raises(CheckpointError, match=r"missing: \['model\.layers\.4\.hnorm\.weight'.*mtp\.layers\.0\.hnorm"):
        pgconvert.convert(src, tmp_path / "out", dst_format="megatron")


def test_group_limited_routing_round_trips_through_megatron_with_the_same_logits(tmp_path: Path) -> None:
    """n_group=2, topk_group=1 with top-2 routing: HF's top-2 group score is megatron-core's
    topk // group_topk = 2, carried as moe_router_num_groups / moe_router_group_topk."""
    src = save_glm4_moe(tmp_path / "src", seed=3, n_group=2, topk_group=1)
    ungrouped = Path(shutil.copytree(src, tmp_path / "ungrouped"))
    edit_json(ungrouped / "config.json", lambda doc: doc.update(n_group=1, topk_group=1))
    ids = input_ids(VOCAB)
    # The group limit changes what this model computes, so dropping it would show in the logits.
    assert not torch.allclose(hf_logits(ungrouped, ids), hf_logits(src, ids), rtol=1e-4, atol=1e-4)

    pgconvert.convert(src, tmp_path / "megatron", dst_format="megatron", dst_tp=2, dst_ep=2)
    args = first_rank_args(tmp_path / "megatron")
    shutil.rmtree(tmp_path / "megatron" / "hf")
    pgconvert.convert(tmp_path / "megatron", tmp_path / "hf", dst_format="hf", strict=True)

    assert (args.moe_router_num_groups, args.moe_router_group_topk) == (2, 1)
    written = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (written["n_group"], written["topk_group"]) == (2, 1)
    assert_same_hf_tensors(src, tmp_path / "hf")
    torch.testing.assert_close(hf_logits(tmp_path / "hf", ids), hf_logits(src, ids), rtol=1e-5, atol=1e-5)


def test_megatron_core_group_limited_routing_chooses_as_transformers_glm4_moe() -> None:
    """megatron-core's topk_routing_with_score_function with the carried args routes as
    transformers' Glm4MoeTopkRouter (same experts, same weights)."""
    from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function
    from transformers import Glm4MoeConfig
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeTopkRouter

    config = Glm4MoeConfig(hidden_size=16, n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2,
                           routed_scaling_factor=2.5, norm_topk_prob=True)
    router = Glm4MoeTopkRouter(config)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=generator))
        router.e_score_correction_bias.copy_(0.3 * torch.randn(16, generator=generator))
    hidden = torch.randn(64, 16, generator=generator)

    logits, weights, chosen = router(hidden)
    probs, routing_map = topk_routing_with_score_function(
        logits, 4, num_groups=4, group_topk=2, scaling_factor=2.5, score_function="sigmoid",
        expert_bias=router.e_score_correction_bias)

    expected = torch.zeros(64, 16).scatter(1, chosen, weights)
    assert torch.equal(routing_map, expected != 0)
    torch.testing.assert_close(probs, expected, rtol=1e-6, atol=1e-6)


def test_group_limited_routing_megatron_scores_differently_is_refused_naming_the_keys(source: Path,
                                                                                      tmp_path: Path) -> None:
    """n_group=4, topk_group=2 with top-2 routing: megatron-core would score a group by its best
    topk // group_topk = 1 expert, transformers by its best 2."""
    src = _copy(source, tmp_path)
    edit_json(src / "config.json", lambda doc: doc.update(n_group=4, topk_group=2))

    with pytest.raises(CheckpointError, match=r"n_group=4, topk_group=2 with num_experts_per_tok=2"):
        pgconvert.convert(src, tmp_path / "out", dst_format="megatron")


def test_router_without_top_k_renormalization_is_named_and_refused_under_strict(source: Path, tmp_path: Path) -> None:
    """megatron-core's sigmoid router always renormalizes the chosen weights (top-k > 1)."""
    src = _copy(source, tmp_path)
    edit_json(src / "config.json", lambda doc: doc.update(norm_topk_prob=False))

    report = pgconvert.convert(src, tmp_path / "out", dst_format="megatron")
    with pytest.raises(StrictModeError, match="norm_topk_prob=False"):
        pgconvert.convert(src, tmp_path / "strict", dst_format="megatron", strict=True)

    assert any("norm_topk_prob=False" in notice for notice in report.notices)


def test_absent_partial_rotary_factor_means_glms_default_half(source: Path, tmp_path: Path) -> None:
    src = _copy(source, tmp_path)
    edit_json(src / "config.json", lambda doc: doc["rope_parameters"].pop("partial_rotary_factor"))

    pgconvert.convert(src, tmp_path / "megatron", dst_format="megatron")

    with torch.serialization.safe_globals([argparse.Namespace]):
        args = torch.load(tmp_path / "megatron" / "iter_0000000" / "mp_rank_00" / "model_optim_rng.pt",
                          weights_only=True)["args"]
    assert args.rotary_percent == 0.5


def test_megatron_groups_glm_scores_differently_cannot_be_written_as_glm4_moe(source: Path) -> None:
    """From Megatron, moe_router_group_topk=2 with top-2 routing (a group's best 1 expert) is not
    GLM's top-2 group score: the family refuses it, naming the field; group_topk=1 fits."""
    import dataclasses

    from pgconvert.formats.hf import family_mismatches, model_config_from_hf

    doc = json.loads((source / "config.json").read_text())
    family, config, _ = model_config_from_hf({**doc, "n_group": 2, "topk_group": 1}, source / "config.json")

    assert family_mismatches(family, config) == []
    refused = family_mismatches(family, dataclasses.replace(config, moe_router_num_groups=4, moe_router_group_topk=2))
    assert refused == ["moe_router_group_topk=2 with moe_router_topk=2 (Glm4Moe scores a group by its best 2 "
                       "experts: needs topk // group_topk = 2)"]
