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

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from support.mcore_optimizer_step import COLUMN_PARALLEL, GATED, ROW_PARALLEL
from support.megatron_fixtures import allowed_globals, load_for_test

pytest.importorskip("megatron.core", reason="megatron-core's own optimizer is the acceptance check")

GOLDENS = Path(__file__).parent / "data" / "megatron_lm"
SCRIPT = Path(__file__).parent / "support" / "mcore_optimizer_step.py"
FP32_RTOL, FP32_ATOL = 1e-6, 1e-9
BF16_RTOL, BF16_ATOL = 2 ** -7, 0.0
KEYS = ("param", "exp_avg", "exp_avg_sq")


def join_tp(name: str, pieces: list[torch.Tensor], swiglu: bool) -> torch.Tensor:
    """The whole parameter from its TP pieces (in TP rank order), by Megatron's rules for a dense GPT."""
    if name.endswith(ROW_PARALLEL):
        return torch.cat(pieces, dim=1)
    if name.endswith(GATED) and swiglu:  # each piece is [gate_i; up_i]
        halves = [piece.chunk(2, dim=0) for piece in pieces]
        return torch.cat([gate for gate, _ in halves] + [up for _, up in halves], dim=0)
    if name.endswith(COLUMN_PARALLEL) or name.endswith(GATED):
        return torch.cat(pieces, dim=0)
    assert pieces[0].dim() == 1, name
    for piece in pieces[1:]:
        assert torch.equal(piece, pieces[0]), f"{name}: replicated pieces differ"
    return pieces[0]


def _states(results: list[dict], when: str) -> dict[tuple[str, int], dict[str, torch.Tensor]]:
    """(name, tp rank) -> whole local tensors, from whole (plain) or DP-sliced (distributed) entries."""
    flat: dict[tuple[str, int], dict[str, torch.Tensor]] = {}
    for result in results:
        for name, (offset, tensors) in result[when].items():
            shape = result["weights"][name].shape
            slot = flat.setdefault((name, result["tp_rank"]),
                                   {key: torch.full((shape.numel(),), float("nan")) for key in KEYS})
            for key in KEYS:
                tensor = tensors[key]
                dst = slot[key][offset:offset + tensor.numel()]
                if not dst.isnan().all():  # a DP replica of the plain optimizer holds the same values
                    assert torch.equal(dst, tensor.flatten()), f"{name}.{key}: DP replicas differ"
                dst.copy_(tensor.flatten())
    for (name, tp_rank), slot in flat.items():
        assert not any(tensor.isnan().any() for tensor in slot.values()), f"{name}: not covered by the DP shards"
        shape = next(r["weights"][name].shape for r in results if r["tp_rank"] == tp_rank and name in r["weights"])
        flat[(name, tp_rank)] = {key: tensor.view(shape) for key, tensor in slot.items()}
    return flat


def _joined(results: list[dict], swiglu: bool) -> dict[str, dict[str, torch.Tensor]]:
    """Per canonical name: before.*, after.* (optimizer tensors) and weight, joined over the TP ranks."""
    tp = 1 + max(result["tp_rank"] for result in results)
    names = sorted({name for result in results for name in result["weights"]})
    weights: dict[tuple[str, int], torch.Tensor] = {}
    for result in results:
        for name, weight in result["weights"].items():
            previous = weights.setdefault((name, result["tp_rank"]), weight)
            assert torch.equal(previous, weight), f"{name}: DP replicas' weights differ"
    joined = {name: {"weight": join_tp(name, [weights[(name, rank)] for rank in range(tp)], swiglu)}
              for name in names}
    for when in ("before", "after"):
        states = _states(results, when)
        for name in names:
            for key in KEYS:
                pieces = [states[(name, rank)][key] for rank in range(tp)]
                joined[name][f"{when}.{key}"] = join_tp(name, pieces, swiglu)
    return joined


def _run(grads: Path, runs: list[tuple[Path, Path, int]]) -> list[list[dict]]:
    argv = [str(part) for run in runs for part in run]
    done = subprocess.run([sys.executable, "-W", "ignore", str(SCRIPT), str(grads), *argv], capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    return [[torch.load(path, weights_only=True) for path in sorted(out.glob("rank*.pt"))] for _, out, _ in runs]


def _fixed_gradients(converted: Path, path: Path, scale: float = 1e-2) -> None:
    """A deterministic gradient per parameter (the converted TP1 model's names and shapes), scaled so
    that their global norm (about 3.3; 2.5 for the small torch_dist model at scale 3e-2) exceeds
    clip_grad = 1 and the step clips."""
    model = load_for_test(converted / "iter_0000002" / "mp_rank_00" / "model_optim_rng.pt")["model"]
    generator = torch.Generator().manual_seed(0)
    torch.save({name: torch.randn(tensor.shape, generator=generator) * scale
                for name, tensor in sorted(model.items()) if isinstance(tensor, torch.Tensor)}, path)


def _assert_same_step(target: list[dict], original: list[dict], args: object,
                      weight_tolerance: tuple[float, float]) -> None:
    for when, step in (("before", 2.0), ("after", 3.0)):  # the goldens stopped at iteration 2
        steps = {float(tensors["step"]) for run in (target, original) for result in run
                 for _, tensors in result[when].values()}
        assert steps == {step}, f"Adam's step {when} the optimizer step: {sorted(steps)}"
    norms = {result["grad_norm"] for run in (target, original) for result in run}
    assert min(norms) > args.clip_grad and max(norms) == pytest.approx(min(norms), rel=1e-6)
    expected, actual = _joined(original, args.swiglu), _joined(target, args.swiglu)
    assert sorted(actual) == sorted(expected) and len(actual) == 15
    for name, tensors in actual.items():
        for key in KEYS:
            assert torch.equal(tensors[f"before.{key}"], expected[name][f"before.{key}"]), f"{name} loaded {key}"
            torch.testing.assert_close(tensors[f"after.{key}"], expected[name][f"after.{key}"], rtol=FP32_RTOL,
                                       atol=FP32_ATOL, msg=lambda m: f"{name} {key} after the step: {m}")
        assert not torch.equal(tensors["after.param"], tensors["before.param"]), f"{name}: the step changed nothing"
        rtol, atol = weight_tolerance
        torch.testing.assert_close(tensors["weight"], expected[name]["weight"], rtol=rtol, atol=atol,
                                   msg=lambda m: f"{name} weight after the step: {m}")


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
    _fixed_gradients(tmp_path / "tp1", tmp_path / "grads.pt")
    runs = [(tmp_path / "tp1" / "iter_0000002", tmp_path / f"out_tp1_dp{target_dp}", target_dp)
            for target_dp in target_dps]
    *targets, original = _run(tmp_path / "grads.pt", [*runs, (source / "iter_0000002", tmp_path / "out_src", dp)])
    assert [len(target) for target in targets] == list(target_dps) and len(original) == 4
    args = load_for_test(next((source / "iter_0000002").glob("mp_rank_*/model_optim_rng.pt")))["args"]
    for target in targets:
        _assert_same_step(target, original, args, weight_tolerance)


def _with_common_pt(iteration_dir: Path, copy: Path) -> Path:
    """A copy of a torch_dist checkpoint written by Megatron-LM d98e8a64 (megatron-core 0.20) that
    megatron-core 0.16.1 can open: 0.20 keeps the common state as the DCP object ``common_state``
    (``shard_0_1``), 0.16.1 reads it only from ``common.pt`` (``TorchCommonLoadStrategy.load_common``).
    The object's bytes are read with torch's own DCP reader (kept as bytes: its default planner
    would unpickle them unrestricted), unpickled weights-only as 0.20's ``load_common_state_dict``
    does, and saved as ``common.pt`` (only the container changes: the same objects under the same
    names); the data files are copied unchanged."""
    import io
    import shutil

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import DefaultLoadPlanner

    from pgconvert.formats.megatron import FRAMEWORK_PICKLE

    raw: dict[str, bytes] = {}

    class RawBytes(DefaultLoadPlanner):
        def load_bytes(self, read_item: object, value: io.BytesIO) -> None:
            raw[read_item.dest_index.fqn] = value.read()

    shutil.copytree(iteration_dir, copy)
    with pytest.warns(UserWarning, match="single process"):
        dcp.load({"common_state/shard_0_1": io.BytesIO()}, checkpoint_id=str(copy), planner=RawBytes(), no_dist=True)
    with torch.serialization.safe_globals(allowed_globals()):
        common = torch.load(io.BytesIO(raw["common_state/shard_0_1"]), weights_only=True)
    # pgconvert's pickler writes the stand-ins of Megatron's enums in ``args`` back under their own names
    torch.save(common[0] if isinstance(common, list) else common, copy / "common.pt", pickle_module=FRAMEWORK_PICKLE)
    return copy


@pytest.mark.parametrize(("form", "target_dp"), [("fully_reshardable", 2), ("dp_reshardable", 1)])
def test_megatron_core_loads_the_torch_dist_conversion_and_steps_as_the_original(tmp_path: Path, form: str,
                                                                                 target_dp: int) -> None:
    """torch_dist distributed-optimizer goldens (the small model, bf16, TP2 DP2): pgconvert's TP1
    torch_dist conversion (``fully_reshardable``) is loaded by megatron-core's own
    ``dist_checkpointing.load`` at TP1 (DP2: megatron-core flattens and slices each parameter's state
    for its DP rank; DP1), the golden itself at TP2 DP2 in its own form; one step each, compared as above."""
    import pgconvert

    source = GOLDENS / f"train_tp2dp2_distopt_{form}_torch_dist"
    pgconvert.convert(source, tmp_path / "td1", dst_format="torch_dist", dst_tp=1)
    pgconvert.convert(source, tmp_path / "model", dst_format="megatron", dst_tp=1, skip_optimizer=True)
    _fixed_gradients(tmp_path / "model", tmp_path / "grads.pt", scale=3e-2)
    original_dir = _with_common_pt(source / "iter_0000002", tmp_path / "src")
    runs = [(tmp_path / "td1" / "iter_0000002", tmp_path / "out_td1", target_dp),
            (original_dir, tmp_path / "out_src", 2)]
    target, original = _run(tmp_path / "grads.pt", runs)
    assert len(target) == target_dp and len(original) == 4
    args = load_for_test(original_dir / "common.pt")["args"]
    assert args.use_distributed_optimizer and args.bf16 and args.hidden_size == 16
    _assert_same_step(target, original, args, (BF16_RTOL, BF16_ATOL))
