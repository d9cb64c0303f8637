"""Faults planted in real checkpoints' optimizer state (Megatron-LM's own training goldens, and pgconvert's torch_dist
outputs of them), for the optimizer-state checks and the fuzzing layer: a rank file's ``optimizer`` entry, a
``distrib_optim.pt``, a torch_dist ``common.pt`` or a stored object rewritten in place."""

from __future__ import annotations

import dataclasses
import io
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import MetadataIndex

from support.megatron_fixtures import load_for_test
from support.optimizer_cli import rewrite_metadata, torch_metadata
from pgconvert.formats.megatron import FRAMEWORK_PICKLE

GOLDENS = Path(__file__).parent.parent / "data" / "megatron_lm"
ITER = "iter_0000002"
# Megatron-LM's TP2 DP2 bf16 runs of the goldens' tiny Llama: the distributed optimizer (distrib_optim.pt beside
# each rank file) and the plain one (fp32 masters in the rank file).
DISTRIBUTED = GOLDENS / "train_tp2dp2_distopt_bf16_torch"
PLAIN_BF16 = GOLDENS / "train_tp2dp2_bf16_torch"
# The flat buffers' key of those bf16 runs: (parameter dtype, grad dtype), grads accumulated in fp32.
BF16_KEY = (torch.bfloat16, torch.float32)

Change = Callable[[dict[str, Any]], None]


def copy_checkpoint(src: Path, where: Path) -> Path:
    """A copy of checkpoint ``src`` at ``where`` to plant faults in."""
    return Path(shutil.copytree(src, where))


def rank_files(root: Path, name: str = "model_optim_rng.pt") -> list[Path]:
    """The iteration's per-rank files called ``name``, in rank-directory order."""
    return sorted((root / ITER).glob(f"mp_rank_*/{name}"))


def edit_rank_files(root: Path, change: Change, ranks: list[int] | None = None) -> None:
    """Each rank file (or those of ``ranks``) loaded, changed and saved back with its args' framework classes."""
    for index, path in enumerate(rank_files(root)):
        if ranks is None or index in ranks:
            state = load_for_test(path)
            change(state)
            torch.save(state, path, pickle_module=FRAMEWORK_PICKLE)


def edit_distrib_optim(root: Path, change: Change, ranks: list[int] | None = None) -> None:
    """Each ``distrib_optim.pt`` (or those of ``ranks``) loaded, changed and saved back."""
    for index, path in enumerate(rank_files(root, "distrib_optim.pt")):
        if ranks is None or index in ranks:
            state = torch.load(path, weights_only=True)
            change(state)
            torch.save(state, path)


def edit_common(iteration_dir: Path, change: Change) -> None:
    """A torch_dist ``common.pt`` (as pgconvert writes it) loaded, changed and saved back."""
    path = iteration_dir / "common.pt"
    common = load_for_test(path)
    change(common)
    torch.save(common, path, pickle_module=FRAMEWORK_PICKLE)


def replace_stored_object(iteration_dir: Path, key: str, value: Any) -> None:
    """A torch_dist ShardedObject's stored value (``key``: its ``.../shard_0_1`` entry) replaced: the new
    ``torch.save([value])`` appended to its data file and ``.metadata`` pointed at it."""
    index = MetadataIndex(key)
    info = torch_metadata(iteration_dir).storage_data[index]
    data = io.BytesIO()
    torch.save([value], data)
    path = iteration_dir / info.relative_path
    offset = path.stat().st_size
    with open(path, "ab") as handle:
        handle.write(data.getvalue())
    moved = dataclasses.replace(info, offset=offset, length=len(data.getvalue()))

    def point(metadata: Any) -> None:
        metadata.storage_data[index] = moved

    rewrite_metadata(iteration_dir, point)


def stored_object(iteration_dir: Path, key: str) -> Any:
    """A ShardedObject's value read from the bytes ``.metadata`` points at (``torch.save([value])``)."""
    info = torch_metadata(iteration_dir).storage_data[MetadataIndex(key)]
    with open(iteration_dir / info.relative_path, "rb") as handle:
        handle.seek(info.offset)
        data = handle.read(info.length)
    (value,) = torch.load(io.BytesIO(data), weights_only=True)
    return value


def set_in_groups(key: str, value: Any) -> Callable[[list[dict[str, Any]]], None]:
    """Set ``key`` of every param group of a list to ``value``."""
    def change(groups: list[dict[str, Any]]) -> None:
        for group in groups:
            group[key] = value
    return change


def distributed_groups(state: dict[str, Any]) -> list[dict[str, Any]]:
    """A distributed optimizer's rank file's param groups (with their step)."""
    return state["optimizer"]["optimizer"]["param_groups"]
