"""Megatron-LM accepts pgconvert's resharded optimizer state and resumes as the original would.

    PGCONVERT_MEGATRON_LM=/path/to/Megatron-LM PGCONVERT_MEGATRON_LM_PYTHON=/venv/python \
        python scripts/megatron_lm_resume_check.py WORKDIR

1. pgconvert converts the golden ``train_tp2pp2_torch`` (fp32, plain optimizer, iteration 2) to TP1 PP1;
2. Megatron-LM's ``pretrain_gpt.py`` (through ``megatron_lm_cpu_train.py``) builds the model and its
   optimizer at TP1 PP1 on one CPU rank, loads that checkpoint with its own ``load_checkpoint``
   (model, ``optimizer.load_state_dict``, scheduler; ``--no-load-rng``) and trains iteration 3 on the
   mock data; the same from the unconverted golden at TP2 PP2 on four ranks;
3. both iteration-3 checkpoints are exported per parameter (``pgconvert export-optimizer``) and every
   weight, ``exp_avg`` and ``exp_avg_sq`` must agree within rtol 1e-5 / atol 1e-7 (the TP2 run sums
   partial products in another order), with step 3 and 6 consumed samples in both.

Exit 0 when they agree; the Megatron log tail otherwise.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from interop_megatron_lm import _megatron_env  # noqa: E402
from make_megatron_lm_goldens import GOLDENS, LAUNCHER, MODEL_FLAGS  # noqa: E402

RTOL, ATOL = 1e-5, 1e-7


def resume(load: Path, save: Path, nproc: int, port: int, flags: list[str]) -> None:
    """One more iteration of pretrain_gpt.py from ``load``, saved into ``save``."""
    python, env, source = _megatron_env()
    env = dict(env, OMP_NUM_THREADS="1")
    model_flags = list(MODEL_FLAGS)
    for name in ("--train-iters", "--save-interval"):
        model_flags[model_flags.index(name) + 1] = "3"
    cmd = [python, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-port", str(port),
           str(LAUNCHER), str(source), *model_flags, *flags, "--ckpt-format", "torch", "--load", str(load),
           "--save", str(save), "--no-load-rng", "--use-checkpoint-opt_param-scheduler"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1200)
    log = done.stdout + done.stderr
    if done.returncode != 0 or "successfully saved checkpoint from iteration       3" not in log:
        raise SystemExit(f"Megatron-LM resume from {load} failed (exit {done.returncode}):\n{log[-6000:]}")


def compare(a: Path, b: Path) -> float:
    """Largest absolute difference over every exported tensor; raises when outside RTOL/ATOL."""
    worst = 0.0
    names = sorted(p.name for p in a.glob("*.pt"))
    if not names or names != sorted(p.name for p in b.glob("*.pt")):
        raise SystemExit(f"{a} and {b} hold different parameters")
    for name in names:
        x, y = torch.load(a / name, weights_only=True), torch.load(b / name, weights_only=True)
        for key in ("param", "exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(x[key], y[key], rtol=RTOL, atol=ATOL, msg=lambda m: f"{name} {key}: {m}")
            worst = max(worst, (x[key] - y[key]).abs().max().item())
        if float(x["step"]) != 3.0 or float(y["step"]) != 3.0:
            raise SystemExit(f"{name}: step {float(x['step'])} / {float(y['step'])}, expected 3")
    return worst


def main() -> None:
    from pgconvert import convert
    from pgconvert.optimizer_reshard import export_from_path

    work = Path(sys.argv[1])
    golden = GOLDENS / "train_tp2pp2_torch"
    convert(golden, work / "converted_tp1", dst_tp=1, dst_pp=1)
    resume(work / "converted_tp1", work / "resumed_tp1", 1, 29631, ["--tensor-model-parallel-size", "1",
                                                                    "--pipeline-model-parallel-size", "1"])
    resume(golden, work / "resumed_tp2pp2", 4, 29632, ["--tensor-model-parallel-size", "2",
                                                       "--pipeline-model-parallel-size", "2"])
    for name in ("resumed_tp1", "resumed_tp2pp2"):
        export_from_path(work / name, work / f"{name}_state", None)
    worst = compare(work / "resumed_tp1_state", work / "resumed_tp2pp2_state")
    print(f"resumed TP1 (converted) and TP2 PP2 (original) agree: max |diff| {worst:.3g} "
          f"(rtol {RTOL}, atol {ATOL})")


if __name__ == "__main__":
    main()
