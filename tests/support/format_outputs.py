"""Sources for tests that write every destination format (Megatron per-rank, hf, torch_dist), and the
byte-for-byte comparison of two outputs."""

from __future__ import annotations

from pathlib import Path

from support.hf_helpers import build_hf_model, save_hf_model
from support.megatron_fixtures import make_full_model, write_megatron_checkpoint
from support.tiny_models import MOE

# Small shard and data files, so a tiny model is split into many.
SHARD_SIZE = ["--max-shard-size", "40KB"]
# Megatron-LM's own TP2 DP2 training run with the distributed optimizer: distrib_optim.pt beside each rank file.
DISTRIBUTED_OPTIMIZER_RUN = Path(__file__).parent.parent / "data" / "megatron_lm" / "train_tp2dp2_distopt_bf16_torch"


def write_sources(root: Path) -> dict[str, Path]:
    """A tiny HF model (``hf``: transformers checks what an hf destination loads against it) and a TP2 EP2
    Megatron checkpoint with experts (``megatron``), written under ``root``."""
    return {"hf": save_hf_model(build_hf_model("llama"), root / "hf_src"),
            "megatron": write_megatron_checkpoint(root / "megatron_src", MOE, make_full_model(MOE), 2, 1, ep=2)}


def output_files(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` and its bytes, the manifest aside (it records the run: times, options)."""
    return {path.relative_to(root).as_posix(): path.read_bytes() for path in sorted(root.rglob("*"))
            if path.is_file() and path.name != "pgconvert.json"}


def assert_same_bytes(actual: Path, expected: Path) -> None:
    """The same files, each with the same bytes (the manifest aside)."""
    actual_files, expected_files = output_files(actual), output_files(expected)
    assert sorted(actual_files) == sorted(expected_files)
    assert [name for name in expected_files if actual_files[name] != expected_files[name]] == []
