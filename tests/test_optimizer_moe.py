"""Mixture-of-experts optimizer state through TP and EP changes, on state megatron-core laid out.

``mcore_moe_optimizer.py`` (a subprocess) trains the MoE fixture for two AdamW steps with megatron-core's
own param groups (and, for the distributed optimizer, its own ``_ParamAndGradBuffer`` offsets), at
TP2 x EP2: the dense and expert-parallel optimizers chained, as ``get_megatron_optimizer`` builds them.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner, Result
from support.megatron_fixtures import assert_same_tree, load_for_test
from support.moe_optimizer_runs import ITER, assert_round_trip, generate, rank_files

import pgconvert
from pgconvert.cli import main
from pgconvert.formats import LoadOptions
from pgconvert.loaders.megatron import MegatronSource
from pgconvert.formats.megatron import FRAMEWORK_PICKLE, safe_torch_load
from pgconvert.optimizer.order import OptimizerRules, chained_slots

pytest.importorskip("megatron.core", reason="megatron-core lays out the reference optimizer state")


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return generate(tmp_path_factory.mktemp("moe") / "plain", 2, 1, 2, "fp32")


@pytest.fixture(scope="module")
def distributed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return generate(tmp_path_factory.mktemp("moe") / "dist", 2, 1, 2, "distributed")


def _convert(src: Path, dst: Path, *flags: str) -> Result:
    result = CliRunner().invoke(main, ["convert", str(src), str(dst), "-q", *flags], prog_name="pgconvert")
    assert result.exit_code == 0, result.output
    return result


def test_positions_are_megatron_cores_on_every_ep_rank(plain: Path) -> None:
    expected = json.loads((plain.parent / "plain.positions.json").read_text())
    source = MegatronSource(plain / ITER, 2, False, LoadOptions())
    assert len(source.files) == 4
    for coord, path in source.files.items():
        state = safe_torch_load(path)
        chained = chained_slots(source.config, source.layout, coord, OptimizerRules.from_args(state["args"], str(path)),
                                source.vocab_rows)
        derived = [[[slot.spec.local_name for slot in group] for group in groups] for groups in chained]
        assert derived == expected[path.parent.name], path.parent.name
        # Dense: weight decay and no weight decay; experts (EP 2): one group, 3 MoE layers x 4 local experts x 2.
        assert [len(groups) for groups in derived] == [2, 1] and len(derived[1][0]) == 24
        assert isinstance(state["optimizer"], list) and len(state["optimizer"]) == 2


def test_plain_ep2_to_ep1_and_back_is_bit_exact(plain: Path, tmp_path: Path) -> None:
    _convert(plain, tmp_path / "ep1", "--dst-ep", "1")
    merged = rank_files(tmp_path / "ep1")
    assert set(merged) == {"mp_rank_00/model_optim_rng.pt", "mp_rank_01/model_optim_rng.pt"}
    optimizer = merged["mp_rank_00/model_optim_rng.pt"]["optimizer"]  # type: ignore[index]
    # EP 1: the experts are allreduce parameters, in the one optimizer's weight-decay group.
    assert isinstance(optimizer, dict) and [len(g["params"]) for g in optimizer["param_groups"]] == [24 + 48, 9]
    assert not any(g["is_expert_parallel"] for g in optimizer["param_groups"])
    _convert(tmp_path / "ep1", tmp_path / "back", "--dst-ep", "2")
    assert_round_trip(plain, tmp_path / "back")


def test_verify_matches_param_groups_by_what_they_hold_across_an_ep_change(plain: Path, tmp_path: Path) -> None:
    # EP 2 chains a dense and an expert optimizer, EP 1 has one: the same groups at other positions.
    _convert(plain, tmp_path / "ep1", "--dst-ep", "1")

    report = pgconvert.verify(plain, tmp_path / "ep1")

    assert report.optimizer is not None and report.optimizer.status == "compared"
    assert report.equal, [difference.message for difference in report.optimizer.differences]
    edited = Path(shutil.copytree(tmp_path / "ep1", tmp_path / "edited"))
    for path in edited.glob(f"{ITER}/mp_rank_*/model_optim_rng.pt"):  # every rank, as a changed run would
        state = load_for_test(path)
        state["optimizer"]["param_groups"][0]["lr"] = 0.125  # the group that holds the experts at EP 1
        torch.save(state, path, pickle_module=FRAMEWORK_PICKLE)
    differences = pgconvert.verify(plain, edited).optimizer.differences  # type: ignore[union-attr]
    assert [(difference.name, difference.field) for difference in differences] == [
        ("optimizer[0].param_groups[0].lr", "lr"), ("optimizer[1].param_groups[0].lr", "lr")]
    assert all(difference.message.endswith(", …)") and "0.125 in B" in difference.message
               for difference in differences)


def test_bf16_ep2_to_ep1_and_back_is_bit_exact(tmp_path: Path) -> None:
    # Float16OptimizerWithFloat16Params: the fp32 masters (fp32_from_fp16_params) of both chained optimizers.
    source = generate(tmp_path / "bf16", 2, 1, 2, "bf16")
    _convert(source, tmp_path / "ep1", "--dst-ep", "1", "--dst-tp", "1")
    optimizer = rank_files(tmp_path / "ep1")["mp_rank_00/model_optim_rng.pt"]["optimizer"]  # type: ignore[index]
    assert [len(group) for group in optimizer["fp32_from_fp16_params"]] == [24 + 48, 9]
    _convert(tmp_path / "ep1", tmp_path / "back", "--dst-ep", "2", "--dst-tp", "2")
    assert_round_trip(source, tmp_path / "back")


def test_an_optimizer_list_that_does_not_match_the_layout_is_a_named_error(plain: Path, tmp_path: Path) -> None:
    shutil.copytree(plain, tmp_path / "src")
    path = tmp_path / "src" / ITER / "mp_rank_01_001" / "model_optim_rng.pt"
    state = load_for_test(path)
    state["optimizer"] = state["optimizer"][0]
    torch.save(state, path)
    result = CliRunner().invoke(main, ["convert", str(tmp_path / "src"), str(tmp_path / "out"), "-q", "--dst-ep", "1"],
                                prog_name="pgconvert")
    assert result.exit_code == 1, result.output
    assert "mp_rank_01_001/model_optim_rng.pt: optimizer holds one optimizer, but megatron-core 0.16.1" in result.output
    assert "chains 2" in result.output and "Traceback" not in result.output and not (tmp_path / "out").exists()


def test_plain_tp_and_ep_change_together_and_back_is_bit_exact(plain: Path, tmp_path: Path) -> None:
    _convert(plain, tmp_path / "tp1ep4", "--dst-tp", "1", "--dst-ep", "4")
    (state,) = [v for k, v in rank_files(tmp_path / "tp1ep4").items() if k.startswith("mp_rank_00_003")]
    assert [len(g["params"]) for g in state["optimizer"][1]["param_groups"]] == [12]  # type: ignore[index]
    _convert(tmp_path / "tp1ep4", tmp_path / "back", "--dst-tp", "2", "--dst-ep", "2")
    assert_round_trip(plain, tmp_path / "back")


def test_distributed_ep2_tp2_to_one_rank_and_back_is_bit_exact(distributed: Path, tmp_path: Path) -> None:
    # Reading it at all checks pgconvert's flat offsets against megatron-core's _ParamAndGradBuffer: every
    # parameter's fp32 master at its derived range must round to the model weight of that name.
    _convert(distributed, tmp_path / "one", "--dst-tp", "1", "--dst-ep", "1")
    one = rank_files(tmp_path / "one")
    assert isinstance(one["mp_rank_00/distrib_optim.pt"], dict)
    _convert(tmp_path / "one", tmp_path / "back", "--dst-tp", "2", "--dst-ep", "2")
    source = rank_files(distributed)
    assert source["mp_rank_00_001/distrib_optim.pt"][0] is None  # type: ignore[index]
    assert_round_trip(distributed, tmp_path / "back")


def test_distributed_and_plain_exports_of_the_ep_change_agree(distributed: Path, tmp_path: Path) -> None:
    # The per-parameter form is layout-independent: EP2 x TP2 and its EP4 x TP1 conversion export the same.
    _convert(distributed, tmp_path / "ep4", "--dst-tp", "1", "--dst-ep", "4")
    exported = []
    for name, src in (("a", distributed), ("b", tmp_path / "ep4")):
        result = CliRunner().invoke(main, ["export-optimizer", str(src), str(tmp_path / name)], prog_name="pgconvert")
        assert result.exit_code == 0, result.output
        exported.append({p.name: torch.load(p, weights_only=True) for p in sorted((tmp_path / name).glob("*.pt"))})
    assert set(exported[0]) == set(exported[1])
    assert "decoder.layers.3.mlp.experts.local_experts.7.linear_fc2.weight.pt" in exported[0]
    for name, tensors in exported[0].items():
        assert_same_tree(tensors, exported[1][name], name)


def test_plain_pp2_and_back_is_bit_exact(plain: Path, tmp_path: Path) -> None:
    _convert(plain, tmp_path / "pp2", "--dst-tp", "1", "--dst-pp", "2")
    stage1 = rank_files(tmp_path / "pp2")["mp_rank_00_001_001/model_optim_rng.pt"]["optimizer"]  # type: ignore[index]
    # Stage 1 (layers 2, 3: both MoE) of EP rank 1: 2 layers x 4 local experts x 2 weights.
    assert [len(g["params"]) for g in stage1[1]["param_groups"]] == [16]
    _convert(tmp_path / "pp2", tmp_path / "back", "--dst-tp", "2", "--dst-pp", "1")
    assert_round_trip(plain, tmp_path / "back")


def test_distributed_vpp2_and_back_is_bit_exact(distributed: Path, tmp_path: Path) -> None:
    _convert(distributed, tmp_path / "vpp", "--dst-tp", "1", "--dst-vpp", "2")
    dense, experts = rank_files(tmp_path / "vpp")["mp_rank_00_000/distrib_optim.pt"]  # type: ignore[misc]
    # One buffer per model chunk, dense and expert-parallel alike (both chunks hold MoE layers).
    assert sorted(k for k in dense if k != "buckets_coalesced") == [0, 1]
    assert sorted(k for k in experts if k != "buckets_coalesced") == [0, 1]
    _convert(tmp_path / "vpp", tmp_path / "back", "--dst-tp", "2", "--dst-vpp", "1")
    # --dst-vpp 1 names the one chunk model0: the optimizer entries and flat buffers are compared.
    assert_round_trip(distributed, tmp_path / "back", ("optimizer", "iteration"))


def test_ep1_pp2_positions_are_megatron_cores_and_reach_ep2(tmp_path: Path) -> None:
    # At EP 1 the experts are allreduce parameters: one optimizer, experts in its weight-decay group.
    source = generate(tmp_path / "ep1pp2", 1, 2, 1, "fp32")
    expected = json.loads((tmp_path / "ep1pp2.positions.json").read_text())
    loaded = MegatronSource(source / ITER, 2, False, LoadOptions())
    for coord, path in loaded.files.items():
        chained = chained_slots(loaded.config, loaded.layout, coord, padded_vocab_size=loaded.vocab_rows)
        derived = [[[slot.spec.local_name for slot in group] for group in groups] for groups in chained]
        assert derived == expected[path.parent.name] and len(derived) == 1, path.parent.name
    _convert(source, tmp_path / "ep2", "--dst-pp", "1", "--dst-ep", "2")
    _convert(tmp_path / "ep2", tmp_path / "back", "--dst-pp", "2", "--dst-ep", "1")
    assert_round_trip(source, tmp_path / "back")


def test_a_plain_moe_optimizer_goes_into_torch_dist_in_the_plain_form_only(plain: Path, tmp_path: Path) -> None:
    # megatron-core's plain optimizers (a MoE run's chained pair too) have a torch_dist form of
    # their own, written as such (tests/test_optimizer_torch_dist_plain.py checks the records); asked for a
    # distributed-optimizer form, the state is not carried: named, refused under --strict.
    args = ["convert", str(plain), str(tmp_path / "td"), "--dst-format", "torch_dist", "--dst-tp", "1", "--dst-ep", "1"]
    loose = CliRunner().invoke(main, args, prog_name="pgconvert")
    assert loose.exit_code == 0, loose.output
    assert "scheduler, iteration, floating-point operations and consumed samples carried" in loose.output
    assert (tmp_path / "td" / "iter_0000002" / "__1_0.distcp").is_file()
    strict = CliRunner().invoke(main, [*args[:2], str(tmp_path / "dp"), *args[3:], "--strict", "--dst-optim-form",
                                       "dp_reshardable"], prog_name="pgconvert")
    assert strict.exit_code == 2 and "Traceback" not in strict.output, strict.output
    assert not (tmp_path / "dp").exists()
