"""Optimizer state written into an ``fsdp_dtensor`` destination, as Megatron-LM saves Megatron-FSDP's.

The reference is Megatron-LM's own save (tests/data/megatron_lm/train_tp2dp2_fsdp_dtensor_optim, a bf16 TP2 DP2
Megatron-FSDP run), read here with torch.distributed.checkpoint alone: the store is global, so pgconvert's output at
any TP holds the same tensors (fp32 masters, moments, steps) and bytes entries (param groups, scheduler,
floating-point operations), bit for bit; only the args differ. A bf16 per-rank run's conversion holds its fp32
masters as the model, not its bf16 weights widened.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from support.checkpoint_compare import read_dcp, read_dcp_objects, rewrite_dcp_metadata
from support.megatron_fixtures import load_for_test
from torch.distributed.checkpoint import FileSystemReader

import pgconvert
from pgconvert.errors import StrictModeError
from pgconvert.formats import LoadOptions
from pgconvert.formats.registry import get_loader
from pgconvert.optimizer.order import OptimizerLayoutError

GOLDENS = Path(__file__).parent / "data" / "megatron_lm"
GOLDEN = GOLDENS / "train_tp2dp2_fsdp_dtensor_optim"
PER_RANK_BF16 = GOLDENS / "train_tp2dp2_distopt_bf16_torch"
ITERATION = "iter_0000002"
MODEL = "model.module."
STATE = "optimizer.state.module.module.module."
# Entries that depend on the run's ranks (RNG) or name its layout (args): not compared.
UNCOMPARED = ("rng_state.", "args")


def _bytes_entries(iteration_dir: Path) -> dict[str, object]:
    """Every bytes entry but the uncompared ones, each the object ``dcp.load`` hands over."""
    return read_dcp_objects(iteration_dir, lambda key: not key.startswith(UNCOMPARED))


def _assert_store_is_the_golden(written: Path) -> None:
    """Every tensor and bytes entry (RNG and args aside) of the golden, and no other, equal bit for bit."""
    golden_md, golden = read_dcp(GOLDEN / ITERATION)
    md, tensors = read_dcp(written / ITERATION)
    expected = {key for key in golden_md.state_dict_metadata if not key.startswith(UNCOMPARED)}
    assert set(md.state_dict_metadata) - {"args"} == expected
    compared = [key for key in golden if not key.startswith(UNCOMPARED)]
    assert len(compared) == 68 and sum(key.startswith(STATE) for key in compared) == 51
    for key in compared:
        assert tensors[key].dtype == golden[key].dtype and torch.equal(tensors[key], golden[key]), key
    golden_entries = _bytes_entries(GOLDEN / ITERATION)
    assert len(golden_entries) > 280 and _bytes_entries(written / ITERATION) == golden_entries


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    work = tmp_path_factory.mktemp("fsdp_optimizer_saver")
    out = {"tp1": work / "tp1", "tp2": work / "tp2", "per-rank": work / "per_rank", "back": work / "back"}
    pgconvert.convert(GOLDEN, out["tp1"], dst_format="fsdp_dtensor", dst_tp=1)
    pgconvert.convert(GOLDEN, out["tp2"], dst_format="fsdp_dtensor", dst_tp=2)
    # the bf16 run as Megatron-LM keeps it per rank (bf16 weights, fp32 masters in distrib_optim.pt), and back
    pgconvert.convert(GOLDEN, out["per-rank"], dst_format="megatron", dst_tp=2, dtype="bf16")
    pgconvert.convert(out["per-rank"], out["back"], dst_format="fsdp_dtensor", dst_tp=2)
    return out


@pytest.mark.parametrize("label", ["tp1", "tp2", "back"])
def test_written_state_is_megatron_lm_s_own(written: dict[str, Path], label: str) -> None:
    """TP1 and TP2 from the golden, and the golden through bf16 per-rank files and back: the golden's store."""
    _assert_store_is_the_golden(written[label])
    args = get_loader("fsdp_dtensor").open(written[label], LoadOptions()).megatron_args  # Megatron's classes inside
    assert args.tensor_model_parallel_size == (1 if label == "tp1" else 2)
    assert args.bf16 and args.ckpt_format == "fsdp_dtensor" and args.use_megatron_fsdp


def test_per_rank_round_trip_went_through_bf16_weights(written: dict[str, Path]) -> None:
    """The per-rank files hold bf16 weights: the way back took the fp32 model from their masters."""
    rank = load_for_test(written["per-rank"] / ITERATION / "mp_rank_00" / "model_optim_rng.pt")
    assert rank["model"]["decoder.layers.0.mlp.linear_fc2.weight"].dtype == torch.bfloat16


def test_pgconvert_reads_and_verifies_the_output(written: dict[str, Path]) -> None:
    done = subprocess.run([sys.executable, "-m", "pgconvert", "verify", str(GOLDEN), str(written["tp2"])],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "optimizer state (distributed, fsdp_dtensor): 15 parameters compared (bit-exact): equal" in done.stdout
    manifest = json.loads((written["tp2"] / "pgconvert.json").read_text())
    assert any(item["path"].endswith("__0_2.distcp") for item in manifest["files"]), manifest["files"]


def test_bf16_per_rank_run_gives_its_fp32_masters_as_the_model(tmp_path: Path) -> None:
    """Megatron-LM's own bf16 distributed-optimizer run: the model entries are its masters (pgconvert's
    export-optimizer of the source), and some differ from its bf16 weights widened."""
    report = pgconvert.convert(PER_RANK_BF16, tmp_path / "fsdp", dst_format="fsdp_dtensor", dst_tp=1)
    assert any("fsdp_dtensor stores the optimizer's fp32 master weights as the model" in note
               for note in report.notices), report.notices
    assert not any("written widened to float32" in note for note in report.notices), report.notices
    done = subprocess.run([sys.executable, "-m", "pgconvert", "export-optimizer", str(PER_RANK_BF16),
                           str(tmp_path / "export")], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    index = json.loads((tmp_path / "export" / "optimizer.json").read_text())
    _, tensors = read_dcp(tmp_path / "fsdp" / ITERATION)
    differ = 0
    for name, entry in index["parameters"].items():
        held = torch.load(tmp_path / "export" / entry["file"], weights_only=True)
        stem = "model.module." + name
        model = torch.cat([tensors[stem + "_w"], tensors[stem + "_v"]]) if stem + "_w" in tensors else tensors[stem]
        assert model.dtype == torch.float32 and torch.equal(model, held["param"]), name
        for field in ("exp_avg", "exp_avg_sq"):
            key = STATE + name + "." + field
            state = torch.cat([tensors[key.replace(".weight.", ".weight_w.")],
                               tensors[key.replace(".weight.", ".weight_v.")]]) if stem + "_w" in tensors \
                else tensors[key]
            assert torch.equal(state, held[field]), f"{name} {field}"
        differ += not torch.equal(model, model.to(torch.bfloat16).float())
    assert differ == len(index["parameters"])  # none is its bf16 weight widened


# megatron-core's local spec saves its layer norms under the TE names (its sharded_state_dict_keys_map).
TE_NAMES = {"input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
            "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight"}


def _torch_dist_record(records: dict[str, torch.Tensor], field: str, parameter: str) -> torch.Tensor:
    """A torch_dist fully_reshardable record of an fsdp_dtensor parameter name: layers stacked on dim 0, a SwiGLU
    fc1 whole (``[gate; up]``, the ``_w``/``_v`` halves its first and second half)."""
    stem = parameter.removesuffix("_w").removesuffix("_v")
    match = re.fullmatch(r"decoder\.layers\.(\d+)\.(.*)", stem)
    key = f"optimizer.state.{field}." + (f"decoder.layers.{TE_NAMES.get(match.group(2), match.group(2))}" if match
                                         else stem)
    record = records[key][int(match.group(1))] if match else records[key]
    return record.chunk(2)[parameter.endswith("_v")] if stem != parameter else record


def test_torch_dist_run_gives_its_masters_and_moments(tmp_path: Path) -> None:
    """Megatron-LM's bf16 fully_reshardable torch_dist save (read with torch's DCP alone): its fp32 ``param`` records
    are the model entries, its moments the optimizer records, whatever TP the destination names."""
    source = GOLDENS / "train_tp2dp2_distopt_fully_reshardable_torch_dist"
    pgconvert.convert(source, tmp_path / "fsdp", dst_format="fsdp_dtensor", dst_tp=1)
    _, records = read_dcp(source / ITERATION)
    _, tensors = read_dcp(tmp_path / "fsdp" / ITERATION)
    parameters = [key[len(MODEL):] for key in tensors if key.startswith(MODEL)]
    assert len(parameters) == 17
    for parameter in parameters:
        assert torch.equal(tensors[MODEL + parameter], _torch_dist_record(records, "param", parameter)), parameter
        for field in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(tensors[f"{STATE}{parameter}.{field}"],
                               _torch_dist_record(records, field, parameter)), f"{parameter} {field}"
        assert float(tensors[f"{STATE}{parameter}.step"]) == 2.0


def test_worker_processes_write_the_same_store(written: dict[str, Path], tmp_path: Path) -> None:
    pgconvert.convert(GOLDEN, tmp_path / "workers", dst_format="fsdp_dtensor", dst_tp=2, workers=2)
    _assert_store_is_the_golden(tmp_path / "workers")


def test_dst_dp_is_recorded_in_the_args(tmp_path: Path) -> None:
    pgconvert.convert(GOLDEN, tmp_path / "fsdp", dst_format="fsdp_dtensor", dst_tp=2, dst_dp=4)
    args = get_loader("fsdp_dtensor").open(tmp_path / "fsdp", LoadOptions()).megatron_args
    assert (args.data_parallel_size, args.world_size) == (4, 8)
    _assert_store_is_the_golden(tmp_path / "fsdp")


def test_fp16_run_is_written_without_its_state_by_name(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """fsdp_dtensor saves no grad scaler: a run written as fp16 (the saver's run precision made fp16) gets the model
    alone, which a notice names and --strict refuses."""
    from pgconvert.savers.fsdp_dtensor import FsdpDtensorSaver

    monkeypatch.setattr(FsdpDtensorSaver, "_run_dtype", staticmethod(lambda source, options: torch.float16))
    refusal = "fsdp_dtensor holds no grad scaler, so an fp16 run's state"
    with pytest.raises(StrictModeError, match=refusal):
        pgconvert.convert(GOLDEN, tmp_path / "strict", dst_format="fsdp_dtensor", dst_tp=1, strict=True)
    assert not (tmp_path / "strict").exists()
    report = pgconvert.convert(GOLDEN, tmp_path / "out", dst_format="fsdp_dtensor", dst_tp=1)
    assert any(refusal in notice for notice in report.notices), report.notices
    entries = FileSystemReader(str(tmp_path / "out" / ITERATION)).read_metadata().state_dict_metadata
    assert not any(key.startswith("optimizer.") for key in entries)


def test_missing_record_is_named_and_nothing_written(tmp_path: Path) -> None:
    copy = tmp_path / "ckpt"
    shutil.copytree(GOLDEN, copy)
    key = STATE + "decoder.layers.0.mlp.linear_fc1.weight_v.exp_avg_sq"

    def drop(metadata: Any) -> None:
        del metadata.state_dict_metadata[key]
        metadata.storage_data = {index: info for index, info in metadata.storage_data.items() if index.fqn != key}

    rewrite_dcp_metadata(copy / ITERATION, drop)
    with pytest.raises(OptimizerLayoutError, match=r"no optimizer record '.*linear_fc1\.weight_v\.exp_avg_sq'"):
        pgconvert.convert(copy, tmp_path / "out", dst_format="fsdp_dtensor", dst_tp=1)
    assert not (tmp_path / "out").exists()


def test_dry_run_lists_the_state_files(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "pgconvert", "convert", str(GOLDEN), str(tmp_path / "out"),
                           "--dst-format", "fsdp_dtensor", "--dst-tp", "2", "--dry-run"],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "iter_0000002/__0_2.distcp  + optimizer state (distributed, fsdp_dtensor" in done.stdout, done.stdout
    assert not (tmp_path / "out").exists()
