"""Cohere2 (c4ai-command-r7b-12-2024, Command A): HF -> Megatron TP2/PP2 -> torch_dist -> HF is bit-exact with the same
logits, config and side files; Cohere's parallel layer is carried as Cohere's (a notice, refused under --strict); the
window on three layers in four and RoPE on those alone reach the args as window_size, window_attn_skip_freq and
no_rope_freq; an independent TP forward over the rank files, reading the args, computes transformers' logits and moves
when the window or the NoPE layers are knocked out of the args.
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
from support.round_trips import assert_config_refused, assert_round_trip

import pgconvert
from pgconvert.errors import CheckpointError, StrictModeError
from pgconvert.families import ORDERED
from pgconvert.formats.hf import family_mismatches, infer_family, model_config_from_hf, unmapped_losses

CARRIED_NOTICE = ("use_parallel_residual=True, shared_input_layernorm=True, layernorm_bias=False, logit_scale=0.25: "
                  "megatron-core has no such setting")


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_parallel_block_model("cohere2", tmp_path_factory.mktemp("cohere2") / "src", seed=5)


@pytest.fixture(scope="module")
def tp2(source: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    dst = tmp_path_factory.mktemp("cohere2_tp2") / "megatron"
    pgconvert.convert(source, dst, dst_format="megatron", dst_tp=2)
    return dst


def _with_config(src: Path, dst: Path, change: dict[str, object]) -> Path:
    """A copy of ``src`` whose config.json has ``change`` (a None value: the key removed)."""
    shutil.copytree(src, dst)
    doc = {**json.loads((dst / "config.json").read_text()), **change}
    (dst / "config.json").write_text(json.dumps({key: value for key, value in doc.items() if value is not None}))
    return dst


def test_hf_to_megatron_tp2_pp2_to_torch_dist_to_hf_is_bit_exact(source: Path, tmp_path: Path) -> None:
    report = assert_round_trip(source, tmp_path, input_ids(), dst_tp=2, dst_pp=2)
    assert any(CARRIED_NOTICE in notice for notice in report.notices), report.notices


def test_args_hold_the_window_and_rope_on_the_windowed_layers_alone(tp2: Path) -> None:
    args = megatron_args(tp2)
    assert (args.window_size, args.window_attn_skip_freq, args.no_rope_freq) == ((4, 0), [1, 1, 1, 0], [0, 0, 0, 1])
    assert (args.use_parallel_residual, args.shared_input_layernorm, args.layernorm_bias) == (True, True, False)
    assert (args.logit_scale, args.rotary_base, args.rotary_interleaved, args.qk_layernorm) == (0.25, 50000.0, True,
                                                                                               False)
    assert (args.kv_channels, args.num_query_groups, args.untie_embeddings_and_output_weights) == (8, 2, False)


def test_reference_forward_over_tp2_rank_files_gives_transformers_logits(source: Path, tp2: Path) -> None:
    ids = input_ids()
    logits = parallel_block_logits(read_megatron_tp_ranks(tp2), megatron_args(tp2), ids)
    torch.testing.assert_close(logits.float(), hf_logits(source, ids), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("knocked_out", [{"window_size": None}, {"no_rope_freq": None}],
                         ids=["no-window", "rope-everywhere"])
def test_knocking_a_setting_out_of_the_args_changes_the_reference_logits(source: Path, tp2: Path,
                                                                         knocked_out: dict[str, object]) -> None:
    ids, args = input_ids(), megatron_args(tp2)
    changed = argparse.Namespace(**{**vars(copy.deepcopy(args)), **knocked_out})
    assert not torch.allclose(parallel_block_logits(read_megatron_tp_ranks(tp2), changed, ids).float(),
                              hf_logits(source, ids), rtol=1e-3, atol=1e-3)


def test_with_every_layer_full_attention_no_layer_rotates_and_the_model_converts_both_ways(tmp_path: Path) -> None:
    src = save_parallel_block_model("cohere2", tmp_path / "src", seed=6, layer_types=["full_attention"] * 4)
    assert_round_trip(src, tmp_path, input_ids(), dst_tp=2, dst_pp=2)
    args = megatron_args(tmp_path / "megatron")
    assert (args.window_size, args.no_rope_freq) == (None, [1, 1, 1, 1])
    shutil.rmtree(tmp_path / "megatron" / "hf")
    pgconvert.convert(tmp_path / "megatron", tmp_path / "rebuilt", dst_format="hf", dst_tp=1, dst_pp=1)
    ids = input_ids()
    torch.testing.assert_close(hf_logits(tmp_path / "rebuilt", ids), hf_logits(src, ids), rtol=1e-5, atol=1e-5)


def test_strict_refuses_a_megatron_target(source: Path, tmp_path: Path) -> None:
    with pytest.raises(StrictModeError, match="use_parallel_residual=True, shared_input_layernorm=True"):
        pgconvert.convert(source, tmp_path / "out", dst_format="megatron", strict=True)
    assert not (tmp_path / "out").exists()


def test_megatron_model_without_the_carried_config_is_written_as_cohere2(source: Path, tp2: Path,
                                                                        tmp_path: Path) -> None:
    megatron = Path(shutil.copytree(tp2, tmp_path / "megatron"))
    shutil.rmtree(megatron / "hf")
    pgconvert.convert(megatron, tmp_path / "hf", dst_format="hf", dst_tp=1)
    written = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (written["architectures"], written["logit_scale"], written["sliding_window"]) == (["Cohere2ForCausalLM"],
                                                                                            0.25, 5)
    assert written["layer_types"] == ["sliding_attention"] * 3 + ["full_attention"]
    assert_same_hf_tensors(source, tmp_path / "hf")
    ids = input_ids()
    torch.testing.assert_close(hf_logits(tmp_path / "hf", ids), hf_logits(source, ids), rtol=1e-5, atol=1e-5)


def test_the_model_fits_no_other_family(source: Path) -> None:
    config = model_config_from_hf(json.loads((source / "config.json").read_text()), source / "config.json")[1]
    assert infer_family(config).architecture == "Cohere2ForCausalLM"
    for family in (family for family in ORDERED if family.architecture != "Cohere2ForCausalLM"):
        assert family_mismatches(family, config) + unmapped_losses(family.architecture, config), family.architecture


def test_the_releases_older_spelling_reads_as_the_same_model(source: Path, tmp_path: Path) -> None:
    """c4ai-command-r7b-12-2024's config.json as released: sliding_window_pattern, a top-level rope_theta."""
    src = _with_config(source, tmp_path / "src", {"layer_types": None, "sliding_window_pattern": 4,
                                                  "rope_parameters": None, "rope_theta": 50000})
    pgconvert.convert(src, tmp_path / "m", dst_format="megatron", dst_tp=2)
    args = megatron_args(tmp_path / "m")
    assert (args.window_attn_skip_freq, args.no_rope_freq, args.rotary_base) == ([1, 1, 1, 0], [0, 0, 0, 1], 50000.0)
    ids = input_ids()
    torch.testing.assert_close(hf_logits(src, ids), hf_logits(source, ids), rtol=0, atol=0)


@pytest.mark.parametrize("layer_types", [["sliding_attention"] * 3 + ["full_attention"], ["full_attention"] * 4],
                         ids=["sliding-layers", "every-layer-full"])
def test_a_null_window_is_refused_by_name(source: Path, tmp_path: Path, layer_types: list[str]) -> None:
    """Cohere2Model builds a sliding-window mask whatever the layer types, from the window as given: transformers
    cannot run a model without one."""
    src = _with_config(source, tmp_path / "src", {"layer_types": layer_types})
    doc = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**doc, "sliding_window": None}))
    with pytest.raises(CheckpointError, match="sliding_window=null: Cohere2Model builds a sliding-window mask"):
        pgconvert.convert(src, tmp_path / "out", dst_format="megatron")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("change, expected", [
    ({"attention_bias": True}, "attention_bias=True: Cohere2ForCausalLM is converted only with attention_bias=False"),
    ({"layer_types": None, "sliding_window_pattern": 0}, "sliding_window_pattern=0: expected a positive integer"),
], ids=["attention-bias", "no-period"])
def test_settings_megatron_cannot_hold_are_refused_by_name(source: Path, tmp_path: Path, change: dict[str, object],
                                                           expected: str) -> None:
    assert_config_refused(source, tmp_path, change, expected)
