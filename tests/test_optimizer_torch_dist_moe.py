"""A MoE model's chained optimizer state through torch_dist (fully_reshardable form), on state megatron-core
laid out (``mcore_moe_optimizer.py``: TP2 x EP2, the dense and expert-parallel distributed optimizers chained).

megatron-core 0.16.1's ``ChainedOptimizer.sharded_state_dict`` (optimizer.py) with Megatron-LM's
``chained_optim_avoid_prefix``: no key prefix for fully_reshardable; ``{0: dense, 1: expert}`` in the common state.
"""

from __future__ import annotations

import json
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner, Result

from support.cli_helpers import assert_clean_refusal
from support.megatron_fixtures import assert_same_tree, load_for_test
from support.moe_optimizer_runs import ITER, assert_optimizer_files_equal, generate, optimizer_records, rank_files
from support.torch_dist_forms import FOR_MCORE_016_CLI
from support.checkpoint_compare import read_common
from pgconvert.cli import main
from pgconvert.formats.torch_dist import read_dcp_metadata

pytest.importorskip("megatron.core", reason="megatron-core lays out the reference optimizer state")


FIELDS = ("param", "exp_avg", "exp_avg_sq")


@pytest.fixture(scope="module")
def distributed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return generate(tmp_path_factory.mktemp("moe_torch_dist") / "dist", 2, 1, 2, "distributed")


def _cli(*args: str | Path) -> Result:
    return CliRunner().invoke(main, [str(arg) for arg in args], prog_name="pgconvert")


def _convert(src: Path, dst: Path, *flags: str) -> None:
    result = _cli("convert", src, dst, "-q", "--strict", *flags, *FOR_MCORE_016_CLI)
    assert result.exit_code == 0, result.output


def _export(src: Path, out: Path) -> dict[str, dict[str, torch.Tensor]]:
    result = _cli("export-optimizer", src, out)
    assert result.exit_code == 0, result.output
    return {path.stem: torch.load(path, weights_only=True) for path in sorted(out.glob("*.pt"))}


def test_per_rank_ep2_to_torch_dist_and_back_is_bit_exact(distributed: Path, tmp_path: Path) -> None:
    _convert(distributed, tmp_path / "td", "--dst-format", "torch_dist")
    common = read_common(tmp_path / "td" / ITER)
    # ChainedOptimizer.sharded_state_dict: {0: dense, 1: expert}, each a DistributedOptimizer's common part.
    assert sorted(common["optimizer"]) == [0, 1]
    assert [len(entry["optimizer"]["param_groups"]) for entry in common["optimizer"].values()] == [2, 1]
    assert {entry["param_state_sharding_type"] for entry in common["optimizer"].values()} == {"fully_reshardable"}
    assert [g["is_expert_parallel"] for e in common["optimizer"].values() for g in e["optimizer"]["param_groups"]] \
        == [False, False, True]
    stored = read_dcp_metadata(tmp_path / "td" / ITER / ".metadata").state_dict_metadata
    expert_key = "optimizer.state.exp_avg.decoder.layers.3.mlp.experts.experts.linear_fc2.weight"
    assert [key for key in stored if key.startswith("optimizer.") and "expert_bias" in key] == []
    _convert(tmp_path / "td", tmp_path / "back", "--dst-format", "megatron", "--dst-tp", "2", "--dst-ep", "2")
    assert_optimizer_files_equal(distributed, tmp_path / "back")
    # an expert record: the model key's global expert axis (8 experts) and shape
    assert list(stored[expert_key].size) == list(stored[expert_key[len("optimizer.state.exp_avg."):]].size) == [8, 64, 64]


def test_torch_dist_ep1_tp1_holds_one_optimizer_and_reaches_ep2_again(distributed: Path, tmp_path: Path) -> None:
    _convert(distributed, tmp_path / "td", "--dst-format", "torch_dist", "--dst-tp", "1", "--dst-ep", "1")
    common = read_common(tmp_path / "td" / ITER)
    # EP 1: the experts are allreduce parameters, in the one (dense) optimizer: no chaining.
    assert common["optimizer"]["param_state_sharding_type"] == "fully_reshardable"
    assert len(common["optimizer"]["optimizer"]["param_groups"]) == 2
    original = _export(distributed, tmp_path / "original")
    exported = _export(tmp_path / "td", tmp_path / "td_export")
    assert set(original) == set(exported) and "decoder.layers.3.mlp.experts.local_experts.7.linear_fc2.weight" in original
    for name, tensors in original.items():
        assert_same_tree(tensors, exported[name], name)
    # torch_dist EP1 -> per-rank EP1 -> per-rank EP2 TP2: the original files again
    _convert(tmp_path / "td", tmp_path / "ep1", "--dst-format", "megatron")
    one = rank_files(tmp_path / "ep1")["mp_rank_00/model_optim_rng.pt"]["optimizer"]  # type: ignore[index]
    assert isinstance(one, dict) and [len(g) for g in [one["optimizer"]["param_groups"]]] == [2]
    _convert(tmp_path / "ep1", tmp_path / "back", "--dst-tp", "2", "--dst-ep", "2")
    assert_optimizer_files_equal(distributed, tmp_path / "back")


def test_torch_dist_ep2_to_per_rank_ep1_and_back_through_torch_dist(distributed: Path, tmp_path: Path) -> None:
    _convert(distributed, tmp_path / "td", "--dst-format", "torch_dist")
    _convert(tmp_path / "td", tmp_path / "ep1", "--dst-format", "megatron", "--dst-tp", "1", "--dst-ep", "1")
    state = rank_files(tmp_path / "ep1")["mp_rank_00/distrib_optim.pt"]
    assert isinstance(state, dict)  # one optimizer at EP 1
    _convert(tmp_path / "ep1", tmp_path / "td2", "--dst-format", "torch_dist", "--dst-tp", "2", "--dst-ep", "2")
    _convert(tmp_path / "td2", tmp_path / "back", "--dst-format", "megatron")
    assert_optimizer_files_equal(distributed, tmp_path / "back")


def test_per_rank_ep2_to_dp_reshardable_at_its_own_layout_and_back_is_bit_exact(distributed: Path,
                                                                               tmp_path: Path) -> None:
    # TP2 x EP2 x DP2 (expert data-parallel size 1): the chained optimizers' chained_<i>.-prefixed records,
    # the expert ones per TP x EP rank (data_parallel_group_idx tp + 2 * ep)
    _convert(distributed, tmp_path / "td", "--dst-format", "torch_dist", "--dst-optim-form", "dp_reshardable",
             "--dst-dp", "2")
    common = read_common(tmp_path / "td" / ITER)
    assert common["optimizer"] == {index: {"param_state_sharding_type": "dp_reshardable"} for index in (0, 1)}
    stored = read_dcp_metadata(tmp_path / "td" / ITER / ".metadata").state_dict_metadata
    groups = {key.split(".optimizer.distributed.")[0] + "." + key.split(".")[3] for key in stored
              if key.startswith("chained_")}
    assert groups == {"chained_0.dp_group_idx_0", "chained_0.dp_group_idx_1", *(f"chained_1.dp_group_idx_{g}"
                                                                               for g in range(4))}
    _convert(tmp_path / "td", tmp_path / "back", "--dst-format", "megatron")
    assert_optimizer_files_equal(distributed, tmp_path / "back")


def test_dp_reshardable_moe_at_pp2_vpp2_counts_only_the_chunks_holding_experts(distributed: Path,
                                                                              tmp_path: Path) -> None:
    # layer 1 is dense, so stage 1's first model chunk has no expert_parallel_buffers: its expert optimizer's
    # only buffer is gbuf_idx_0 (the chunk of layer 3); the expert records per tp + tp_size * (ep + ep_size * pp)
    _convert(distributed, tmp_path / "td", "--dst-format", "torch_dist", "--dst-optim-form", "dp_reshardable",
             "--dst-tp", "1", "--dst-pp", "2", "--dst-vpp", "2", "--dst-dp", "2")
    stored = read_dcp_metadata(tmp_path / "td" / ITER / ".metadata").state_dict_metadata
    buffers = {".".join(key.split(".")[3:5]) for key in stored if key.startswith("chained_1.") and "gbuf_idx" in key}
    assert buffers == {"dp_group_idx_0.gbuf_idx_0", "dp_group_idx_0.gbuf_idx_1", "dp_group_idx_1.gbuf_idx_0",
                       "dp_group_idx_1.gbuf_idx_1", "dp_group_idx_2.gbuf_idx_0", "dp_group_idx_3.gbuf_idx_0"}
    _convert(tmp_path / "td", tmp_path / "back", "--dst-format", "megatron", "--dst-tp", "2", "--dst-pp", "1",
             "--dst-ep", "2")
    assert_optimizer_files_equal(distributed, tmp_path / "back")


def test_a_chained_entry_missing_is_a_named_error(distributed: Path, tmp_path: Path) -> None:
    _convert(distributed, tmp_path / "td", "--dst-format", "torch_dist")
    path = tmp_path / "td" / ITER / "common.pt"
    common = load_for_test(path)
    common["optimizer"] = common["optimizer"][0]  # the dense optimizer's entry alone, at EP 2
    torch.save(common, path, pickle_module=pickle)
    result = _cli("convert", tmp_path / "td", tmp_path / "out", "--dst-format", "megatron")
    assert_clean_refusal(result, 1, "common state", "optimizer holds 1 optimizer(s)", "chains 2")
    assert not (tmp_path / "out").exists()
    shutil.rmtree(tmp_path / "td")


def test_megatron_core_declares_loads_and_saves_back_the_same_records(distributed: Path, tmp_path: Path) -> None:
    # megatron-core 0.16.1 on four gloo ranks (TP2 x EP2): its ChainedOptimizer.sharded_state_dict declares the
    # records pgconvert wrote (keys, global shapes), dist_checkpointing.load reads them, and its own
    # fully_reshardable save of the loaded state holds the same records and param groups, bit for bit.
    _convert(distributed, tmp_path / "td", "--dst-format", "torch_dist")
    script = Path(__file__).parent / "support" / "mcore_moe_fully_reshardable.py"
    done = subprocess.run([sys.executable, "-W", "ignore", str(script), str(tmp_path / "td" / ITER), str(tmp_path / "mc")],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    ours = optimizer_records(tmp_path / "td" / ITER)
    stored = read_dcp_metadata(tmp_path / "td" / ITER / ".metadata").state_dict_metadata
    declared: dict[str, list[int]] = {}
    for rank in range(4):
        report = json.loads((tmp_path / "mc" / f"rank{rank}.json").read_text())
        assert report["chained"] == 2 and sorted(report["structure"]) == ["int:0", "int:1"]
        declared.update(report["declared"])
    assert declared == {key: list(stored[key].size) for key in ours}
    theirs = optimizer_records(tmp_path / "mc" / "saved")
    assert set(theirs) == set(ours) and len(ours) == 117
    for key, tensor in ours.items():
        assert theirs[key].dtype == tensor.dtype and torch.equal(theirs[key], tensor), key
    saved_common = read_common(tmp_path / "mc" / "saved")
    assert saved_common["optimizer"] == read_common(tmp_path / "td" / ITER)["optimizer"]


def test_a_fully_reshardable_moe_source_labelled_dp_reshardable_is_a_named_error(distributed: Path,
                                                                                tmp_path: Path) -> None:
    # a MoE run's dp_reshardable state is read from its chained_<i>.-prefixed records: here there are none
    _convert(distributed, tmp_path / "td", "--dst-format", "torch_dist")
    path = tmp_path / "td" / ITER / "common.pt"
    common = load_for_test(path)
    for entry in common["optimizer"].values():
        entry["param_state_sharding_type"] = "dp_reshardable"
    torch.save(common, path, pickle_module=pickle)
    result = _cli("convert", tmp_path / "td", tmp_path / "out", "--dst-format", "megatron", "--strict")
    assert_clean_refusal(result, 1, "no stored object", "chained_0.optimizer.distributed.dp_group_idx_0.optimizer")
    assert not (tmp_path / "out").exists()
