"""Megatron-LM's plain Muon optimizer (``--optimizer muon`` without the distributed optimizer), on two goldens:

- torch_dist, megatron-core 0.19.2's own save (``scripts/make_muon_golden.py``: TP2 on gloo CPU ranks, two steps);
  the same script has megatron-core 0.19.2 load pgconvert's output at TP1 and TP2 and hold the golden's state
  (``load DIR TP``, outside CI: CI has megatron-core 0.16.1, which has no Muon);
- per-rank files, Megatron-LM d98e8a64's own training saves (``scripts/make_megatron_lm_goldens.py``, TP2 DP2, two
  iterations), one with ``--decoupled-lr``; ``scripts/megatron_lm_resume_check.py muon_tp2dp2_bf16_torch`` has
  Megatron-LM resume from pgconvert's TP1 conversion of the other (outside CI).

megatron-core chains a Muon optimizer (every 2-dim weight but the word embedding and output layer: an fp32 master
and a ``momentum_buffer`` each, no step) and an Adam one (the embedding, output layer and norms); a rank file's
``optimizer`` is the list of the two."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

import pgconvert
from support.checkpoint_compare import read_common
from support.cli_helpers import assert_clean_refusal
from support.megatron_fixtures import assert_same_tree, rank_states
from support.optimizer_cli import convert_strict, dcp_read, export_optimizer, float32_and_back, run_cli
from support.optimizer_faults import edit_common, edit_rank_files
from support.torch_dist_forms import FOR_MCORE_016_CLI
from pgconvert.formats.torch_dist import read_dcp_metadata
from pgconvert.optimizer.export import export_from_path
from pgconvert.optimizer.order import UnsupportedOptimizerError

GOLDEN = Path(__file__).parent / "data" / "megatron_lm" / "mcore019_tp2_muon_bf16_torch_dist"
PER_RANK = Path(__file__).parent / "data" / "megatron_lm" / "train_tp2dp2_muon_bf16_torch"
# The same run with --decoupled-lr 5e-4 --decoupled-min-lr 5e-5
DECOUPLED = Path(__file__).parent / "data" / "megatron_lm" / "train_tp2dp2_muon_decoupled_lr_bf16_torch"
ITER = "iter_0000002"
FC1 = "decoder.layers.mlp.linear_fc1.weight"
ADAM_KEYS = {"param", "exp_avg", "exp_avg_sq", "step"}


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, torch.Tensor]]:
    return export_optimizer(GOLDEN, tmp_path_factory.mktemp("export"))


def _assert_same_records(expected: Path, actual: Path, count: int | None = None) -> None:
    """Two torch_dist iterations hold the same records (``count`` of them, if given), dtype and bits."""
    want, got = _records(expected), _records(actual)
    assert set(want) == set(got) and count in (None, len(want))
    for key, tensor in want.items():
        assert got[key].dtype == tensor.dtype and torch.equal(got[key], tensor), key


def _records(iteration_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the store (model and optimizer), read whole by torch's own DCP reader."""
    metadata = read_dcp_metadata(iteration_dir / ".metadata").state_dict_metadata
    return dcp_read(iteration_dir, [key for key, md in metadata.items() if hasattr(md, "size")])


def test_the_golden_is_megatron_core_0_19s_chained_muon_and_adam() -> None:
    common = read_common(GOLDEN / ITER)
    muon, adam = (common["optimizer"][index]["optimizer"] for index in (0, 1))
    assert set(muon) == {"param_groups"} and [group["momentum"] for group in muon["param_groups"]] == [0.9]
    assert float(adam["state"]["common_step"]) == 2.0
    assert [group["wd_mult"] for group in adam["param_groups"]] == [1.0, 0.0]
    keys = set(read_dcp_metadata(GOLDEN / ITER / ".metadata").state_dict_metadata)
    momentum = {key for key in keys if key.startswith("optimizer.state.momentum_buffer.")}
    assert len(momentum) == 4 and "optimizer.state.momentum_buffer." + FC1 in momentum  # the stacked 2-dim weights
    assert "optimizer.state.exp_avg.output_layer.weight" in keys and "optimizer.state.exp_avg." + FC1 not in keys


def test_each_parameter_is_read_with_its_own_optimizers_state(exported: dict[str, dict[str, torch.Tensor]]) -> None:
    muon = sorted(name for name, tensors in exported.items() if "momentum_buffer" in tensors)
    assert len(muon) == 8 and all(set(exported[name]) == {"param", "momentum_buffer"} for name in muon)
    adam = [name for name in exported if name not in muon]
    assert sorted(adam)[:2] == ["decoder.final_layernorm.weight", "decoder.layers.0.input_layernorm.weight"]
    assert all(set(exported[name]) == ADAM_KEYS and float(exported[name]["step"]) == 2.0 for name in adam)
    # the records as torch's DCP reader gives them (layers stacked; fc1's global tensor is [gate; up])
    held = dcp_read(GOLDEN / ITER, [FC1, "optimizer.state.momentum_buffer." + FC1, "optimizer.state.fp32_param." + FC1])
    for layer in range(2):
        tensors = exported[f"decoder.layers.{layer}.mlp.linear_fc1.weight"]
        assert torch.equal(tensors["momentum_buffer"], held["optimizer.state.momentum_buffer." + FC1][layer])
        assert torch.equal(tensors["param"], held["optimizer.state.fp32_param." + FC1][layer])
        assert torch.equal(tensors["param"].bfloat16(), held[FC1][layer])  # the master rounds to the weight
        assert tensors["momentum_buffer"].abs().min() > 0  # two steps of non-zero gradients


def test_other_layouts_give_megatron_cores_records_back_bit_for_bit(tmp_path: Path) -> None:
    tp1 = convert_strict(GOLDEN, tmp_path / "tp1", "--dst-format", "torch_dist", "--dst-tp", "1", *FOR_MCORE_016_CLI)
    pp2 = convert_strict(tp1, tmp_path / "pp2", "--dst-format", "torch_dist", "--dst-pp", "2")
    back = convert_strict(pp2, tmp_path / "back", "--dst-format", "torch_dist", "--dst-tp", "2", "--dst-pp", "1")
    _assert_same_records(GOLDEN / ITER, back / ITER, 32)
    expected, written = read_common(GOLDEN / ITER)["optimizer"], read_common(back / ITER)["optimizer"]
    assert written[0] == expected[0]  # Muon's groups, no step
    assert written[1]["optimizer"]["param_groups"] == expected[1]["optimizer"]["param_groups"]
    assert torch.equal(written[1]["optimizer"]["state"]["common_step"], expected[1]["optimizer"]["state"]["common_step"])
    result = pgconvert.verify(GOLDEN, pp2)
    assert result.equal and result.optimizer is not None, result.differences[:5]
    inspected = run_cli("inspect", GOLDEN)
    assert "muon and adam, float16, plain: 15 parameters checked" in inspected.output, inspected.output


def test_a_destination_that_writes_adam_only_names_the_muon_state(tmp_path: Path) -> None:
    result = run_cli("convert", GOLDEN, tmp_path / "fsdp", "--dst-format", "fsdp_dtensor")
    assert result.exit_code == 0, result.output
    assert "args.optimizer='muon': its state is written into megatron, torch_dist only, not fsdp_dtensor" in \
        " ".join(result.output.split())
    strict = run_cli("convert", GOLDEN, tmp_path / "strict", "--dst-format", "fsdp_dtensor", "--strict")
    assert strict.exit_code != 0 and not (tmp_path / "strict").exists()


# the layer-wise distributed optimizer's legacy layout (every parameter in its own buffer), a scalar optimizer other
# than Adam under it (Lion: Megatron-LM saves it only with Apex or Transformer Engine)
@pytest.mark.parametrize("setting, name", [
    ({"use_layer_wise_distributed_optimizer": True, "use_layer_wise_param_layout": False},
     "use_layer_wise_param_layout"),
    ({"use_layer_wise_distributed_optimizer": True, "muon_scalar_optimizer": "lion"}, "muon_scalar_optimizer")])
def test_a_muon_run_whose_layout_is_not_mapped_is_named(setting: dict[str, object], name: str,
                                                        tmp_path: Path) -> None:
    src = convert_strict(GOLDEN, tmp_path / "src", "--dst-format", "torch_dist", *FOR_MCORE_016_CLI)
    edit_common(src / ITER, lambda common: vars(common["args"]).update(setting))
    assert_clean_refusal(run_cli("export-optimizer", src, tmp_path / "export"), 2, "args.optimizer='muon'",
                         "--skip-optimizer")
    with pytest.raises(UnsupportedOptimizerError, match=rf"args.optimizer='muon' with .*{name}"):
        export_from_path(src, tmp_path / "again", None)


def test_the_per_rank_golden_is_megatron_lms_list_of_muon_and_adam() -> None:
    for state in rank_states(PER_RANK / ITER).values():
        muon, adam = state["optimizer"]
        assert state["args"].optimizer == "muon" and not state["args"].use_layer_wise_distributed_optimizer
        assert [len(group["params"]) for group in muon["optimizer"]["param_groups"]] == [8]
        assert all(set(entry) == {"momentum_buffer"} for entry in muon["optimizer"]["state"].values())
        assert [len(group["params"]) for group in adam["optimizer"]["param_groups"]] == [2, 5]
        assert all(set(entry) == ADAM_KEYS - {"param"} for entry in adam["optimizer"]["state"].values())
        assert [len(group) for group in muon["fp32_from_fp16_params"]] == [8]


def test_per_rank_muon_state_is_the_tp_pieces_joined_and_round_trips_bit_exact(tmp_path: Path) -> None:
    tp1 = convert_strict(PER_RANK, tmp_path / "tp1", "--dst-tp", "1", "--dst-dp", "1")
    back = convert_strict(tp1, tmp_path / "back", "--dst-tp", "2", "--dst-dp", "2")
    ranks, merged = rank_states(PER_RANK / ITER), rank_states(tp1 / ITER)["mp_rank_00"]
    muon = merged["optimizer"][0]["optimizer"]["state"]
    pieces = [ranks[f"mp_rank_0{tp}"]["optimizer"][0]["optimizer"]["state"] for tp in (0, 1)]
    # Muon's positions: layer 0's linear_proj (row parallel), linear_qkv, fc1 (gate and up), fc2
    assert torch.equal(muon[0]["momentum_buffer"], torch.cat([piece[0]["momentum_buffer"] for piece in pieces], 1))
    gate = [piece[2]["momentum_buffer"].chunk(2) for piece in pieces]
    assert torch.equal(muon[2]["momentum_buffer"], torch.cat([gate[0][0], gate[1][0], gate[0][1], gate[1][1]]))
    again = rank_states(back / ITER)
    assert set(again) == set(ranks) == {"mp_rank_00", "mp_rank_01"}
    for rank, state in ranks.items():
        for key in ("optimizer", "opt_param_scheduler", "num_floating_point_operations_so_far", "model"):
            assert_same_tree(state[key], again[rank][key], f"{rank}.{key}")
    assert pgconvert.verify(PER_RANK, tp1).equal


def test_per_rank_and_torch_dist_muon_state_convert_into_each_other_bit_exact(tmp_path: Path) -> None:
    dist = convert_strict(PER_RANK, tmp_path / "dist", "--dst-format", "torch_dist", "--dst-tp", "1",
                          *FOR_MCORE_016_CLI)
    back = convert_strict(dist, tmp_path / "back", "--dst-format", "megatron", "--dst-tp", "2")
    for rank, state in rank_states(PER_RANK / ITER).items():
        assert_same_tree(state["optimizer"], rank_states(back / ITER)[rank]["optimizer"], rank)
    # megatron-core 0.19.2's own torch_dist save, through per-rank files and back: its records again
    per_rank = convert_strict(GOLDEN, tmp_path / "per_rank", "--dst-format", "megatron", "--dst-tp", "1")
    assert len(rank_states(per_rank / ITER)["mp_rank_00"]["optimizer"]) == 2
    again = convert_strict(per_rank, tmp_path / "again", "--dst-format", "torch_dist", "--dst-tp", "2",
                           *FOR_MCORE_016_CLI)
    _assert_same_records(GOLDEN / ITER, again / ITER)


def test_decoupled_learning_rates_are_adams_first_group_at_every_layout(tmp_path: Path) -> None:
    tp1 = convert_strict(DECOUPLED, tmp_path / "tp1", "--dst-tp", "1", "--dst-dp", "1")
    muon, adam = (entry["optimizer"]["param_groups"] for entry in rank_states(tp1 / ITER)["mp_rank_00"]["optimizer"])
    assert [(group["max_lr"], group["min_lr"], len(group["params"])) for group in adam] == [(5e-4, 5e-5, 2),
                                                                                        (1e-3, 1e-4, 5)]
    assert [(group["max_lr"], len(group["params"])) for group in muon] == [(1e-3, 8)]
    dist = convert_strict(tp1, tmp_path / "dist", "--dst-format", "torch_dist", "--dst-pp", "2", *FOR_MCORE_016_CLI)
    back = convert_strict(dist, tmp_path / "back", "--dst-format", "megatron", "--dst-tp", "2", "--dst-pp", "1",
                          "--dst-dp", "2")
    again = rank_states(back / ITER)
    for rank, state in rank_states(DECOUPLED / ITER).items():
        assert_same_tree(state["optimizer"], again[rank]["optimizer"], rank)


def test_a_muon_runs_adam_groups_that_are_not_its_decoupled_ones_are_named(tmp_path: Path) -> None:
    src = tmp_path / "src"
    shutil.copytree(DECOUPLED, src)
    # not the max_lr the embedding and output layer's group holds
    edit_rank_files(src, lambda state: setattr(state["args"], "decoupled_lr", 2e-4))
    assert_clean_refusal(run_cli("export-optimizer", src, tmp_path / "export"), 1,
                         "optimizer[1]: optimizer.param_groups[0]", "max_lr=0.0005", "(wd_mult=1.0, max_lr=0.0002")


def test_a_dtype_change_keeps_the_masters_and_momentum_and_comes_back_bit_exact(tmp_path: Path) -> None:
    fp32, bf16, said = float32_and_back(PER_RANK, tmp_path)
    assert "the model's weights are the optimizer's fp32 master weights" in said, said
    merged = rank_states(fp32 / ITER)["mp_rank_00"]
    muon, adam = merged["optimizer"]  # FP32Optimizer's: the torch optimizers' state dicts, the weights their masters
    assert set(muon) == set(adam) == {"state", "param_groups"}
    assert all(set(entry) == {"momentum_buffer"} for entry in muon["state"].values())
    exported = export_optimizer(PER_RANK, tmp_path / "export")
    for name, weight in merged["model"].items():
        if name in exported:
            assert weight.dtype == torch.float32 and torch.equal(weight, exported[name]["param"]), name
    again = rank_states(bf16 / ITER)
    for rank, state in rank_states(PER_RANK / ITER).items():
        for key in ("optimizer", "model"):
            assert_same_tree(state[key], again[rank][key], f"{rank}.{key}")
    # megatron-core 0.19.2's torch_dist save through float32 and back: its records again
    wide = run_cli("convert", GOLDEN, tmp_path / "td32", "--dst-format", "torch_dist", "--dtype", "fp32",
                   "--dst-tp", "1", *FOR_MCORE_016_CLI)
    assert wide.exit_code == 0, wide.output
    common = read_common(tmp_path / "td32" / ITER)["optimizer"]  # FP32Optimizer's: no fp32_param records
    assert set(common[0]) == {"param_groups"} and set(common[1]) == {"param_groups", "state"}
    assert not any(".fp32_param." in key for key in _records(tmp_path / "td32" / ITER))
    back = run_cli("convert", tmp_path / "td32", tmp_path / "td16", "--dst-format", "torch_dist", "--dtype", "bf16",
                   "--dst-tp", "2", *FOR_MCORE_016_CLI)
    assert back.exit_code == 0, back.output
    _assert_same_records(GOLDEN / ITER, tmp_path / "td16" / ITER)
