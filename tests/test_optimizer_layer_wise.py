"""Megatron-LM's Muon with the layer-wise distributed optimizer (``--optimizer muon --use-distributed-optimizer``:
``use_layer_wise_distributed_optimizer``), in torch_dist, on two goldens that Megatron-LM d98e8a64's own training wrote
(``scripts/make_megatron_lm_goldens.py``: TP2 DP2, bf16, two iterations), one run saved in each form:

- ``dp_reshardable``: Muon's records ``chained_0.optimizer.state.{fp32_param,momentum_buffer}.<model key>``, Adam's the
  distributed optimizer's flat records ``chained_1.optimizer.distributed.dp_group_idx_<g>...`` over a buffer of the
  embedding, output layer and norms;
- ``fully_reshardable``: the same unprefixed, Adam's ``optimizer.state.{param,exp_avg,exp_avg_sq}.<model key>``.

With MoE (a third golden: TP1 EP2 DP4, 4 experts, bf16, ``dp_reshardable``) the layer-wise optimizer holds the experts
too, in a param group of its own (``is_expert_parallel``) at expert parallel size > 1; the run's state equals that of
the same run with plain Muon bit for bit.

``scripts/megatron_lm_resume_check.py muon_layer_wise_dp_reshardable_torch_dist
muon_layer_wise_fully_reshardable_torch_dist muon_layer_wise_moe_ep2_torch_dist muon_layer_wise_moe_ep2_torch_dist_to_ep4``
has Megatron-LM resume from pgconvert's conversions (outside CI)."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

import pgconvert
from support.checkpoint_compare import read_common, read_dcp_objects
from support.cli_helpers import assert_clean_refusal
from support.layer_wise_records import assert_same_layer_wise_records
from support.optimizer_cli import convert_strict, export_optimizer, run_cli
from support.optimizer_faults import edit_common
from support.torch_dist_forms import FOR_MCORE_016_CLI
from pgconvert.formats.torch_dist import read_dcp_metadata
from pgconvert.optimizer.export import export_from_path
from pgconvert.model.config import ModelConfig
from pgconvert.model.layout import ParallelLayout
from pgconvert.optimizer.order import (OptimizerLayoutError, OptimizerRules, UnsupportedOptimizerError,
                                       layer_wise_target_refusal)

GOLDENS = Path(__file__).parent / "data" / "megatron_lm"
DP = GOLDENS / "train_tp2dp2_muon_layer_wise_dp_reshardable_torch_dist"
FR = GOLDENS / "train_tp2dp2_muon_layer_wise_fully_reshardable_torch_dist"
PLAIN_MUON = GOLDENS / "mcore019_tp2_muon_bf16_torch_dist"
MOE = GOLDENS / "train_tp1ep2dp4_muon_layer_wise_moe_dp_reshardable_torch_dist"
PLAIN_MOE = GOLDENS / "train_tp1ep2dp4_muon_moe_bf16_torch_dist"  # the same run with plain Muon
FORMS = {"dp_reshardable": DP, "fully_reshardable": FR}
ITER = "iter_0000002"
MUON_PARAMS, ADAM_PARAMS = 8, 7


def _optimizer_entry(root: Path) -> dict[Any, Any]:
    return read_common(root / ITER)["optimizer"]


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, dict[str, torch.Tensor]]]:
    return {form: export_optimizer(golden, tmp_path_factory.mktemp(form)) for form, golden in FORMS.items()}


def test_the_goldens_are_megatron_lms_layer_wise_saves(exported: dict[str, Any]) -> None:
    for form, golden in FORMS.items():
        common = read_common(golden / ITER)
        args = common["args"]
        assert args.optimizer == "muon" and args.use_layer_wise_distributed_optimizer
        assert not args.use_distributed_optimizer and args.use_layer_wise_param_layout
        entry = common["optimizer"]
        assert sorted(entry) == [0, 1] and entry[1]["param_state_sharding_type"] == form
        assert common["content_metadata"]["distrib_optim_sharding_type"] == form
        state = exported[form]
        muon = [name for name, fields in state.items() if set(fields) == {"param", "momentum_buffer"}]
        adam = [name for name, fields in state.items() if set(fields) == {"param", "exp_avg", "exp_avg_sq", "step"}]
        assert (len(muon), len(adam)) == (MUON_PARAMS, ADAM_PARAMS) and len(state) == MUON_PARAMS + ADAM_PARAMS
        assert all(float(state[name]["step"]) == 2.0 for name in adam)
        assert all(state[name]["param"].dim() == 2 and "embedding" not in name and "output" not in name
                   for name in muon)


def test_both_forms_of_the_same_run_read_as_the_same_state(exported: dict[str, Any]) -> None:
    # one run, saved twice: dp_reshardable's flat placement and fully_reshardable's model space must agree
    dp, fr = exported["dp_reshardable"], exported["fully_reshardable"]
    assert sorted(dp) == sorted(fr)
    for name, fields in dp.items():
        assert sorted(fields) == sorted(fr[name]), name
        assert all(torch.equal(fields[key], fr[name][key]) for key in fields), name


@pytest.mark.parametrize("form, other", [("dp_reshardable", "fully_reshardable"),
                                         ("fully_reshardable", "dp_reshardable")])
def test_written_in_the_other_form_it_is_megatron_lms_own_save_of_that_form(tmp_path: Path, form: str,
                                                                            other: str) -> None:
    out = convert_strict(FORMS[form], tmp_path / "out", "--dst-format", "torch_dist", "--dst-tp", "2",
                         "--dst-optim-form", other)
    assert_same_layer_wise_records(FORMS[other], out)
    assert _optimizer_entry(out) == _optimizer_entry(FORMS[other])
    content = read_common(out / ITER)["content_metadata"]
    assert content["distrib_optim_sharding_type"] == other and content["chained_optim_avoid_prefix"] is True


@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize("layout", [("--dst-tp", "1", "--dst-dp", "1"), ("--dst-tp", "1", "--dst-pp", "2"),
                                    ("--dst-tp", "1", "--dst-dp", "4")])
def test_resharded_and_back_it_is_the_golden(tmp_path: Path, form: str, layout: tuple[str, ...]) -> None:
    there = convert_strict(FORMS[form], tmp_path / "there", "--dst-format", "torch_dist", *layout)
    assert read_common(there / ITER)["optimizer"][1]["param_state_sharding_type"] == form
    assert pgconvert.verify(FORMS[form], there).equal
    back = convert_strict(there, tmp_path / "back", "--dst-format", "torch_dist", "--dst-tp", "2", "--dst-pp", "1",
                          "--dst-dp", "2")
    assert_same_layer_wise_records(FORMS[form], back)
    assert _optimizer_entry(back) == _optimizer_entry(FORMS[form])


def test_the_dry_run_counts_the_records_written(tmp_path: Path) -> None:
    flags = ("--dst-format", "torch_dist", "--dst-tp", "1", "--dst-dp", "2", "--max-shard-size", "20000")
    result = run_cli("convert", DP, tmp_path / "dry", "--dry-run", *flags)
    assert result.exit_code == 0, result.output
    planned = {line.split()[0]: int(line.split("tensors")[0].split()[-1]) for line in result.output.splitlines()
               if "optimizer records (layer-wise, dp_reshardable" in line}
    assert len(planned) > 1
    out = convert_strict(DP, tmp_path / "out", *flags)
    metadata = read_dcp_metadata(out / ITER / ".metadata")
    stored = {f"{ITER}/{name}": 0 for name in {info.relative_path for info in metadata.storage_data.values()}}
    for info in metadata.storage_data.values():
        stored[f"{ITER}/{info.relative_path}"] += 1
    assert planned == {relpath: count for relpath, count in stored.items() if "__1_" in relpath}


@pytest.mark.parametrize("flags, fragment", [
    (("--dst-format", "megatron"), "with the layer-wise distributed optimizer: its state is written into torch_dist "
                                   "only, not megatron"),
    (("--dst-format", "torch_dist", "--dst-optim-form", "fully_sharded_model_space"),
     "is written as dp_reshardable or fully_reshardable"),
])
def test_what_is_not_carried_is_a_notice_and_refused_under_strict(tmp_path: Path, flags: tuple[str, ...],
                                                                  fragment: str) -> None:
    result = run_cli("convert", DP, tmp_path / "lenient", "--dst-tp", "1", *flags)
    assert result.exit_code == 0 and fragment in " ".join(result.output.split()), result.output
    strict = run_cli("convert", DP, tmp_path / "strict", "-q", "--dst-tp", "1", "--strict", *flags)
    assert_clean_refusal(strict, 2, "--strict: refusing to guess: ")
    assert fragment in " ".join(strict.output.split()) and not (tmp_path / "strict").exists()


def test_another_dtype_carries_the_model_alone_and_says_why(tmp_path: Path) -> None:
    report = pgconvert.convert(DP, tmp_path / "fp32", dst_format="torch_dist", dst_tp=1, dtype="fp32")
    assert any("--dtype float32: a layer-wise run's optimizer state" in note and "bfloat16 only" in note
               for note in report.notices), report.notices
    assert not any(key.startswith(("optimizer.", "chained_")) for key in
                   read_dcp_metadata(tmp_path / "fp32" / ITER / ".metadata").state_dict_metadata)


def test_plain_muon_state_under_layer_wise_args_is_named(tmp_path: Path) -> None:
    src = convert_strict(PLAIN_MUON, tmp_path / "src", "--dst-format", "torch_dist", "--dst-tp", "1",
                         *FOR_MCORE_016_CLI)  # common.pt
    edit_common(src / ITER, lambda common: vars(common["args"]).update(use_layer_wise_distributed_optimizer=True))
    with pytest.raises(OptimizerLayoutError, match=r"optimizer\[1\]\.param_state_sharding_type=None: the layer-wise"):
        export_from_path(src, tmp_path / "export", None)


@pytest.mark.parametrize("setting, name", [({"use_layer_wise_param_layout": False}, "use_layer_wise_param_layout"),
                                           ({"bf16": False}, "bf16")])
def test_a_layer_wise_layout_that_is_not_mapped_is_named(setting: dict[str, object], name: str) -> None:
    args = argparse.Namespace(optimizer="muon", use_layer_wise_distributed_optimizer=True, bf16=True,
                              use_layer_wise_param_layout=True)
    vars(args).update(setting)
    with pytest.raises(UnsupportedOptimizerError, match=rf"args.optimizer='muon' with args.{name}=False"):
        OptimizerRules.from_args(args, "here")
    assert OptimizerRules.from_args(argparse.Namespace(optimizer="muon", use_layer_wise_distributed_optimizer=True,
                                                       bf16=True), "here").layer_wise


def _groups(root: Path) -> list[list[tuple[Any, bool, float]]]:
    """Per chained optimizer of a checkpoint's common state, its groups' (optimizer, is_expert_parallel, wd_mult)."""
    entry = _optimizer_entry(root)
    groups = [entry[0]["optimizer"]["param_groups"]]
    if "optimizer" in entry[1]:  # fully_reshardable: Adam's groups in the common state
        groups.append(entry[1]["optimizer"]["param_groups"])
    else:  # dp_reshardable: in its ShardedObject (one per model-parallel rank: the dense buffer's)
        held = read_dcp_objects(root / ITER, lambda key: key.startswith("chained_1.optimizer.distributed.dp_group_idx_0"
                                                                        ".optimizer/"))
        groups.append(next(iter(held.values()))[0]["param_groups"])
    return [[(group.get("optimizer"), group["is_expert_parallel"], group["wd_mult"]) for group in held]
            for held in groups]


def test_with_moe_the_layer_wise_optimizer_holds_the_experts_in_a_group_of_their_own() -> None:
    common = read_common(MOE / ITER)
    args = common["args"]
    assert args.use_layer_wise_distributed_optimizer and args.expert_model_parallel_size == 2 and args.num_experts == 4
    assert _groups(MOE) == [[(None, False, 1.0), (None, True, 1.0)], [("adam", False, 1.0), ("adam", False, 0.0)]]
    keys = read_dcp_metadata(MOE / ITER / ".metadata").state_dict_metadata
    assert "chained_0.optimizer.state.momentum_buffer.decoder.layers.mlp.experts.experts.linear_fc1.weight" in keys
    # one run, trained with plain Muon and with the layer-wise optimizer: the same state, read from either form
    report = pgconvert.verify(PLAIN_MOE, MOE)
    assert report.equal and report.optimizer is not None and report.optimizer.compared == 29


@pytest.mark.parametrize("layout", [("--dst-ep", "1", "--dst-dp", "4"), ("--dst-ep", "4", "--dst-dp", "4"),
                                    ("--dst-ep", "1", "--dst-pp", "2", "--dst-dp", "2"),
                                    ("--dst-tp", "2", "--dst-ep", "2", "--dst-dp", "2"),
                                    ("--dst-ep", "2", "--dst-dp", "2", "--dst-optim-form", "fully_reshardable")])
def test_with_moe_resharded_and_back_it_is_the_golden(tmp_path: Path, layout: tuple[str, ...]) -> None:
    there = convert_strict(MOE, tmp_path / "there", "--dst-format", "torch_dist", "--dst-tp", "1", *layout)
    experts = "--dst-ep" in layout and layout[layout.index("--dst-ep") + 1] != "1"
    assert _groups(there)[0] == [(None, False, 1.0), (None, True, 1.0)] if experts else [(None, False, 1.0)]
    report = pgconvert.verify(MOE, there)  # the expert group's position is the layout's, its role the same
    assert report.equal, (report.differences, report.optimizer)
    back = convert_strict(there, tmp_path / "back", "--dst-format", "torch_dist", "--dst-tp", "1", "--dst-pp", "1",
                          "--dst-ep", "2", "--dst-dp", "4", "--dst-optim-form", "dp_reshardable")
    assert_same_layer_wise_records(MOE, back)
    assert _optimizer_entry(back) == _optimizer_entry(MOE)


def test_the_experts_biases_under_the_layer_wise_optimizer_are_not_written_at_expert_parallel_above_one() -> None:
    # legal at EP1 (dense parameters of the distributed Adam); at EP > 1 megatron-core asserts the layer-wise path has
    # no expert-parallel scalar optimizer, so such a destination would not load
    rules = OptimizerRules(kind="muon", layer_wise=True)
    config = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=8, ffn_hidden_size=128, num_experts=4,
                         add_bias_linear=True)
    assert layer_wise_target_refusal(rules, config, ParallelLayout(ep=1)) is None
    refused = layer_wise_target_refusal(rules, config, ParallelLayout(ep=2))
    assert refused is not None and "experts' biases at expert parallel size 2" in refused
    assert layer_wise_target_refusal(rules, dataclasses.replace(config, add_bias_linear=False),
                                     ParallelLayout(ep=2)) is None
    assert layer_wise_target_refusal(OptimizerRules(kind="muon"), config, ParallelLayout(ep=2)) is None

