"""Cohere (c4ai-command-r-v01): HF -> Megatron TP2/PP2 -> HF and HF -> torch_dist -> HF are bit-exact with the same
logits, config and side files; the parallel layer with one shared norm, the bias-free LayerNorm and the logit scale
megatron-core cannot compute are carried in the args with a notice (refused under --strict); an independent TP
forward over the rank files, reading the args, computes transformers' logits, and moves when one of them is
knocked out of the args.
"""

from __future__ import annotations

import argparse
import copy
import json
import shutil
from pathlib import Path

import pytest
import torch
from support.hf_helpers import assert_same_hf_tensors, hf_logits, read_megatron_tp_ranks
from support.llama_like_helpers import megatron_args
from support.parallel_block_helpers import input_ids, parallel_block_logits, save_parallel_block_model
from support.round_trips import assert_config_refused, assert_same_model

import pgconvert
from pgconvert.errors import StrictModeError
from pgconvert.families import ORDERED
from pgconvert.formats.hf import family_mismatches, infer_family, model_config_from_hf, unmapped_losses

SIDE_FILES = ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
CARRIED_NOTICE = ("use_parallel_residual=True, shared_input_layernorm=True, layernorm_bias=False, logit_scale=0.0625: "
                  "megatron-core has no such setting")


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_parallel_block_model("cohere", tmp_path_factory.mktemp("cohere") / "src", seed=5)


@pytest.fixture(scope="module")
def tp2(source: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    dst = tmp_path_factory.mktemp("cohere_tp2") / "megatron"
    report = pgconvert.convert(source, dst, dst_format="megatron", dst_tp=2)
    assert any(CARRIED_NOTICE in notice for notice in report.notices), report.notices
    return dst


def _assert_same_model(source: Path, converted: Path) -> None:
    assert_same_model(source, converted, input_ids(), SIDE_FILES)


def test_hf_to_megatron_tp2_pp2_to_hf_is_bit_exact(source: Path, tmp_path: Path) -> None:
    report = pgconvert.convert(source, tmp_path / "megatron", dst_format="megatron", dst_tp=2, dst_pp=2)
    assert any(CARRIED_NOTICE in notice for notice in report.notices), report.notices
    pgconvert.convert(tmp_path / "megatron", tmp_path / "hf", dst_format="hf", dst_tp=1, dst_pp=1)
    _assert_same_model(source, tmp_path / "hf")


def test_hf_to_torch_dist_to_hf_is_bit_exact(source: Path, tmp_path: Path) -> None:
    pgconvert.convert(source, tmp_path / "dist", dst_format="torch_dist", dst_tp=2)
    pgconvert.convert(tmp_path / "dist", tmp_path / "hf", dst_format="hf", dst_tp=1)
    _assert_same_model(source, tmp_path / "hf")


def test_rank_files_hold_one_norm_per_layer_without_biases(tp2: Path) -> None:
    models = read_megatron_tp_ranks(tp2)
    norms = sorted(key for key in models[0] if "norm" in key)
    assert norms == ["decoder.final_layernorm.weight", *(f"decoder.layers.{i}.input_layernorm.weight" for i in range(4))]
    args = megatron_args(tp2)
    assert (args.use_parallel_residual, args.shared_input_layernorm, args.layernorm_bias) == (True, True, False)
    assert (args.logit_scale, args.normalization, args.rotary_interleaved, args.swiglu) == (0.0625, "LayerNorm", True,
                                                                                           True)


def test_reference_forward_over_tp2_rank_files_gives_transformers_logits(source: Path, tp2: Path) -> None:
    ids = input_ids()
    logits = parallel_block_logits(read_megatron_tp_ranks(tp2), megatron_args(tp2), ids)
    torch.testing.assert_close(logits.float(), hf_logits(source, ids), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("knocked_out", [{"use_parallel_residual": False, "shared_input_layernorm": False},
                                         {"logit_scale": 1.0}, {"rotary_interleaved": False}],
                         ids=["sequential-layer", "logit-scale", "rotate-half"])
def test_knocking_a_setting_out_of_the_args_changes_the_reference_logits(source: Path, tp2: Path,
                                                                         knocked_out: dict[str, object]) -> None:
    ids, models, args = input_ids(), read_megatron_tp_ranks(tp2), megatron_args(tp2)
    if not knocked_out.get("shared_input_layernorm", True):  # the sequential layer reads a second norm: the first
        models = [{**model, **{key.replace("input_layernorm", "pre_mlp_layernorm"): value
                               for key, value in model.items() if "input_layernorm" in key}} for model in models]
    changed = argparse.Namespace(**{**vars(copy.deepcopy(args)), **knocked_out})
    assert not torch.allclose(parallel_block_logits(models, changed, ids).float(), hf_logits(source, ids),
                              rtol=1e-3, atol=1e-3)


def test_strict_refuses_a_megatron_target(source: Path, tmp_path: Path) -> None:
    with pytest.raises(StrictModeError, match="use_parallel_residual=True, shared_input_layernorm=True"):
        pgconvert.convert(source, tmp_path / "out", dst_format="torch_dist", strict=True)
    assert not (tmp_path / "out").exists()


def test_megatron_model_without_the_carried_config_is_written_as_cohere(source: Path, tp2: Path,
                                                                       tmp_path: Path) -> None:
    megatron = Path(shutil.copytree(tp2, tmp_path / "megatron"))
    shutil.rmtree(megatron / "hf")
    pgconvert.convert(megatron, tmp_path / "hf", dst_format="hf", dst_tp=1)
    written = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (written["architectures"], written["logit_scale"]) == (["CohereForCausalLM"], 0.0625)
    assert_same_hf_tensors(source, tmp_path / "hf")
    ids = input_ids()
    torch.testing.assert_close(hf_logits(tmp_path / "hf", ids), hf_logits(source, ids), rtol=1e-5, atol=1e-5)


def test_the_model_fits_no_other_family(source: Path) -> None:
    config = model_config_from_hf(json.loads((source / "config.json").read_text()), source / "config.json")[1]
    assert infer_family(config).architecture == "CohereForCausalLM"
    for family in (family for family in ORDERED if family.architecture != "CohereForCausalLM"):
        assert family_mismatches(family, config) + unmapped_losses(family.architecture, config), family.architecture


@pytest.mark.parametrize("change, expected", [
    ({"attention_bias": True}, "attention_bias=True: CohereForCausalLM is converted only with attention_bias=False"),
    ({"use_qk_norm": True}, "use_qk_norm=true: CohereLayerNorm over \\(heads, head_dim\\) has a weight for each head"),
], ids=["attention-bias", "qk-norm-per-head"])
def test_settings_megatron_cannot_hold_are_refused_by_name(source: Path, tmp_path: Path, change: dict[str, object],
                                                           expected: str) -> None:
    assert_config_refused(source, tmp_path, change, expected)
