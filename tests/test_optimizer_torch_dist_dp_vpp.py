"""The dp_reshardable distributed-optimizer form (``savers/torch_dist/optimizer_dp_reshardable.py`` writes it,
``loaders/torch_dist/optimizer.py`` reads it) at virtual pipeline layouts, with several DDP buckets in a chunk, and with a
DP change together with a PP change.

The goldens have two layers, so PP2 x VPP2 (four virtual stages) is a ``--dst-pipeline-layout``: ``E|t|t|L``
(every virtual stage holds parameters) or ``Et||t|L`` (the second pipeline stage's first chunk is empty: megatron-
core's DDP makes no buffer for it, and ``DistributedOptimizer`` numbers its buffers, ``gbuf_idx``, over the chunks
that have one). megatron-core 0.16.1 itself (``mcore_vpp_dp_reshardable.py``: gloo processes, one per rank,
GPTModel chunks per virtual stage + DDP + ``get_megatron_optimizer``) loads pgconvert's records with
``dist_checkpointing.load`` and saves them back: the same keys, global shapes, chunks, objects and values.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from support.dp_records import bucket_masks, optimizer_entries, read_objects, torch_read
from support.dp_records import (ITERATION, OWN_LAYOUT, TP2DP2, TP2PP2, assert_golden_records_equal,
                                convert_to_torch_dist)
from support.flat_relayout import relayout
from support.optimizer_cli import run_cli

PP2_VPP2 = ("--dst-pp", "2", "--dst-pipeline-layout", "E|t|t|L")
PP2_VPP2_EMPTY_CHUNK = ("--dst-pp", "2", "--dst-pipeline-layout", "Et||t|L")
DP_RESHARDABLE = ("--dst-optim-form", "dp_reshardable")
ROUND_TRIPS = {
    "tp2dp2-to-tp2pp2vpp2dp2": (TP2DP2, ("--dst-tp", "2", *PP2_VPP2, "--dst-dp", "2")),
    "tp2pp2dp1-to-tp2pp2vpp2dp2": (TP2PP2, ("--dst-tp", "2", *PP2_VPP2, "--dst-dp", "2")),
    "tp2pp2dp1-to-tp2pp1dp2": (TP2PP2, ("--dst-tp", "2", "--dst-pp", "1", "--dst-dp", "2")),
    "tp2dp2-to-tp1pp2vpp2dp1-empty-chunk": (TP2DP2, ("--dst-tp", "1", *PP2_VPP2_EMPTY_CHUNK, "--dst-dp", "1")),
}


def _buffers(iteration_dir: Path) -> dict[str, set[int]]:
    """dp_group_idx_<g> -> the gbuf_idx of its records."""
    found: dict[str, set[int]] = {}
    for key in optimizer_entries(iteration_dir):
        parts = key.split(".")
        if parts[3].startswith("gbuf_idx_"):
            found.setdefault(parts[2], set()).add(int(parts[3][len("gbuf_idx_"):]))
    return found


@pytest.mark.parametrize("case", sorted(ROUND_TRIPS))
def test_a_golden_through_a_vpp_or_dp_and_pp_change_and_back_is_bit_exact(tmp_path: Path, case: str) -> None:
    golden, target = ROUND_TRIPS[case]
    convert_to_torch_dist(golden, tmp_path / "there", *target, *DP_RESHARDABLE)
    convert_to_torch_dist(tmp_path / "there", tmp_path / "back", *OWN_LAYOUT[golden], "--dst-vpp", "1")
    assert_golden_records_equal(golden, tmp_path / "back")  # every record, chunk and object; torch.equal per element
    if "empty-chunk" in case:
        # megatron-core numbers the buffers of the chunks that have parameters: pipeline stage 1's chunks are
        # '' (no buffer) and 'L', whose buffer is gbuf_idx_0 (mcore_vpp_dp_reshardable.py reports the same)
        assert _buffers(tmp_path / "there" / ITERATION) == {"dp_group_idx_0": {0, 1}, "dp_group_idx_1": {0}}
        objects = read_objects(tmp_path / "there", ["optimizer.distributed.dp_group_idx_1.per_bucket_numel/shard_0_1"])
        assert [len(per_buffer) for per_buffer in objects.values()] == [1]


def test_a_per_rank_distributed_optimizer_numbers_only_the_chunks_that_have_parameters(tmp_path: Path) -> None:
    # distrib_optim.pt is keyed by the same buffer index (DistributedOptimizer.save_parameter_state)
    convert_to_torch_dist(TP2DP2, tmp_path / "td", "--dst-tp", "1", *PP2_VPP2_EMPTY_CHUNK, "--dst-dp", "1", *DP_RESHARDABLE)
    result = run_cli("convert", tmp_path / "td", tmp_path / "mg", "-q", "--dst-format", "megatron")
    assert result.exit_code == 0, result.output
    stages = sorted((tmp_path / "mg" / ITERATION).glob("mp_rank_*/distrib_optim.pt"))
    keys = [sorted(k for k in torch.load(path, weights_only=True) if k != "buckets_coalesced") for path in stages]
    assert keys == [[0, 1], [0]]
    convert_to_torch_dist(tmp_path / "mg", tmp_path / "back", *OWN_LAYOUT[TP2DP2], "--dst-vpp", "1", *DP_RESHARDABLE)
    assert_golden_records_equal(TP2DP2, tmp_path / "back")


# ----------------------------------------------------------------------------- megatron-core's own load and save

SCRIPT = Path(__file__).parent / "support" / "mcore_vpp_dp_reshardable.py"
# The TP2 DP2 golden re-laid out for DDP buckets of 200 elements on the first chunk (test_optimizer_buckets)
BUCKETING = {"overlap_grad_reduce": True, "ddp_bucket_size": 200}
MCORE_CASES = {
    "tp2pp2dp1-to-tp2pp2vpp2dp2": ("golden", ("--dst-tp", "2", *PP2_VPP2, "--dst-dp", "2"), 2),
    "bucketed-tp2dp2-to-tp1pp2vpp2dp2-empty-chunk": ("bucketed", ("--dst-tp", "1", *PP2_VPP2_EMPTY_CHUNK,
                                                                  "--dst-dp", "2"), 2),
}


@pytest.fixture(scope="module")
def bucketed(tmp_path_factory: pytest.TempPathFactory) -> Path:

    root = tmp_path_factory.mktemp("bucketed")
    _convert_to(TP2DP2, root / "tp2", "--dst-format", "megatron", "--dst-tp", "2")
    relayout(root / "tp2", root / "bucketed", BUCKETING)
    return root / "bucketed"


def _convert_to(src: Path, dst: Path, *options: str) -> None:
    result = run_cli("convert", src, dst, "-q", *options)
    assert result.exit_code == 0, result.output


def _assert_saved_back_the_same(written: Path, mcore: Path, ranks: list[dict[str, Any]]) -> None:
    """megatron-core's save of what it loaded: pgconvert's keys, global shapes and chunks; the objects it declares
    are pgconvert's; every element where a parameter lies is equal."""
    ours, theirs = optimizer_entries(written / ITERATION), optimizer_entries(mcore / "saved")
    assert sorted(ours) == sorted(theirs)
    tensors = [key for key, md in ours.items() if hasattr(md, "chunks")]
    for key in tensors:
        assert ours[key].size == theirs[key].size, key
        chunks = [sorted((tuple(c.offsets), tuple(c.sizes)) for c in entry[key].chunks) for entry in (ours, theirs)]
        assert chunks[0] == chunks[1], key
    declared = {key: value for rank in ranks for key, value in rank["objects"].items()}
    assert sorted(declared) == sorted(key for key in ours if key not in tensors)
    # stored as torch.save([ShardedObject.data])
    assert read_objects(written, sorted(declared)) == {key: [value] for key, value in declared.items()}
    masks = bucket_masks(written)
    assert sorted(masks) == sorted(tensors)
    values, saved = torch_read(written / ITERATION, tensors), torch_read(mcore / "saved", tensors)
    for key in tensors:
        assert torch.equal(values[key][masks[key]], saved[key][masks[key]]), key


def _assert_loaded_the_reference(reference: Path, ranks: list[dict[str, Any]]) -> None:
    """What each DP rank's optimizer holds is its slice of its TP piece of the source's per-parameter state
    (the golden's SwiGLU model: ``mcore_optimizer_step.tp_piece``); over the DP ranks, all of it."""
    from support.mcore_optimizer_step import tp_piece

    tp = 1 + max(rank["coord"][0] for rank in ranks)
    covered: dict[tuple[str, int], int] = {}
    for rank in ranks:
        for name, (offset, tensors) in rank["loaded"].items():
            expected = torch.load(reference / f"{name}.pt", weights_only=True)
            for key in ("param", "exp_avg", "exp_avg_sq"):
                whole = tp_piece(name, expected[key], tp, rank["coord"][0], swiglu=True).reshape(-1)
                assert torch.equal(tensors[key], whole[offset:offset + tensors[key].numel()]), f"{name}.{key}"
            where = (name, rank["coord"][0])
            covered[where] = covered.get(where, 0) + tensors["param"].numel()
    sizes = {path.stem: torch.load(path, weights_only=True)["param"] for path in reference.glob("*.pt")}
    assert covered == {(name, tp_rank): tp_piece(name, full, tp, tp_rank, swiglu=True).numel()
                       for name, full in sizes.items() for tp_rank in range(tp)}


@pytest.mark.parametrize("case", sorted(MCORE_CASES))
def test_megatron_core_loads_the_vpp_records_and_saves_back_the_same(tmp_path: Path, case: str,
                                                                     request: pytest.FixtureRequest) -> None:
    pytest.importorskip("megatron.core", reason="megatron-core's own load and save are the check")
    which, target, dp = MCORE_CASES[case]
    source = TP2PP2 if which == "golden" else request.getfixturevalue("bucketed")
    convert_to_torch_dist(source, tmp_path / "td", *target, *DP_RESHARDABLE)
    result = run_cli("export-optimizer", source, tmp_path / "reference")
    assert result.exit_code == 0, result.output
    done = subprocess.run([sys.executable, "-W", "ignore", str(SCRIPT), str(tmp_path / "td" / ITERATION),
                           str(tmp_path / "mc"), str(dp)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    ranks = [torch.load(path, weights_only=True) for path in sorted((tmp_path / "mc").glob("rank*.pt"))]
    _assert_saved_back_the_same(tmp_path / "td", tmp_path / "mc", ranks)
    _assert_loaded_the_reference(tmp_path / "reference", ranks)
    per_bucket = [value for rank in ranks for key, value in rank["objects"].items() if "per_bucket_numel_unp" in key]
    buckets = max(len(sizes) for per_buffer in per_bucket for entry in per_buffer for sizes in entry.values())
    assert buckets >= (3 if which == "bucketed" else 1)  # several DDP buckets on the first chunk
    chunks_per_buffer = [rank["gbuf_chunks"] for rank in ranks]  # megatron-core's gbuf_idx -> model chunk
    if "empty-chunk" in case:
        assert {0: 1} in chunks_per_buffer  # stage 1's only buffer is its second chunk's
