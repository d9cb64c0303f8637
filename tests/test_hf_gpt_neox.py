"""GPT-NeoX (pythia): HF -> Megatron TP2/PP2 -> HF and HF -> torch_dist -> HF are bit-exact with the same logits,
config and side files; the parallel attention and MLP megatron-core cannot compute is carried in the args with a
notice (refused under --strict); an independent TP forward over the rank files, reading the args, computes
transformers' logits, and moves when the parallel residual or the partial rotary is knocked out of the args.
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
from pgconvert.errors import PgconvertError, StrictModeError
from pgconvert.families import ORDERED
from pgconvert.formats.hf import family_mismatches, infer_family, model_config_from_hf, unmapped_losses

SIDE_FILES = ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
PARALLEL_NOTICE = "use_parallel_residual=True: megatron-core has no such setting"


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_parallel_block_model("gpt_neox", tmp_path_factory.mktemp("gpt_neox") / "src", seed=5)


@pytest.fixture(scope="module")
def tp2(source: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str]]:
    """The source as TP2 Megatron rank files, and the conversion's notices."""
    dst = tmp_path_factory.mktemp("gpt_neox_tp2") / "megatron"
    return dst, pgconvert.convert(source, dst, dst_format="megatron", dst_tp=2).notices


def _assert_same_model(source: Path, converted: Path) -> None:
    assert_same_model(source, converted, input_ids(), SIDE_FILES)


def test_hf_to_megatron_tp2_pp2_to_hf_is_bit_exact_and_names_the_parallel_layer(source: Path, tmp_path: Path) -> None:
    report = pgconvert.convert(source, tmp_path / "megatron", dst_format="megatron", dst_tp=2, dst_pp=2)
    assert any(PARALLEL_NOTICE in notice for notice in report.notices), report.notices
    pgconvert.convert(tmp_path / "megatron", tmp_path / "hf", dst_format="hf", dst_tp=1, dst_pp=1)
    _assert_same_model(source, tmp_path / "hf")
    manifest = json.loads((tmp_path / "megatron" / "pgconvert.json").read_text())
    assert manifest["model_config"]["use_parallel_residual"] is True


def test_hf_to_torch_dist_to_hf_is_bit_exact(source: Path, tmp_path: Path) -> None:
    report = pgconvert.convert(source, tmp_path / "dist", dst_format="torch_dist", dst_tp=2)
    assert any(PARALLEL_NOTICE in notice for notice in report.notices), report.notices
    pgconvert.convert(tmp_path / "dist", tmp_path / "hf", dst_format="hf", dst_tp=1)
    _assert_same_model(source, tmp_path / "hf")


def test_megatron_args_hold_the_parallel_layer_partial_rotary_layernorm_gelu_and_biases(
        tp2: tuple[Path, list[str]]) -> None:
    args = megatron_args(tp2[0])
    assert args.use_parallel_residual is True
    assert (args.rotary_percent, args.rotary_base, args.position_embedding_type) == (0.25, 10000.0, "rope")
    assert (args.normalization, args.norm_epsilon, args.add_bias_linear) == ("LayerNorm", 1e-5, True)
    assert (args.swiglu, args.openai_gelu, args.num_query_groups) == (False, False, 4)
    assert args.untie_embeddings_and_output_weights is True


def test_reference_forward_over_tp2_rank_files_gives_transformers_logits(source: Path,
                                                                          tp2: tuple[Path, list[str]]) -> None:
    ids = input_ids()
    logits = parallel_block_logits(read_megatron_tp_ranks(tp2[0]), megatron_args(tp2[0]), ids)
    torch.testing.assert_close(logits.float(), hf_logits(source, ids), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("knocked_out", [{"use_parallel_residual": False}, {"rotary_percent": 1.0}],
                         ids=["sequential-layer", "whole-head-rotary"])
def test_knocking_a_setting_out_of_the_args_changes_the_reference_logits(
        source: Path, tp2: tuple[Path, list[str]], knocked_out: dict[str, object]) -> None:
    ids, models = input_ids(), read_megatron_tp_ranks(tp2[0])
    args = megatron_args(tp2[0])
    changed = argparse.Namespace(**{**vars(copy.deepcopy(args)), **knocked_out})
    expected = hf_logits(source, ids)
    torch.testing.assert_close(parallel_block_logits(models, args, ids).float(), expected, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(parallel_block_logits(models, changed, ids).float(), expected, rtol=1e-3, atol=1e-3)


def test_sequential_gpt_neox_converts_without_the_carried_setting(tmp_path: Path) -> None:
    source = save_parallel_block_model("gpt_neox", tmp_path / "src", seed=6, use_parallel_residual=False)
    report = pgconvert.convert(source, tmp_path / "megatron", dst_format="megatron", dst_tp=2, strict=True)
    assert not any("use_parallel_residual" in notice for notice in report.notices), report.notices
    args = megatron_args(tmp_path / "megatron")
    assert not hasattr(args, "use_parallel_residual")
    ids = input_ids()
    logits = parallel_block_logits(read_megatron_tp_ranks(tmp_path / "megatron"), args, ids)
    torch.testing.assert_close(logits.float(), hf_logits(source, ids), rtol=1e-5, atol=1e-5)
    pgconvert.convert(tmp_path / "megatron", tmp_path / "hf", dst_format="hf", dst_tp=1)
    _assert_same_model(source, tmp_path / "hf")


def test_strict_refuses_a_megatron_target_of_the_parallel_layer(source: Path, tmp_path: Path) -> None:
    with pytest.raises(StrictModeError, match="use_parallel_residual=True"):
        pgconvert.convert(source, tmp_path / "out", dst_format="megatron", strict=True)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("megatron_format", ["megatron", "torch_dist"])
def test_megatron_model_without_the_carried_config_is_written_as_gpt_neox(source: Path, tp2: tuple[Path, list[str]],
                                                                         tmp_path: Path, megatron_format: str) -> None:
    megatron = Path(shutil.copytree(tp2[0], tmp_path / "megatron"))
    shutil.rmtree(megatron / "hf")
    if megatron_format == "torch_dist":
        pgconvert.convert(megatron, tmp_path / "dist", dst_format="torch_dist")
        megatron = tmp_path / "dist"
    pgconvert.convert(megatron, tmp_path / "hf", dst_format="hf", dst_tp=1)
    written = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert written["architectures"] == ["GPTNeoXForCausalLM"]
    assert (written["use_parallel_residual"], written["rope_parameters"]["partial_rotary_factor"]) == (True, 0.25)
    assert_same_hf_tensors(source, tmp_path / "hf")
    ids = input_ids()
    torch.testing.assert_close(hf_logits(tmp_path / "hf", ids), hf_logits(source, ids), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("change, expected", [
    ({"attention_bias": False}, "attention_bias=False: GPTNeoXForCausalLM is converted only with attention_bias=True"),
    ({"hidden_act": "gelu_new"}, "hidden_act='gelu_new': GPTNeoXForCausalLM is converted only with hidden_act='gelu'"),
], ids=["unbiased-attention", "tanh-gelu"])
def test_settings_megatron_cannot_hold_are_refused_by_name(source: Path, tmp_path: Path, change: dict[str, object],
                                                           expected: str) -> None:
    assert_config_refused(source, tmp_path, change, expected)


def test_a_parallel_model_fits_no_other_family(source: Path) -> None:
    config = model_config_from_hf(json.loads((source / "config.json").read_text()), source / "config.json")[1]
    assert config.use_parallel_residual is True
    assert infer_family(config).architecture == "GPTNeoXForCausalLM"
    for family in (family for family in ORDERED if family.architecture != "GPTNeoXForCausalLM"):
        assert family_mismatches(family, config) + unmapped_losses(family.architecture, config), family.architecture
    llama_like = config.replace(normalization="RMSNorm", gated_linear_unit=True, activation="silu",
                                add_bias_linear=False, rotary_percent=1.0)
    assert infer_family(llama_like.replace(use_parallel_residual=False)).architecture == "LlamaForCausalLM"
    with pytest.raises(PgconvertError, match="LlamaForCausalLM: use_parallel_residual=True: LlamaForCausalLM has no "
                                             "such setting"):
        infer_family(llama_like)
