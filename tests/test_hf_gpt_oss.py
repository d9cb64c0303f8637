"""GPT-OSS (GptOssForCausalLM): HF <-> Megatron / torch_dist is bit-exact, and the model survives.

The source is a tiny transformers model (tests/support/glm4_moe_gpt_oss_helpers.py): every layer MoE with experts
stacked per layer as transformers saves them (gate_up_proj [E, hidden, 2·I], gate/up interleaved),
biases on every linear and on the router, attention sinks, a window of 4 on alternate layers, the
clamped GLU with a limit low enough to bite, and a vocab that is not a multiple of 128. RoPE is plain
in the main fixture (the reference forward computes plain RoPE); the released YaRN scaling has its own
round trip below.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from support.hf_helpers import (
    assert_same_hf_tensors,
    edit_json,
    hf_logits,
    input_ids,
    read_megatron_tp_ranks,
    rewrite_as_single_file,
)
from support.glm4_moe_gpt_oss_helpers import GPT_OSS_KWARGS, assert_same_release, first_rank_args, gpt_oss_tp_logits, save_gpt_oss

import pgconvert
from pgconvert.errors import CheckpointError

VOCAB = GPT_OSS_KWARGS["vocab_size"]
LAYOUTS = {"tp2pp2": dict(dst_tp=2, dst_pp=2), "tp2ep2": dict(dst_tp=2, dst_ep=2),
           "tp2ep2pp2-grouped": dict(dst_tp=2, dst_ep=2, dst_pp=2, dst_expert_layout="grouped")}
MEGATRON_ONLY_ARGS = "softmax_type='learnable', glu_linear_offset=1.0, activation_func_clamp_value=0.5"


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_gpt_oss(tmp_path_factory.mktemp("gpt_oss") / "src", seed=3)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_gpt_oss_to_megatron_and_back_is_bit_exact_with_the_same_logits(source: Path, tmp_path: Path,
                                                                        layout: str) -> None:
    to_megatron = pgconvert.convert(source, tmp_path / "megatron", dst_format="megatron", **LAYOUTS[layout])
    back = pgconvert.convert(tmp_path / "megatron", tmp_path / "hf", dst_format="hf")

    assert any(MEGATRON_ONLY_ARGS in notice for notice in to_megatron.notices)
    assert not [notice for notice in back.notices if "not carried" in notice]
    assert_same_release(source, tmp_path / "hf", VOCAB)


def test_gpt_oss_to_torch_dist_and_back_is_bit_exact(source: Path, tmp_path: Path) -> None:
    pgconvert.convert(source, tmp_path / "dist", dst_format="torch_dist")
    pgconvert.convert(tmp_path / "dist", tmp_path / "hf", dst_format="hf")

    assert_same_release(source, tmp_path / "hf", VOCAB)


def test_megatron_tp2_ep2_rank_files_compute_the_hf_logits(source: Path, tmp_path: Path) -> None:
    """Independent forward over the TP-sharded rank files (not pgconvert's merge) against transformers."""
    config = json.loads((source / "config.json").read_text())
    ids = input_ids(VOCAB)
    pgconvert.convert(source, tmp_path / "megatron", dst_format="megatron", dst_tp=2, dst_ep=2)
    ranks = read_megatron_tp_ranks(tmp_path / "megatron")

    actual = gpt_oss_tp_logits(ranks, config, ids)

    torch.testing.assert_close(actual, hf_logits(source, ids).to(torch.float64), rtol=1e-5, atol=1e-5)
    # The settings it computes with are the ones the Megatron args carry (Megatron-Bridge's names).
    args = first_rank_args(tmp_path / "megatron")
    assert (args.softmax_type, args.glu_linear_offset, args.activation_func_clamp_value) == ("learnable", 1.0, 0.5)
    assert args.quick_geglu and not args.swiglu and args.add_bias_linear and not args.add_qkv_bias
    assert (tuple(args.window_size), list(args.window_attn_skip_freq)) == ((3, 0), [1, 0, 1, 0])
    # Each TP rank holds the sinks of its own heads.
    assert ranks[0]["decoder.layers.0.self_attention.core_attention.softmax_offset"].shape == (4,)


@pytest.mark.parametrize("change", ["sinks", "window", "clamp", "expert_bias"])
def test_reference_forward_depends_on_each_gpt_oss_setting(source: Path, tmp_path: Path, change: str) -> None:
    """The check above is sensitive: lose the sinks, the window, the clamp or the experts' fc1 bias and the
    logits differ."""
    config = json.loads((source / "config.json").read_text())
    ids = input_ids(VOCAB)
    pgconvert.convert(source, tmp_path / "megatron", dst_format="megatron", dst_tp=2, dst_ep=2)
    ranks = read_megatron_tp_ranks(tmp_path / "megatron")
    if change == "window":
        config["layer_types"] = ["full_attention"] * len(config["layer_types"])
    elif change == "clamp":
        config["swiglu_limit"] = 1e9
    else:
        suffix = "softmax_offset" if change == "sinks" else "linear_fc1.bias"
        for model in ranks:
            for key in [k for k in model if k.endswith(suffix)]:
                model[key] = torch.zeros_like(model[key])

    actual = gpt_oss_tp_logits(ranks, config, ids)

    assert not torch.allclose(actual, hf_logits(source, ids).to(torch.float64), rtol=1e-4, atol=1e-4)


def test_megatron_gpt_oss_without_a_carried_config_is_written_as_gpt_oss(source: Path, tmp_path: Path) -> None:
    """From Megatron args alone (no hf/ folder) the family is inferred and config.json built from the
    table: transformers then computes the same logits."""
    pgconvert.convert(source, tmp_path / "megatron", dst_format="megatron", dst_tp=2, dst_ep=2)
    shutil.rmtree(tmp_path / "megatron" / "hf")

    report = pgconvert.convert(tmp_path / "megatron", tmp_path / "hf", dst_format="hf")

    written = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert written["architectures"] == ["GptOssForCausalLM"]
    expected = {key: json.loads((source / "config.json").read_text())[key] for key in (
        "layer_types", "sliding_window", "swiglu_limit", "swiglu_alpha", "attention_bias", "num_local_experts",
        "intermediate_size")}
    assert {key: written[key] for key in expected} == expected
    assert not [notice for notice in report.notices if "not carried" in notice]
    assert_same_hf_tensors(source, tmp_path / "hf")
    ids = input_ids(VOCAB)
    torch.testing.assert_close(hf_logits(tmp_path / "hf", ids), hf_logits(source, ids), rtol=1e-5, atol=1e-5)


def _copy(source: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(source, tmp_path / "src"))


# The released checkpoints' RoPE (openai/gpt-oss-20b config.json), carried by pgconvert.semantics.yarn.
RELEASED_YARN = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                 "truncate": False, "original_max_position_embeddings": 4096}


def test_released_yarn_rope_round_trips_through_megatron_with_the_same_logits(tmp_path: Path) -> None:
    src = save_gpt_oss(tmp_path / "src", seed=4, rope_parameters=dict(RELEASED_YARN))

    to_megatron = pgconvert.convert(src, tmp_path / "megatron", dst_format="megatron", dst_tp=2, dst_ep=2)
    pgconvert.convert(tmp_path / "megatron", tmp_path / "hf", dst_format="hf")

    assert not [notice for notice in to_megatron.notices if "rope" in notice.lower()]
    args = first_rank_args(tmp_path / "megatron")
    assert (args.position_embedding_type, args.rotary_base) == ("yarn", 150000.0)
    assert_same_release(src, tmp_path / "hf", VOCAB)


def test_swiglu_alpha_other_than_quick_gelus_is_refused(source: Path, tmp_path: Path) -> None:
    src = _copy(source, tmp_path)
    edit_json(src / "config.json", lambda doc: doc.update(swiglu_alpha=1.5))

    with pytest.raises(CheckpointError, match=r"swiglu_alpha=1\.5: GptOssForCausalLM is converted only with "
                                              r"swiglu_alpha=1\.702"):
        pgconvert.convert(src, tmp_path / "out", dst_format="megatron")


def test_stacked_expert_tensor_missing_an_expert_is_refused_naming_it(source: Path, tmp_path: Path) -> None:
    src = _copy(source, tmp_path)
    name = "model.layers.2.mlp.experts.gate_up_proj"
    rewrite_as_single_file(src, lambda tensors: tensors.update({name: tensors[name][:3].clone()}))

    with pytest.raises(CheckpointError, match=re.escape(f"{name} has shape [3, 64, 64], expected [4, 64, 64]")):
        pgconvert.convert(src, tmp_path / "out", dst_format="megatron")


def test_small_shards_never_split_a_stacked_expert_tensor(source: Path, tmp_path: Path) -> None:
    """Each layer's experts are written as one stacked tensor even where the shard limit falls inside them."""
    pgconvert.convert(source, tmp_path / "megatron", dst_format="megatron", dst_tp=2, dst_ep=2)

    pgconvert.convert(tmp_path / "megatron", tmp_path / "hf", dst_format="hf", max_shard_size=20_000)

    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 4
    assert_same_hf_tensors(source, tmp_path / "hf")
    ids = input_ids(VOCAB)
    torch.testing.assert_close(hf_logits(tmp_path / "hf", ids), hf_logits(source, ids), rtol=1e-5, atol=1e-5)
