"""Regenerate tests/data/megatron_lm/ with Megatron-LM's own tools (see the README there).

    PGCONVERT_MEGATRON_LM=/path/to/Megatron-LM PGCONVERT_MEGATRON_LM_PYTHON=/venv/with/triton/python \
        python scripts/make_megatron_lm_goldens.py [convert|train ...]

``convert``: outputs of Megatron-LM's ``tools/checkpoint/convert.py``. ``train``: training
checkpoints written by Megatron-LM's ``pretrain_gpt.py`` (two iterations on mock data, 4 ranks
under ``torchrun`` with gloo on the CPU, through ``scripts/megatron_lm_cpu_train.py``), i.e. by
its own ``save_checkpoint``, with optimizer, scheduler, RNG and rerun state.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from interop_megatron_lm import _megatron_env, make_hf, megatron_convert, pgconvert  # noqa: E402

GOLDENS = Path(__file__).resolve().parents[1] / "tests" / "data" / "megatron_lm"
LAUNCHER = Path(__file__).resolve().parent / "megatron_lm_cpu_train.py"

# pretrain_gpt.py flags shared by every training golden: the tiny Llama of the convert.py goldens
# (local spec), mock data, two iterations, a checkpoint at the second. Dropout is 0 (see
# megatron_lm_cpu_train.py: on the CPU the data loader's seed would move one TP rank's masks).
MODEL_FLAGS = [
    "--distributed-backend", "gloo", "--transformer-impl", "local", "--no-rope-fusion",
    "--no-gradient-accumulation-fusion", "--no-masked-softmax-fusion", "--no-bias-swiglu-fusion",
    "--no-bias-dropout-fusion", "--no-persist-layer-norm",
    "--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "128", "--num-attention-heads", "4",
    "--group-query-attention", "--num-query-groups", "2", "--swiglu", "--normalization", "RMSNorm",
    "--position-embedding-type", "rope", "--untie-embeddings-and-output-weights", "--disable-bias-linear",
    "--seq-length", "16", "--max-position-embeddings", "16", "--micro-batch-size", "1", "--global-batch-size", "2",
    "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "255",
    "--hidden-dropout", "0", "--attention-dropout", "0",
    "--lr", "1e-3", "--min-lr", "1e-4", "--lr-decay-style", "cosine", "--lr-warmup-iters", "1",
    "--train-iters", "2", "--seed", "1234", "--save-interval", "2", "--eval-iters", "0", "--eval-interval", "1000",
    "--log-interval", "1",
]
# A smaller model for the distributed-optimizer torch_dist goldens (tests/data stays under
# 8 MB); given after MODEL_FLAGS, so argparse keeps these values. Vocab 63 padded to 64 (TP2).
SMALL_MODEL_FLAGS = ["--hidden-size", "16", "--ffn-hidden-size", "32", "--vocab-size", "63",
                     "--make-vocab-size-divisible-by", "32"]
_DISTOPT_TORCH_DIST = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "1",
                       "--ckpt-format", "torch_dist", "--use-distributed-optimizer", "--bf16", "--no-save-rng",
                       *SMALL_MODEL_FLAGS]
_FSDP_DTENSOR = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "1", "--use-megatron-fsdp",
                 "--ckpt-format", "fsdp_dtensor", "--bf16", "--no-gradient-reduce-div-fusion", "--no-save-optim",
                 "--no-save-rng", *SMALL_MODEL_FLAGS]
# golden directory -> the flags that make it (all 4 ranks)
TRAINING_RUNS: dict[str, list[str]] = {
    "train_tp2pp2_torch": ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                           "--ckpt-format", "torch"],
    "train_tp2dp2_distopt_bf16_torch": ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "1",
                                        "--ckpt-format", "torch", "--use-distributed-optimizer", "--bf16"],
    "train_tp2dp2_bf16_torch": ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "1",
                                "--ckpt-format", "torch", "--bf16"],
    "train_tp2pp2_bf16_torch_dist": ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                                     "--ckpt-format", "torch_dist", "--bf16", *SMALL_MODEL_FLAGS],
    # The distributed optimizer's torch_dist forms that Megatron-LM writes, TP2 DP2. The third,
    # fully_sharded_model_space, cannot be made: with MLM_DISTOPT_SHARDING_TYPE=fully_sharded_model_space
    # (scripts/megatron_lm_cpu_train.py) save_checkpoint fails in megatron-core's own
    # DistributedOptimizer.sharded_param_state_fs_model_space (distrib_optimizer.py:2052):
    # "ShardedTensor.flattened_range is not supported." (dist_checkpointing/mapping.py:130; 0.16.1 alike).
    # megatron-core 0.15.0 makes it: scripts/make_fs_model_space_golden.py.
    "train_tp2dp2_distopt_dp_reshardable_torch_dist": _DISTOPT_TORCH_DIST,
    "train_tp2dp2_distopt_fully_reshardable_torch_dist": [*_DISTOPT_TORCH_DIST, "--dist-ckpt-optim-fully-reshardable"],
    # dp_reshardable over two pipeline stages (model-parallel rank g = tp + 2 * pp), DP1
    "train_tp2pp2_distopt_dp_reshardable_torch_dist": [*_DISTOPT_TORCH_DIST[:2], "--pipeline-model-parallel-size", "2",
                                                       *_DISTOPT_TORCH_DIST[4:]],
    # Megatron-FSDP (--use-megatron-fsdp, which requires --ckpt-format fsdp_dtensor), TP2 DP2, the smaller
    # model. Gloo has no PREMUL_SUM reduce-scatter: the gradients are scaled before a SUM instead
    # (--no-gradient-reduce-div-fusion). Model only: with torch's Adam (no TE/Apex on a CPU) a rank keeps
    # no optimizer state for a parameter none of whose elements it holds, so the ranks' state dicts differ
    # and save_checkpoint's collective preprocessing (handle_swiglu_in_state_dict) waits forever.
    "train_tp2dp2_fsdp_dtensor": _FSDP_DTENSOR,
    # The same run with its optimizer state: scripts/megatron_lm_cpu_train.py gives a rank's parameters whose shard
    # is empty the Adam state (empty zeros, the common step) torch's Adam never creates for them there, so the
    # save's collectives see every key on every rank.
    "train_tp2dp2_fsdp_dtensor_optim": [flag for flag in _FSDP_DTENSOR if flag != "--no-save-optim"],
    # A DeepSeek-V3-shaped Megatron-FSDP run with its optimizer state: multi-latent attention (q and kv LoRA ranks,
    # the latent norms: --qk-layernorm; plain RoPE: Megatron-LM's YaRN table asks torch for an accelerator), layer 0
    # dense, layer 1 and the multi-token prediction layer four routed experts (EP2, so the expert data-parallel size is
    # 2 beside the dense 4) with a shared expert and a sigmoid router with its expert bias; SwiGLU everywhere. Without
    # --group-query-attention (MODEL_FLAGS_DROPPED), which MLA refuses. The head sizes make k and v heads kv_channels
    # wide (the launcher's local MLA attention). TP1: at TP > 1 megatron-core asks MoE for sequence parallelism, which
    # the local spec's torch norms refuse. Gloo's all_to_all_single refuses uneven splits: the allgather dispatcher.
    "train_tp1ep2dp4_mla_moe_mtp_fsdp_dtensor_optim": [
        *[flag for flag in _FSDP_DTENSOR if flag != "--no-save-optim"], "--tensor-model-parallel-size", "1",
        "--global-batch-size", "4", "--multi-latent-attention", "--q-lora-rank", "8", "--kv-lora-rank", "8",
        "--qk-head-dim", "2", "--qk-pos-emb-head-dim", "2", "--v-head-dim", "4", "--rope-type", "rope",
        "--qk-layernorm", "--num-experts", "4", "--expert-model-parallel-size", "2",
        "--moe-router-topk", "2", "--moe-token-dispatcher-type", "allgather", "--moe-ffn-hidden-size", "24",
        "--moe-shared-expert-intermediate-size", "32", "--moe-layer-freq", "[0,1]",
        "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias", "--mtp-num-layers", "1"],
    # Megatron-LM's plain Muon optimizer (--optimizer muon without --use-distributed-optimizer, which validate_args
    # would turn into the layer-wise distributed optimizer), per-rank files, TP2 DP2, bf16, the smaller model: each
    # rank file's optimizer is the list [Muon's, Adam's]. PGCONVERT_MEGATRON_LM_PYTHON's environment needs triton
    # (megatron-core d98e8a64 imports it unguarded; 3.9.0 from PyPI) and emerging-optimizers 0.3.0, which declares
    # Python >= 3.12: on 3.11 its wheel installed with --no-deps --ignore-requires-python, and absl-py
    # (scripts/make_muon_golden.py's environment, with triton added).
    "train_tp2dp2_muon_bf16_torch": ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "1",
                                     "--ckpt-format", "torch", "--bf16", "--optimizer", "muon", "--no-save-rng",
                                     *SMALL_MODEL_FLAGS],
    # The same with the embedding and output layer's own learning rates (in Adam's groups, beside the norms').
    "train_tp2dp2_muon_decoupled_lr_bf16_torch": ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size",
                                                  "1", "--ckpt-format", "torch", "--bf16", "--optimizer", "muon",
                                                  "--decoupled-lr", "5e-4", "--decoupled-min-lr", "5e-5",
                                                  "--no-save-rng", *SMALL_MODEL_FLAGS],
    # Muon with --use-distributed-optimizer, which validate_args turns into the layer-wise distributed optimizer
    # (use_layer_wise_distributed_optimizer; use_distributed_optimizer off): megatron-core chains the layer-wise
    # optimizer over the Muon parameters (their state in model space) and a distributed Adam over a DDP buffer of the
    # rest. torch_dist in its two forms: dp_reshardable (the default) and fully_reshardable.
    "train_tp2dp2_muon_layer_wise_dp_reshardable_torch_dist": [*_DISTOPT_TORCH_DIST, "--optimizer", "muon"],
    "train_tp2dp2_muon_layer_wise_fully_reshardable_torch_dist": [*_DISTOPT_TORCH_DIST, "--optimizer", "muon",
                                                                  "--dist-ckpt-optim-fully-reshardable"],
    # Plain Muon with MoE at expert parallel size 2 (TP1 EP2 DP4; 4 experts, top-2 routing, SequentialMLP, the
    # allgather dispatcher as above): megatron-core chains Muon's dense (attention, router) and expert-parallel
    # (experts) optimizers, then Adam's (embedding, output layer, norms).
    "train_tp1ep2dp4_muon_moe_bf16_torch_dist": ["--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size",
                                                 "1", "--expert-model-parallel-size", "2", "--num-experts", "4",
                                                 "--moe-router-topk", "2", "--moe-token-dispatcher-type", "allgather",
                                                 "--global-batch-size", "4", "--ckpt-format", "torch_dist", "--bf16",
                                                 "--optimizer", "muon", "--no-save-rng", *SMALL_MODEL_FLAGS],
    # Plain Muon with Lion for the embedding, output layer and norms (--muon-scalar-optimizer lion: an exp_avg per
    # parameter and no step), per-rank files and torch_dist, TP2 DP2.
    "train_tp2dp2_muon_lion_bf16_torch": ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "1",
                                          "--ckpt-format", "torch", "--bf16", "--optimizer", "muon",
                                          "--muon-scalar-optimizer", "lion", "--no-save-rng", *SMALL_MODEL_FLAGS],
    "train_tp2dp2_muon_lion_bf16_torch_dist": ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size",
                                               "1", "--ckpt-format", "torch_dist", "--bf16", "--optimizer", "muon",
                                               "--muon-scalar-optimizer", "lion", "--no-save-rng", *SMALL_MODEL_FLAGS],
    # Megatron-LM's Lion optimizer (--optimizer lion, an emerging optimizer as Muon is: Lion for the 2-dim weights but
    # the embedding and output layer, an exp_avg each and no step, chained with Adam for the rest): per-rank files
    # (plain), and torch_dist with --use-distributed-optimizer (the layer-wise distributed optimizer, dp_reshardable).
    "train_tp2dp2_lion_bf16_torch": ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "1",
                                     "--ckpt-format", "torch", "--bf16", "--optimizer", "lion", "--no-save-rng",
                                     *SMALL_MODEL_FLAGS],
    "train_tp2dp2_lion_layer_wise_dp_reshardable_torch_dist": [*_DISTOPT_TORCH_DIST, "--optimizer", "lion"],
    # The same MoE run with --use-distributed-optimizer: the layer-wise distributed optimizer over Muon's dense and
    # expert parameters (each whole on one rank of its data-parallel group), a distributed Adam over the rest.
    "train_tp1ep2dp4_muon_layer_wise_moe_dp_reshardable_torch_dist": [
        "--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1", "--expert-model-parallel-size",
        "2", "--num-experts", "4", "--moe-router-topk", "2", "--moe-token-dispatcher-type", "allgather",
        "--global-batch-size", "4", "--ckpt-format", "torch_dist", "--use-distributed-optimizer", "--bf16",
        "--optimizer", "muon", "--no-save-rng", *SMALL_MODEL_FLAGS],
}
# MODEL_FLAGS a run leaves out (a store_true flag cannot be switched off by a later one).
MODEL_FLAGS_DROPPED: dict[str, tuple[str, ...]] = {
    "train_tp1ep2dp4_mla_moe_mtp_fsdp_dtensor_optim": ("--group-query-attention",)}
# Environment a run needs besides _megatron_env's: Megatron-FSDP asserts CUDA_DEVICE_MAX_CONNECTIONS != 1
# (arguments.py validate_args), which every other run needs at TP > 1.
TRAINING_ENV: dict[str, dict[str, str]] = {name: {"CUDA_DEVICE_MAX_CONNECTIONS": "8"} for name in
                                           TRAINING_RUNS if "--use-megatron-fsdp" in TRAINING_RUNS[name]}


def megatron_train(save: Path, flags: list[str], port: int, nproc: int = 4,
                   extra_env: dict[str, str] | None = None, dropped: tuple[str, ...] = ()) -> str:
    """Megatron-LM's pretrain_gpt.py on ``nproc`` CPU ranks; its save_checkpoint writes ``save``. ``dropped``:
    MODEL_FLAGS left out."""
    python, env, source = _megatron_env()
    env = dict(env, OMP_NUM_THREADS="1", **(extra_env or {}))
    model_flags = [flag for flag in MODEL_FLAGS if flag not in dropped]
    cmd = [python, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-port", str(port),
           str(LAUNCHER), str(source), *model_flags, *flags, "--save", str(save)]
    print("$", " ".join(cmd[1:]), flush=True)
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    log = done.stdout + done.stderr
    if done.returncode != 0 or "successfully saved checkpoint from iteration       2" not in log:
        raise SystemExit(f"Megatron-LM pretrain_gpt.py failed (exit {done.returncode}):\n{log[-6000:]}")
    return log


def make_training_goldens(names: list[str]) -> None:
    for port, name in enumerate(names, start=29600):
        target = GOLDENS / name
        shutil.rmtree(target, ignore_errors=True)
        log = megatron_train(target, TRAINING_RUNS[name], port, extra_env=TRAINING_ENV.get(name),
                             dropped=MODEL_FLAGS_DROPPED.get(name, ()))
        shims = sorted({line.strip() for line in log.splitlines() if "shim]" in line and ":" in line})
        print(f"  {name}: saved; shims used:\n    " + "\n    ".join(shims), flush=True)
        # Megatron writes the tokenizer's (empty, NullTokenizer) folder beside a torch_dist iteration
        for empty in sorted(target.rglob("*"), reverse=True):
            if empty.is_dir() and not any(empty.iterdir()):
                empty.rmdir()


def make_convert_goldens() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        make_hf(work / "hf")
        for src_tp, dst_tp in ((1, 2), (2, 1)):
            ours = work / f"pgconvert_tp{src_tp}"
            pgconvert("convert", str(work / "hf"), str(ours), "--dst-format", "megatron",
                      "--dst-tp", str(src_tp), "--dst-transformer-impl", "local")
            target = GOLDENS / f"convert_py_core_tp{dst_tp}"
            shutil.rmtree(target, ignore_errors=True)
            megatron_convert(ours, target, dst_tp, 1)


def main(argv: list[str]) -> int:
    what = argv or ["convert", "train"]
    if "convert" in what:
        make_convert_goldens()
    if "train" in what:
        make_training_goldens([name for name in TRAINING_RUNS if name in what] or list(TRAINING_RUNS))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
