"""Optimizer state carried to another ``--dtype``: the fp32 masters stay the source of truth.

The Megatron-LM goldens (bf16 Float16OptimizerWithFloat16Params and DistributedOptimizer at TP2 DP2, fp32
FP32Optimizer at TP2 PP2, the bf16 dp_reshardable torch_dist run) are converted to TP1 in the other dtype.
megatron-core 0.16.1 (``mcore_optimizer_step.py``, gloo processes on the CPU) builds the run in the new dtype,
loads the conversion with its own ``load_state_dict`` / ``load_parameter_state`` / ``dist_checkpointing.load`` and
steps once on fixed gradients (values a bf16 gradient buffer holds exactly, so both runs see the same gradients):

- what its optimizer holds after loading (fp32 main params, both moments) equals the original run's, bit for bit.
  A float32 run's main params are its model weights: the weights were written from the masters, not widened;
- after the step the main params and moments agree with the original's within fp32 rtol 1e-6 / atol 1e-9, and the
  model's weights are the main params (rounded once to bf16 for a bf16 run).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import pgconvert
from pgconvert.cli import main
from support.checkpoint_compare import read_common
from support.mcore_step_check import FP32_ATOL, FP32_RTOL, KEYS, fixed_gradients, joined, run_steps, with_common_pt
from support.megatron_fixtures import load_for_test
from support.moe_optimizer_runs import assert_round_trip
from support.torch_dist_forms import FOR_MCORE_016

GOLDENS = Path(__file__).parent / "data" / "megatron_lm"
ITERATION = "iter_0000002"
# golden, its data-parallel size, the dtype it is converted to
PER_RANK = (("train_tp2dp2_distopt_bf16_torch", 2, "fp32"), ("train_tp2dp2_bf16_torch", 2, "fp32"),
            ("train_tp2pp2_torch", 1, "bf16"))
TORCH_DIST = "train_tp2dp2_distopt_dp_reshardable_torch_dist"


def _bf16_exact_gradients(model: Path, path: Path, scale: float) -> None:
    """``fixed_gradients`` rounded to values bf16 holds exactly: a bf16 and an fp32 gradient buffer hold the same."""
    fixed_gradients(model, path, scale)
    grads = torch.load(path, weights_only=True)
    torch.save({name: grad.to(torch.bfloat16).float() for name, grad in grads.items()}, path)


def _rank_args(iteration_dir: Path) -> object:
    return load_for_test(next(iteration_dir.glob("mp_rank_*/model_optim_rng.pt")))["args"]


def _assert_steps_as_the_original(target: list[dict], original: list[dict], args: object) -> None:
    expected, actual = joined(original, args.swiglu), joined(target, args.swiglu)
    assert sorted(actual) == sorted(expected) and actual
    assert target[0]["grad_norm"] == pytest.approx(original[0]["grad_norm"], rel=1e-6)
    for name, tensors in actual.items():
        for key in KEYS:
            assert torch.equal(tensors[f"before.{key}"], expected[name][f"before.{key}"]), f"{name} loaded {key}"
            torch.testing.assert_close(tensors[f"after.{key}"], expected[name][f"after.{key}"], rtol=FP32_RTOL,
                                       atol=FP32_ATOL, msg=lambda m: f"{name} {key} after the step: {m}")
        weight = tensors["weight"]
        assert torch.equal(weight, tensors["after.param"].to(weight.dtype)), f"{name}: weight is not its master"


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("dtype")
    out = {}
    for golden, _, dtype in PER_RANK:
        out[golden] = root / golden
        pgconvert.convert(GOLDENS / golden, out[golden], dst_tp=1, dst_pp=1, dtype=dtype)
    out[TORCH_DIST] = root / TORCH_DIST
    pgconvert.convert(GOLDENS / TORCH_DIST, out[TORCH_DIST], dst_format="torch_dist", dst_tp=1, dtype="fp32",
                      dst_optim_form="dp_reshardable", dst_dp=1, **FOR_MCORE_016)
    return out


def test_megatron_core_steps_a_run_carried_to_another_dtype_as_the_original(converted: dict[str, Path],
                                                                            tmp_path: Path) -> None:
    grads = tmp_path / "grads.pt"
    _bf16_exact_gradients(converted["train_tp2dp2_bf16_torch"], grads, 1e-2)
    runs = [(converted[golden] / ITERATION, tmp_path / f"target_{golden}", 1) for golden, _, _ in PER_RANK]
    runs += [(GOLDENS / golden / ITERATION, tmp_path / f"original_{golden}", dp) for golden, dp, _ in PER_RANK]
    small = tmp_path / "small.pt"
    pgconvert.convert(GOLDENS / TORCH_DIST, tmp_path / "small", dst_format="megatron", dst_tp=1, skip_optimizer=True)
    _bf16_exact_gradients(tmp_path / "small", small, 3e-2)
    results = run_steps(grads, runs)
    original_dir = with_common_pt(GOLDENS / TORCH_DIST / ITERATION, tmp_path / "src")
    target_td, original_td = run_steps(small, [(converted[TORCH_DIST] / ITERATION, tmp_path / "target_td", 1),
                                               (original_dir, tmp_path / "original_td", 2)])
    for index, (golden, _, dtype) in enumerate(PER_RANK):
        target, original = results[index], results[index + len(PER_RANK)]
        args = _rank_args(GOLDENS / golden / ITERATION)
        assert _rank_args(converted[golden] / ITERATION).bf16 == (dtype == "bf16") != args.bf16
        _assert_steps_as_the_original(target, original, args)
    args = read_common(original_dir)["args"]
    assert args.bf16 and not read_common(converted[TORCH_DIST] / ITERATION)["args"].bf16
    _assert_steps_as_the_original(target_td, original_td, args)


@pytest.mark.parametrize("golden", ["train_tp2dp2_distopt_bf16_torch", "train_tp2dp2_bf16_torch"])
def test_bf16_to_fp32_and_back_is_the_original_run(converted: dict[str, Path], tmp_path: Path, golden: str) -> None:
    """The fp32 weights are the masters (some differ from the bf16 weights widened); back in bf16 at TP2 the rank
    files' model, optimizer and iteration and the distributed optimizer's buffers are the original's, bit for bit."""
    source = GOLDENS / golden / ITERATION
    widened = load_for_test(source / "mp_rank_00" / "model_optim_rng.pt")["model"]
    written = load_for_test(converted[golden] / ITERATION / "mp_rank_00" / "model_optim_rng.pt")["model"]
    name = "decoder.layers.0.mlp.linear_fc2.weight"
    assert written[name].dtype == torch.float32
    assert not torch.equal(written[name].chunk(2, dim=1)[0], widened[name].float())
    assert torch.equal(written[name].chunk(2, dim=1)[0].to(torch.bfloat16), widened[name])
    pgconvert.convert(converted[golden], tmp_path / "back", dst_tp=2, dst_pp=1, dtype="bf16")
    assert_round_trip(GOLDENS / golden, tmp_path / "back")


def test_worker_processes_write_the_masters_as_one_process_does(tmp_path: Path) -> None:
    source = GOLDENS / "train_tp2dp2_distopt_bf16_torch"
    pgconvert.convert(source, tmp_path / "one", dst_tp=2, dtype="fp32")
    report = pgconvert.convert(source, tmp_path / "workers", dst_tp=2, dtype="fp32", workers=2)
    assert_round_trip(tmp_path / "one", tmp_path / "workers")
    assert load_for_test(tmp_path / "workers" / ITERATION / "mp_rank_01" / "model_optim_rng.pt")["args"].bf16 is False
    assert any("megatron-core 0.16.1 (and Megatron-LM main) raises loading it" in note for note in report.notices)


def test_into_fp16_the_optimizer_state_is_named_and_not_carried(tmp_path: Path) -> None:
    src = GOLDENS / "train_tp2dp2_bf16_torch"
    loose = CliRunner().invoke(main, ["convert", str(src), str(tmp_path / "out"), "--dst-tp", "1", "--dtype", "fp16"],
                               prog_name="pgconvert")
    assert loose.exit_code == 0, loose.output
    assert "--dtype float16: the optimizer state of a bfloat16 run is not carried into float16" in loose.output
    written = load_for_test(tmp_path / "out" / ITERATION / "mp_rank_00" / "model_optim_rng.pt")
    assert "optimizer" not in written and written["model"]["embedding.word_embeddings.weight"].dtype == torch.float16
