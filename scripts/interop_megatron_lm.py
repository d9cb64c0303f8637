"""Feed pgconvert's Megatron outputs to Megatron-LM's own tools (local check; needs its source).

    PGCONVERT_MEGATRON_LM=/path/to/Megatron-LM python scripts/interop_megatron_lm.py WORKDIR

Steps (each must succeed):
1. a tiny random Llama (HF) -> pgconvert -> Megatron per-rank TP1 and TP2 (local spec);
2. each goes through Megatron-LM's tools/checkpoint/convert.py (loader and saver ``core_cpu`` from
   the CPU shims, which wrap Megatron's ``core`` ones; the loader calls Megatron's
   ``load_checkpoint`` and its ``validate_args`` on the args pgconvert wrote) to TP2 / TP1;
3. pgconvert reads Megatron's outputs back to HF; every tensor must equal the source's.

Megatron-LM's Python needs: its source, the shims folder (PGCONVERT_MEGATRON_LM_SHIMS, default
/work/shared/megatron_lm_cpu) and a Python with triton (PGCONVERT_MEGATRON_LM_PYTHON).
"""

from __future__ import annotations

import os
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


def main(work: Path) -> int:
    work.mkdir(parents=True, exist_ok=True)
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
    print("interop OK")
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
