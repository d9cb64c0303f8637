"""megatron-core's own plain optimizer state in torch_dist, resharded by pgconvert and loaded back.

``mcore_plain_torch_dist.py`` (megatron-core 0.16.1, gloo processes on the CPU): GPTModel + DDP +
``get_megatron_optimizer`` without the distributed optimizer at TP2, in bf16 (Float16OptimizerWithFloat16Params)
and fp32 (FP32Optimizer), two AdamW steps, then ``dist_checkpointing.save`` of the model's and the optimizer's
``sharded_state_dict``. pgconvert converts that to per-rank TP1, to torch_dist TP1 (plain form) and back to torch_dist
TP2; every optimizer tensor equals (``torch.equal``, per parameter) what megatron-core held. Then
``mcore_optimizer_step.py`` has megatron-core ``dist_checkpointing.load`` pgconvert's TP1 torch_dist output into its
optimizer at TP1 and the original at TP2, and step both on the same gradients (``assert_same_step``): what it holds
after loading is equal, the step agrees within FP32_RTOL / FP32_ATOL (one bf16 ulp for bf16 weights).
Megatron-LM's own plain torch_dist run (bf16, TP2 PP2) is loaded the same way.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from support.mcore_step_check import (BF16_ATOL, BF16_RTOL, FP32_ATOL, FP32_RTOL, KEYS, assert_same_step, fixed_gradients,
                                     joined, run_steps, with_common_pt)
from support.optimizer_cli import export_optimizer, run_cli
from support.checkpoint_compare import read_common
from support.torch_dist_forms import FOR_MCORE_016_CLI

pytest.importorskip("megatron.core", reason="megatron-core's own optimizer is the reference")


SCRIPT = Path(__file__).parent / "support" / "mcore_plain_torch_dist.py"
ARGS_FROM = Path(__file__).parent / "data" / "megatron_lm" / "train_tp2dp2_bf16_torch" / "iter_0000002"
PLAIN_TD = Path(__file__).parent / "data" / "megatron_lm" / "train_tp2pp2_bf16_torch_dist"
ITER = "iter_0000002"


@pytest.fixture(scope="module", params=["bf16", "fp32"])
def saved(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    root = tmp_path_factory.mktemp(f"plain_torch_dist_{request.param}") / "src"
    done = subprocess.run([sys.executable, "-W", "ignore", str(SCRIPT), str(ARGS_FROM), str(root), request.param],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    return request.param, root


def _convert(src: Path, dst: Path, *flags: str) -> None:
    result = run_cli("convert", src, dst, "-q", "--strict", *flags, *FOR_MCORE_016_CLI)
    assert result.exit_code == 0, result.output


def _held(root: Path) -> dict[str, dict[str, torch.Tensor]]:
    results = [torch.load(path, weights_only=True) for path in sorted(root.with_suffix(".held").glob("rank*.pt"))]
    assert len(results) == 2
    return joined(results, swiglu=True)


def test_every_optimizer_tensor_megatron_core_saved_survives_the_reshards(saved: tuple[str, Path],
                                                                          tmp_path: Path) -> None:
    dtype, src = saved
    common = read_common(src / ITER)
    assert "param_state_sharding_type" not in str(common["optimizer"])  # megatron-core's plain optimizer
    original = export_optimizer(src, tmp_path / "ex_src")
    held = _held(src)
    assert sorted(original) == sorted(held) and len(held) == 15
    for name, tensors in held.items():  # pgconvert reads what megatron-core's optimizer held
        for key in KEYS:
            assert torch.equal(original[name][key], tensors[f"before.{key}"]), f"{name}.{key}"
        assert float(original[name]["step"]) == 2.0
    _convert(src, tmp_path / "pr1", "--dst-format", "megatron", "--dst-tp", "1")
    _convert(src, tmp_path / "td1", "--dst-format", "torch_dist", "--dst-tp", "1")
    _convert(tmp_path / "td1", tmp_path / "td2", "--dst-format", "torch_dist", "--dst-tp", "2")
    _convert(tmp_path / "pr1", tmp_path / "pr_td2", "--dst-format", "torch_dist", "--dst-tp", "2")
    for name in ("pr1", "td1", "td2", "pr_td2"):
        again = export_optimizer(tmp_path / name, tmp_path / f"ex_{name}")
        assert sorted(again) == sorted(original)
        for parameter, tensors in original.items():
            for key, value in tensors.items():
                assert value.dtype == again[parameter][key].dtype and torch.equal(value, again[parameter][key]), \
                    f"{name}: {parameter}.{key}"


def test_megatron_core_loads_pgconverts_tp1_plain_torch_dist_and_steps_as_the_original(saved: tuple[str, Path],
                                                                                      tmp_path: Path) -> None:
    dtype, src = saved
    _convert(src, tmp_path / "td1", "--dst-format", "torch_dist", "--dst-tp", "1")
    _convert(src, tmp_path / "model", "--dst-format", "megatron", "--dst-tp", "1", "--skip-optimizer")
    fixed_gradients(tmp_path / "model", tmp_path / "grads.pt")
    target, original = run_steps(tmp_path / "grads.pt", [(tmp_path / "td1" / ITER, tmp_path / "out_td1", 1),
                                                     (src / ITER, tmp_path / "out_src", 1)])
    assert len(target) == 1 and len(original) == 2
    args = read_common(src / ITER)["args"]
    assert not args.use_distributed_optimizer and args.bf16 == (dtype == "bf16")
    tolerance = (BF16_RTOL, BF16_ATOL) if dtype == "bf16" else (FP32_RTOL, FP32_ATOL)
    assert_same_step(target, original, args, tolerance)
    held = _held(src)  # megatron-core at TP1 holds exactly what it held at TP2 when it saved
    loaded = joined(target, swiglu=True)
    for name, tensors in held.items():
        for key in KEYS:
            assert torch.equal(loaded[name][f"before.{key}"], tensors[f"before.{key}"]), f"{name}.{key}"


def test_megatron_core_loads_the_conversion_of_megatron_lms_plain_run(tmp_path: Path) -> None:
    """Megatron-LM's own bf16 plain torch_dist run (TP2 PP2, the small model) converted to TP1 torch_dist."""
    _convert(PLAIN_TD, tmp_path / "td1", "--dst-format", "torch_dist", "--dst-tp", "1", "--dst-pp", "1")
    _convert(PLAIN_TD, tmp_path / "model", "--dst-format", "megatron", "--dst-tp", "1", "--dst-pp", "1",
             "--skip-optimizer")
    fixed_gradients(tmp_path / "model", tmp_path / "grads.pt", scale=3e-2)
    original_dir = with_common_pt(PLAIN_TD / ITER, tmp_path / "src")
    target, original = run_steps(tmp_path / "grads.pt", [(tmp_path / "td1" / ITER, tmp_path / "out_td1", 1),
                                                     (original_dir, tmp_path / "out_src", 1)])
    assert len(target) == 1 and len(original) == 4
    args = read_common(original_dir)["args"]
    assert not args.use_distributed_optimizer and args.bf16
    assert_same_step(target, original, args, (BF16_RTOL, BF16_ATOL))
