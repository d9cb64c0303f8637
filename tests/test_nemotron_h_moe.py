"""Nemotron-H with MoE layers (``E``: Nemotron 3 Nano's routed experts with one shared expert, a sigmoid router
with ``e_score_correction_bias``, renormalized top-k scaled by ``routed_scaling_factor``, relu2 experts).

The tiny model is ``support.nemotron_h_models``'s ``TINY_MOE``, built by transformers. Checked:

1. HF -> per-rank Megatron (TP1, TP2×EP2, TP2×PP2×EP2) -> HF is bit-exact, and the written config.json
   computes the original logits; every expert lands at its global index;
2. megatron-core 0.16.1's MambaModel (``support.mcore_mamba``: its MoE spec with local modules) loads every rank
   file with ``strict=True``, and its MoELayer computes transformers' NemotronHMoE output from the converted
   weights and args (a knock-out of the scaling factor moves it);
3. torch_dist: the keys MambaModel's ``sharded_state_dict()`` declares, megatron-core's ``dist_checkpointing.load``
   of pgconvert's output at TP2×EP2 and TP1×PP2×EP2 (one gloo job), pgconvert reading what megatron-core saved,
   and round trips;
4. what NemotronHMoE or megatron-core cannot compute is refused by name.
"""

from __future__ import annotations

import copy
import json
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file
from support.checkpoint_compare import read_common
from support.hf_helpers import assert_same_hf_tensors, hf_logits, input_ids, read_megatron_tp_ranks
from support.mamba_reference import hybrid_logits
from support.nemotron_h_models import MOE_PATTERN, TINY_MOE, write_tiny_nemotron_h_moe
from support.torch_dist_forms import FOR_MCORE_016
from support.megatron_fixtures import load_for_test

import pgconvert
from pgconvert.cli import main
from pgconvert.errors import ConfigError
from pgconvert.families import FAMILIES
from pgconvert.formats.hf import require_family_fits
from pgconvert.model.config import ModelConfig

with warnings.catch_warnings():
    warnings.simplefilter("ignore", UserWarning)
    pytest.importorskip("megatron.core", reason="megatron-core is the client of the megatron formats")
    from support.mcore_gpt_models import read_layout, sharded_layout
    from support.mcore_helpers import RankLayout, cpu_forward_patches, fake_group_queries, rank_files
    from support.mcore_mamba import (assert_loaded_is_rank, assert_loads_strictly, build_mamba_model,
                                     mamba_sharded_state_dict)
    from support.mcore_torch_dist_job import run_job

ITERATION_DIR = "iter_0000000"
# The local spec's names with SequentialMLP experts: what megatron-core's stand-in MambaModel holds.
LOCAL = dict(dst_transformer_impl="local", dst_expert_layout="sequential")
EXPERTS = TINY_MOE["n_routed_experts"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_nemotron_h_moe(tmp_path_factory.mktemp("nemotron_h_moe") / "hf")


@pytest.fixture(scope="module")
def rank_files_at(tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """pgconvert's local-spec rank files of the tiny model at a TP×PP×EP, each layout converted once."""
    made: dict[tuple[int, int, int], Path] = {}

    def at(tp: int = 1, pp: int = 1, ep: int = 1) -> Path:
        if (tp, pp, ep) not in made:
            made[(tp, pp, ep)] = tmp_path_factory.mktemp(f"moe_ranks_tp{tp}pp{pp}ep{ep}") / "mcore"
            pgconvert.convert(tiny, made[(tp, pp, ep)], dst_format="megatron", dst_tp=tp, dst_pp=pp, dst_ep=ep,
                              **LOCAL)
        return made[(tp, pp, ep)]

    return at


def _ids() -> torch.Tensor:
    return input_ids(TINY_MOE["vocab_size"], seq=12)


def _hf_tensors(directory: Path) -> dict[str, torch.Tensor]:
    return {key: value for path in directory.glob("*.safetensors") for key, value in load_file(path).items()}


# --------------------------------------------------------------------------- 1. HF <-> per-rank Megatron


@pytest.mark.parametrize("layout", [dict(dst_tp=1), dict(dst_tp=2, dst_ep=2), dict(dst_tp=2, dst_pp=2, dst_ep=2)],
                         ids=["tp1", "tp2ep2", "tp2pp2ep2"])
def test_round_trip_through_megatron_is_bit_exact_and_computes_the_same_logits(
        tiny: Path, tmp_path: Path, layout: dict[str, int]) -> None:
    """The default (megatron-core's TE Mamba spec: TEGroupedMLP experts) written, resharded to TP1 in the
    local spec's SequentialMLP names, and back to HF."""
    pgconvert.convert(tiny, tmp_path / "mcore", dst_format="megatron", **layout)
    pgconvert.convert(tmp_path / "mcore", tmp_path / "tp1", dst_tp=1, dst_ep=1, **LOCAL)
    pgconvert.convert(tmp_path / "tp1", tmp_path / "hf", dst_format="hf")

    assert_same_hf_tensors(tiny, tmp_path / "hf")
    written = json.loads((tmp_path / "hf" / "config.json").read_text())
    for key in ("layers_block_type", "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size",
                "moe_shared_expert_intermediate_size", "routed_scaling_factor", "n_group", "topk_group"):
        assert written[key] == TINY_MOE[key], key
    torch.testing.assert_close(hf_logits(tmp_path / "hf", _ids()), hf_logits(tiny, _ids()), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layout", [dict(dst_tp=1, dst_ep=2), dict(dst_tp=2, dst_ep=2)], ids=["tp1ep2", "tp2ep2"])
def test_the_rank_files_compute_transformers_logits(tiny: Path, tmp_path: Path, layout: dict[str, int]) -> None:
    """An independent forward (``support.mamba_reference``, float64) over the TP-sharded, EP-joined rank files of
    megatron-core's TE Mamba spec (grouped experts)."""
    pgconvert.convert(tiny, tmp_path / "mcore", dst_format="megatron", **layout)
    config = json.loads((tiny / "config.json").read_text())

    reference = hybrid_logits(read_megatron_tp_ranks(tmp_path / "mcore"), config, _ids())

    torch.testing.assert_close(reference.to(torch.float32), hf_logits(tiny, _ids()), rtol=1e-5, atol=1e-5)


def test_the_args_describe_the_moe_layers_as_megatron_lm_records_them(tiny: Path, tmp_path: Path) -> None:
    pgconvert.convert(tiny, tmp_path / "mcore", dst_format="megatron", dst_tp=2, dst_ep=2)
    state = load_for_test(tmp_path / "mcore" / ITERATION_DIR / "mp_rank_01_001" / "model_optim_rng.pt")
    args, model = state["args"], state["model"]

    assert (args.hybrid_override_pattern, args.num_experts, args.moe_router_topk) == (MOE_PATTERN, 8, 4)
    assert (args.moe_ffn_hidden_size, args.moe_shared_expert_intermediate_size) == (32, 64)
    assert (args.moe_router_score_function, args.moe_router_enable_expert_bias) == ("sigmoid", True)
    assert (args.moe_router_topk_scaling_factor, args.moe_router_num_groups) == (2.5, None)
    assert (args.moe_grouped_gemm, args.transformer_impl, args.squared_relu) == (True, "transformer_engine", True)
    assert (args.expert_model_parallel_size, args.expert_tensor_parallel_size) == (2, 2)
    # Layer 1 (E): TP rank 1's half of experts 4..7 (TEGroupedMLP: weight0..3) and of the shared expert.
    assert model["decoder.layers.1.mlp.experts.linear_fc1.weight3"].shape == (16, 64)
    assert model["decoder.layers.1.mlp.shared_experts.linear_fc2.weight"].shape == (64, 32)
    assert model["decoder.layers.1.mlp.router.expert_bias"].dtype == torch.float32
    assert "decoder.layers.1.pre_mlp_layernorm.weight" in model


def test_every_moe_tensor_is_transformers_own_at_its_global_expert_index(
        tiny: Path, rank_files_at: Callable[..., Path]) -> None:
    """TP1×EP2: the EP ranks joined by global expert index are transformers' tensors, one to one."""
    megatron, = read_megatron_tp_ranks(rank_files_at(ep=2))
    hf = _hf_tensors(tiny)

    for layer in (i for i, symbol in enumerate(MOE_PATTERN) if symbol == "E"):
        hf_layer, mc_layer = f"backbone.layers.{layer}.", f"decoder.layers.{layer}."
        pairs = {"norm.weight": "pre_mlp_layernorm.weight", "mixer.gate.weight": "mlp.router.weight",
                 "mixer.gate.e_score_correction_bias": "mlp.router.expert_bias",
                 "mixer.shared_experts.up_proj.weight": "mlp.shared_experts.linear_fc1.weight",
                 "mixer.shared_experts.down_proj.weight": "mlp.shared_experts.linear_fc2.weight"}
        for expert in range(EXPERTS):
            pairs[f"mixer.experts.{expert}.up_proj.weight"] = f"mlp.experts.local_experts.{expert}.linear_fc1.weight"
            pairs[f"mixer.experts.{expert}.down_proj.weight"] = f"mlp.experts.local_experts.{expert}.linear_fc2.weight"
        for hf_name, mc_name in pairs.items():
            assert torch.equal(megatron[mc_layer + mc_name], hf[hf_layer + hf_name].to(torch.float64)), mc_name


def test_a_megatron_checkpoint_without_its_config_json_is_written_as_nemotron_h_with_its_experts(
        tiny: Path, rank_files_at: Callable[..., Path], tmp_path: Path) -> None:
    bare = tmp_path / "bare"
    shutil.copytree(rank_files_at(tp=2, ep=2), bare)
    shutil.rmtree(bare / "hf")

    pgconvert.convert(bare, tmp_path / "hf", dst_format="hf")

    written = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (written["architectures"], written["hybrid_override_pattern"]) == (["NemotronHForCausalLM"], MOE_PATTERN)
    assert (written["n_routed_experts"], written["num_experts_per_tok"], written["norm_topk_prob"]) == (8, 4, True)
    assert (written["routed_scaling_factor"], written["moe_shared_expert_intermediate_size"]) == (2.5, 64)
    assert_same_hf_tensors(tiny, tmp_path / "hf")
    torch.testing.assert_close(hf_logits(tmp_path / "hf", _ids()), hf_logits(tiny, _ids()), rtol=1e-5, atol=1e-5)


def test_grouped_routing_and_an_integer_scaling_factor_are_carried_both_ways(tiny: Path, tmp_path: Path) -> None:
    """n_group=4, topk_group=2 with 4 experts per token: megatron-core scores a group by its best 4 // 2 = 2
    experts, transformers by its top-2 sum: the same routing."""
    source = _edited(tiny, tmp_path, n_group=4, topk_group=2, routed_scaling_factor=2)

    pgconvert.convert(source, tmp_path / "mcore", dst_format="megatron", dst_ep=2)
    pgconvert.convert(tmp_path / "mcore", tmp_path / "hf", dst_format="hf")

    args = load_for_test(tmp_path / "mcore" / ITERATION_DIR / "mp_rank_00_000" / "model_optim_rng.pt")["args"]
    assert (args.moe_router_num_groups, args.moe_router_group_topk, args.moe_router_topk_scaling_factor) == (4, 2, 2.0)
    written = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (written["n_group"], written["topk_group"], written["routed_scaling_factor"]) == (4, 2, 2.0)


def test_the_expert_count_under_transformers_alias_num_local_experts_is_read(tiny: Path) -> None:
    from pgconvert.formats.hf import model_config_from_hf

    doc = json.loads((tiny / "config.json").read_text())
    doc["num_local_experts"] = doc.pop("n_routed_experts")

    _, config, _ = model_config_from_hf(doc, Path("config.json"))

    assert config.moe.num_experts == 8


# --------------------------------------------------------------------------- 2. megatron-core's MambaModel


@pytest.mark.parametrize("layout", [dict(tp=1), dict(tp=2, pp=2, ep=2)], ids=["tp1", "tp2pp2ep2"])
def test_megatron_cores_mamba_model_loads_every_rank_file_strictly(rank_files_at: Callable[..., Path],
                                                                   layout: dict[str, int]) -> None:
    ranks = rank_files(rank_files_at(**layout))
    assert len(ranks) == layout["tp"] * layout.get("pp", 1) * layout.get("ep", 1)
    for rank in ranks:
        loaded = assert_loads_strictly(rank)
        assert any(".mlp.experts.local_experts." in name for name in loaded), rank.path


def _moe_outputs(tiny: Path, rank_dir: Path, edit_args: Callable[[Any], None] | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(megatron-core's MoELayer output, transformers' NemotronHMoE output) of layer 1 for the same input."""
    from transformers import AutoModelForCausalLM

    rank, = rank_files(rank_dir)
    args = copy.copy(rank.args)
    if edit_args is not None:
        edit_args(args)
    model = build_mamba_model(args, rank.layout)
    model.load_state_dict(rank.model, strict=True)
    reference = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()
    hidden = torch.randn(2, 12, TINY_MOE["hidden_size"], generator=torch.Generator().manual_seed(7))
    with torch.no_grad(), cpu_forward_patches(), fake_group_queries():
        output, bias = model.decoder.layers[1].mlp(hidden.transpose(0, 1).contiguous())
        expected = reference.model.layers[1].mixer(hidden)
    assert bias is None
    return output.transpose(0, 1), expected


def test_megatron_cores_moe_layer_computes_transformers_moe_output(tiny: Path,
                                                                   rank_files_at: Callable[..., Path]) -> None:
    """megatron-core's router (sigmoid, expert bias, renormalized top-k, scaling), relu2 experts and shared
    expert, built from the written args, compute NemotronHMoE's output (fp32)."""
    output, expected = _moe_outputs(tiny, rank_files_at())

    torch.testing.assert_close(output, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("name", "value"), [("moe_router_topk_scaling_factor", None), ("moe_router_topk", 2)])
def test_an_args_setting_knocked_out_moves_megatron_cores_moe_output(
        tiny: Path, rank_files_at: Callable[..., Path], name: str, value: object) -> None:
    output, expected = _moe_outputs(tiny, rank_files_at(), lambda args: setattr(args, name, value))

    assert not torch.allclose(output, expected, rtol=1e-3, atol=1e-3)


# --------------------------------------------------------------------------- 3. torch_dist


def test_torch_dist_keys_shapes_and_chunks_are_what_megatron_cores_mamba_model_declares(
        tiny: Path, tmp_path: Path) -> None:
    """The TE spec's TEGroupedMLP experts and the local SequentialMLP's are stored under the same keys."""
    for name, options in (("grouped", {}), ("sequential", LOCAL)):
        pgconvert.convert(tiny, tmp_path / name, dst_format="torch_dist", **options, **FOR_MCORE_016)
    args = read_common(tmp_path / "sequential" / ITERATION_DIR)["args"]
    model = build_mamba_model(args, RankLayout(1, 1, 0, 0))
    expected_tensors, expected_objects = sharded_layout(mamba_sharded_state_dict(model))
    assert "decoder.layers.1.mlp.router.expert_bias" in expected_tensors

    for name in ("grouped", "sequential"):
        tensors, objects = read_layout(tmp_path / name / ITERATION_DIR)
        assert sorted(tensors) == sorted(expected_tensors), name
        for key, (shape, dtype, chunks) in expected_tensors.items():
            assert tensors[key] == (shape, dtype, chunks), (name, key)
        if name == "sequential":
            assert objects == expected_objects


# (name, tp, pp, ep): pgconvert writes each layout and megatron-core loads it at that layout.
DIST_CASES = [("tp2ep2", 2, 1, 2), ("tp1pp2ep2", 1, 2, 2)]


@pytest.fixture(scope="module")
def loaded_by_megatron_core(tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One megatron-core job of 4 gloo ranks loads every case's checkpoint."""
    root = tmp_path_factory.mktemp("moe_hybrid_loads")
    cases = []
    for name, tp, pp, ep in DIST_CASES:
        pgconvert.convert(tiny, root / name, dst_format="torch_dist", dst_tp=tp, dst_pp=pp, dst_ep=ep, **LOCAL,
                          **FOR_MCORE_016)
        cases.append({"name": name, "ckpt": str(root / name / ITERATION_DIR), "tp": tp, "pp": pp, "ep": ep})
    run_job({"action": "hybrid_load", "world": 4, "cases": cases}, root / "job")
    return root / "job"


@pytest.mark.parametrize(("name", "tp", "pp", "ep"), DIST_CASES, ids=[case[0] for case in DIST_CASES])
def test_megatron_core_loads_pgconvert_torch_dist_strictly_with_every_value_in_place(
        loaded_by_megatron_core: Path, rank_files_at: Callable[..., Path], name: str, tp: int, pp: int,
        ep: int) -> None:
    for rank in rank_files(rank_files_at(tp=tp, pp=pp, ep=ep)):
        place = rank.layout
        assert_loaded_is_rank(
            loaded_by_megatron_core / f"{name}_rank_{place.tp_rank}_{place.pp_rank}_{place.ep_rank}.pt", rank)


def test_a_torch_dist_megatron_cores_mamba_model_saved_at_tp2_ep2_reads_back_bit_exact(
        tiny: Path, rank_files_at: Callable[..., Path], tmp_path: Path) -> None:
    saved = tmp_path / "mcore"
    (saved / "iter_0000100").mkdir(parents=True)
    (saved / "latest_checkpointed_iteration.txt").write_text("100")
    run_job({"action": "hybrid_save", "world": 4, "source": str(rank_files_at(tp=2, ep=2)),
             "ckpt": str(saved / "iter_0000100")}, tmp_path / "job")

    pgconvert.convert(saved, tmp_path / "hf", dst_format="hf")
    pgconvert.convert(saved, tmp_path / "dist", dst_format="torch_dist", dst_tp=1, dst_pp=2, dst_ep=1)
    pgconvert.convert(tmp_path / "dist", tmp_path / "hf_again", dst_format="hf")

    assert_same_hf_tensors(tiny, tmp_path / "hf")
    assert_same_hf_tensors(tiny, tmp_path / "hf_again")


# --------------------------------------------------------------------------- 4. refusals


def _edited(tiny: Path, tmp_path: Path, **changes: object) -> Path:
    source = tmp_path / "edited"
    shutil.copytree(tiny, source)
    doc = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps({**doc, **changes}))
    return source


@pytest.mark.parametrize(("changes", "message"), [
    ({"norm_topk_prob": False}, "norm_topk_prob=False: megatron-core renormalizes the chosen sigmoid scores"),
    ({"moe_latent_size": 16}, "moe_latent_size=16: latent expert projections"),
    ({"num_experts_per_tok": 1}, "num_experts_per_tok=1: transformers renormalizes the one chosen score"),
    ({"n_group": 4, "topk_group": 1}, "n_group=4, topk_group=1 with num_experts_per_tok=4: transformers scores a "
                                      "group by its best 2 expert(s), megatron-core by its best"),
    ({"n_group": 3, "topk_group": 1}, "n_group=3, topk_group=1: the groups must divide n_routed_experts=8"),
], ids=["norm_topk_prob", "latent", "top1", "group_score", "groups"])
def test_moe_settings_megatron_core_cannot_compute_are_refused_by_name(tiny: Path, tmp_path: Path,
                                                                       changes: dict[str, object],
                                                                       message: str) -> None:
    source = _edited(tiny, tmp_path, **changes)

    result = CliRunner().invoke(main, ["--dst-format", "megatron", str(source), str(tmp_path / "out")])

    assert result.exit_code != 0 and not isinstance(result.exception, (AssertionError, TypeError)), result.output
    assert message in result.output, result.output
    assert not (tmp_path / "out").exists()


def test_an_expert_parallel_size_that_does_not_divide_the_experts_is_refused_while_planning(
        tiny: Path, tmp_path: Path) -> None:
    result = CliRunner().invoke(main, ["--dst-format", "torch_dist", "--dst-ep", "3", str(tiny),
                                       str(tmp_path / "out")])

    assert result.exit_code == 2, result.output
    assert "--dst-ep 3: num_experts=8 is not divisible by 3" in result.output
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(("changes", "message"), [
    ({"moe_router_score_function": "softmax", "moe_router_enable_expert_bias": False},
     "moe_router_score_function='softmax' (needs 'sigmoid'), moe_router_enable_expert_bias=False (needs True)"),
    ({"moe_shared_expert_intermediate_size": None},
     "moe_shared_expert_intermediate_size=None (NemotronHMoE always has a shared expert)"),
    ({"moe_shared_expert_gate": True}, "moe_shared_expert_gate=True (needs False)"),
    ({"hybrid_override_pattern": "M*M*-M*M*-", "moe_shared_expert_intermediate_size": None,
      "moe_router_score_function": "softmax", "moe_router_enable_expert_bias": False},
     "num_experts=8 (needs E layers in the pattern)"),
], ids=["softmax", "no_shared", "shared_gate", "experts_without_E"])
def test_a_megatron_moe_model_nemotron_h_cannot_compute_is_refused_by_name(changes: dict[str, object],
                                                                          message: str) -> None:
    settings: dict[str, Any] = dict(
        num_layers=len(MOE_PATTERN), hidden_size=64, num_attention_heads=4, ffn_hidden_size=96, vocab_size=131,
        hybrid_override_pattern=MOE_PATTERN, mamba_head_dim=16, mamba_num_groups=2, mamba_state_dim=8,
        mamba_num_heads=8, num_experts=8, moe_ffn_hidden_size=32, moe_router_topk=4,
        moe_shared_expert_intermediate_size=64, moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True, moe_router_topk_scaling_factor=2.5)
    family = FAMILIES["NemotronHForCausalLM"]
    fixed = {name: value for name, value in family.fixed.items() if name != "hybrid_override_pattern"}
    config = ModelConfig.from_settings({**fixed, **settings, **changes})

    with pytest.raises(ConfigError, match="cannot be written as NemotronHForCausalLM") as refused:
        require_family_fits(family, config, "hf")
    assert message in str(refused.value)
