"""The distributed optimizer written into a torch_dist destination in megatron-core's
``dp_reshardable`` form (Megatron-LM's default), checked record by record against Megatron-LM's own
goldens (tests/data/megatron_lm/README.md) as torch's DCP reader reads them."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from support.cli_helpers import assert_clean_refusal
from support.dp_records import (FULLY, GOLDENS, ITERATION, OWN_LAYOUT, TP2DP2, TP2PP2, assert_golden_records_equal,
                                convert_to_torch_dist, optimizer_entries)
from support.megatron_fixtures import load_for_test
from support.optimizer_cli import run_cli
from support.checkpoint_compare import read_common
from pgconvert.errors import ValidationError
from pgconvert.formats import LoadOptions
from pgconvert.formats.registry import get_loader


@pytest.mark.parametrize("golden", [TP2DP2, TP2PP2], ids=["tp2dp2", "tp2pp2"])
def test_the_goldens_own_layout_is_written_as_megatron_core_writes_it(tmp_path: Path, golden: Path) -> None:
    convert_to_torch_dist(golden, tmp_path / "out", *OWN_LAYOUT[golden])  # default form: the source's
    assert_golden_records_equal(golden, tmp_path / "out")
    common = read_common(tmp_path / "out" / ITERATION)
    reference = get_loader("torch_dist").open(golden, LoadOptions())
    expected = {"param_state_sharding_type": "dp_reshardable"}
    assert common["optimizer"] == reference.common_state["optimizer"] == expected
    assert common["content_metadata"] == reference.common_state["content_metadata"]
    assert common["args"].data_parallel_size == reference.megatron_args.data_parallel_size
    assert common["iteration"] == 2 and common["opt_param_scheduler"] == reference.common_state["opt_param_scheduler"]
    reference.close()


@pytest.mark.parametrize("golden", [TP2DP2, TP2PP2], ids=["tp2dp2", "tp2pp2"])
def test_tp1_dp_reshardable_and_back_is_bit_exact(tmp_path: Path, golden: Path) -> None:
    convert_to_torch_dist(golden, tmp_path / "tp1", "--dst-tp", "1", "--dst-pp", "1", "--dst-optim-form", "dp_reshardable")
    common = read_common(tmp_path / "tp1" / ITERATION)
    assert common["optimizer"]["param_state_sharding_type"] == "dp_reshardable"
    keys = optimizer_entries(tmp_path / "tp1" / ITERATION)
    assert {key.split(".")[2] for key in keys} == {"dp_group_idx_0"}  # one model-parallel rank
    convert_to_torch_dist(tmp_path / "tp1", tmp_path / "back", *OWN_LAYOUT[golden])
    assert_golden_records_equal(golden, tmp_path / "back")


def test_a_fully_reshardable_run_written_dp_reshardable_equals_megatron_cores_dp_reshardable(tmp_path: Path) -> None:
    # The same seeded run saved by Megatron-LM in both forms: converting one into the other's form
    # gives the other's records.
    convert_to_torch_dist(FULLY, tmp_path / "default", "--dst-tp", "1")
    assert read_common(tmp_path / "default" / ITERATION)["optimizer"][
        "param_state_sharding_type"] == "fully_reshardable"
    convert_to_torch_dist(FULLY, tmp_path / "dp", *OWN_LAYOUT[TP2DP2], "--dst-optim-form", "dp_reshardable")
    assert_golden_records_equal(TP2DP2, tmp_path / "dp")


def test_an_invalid_form_or_use_is_a_named_error(tmp_path: Path) -> None:
    import pgconvert

    result = run_cli("convert", TP2DP2, tmp_path / "a", "--dst-format", "torch_dist", "--dst-optim-form", "bucket_space")
    assert_clean_refusal(result, 2, "--dst-optim-form", "bucket_space", "fully_reshardable", "dp_reshardable")
    with pytest.raises(ValidationError, match="--dst-optim-form 'bucket_space': must be one of fully_reshardable, "
                                              "dp_reshardable"):
        pgconvert.convert(TP2DP2, tmp_path / "b", dst_format="torch_dist", dst_optim_form="bucket_space")
    result = run_cli("convert", TP2DP2, tmp_path / "c", "--dst-format", "megatron", "--dst-optim-form", "dp_reshardable")
    assert_clean_refusal(result, 2, "--dst-optim-form dp_reshardable: applies to a torch_dist destination, "
                                    "not megatron")
    result = run_cli("convert", TP2DP2, tmp_path / "d", "--dst-format", "torch_dist", "--dst-optim-form",
                  "dp_reshardable", "--skip-optimizer")
    assert_clean_refusal(result, 2, "drop --skip-optimizer or --dst-optim-form")
    # megatron-core cannot save a DP shard that holds no parameter ("empty bucket encountered")
    result = run_cli("convert", TP2DP2, tmp_path / "e", "--dst-format", "torch_dist", "--dst-dp", "64")
    assert_clean_refusal(result, 2, "data-parallel rank 63 of 64 holds no parameter", "empty bucket encountered")
    assert not any((tmp_path / name).exists() for name in "abcde")


def test_megatron_core_loads_the_written_dp_reshardable_state_at_dp1_and_dp2(tmp_path: Path) -> None:
    """megatron-core's DistributedOptimizer (0.16.1, gloo processes on the CPU) loads pgconvert's TP1
    dp_reshardable records with dist_checkpointing.load, as Megatron-LM's load_checkpoint does, and
    holds exactly the golden's per-parameter state, whole at DP1 and sliced over two DP ranks."""
    import subprocess
    import sys

    pytest.importorskip("megatron.core", reason="megatron-core's own load is the check")
    convert_to_torch_dist(TP2DP2, tmp_path / "tp1", "--dst-tp", "1", "--dst-optim-form", "dp_reshardable")
    result = run_cli("export-optimizer", TP2DP2, tmp_path / "reference")
    assert result.exit_code == 0, result.output
    script = Path(__file__).parent / "support" / "mcore_dp_reshardable_load.py"
    for dp in (1, 2):
        out = tmp_path / f"dp{dp}"
        subprocess.run([sys.executable, str(script), str(tmp_path / "tp1" / ITERATION), str(out), str(dp)],
                       check=True, timeout=600)
        covered: dict[str, int] = {}
        for rank in range(dp):
            result = torch.load(out / f"rank{rank}.pt", weights_only=True)
            assert result["group_steps"] == [2.0, 2.0]  # the param groups' step, from the .optimizer object
            loaded = result["loaded"]
            for name, (offset, tensors) in loaded.items():
                expected = torch.load(tmp_path / "reference" / f"{name}.pt", weights_only=True)
                for key in ("param", "exp_avg", "exp_avg_sq"):
                    whole = expected[key].reshape(-1)
                    assert torch.equal(tensors[key], whole[offset:offset + tensors[key].numel()]), f"{name}.{key}"
                covered[name] = covered.get(name, 0) + tensors["param"].numel()
        reference = {path.stem: torch.load(path, weights_only=True)["param"].numel()
                     for path in (tmp_path / "reference").glob("*.pt")}
        assert covered == reference  # every element loaded once over the DP ranks


def test_a_per_rank_distributed_optimizer_goes_into_dp_reshardable_and_back(tmp_path: Path) -> None:
    src = GOLDENS / "train_tp2dp2_distopt_bf16_torch"
    convert_to_torch_dist(src, tmp_path / "td", "--dst-tp", "1", "--dst-dp", "2", "--dst-optim-form", "dp_reshardable")
    common = read_common(tmp_path / "td" / ITERATION)
    assert common["optimizer"] == {"param_state_sharding_type": "dp_reshardable"}
    assert common["args"].data_parallel_size == 2
    result = run_cli("convert", tmp_path / "td", tmp_path / "back", "-q", "--dst-format", "megatron", "--dst-tp", "2")
    assert result.exit_code == 0, result.output
    for rank_dir in ("mp_rank_00", "mp_rank_01"):
        a, b = (torch.load(d / ITERATION / rank_dir / "distrib_optim.pt", weights_only=True)
                for d in (src, tmp_path / "back"))
        ((_, bufs_a),), ((_, bufs_b),) = a[0].items(), b[0].items()
        for field in ("param", "exp_avg", "exp_avg_sq"):
            assert torch.equal(bufs_a[field], bufs_b[field]), f"{rank_dir}.{field}"


def test_context_parallel_ranks_share_the_dense_buckets_as_data_parallel_ranks_do(tmp_path: Path) -> None:
    """megatron-core's dense distributed optimizer shards over ``intra_dp_cp`` (DP x CP ranks): a run at CP4 DP1
    cuts its dp_reshardable buckets in the same four shards as one at CP1 DP4 (a parameter straddles a quarter's
    boundary, so the chunks differ from one shard's)."""
    from pgconvert.savers.megatron import save_durably

    src = GOLDENS / "train_tp2dp2_distopt_bf16_torch"
    edited = tmp_path / "cp4"
    shutil.copytree(src, edited)
    for path in edited.glob(f"{ITERATION}/mp_rank_*/model_optim_rng.pt"):
        state = dict(load_for_test(path))
        state["args"].context_parallel_size, state["args"].data_parallel_size = 4, 1
        save_durably(state, path)
    convert_to_torch_dist(src, tmp_path / "dp4", "--dst-tp", "2", "--dst-dp", "4", "--dst-optim-form", "dp_reshardable")
    convert_to_torch_dist(edited, tmp_path / "cp4dp1", "--dst-tp", "2", "--dst-dp", "1", "--dst-optim-form", "dp_reshardable")
    assert read_common(tmp_path / "cp4dp1" / ITERATION)["args"].context_parallel_size == 4
    assert_golden_records_equal(tmp_path / "dp4", tmp_path / "cp4dp1")
