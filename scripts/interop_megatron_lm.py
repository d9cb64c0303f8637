"""Feed pgconvert's Megatron outputs to Megatron-LM's own tools (local check; needs its source).

    PGCONVERT_MEGATRON_LM=/path/to/Megatron-LM python scripts/interop_megatron_lm.py WORKDIR

Steps (each must succeed):
1. a tiny random Llama (HF) -> pgconvert -> Megatron per-rank TP1 and TP2 (local spec);
2. each goes through Megatron-LM's tools/checkpoint/convert.py (loader and saver ``core_cpu`` from
   the CPU shims, which wrap Megatron's ``core`` ones; the loader calls Megatron's
   ``load_checkpoint`` and its ``validate_args`` on the args pgconvert wrote) to TP2 / TP1;
3. pgconvert reads Megatron's outputs back to HF; every tensor must equal the source's;
4. pgconvert's TP2/PP2 outputs, per-rank (``torch``) and ``torch_dist``, are loaded by Megatron-LM's
   own ``pretrain_gpt.py`` on 4 CPU ranks (``scripts/megatron_lm_cpu_train.py``): model args from
   the checkpoint (``--use-checkpoint-args``, so Megatron's ``load_args_from_checkpoint`` and
   ``validate_args`` see what pgconvert wrote), ``load_checkpoint`` as a resume (``--no-load-optim
   --no-load-rng``, no ``--finetune``: its ``check_checkpoint_args`` runs too), one training step
   at learning rate 0, ``save_checkpoint``; pgconvert reads that save back to HF, bit-identical to
   the source;
5. the TP2/PP2 per-rank output also goes through ``convert.py`` to TP1 and back to HF;
6. Megatron-LM's own Megatron-FSDP save (tests/data/megatron_lm/train_tp2dp2_fsdp_dtensor) -> pgconvert ->
   per-rank and torch_dist TP2, each resumed by ``pretrain_gpt.py`` as in 4 (the golden's iteration 2, one
   step at lr 0 to iteration 3); pgconvert reads the save back, equal to the golden bit for bit;
7. Megatron-LM trains a Megatron-FSDP run (fp32, GELU MLP, TP2 DP2; why not bf16 or SwiGLU: ``FSDP_RUN_FLAGS``)
   -> pgconvert -> per-rank TP1 -> pgconvert -> fsdp_dtensor TP2 and TP1, resumed by ``pretrain_gpt.py
   --use-megatron-fsdp --ckpt-format fsdp_dtensor`` at TP2 DP1 and TP1 DP4: the TP2 DP1 run's iteration-3 loss
   equals (rtol 1e-5) the one Megatron-LM computes resuming its own save at TP2 DP2, and each step at lr 0 saves
   back the tensors it loaded (pgconvert ``verify``).

8. Megatron-LM's bf16 SwiGLU Megatron-FSDP save with its optimizer state (tests/data/megatron_lm/
   train_tp2dp2_fsdp_dtensor_optim) -> pgconvert -> per-rank TP1 bf16 -> pgconvert -> fsdp_dtensor TP2 with the
   optimizer state, resumed by ``pretrain_gpt.py`` at TP2 DP2 and TP2 DP1 loading the optimizer, one step at the
   checkpoint's learning rate: at each, the iteration-3 loss and the saved weights, moments and steps are those of
   Megatron-LM resuming its own save there (bit-exact, read with torch's DCP), and DP1's loss is the run's
   continuation within one bf16 ulp.

Run only some steps: ``python scripts/interop_megatron_lm.py WORKDIR fsdp`` runs steps 6 to 8 alone,
``fsdp-optim`` step 8.

Megatron-LM's Python needs: its source, the shims folder (PGCONVERT_MEGATRON_LM_SHIMS, default
/work/shared/megatron_lm_cpu) and a Python with triton (PGCONVERT_MEGATRON_LM_PYTHON).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file


def _megatron_env() -> tuple[str, dict[str, str], Path]:
    source = Path(os.environ["PGCONVERT_MEGATRON_LM"])
    shims = os.environ.get("PGCONVERT_MEGATRON_LM_SHIMS", "/work/shared/megatron_lm_cpu")
    env = dict(os.environ, PYTHONPATH=f"{shims}:{source}", CUDA_DEVICE_MAX_CONNECTIONS="1")
    return os.environ.get("PGCONVERT_MEGATRON_LM_PYTHON", sys.executable), env, source


def make_hf(path: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         tie_word_embeddings=False, torch_dtype="float32")
    LlamaForCausalLM(config).save_pretrained(path)


def pgconvert(*argv: str) -> None:
    cmd = [sys.executable, "-m", "pgconvert", *argv]
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)


def megatron_convert(src: Path, dst: Path, tp: int, pp: int) -> str:
    python, env, source = _megatron_env()
    cmd = [python, str(source / "tools/checkpoint/convert.py"), "--model-type", "GPT",
           "--loader", "core_cpu", "--saver", "core_cpu", "--load-dir", str(src), "--save-dir", str(dst),
           "--target-tensor-parallel-size", str(tp), "--target-pipeline-parallel-size", str(pp),
           "--loader-transformer-impl", "local", "--saver-transformer-impl", "local",
           "--position-embedding-type", "rope", "--megatron-path", str(source)]
    print("$", " ".join(cmd[1:]), flush=True)
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    log = done.stdout + done.stderr
    # convert.py exits 0 even when its saver process dies; the saver's last word is "Done!".
    if done.returncode != 0 or "Done!" not in done.stdout:
        raise SystemExit(f"Megatron-LM convert.py failed (exit {done.returncode}):\n{log[-6000:]}")
    return log


def same_tensors(expected: Path, actual: Path) -> None:
    def read(root: Path) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for file in sorted(root.glob("*.safetensors")):
            out.update(load_file(file))
        return out

    a, b = read(expected), read(actual)
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    bad = [k for k in a if not torch.equal(a[k], b[k])]
    assert not bad, bad
    print(f"  {len(a)} tensors bit-identical to the source", flush=True)


# The run's own flags (not model args: those come from the checkpoint). The model is HF's tiny
# Llama, whose RMSNorm epsilon (1e-6) load_args_from_checkpoint does not take from the checkpoint.
LOAD_FLAGS = [
    "--distributed-backend", "gloo", "--transformer-impl", "local", "--no-rope-fusion",
    "--no-gradient-accumulation-fusion", "--no-masked-softmax-fusion", "--no-bias-swiglu-fusion",
    "--no-bias-dropout-fusion", "--no-persist-layer-norm", "--norm-epsilon", "1e-6",
    "--use-checkpoint-args", "--no-use-tokenizer-model-from-checkpoint-args",
    "--no-load-optim", "--no-load-rng",
    "--seq-length", "16", "--micro-batch-size", "1", "--global-batch-size", "2",
    "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "256",
    "--lr", "0", "--min-lr", "0", "--train-iters", "1", "--seed", "1234",
    "--save-interval", "1", "--eval-iters", "0", "--eval-interval", "1000", "--log-interval", "1",
]


def megatron_load_and_train(src: Path, dst: Path, tp: int, pp: int, ckpt_format: str, port: int,
                            extra: tuple[str, ...] = (), saved_iteration: int = 1, dp: int = 1,
                            extra_env: dict[str, str] | None = None, dropped: tuple[str, ...] = ()) -> str:
    """Megatron-LM's pretrain_gpt.py on ``tp * pp * dp`` ranks loads ``src``, trains one step at lr 0 and saves
    ``dst`` (at ``saved_iteration``; ``extra`` flags after the others, which argparse lets win; ``dropped``: flags of
    ``LOAD_FLAGS`` left out)."""
    python, env, source = _megatron_env()
    env = dict(env, OMP_NUM_THREADS="1", **(extra_env or {}))
    launcher = Path(__file__).resolve().parent / "megatron_lm_cpu_train.py"
    cmd = [python, "-m", "torch.distributed.run", "--nproc-per-node", str(tp * pp * dp), "--master-port", str(port),
           str(launcher), str(source), *(flag for flag in LOAD_FLAGS if flag not in dropped),
           "--tensor-model-parallel-size", str(tp),
           "--pipeline-model-parallel-size", str(pp), "--ckpt-format", ckpt_format,
           "--load", str(src), "--save", str(dst), *extra]
    print("$", " ".join(cmd[1:]), flush=True)
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    log = done.stdout + done.stderr
    wanted = ("successfully loaded checkpoint from", f"successfully saved checkpoint from iteration {saved_iteration:7d}")
    if done.returncode != 0 or not all(w in log for w in wanted):
        raise SystemExit(f"Megatron-LM pretrain_gpt.py failed (exit {done.returncode}):\n{log[-6000:]}")
    for line in log.splitlines():
        if any(w in line for w in wanted) or "lm loss" in line:
            print("  megatron:", line.strip()[:160], flush=True)
    return log


def tp2pp2_round_trips(work: Path, hf: Path) -> None:
    for fmt, name in (("megatron", "torch"), ("torch_dist", "torch_dist")):
        ours = work / f"pgconvert_tp2pp2_{name}"
        pgconvert("convert", str(hf), str(ours), "--dst-format", fmt, "--dst-tp", "2", "--dst-pp", "2",
                  "--dst-transformer-impl", "local", "--overwrite")
        theirs = work / f"megatron_lm_trained_from_pgconvert_tp2pp2_{name}"
        megatron_load_and_train(ours, theirs, 2, 2, name, 29650 + len(name))
        back = work / f"hf_from_megatron_lm_trained_{name}"
        pgconvert("convert", str(theirs), str(back), "--dst-format", "hf", "--hf-config", str(hf / "config.json"),
                  "--overwrite")
        same_tensors(hf, back)
    tp1 = work / "megatron_lm_tp1_from_pgconvert_tp2pp2"
    megatron_convert(work / "pgconvert_tp2pp2_torch", tp1, 1, 1)
    print("  convert.py: saver printed Done! on pgconvert's TP2/PP2 output", flush=True)
    back = work / "hf_from_megatron_lm_tp1_from_tp2pp2"
    pgconvert("convert", str(tp1), str(back), "--dst-format", "hf", "--hf-config", str(hf / "config.json"),
              "--overwrite")
    same_tensors(hf, back)


FSDP_GOLDEN = Path(__file__).resolve().parents[1] / "tests/data/megatron_lm/train_tp2dp2_fsdp_dtensor"
# the golden's model settings --use-checkpoint-args does not take from its args; a step past its iteration 2
FSDP_RESUME_FLAGS = ("--norm-epsilon", "1e-5", "--vocab-size", "63", "--make-vocab-size-divisible-by", "32",
                     "--train-iters", "3")


def fsdp_golden_resumes(work: Path) -> None:
    reference = work / "pgconvert_tp1_from_fsdp_golden"
    pgconvert("convert", str(FSDP_GOLDEN), str(reference), "--dst-format", "megatron", "--dst-tp", "1", "--overwrite")
    for fmt, name in (("megatron", "torch"), ("torch_dist", "torch_dist")):
        ours = work / f"pgconvert_tp2_from_fsdp_golden_{name}"
        pgconvert("convert", str(FSDP_GOLDEN), str(ours), "--dst-format", fmt, "--dst-tp", "2", "--overwrite")
        theirs = work / f"megatron_lm_resumed_from_fsdp_golden_{name}"
        megatron_load_and_train(ours, theirs, 2, 1, name, 29670 + len(name), FSDP_RESUME_FLAGS, saved_iteration=3)
        back = work / f"pgconvert_tp1_from_megatron_lm_resumed_{name}"
        pgconvert("convert", str(theirs), str(back), "--dst-format", "megatron", "--dst-tp", "1", "--overwrite")
        pgconvert("verify", str(reference), str(back))


# Megatron-FSDP as the golden's run used it (scripts/make_megatron_lm_goldens.py): model only (a CPU rank's Adam
# keeps no state for parameters it holds none of, and the save's collectives then wait forever); Megatron-FSDP
# asserts CUDA_DEVICE_MAX_CONNECTIONS != 1. In fp32: Megatron-LM d98e8a64 resumes no bf16/fp16 Megatron-FSDP run
# without its optimizer state (load_checkpoint calls optimizer.reload_model_params(): "NotImplementedError:
# Megatron-FSDP does not implement a model-to-main parameter update"), and the golden holds none (loading it with
# the optimizer waits forever on CPU ranks, as saving it does). Not gated: in an fp32 run (no Float16Module
# around the model) handle_swiglu_in_state_dict looks up ``module.module.<name>`` and fails ("GPTModel has no
# attribute `module`"), so the run below is a GELU MLP, trained by Megatron-LM here.
FSDP_RUN_FLAGS = ("--use-megatron-fsdp", "--ckpt-format", "fsdp_dtensor", "--no-gradient-reduce-div-fusion",
                  "--no-save-optim", "--no-save-rng")
FSDP_ENV = {"CUDA_DEVICE_MAX_CONNECTIONS": "8"}


def _loss_at(log: str, iteration: int) -> float:
    """The ``lm loss`` Megatron-LM logs for ``iteration`` (computed on the loaded weights, before the step)."""
    match = re.search(rf"iteration\s+{iteration}/\s*\d+ \|.*?\| lm loss: ([0-9.E+-]+) \|", log)
    if match is None:
        raise SystemExit(f"no lm loss logged for iteration {iteration}")
    return float(match.group(1))


def megatron_fsdp_train(save: Path) -> None:
    """Megatron-LM's pretrain_gpt.py trains the goldens' smaller model with a GELU MLP in fp32 with Megatron-FSDP,
    TP2 DP2, two iterations, and saves it (fsdp_dtensor, model only)."""
    from make_megatron_lm_goldens import LAUNCHER, MODEL_FLAGS, SMALL_MODEL_FLAGS

    python, env, source = _megatron_env()
    env = dict(env, OMP_NUM_THREADS="1", **FSDP_ENV)
    cmd = [python, "-m", "torch.distributed.run", "--nproc-per-node", "4", "--master-port", "29711", str(LAUNCHER),
           str(source), *(flag for flag in MODEL_FLAGS if flag != "--swiglu"), "--tensor-model-parallel-size", "2",
           "--pipeline-model-parallel-size", "1", *FSDP_RUN_FLAGS, *SMALL_MODEL_FLAGS, "--save", str(save)]
    print("$", " ".join(cmd[1:]), flush=True)
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    log = done.stdout + done.stderr
    if done.returncode != 0 or "successfully saved checkpoint from iteration       2" not in log:
        raise SystemExit(f"Megatron-LM pretrain_gpt.py failed (exit {done.returncode}):\n{log[-6000:]}")


def fsdp_dtensor_resumes(work: Path) -> None:
    """pgconvert's fsdp_dtensor output of a per-rank TP1 checkpoint (a Megatron-FSDP TP2 DP2 run's, converted),
    resumed by Megatron-LM with Megatron-FSDP at data-parallel sizes that run did not use: TP2 DP1, whose batch is
    the run's continuation's (the same global batch of mock samples), and TP1 DP4 (a global batch of 4). The
    continuation's loss is the one Megatron-LM computes resuming the run's own save at TP2 DP2; each step at lr 0
    saves back the tensors it loaded."""
    original = work / "megatron_lm_fsdp_fp32_gelu_tp2dp2"
    megatron_fsdp_train(original)
    per_rank = work / "pgconvert_tp1_from_megatron_lm_fsdp_fp32"
    pgconvert("convert", str(original), str(per_rank), "--dst-format", "megatron", "--dst-tp", "1", "--overwrite")
    flags = (*FSDP_RUN_FLAGS, *FSDP_RESUME_FLAGS)
    resumed = work / "megatron_lm_resumed_fsdp_fp32_itself"
    expected = _loss_at(megatron_load_and_train(original, resumed, 2, 1, "fsdp_dtensor", 29691, flags,
                                                saved_iteration=3, dp=2, extra_env=FSDP_ENV), 3)
    for tp, dp, batch in ((2, 1, "2"), (1, 4, "4")):
        ours = work / f"pgconvert_fsdp_dtensor_tp{tp}_from_per_rank_tp1"
        pgconvert("convert", str(per_rank), str(ours), "--dst-format", "fsdp_dtensor", "--dst-tp", str(tp),
                  "--overwrite")
        theirs = work / f"megatron_lm_resumed_from_pgconvert_fsdp_dtensor_tp{tp}_dp{dp}"
        log = megatron_load_and_train(ours, theirs, tp, 1, "fsdp_dtensor", 29692 + tp, (*flags, "--global-batch-size",
                                      batch), saved_iteration=3, dp=dp, extra_env=FSDP_ENV)
        if batch == "2":  # the run's continuation: the same samples
            loss = _loss_at(log, 3)
            print(f"  iteration 3 lm loss: {loss:.6E} resumed from pgconvert's fsdp_dtensor at TP{tp} DP{dp}, "
                  f"{expected:.6E} resumed from Megatron-LM's own save at TP2 DP2", flush=True)
            if abs(loss - expected) > 1e-5 * abs(expected):
                raise SystemExit(f"lm loss {loss} differs from the run's continuation {expected} (rtol 1e-5, fp32)")
        back = work / f"pgconvert_tp1_from_megatron_lm_resumed_fsdp_dtensor_tp{tp}_dp{dp}"
        pgconvert("convert", str(theirs), str(back), "--dst-format", "megatron", "--dst-tp", "1", "--overwrite")
        pgconvert("verify", str(per_rank), str(back))


FSDP_OPTIM_GOLDEN = FSDP_GOLDEN.parent / "train_tp2dp2_fsdp_dtensor_optim"
# Megatron-FSDP resumed with its optimizer state and the checkpoint's learning-rate schedule (the step at iteration 3
# moves the weights and the moments), saving them again (the launcher's empty-shard shim lets the save finish).
FSDP_OPTIM_FLAGS = ("--use-megatron-fsdp", "--ckpt-format", "fsdp_dtensor", "--no-gradient-reduce-div-fusion",
                    "--no-save-rng", "--bf16", "--use-checkpoint-opt_param-scheduler", *FSDP_RESUME_FLAGS)


def fsdp_optimizer_resumes(work: Path) -> None:
    """Megatron-LM's bf16 SwiGLU Megatron-FSDP save with its optimizer state (the golden, TP2 DP2) -> pgconvert ->
    per-rank TP1 in bf16 (the masters in distrib_optim.pt) -> pgconvert -> fsdp_dtensor TP2 with the optimizer state
    (the model entries the masters again), resumed by ``pretrain_gpt.py`` at TP2 DP2 and at TP2 DP1 (a data-parallel
    size the run did not use; the same global batch) loading the optimizer: at each, the iteration-3 loss and the
    state it saves after a step at the run's learning rate (weights, moments and steps bit-exact) are those of
    Megatron-LM resuming its own save there, and DP1's loss is the run's continuation (DP2's) within one bf16 ulp."""
    per_rank = work / "pgconvert_tp1_bf16_from_fsdp_optim_golden"
    pgconvert("convert", str(FSDP_OPTIM_GOLDEN), str(per_rank), "--dst-format", "megatron", "--dst-tp", "1",
              "--dtype", "bf16", "--overwrite")
    ours = work / "pgconvert_fsdp_dtensor_tp2_optim_from_per_rank_tp1"
    pgconvert("convert", str(per_rank), str(ours), "--dst-format", "fsdp_dtensor", "--dst-tp", "2", "--overwrite",
              "--strict")
    pgconvert("verify", str(FSDP_OPTIM_GOLDEN), str(ours))
    continuation = None
    for dp in (2, 1):
        expected_dir = work / f"megatron_lm_resumed_fsdp_optim_itself_dp{dp}"
        expected = _loss_at(megatron_load_and_train(FSDP_OPTIM_GOLDEN, expected_dir, 2, 1, "fsdp_dtensor",
                                                    29721 + 2 * dp, FSDP_OPTIM_FLAGS, saved_iteration=3, dp=dp,
                                                    extra_env=FSDP_ENV, dropped=("--no-load-optim",)), 3)
        theirs = work / f"megatron_lm_resumed_from_pgconvert_fsdp_dtensor_optim_dp{dp}"
        log = megatron_load_and_train(ours, theirs, 2, 1, "fsdp_dtensor", 29722 + 2 * dp, FSDP_OPTIM_FLAGS,
                                      saved_iteration=3, dp=dp, extra_env=FSDP_ENV, dropped=("--no-load-optim",))
        loss = _loss_at(log, 3)
        continuation = expected if continuation is None else continuation
        print(f"  TP2 DP{dp}: iteration 3 lm loss: {loss:.6E} resumed from pgconvert's fsdp_dtensor with its optimizer "
              f"state, {expected:.6E} resumed from Megatron-LM's own save, {continuation:.6E} the run's continuation "
              "(DP2)", flush=True)
        if loss != expected or abs(loss - continuation) > 2 ** -7 * abs(continuation):
            raise SystemExit(f"TP2 DP{dp}: lm loss {loss} differs from Megatron-LM's {expected} or the run's "
                             f"continuation {continuation}")
        same_store_tensors(expected_dir / "iter_0000003", theirs / "iter_0000003")


FSDP_MOE_GOLDEN = FSDP_GOLDEN.parent / "train_tp1ep2dp4_mla_moe_mtp_fsdp_dtensor_optim"
# The DeepSeek-V3-shaped golden's run flags (scripts/make_megatron_lm_goldens.py): --use-checkpoint-args does not take
# the MLA, MoE and MTP settings from its args. DP4 (TP1 on 4 ranks): the global batch 4.
FSDP_MOE_FLAGS = (*FSDP_OPTIM_FLAGS, "--global-batch-size", "4", "--multi-latent-attention", "--q-lora-rank", "8",
                  "--kv-lora-rank", "8", "--qk-head-dim", "2", "--qk-pos-emb-head-dim", "2", "--v-head-dim", "4",
                  "--rope-type", "rope", "--qk-layernorm", "--num-experts", "4", "--moe-router-topk", "2",
                  "--moe-token-dispatcher-type", "allgather", "--moe-ffn-hidden-size", "24",
                  "--moe-shared-expert-intermediate-size", "32", "--moe-layer-freq", "[0,1]",
                  "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias", "--mtp-num-layers", "1")


def fsdp_moe_resumes(work: Path) -> None:
    """Megatron-LM's DeepSeek-V3-shaped Megatron-FSDP save (MLA, MoE, MTP) with its optimizer state (EP2, TP1 DP4) ->
    pgconvert -> per-rank EP1 (fp32 weights, the masters) -> pgconvert -> fsdp_dtensor at EP2 and EP4 of a bf16 run
    (``--dtype bf16`` sets the args; the store keeps fp32 main weights) with the optimizer state, each resumed by
    ``pretrain_gpt.py`` on 4 ranks at its EP loading the optimizer, one step at the checkpoint's learning rate: at
    EP2 the iteration-3 loss and the saved weights, moments and steps are those of Megatron-LM resuming its own save
    (bit-exact); at EP4 (one expert per rank, an expert data-parallel size of 1) the loss is the run's continuation
    within one bf16 ulp."""
    per_rank = work / "pgconvert_ep1_from_fsdp_moe_golden"
    pgconvert("convert", str(FSDP_MOE_GOLDEN), str(per_rank), "--dst-format", "megatron", "--dst-tp", "1",
              "--dst-ep", "1", "--overwrite")
    expected_dir = work / "megatron_lm_resumed_fsdp_moe_itself_ep2"
    expected = _loss_at(megatron_load_and_train(FSDP_MOE_GOLDEN, expected_dir, 1, 1, "fsdp_dtensor", 29731,
                                                (*FSDP_MOE_FLAGS, "--expert-model-parallel-size", "2"),
                                                saved_iteration=3, dp=4, extra_env=FSDP_ENV,
                                                dropped=("--no-load-optim",)), 3)
    for ep in (2, 4):
        ours = work / f"pgconvert_fsdp_dtensor_ep{ep}_from_per_rank_ep1"
        pgconvert("convert", str(per_rank), str(ours), "--dst-format", "fsdp_dtensor", "--dst-tp", "1",
                  "--dst-ep", str(ep), "--dtype", "bf16", "--overwrite", "--strict")
        pgconvert("verify", str(FSDP_MOE_GOLDEN), str(ours))
        theirs = work / f"megatron_lm_resumed_from_pgconvert_fsdp_dtensor_moe_ep{ep}"
        log = megatron_load_and_train(ours, theirs, 1, 1, "fsdp_dtensor", 29732 + ep,
                                      (*FSDP_MOE_FLAGS, "--expert-model-parallel-size", str(ep)), saved_iteration=3,
                                      dp=4, extra_env=FSDP_ENV, dropped=("--no-load-optim",))
        loss = _loss_at(log, 3)
        print(f"  TP1 EP{ep} DP4: iteration 3 lm loss: {loss:.6E} resumed from pgconvert's fsdp_dtensor with its "
              f"optimizer state, {expected:.6E} resumed from Megatron-LM's own save at EP2", flush=True)
        if (ep == 2 and loss != expected) or abs(loss - expected) > 2 ** -7 * abs(expected):
            raise SystemExit(f"EP{ep}: lm loss {loss} differs from Megatron-LM's {expected}")
        if ep == 2:
            same_store_tensors(expected_dir / "iter_0000003", theirs / "iter_0000003")


def same_store_tensors(expected: Path, actual: Path) -> None:
    """Every tensor entry of two DCP stores (model, moments, steps), read by torch.distributed.checkpoint alone, equal
    bit for bit (pgconvert's ``verify`` refuses these saves: on CPU ranks a parameter whose shard a rank holds none
    of gets no gradient there, so its saved Adam step can stay one behind the others', in both saves alike)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader, TensorStorageMetadata

    def read(directory: Path) -> dict[str, torch.Tensor]:
        entries = FileSystemReader(str(directory)).read_metadata().state_dict_metadata
        tensors = {key: torch.empty(tuple(md.size), dtype=md.properties.dtype) for key, md in entries.items()
                   if isinstance(md, TensorStorageMetadata) and not key.startswith("rng_state.")}
        dcp.load(tensors, storage_reader=FileSystemReader(str(directory)), no_dist=True)
        return tensors

    a, b = read(expected), read(actual)
    if a.keys() != b.keys():
        raise SystemExit(f"the saves' keys differ: {sorted(set(a) ^ set(b))[:8]}")
    bad = [key for key in a if a[key].dtype != b[key].dtype or not torch.equal(a[key], b[key])]
    if bad:
        raise SystemExit(f"the saves differ in {bad[:8]}")
    moments = sum(key.startswith("optimizer.state.") for key in a)
    print(f"  {len(a)} tensors of the saves bit-identical ({moments} optimizer records)", flush=True)


def main(work: Path, only: str | None = None) -> int:
    work.mkdir(parents=True, exist_ok=True)
    if only == "fsdp-optim":
        fsdp_optimizer_resumes(work)
        print("interop OK (step 8)")
        return 0
    if only == "fsdp-moe":
        fsdp_moe_resumes(work)
        print("interop OK (step 9)")
        return 0
    if only == "fsdp":
        fsdp_golden_resumes(work)
        fsdp_dtensor_resumes(work)
        fsdp_optimizer_resumes(work)
        fsdp_moe_resumes(work)
        print("interop OK (steps 6 to 9)")
        return 0
    hf = work / "hf"
    make_hf(hf)
    for src_tp, dst_tp in ((1, 2), (2, 1)):
        ours = work / f"pgconvert_tp{src_tp}"
        pgconvert("convert", str(hf), str(ours), "--dst-format", "megatron", "--dst-tp", str(src_tp),
                  "--dst-transformer-impl", "local", "--overwrite")
        theirs = work / f"megatron_lm_tp{dst_tp}_from_pgconvert_tp{src_tp}"
        log = megatron_convert(ours, theirs, dst_tp, 1)
        print("  convert.py: saver printed Done!;", sum("[shim]" in line for line in log.splitlines()),
              "shim notes", flush=True)
        back = work / f"hf_from_megatron_lm_tp{dst_tp}_{src_tp}"
        pgconvert("convert", str(theirs), str(back), "--dst-format", "hf", "--hf-config", str(hf / "config.json"),
                  "--overwrite")
        same_tensors(hf, back)
        # Megatron's own output (enums in args, its expert TP size) through pgconvert and back to
        # Megatron-LM: the enums must come back as Megatron's classes for its validate_args.
        again = work / f"pgconvert_tp{src_tp}_from_megatron_lm_tp{dst_tp}"
        pgconvert("convert", str(theirs), str(again), "--dst-tp", str(src_tp), "--overwrite")
        megatron_convert(again, work / f"megatron_lm_tp{dst_tp}_from_pgconvert_again", dst_tp, 1)
        print("  convert.py: saver printed Done! on pgconvert's rewrite of Megatron-LM's output", flush=True)
    tp2pp2_round_trips(work, hf)
    fsdp_golden_resumes(work)
    fsdp_dtensor_resumes(work)
    fsdp_optimizer_resumes(work)
    fsdp_moe_resumes(work)
    print("interop OK")
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else None))
