"""megatron-core's optimizer step on a converted checkpoint and on its source, compared: the gloo run of
``mcore_optimizer_step.py``, the fixed gradients it applies, and the comparison of what each run's optimizer held
before and after the step (the source's TP ranks joined by Megatron's TP rules, written here)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from support.mcore_optimizer_step import COLUMN_PARALLEL, GATED, ROW_PARALLEL
from support.megatron_fixtures import allowed_globals, load_for_test

SCRIPT = Path(__file__).parent / "mcore_optimizer_step.py"
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


def joined(results: list[dict], swiglu: bool) -> dict[str, dict[str, torch.Tensor]]:
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


def run_steps(grads: Path, runs: list[tuple[Path, Path, int]], python: str = sys.executable) -> list[list[dict]]:
    """``mcore_optimizer_step.py`` over ``runs`` (iteration dir, output dir, DP) in one child process of ``python``
    (an interpreter with megatron-core: by default this one; another finds pgconvert and the test support here)."""
    argv = [str(part) for run in runs for part in run]
    repo = SCRIPT.resolve().parents[2]
    env = None if python == sys.executable else dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(repo), str(repo / "tests"), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([python, "-W", "ignore", str(SCRIPT), str(grads), *argv], capture_output=True,
                          text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    return [[torch.load(path, weights_only=True) for path in sorted(out.glob("rank*.pt"))] for _, out, _ in runs]


def fixed_gradients(converted: Path, path: Path, scale: float = 1e-2) -> None:
    """A deterministic gradient per parameter (the converted TP1 model's names and shapes), scaled so
    that their global norm (about 3.3; 2.5 for the small torch_dist model at scale 3e-2) exceeds
    clip_grad = 1 and the step clips."""
    model = load_for_test(converted / "iter_0000002" / "mp_rank_00" / "model_optim_rng.pt")["model"]
    generator = torch.Generator().manual_seed(0)
    torch.save({name: torch.randn(tensor.shape, generator=generator) * scale
                for name, tensor in sorted(model.items()) if isinstance(tensor, torch.Tensor)}, path)


def assert_same_step(target: list[dict], original: list[dict], args: object,
                      weight_tolerance: tuple[float, float]) -> None:
    for when, step in (("before", 2.0), ("after", 3.0)):  # the goldens stopped at iteration 2
        steps = {float(tensors["step"]) for run in (target, original) for result in run
                 for _, tensors in result[when].values()}
        assert steps == {step}, f"Adam's step {when} the optimizer step: {sorted(steps)}"
    norms = {result["grad_norm"] for run in (target, original) for result in run}
    assert min(norms) > args.clip_grad and max(norms) == pytest.approx(min(norms), rel=1e-6)
    expected, actual = joined(original, args.swiglu), joined(target, args.swiglu)
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


def with_common_pt(iteration_dir: Path, copy: Path) -> Path:
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
