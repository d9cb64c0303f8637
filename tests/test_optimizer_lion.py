"""Megatron-LM's Lion, on goldens that Megatron-LM d98e8a64's own training wrote
(``scripts/make_megatron_lm_goldens.py``: TP2 DP2, bf16, two iterations):

- as Muon's scalar optimizer (``--optimizer muon --muon-scalar-optimizer lion``), one run saved in per-rank files and
  in torch_dist: megatron-core chains a Muon optimizer (every 2-dim weight but the word embedding and output layer: an
  fp32 master and a ``momentum_buffer`` each, no step) and a Lion one (the embedding, output layer and norms: an fp32
  master and an ``exp_avg`` each, no step; its groups record ``optimizer: 'lion'`` and Lion's ``betas``);
- as the emerging optimizer itself (``--optimizer lion``): Lion for the 2-dim weights, Adam for the rest, chained as
  Muon's run chains them; in per-rank files (plain) and, with ``--use-distributed-optimizer``, in torch_dist (the
  layer-wise distributed optimizer, ``dp_reshardable``).

``scripts/megatron_lm_resume_check.py muon_lion_tp2dp2_bf16_torch muon_lion_tp2dp2_bf16_torch_dist
lion_tp2dp2_bf16_torch lion_layer_wise_dp_reshardable_torch_dist`` has Megatron-LM resume from pgconvert's conversions
(outside CI)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import torch

import pgconvert
from support.checkpoint_compare import read_common
from support.layer_wise_records import assert_same_layer_wise_records
from support.megatron_fixtures import assert_same_tree, rank_states
from support.optimizer_cli import convert_strict, dcp_read, export_optimizer, float32_and_back, run_cli
from support.torch_dist_forms import FOR_MCORE_016_CLI
from pgconvert.formats import LoadOptions
from pgconvert.formats.torch_dist import read_dcp_metadata
from pgconvert.loaders.torch_dist import TorchDistLoader
from pgconvert.optimizer.order import LION, MUON, ChainMember, OptimizerRules, UnsupportedOptimizerError, chain

GOLDENS = Path(__file__).parent / "data" / "megatron_lm"
PER_RANK = GOLDENS / "train_tp2dp2_muon_lion_bf16_torch"
DIST = GOLDENS / "train_tp2dp2_muon_lion_bf16_torch_dist"  # the same run saved in torch_dist
LION_RUN = GOLDENS / "train_tp2dp2_lion_bf16_torch"  # --optimizer lion
LION_LAYER_WISE = GOLDENS / "train_tp2dp2_lion_layer_wise_dp_reshardable_torch_dist"  # with the distributed optimizer
ITER = "iter_0000002"
LION_GROUPS = [("lion", 1.0), ("lion", 0.0)]  # (optimizer, wd_mult): the embedding and output layer, then the norms


def _records(iteration_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the store (model and optimizer), read whole by torch's own DCP reader."""
    metadata = read_dcp_metadata(iteration_dir / ".metadata").state_dict_metadata
    return dcp_read(iteration_dir, [key for key, md in metadata.items() if hasattr(md, "size")])


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, dict[str, torch.Tensor]]]:
    return {"per-rank": export_optimizer(PER_RANK, tmp_path_factory.mktemp("per_rank")),
            "torch_dist": export_optimizer(DIST, tmp_path_factory.mktemp("dist"))}


def test_the_goldens_are_megatron_lms_muon_and_lion() -> None:
    for state in rank_states(PER_RANK / ITER).values():
        assert state["args"].optimizer == "muon" and state["args"].muon_scalar_optimizer == "lion"
        muon, lion = state["optimizer"]
        assert all(set(entry) == {"momentum_buffer"} for entry in muon["optimizer"]["state"].values())
        assert all(set(entry) == {"exp_avg"} for entry in lion["optimizer"]["state"].values())
        groups = lion["optimizer"]["param_groups"]
        assert [(group["optimizer"], group["wd_mult"]) for group in groups] == LION_GROUPS
        assert [len(group["params"]) for group in groups] == [2, 5] and groups[0]["betas"] == (0.95, 0.98)
    common = read_common(DIST / ITER)["optimizer"]
    assert "state" not in common[1]["optimizer"]  # no common_step: Lion counts no steps
    keys = read_dcp_metadata(DIST / ITER / ".metadata").state_dict_metadata
    assert "optimizer.state.exp_avg.output_layer.weight" in keys
    assert not any(key.startswith("optimizer.state.exp_avg_sq.") for key in keys)


def test_each_parameter_is_read_with_its_own_optimizers_state(exported: dict[str, dict[str, dict[str, torch.Tensor]]]
                                                             ) -> None:
    state = exported["per-rank"]
    lion = sorted(name for name, fields in state.items() if "exp_avg" in fields)
    assert len(lion) == 7 and all(set(state[name]) == {"param", "exp_avg"} for name in lion)
    assert "output_layer.weight" in lion and "embedding.word_embeddings.weight" in lion
    assert all(set(fields) == {"param", "momentum_buffer"} for name, fields in state.items() if name not in lion)
    # one run saved in two formats: the same state, bit for bit
    other = exported["torch_dist"]
    assert sorted(other) == sorted(state)
    for name, fields in state.items():
        assert all(torch.equal(fields[key], other[name][key]) for key in fields), name
    assert pgconvert.verify(PER_RANK, DIST).equal
    inspected = run_cli("inspect", DIST)
    assert inspected.exit_code == 0 and "optimizer   muon and lion, float16, plain: 15 parameters" in inspected.output


def test_a_dtype_change_keeps_lions_state_and_comes_back_bit_exact(tmp_path: Path) -> None:
    fp32, bf16, _ = float32_and_back(PER_RANK, tmp_path)
    _, lion = rank_states(fp32 / ITER)["mp_rank_00"]["optimizer"]  # FP32Optimizer's: no masters beside
    assert all(set(entry) == {"exp_avg"} for entry in lion["state"].values()) and "fp32_from_fp16_params" not in lion
    again = rank_states(bf16 / ITER)
    for rank, state in rank_states(PER_RANK / ITER).items():
        for key in ("optimizer", "model"):
            assert_same_tree(state[key], again[rank][key], f"{rank}.{key}")


@pytest.mark.parametrize("there", [("--dst-tp", "1", "--dst-dp", "1"), ("--dst-tp", "1", "--dst-pp", "2"),
                                   ("--dst-format", "torch_dist", "--dst-tp", "1", *FOR_MCORE_016_CLI)])
def test_per_rank_resharded_and_back_it_is_the_golden(tmp_path: Path, there: tuple[str, ...]) -> None:
    middle = convert_strict(PER_RANK, tmp_path / "there", *there)
    report = pgconvert.verify(PER_RANK, middle)
    assert report.equal, (report.differences, report.optimizer)
    back = convert_strict(middle, tmp_path / "back", "--dst-format", "megatron", "--dst-tp", "2", "--dst-pp", "1",
                          "--dst-dp", "2")
    again = rank_states(back / ITER)
    for rank, state in rank_states(PER_RANK / ITER).items():
        for key in ("optimizer", "opt_param_scheduler"):  # the model: ``verify`` above
            assert_same_tree(state[key], again[rank][key], f"{rank}.{key}")


def test_torch_dist_resharded_and_back_it_is_the_golden(tmp_path: Path) -> None:
    tp1 = convert_strict(DIST, tmp_path / "tp1", "--dst-format", "torch_dist", "--dst-tp", "1", "--dst-pp", "2")
    per_rank = convert_strict(tp1, tmp_path / "per_rank", "--dst-format", "megatron", "--dst-tp", "1", "--dst-pp", "1")
    lion = rank_states(per_rank / ITER)["mp_rank_00"]["optimizer"][1]["optimizer"]
    assert [(group["optimizer"], group["wd_mult"]) for group in lion["param_groups"]] == LION_GROUPS
    back = convert_strict(per_rank, tmp_path / "back", "--dst-format", "torch_dist", "--dst-tp", "2",
                          *FOR_MCORE_016_CLI)
    want, got = _records(DIST / ITER), _records(back / ITER)
    assert sorted(want) == sorted(got)
    assert all(got[key].dtype == tensor.dtype and torch.equal(got[key], tensor) for key, tensor in want.items())
    assert read_common(back / ITER)["optimizer"] == read_common(DIST / ITER)["optimizer"]


def test_the_chain_is_muons_then_the_scalar_optimizers() -> None:
    args = argparse.Namespace(optimizer="muon", muon_scalar_optimizer="lion", bf16=True)
    rules = OptimizerRules.from_args(args, "here")
    assert rules.scalar == LION
    source = TorchDistLoader().open(DIST, LoadOptions())
    assert chain(source.config, source.layout, rules) == (ChainMember(MUON), ChainMember(LION))
    assert ChainMember(LION).fields == ("param", "exp_avg") and not ChainMember(LION).stepped


def test_lion_with_the_layer_wise_optimizer_is_named() -> None:
    # Megatron-LM d98e8a64 saves it only with Apex or Transformer Engine (its DistributedOptimizer reads a per-parameter
    # step that Lion does not keep), so no golden exists here
    args = argparse.Namespace(optimizer="muon", muon_scalar_optimizer="lion", bf16=True,
                              use_layer_wise_distributed_optimizer=True, use_layer_wise_param_layout=True)
    with pytest.raises(UnsupportedOptimizerError, match=r"args.optimizer='muon' with args.muon_scalar_optimizer='lion'"):
        OptimizerRules.from_args(args, "here")


def test_lion_as_the_emerging_optimizer_is_chained_with_adam() -> None:
    for state in rank_states(LION_RUN / ITER).values():
        assert state["args"].optimizer == "lion" and not state["args"].use_layer_wise_distributed_optimizer
        lion, adam = state["optimizer"]
        assert [len(group["params"]) for group in lion["optimizer"]["param_groups"]] == [8]
        assert all(set(entry) == {"exp_avg"} for entry in lion["optimizer"]["state"].values())
        assert [len(group["params"]) for group in adam["optimizer"]["param_groups"]] == [2, 5]
        assert all(set(entry) == {"step", "exp_avg", "exp_avg_sq"} for entry in adam["optimizer"]["state"].values())
    rules = OptimizerRules.from_args(rank_states(LION_RUN / ITER)["mp_rank_00"]["args"], "here")
    assert (rules.kind, rules.scalar, rules.layer_wise) == (LION, "adam", False)
    common = read_common(LION_LAYER_WISE / ITER)
    assert common["args"].use_layer_wise_distributed_optimizer and common["args"].optimizer == "lion"
    keys = read_dcp_metadata(LION_LAYER_WISE / ITER / ".metadata").state_dict_metadata
    assert "chained_0.optimizer.state.exp_avg.decoder.layers.mlp.linear_fc1.weight" in keys


@pytest.mark.parametrize("there", [("--dst-tp", "1", "--dst-dp", "1"), ("--dst-tp", "1", "--dst-pp", "2"),
                                   ("--dst-format", "torch_dist", "--dst-tp", "1", *FOR_MCORE_016_CLI)])
def test_lion_per_rank_resharded_and_back_it_is_the_golden(tmp_path: Path, there: tuple[str, ...]) -> None:
    middle = convert_strict(LION_RUN, tmp_path / "there", *there)
    report = pgconvert.verify(LION_RUN, middle)
    assert report.equal and report.optimizer is not None and report.optimizer.compared == 15, report.differences
    back = convert_strict(middle, tmp_path / "back", "--dst-format", "megatron", "--dst-tp", "2", "--dst-pp", "1",
                          "--dst-dp", "2")
    again = rank_states(back / ITER)
    for rank, state in rank_states(LION_RUN / ITER).items():
        for key in ("optimizer", "opt_param_scheduler"):
            assert_same_tree(state[key], again[rank][key], f"{rank}.{key}")


@pytest.mark.parametrize("there", [("--dst-tp", "1", "--dst-dp", "1"), ("--dst-tp", "1", "--dst-pp", "2"),
                                   ("--dst-tp", "2", "--dst-dp", "2", "--dst-optim-form", "fully_reshardable")])
def test_lion_layer_wise_resharded_and_back_it_is_the_golden(tmp_path: Path, there: tuple[str, ...]) -> None:
    middle = convert_strict(LION_LAYER_WISE, tmp_path / "there", "--dst-format", "torch_dist", *there)
    report = pgconvert.verify(LION_LAYER_WISE, middle)
    assert report.equal and report.optimizer is not None and report.optimizer.compared == 15, report.differences
    back = convert_strict(middle, tmp_path / "back", "--dst-format", "torch_dist", "--dst-tp", "2", "--dst-pp", "1",
                          "--dst-dp", "2", "--dst-optim-form", "dp_reshardable")
    assert_same_layer_wise_records(LION_LAYER_WISE, back)
    assert read_common(back / ITER)["optimizer"] == read_common(LION_LAYER_WISE / ITER)["optimizer"]

