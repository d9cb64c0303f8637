"""Llama 4 text (Llama4ForCausalLM): HF <-> Megatron / torch_dist is bit-exact, and megatron-core computes it.

The source is Llama-4-Scout-17B-16E-Instruct's text_config shrunk (tests/support/llama4_models.py): every layer
MoE with top-1 sigmoid routing on the expert's input and a shared expert, stacked transposed experts, a NoPE
layer, the qk L2 norm on the RoPE layers, interleaved (complex) RoPE with llama3 scaling, chunked attention and
the attention temperature as released. megatron-core 0.16.1's GPTModel, built from the written args with
Megatron-Bridge's Llama 4 placement of the L2 norms (tests/support/mcore_helpers.py), computes transformers'
logits; each Llama 4 setting knocked out of the args (or the experts' gate/up swapped) moves them. Chunked
attention and the temperature have no megatron-core setting: carried, and shown to matter on HF's side.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path
from collections.abc import Callable
from typing import Any

import pytest
import torch
from support.hf_helpers import _load_rank, assert_same_hf_tensors, edit_json, hf_logits, input_ids
from support.llama4_models import MAVERICK_TEXT, SCOUT_TEXT, save_llama4

import pgconvert
from pgconvert.errors import ConfigError, StrictModeError

VOCAB = SCOUT_TEXT["vocab_size"]
TOL = dict(rtol=1e-5, atol=1e-5)
# megatron-core sums in another order (router, expert unpermute, rotary tables): float32 round-off.
MCORE_TOL = dict(rtol=1e-5, atol=5e-5)


@pytest.fixture(scope="module")
def scout(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_llama4(tmp_path_factory.mktemp("llama4") / "scout", seed=3)


@pytest.fixture(scope="module")
def megatron_tp1(tmp_path_factory: pytest.TempPathFactory) -> Callable:
    root = tmp_path_factory.mktemp("llama4_tp1")
    made: dict[str, tuple[Path, Path]] = {}

    def get(name: str) -> tuple[Path, Path]:
        if name not in made:
            src = save_llama4(root / name, seed=3, base=SCOUT_TEXT if name == "scout" else MAVERICK_TEXT)
            pgconvert.convert(src, root / f"{name}-megatron", dst_format="megatron", dst_tp=1, dst_pp=1, dst_ep=1)
            made[name] = (src, root / f"{name}-megatron")
        return made[name]
    return get


def _rank_files(root: Path) -> list[Path]:
    return sorted(root.glob("iter_*/mp_rank_*/model_optim_rng.pt"))


def _rewrite_ranks(root: Path, change: Any) -> None:
    for path in _rank_files(root):
        payload = _load_rank(path)
        change(payload)
        torch.save(payload, path)


def _set_args(changes: dict[str, Any]) -> Any:
    def change(payload: dict[str, Any]) -> None:
        args: argparse.Namespace = payload["args"]
        for name, value in changes.items():
            setattr(args, name, value)
    return change


def test_scout_to_megatron_tp2_pp2_ep2_to_torch_dist_and_back_is_bit_exact(scout: Path, tmp_path: Path) -> None:
    there = pgconvert.convert(scout, tmp_path / "megatron", dst_format="megatron", dst_tp=2, dst_pp=2, dst_ep=2)
    pgconvert.convert(tmp_path / "megatron", tmp_path / "dist", dst_format="torch_dist")
    back = pgconvert.convert(tmp_path / "dist", tmp_path / "hf", dst_format="hf")

    assert [notice for notice in there.notices if "get_llama4_layer_spec" in notice]
    assert not [notice for notice in back.notices if "not carried" in notice]
    assert_same_hf_tensors(scout, tmp_path / "hf")
    assert json.loads((tmp_path / "hf" / "config.json").read_text()) == json.loads((scout / "config.json").read_text())
    ids = input_ids(VOCAB)
    torch.testing.assert_close(hf_logits(tmp_path / "hf", ids), hf_logits(scout, ids), **TOL)


@pytest.mark.parametrize("layout", [dict(dst_pp=2, dst_vpp=2, dst_ep=4),
                                    dict(dst_tp=2, dst_ep=2, dst_transformer_impl="transformer_engine",
                                         dst_expert_layout="grouped")], ids=["pp2vpp2ep4", "te-grouped-tp2ep2"])
def test_scout_through_other_layouts_and_back_is_bit_exact(scout: Path, tmp_path: Path,
                                                           layout: dict[str, Any]) -> None:
    pgconvert.convert(scout, tmp_path / "megatron", dst_format="megatron", **layout)
    pgconvert.convert(tmp_path / "megatron", tmp_path / "hf", dst_format="hf")

    assert_same_hf_tensors(scout, tmp_path / "hf")


def test_torch_dist_keys_shapes_and_chunks_are_what_megatron_core_declares(megatron_tp1: Callable,
                                                                           tmp_path: Path) -> None:
    """megatron-core's GPTModel built from the args (its L2 norms hold no tensor, the shared expert no gate)
    declares the keys pgconvert writes."""
    import support.mcore_helpers as mcore
    from support.mcore_gpt_models import megatron_core_layout, read_layout
    from support.torch_dist_forms import FOR_MCORE_016

    _, megatron = megatron_tp1("maverick")
    pgconvert.convert(megatron, tmp_path / "dist", dst_format="torch_dist", **FOR_MCORE_016)
    expected, expected_objects = megatron_core_layout(mcore.load_rank_into_gpt_model(mcore.rank_files(megatron)[0]))

    tensors, objects = read_layout(tmp_path / "dist" / "iter_0000000")

    assert any("shared_experts.linear_fc1" in key for key in expected) and any(".experts." in key for key in expected)
    assert objects == expected_objects
    assert sorted(tensors) == sorted(expected)
    for key, (shape, _, chunks) in expected.items():
        assert tensors[key][0] == shape and tensors[key][2] == chunks, key


def test_megatron_args_carry_every_llama4_setting(megatron_tp1: Callable) -> None:
    _, megatron = megatron_tp1("scout")
    args = _load_rank(_rank_files(megatron)[0])["args"]

    assert (args.qk_l2_norm, args.moe_apply_probs_on_input, args.rotary_interleaved, args.use_rope_scaling) == (
        True, True, True, True)
    assert (args.moe_router_score_function, args.moe_router_topk, args.moe_router_pre_softmax) == ("sigmoid", 1, False)
    assert (args.ffn_hidden_size, args.moe_ffn_hidden_size, args.moe_shared_expert_intermediate_size) == (48, 32, 32)
    assert list(args.no_rope_freq) == [0, 0, 0, 1] and args.moe_layer_freq == 1
    assert (args.attention_chunk_size, args.attn_temperature_tuning) == (8192, True)


@pytest.mark.parametrize("name", ["scout", "maverick"])
def test_megatron_core_forward_of_the_tp1_rank_file_equals_transformers(megatron_tp1: Callable, name: str) -> None:
    import support.mcore_helpers as mcore

    src, megatron = megatron_tp1(name)
    ids = input_ids(VOCAB)

    actual = mcore.megatron_core_logits_from_args(megatron, ids)

    torch.testing.assert_close(actual, hf_logits(src, ids), **MCORE_TOL)


def test_megatron_core_forward_stage_by_stage_at_pp2_equals_transformers(scout: Path, tmp_path: Path) -> None:
    """The L2 norms leave the NoPE layer by its global index on the second stage too."""
    import support.mcore_helpers as mcore

    pgconvert.convert(scout, tmp_path / "megatron", dst_format="megatron", dst_tp=1, dst_pp=2, dst_ep=1)
    ids = input_ids(VOCAB)

    actual = mcore.megatron_core_logits_from_args(tmp_path / "megatron", ids)

    assert len(mcore.rank_files(tmp_path / "megatron")) == 2
    torch.testing.assert_close(actual, hf_logits(scout, ids), **MCORE_TOL)


def test_megatron_cores_own_spec_normalizes_the_nope_layer_too_as_the_notice_says(
        megatron_tp1: Callable, monkeypatch: pytest.MonkeyPatch) -> None:
    """Built with megatron-core's decoder block spec as it is (the L2 norm in every layer), the model computes
    otherwise: hence the notice naming Megatron-Bridge's get_llama4_layer_spec."""
    import support.mcore_helpers as mcore

    src, megatron = megatron_tp1("scout")
    monkeypatch.setattr(mcore, "_l2_norms_on_rope_layers", lambda spec, config, pp_rank: spec)
    ids = input_ids(VOCAB)

    actual = mcore.megatron_core_logits_from_args(megatron, ids)

    assert not torch.allclose(actual, hf_logits(src, ids), **MCORE_TOL)


def _swap_gate_up(fragment: str) -> Any:
    """The ``[gate; up]`` halves of every ``linear_fc1`` whose name holds ``fragment`` swapped."""
    def change(payload: dict[str, Any]) -> None:
        for key, value in payload["model"].items():
            if fragment in key and key.endswith("linear_fc1.weight"):
                gate, up = value.chunk(2)
                payload["model"][key] = torch.cat([up, gate])
    return change


KNOCK_OUTS: dict[str, tuple[str, Any]] = {
    "probs-on-output": ("scout", _set_args({"moe_apply_probs_on_input": False})),
    "no-qk-l2-norm": ("scout", _set_args({"qk_l2_norm": False})),
    "rope-on-every-layer": ("scout", _set_args({"no_rope_freq": None})),
    "rotate-half": ("scout", _set_args({"rotary_interleaved": False})),
    "no-rope-scaling": ("scout", _set_args({"use_rope_scaling": False})),
    "softmax-router": ("scout", _set_args({"moe_router_score_function": "softmax", "moe_router_pre_softmax": True})),
    "experts-gate-up-swapped": ("scout", _swap_gate_up(".mlp.experts.")),
    "shared-expert-gate-up-swapped": ("scout", _swap_gate_up(".mlp.shared_experts.")),
    "dense-mlp-gate-up-swapped": ("maverick", _swap_gate_up(".mlp.linear_fc1.")),
}


@pytest.mark.parametrize("case", sorted(KNOCK_OUTS))
def test_megatron_core_forward_sees_each_llama4_setting(megatron_tp1: Callable, tmp_path: Path, case: str) -> None:
    import support.mcore_helpers as mcore

    name, change = KNOCK_OUTS[case]
    src, megatron = megatron_tp1(name)
    knocked_out = Path(shutil.copytree(megatron, tmp_path / "megatron"))
    _rewrite_ranks(knocked_out, change)
    ids = input_ids(VOCAB)

    actual = mcore.megatron_core_logits_from_args(knocked_out, ids)

    assert not torch.allclose(actual, hf_logits(src, ids), **MCORE_TOL)


# Chunks of 4 tokens and the temperature from position 3 on, so that 12 tokens see both.
SHORT = dict(attention_chunk_size=4, floor_scale=4, attn_scale=0.5)


@pytest.mark.parametrize("knocked_out", ["attention_chunk_size", "attn_temperature_tuning"])
def test_chunked_attention_and_temperature_are_carried_and_change_the_logits(tmp_path: Path,
                                                                             knocked_out: str) -> None:
    """megatron-core computes neither: both go through the args and back (same logits), and a checkpoint whose
    args lose one converts to another model."""
    src = save_llama4(tmp_path / "src", seed=3, **SHORT)
    report = pgconvert.convert(src, tmp_path / "megatron", dst_format="megatron", dst_tp=2)
    shutil.rmtree(tmp_path / "megatron" / "hf")
    pgconvert.convert(tmp_path / "megatron", tmp_path / "hf", dst_format="hf")
    _rewrite_ranks(tmp_path / "megatron", _set_args({knocked_out: None}))
    pgconvert.convert(tmp_path / "megatron", tmp_path / "lost", dst_format="hf")
    ids = input_ids(VOCAB)

    assert [notice for notice in report.notices if "attention_chunk_size=4" in notice and "floor_scale=4" in notice]
    torch.testing.assert_close(hf_logits(tmp_path / "hf", ids), hf_logits(src, ids), **TOL)
    assert not torch.allclose(hf_logits(tmp_path / "lost", ids), hf_logits(src, ids), **TOL)


def test_megatron_llama4_without_a_carried_config_is_written_as_llama4(megatron_tp1: Callable,
                                                                       tmp_path: Path) -> None:
    src, megatron = megatron_tp1("maverick")
    bare = Path(shutil.copytree(megatron, tmp_path / "megatron"))
    shutil.rmtree(bare / "hf")

    pgconvert.convert(bare, tmp_path / "hf", dst_format="hf")

    written = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert written["architectures"] == ["Llama4ForCausalLM"]
    assert (written["moe_layers"], written["interleave_moe_layer_step"], written["use_qk_norm"]) == ([1, 3], 2, False)
    assert_same_hf_tensors(src, tmp_path / "hf")
    ids = input_ids(VOCAB)
    torch.testing.assert_close(hf_logits(tmp_path / "hf", ids), hf_logits(src, ids), **TOL)


def test_strict_refuses_a_megatron_target_that_computes_without_chunks_and_temperature(scout: Path,
                                                                                       tmp_path: Path) -> None:
    with pytest.raises(StrictModeError, match=r"attention_chunk_size=8192, attn_temperature_tuning=True"):
        pgconvert.convert(scout, tmp_path / "out", dst_format="megatron", strict=True)


def test_released_integer_temperature_switch_reads_as_on(scout: Path, tmp_path: Path) -> None:
    """Llama-4-Scout's config.json says attn_temperature_tuning: 4 (read as true by the transformers that released
    it); transformers 5.24 refuses the integer, pgconvert reads it as on and writes true."""
    src = Path(shutil.copytree(scout, tmp_path / "src"))
    edit_json(src / "config.json", lambda doc: doc.update(attn_temperature_tuning=4))

    pgconvert.convert(src, tmp_path / "megatron", dst_format="megatron")

    assert _load_rank(_rank_files(tmp_path / "megatron")[0])["args"].attn_temperature_tuning is True


@pytest.mark.parametrize(("change", "message"), [
    ({"num_experts_per_tok": 2}, r"num_experts_per_tok"),
    ({"attention_bias": True}, r"attention_bias"),
    ({"layer_types": ["full_attention"] * 4}, r"layer_types=.* with attention_chunk_size=8192: Llama 4 chunks the attention of exactly the RoPE layers"),
])
def test_settings_megatron_computes_otherwise_are_refused_by_name(scout: Path, tmp_path: Path,
                                                                  change: dict[str, Any], message: str) -> None:
    src = Path(shutil.copytree(scout, tmp_path / "src"))
    edit_json(src / "config.json", lambda doc: doc.update(change))

    with pytest.raises((ConfigError, ValueError), match=message):
        pgconvert.convert(src, tmp_path / "out", dst_format="megatron")
