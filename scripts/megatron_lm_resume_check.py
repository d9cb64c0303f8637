"""Megatron-LM accepts pgconvert's resharded optimizer state and resumes as the original would.

    PGCONVERT_MEGATRON_LM=/path/to/Megatron-LM PGCONVERT_MEGATRON_LM_PYTHON=/venv/python \
        python scripts/megatron_lm_resume_check.py WORKDIR [CASE ...]

Cases (``CASES``; all of them when none is named), each a checkpoint at iteration 2 written by
Megatron-LM's own ``save_checkpoint``:

- ``tp2pp2_torch``: golden ``train_tp2pp2_torch`` (fp32, plain optimizer, per-rank files), TP2 PP2 -> TP1 PP1;
- ``tp2dp2_distopt_bf16_torch``: golden ``train_tp2dp2_distopt_bf16_torch`` (bf16, distributed optimizer,
  per-rank files with ``distrib_optim.pt``), TP2 DP2 -> TP1 DP1;
- ``tp2pp2_distopt_bf16_torch_dist``: golden ``train_tp2pp2_distopt_dp_reshardable_torch_dist`` (bf16,
  distributed optimizer, torch_dist ``dp_reshardable``, the smaller model), TP2 PP2 -> TP1 PP1, written
  as ``dp_reshardable`` for DP1;
- ``moe_ep2_distopt_torch_dist``: a MoE run that Megatron-LM trains here first (fp32, 4 experts, top-2
  routing, SequentialMLP, distributed optimizer, torch_dist ``dp_reshardable``, the smaller model, TP1
  EP2 DP2 on 2 ranks, ``MOE_FLAGS``), EP2 -> EP1 on one rank (dense and expert optimizers chained);
- ``muon_tp2dp2_bf16_torch``: golden ``train_tp2dp2_muon_bf16_torch`` (bf16, plain Muon: ``--optimizer muon``
  without the distributed optimizer, per-rank files holding the chained Muon and Adam optimizers' state, the
  smaller model), TP2 DP2 -> TP1 DP1, and (``muon_tp2dp2_bf16_torch_to_pp2``) -> TP1 PP2 on two ranks, each
  stage's chained Muon and Adam optimizers its own layer's; Megatron-LM's Muon needs emerging-optimizers in
  ``PGCONVERT_MEGATRON_LM_PYTHON``'s environment (``scripts/make_megatron_lm_goldens.py`` says how);
- ``muon_layer_wise_dp_reshardable_torch_dist``: golden ``train_tp2dp2_muon_layer_wise_dp_reshardable_torch_dist``
  (bf16, Muon with the layer-wise distributed optimizer, torch_dist ``dp_reshardable``), TP2 DP2 -> TP1 DP2 on two
  ranks, and (``..._to_pp2``) -> TP1 PP2 DP2 on four, each stage with its own layer-wise and distributed Adam
  optimizers; ``muon_layer_wise_fully_reshardable_torch_dist`` (its ``fully_reshardable`` save) -> TP1 DP1;
- ``muon_moe_ep2_torch_dist``: golden ``train_tp1ep2dp4_muon_moe_bf16_torch_dist`` (bf16, plain Muon with 4 experts:
  Muon's dense and expert optimizers and Adam's chained, torch_dist), EP2 DP4 -> EP1 DP1 on one rank, in torch_dist
  and (``..._to_torch``) in per-rank files;
- ``muon_layer_wise_moe_ep2_torch_dist``: golden ``train_tp1ep2dp4_muon_layer_wise_moe_dp_reshardable_torch_dist``
  (the same MoE run with the layer-wise distributed optimizer: its dense and expert groups, a distributed Adam),
  EP2 DP4 -> EP1 DP2 on two ranks, and (``..._to_ep4``) -> EP4 DP4 on four;
- ``muon_lion_tp2dp2_bf16_torch``: golden ``train_tp2dp2_muon_lion_bf16_torch`` (bf16, plain Muon with Lion for the
  embedding, output layer and norms: ``--muon-scalar-optimizer lion``, per-rank files), TP2 DP2 -> TP1 DP1, and
  ``muon_lion_tp2dp2_bf16_torch_dist`` (the same run's torch_dist save) -> TP1 PP2 on two ranks;
- ``lion_tp2dp2_bf16_torch``: golden ``train_tp2dp2_lion_bf16_torch`` (bf16, ``--optimizer lion``: Lion for the 2-dim
  weights chained with Adam, per-rank files), TP2 DP2 -> TP1 DP1, and ``lion_layer_wise_dp_reshardable_torch_dist``
  (``--use-distributed-optimizer``: the layer-wise distributed optimizer, torch_dist ``dp_reshardable``) -> TP1 DP2
  on two ranks.

Per case:

1. pgconvert converts the checkpoint to the new layout (``--no-load-rng`` is then needed: RNG state
   is not carried);
2. Megatron-LM's ``pretrain_gpt.py`` (through ``megatron_lm_cpu_train.py``) builds the model and its
   optimizer at the new layout, loads that checkpoint with its own ``load_checkpoint`` (model,
   ``optimizer.load_state_dict``, for the distributed optimizer ``load_parameter_state`` of
   ``distrib_optim.pt`` or the torch_dist records, scheduler; ``--no-load-rng``) and trains
   iterations 3 to 5 on the mock data, saving at 3 and 5; the same from the unconverted checkpoint
   at its own layout;
3. the ``lm loss`` Megatron-LM prints for iterations 3, 4 and 5 (``%.6E``, 7 significant digits) must
   agree: fp32 within ``FP32_LOSS_RTOL`` (1e-6 relative), bf16 within ``BF16_LOSS_RTOL`` (5e-5; see
   their comment);
   iteration 3's loss checks the loaded weights, 4 and 5 the optimizer state (moments, step,
   scheduler) that the step from 3 used;
4. both iteration-3 checkpoints are exported per parameter (``pgconvert export-optimizer``) and every
   fp32 main weight, ``exp_avg`` and ``exp_avg_sq`` (a Muon parameter's ``momentum_buffer``) must agree:
   fp32 within rtol 1e-5 / atol 1e-7 (another layout sums partial products in another order); bf16
   within ``BF16_TOLERANCES`` (the forward and backward round in bf16 in another order); step 3
   everywhere (Adam's). The largest weight update of the step is printed beside the differences, for scale.

Megatron-LM limitations worked around (on the CPU only, opt-in, set here for the distributed-optimizer
runs): its ``DistributedOptimizer`` cannot resume with torch's Adam (no Apex/Transformer Engine, as on
a CPU) at Megatron-LM d98e8a64, not even from its own unconverted checkpoint: ``KeyError: 'step'``
(per-rank), an ``AssertionError`` before a torch_dist load, one ``step`` shared by every parameter, a
stale step copied over the loaded one (``dp_reshardable``); and on any device a ``dp_reshardable`` load
of fp32 weights (the MoE case) raises ``RuntimeError: a view of a leaf Variable that requires grad is
being used in an in-place operation`` (megatron/core/optimizer/distrib_optimizer.py:2071, no
``torch.no_grad()``; the copy at 1225). ``PGCONVERT_FIX_DISTOPT_STEP=1`` makes the launcher install
``install_distopt_step_fix`` and ``install_distopt_sharded_load_fix``; their docstrings give
Megatron-LM's file and lines.

Exit 0 when every case agrees; the Megatron log tail otherwise. Without ``PGCONVERT_MEGATRON_LM``
(CI cannot fetch Megatron-LM) it says so and exits 2; the test that runs it skips there.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from interop_megatron_lm import _megatron_env  # noqa: E402
from make_megatron_lm_goldens import GOLDENS, LAUNCHER, MODEL_FLAGS, SMALL_MODEL_FLAGS, megatron_train  # noqa: E402

RTOL, ATOL = 1e-5, 1e-7
SAVED, LAST = 3, 5  # the resumed runs save at iteration 3 (compared state) and end at 5
RUNS = ("resumed_converted", "resumed_original")
LOSS = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?\| lm loss: ([0-9.E+-]+) \|")


def resume(load: Path, save: Path, nproc: int, port: int, flags: list[str]) -> dict[int, str]:
    """Iterations 3 to 5 of pretrain_gpt.py from ``load``, saved into ``save`` at 3 and 5; the
    ``lm loss`` Megatron-LM printed for each iteration, as printed."""
    python, env, source = _megatron_env()
    env = dict(env, OMP_NUM_THREADS="1", PGCONVERT_FIX_DISTOPT_STEP="1" if "--use-distributed-optimizer" in flags else "0")
    model_flags = list(MODEL_FLAGS)
    for name, value in (("--train-iters", LAST), ("--save-interval", SAVED)):
        model_flags[model_flags.index(name) + 1] = str(value)
    cmd = [python, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-port", str(port),
           str(LAUNCHER), str(source), *model_flags, *flags, "--load", str(load), "--save", str(save),
           "--no-load-rng", "--use-checkpoint-opt_param-scheduler"]
    print("$", " ".join(cmd[1:]), flush=True)
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    log = done.stdout + done.stderr
    saved = all(f"successfully saved checkpoint from iteration {i:7d}" in log for i in (SAVED, LAST))
    losses = {int(i): loss for i, loss in LOSS.findall(log)}
    if done.returncode != 0 or not saved or sorted(losses) != list(range(SAVED, LAST + 1)):
        raise SystemExit(f"Megatron-LM resume from {load} failed (exit {done.returncode}, losses {losses}):\n"
                         f"{log[-6000:]}")
    shims = sorted({line.strip() for line in log.splitlines() if "shim]" in line and ":" in line})
    print("  shims used:\n    " + "\n    ".join(shims), flush=True)
    return losses


def compare_losses(converted: dict[int, str], original: dict[int, str], rtol: float) -> str:
    """The printed losses side by side (printed); raises when a pair differs by more than ``rtol`` of the original's."""
    rows, far = [], []
    for iteration in sorted(original):
        a, b = float(converted[iteration]), float(original[iteration])
        rows.append(f"{iteration}: {converted[iteration]} / {original[iteration]} (rel {abs(a - b) / abs(b):.1e})")
        if abs(a - b) > rtol * abs(b):
            far.append(iteration)
    line = "; ".join(rows)
    print(f"  lm loss (converted / original): {line}", flush=True)
    if far:
        raise SystemExit(f"lm loss of iterations {far} more than rtol {rtol:g} apart: {line}")
    return line


def compare(a: Path, b: Path, tolerances: dict[str, tuple[float, float, float]]) -> dict[str, float]:
    """Largest absolute difference per exported key compared; raises when outside ``tolerances``: per key
    (rtol, atol, fraction), where the atol used is ``atol + fraction * max |b[key]|`` of each tensor."""
    worst: dict[str, float] = {}
    names = sorted(p.name for p in a.glob("*.pt"))
    if not names or names != sorted(p.name for p in b.glob("*.pt")):
        raise SystemExit(f"{a} and {b} hold different parameters")
    for name in names:
        x, y = torch.load(a / name, weights_only=True), torch.load(b / name, weights_only=True)
        if set(x) != set(y) or not set(x) & set(tolerances) - {"param"}:
            raise SystemExit(f"{name}: fields {sorted(x)} / {sorted(y)}, tolerances for {sorted(tolerances)}")
        for key, (rtol, atol, fraction) in tolerances.items():
            if key not in y:  # Adam's moments, or a Muon parameter's momentum buffer
                continue
            atol += fraction * y[key].abs().max().item()
            torch.testing.assert_close(x[key], y[key], rtol=rtol, atol=atol, msg=lambda m: f"{name} {key}: {m}")
            worst[key] = max(worst.get(key, 0.0), (x[key] - y[key]).abs().max().item())
        steps = [float(state["step"]) for state in (x, y) if "step" in state]  # Muon keeps none
        if steps and steps != [SAVED, SAVED]:
            raise SystemExit(f"{name}: step {steps}, expected {SAVED}")
    return worst


def largest_update(before: Path, after: Path) -> float:
    """max |param(iteration 3) - param(iteration 2)|: the size of the step the two runs took."""
    return max((torch.load(after / p.name, weights_only=True)["param"]
                - torch.load(p, weights_only=True)["param"]).abs().max().item() for p in before.glob("*.pt"))


@dataclass(frozen=True)
class Case:
    """A checkpoint at iteration 2 (a golden, or ``train`` flags for Megatron-LM to make it here), the
    layout pgconvert converts it to (``target``: ``convert`` options) and the pretrain_gpt.py flags of
    each resumed run (the converted one on ``converted_ranks`` ranks)."""

    source: str
    target: dict[str, int]
    converted_flags: list[str]
    original: tuple[int, list[str]]
    bf16: bool
    train: list[str] = field(default_factory=list)
    converted_ranks: int = 1


def prepare(work: Path, name: str, case: Case, port: int) -> Path:
    """The case's iteration-2 checkpoint: its golden, or Megatron-LM's run made here."""
    if not case.train:
        return GOLDENS / case.source
    source = work / name / case.source
    if not (source / "latest_checkpointed_iteration.txt").is_file():
        megatron_train(source, case.train, port, case.original[0])
    return source


def check(work: Path, name: str, case: Case, port: int) -> str:
    from pgconvert import convert
    from pgconvert.optimizer.export import export_from_path

    source, out = prepare(work, name, case, port), work / name
    for stale in ("converted", *RUNS, *(f"{run}_state" for run in (*RUNS, "source"))):
        shutil.rmtree(out / stale, ignore_errors=True)
    convert(source, out / "converted", **case.target)
    converted = resume(out / "converted", out / "resumed_converted", case.converted_ranks, port + 1,
                       case.converted_flags)
    original = resume(source, out / "resumed_original", case.original[0], port + 2, case.original[1])
    for run, path, iteration in (*((run, out / run, SAVED) for run in RUNS), ("source", source, 2)):
        export_from_path(path, out / f"{run}_state", iteration)
    update = largest_update(out / "source_state", out / "resumed_original_state")
    # Lion moves each weight by +-lr (the sign of its update): where bf16 rounding flips the sign of a tiny entry,
    # the two runs' weights end up two updates apart
    allowed = update * (2 if "lion" in case.converted_flags else 1)
    tolerances = dict(BF16_TOLERANCES, param=(0.0, allowed, 0.0)) if case.bf16 else FP32_TOLERANCES
    losses = compare_losses(converted, original, BF16_LOSS_RTOL if case.bf16 else FP32_LOSS_RTOL)
    worst = compare(out / "resumed_converted_state", out / "resumed_original_state", tolerances)
    figures = ", ".join(f"{key} {value:.3g}" for key, value in worst.items())
    return (f"{name}: resumed at {case.target} (converted) and at the original layout agree: lm loss "
            f"(converted / original) {losses}; iteration-3 state max |diff| {figures} (tolerances (rtol, "
            f"atol, fraction of max|x|): {tolerances}); largest weight update of the step {update:.3g}")


TP = "--tensor-model-parallel-size"
PP = "--pipeline-model-parallel-size"
DISTOPT = ["--use-distributed-optimizer", "--bf16"]
MUON = ["--optimizer", "muon", "--bf16"]  # plain Muon: without --use-distributed-optimizer
LAYER_WISE = [*MUON, "--use-distributed-optimizer", "--no-save-rng", *SMALL_MODEL_FLAGS]  # the layer-wise optimizer
TORCH, TORCH_DIST = ["--ckpt-format", "torch"], ["--ckpt-format", "torch_dist"]
# The plain Muon MoE golden's run: 4 experts, top-2 routing, the allgather dispatcher, global batch 4.
MUON_MOE = [*MUON, "--num-experts", "4", "--moe-router-topk", "2", "--moe-token-dispatcher-type", "allgather",
            "--global-batch-size", "4", *TORCH_DIST, "--no-save-rng", *SMALL_MODEL_FLAGS]
LAYER_WISE_MOE = [*MUON_MOE, "--use-distributed-optimizer"]  # the same run with the layer-wise optimizer
MUON_LION = [*MUON, "--muon-scalar-optimizer", "lion", "--no-save-rng", *SMALL_MODEL_FLAGS]  # Lion for the rest
LION = ["--optimizer", "lion", "--bf16", "--no-save-rng", *SMALL_MODEL_FLAGS]  # Lion for the 2-dim weights, Adam else
FP32_TOLERANCES = dict.fromkeys(("param", "exp_avg", "exp_avg_sq"), (RTOL, ATOL, 0.0))
# bf16 forward and backward: the TP1 and TP2 x DP2 runs round activations and gradients in other
# orders, so iteration 3's gradients differ by up to ~1% of each tensor's largest gradient (measured:
# 0.5-0.9%, a few bf16 ulps). The moments inherit that (measured: exp_avg 0.6%, exp_avg_sq 1.3% of
# their largest entry); Adam's normalised update amplifies it where v is small, so a main param may
# differ by up to one step's update (measured 64% of it, the embedding), and no more. A misplaced or
# mis-ordered state differs by the size of the values themselves (~100% of max |x|).
BF16_TOLERANCES = {"exp_avg": (0.0, 0.0, 3e-2), "exp_avg_sq": (0.0, 0.0, 5e-2), "momentum_buffer": (0.0, 0.0, 3e-2)}
# Losses. fp32: the two layouts compute the same sums in another order (TP partial products, DP
# gradient reduction against micro-batch accumulation), ~1e-7 relative, below the 7 printed digits
# (measured: equal in every digit). bf16: each layout rounds activations to bf16 (8 bits) after sums
# taken in another order, so the losses differ from iteration 3 on, where both hold the same weights
# (measured: 5e-6 to 1.9e-5 relative). For scale: the converted fp32 MoE run resumed without its Adam
# state (--no-load-optim with --lr 1e-4 --min-lr 1e-4 --lr-warmup-iters 0, the same lr) prints losses
# 1.6e-5 and 7.1e-5 apart at iterations 4 and 5, so in bf16 the loss alone cannot tell a lost optimizer
# state at this size; the state comparison does. A wrong Adam step it tells: with dp_reshardable's
# stale step (the launcher's step fix undone), the bf16 torch_dist case prints losses 1.3e-4 and 3.0e-4
# apart at iterations 4 and 5.
FP32_LOSS_RTOL = 1e-6
BF16_LOSS_RTOL = 5e-5
# The MoE run that Megatron-LM trains here: TP1 EP2 DP2 (2 ranks), fp32, distributed optimizer, torch_dist.
MOE_FLAGS = ["--num-experts", "4", "--moe-router-topk", "2", *SMALL_MODEL_FLAGS, "--use-distributed-optimizer",
             *TORCH_DIST, "--no-save-rng"]
CASES: dict[str, Case] = {
    "tp2pp2_torch": Case("train_tp2pp2_torch", dict(dst_tp=1, dst_pp=1), [TP, "1", PP, "1", *TORCH],
                         (4, [TP, "2", PP, "2", *TORCH]), False),
    "tp2dp2_distopt_bf16_torch": Case("train_tp2dp2_distopt_bf16_torch", dict(dst_tp=1, dst_pp=1),
                                      [TP, "1", PP, "1", *DISTOPT, *TORCH], (4, [TP, "2", PP, "1", *DISTOPT, *TORCH]),
                                      True),
    "tp2pp2_distopt_bf16_torch_dist": Case(
        "train_tp2pp2_distopt_dp_reshardable_torch_dist", dict(dst_tp=1, dst_pp=1, dst_dp=1),
        [TP, "1", PP, "1", *DISTOPT, *TORCH_DIST, "--no-save-rng", *SMALL_MODEL_FLAGS],
        (4, [TP, "2", PP, "2", *DISTOPT, *TORCH_DIST, "--no-save-rng", *SMALL_MODEL_FLAGS]), True),
    "moe_ep2_distopt_torch_dist": Case(
        "train_tp1ep2dp2_moe_distopt_torch_dist", dict(dst_tp=1, dst_pp=1, dst_ep=1, dst_dp=1),
        [TP, "1", PP, "1", "--expert-model-parallel-size", "1", *MOE_FLAGS],
        (2, [TP, "1", PP, "1", "--expert-model-parallel-size", "2", *MOE_FLAGS]), False,
        train=[TP, "1", PP, "1", "--expert-model-parallel-size", "2", *MOE_FLAGS]),
    "muon_tp2dp2_bf16_torch": Case(
        "train_tp2dp2_muon_bf16_torch", dict(dst_tp=1, dst_pp=1, dst_dp=1),
        [TP, "1", PP, "1", *MUON, *TORCH, "--no-save-rng", *SMALL_MODEL_FLAGS],
        (4, [TP, "2", PP, "1", *MUON, *TORCH, "--no-save-rng", *SMALL_MODEL_FLAGS]), True),
    "muon_tp2dp2_bf16_torch_to_pp2": Case(
        "train_tp2dp2_muon_bf16_torch", dict(dst_tp=1, dst_pp=2, dst_dp=1),
        [TP, "1", PP, "2", *MUON, *TORCH, "--no-save-rng", *SMALL_MODEL_FLAGS],
        (4, [TP, "2", PP, "1", *MUON, *TORCH, "--no-save-rng", *SMALL_MODEL_FLAGS]), True, converted_ranks=2),
    "muon_layer_wise_dp_reshardable_torch_dist": Case(
        "train_tp2dp2_muon_layer_wise_dp_reshardable_torch_dist", dict(dst_tp=1, dst_pp=1, dst_dp=2),
        [TP, "1", PP, "1", *LAYER_WISE, *TORCH_DIST], (4, [TP, "2", PP, "1", *LAYER_WISE, *TORCH_DIST]), True,
        converted_ranks=2),
    "muon_moe_ep2_torch_dist": Case(
        "train_tp1ep2dp4_muon_moe_bf16_torch_dist", dict(dst_tp=1, dst_pp=1, dst_ep=1, dst_dp=1),
        [TP, "1", PP, "1", "--expert-model-parallel-size", "1", *MUON_MOE],
        (4, [TP, "1", PP, "1", "--expert-model-parallel-size", "2", *MUON_MOE]), True),
    "muon_moe_ep2_torch_dist_to_torch": Case(
        "train_tp1ep2dp4_muon_moe_bf16_torch_dist", dict(dst_format="megatron", dst_tp=1, dst_pp=1, dst_ep=1, dst_dp=1),
        [TP, "1", PP, "1", "--expert-model-parallel-size", "1", *MUON_MOE, *TORCH],
        (4, [TP, "1", PP, "1", "--expert-model-parallel-size", "2", *MUON_MOE]), True),
    "muon_layer_wise_dp_reshardable_torch_dist_to_pp2": Case(
        "train_tp2dp2_muon_layer_wise_dp_reshardable_torch_dist", dict(dst_tp=1, dst_pp=2, dst_dp=2),
        [TP, "1", PP, "2", *LAYER_WISE, *TORCH_DIST], (4, [TP, "2", PP, "1", *LAYER_WISE, *TORCH_DIST]), True,
        converted_ranks=4),
    "muon_layer_wise_fully_reshardable_torch_dist": Case(
        "train_tp2dp2_muon_layer_wise_fully_reshardable_torch_dist", dict(dst_tp=1, dst_pp=1, dst_dp=1),
        [TP, "1", PP, "1", *LAYER_WISE, *TORCH_DIST, "--dist-ckpt-optim-fully-reshardable"],
        (4, [TP, "2", PP, "1", *LAYER_WISE, *TORCH_DIST, "--dist-ckpt-optim-fully-reshardable"]), True),
    "muon_lion_tp2dp2_bf16_torch": Case(
        "train_tp2dp2_muon_lion_bf16_torch", dict(dst_tp=1, dst_pp=1, dst_dp=1),
        [TP, "1", PP, "1", *MUON_LION, *TORCH], (4, [TP, "2", PP, "1", *MUON_LION, *TORCH]), True),
    "muon_lion_tp2dp2_bf16_torch_dist": Case(
        "train_tp2dp2_muon_lion_bf16_torch_dist", dict(dst_tp=1, dst_pp=2, dst_dp=1),
        [TP, "1", PP, "2", *MUON_LION, *TORCH_DIST], (4, [TP, "2", PP, "1", *MUON_LION, *TORCH_DIST]), True,
        converted_ranks=2),
    "lion_tp2dp2_bf16_torch": Case(
        "train_tp2dp2_lion_bf16_torch", dict(dst_tp=1, dst_pp=1, dst_dp=1),
        [TP, "1", PP, "1", *LION, *TORCH], (4, [TP, "2", PP, "1", *LION, *TORCH]), True),
    "lion_layer_wise_dp_reshardable_torch_dist": Case(
        "train_tp2dp2_lion_layer_wise_dp_reshardable_torch_dist", dict(dst_tp=1, dst_pp=1, dst_dp=2),
        [TP, "1", PP, "1", *LION, "--use-distributed-optimizer", *TORCH_DIST],
        (4, [TP, "2", PP, "1", *LION, "--use-distributed-optimizer", *TORCH_DIST]), True, converted_ranks=2),
    "muon_layer_wise_moe_ep2_torch_dist": Case(
        "train_tp1ep2dp4_muon_layer_wise_moe_dp_reshardable_torch_dist", dict(dst_tp=1, dst_pp=1, dst_ep=1, dst_dp=2),
        [TP, "1", PP, "1", "--expert-model-parallel-size", "1", *LAYER_WISE_MOE],
        (4, [TP, "1", PP, "1", "--expert-model-parallel-size", "2", *LAYER_WISE_MOE]), True, converted_ranks=2),
    "muon_layer_wise_moe_ep2_torch_dist_to_ep4": Case(
        "train_tp1ep2dp4_muon_layer_wise_moe_dp_reshardable_torch_dist", dict(dst_tp=1, dst_pp=1, dst_ep=4, dst_dp=4),
        [TP, "1", PP, "1", "--expert-model-parallel-size", "4", *LAYER_WISE_MOE],
        (4, [TP, "1", PP, "1", "--expert-model-parallel-size", "2", *LAYER_WISE_MOE]), True, converted_ranks=4),
}


def main(argv: list[str]) -> int:
    if not os.environ.get("PGCONVERT_MEGATRON_LM"):
        print("megatron_lm_resume_check: PGCONVERT_MEGATRON_LM is not set; this check needs a Megatron-LM "
              "source tree (see the docstring)", file=sys.stderr)
        return 2
    work, names = Path(argv[0]), argv[1:] or list(CASES)
    unknown = sorted(set(names) - set(CASES))
    if unknown:
        print(f"megatron_lm_resume_check: unknown cases {unknown}; the cases are {list(CASES)}", file=sys.stderr)
        return 2
    lines = [check(work, name, CASES[name], 29630 + 4 * index) for index, name in enumerate(names)]
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
