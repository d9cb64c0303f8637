"""Experts, expert parallelism and virtual pipelines: bit-exact against independently sliced fixtures."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from support.checkpoint_compare import assert_same_ranks
from click.testing import CliRunner
from support.tiny_models import GQA_SWIGLU, MOE, MOE_GROUPED_TE
from support.megatron_fixtures import (
    load_for_test,
    make_full_model,
    merge_megatron_checkpoint,
    read_megatron_checkpoint_ranks,
    write_megatron_checkpoint,
)

import pgconvert
from pgconvert.cli import main

MOE_MODELS = {"moe_sequential_local": MOE, "moe_grouped_te_tied": MOE_GROUPED_TE}


# (tp, pp, ep, vpp) hops.
MOE_TRIPS = {
    "ep4-ep1-ep4": [(1, 1, 4, None), (1, 1, 1, None), (1, 1, 4, None)],
    "ep2tp2-ep4tp1-back": [(2, 1, 2, None), (1, 1, 4, None), (2, 1, 2, None)],
    "tp2ep2pp2-ep8-back": [(2, 2, 2, None), (1, 1, 8, None), (2, 2, 2, None)],
    "vpp2pp2-pp4-back": [(1, 2, 2, 2), (1, 4, 1, None), (1, 2, 2, 2)],
}


@pytest.mark.parametrize("hops", list(MOE_TRIPS.values()), ids=list(MOE_TRIPS))
@pytest.mark.parametrize("model_name", sorted(MOE_MODELS))
def test_moe_round_trip_matches_fixtures_at_every_hop(tmp_path: Path, model_name: str, hops: list) -> None:
    model = MOE_MODELS[model_name]
    full = make_full_model(model, seed=3)
    tp, pp, ep, vpp = hops[0]
    current = original = write_megatron_checkpoint(tmp_path / "hop0", model, full, tp, pp, ep=ep, vpp=vpp)

    for index, (tp, pp, ep, vpp) in enumerate(hops[1:], start=1):
        converted = tmp_path / f"hop{index}"
        pgconvert.convert(current, converted, dst_tp=tp, dst_pp=pp, dst_ep=ep, dst_vpp=vpp)
        expected = write_megatron_checkpoint(tmp_path / f"expected{index}", model, full, tp, pp, ep=ep, vpp=vpp)
        assert_same_ranks(converted, expected)
        current = converted

    assert_same_ranks(current, original)
    merged = merge_megatron_checkpoint(current, model)
    assert merged.keys() == full.keys() and all(torch.equal(merged[k], full[k]) for k in full)


def test_dense_model_vpp2_pp2_to_pp4_and_back(tmp_path: Path) -> None:
    full = make_full_model(replace(GQA_SWIGLU, num_layers=8))
    model = replace(GQA_SWIGLU, num_layers=8)
    src = write_megatron_checkpoint(tmp_path / "src", model, full, 2, 2, vpp=2)

    pgconvert.convert(src, tmp_path / "pp4", dst_pp=4, dst_tp=1)
    pgconvert.convert(tmp_path / "pp4", tmp_path / "back", dst_pp=2, dst_vpp=2, dst_tp=2)

    assert_same_ranks(tmp_path / "pp4", write_megatron_checkpoint(tmp_path / "e4", model, full, 1, 4))
    assert_same_ranks(tmp_path / "back", src)


@pytest.mark.parametrize(("src_layout", "dst_layout"), [("sequential", "grouped"), ("grouped", "sequential")])
def test_grouped_gemm_and_sequential_experts_convert_both_ways(tmp_path: Path, src_layout: str, dst_layout: str) -> None:
    src_model = replace(MOE, moe_grouped_gemm=src_layout == "grouped")
    dst_model = replace(MOE, moe_grouped_gemm=dst_layout == "grouped")
    full = make_full_model(MOE)
    src = write_megatron_checkpoint(tmp_path / "src", src_model, full, 2, 1, ep=2)

    result = CliRunner().invoke(main, ["--quiet", "--dst-expert-layout", dst_layout, "--dst-ep", "4",
                                       str(src), str(tmp_path / "dst")])

    assert result.exit_code == 0, result.output
    assert_same_ranks(tmp_path / "dst", write_megatron_checkpoint(tmp_path / "expected", dst_model, full, 2, 1, ep=4))


def test_transformer_engine_naming_can_be_chosen_for_the_target(tmp_path: Path) -> None:
    local = replace(MOE, transformer_impl="local")
    te = replace(MOE, transformer_impl="transformer_engine")
    full = make_full_model(MOE)
    src = write_megatron_checkpoint(tmp_path / "src", local, full, 1, 1, ep=2)

    pgconvert.convert(src, tmp_path / "te", dst_transformer_impl="transformer_engine")
    pgconvert.convert(tmp_path / "te", tmp_path / "local", dst_transformer_impl="local")

    assert_same_ranks(tmp_path / "te", write_megatron_checkpoint(tmp_path / "expected", te, full, 1, 1, ep=2))
    assert_same_ranks(tmp_path / "local", src)


def test_dtype_option_casts_the_router_and_keeps_expert_bias_in_float32(tmp_path: Path) -> None:
    """megatron-core holds a router's weight in the run's dtype and its expert bias (a buffer) in float32."""
    full = make_full_model(MOE)
    src = write_megatron_checkpoint(tmp_path / "src", MOE, full, 1, 1, ep=2)

    pgconvert.convert(src, tmp_path / "fp16", dtype="fp16")

    _, ranks = read_megatron_checkpoint_ranks(tmp_path / "fp16")
    model = ranks[(0, 0, 1)]["model"]
    assert model["decoder.layers.0.mlp.router.weight"].dtype == torch.float16
    assert model["decoder.layers.0.mlp.router.expert_bias"].dtype == torch.float32
    assert model["decoder.layers.0.mlp.experts.local_experts.3.linear_fc1.weight"].dtype == torch.float16
    assert model["decoder.layers.0.self_attention.linear_qkv.weight"].dtype == torch.float16
    assert torch.equal(model["decoder.layers.0.mlp.router.weight"],
                       full["decoder.layers.0.mlp.router.weight"].to(torch.float16))


def test_pipeline_layout_string_places_layers_and_round_trips(tmp_path: Path) -> None:
    model = GQA_SWIGLU
    full = make_full_model(model)
    src = write_megatron_checkpoint(tmp_path / "src", model, full, 1, 1)

    result = CliRunner().invoke(main, ["--quiet", "--dst-pp", "2", "--dst-pipeline-layout", "Et|tt|t|L",
                                       str(src), str(tmp_path / "layout")])
    pgconvert.convert(tmp_path / "layout", tmp_path / "back", dst_pp=1)

    assert result.exit_code == 0, result.output
    args, ranks = read_megatron_checkpoint_ranks(tmp_path / "layout")
    assert args.pipeline_model_parallel_layout == "Et|tt|t|L"
    stage0, stage1 = ranks[(0, 0, 0)], ranks[(0, 1, 0)]
    # Virtual stages: 0 = stage0/model0 (E, layer 0), 1 = stage1/model0 (layers 1-2),
    # 2 = stage0/model1 (layer 3), 3 = stage1/model1 (L only).
    assert "embedding.word_embeddings.weight" in stage0["model0"]
    assert [k for k in stage0["model0"] if k.endswith("linear_fc2.weight")] == ["decoder.layers.0.mlp.linear_fc2.weight"]
    assert torch.equal(stage1["model0"]["decoder.layers.1.mlp.linear_fc2.weight"],
                       full["decoder.layers.2.mlp.linear_fc2.weight"])
    assert torch.equal(stage0["model1"]["decoder.layers.0.mlp.linear_fc2.weight"],
                       full["decoder.layers.3.mlp.linear_fc2.weight"])
    assert sorted(stage1["model1"]) == ["decoder.final_layernorm.weight", "output_layer.weight"]
    assert_same_ranks(tmp_path / "back", src)


def run_cli(*args: str | Path) -> tuple[int, str]:
    result = CliRunner().invoke(main, [str(a) for a in args])
    return result.exit_code, result.output


def test_experts_not_divisible_by_target_ep_are_refused(tmp_path: Path) -> None:
    src = write_megatron_checkpoint(tmp_path / "src", MOE, make_full_model(MOE), 1, 1, ep=2)

    code, output = run_cli(src, tmp_path / "dst", "--dst-ep", "3")

    assert code == 2
    assert "--dst-ep 3: num_experts=8 is not divisible by 3" in output
    assert not (tmp_path / "dst").exists()


def test_expert_tp_different_from_tp_is_refused_for_the_per_rank_format(tmp_path: Path) -> None:
    src = write_megatron_checkpoint(tmp_path / "src", MOE, make_full_model(MOE), 2, 1, ep=2)

    code, output = run_cli(src, tmp_path / "dst", "--dst-expert-tp", "1")

    assert code == 2
    assert "--dst-expert-tp 1: the megatron per-rank format" in output and "== tp (2)" in output


def test_missing_expert_shard_is_named(tmp_path: Path) -> None:
    src = write_megatron_checkpoint(tmp_path / "src", MOE, make_full_model(MOE), 1, 1, ep=4)
    victim = src / "iter_0000100" / "mp_rank_00_002"
    (victim / "model_optim_rng.pt").unlink()
    victim.rmdir()

    code, output = run_cli(src, tmp_path / "dst", "--dst-ep", "1")

    assert code == 1
    assert "missing rank files for tp=1,pp=1,ep=4 (from args): mp_rank_00_002/model_optim_rng.pt" in output


def test_expert_index_beyond_the_ranks_share_is_refused(tmp_path: Path) -> None:
    src = write_megatron_checkpoint(tmp_path / "src", MOE, make_full_model(MOE), 1, 1, ep=4)
    path = src / "iter_0000100" / "mp_rank_00_001" / "model_optim_rng.pt"
    state = load_for_test(path)
    # Rank 1 of ep=4 holds experts 2-3 as local 0-1; a local index 2 duplicates rank 2's first expert.
    prefix = "decoder.layers.0.mlp.experts.local_experts."
    state["model"][prefix + "2.linear_fc1.weight"] = state["model"][prefix + "1.linear_fc1.weight"].clone()
    torch.save(state, path)

    code, output = run_cli(src, tmp_path / "dst", "--dst-ep", "1")

    assert code == 1
    assert f"unexpected: ['{prefix}2.linear_fc1.weight']" in output


def test_dense_tensor_that_differs_between_ep_ranks_is_refused(tmp_path: Path) -> None:
    src = write_megatron_checkpoint(tmp_path / "src", MOE, make_full_model(MOE), 1, 1, ep=2)
    path = src / "iter_0000100" / "mp_rank_00_001" / "model_optim_rng.pt"
    state = load_for_test(path)
    state["model"]["decoder.layers.1.mlp.linear_fc1.weight"][0, 0] += 1
    torch.save(state, path)

    code, output = run_cli(src, tmp_path / "dst", "--dst-ep", "1")

    assert code == 1
    assert "decoder.layers.1.mlp.linear_fc1.weight: the copies in" in output and "mp_rank_00_001" in output


def test_rank_file_without_the_chunks_its_args_promise_is_refused(tmp_path: Path) -> None:
    model = replace(GQA_SWIGLU, num_layers=8)
    src = write_megatron_checkpoint(tmp_path / "src", model, make_full_model(model), 1, 2, vpp=2)
    path = src / "iter_0000100" / "mp_rank_00_001" / "model_optim_rng.pt"
    state = load_for_test(path)
    del state["model1"]
    torch.save(state, path)

    code, output = run_cli(src, tmp_path / "dst", "--dst-pp", "1")

    assert code == 1
    assert "model chunks ['model0'] do not match the layout tp=1,pp=2,vpp=2 from args (expected ['model0', 'model1'])" in output


@pytest.mark.parametrize(("layers", "message"), [
    (8, "--dst-pp 2 × --dst-vpp 3: num_layers=8 is not divisible by 6"),
    (4, "--dst-pp 2 × --dst-vpp 3: 6 virtual pipeline stages, more than num_layers=4"),
])
def test_vpp_that_does_not_fit_the_layers_is_refused(tmp_path: Path, layers: int, message: str) -> None:
    model = replace(GQA_SWIGLU, num_layers=layers)
    src = write_megatron_checkpoint(tmp_path / "src", model, make_full_model(model), 1, 1)

    code, output = run_cli(src, tmp_path / "dst", "--dst-pp", "2", "--dst-vpp", "3")

    assert code == 2
    assert message in output


def test_sequential_expert_extra_states_follow_the_target_ep(tmp_path: Path) -> None:
    model = replace(MOE, transformer_impl="transformer_engine")
    full = make_full_model(model)
    src = write_megatron_checkpoint(tmp_path / "src", model, full, 1, 1, ep=4)

    pgconvert.convert(src, tmp_path / "ep2", dst_ep=2)

    assert_same_ranks(tmp_path / "ep2", write_megatron_checkpoint(tmp_path / "expected", model, full, 1, 1, ep=2))
