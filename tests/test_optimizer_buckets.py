"""Distributed-optimizer state of runs whose DDP splits each grad buffer into several buckets.

With ``--overlap-grad-reduce`` megatron-core's ``DistributedDataParallel`` cuts the first pipeline stage's
first model chunk into buckets of about ``ddp_bucket_size`` elements, and at pipeline size > 1 with tied
embeddings the shared embedding gets a bucket of its own on any stage. ``optimizer_map.flat_buffers``
reproduces that; here it is checked against megatron-core itself:

- ``mcore_bucket_layout.py`` builds megatron-core 0.16.1's GPTModel + ``DistributedDataParallel`` (gloo
  processes, one per rank) and reports every parameter's (bucket, start, end); pgconvert's must be the same.
- A multi-bucket ``distrib_optim.pt`` checkpoint (the TP2 DP2 training golden, re-laid out for a small
  bucket size) is loaded by megatron-core's own ``load_parameter_state`` with that bucketing
  (``mcore_optimizer_step.py``): it must hold exactly what megatron-core loads from the one-bucket golden,
  and take the same step. Then TP2 -> TP1 -> TP2 is bit-exact, and the TP1 conversion is accepted too.
"""

from __future__ import annotations

import copy
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from megatron_fixtures import load_for_test
from pgconvert.grid import iter_ranks
from pgconvert.megatron_format import config_from_args, layout_from_args
from pgconvert.optimizer_map import (FlatParam, OptimizerRules, UnsupportedOptimizerError, bucket_ranges,
                                     flat_buffers)
from pgconvert.provider import OUTPUT_LAYER

pytest.importorskip("megatron.core", reason="megatron-core's own DDP is the reference")

GOLDENS = Path(__file__).parent / "data" / "megatron_lm"
DISTOPT = GOLDENS / "train_tp2dp2_distopt_bf16_torch"
RANK0 = DISTOPT / "iter_0000002" / "mp_rank_00" / "model_optim_rng.pt"
LAYOUT_SCRIPT = Path(__file__).parent / "mcore_bucket_layout.py"
BUCKET = 5000  # elements: a few parameters per bucket of the tiny model (its largest TP2 piece has 16384)
BUCKETING = {"overlap_grad_reduce": True, "ddp_bucket_size": BUCKET}


def _args(overrides: dict[str, Any]) -> Any:
    args = copy.copy(load_for_test(RANK0)["args"])
    for key, value in overrides.items():
        setattr(args, key, value)
    return args


def _pgconvert_layout(args: Any) -> dict[tuple[int, int], list[tuple[dict[str, tuple[int, int, int]], list[int]]]]:
    """(tp, pp) -> per buffer: canonical name -> (bucket, start, end) inside the bucket; unpadded bucket sizes."""
    config = config_from_args(args, RANK0, "local", None)
    layout = layout_from_args(args, RANK0)
    rules = OptimizerRules.from_args(args, str(RANK0))
    result = {}
    for coord in iter_ranks(layout):
        buffers = flat_buffers(config, layout, coord, rules, args.padded_vocab_size, args, args.data_parallel_size)
        result[(coord.tp, coord.pp)] = [
            ({_name(item): (item.bucket, item.start - item.bucket_start, item.end - item.bucket_start)
              for item in placed}, [end - start for start, end in bucket_ranges(placed, numel)])
            for placed, numel in buffers]
    return result


def _name(item: FlatParam) -> str:
    """megatron-core's name (layers numbered globally): the tied output copy is its own ``output_layer``."""
    spec = item.slot.spec
    return OUTPUT_LAYER if spec.local_name == OUTPUT_LAYER else spec.canonical


def _mcore_layout(overrides: dict[str, Any], out: Path) -> dict[tuple[int, int], list[tuple[dict, list[int]]]]:
    done = subprocess.run([sys.executable, "-W", "ignore", str(LAYOUT_SCRIPT), str(DISTOPT / "iter_0000002"),
                           json.dumps(overrides), str(out)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    result: dict[tuple[int, int], list[tuple[dict, list[int]]]] = {}
    for path in sorted(out.glob("rank*.pt")):
        rank = torch.load(path, weights_only=True)
        buffers = []
        for buffer in rank["buffers"]:
            starts = [start for start, _ in buffer["bucket_indices"]]
            params = {name: (bucket, start - starts[bucket], end - starts[bucket])
                      for name, (start, end, bucket) in buffer["params"].items()}
            buffers.append((params, buffer["numel_unpadded"]))
        previous = result.setdefault((rank["tp_rank"], rank["pp_rank"]), buffers)
        assert previous == buffers, "DP replicas' layouts differ"
    return result


LAYOUTS = {
    # the golden's own TP2 DP2, bucketed: several buckets in the one stage
    "tp2-dp2": dict(BUCKETING),
    # tied embeddings at PP2: the first stage bucketed and its embedding alone; the last stage one bucket
    # (DDP does not bucket later stages) but the output weight's copy alone
    "tp1-pp2-dp2-tied": dict(BUCKETING, tensor_model_parallel_size=1, pipeline_model_parallel_size=2,
                             untie_embeddings_and_output_weights=False),
    # tied at PP2 without overlap_grad_reduce: only the shared embedding splits a buffer
    "tp2-pp2-dp1-tied-no-overlap": dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2,
                                        data_parallel_size=1, untie_embeddings_and_output_weights=False),
}


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_every_parameters_bucket_and_range_are_megatron_cores(tmp_path: Path, name: str) -> None:
    overrides = LAYOUTS[name]
    expected = _mcore_layout(overrides, tmp_path / "mcore")
    actual = _pgconvert_layout(_args(overrides))
    assert sorted(actual) == sorted(expected)
    for rank, buffers in expected.items():
        assert len(actual[rank]) == len(buffers) == 1, rank
        assert actual[rank] == buffers, rank
    buckets = [len(sizes) for buffers in expected.values() for _, sizes in buffers]
    assert max(buckets) >= (3 if overrides.get("overlap_grad_reduce") else 2), buckets


def test_flat_buffers_on_old_code_refused_these_layouts() -> None:
    # The layouts above are what pgconvert used to refuse; a setting it cannot reproduce still is, by name.
    args = _args(dict(BUCKETING, ddp_num_buckets=4))
    with pytest.raises(UnsupportedOptimizerError, match="args.ddp_num_buckets=4"):
        _pgconvert_layout(args)
    args = _args(dict(overlap_grad_reduce=True, ddp_bucket_size=None, data_parallel_size=30,
                      context_parallel_size=2))
    with pytest.raises(UnsupportedOptimizerError, match="context_parallel_size=2.*0.16.1.*0.20.0"):
        _pgconvert_layout(args)


def _relayout(src: Path, dst: Path, overrides: dict[str, Any]) -> None:
    """``src`` (a per-rank distributed-optimizer checkpoint) with ``overrides`` in every rank's args and
    each ``distrib_optim.pt`` moved, parameter by parameter, to the flat layout those args give."""
    from pgconvert.savers.megatron import save_durably

    shutil.copytree(src, dst)
    for path in sorted((dst / "iter_0000002").glob("mp_rank_*/model_optim_rng.pt")):
        state = dict(load_for_test(path))
        old = state["args"]
        new = copy.copy(old)
        for key, value in overrides.items():
            setattr(new, key, value)
        config, layout = config_from_args(old, path, "local", None), layout_from_args(old, path)
        coord = next(c for c in iter_ranks(layout) if path.parent.name == f"mp_rank_{c.tp:02d}")
        rules = OptimizerRules.from_args(old, str(path))
        before, after = (flat_buffers(config, layout, coord, rules, old.padded_vocab_size, args, old.data_parallel_size)
                         for args in (old, new))
        flat = torch.load(path.parent / "distrib_optim.pt", weights_only=True)
        for index, ((old_placed, _), (new_placed, numel)) in enumerate(zip(before, after)):
            ((dtype, tensors),) = flat[index].items()
            moved: dict[str, Any] = {key: torch.zeros(numel) for key in ("param", "exp_avg", "exp_avg_sq")}
            ranges = {item.slot.position: (item.start, item.end) for item in old_placed}
            for item in new_placed:
                start, end = ranges[item.slot.position]
                for key in moved:
                    moved[key][item.start:item.end] = tensors[key][start:end]
            flat[index] = {dtype: dict(moved, numel_unpadded=numel)}
        torch.save(flat, path.parent / "distrib_optim.pt")
        state["args"] = new
        save_durably(state, path)


@pytest.fixture(scope="module")
def bucketed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("bucketed") / "tp2"
    _relayout(DISTOPT, root, BUCKETING)
    return root
