"""megatron-core's own optimizer accepts pgconvert's resharded optimizer state and takes the same step.

For each training golden written by Megatron-LM (fp32 FP32Optimizer at TP2 PP2; bf16
Float16OptimizerWithFloat16Params at TP2 DP2; bf16 DistributedOptimizer at TP2 DP2), pgconvert
converts it to TP1 PP1 DP1. ``mcore_optimizer_step.py`` (megatron-core 0.16.1 in gloo processes on the
CPU) then builds GPTModel + DDP + ``get_megatron_optimizer`` at each layout, loads the checkpoint with
megatron-core's own ``load_state_dict`` / ``load_parameter_state``, sets the same fixed gradients
(cut per TP rank) and calls ``optimizer.step()``: from the converted checkpoint at TP1 (DP1, and for
the distributed optimizer also DP2, where megatron-core re-pads and scatters the converted flat
buffers), and from the unconverted golden at its own layout (4 ranks). The source ranks' results are joined here by
Megatron's TP rules (concatenation written in this file, not pgconvert's), and:

- what the optimizer holds after loading (fp32 main params, ``exp_avg``, ``exp_avg_sq``) is equal
  (``torch.equal``) at both layouts;
- the gradients are large enough that the step clips them (grad norm > ``clip_grad``), and both
  layouts report the same norm (rtol 1e-6: the TP2/PP2 run sums the squares across ranks);
- after the step, the main params, the moments and the model weights agree within rtol 1e-6 /
  atol 1e-9 (fp32; the clip factor may differ in its last bits) and one bf16 ulp (rtol 2**-7) for
  bf16 weights.

The torch_dist distributed-optimizer goldens (``fully_reshardable``, ``dp_reshardable``; TP2 DP2) are
checked the same way: pgconvert's TP1 torch_dist output is loaded with megatron-core's own
``dist_checkpointing.load`` (TP1 DP2 and DP1), the golden at TP2 DP2.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from support.mcore_step_check import (BF16_ATOL, BF16_RTOL, FP32_ATOL, FP32_RTOL, assert_same_step, fixed_gradients,
                                     run_steps, with_common_pt)
from support.megatron_fixtures import load_for_test
from support.checkpoint_compare import read_common
from support.torch_dist_forms import FOR_MCORE_016

pytest.importorskip("megatron.core", reason="megatron-core's own optimizer is the acceptance check")

GOLDENS = Path(__file__).parent / "data" / "megatron_lm"


@pytest.mark.parametrize(("golden", "dp", "target_dps", "weight_tolerance"), [
    ("train_tp2pp2_torch", 1, (1,), (FP32_RTOL, FP32_ATOL)),
    ("train_tp2dp2_bf16_torch", 2, (1,), (BF16_RTOL, BF16_ATOL)),
    # TP1 at DP1 and DP2: megatron-core re-pads and scatters the converted flat buffers over its DP ranks.
    ("train_tp2dp2_distopt_bf16_torch", 2, (1, 2), (BF16_RTOL, BF16_ATOL)),
], ids=["fp32-tp2pp2", "bf16-tp2dp2", "distributed-bf16-tp2dp2"])
def test_megatron_core_steps_the_converted_state_as_the_original(tmp_path: Path, golden: str, dp: int,
                                                                 target_dps: tuple[int, ...],
                                                                 weight_tolerance: tuple[float, float]) -> None:
    import pgconvert

    source = GOLDENS / golden
    pgconvert.convert(source, tmp_path / "tp1", dst_tp=1, dst_pp=1)
    fixed_gradients(tmp_path / "tp1", tmp_path / "grads.pt")
    runs = [(tmp_path / "tp1" / "iter_0000002", tmp_path / f"out_tp1_dp{target_dp}", target_dp)
            for target_dp in target_dps]
    *targets, original = run_steps(tmp_path / "grads.pt", [*runs, (source / "iter_0000002", tmp_path / "out_src", dp)])
    assert [len(target) for target in targets] == list(target_dps) and len(original) == 4
    args = load_for_test(next((source / "iter_0000002").glob("mp_rank_*/model_optim_rng.pt")))["args"]
    for target in targets:
        assert_same_step(target, original, args, weight_tolerance)


@pytest.mark.parametrize(("form", "target_dp"), [("fully_reshardable", 2), ("dp_reshardable", 1)])
def test_megatron_core_loads_the_torch_dist_conversion_and_steps_as_the_original(tmp_path: Path, form: str,
                                                                                 target_dp: int) -> None:
    """torch_dist distributed-optimizer goldens (the small model, bf16, TP2 DP2): pgconvert's TP1
    torch_dist conversion (``fully_reshardable``) is loaded by megatron-core's own
    ``dist_checkpointing.load`` at TP1 (DP2: megatron-core flattens and slices each parameter's state
    for its DP rank; DP1), the golden itself at TP2 DP2 in its own form; one step each, compared as above."""
    import pgconvert

    source = GOLDENS / f"train_tp2dp2_distopt_{form}_torch_dist"
    pgconvert.convert(source, tmp_path / "td1", dst_format="torch_dist", dst_tp=1, **FOR_MCORE_016)
    pgconvert.convert(source, tmp_path / "model", dst_format="megatron", dst_tp=1, skip_optimizer=True)
    fixed_gradients(tmp_path / "model", tmp_path / "grads.pt", scale=3e-2)
    original_dir = with_common_pt(source / "iter_0000002", tmp_path / "src")
    runs = [(tmp_path / "td1" / "iter_0000002", tmp_path / "out_td1", target_dp),
            (original_dir, tmp_path / "out_src", 2)]
    target, original = run_steps(tmp_path / "grads.pt", runs)
    assert len(target) == target_dp and len(original) == 4
    args = read_common(original_dir)["args"]
    assert args.use_distributed_optimizer and args.bf16 and args.hidden_size == 16
    assert_same_step(target, original, args, (BF16_RTOL, BF16_ATOL))
