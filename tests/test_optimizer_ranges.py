"""A Megatron per-rank source's optimizer state is read by byte range, nothing memory-mapped
(``loaders/megatron/optimizer.py``, ``distrib_optim.py``, ``io.torch_input.StoredTensors``).

``distrib_optim.pt`` and the rank files' optimizer tensors are read as their structure: each large tensor
stays in its file as a meta tensor that knows where its bytes are, and each parameter's slice of a flat
buffer (or its plain state tensor) is read with ``os.preadv`` straight into its place in the merged or
cut result. Outputs are the same bytes as before (the optimizer test files and the goldens compare
them); here: what is read, how, into where, and a file cut short while it is read.
"""

from __future__ import annotations

import os
import re
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from support.cli_helpers import assert_clean_refusal, run_cli
from support.megatron_fixtures import load_for_test
from support.optimizer_faults import DISTRIBUTED, PLAIN_BF16, copy_checkpoint, rank_files

import pgconvert
import pgconvert.io.ranges as ranges
import pgconvert.io.torch_input as torch_input
from pgconvert.errors import CheckpointError
from pgconvert.formats import LoadOptions
from pgconvert.loaders.megatron import MegatronLoader
from pgconvert.loaders.megatron.optimizer import MegatronOptimizerSource
from pgconvert.optimizer.source import FIELDS

# Storages over this many bytes stay in their files when the plain goldens' rank files are read (their
# tensors are all under the default 64 KiB; the RNG state's torch.Generator, 5056 bytes, must stay in memory).
SMALL_STORAGE_BYTES = 8192
ROW_PARALLEL = "decoder.layers.0.self_attention.linear_proj.weight"


class FileReads:
    """While installed: ``os.preadv`` bytes by file name, every destination ``read_region`` filled, and every
    ``torch.load`` (path, whether it maps the file)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.bytes: Counter[str] = Counter()
        self.targets: list[torch.Tensor] = []
        self.loads: list[tuple[str, bool]] = []
        preadv, read_region, load = os.preadv, ranges.read_region, torch.load

        def counting(fd: int, buffers: list[memoryview], offset: int, *flags: int) -> int:
            got = preadv(fd, buffers, offset, *flags)
            self.bytes[Path(os.readlink(f"/proc/self/fd/{fd}")).name] += got
            return got

        def recording(fd: int, region: ranges.FileRegion, out: torch.Tensor) -> None:
            self.targets.append(out)
            read_region(fd, region, out)

        def loading(path: Any, *args: Any, **kwargs: Any) -> Any:
            self.loads.append((str(path), bool(kwargs.get("mmap"))))
            return load(path, *args, **kwargs)

        monkeypatch.setattr(os, "preadv", counting)
        monkeypatch.setattr(ranges, "read_region", recording)
        monkeypatch.setattr(torch_input, "read_region", recording, raising=False)  # absent before it read by range
        monkeypatch.setattr(torch, "load", loading)

    def mapped_loads(self, root: Path) -> list[str]:
        """The files under ``root`` that a ``torch.load`` mapped, by name."""
        return sorted(Path(path).name for path, mapped in self.loads if mapped and Path(path).is_relative_to(root))


def mapped_files() -> set[str]:
    """The names of the files this process maps now."""
    with open("/proc/self/maps") as handle:
        return {Path(fields[5]).name for fields in map(str.split, handle) if len(fields) >= 6}


def mapped_under(root: Path) -> set[str]:
    """The paths of the files under ``root`` this process maps now (other tests' mappings of files of the same name
    elsewhere left out)."""
    prefix = str(root.resolve())
    with open("/proc/self/maps") as handle:
        return {fields[5] for fields in map(str.split, handle) if len(fields) >= 6 and fields[5].startswith(prefix)}


def buffers(root: Path) -> list[dict[str, torch.Tensor]]:
    """Each rank's ``distrib_optim.pt`` flat buffers (one model chunk), as torch.load reads them."""
    loaded = [torch.load(path, weights_only=True) for path in rank_files(root, "distrib_optim.pt")]
    return [next(iter(state[0].values())) for state in loaded]


def loaded_state(optimizer: MegatronOptimizerSource, stored: list[dict[str, torch.Tensor]], name: str,
                 field: str) -> torch.Tensor:
    """``name``'s ``field`` merged from torch.load's buffers (``stored``) at the ranges its pieces view."""
    pieces = []
    for owner in optimizer._owners[name]:
        view = optimizer._read([owner], field)[0]
        rank = int(owner[0].path.parent.name.removeprefix("mp_rank_"))
        pieces.append(stored[rank][field][view.storage_offset():][:view.numel()].view(view.shape))
    return optimizer.rule(name).merge(pieces)


def open_optimizer(root: Path) -> tuple[Any, MegatronOptimizerSource]:
    source = MegatronLoader().open(root, LoadOptions())
    return source, source.open_optimizer()


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="reads /proc/self/maps")
def test_opening_a_distributed_optimizer_maps_no_state_file_and_reads_only_the_masters(
        monkeypatch: pytest.MonkeyPatch) -> None:
    stored = buffers(DISTRIBUTED)
    reads = FileReads(monkeypatch)
    before = mapped_under(DISTRIBUTED)  # what other tests left mapped in this process

    source, optimizer = open_optimizer(DISTRIBUTED)
    try:
        mapped, under = mapped_files(), mapped_under(DISTRIBUTED)
        opened = reads.bytes["distrib_optim.pt"]
        parameters = {name: optimizer.parameter(name) for name in optimizer.names()}
        mapped |= mapped_files()
        under |= mapped_under(DISTRIBUTED)
    finally:
        source.close()

    assert "distrib_optim.pt" not in mapped  # old code: torch.load(mmap=True) of each distrib_optim.pt
    # The weights' loader reads the rank files as their structure too (old code: torch.load(mmap=True) of each).
    assert under - before == set() and reads.mapped_loads(DISTRIBUTED) == []
    # Opening checks every fp32 master against its weight: each parameter's range of the param buffers once
    # (the alignment gaps between them unread), nothing else.
    masters = sum(master.nbytes for rank in optimizer.ranks.values() for held in rank.masters for master in held)
    assert opened == masters > sum(buffer["param"].nbytes for buffer in stored) / 2
    # Reading each parameter's state reads its ranges once more, each field once (all fp32).
    assert reads.bytes["distrib_optim.pt"] - opened == len(FIELDS) * masters
    for name, state in parameters.items():
        for field in FIELDS:
            assert torch.equal(state[field], loaded_state(optimizer, stored, name, field)), (name, field)


def test_a_tp_merge_reads_each_rank_s_slice_straight_into_its_columns(monkeypatch: pytest.MonkeyPatch) -> None:
    stored = buffers(DISTRIBUTED)
    source, optimizer = open_optimizer(DISTRIBUTED)
    try:
        owners = optimizer._owners[ROW_PARALLEL]
        reads = FileReads(monkeypatch)
        state = optimizer.parameter(ROW_PARALLEL)
    finally:
        source.close()

    for field in FIELDS:
        pieces = [optimizer._read([owner], field)[0] for owner in owners]
        assert torch.equal(state[field], loaded_state(optimizer, stored, ROW_PARALLEL, field)), field
        # Each rank's piece was read into a strided view of the merged tensor: its columns, no copy after.
        into = [target for target in reads.targets
                if target.untyped_storage().data_ptr() == state[field].untyped_storage().data_ptr()]
        assert [(target.shape, target.stride()) for target in into] == [
            (piece.shape, state[field].stride()) for piece in pieces]
    assert reads.loads == []


@pytest.mark.parametrize("root", [PLAIN_BF16, DISTRIBUTED], ids=["plain", "distributed"])
def test_the_state_read_by_range_gives_the_same_bytes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, root: Path) -> None:
    pgconvert.convert(root, tmp_path / "in_memory", dst_tp=1)  # the goldens' tensors: all read with the pickle
    monkeypatch.setattr(torch_input, "_REAL_STORAGE_BYTES", SMALL_STORAGE_BYTES)
    plain = [_tensors(load_for_test(path)["optimizer"]) for path in rank_files(PLAIN_BF16)] if root == PLAIN_BF16 else []
    in_files = sum(tensor.nbytes for tensors in plain for tensor in tensors
                   if tensor.untyped_storage().nbytes() > SMALL_STORAGE_BYTES)
    reads = FileReads(monkeypatch)

    pgconvert.convert(root, tmp_path / "by_range", dst_tp=1)

    # Nothing maps the source's rank files: the weights and the optimizer's state are read by range (old code: the
    # weights' loader mapped each, and before that the optimizer's loader too).
    assert reads.mapped_loads(root) == []
    if root == PLAIN_BF16:
        assert reads.bytes["model_optim_rng.pt"] >= in_files > 0
    written = {name: {path.relative_to(tmp_path / name): path.read_bytes()
                      for path in sorted((tmp_path / name).rglob("*.pt"))} for name in ("in_memory", "by_range")}
    assert len(written["by_range"]) == (2 if root == DISTRIBUTED else 1)
    assert written["by_range"] == written["in_memory"]


def _tensors(tree: Any) -> list[torch.Tensor]:
    """Every tensor in a nested structure of dicts and lists, in order."""
    if isinstance(tree, torch.Tensor):
        return [tree]
    values = tree.values() if isinstance(tree, dict) else tree if isinstance(tree, (list, tuple)) else []
    return [tensor for value in values for tensor in _tensors(value)]


# --------------------------------------------------------------------------- files cut short


def test_a_distrib_optim_cut_short_after_opening_is_named(tmp_path: Path) -> None:
    root = copy_checkpoint(DISTRIBUTED, tmp_path / "src")
    source, optimizer = open_optimizer(root)
    state_file = rank_files(root, "distrib_optim.pt")[1]
    size = state_file.stat().st_size
    os.truncate(state_file, size // 2)  # inside the buffers: old code's mapping faults (SIGBUS) there
    try:
        with pytest.raises(CheckpointError, match=rf"^{re.escape(str(state_file))}: the file ends at byte "
                                                  rf"{size // 2}, but a tensor's bytes run to byte \d+; the file "
                                                  "is truncated$"):
            for name in optimizer.names():
                optimizer.parameter(name)
    finally:
        source.close()


@pytest.mark.parametrize("keep", [0.5, 0.98], ids=["half", "zip_directory_cut"])
def test_a_truncated_distrib_optim_is_refused_naming_it(tmp_path: Path, keep: float) -> None:
    root = copy_checkpoint(DISTRIBUTED, tmp_path / "src")
    state_file = rank_files(root, "distrib_optim.pt")[1]
    os.truncate(state_file, int(state_file.stat().st_size * keep))

    result = run_cli("convert", root, tmp_path / "dst", "--dst-tp", "1")

    assert_clean_refusal(result, 1, f"{state_file}: truncated or corrupt torch checkpoint")
    assert not (tmp_path / "dst").exists()
