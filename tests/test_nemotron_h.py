"""Nemotron-H (``NemotronHForCausalLM``, dense): HF -> Megatron (TP, PP) -> HF is bit-exact, and the
Megatron rank files compute transformers' logits.

The tiny model is ``support.nemotron_h_models``'s. The Megatron side is checked twice: megatron-core 0.16.1's own MambaModel, built from each rank file's args, loads it
with ``strict=True`` (``support.mcore_mamba``: its forward needs the ``mamba_ssm`` and Triton kernels,
so only construction runs, with stand-ins named there), and an independent forward pass over the
TP-sharded rank files (``support.mamba_reference``) computes transformers' logits.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from support.hf_helpers import assert_same_hf_tensors, hf_logits, input_ids, read_megatron_tp_ranks
from support.mamba_reference import hybrid_logits
from support.nemotron_h_models import PATTERN, TINY, write_tiny_nemotron_h
from support.megatron_fixtures import load_for_test

import pgconvert
from pgconvert.cli import main
from pgconvert.model.config import ModelConfig
from pgconvert.model.kinds import mamba


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_nemotron_h(tmp_path_factory.mktemp("nemotron_h") / "hf")


@pytest.fixture(scope="module")
def tp2(tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """TP2 with megatron-core's Transformer Engine Mamba spec names: the default for Nemotron-H."""
    out = tmp_path_factory.mktemp("nemotron_h_tp2") / "mcore"
    pgconvert.convert(tiny, out, dst_format="megatron", dst_tp=2)
    return out


def _ids() -> torch.Tensor:
    return input_ids(TINY["vocab_size"], seq=12)


def test_tp2_round_trip_is_bit_exact_and_transformers_computes_the_same_logits(tiny: Path, tp2: Path,
                                                                               tmp_path: Path) -> None:
    pgconvert.convert(tp2, tmp_path / "hf", dst_format="hf")

    assert_same_hf_tensors(tiny, tmp_path / "hf")
    written = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert written["layers_block_type"] == TINY["layers_block_type"]
    torch.testing.assert_close(hf_logits(tmp_path / "hf", _ids()), hf_logits(tiny, _ids()), rtol=1e-5, atol=1e-5)


def test_megatron_args_describe_the_hybrid_model_as_pretrain_mamba_does(tp2: Path) -> None:
    state = load_for_test(tp2 / "iter_0000000" / "mp_rank_01" / "model_optim_rng.pt")
    args = state["args"]

    assert (args.hybrid_override_pattern, args.num_layers, args.is_hybrid_model) == (PATTERN, len(PATTERN), True)
    assert (args.mamba_num_heads, args.mamba_head_dim, args.mamba_num_groups, args.mamba_state_dim) == (8, 16, 2, 8)
    assert (args.position_embedding_type, args.squared_relu, args.swiglu) == ("none", True, False)
    assert args.spec == ["megatron.core.models.mamba.mamba_layer_specs", "mamba_stack_spec"]
    assert args.transformer_impl == "transformer_engine"
    model = state["model"]
    # Rank 1 of 2: its half of every segment of in_proj (z, x: 64 rows each; B, C: 8; dt: 4) and of conv1d.
    assert model["decoder.layers.0.mixer.in_proj.weight"].shape == (148, 64)
    assert model["decoder.layers.0.mixer.conv1d.weight"].shape == (80, 1, 4)
    assert model["decoder.layers.0.mixer.A_log"].shape == (4,)
    assert model["decoder.layers.0.mixer.out_proj.weight"].shape == (64, 64)
    assert "decoder.layers.0.mixer.in_proj.layer_norm_weight" in model and "decoder.final_norm.weight" in model


def test_pipeline_stages_cut_the_pattern_and_round_trip_bit_exact(tiny: Path, tmp_path: Path) -> None:
    pgconvert.convert(tiny, tmp_path / "tp2pp2", dst_format="megatron", dst_tp=2, dst_pp=2,
                      dst_transformer_impl="local")
    pgconvert.convert(tmp_path / "tp2pp2", tmp_path / "tp1pp3", dst_tp=1, dst_pp=3,
                      dst_transformer_impl="transformer_engine")
    pgconvert.convert(tmp_path / "tp1pp3", tmp_path / "hf", dst_format="hf")

    assert_same_hf_tensors(tiny, tmp_path / "hf")
    # Stage 1 of 2 holds layers 6..11 (-M*-M-) numbered from 0, and the decoder's final_norm.
    stage = load_for_test(tmp_path / "tp2pp2" / "iter_0000000" / "mp_rank_00_001" / "model_optim_rng.pt")["model"]
    assert "decoder.layers.0.pre_mlp_layernorm.weight" in stage
    assert "decoder.layers.1.mixer.in_proj.weight" in stage
    assert "decoder.layers.2.input_layernorm.weight" in stage
    assert "decoder.final_norm.weight" in stage and "embedding.word_embeddings.weight" not in stage


@pytest.mark.parametrize("layout", [dict(dst_tp=1), dict(dst_tp=2, dst_pp=2)], ids=["tp1", "tp2pp2"])
def test_megatron_cores_mamba_model_loads_every_rank_file_strictly(tiny: Path, tmp_path: Path,
                                                                   layout: dict[str, int]) -> None:
    pytest.importorskip("megatron.core", reason="megatron-core is the client of the megatron format")
    from support.mcore_helpers import rank_files
    from support.mcore_mamba import assert_loads_strictly

    # The local names of the stand-in spec (megatron-core ships a Transformer Engine spec only).
    pgconvert.convert(tiny, tmp_path / "mcore", dst_format="megatron", dst_transformer_impl="local", **layout)

    ranks = rank_files(tmp_path / "mcore")
    assert len(ranks) == layout["dst_tp"] * layout.get("dst_pp", 1)
    for rank in ranks:
        assert_loads_strictly(rank)


@pytest.mark.parametrize("tp", [1, 2])
def test_the_rank_files_compute_transformers_logits(tiny: Path, tmp_path: Path, tp: int) -> None:
    """At TP1 each gated norm spans both groups of the mixer, at TP2 each rank holds one group."""
    pgconvert.convert(tiny, tmp_path / "mcore", dst_format="megatron", dst_tp=tp,
                      dst_transformer_impl="transformer_engine")
    config = json.loads((tiny / "config.json").read_text())

    reference = hybrid_logits(read_megatron_tp_ranks(tmp_path / "mcore"), config, _ids())

    torch.testing.assert_close(reference.to(torch.float32), hf_logits(tiny, _ids()), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("swap", [(1, 2), (3, 4)], ids=["x-B", "C-dt"])
def test_a_rule_that_swaps_two_in_proj_segments_gives_other_logits(tiny: Path, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch,
                                                                   swap: tuple[int, int]) -> None:
    """The knock-out: cut in_proj with two of its segments (z, x, B, C, dt) swapped in the rule (the same
    total rows, so every shape is unchanged) and the rank files no longer compute the model."""
    rows = mamba.in_proj_rows

    def swapped(config: ModelConfig) -> tuple[int, ...]:
        sizes = list(rows(config))
        first, second = swap
        sizes[first], sizes[second] = sizes[second], sizes[first]
        return tuple(sizes)

    monkeypatch.setattr(mamba, "in_proj_rows", swapped)
    pgconvert.convert(tiny, tmp_path / "mcore", dst_format="megatron", dst_tp=2,
                      dst_transformer_impl="transformer_engine")
    config = json.loads((tiny / "config.json").read_text())

    reference = hybrid_logits(read_megatron_tp_ranks(tmp_path / "mcore"), config, _ids())

    assert not torch.allclose(reference.to(torch.float32), hf_logits(tiny, _ids()), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize(("options", "message"), [
    (["--dst-format", "megatron", "--dst-tp", "4"], "--dst-tp 4: num_query_groups=2 is not divisible by 4"),
    (["--dst-format", "megatron", "--dst-pp", "2", "--dst-vpp", "2"],
     "--dst-vpp 2: the hybrid model 'M-M*-M-M*-M-' cannot take a virtual pipeline"),
    (["--dst-format", "megatron", "--dst-pp", "5"], "--dst-pp 5: num_layers=12 is not divisible by 5"),
])
def test_layouts_the_hybrid_model_cannot_take_are_refused_by_name(tiny: Path, tmp_path: Path, options: list[str],
                                                                  message: str) -> None:
    result = CliRunner().invoke(main, [*options, str(tiny), str(tmp_path / "out")])

    assert result.exit_code == 2, result.output
    assert isinstance(result.exception, SystemExit)
    assert message in result.output
    assert not (tmp_path / "out").exists()


def test_a_megatron_checkpoint_without_its_config_json_is_written_as_nemotron_h(tiny: Path, tp2: Path,
                                                                                tmp_path: Path) -> None:
    """The family inferred from the args' hybrid pattern; config.json built from the model alone."""
    bare = tmp_path / "bare"
    shutil.copytree(tp2, bare)
    shutil.rmtree(bare / "hf")

    pgconvert.convert(bare, tmp_path / "hf", dst_format="hf")

    written = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (written["architectures"], written["hybrid_override_pattern"]) == (["NemotronHForCausalLM"], PATTERN)
    assert written["layers_block_type"] == TINY["layers_block_type"]
    # transformers' default chunk_size (128) scans the 12 tokens in one chunk, the source's in two.
    torch.testing.assert_close(hf_logits(tmp_path / "hf", _ids()), hf_logits(tiny, _ids()), rtol=1e-5, atol=1e-5)


def test_the_time_step_clamp_megatron_core_lacks_is_named_carried_and_refused_under_strict(
        tiny: Path, tmp_path: Path) -> None:
    """transformers clamps softplus(dt) at time_step_min (0.001 by default); megatron-core does not clamp."""
    result = CliRunner().invoke(main, ["--dst-format", "megatron", "--dst-tp", "2", str(tiny), str(tmp_path / "mcore")])
    assert result.exit_code == 0, result.output
    assert "time_step_min=0.001" in result.output and "megatron-core has no such setting" in result.output
    args = load_for_test(tmp_path / "mcore" / "iter_0000000" / "mp_rank_00" / "model_optim_rng.pt")["args"]
    assert args.time_step_min == 0.001

    pgconvert.convert(tmp_path / "mcore", tmp_path / "hf", dst_format="hf")
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["time_step_min"] == 0.001

    strict = CliRunner().invoke(main, ["--strict", "--dst-format", "megatron", str(tiny), str(tmp_path / "refused")])
    assert strict.exit_code == 2 and "time_step_min=0.001" in strict.output, strict.output
    assert not (tmp_path / "refused").exists()


def test_a_megatron_model_without_the_clamp_is_written_with_the_clamp_that_clamps_nothing() -> None:
    from pgconvert.families import FAMILIES
    from pgconvert.formats.hf import hf_config_from_model

    family = FAMILIES["NemotronHForCausalLM"]
    config = ModelConfig(num_layers=len(PATTERN), hidden_size=64, num_attention_heads=4, ffn_hidden_size=96,
                         vocab_size=131, hybrid_override_pattern=PATTERN, mamba_head_dim=16, mamba_num_groups=2,
                         mamba_state_dim=8, mamba_num_heads=8, **family.fixed)

    assert config.setting("time_step_min") == 0.0
    assert hf_config_from_model(family, config, torch.bfloat16)["time_step_min"] == 0.0


def test_a_gated_norm_epsilon_megatron_core_fixes_otherwise_is_named_and_refused_under_strict(
        tiny: Path, tmp_path: Path) -> None:
    source = tmp_path / "eps"
    shutil.copytree(tiny, source)
    doc = json.loads((source / "config.json").read_text())
    doc["layer_norm_epsilon"] = 1e-6
    doc["time_step_min"] = 0.0  # no clamp: the epsilon is the one difference
    (source / "config.json").write_text(json.dumps(doc))

    result = CliRunner().invoke(main, ["--dst-format", "megatron", str(source), str(tmp_path / "mcore")])
    assert result.exit_code == 0, result.output
    assert "norm_epsilon=1e-06 in the Mamba layers' gated norm" in result.output

    strict = CliRunner().invoke(main, ["--strict", "--dst-format", "megatron", str(source), str(tmp_path / "refused")])
    assert strict.exit_code == 2 and "Mamba layers' gated norm" in strict.output, strict.output
