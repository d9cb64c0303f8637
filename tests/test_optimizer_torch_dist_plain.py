"""megatron-core's plain (non-distributed) optimizer state in torch_dist checkpoints, read and written.

Sources: Megatron-LM's own bf16 torch_dist run without --use-distributed-optimizer (``train_tp2pp2_bf16_torch_dist``:
``optimizer.state.{fp32_param,exp_avg,exp_avg_sq}.*`` records, ``common_step`` and the param groups in the common
state) and its fp32 per-rank run (``train_tp2pp2_torch``: FP32Optimizer, no masters beside the weights). Every
optimizer tensor is compared per parameter (``export-optimizer``) with ``torch.equal``; the records pgconvert writes
are read back with torch's own DCP reader. megatron-core's own load of the result: test_optimizer_torch_dist_plain_mcore.py.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from support.cli_helpers import assert_clean_refusal
from support.megatron_fixtures import load_for_test
from support.optimizer_faults import edit_common
from support.moe_optimizer_runs import assert_round_trip, generate, optimizer_records
from support.optimizer_cli import (as_megatron_core_0_13_names, assert_same_parameters, dcp_read, export_optimizer,
                                  rewrite_metadata, run_cli)
from support.torch_dist_forms import FOR_MCORE_016_CLI
from support.checkpoint_compare import read_common

GOLDENS = Path(__file__).parent / "data" / "megatron_lm"
PLAIN_TD = GOLDENS / "train_tp2pp2_bf16_torch_dist"
PLAIN_FP32 = GOLDENS / "train_tp2pp2_torch"
ITER = "iter_0000002"
KEYS = ("param", "exp_avg", "exp_avg_sq", "step")


def _convert(src: Path, dst: Path, *flags: str) -> str:
    result = run_cli("convert", src, dst, "-q", "--strict", *flags, *FOR_MCORE_016_CLI)
    assert result.exit_code == 0, result.output
    return result.output


def test_megatron_lms_plain_records_are_read_per_parameter() -> None:
    from pgconvert.formats import LoadOptions
    from pgconvert.loaders.torch_dist.optimizer import TorchDistOptimizerSource
    from pgconvert.formats.registry import get_loader

    source = get_loader("torch_dist").open(PLAIN_TD, LoadOptions())
    try:
        optimizer = TorchDistOptimizerSource(source)
        assert (optimizer.sharding, optimizer.form) == ("plain", "float16")
        state = optimizer.parameter("decoder.layers.1.mlp.linear_fc2.weight")
        fc2 = "decoder.layers.mlp.linear_fc2.weight"
        keys = [f"optimizer.state.{field}.{fc2}" for field in ("fp32_param", "exp_avg", "exp_avg_sq")]
        read = dcp_read(PLAIN_TD / ITER, keys)  # torch's own DCP reader: the stacked key's layer 1
        for key, field in zip(keys, ("param", "exp_avg", "exp_avg_sq")):
            assert torch.equal(state[field], read[key][1]), field
        assert float(state["step"]) == 2.0 and len(optimizer.names()) == 15
        assert torch.equal(state["param"].to(torch.bfloat16), source.load("decoder.layers.1.mlp.linear_fc2.weight"))
    finally:
        source.close()


def test_plain_torch_dist_to_per_rank_and_torch_dist_tp1_and_back_is_bit_exact(tmp_path: Path) -> None:
    original = export_optimizer(PLAIN_TD, tmp_path / "ex_src")
    _convert(PLAIN_TD, tmp_path / "pr1", "--dst-format", "megatron", "--dst-tp", "1", "--dst-pp", "1")
    _convert(PLAIN_TD, tmp_path / "td1", "--dst-format", "torch_dist", "--dst-tp", "1", "--dst-pp", "1")
    _convert(tmp_path / "td1", tmp_path / "td22", "--dst-format", "torch_dist", "--dst-tp", "2", "--dst-pp", "2")
    _convert(tmp_path / "pr1", tmp_path / "pr_td", "--dst-format", "torch_dist", "--dst-tp", "2", "--dst-pp", "1")
    for name in ("pr1", "td1", "td22", "pr_td"):
        assert_same_parameters(original, export_optimizer(tmp_path / name, tmp_path / f"ex_{name}"))
    rank = load_for_test(tmp_path / "pr1" / ITER / "mp_rank_00" / "model_optim_rng.pt")["optimizer"]
    assert set(rank) == {"optimizer", "fp32_from_fp16_params"}  # Float16OptimizerWithFloat16Params' state_dict
    common = read_common(tmp_path / "td1" / ITER)
    assert set(common["optimizer"]) == {"optimizer"} and float(common["optimizer"]["optimizer"]["state"]
                                                               ["common_step"]) == 2.0
    assert "distrib_optim_sharding_type" not in common["content_metadata"]
    src_groups = load_for_test_common(PLAIN_TD)["optimizer"]["optimizer"]["param_groups"]
    assert common["optimizer"]["optimizer"]["param_groups"] == src_groups
    fc1 = "optimizer.state.fp32_param.decoder.layers.mlp.linear_fc1.weight"
    stored = dcp_read(tmp_path / "td1" / ITER, [fc1])[fc1]  # SwiGLU fc1 at TP1: [gate; up] per layer
    assert torch.equal(stored[0], original["decoder.layers.0.mlp.linear_fc1.weight"]["param"])


def load_for_test_common(golden: Path) -> dict:
    from pgconvert.formats import LoadOptions
    from pgconvert.formats.registry import get_loader

    source = get_loader("torch_dist").open(golden, LoadOptions())
    try:
        return source.common_state
    finally:
        source.close()


def test_fp32_plain_optimizer_goes_into_torch_dist_without_masters_and_back(tmp_path: Path) -> None:
    original = export_optimizer(PLAIN_FP32, tmp_path / "ex_src")
    _convert(PLAIN_FP32, tmp_path / "td1", "--dst-format", "torch_dist", "--dst-tp", "1", "--dst-pp", "1")
    _convert(tmp_path / "td1", tmp_path / "pr22", "--dst-format", "megatron", "--dst-tp", "2", "--dst-pp", "2")
    for name in ("td1", "pr22"):
        assert_same_parameters(original, export_optimizer(tmp_path / name, tmp_path / f"ex_{name}"))
    common = read_common(tmp_path / "td1" / ITER)
    assert set(common["optimizer"]) == {"state", "param_groups"}  # FP32Optimizer: the torch optimizer's own
    from pgconvert.formats.torch_dist import read_dcp_metadata

    keys = set(read_dcp_metadata(tmp_path / "td1" / ITER / ".metadata").state_dict_metadata)
    assert not [key for key in keys if "fp32_param" in key] and "optimizer.state.exp_avg.output_layer.weight" in keys
    for path in sorted((PLAIN_FP32 / ITER).glob("mp_rank_*/model_optim_rng.pt")):
        before, after = load_for_test(path)["optimizer"], load_for_test(tmp_path / "pr22" / path.relative_to(PLAIN_FP32))
        after = after["optimizer"]
        assert before["param_groups"] == after["param_groups"], path
        for position, state in before["state"].items():
            for key, value in state.items():
                assert torch.equal(value, after["state"][position][key]), (path, position, key)


def _copy(tmp_path: Path) -> Path:
    target = tmp_path / "src"
    shutil.copytree(PLAIN_TD, target)
    return target


def test_a_missing_record_and_a_wrong_shape_are_named_errors(tmp_path: Path) -> None:
    src = _copy(tmp_path)
    victim = "optimizer.state.exp_avg_sq.decoder.layers.mlp.linear_fc2.weight"

    def drop(metadata) -> None:  # noqa: ANN001
        del metadata.state_dict_metadata[victim]
        for index in [index for index in metadata.storage_data if index.fqn == victim]:
            del metadata.storage_data[index]

    rewrite_metadata(src / ITER, drop)
    result = run_cli("convert", src, tmp_path / "out", "--dst-format", "megatron", "--dst-tp", "1")
    assert_clean_refusal(result, 1, "no optimizer record", victim, "plain form")
    assert not (tmp_path / "out").exists()
    shutil.rmtree(src)
    src = _copy(tmp_path)
    wrong = "optimizer.state.fp32_param.output_layer.weight"

    def grow(metadata) -> None:  # noqa: ANN001
        entry = metadata.state_dict_metadata[wrong]
        entry.size = torch.Size([entry.size[0] + 32, entry.size[1]])

    rewrite_metadata(src / ITER, grow)
    result = run_cli("convert", src, tmp_path / "out", "--dst-format", "torch_dist", "--dst-tp", "1")
    assert_clean_refusal(result, 1, wrong, "has global shape [96, 16]", "gives [64, 16]")
    assert run_cli("convert", src, tmp_path / "skipped", "--dst-tp", "1", "--skip-optimizer").exit_code == 0


def test_a_missing_common_step_is_a_named_error() -> None:
    from pgconvert.optimizer.order import OptimizerLayoutError
    from pgconvert.loaders.torch_dist.optimizer_forms import plain_step

    entry = {"optimizer": {"state": {}, "param_groups": []}}
    with pytest.raises(OptimizerLayoutError, match="state.common_step = None"):
        plain_step(entry, "float16", "ckpt")


def test_a_moe_runs_chained_plain_optimizers_go_into_torch_dist_at_ep2_and_ep1_and_back(tmp_path: Path) -> None:
    """megatron-core's chained dense and expert Float16 optimizers (TP2 x EP2) into torch_dist's plain form
    at EP2 and EP1 and back to per-rank TP2 x EP2: every optimizer tensor equal per parameter, the records under
    the model keys (no ``chained_<i>.`` prefix), the common state ``{0: dense, 1: expert}``."""
    pytest.importorskip("megatron.core", reason="megatron-core lays out the MoE optimizer state")

    from pgconvert.formats.torch_dist import read_dcp_metadata

    src = generate(tmp_path / "moe", 2, 1, 2, "bf16")  # TP2 x EP2: the dense and expert optimizers chained
    original = export_optimizer(src, tmp_path / "ex_src")
    _convert(src, tmp_path / "td2", "--dst-format", "torch_dist")
    _convert(tmp_path / "td2", tmp_path / "td1", "--dst-format", "torch_dist", "--dst-tp", "1", "--dst-ep", "1")
    _convert(tmp_path / "td1", tmp_path / "back", "--dst-format", "megatron", "--dst-tp", "2", "--dst-ep", "2")
    assert any(".experts." in name for name in original) and len(original) > 8
    for name in ("td2", "td1", "back"):
        again = export_optimizer(tmp_path / name, tmp_path / f"ex_{name}")
        assert set(again) == set(original), name
        for parameter, tensors in original.items():
            assert set(tensors) == set(again[parameter]) == set(KEYS), (name, parameter)
            for key in KEYS:
                assert torch.equal(tensors[key], again[parameter][key]), (name, parameter, key)
    assert_round_trip(src, tmp_path / "back", ("optimizer",))
    common = read_common(tmp_path / "td2" / ITER)["optimizer"]
    step = float(original[next(iter(original))]["step"])
    assert sorted(common) == [0, 1]
    assert [float(entry["optimizer"]["state"]["common_step"]) for entry in common.values()] == [step, step]
    dense, expert = ([group.get("is_expert_parallel") for group in entry["optimizer"]["param_groups"]]
                     for entry in (common[0], common[1]))
    assert expert and all(expert) and not any(dense)
    keys = set(read_dcp_metadata(tmp_path / "td2" / ITER / ".metadata").state_dict_metadata)
    assert not [key for key in keys if key.startswith("chained_")]
    assert [key for key in keys if key.startswith("optimizer.state.fp32_param.") and ".experts." in key]
    assert "optimizer" in set(read_common(tmp_path / "td1" / ITER)["optimizer"])  # EP1: one
    # megatron-core 0.13.1 prefixes the chained optimizers' records chained_<i>.: read as they are named
    shutil.copytree(tmp_path / "td2", tmp_path / "prefixed")
    as_megatron_core_0_13_names(tmp_path / "prefixed" / ITER)
    keys = set(read_dcp_metadata(tmp_path / "prefixed" / ITER / ".metadata").state_dict_metadata)
    assert [key for key in keys if key.startswith("chained_1.optimizer.state.exp_avg.") and ".experts." in key]
    again = export_optimizer(tmp_path / "prefixed", tmp_path / "ex_prefixed")
    assert again.keys() == original.keys()
    assert all(torch.equal(tensors[key], again[name][key]) for name, tensors in original.items() for key in KEYS)
    # megatron-core 0.14.0's ChainedOptimizer saves each group's step as None where torch's Adam holds none in its
    # groups (the count is common_step): read alike
    edit_common(tmp_path / "prefixed" / ITER, lambda common: [group.update(step=None) for entry in
                                                              common["optimizer"].values()
                                                              for group in entry["optimizer"]["param_groups"]])
    again = export_optimizer(tmp_path / "prefixed", tmp_path / "ex_step_none")
    assert all(torch.equal(tensors[key], again[name][key]) for name, tensors in original.items() for key in KEYS)


def test_megatron_core_loads_a_moe_runs_chained_plain_optimizers_from_pgconverts_torch_dist(tmp_path: Path) -> None:
    """megatron-core 0.16.1 on four gloo ranks (TP2 x EP2, its chained dense and expert FP32Optimizers)
    declares the records pgconvert wrote, ``dist_checkpointing.load`` reads them, and its own save of the loaded
    state holds the same records bit for bit and the same common state; pgconvert reads that save back to the
    source's every optimizer tensor."""
    pytest.importorskip("megatron.core", reason="megatron-core is the reference")
    import json
    import subprocess
    import sys

    from support.megatron_fixtures import assert_same_tree

    from pgconvert.formats.torch_dist import read_dcp_metadata

    src = generate(tmp_path / "moe", 2, 1, 2, "fp32")
    _convert(src, tmp_path / "td", "--dst-format", "torch_dist")
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
    assert declared == {key: list(stored[key].size) for key in ours} and ours
    theirs = optimizer_records(tmp_path / "mc" / "saved")
    assert set(theirs) == set(ours)
    for key, tensor in ours.items():
        assert theirs[key].dtype == tensor.dtype and torch.equal(theirs[key], tensor), key
    saved_common = read_common(tmp_path / "mc" / "saved")["optimizer"]
    assert_same_tree(saved_common, read_common(tmp_path / "td" / ITER)["optimizer"], "optimizer")
    original = export_optimizer(src, tmp_path / "ex_src")  # pgconvert reads megatron-core's own save of them
    again = export_optimizer(tmp_path / "mc" / "saved", tmp_path / "ex_mc")
    assert set(again) == set(original) and any(".experts." in name for name in original)
    for parameter, tensors in original.items():
        for key in KEYS:
            assert torch.equal(tensors[key], again[parameter][key]), (parameter, key)


def test_chained_plain_optimizers_with_different_steps_or_forms_are_named_errors() -> None:
    from pgconvert.optimizer.order import OptimizerLayoutError, UnsupportedOptimizerError
    from pgconvert.loaders.torch_dist.optimizer_forms import plain_form, plain_step

    fp32 = {"state": {"common_step": torch.tensor(2.0)}, "param_groups": []}
    assert float(plain_step({0: fp32, 1: dict(fp32)}, "fp32", "ckpt")) == 2.0
    later = {"state": {"common_step": torch.tensor(3.0)}, "param_groups": []}
    with pytest.raises(OptimizerLayoutError, match=r"ckpt: the chained plain optimizers' common_step differ"):
        plain_step({0: fp32, 1: later}, "fp32", "ckpt")
    with pytest.raises(UnsupportedOptimizerError, match=r"ckpt: the chained plain optimizers' forms differ"):
        plain_form({"optimizer": {0: fp32, 1: {"optimizer": fp32}}}, "ckpt")
