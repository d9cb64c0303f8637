"""Reading and comparing the distributed optimizer's torch_dist records (dp_reshardable form) in tests: the
metadata entries, whole records through torch's own DCP reader, the ShardedObjects, and where parameters lie."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from support.optimizer_cli import run_cli
from support.torch_dist_forms import FOR_MCORE_016_CLI

from pgconvert.formats import LoadOptions
from pgconvert.formats.registry import get_loader
from pgconvert.formats.torch_dist import read_dcp_metadata

FIELDS = ("param", "exp_avg", "exp_avg_sq")
GOLDENS = Path(__file__).parent.parent / "data" / "megatron_lm"
TP2DP2 = GOLDENS / "train_tp2dp2_distopt_dp_reshardable_torch_dist"
TP2PP2 = GOLDENS / "train_tp2pp2_distopt_dp_reshardable_torch_dist"
FULLY = GOLDENS / "train_tp2dp2_distopt_fully_reshardable_torch_dist"
# Each golden's own layout as pgconvert options (the DP size is its args.data_parallel_size).
OWN_LAYOUT = {TP2DP2: ("--dst-tp", "2", "--dst-pp", "1", "--dst-dp", "2"),
              TP2PP2: ("--dst-tp", "2", "--dst-pp", "2", "--dst-dp", "1")}
ITERATION = "iter_0000002"


def convert_to_torch_dist(src: Path, dst: Path, *options: str) -> None:
    """``pgconvert convert SRC DST --dst-format torch_dist OPTIONS``, which must succeed, in the form megatron-core
    0.16.1 (which wrote the goldens and loads the outputs) reads."""
    result = run_cli("convert", src, dst, "-q", "--dst-format", "torch_dist", *FOR_MCORE_016_CLI, *options)
    assert result.exit_code == 0, result.output


def assert_golden_records_equal(golden: Path, written: Path) -> None:
    """``assert_records_equal`` (gaps: zeros) with one buffer and one bucket per model-parallel rank."""
    tensors = assert_records_equal(golden, written, ITERATION, zero_gaps=True)
    ranks = len({key.split(".")[2] for key in tensors})  # dp_group_idx_<g>: one per model-parallel rank
    assert ranks >= 2 and len(tensors) == 3 * ranks


def optimizer_entries(iteration_dir: Path) -> dict:
    """The optimizer's metadata entries (``chained_<i>.``-prefixed ones of a MoE run too)."""
    return {key: md for key, md in read_dcp_metadata(iteration_dir / ".metadata").state_dict_metadata.items()
            if key.startswith(("optimizer.", "chained_"))}


def torch_read(iteration_dir: Path, keys: list[str]) -> dict[str, torch.Tensor]:
    """Whole global records read by torch's own DCP reader (not pgconvert's)."""
    entries = optimizer_entries(iteration_dir)
    wanted = {key: torch.empty(entries[key].size, dtype=entries[key].properties.dtype) for key in keys}
    with pytest.warns(UserWarning, match="single process"):
        dcp.load(wanted, checkpoint_id=str(iteration_dir), no_dist=True)
    return wanted


def read_objects(checkpoint: Path, keys: list[str]) -> dict:
    source = get_loader("torch_dist").open(checkpoint, LoadOptions())
    try:
        return source.read_objects(keys)
    finally:
        source.close()


def bucket_masks(checkpoint: Path) -> dict[str, torch.Tensor]:
    """Per bucket record, True where a parameter lies (megatron-core leaves the gaps uninitialised), from the
    ranges pgconvert's reader derives (checked against the model weights when the source opens)."""
    from pgconvert.optimizer.flat import bucket_ranges
    from pgconvert.loaders.torch_dist.optimizer import TorchDistOptimizerSource

    source = get_loader("torch_dist").open(checkpoint, LoadOptions())
    optimizer = TorchDistOptimizerSource(source)
    masks = {}
    for (coord, index), buffers in optimizer._flat.items():  # per rank and chained optimizer
        for buffer, (placed, numel) in enumerate(buffers):
            for bucket, (start, end) in enumerate(bucket_ranges(placed, numel)):
                mask = torch.zeros(end - start, dtype=torch.bool)
                for item in placed:
                    if item.bucket == bucket:
                        mask[item.start - start:item.end - start] = True
                masks.update({optimizer.bucket_key(coord, buffer, field, bucket, index): mask for field in FIELDS})
    source.close()
    return masks


def assert_records_equal(reference: Path, written: Path, iteration: str, zero_gaps: bool) -> list[str]:
    """``written`` has ``reference``'s optimizer keys, global shapes, fp32 dtypes and chunks (offsets, sizes), the
    same objects, every element equal (torch.equal) where a parameter lies, and (``zero_gaps``: pgconvert wrote
    it) zeros elsewhere. Returns the record keys, for the caller's count."""
    expected, actual = optimizer_entries(reference / iteration), optimizer_entries(written / iteration)
    assert sorted(actual) == sorted(expected)
    tensors = [key for key, md in expected.items() if hasattr(md, "chunks")]
    for key in tensors:
        assert actual[key].size == expected[key].size and actual[key].properties.dtype == torch.float32, key
        chunks = [sorted((tuple(c.offsets), tuple(c.sizes)) for c in entry[key].chunks) for entry in (expected, actual)]
        assert chunks[0] == chunks[1], key
    masks = bucket_masks(reference)
    ours, theirs = torch_read(written / iteration, tensors), torch_read(reference / iteration, tensors)
    for key in tensors:
        mask = masks[key]
        assert mask.any() and torch.equal(ours[key][mask], theirs[key][mask]), key
        if zero_gaps:
            assert torch.equal(ours[key][~mask], torch.zeros(int((~mask).sum()))), key
    objects = [key for key in expected if key not in tensors]
    assert read_objects(written, objects) == read_objects(reference, objects)
    return tensors
