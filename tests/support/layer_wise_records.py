"""Comparing two torch_dist checkpoints of a layer-wise distributed optimizer's state (Megatron-LM's ``--optimizer muon``
or ``lion`` with ``--use-distributed-optimizer``): the model-space records bit for bit, the flat records of its
distributed Adam at every parameter's range."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from support.checkpoint_compare import read_dcp_objects
from support.optimizer_cli import dcp_read
from pgconvert.formats import LoadOptions
from pgconvert.formats.torch_dist import read_dcp_metadata
from pgconvert.loaders.torch_dist import TorchDistLoader
from pgconvert.model.grid import RankCoord
from pgconvert.optimizer.flat import flat_buffers

ITER = "iter_0000002"


def _records(root: Path) -> dict[str, torch.Tensor]:
    """Every optimizer record of a torch_dist iteration, read whole by torch's own DCP reader."""
    metadata = read_dcp_metadata(root / ITER / ".metadata").state_dict_metadata
    return dcp_read(root / ITER, [key for key, md in metadata.items() if hasattr(md, "size")
                                  and key.startswith(("optimizer.", "chained_"))])


def _objects(root: Path) -> dict[str, Any]:
    """The dp_reshardable ShardedObjects (param groups, bucket sizes)."""
    return read_dcp_objects(root / ITER, lambda key: key.startswith("chained_1.optimizer.distributed."))


def _parameter_ranges(root: Path) -> dict[str, list[tuple[int, int]]]:
    """Per dp_reshardable flat record of Adam's buffer, the ranges its parameters own (the rest is padding that
    megatron-core leaves uninitialised)."""
    optimizer = TorchDistLoader().open(root, LoadOptions()).open_optimizer()
    ranges: dict[str, list[tuple[int, int]]] = {}
    for tp in range(optimizer.layout.tp):
        coord = RankCoord(tp=tp, pp=0, ep=0)
        buffers = flat_buffers(optimizer.config, optimizer.layout, coord, optimizer.rules, optimizer.vocab_rows,
                               optimizer.args, 2, 1)
        for buffer, (placed, _) in enumerate(buffers):
            for item in placed:
                for field in ("param", "exp_avg", "exp_avg_sq"):
                    key = optimizer.bucket_key(coord, buffer, field, item.bucket, 1)
                    ranges.setdefault(key, []).append((item.start - item.bucket_start, item.end - item.bucket_start))
    return ranges


def assert_same_layer_wise_records(expected: Path, actual: Path) -> None:
    """Two layer-wise torch_dist checkpoints hold the same records: the model-space ones bit for bit, the flat ones
    at every parameter's range (megatron-core's alignment padding is uninitialised memory), and the same objects."""
    want, got = _records(expected), _records(actual)
    assert sorted(want) == sorted(got)
    ranges = _parameter_ranges(expected) if any(".distributed." in key for key in want) else {}
    for key, tensor in want.items():
        assert got[key].dtype == tensor.dtype == torch.float32 and got[key].shape == tensor.shape, key
        if key in ranges:
            assert all(torch.equal(got[key][start:end], tensor[start:end]) for start, end in ranges[key]), key
        else:
            assert ".distributed." not in key and torch.equal(got[key], tensor), key
    assert _objects(actual) == _objects(expected)
