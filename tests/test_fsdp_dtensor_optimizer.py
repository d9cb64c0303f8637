"""Megatron-FSDP's optimizer state (``--ckpt-format fsdp_dtensor``) carried by pgconvert.

The golden (tests/data/megatron_lm/train_tp2dp2_fsdp_dtensor_optim, see the README there) is Megatron-LM's own
``save_checkpoint`` of a bf16 TP2 DP2 Megatron-FSDP run with its optimizer state. The reference is read here with
torch.distributed.checkpoint alone: each parameter's fp32 main weight (``model.module.<name>``), its Adam moments
and step (``optimizer.state.module.module.module.<name>.*``), a SwiGLU fc1's ``_w``/``_v`` halves joined into
Megatron's ``[gate; up]``. pgconvert's conversions are read back by megatron-core 0.16.1 itself
(``tests/support/mcore_optimizer_step.py``: per-rank ``load_parameter_state``, torch_dist ``dist_checkpointing.load``)
and must hold that state bit for bit, and step alike.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from support.checkpoint_compare import read_dcp, rewrite_dcp_metadata
from support.mcore_step_check import FP32_ATOL, FP32_RTOL, KEYS, fixed_gradients, joined, run_steps
from support.torch_dist_forms import FOR_MCORE_016

import pgconvert
from pgconvert.errors import StrictModeError
from pgconvert.optimizer.order import OptimizerLayoutError

GOLDEN = Path(__file__).parent / "data" / "megatron_lm" / "train_tp2dp2_fsdp_dtensor_optim"
ITERATION = GOLDEN / "iter_0000002"
MODEL = "model.module."
STATE = "optimizer.state.module.module.module."
STEP = 2.0  # two iterations


def _joined_halves(tensors: dict[str, torch.Tensor], stem: str, suffix: str = "") -> torch.Tensor:
    return torch.cat([tensors[f"{stem}_w{suffix}"], tensors[f"{stem}_v{suffix}"]])


@pytest.fixture(scope="module")
def reference() -> dict[str, dict[str, torch.Tensor]]:
    """Per canonical name: param (the fp32 main weight), exp_avg, exp_avg_sq and step, read by torch's DCP alone."""
    _, tensors = read_dcp(ITERATION)
    state: dict[str, dict[str, torch.Tensor]] = {}
    for key in tensors:
        if not key.startswith(MODEL):
            continue
        name = key[len(MODEL):]
        stem = name.removesuffix("_w").removesuffix("_v")
        if stem != name:  # a SwiGLU fc1 half: both halves joined once
            state[stem] = {"param": _joined_halves(tensors, MODEL + stem),
                           **{field: _joined_halves(tensors, STATE + stem, "." + field) for field in KEYS[1:]},
                           "step": tensors[f"{STATE}{stem}_w.step"]}
            assert torch.equal(tensors[f"{STATE}{stem}_w.step"], tensors[f"{STATE}{stem}_v.step"])
        else:
            state[name] = {"param": tensors[key], **{field: tensors[f"{STATE}{name}.{field}"] for field in KEYS[1:]},
                           "step": tensors[f"{STATE}{name}.step"]}
    return state


def test_golden_holds_megatron_fsdp_optimizer_state(reference: dict[str, dict[str, torch.Tensor]]) -> None:
    metadata, _ = read_dcp(ITERATION)
    entries = metadata.state_dict_metadata
    assert len(reference) == 15
    assert all(float(tensors["step"]) == STEP and tensors["param"].dtype == torch.float32
               for tensors in reference.values())
    # the moments are chunked as the weights: unevenly over the DP ranks, not aligned to the TP pieces
    assert len(entries[STATE + "output_layer.weight.exp_avg"].chunks) == 4
    assert "optimizer.param_to_group_meta.module.module.module.decoder.final_layernorm.weight.wd_mult" in entries
    # the same run as the model-only golden: the same weights, bit for bit
    _, model_only = read_dcp(GOLDEN.parent / "train_tp2dp2_fsdp_dtensor" / "iter_0000002")
    assert all(torch.equal(model_only[key], value) for key, value in read_dcp(ITERATION)[1].items()
               if key.startswith(MODEL))


def test_export_optimizer_gives_the_golden_state(reference: dict[str, dict[str, torch.Tensor]],
                                                 tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "pgconvert", "export-optimizer", str(GOLDEN), str(tmp_path / "out")],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    index = json.loads((tmp_path / "out" / "optimizer.json").read_text())
    assert index["iteration"] == 2 and index["opt_param_scheduler"]["num_steps"] == 4
    assert [group["wd_mult"] for group in index["param_groups"]] == [1.0, 0.0]
    assert index["parameters"]["decoder.final_layernorm.weight"]["group"] == 1
    for name, expected in reference.items():
        held = torch.load(tmp_path / "out" / index["parameters"][name]["file"], weights_only=True)
        for key, tensor in expected.items():
            assert held[key].dtype == tensor.dtype and torch.equal(held[key], tensor), f"{name} {key}"


def test_inspect_and_verify_see_the_state(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "pgconvert", "inspect", str(GOLDEN)], capture_output=True, text=True)
    assert done.returncode == 0 and "optimizer   distributed, fsdp_dtensor: 15 parameters checked" in done.stdout
    pgconvert.convert(GOLDEN, tmp_path / "tp2", dst_format="torch_dist", dst_tp=2)
    done = subprocess.run([sys.executable, "-m", "pgconvert", "verify", str(GOLDEN), str(tmp_path / "tp2")],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "optimizer state (distributed, fsdp_dtensor in A, distributed, fully_reshardable in B): 15 parameters " \
           "compared (bit-exact): equal" in done.stdout


@pytest.fixture(scope="module")
def stepped(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    """megatron-core 0.16.1 loads pgconvert's TP1 conversions (bf16, as the run trained) and takes one step, in one
    child process: per-rank (``distrib_optim.pt``) at DP1 and DP2, torch_dist (fully_reshardable) at DP2."""
    pytest.importorskip("megatron.core", reason="megatron-core's own optimizer is the acceptance check")
    work = tmp_path_factory.mktemp("fsdp_optimizer")
    pgconvert.convert(GOLDEN, work / "tp1", dst_format="megatron", dst_tp=1, dtype="bf16")
    pgconvert.convert(GOLDEN, work / "td1", dst_format="torch_dist", dst_tp=1, dtype="bf16", **FOR_MCORE_016)
    fixed_gradients(work / "tp1", work / "grads.pt", scale=3e-2)
    runs = {"per-rank dp1": (work / "tp1", 1), "per-rank dp2": (work / "tp1", 2), "torch_dist dp2": (work / "td1", 2)}
    results = run_steps(work / "grads.pt", [(ckpt / "iter_0000002", work / label.replace(" ", "_"), dp)
                                            for label, (ckpt, dp) in runs.items()])
    return dict(zip(runs, results))


def test_megatron_core_loads_the_conversions_bit_exact_and_steps_alike(
        stepped: dict[str, list[dict[str, Any]]], reference: dict[str, dict[str, torch.Tensor]]) -> None:
    after: dict[str, dict[str, dict[str, torch.Tensor]]] = {}
    for label, results in stepped.items():
        state = joined(results, swiglu=True)
        assert sorted(state) == sorted(reference), label
        for name, expected in reference.items():
            for key in KEYS:
                assert torch.equal(state[name][f"before.{key}"], expected[key]), f"{label}: {name} loaded {key}"
            assert not torch.equal(state[name]["after.param"], expected["param"]), f"{label}: {name} did not step"
        steps = {float(tensors["step"]) for result in results for when in ("before", "after")
                 for _, tensors in result[when].values()}
        assert steps == {STEP, STEP + 1}, f"{label}: Adam's steps {sorted(steps)}"
        after[label] = state
    norms = {result["grad_norm"] for results in stepped.values() for result in results}
    assert max(norms) == pytest.approx(min(norms), rel=1e-6) and min(norms) > 1.0  # clip_grad 1: the step clips
    first, *others = after.values()
    for other in others:
        for name, tensors in other.items():
            for key in KEYS:
                torch.testing.assert_close(tensors[f"after.{key}"], first[name][f"after.{key}"], rtol=FP32_RTOL,
                                           atol=FP32_ATOL)


@pytest.fixture
def copy(tmp_path: Path) -> Path:
    target = tmp_path / "ckpt"
    shutil.copytree(GOLDEN, target)
    return target


def _without(key: str) -> Any:
    def drop(metadata: Any) -> None:
        del metadata.state_dict_metadata[key]
        metadata.storage_data = {index: info for index, info in metadata.storage_data.items() if index.fqn != key}
    return drop


def _widened(key: str) -> Any:
    def widen(metadata: Any) -> None:
        held = metadata.state_dict_metadata[key]
        metadata.state_dict_metadata[key] = dataclasses.replace(held, size=torch.Size([24, *held.size[1:]]))  # chunks still inside
    return widen


@pytest.mark.parametrize(("change", "message"), [
    (_without(STATE + "decoder.layers.1.self_attention.linear_proj.weight.exp_avg"),
     r"no optimizer record 'optimizer\.state\.module\.module\.module\.decoder\.layers\.1\.self_attention\.linear_proj"
     r"\.weight\.exp_avg' \(fsdp_dtensor form"),
    (_widened(STATE + "decoder.layers.0.mlp.linear_fc2.weight.exp_avg_sq"),
     r"linear_fc2\.weight\.exp_avg_sq' has global shape \[24, 32\]; its parameter's model entry gives \[16, 32\]"),
], ids=["missing-exp_avg", "shape-disagrees"])
def test_bad_optimizer_state_is_named_and_nothing_written(copy: Path, tmp_path: Path, change: Any,
                                                         message: str) -> None:
    rewrite_dcp_metadata(copy / "iter_0000002", change)
    with pytest.raises(OptimizerLayoutError, match=message):
        pgconvert.convert(copy, tmp_path / "out", dst_format="megatron", dst_tp=1)
    assert not (tmp_path / "out").exists()
    done = subprocess.run([sys.executable, "-m", "pgconvert", "convert", str(copy), str(tmp_path / "cli"),
                           "--dst-format", "torch_dist", "--dst-tp", "1"], capture_output=True, text=True)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    assert "no optimizer record" in done.stderr or "has global shape" in done.stderr
    assert not (tmp_path / "cli").exists()
    report = pgconvert.convert(copy, tmp_path / "model", dst_format="megatron", dst_tp=1, skip_optimizer=True)
    assert (tmp_path / "model" / "latest_checkpointed_iteration.txt").is_file(), report.notices


def test_param_group_members_that_disagree_are_named(copy: Path, tmp_path: Path) -> None:
    """A no-weight-decay parameter whose stored ``wd_mult`` is the decayed one's (its bytes entry pointed at the
    output layer's): the groups megatron-core builds cannot be rebuilt, so the state is refused by name."""
    meta = "optimizer.param_to_group_meta.module.module.module."
    target, donor = meta + "decoder.final_layernorm.weight.wd_mult", meta + "output_layer.weight.wd_mult"

    def repoint(metadata: Any) -> None:
        (info,) = [info for index, info in metadata.storage_data.items() if index.fqn == donor]
        metadata.storage_data = {index: info if index.fqn == target else held
                                 for index, held in metadata.storage_data.items()}

    rewrite_dcp_metadata(copy / "iter_0000002", repoint)
    with pytest.raises(OptimizerLayoutError, match=r"decoder\.final_layernorm\.weight = .*'wd_mult': 1\.0.* differs "
                                                   r"from .*0\.0.* param group 1"):
        pgconvert.convert(copy, tmp_path / "out", dst_format="megatron", dst_tp=1)
    assert not (tmp_path / "out").exists()


def test_fp16_run_is_refused_by_name(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Megatron-FSDP saves no grad scaler: an fp16 run's state (the golden's args made fp16's) is not carried, which a
    notice names and --strict refuses."""
    from pgconvert.loaders.fsdp_dtensor.reader import FsdpDtensorSource

    opened = FsdpDtensorSource.__init__

    def as_fp16(self: FsdpDtensorSource, *args: Any, **kwargs: Any) -> None:
        opened(self, *args, **kwargs)
        self.megatron_args.fp16, self.megatron_args.bf16 = True, False

    monkeypatch.setattr(FsdpDtensorSource, "__init__", as_fp16)
    refusal = "an fp16 run's Megatron-FSDP checkpoint holds no grad scaler"
    with pytest.raises(StrictModeError, match=refusal):
        pgconvert.convert(GOLDEN, tmp_path / "strict", dst_format="megatron", dst_tp=1, strict=True)
    assert not (tmp_path / "strict").exists()
    report = pgconvert.convert(GOLDEN, tmp_path / "out", dst_format="megatron", dst_tp=1)
    assert any(refusal in notice for notice in report.notices), report.notices
    assert not list((tmp_path / "out").rglob("distrib_optim.pt"))


def test_dry_run_lists_the_carried_state(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "pgconvert", "convert", str(GOLDEN), str(tmp_path / "out"),
                           "--dst-format", "megatron", "--dst-tp", "2", "--dtype", "bf16", "--dry-run"],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "iter_0000002/mp_rank_01/distrib_optim.pt  + flat buffers (distributed)" in done.stdout
    assert not (tmp_path / "out").exists()
