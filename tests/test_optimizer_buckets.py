"""Distributed-optimizer state of runs whose DDP splits each grad buffer into several buckets.

With ``--overlap-grad-reduce`` megatron-core's ``DistributedDataParallel`` cuts the first pipeline stage's
first model chunk into buckets of about ``ddp_bucket_size`` elements, and at pipeline size > 1 with tied
embeddings the shared embedding gets a bucket of its own on any stage. ``pgconvert.optimizer.flat.flat_buffers``
reproduces that; here it is checked against megatron-core itself:

- ``mcore_bucket_layout.py`` builds megatron-core 0.16.1's GPTModel + ``DistributedDataParallel`` (gloo
  processes, one per rank) for every case of one list in ONE run (module fixture ``mcore_layouts``) and
  reports every parameter's (start, end, bucket) in the padded buffer, ``bucket_indices`` and
  ``numel_unpadded``; pgconvert's ``flat_buffers`` / ``bucket_ranges``, padded by ``bucket_divisor``, must be
  the same in every case. The bucket sizes are derived from the model's own parameters
  (``_cumulative_ends``: megatron-core's reversed order, 64-aligned starts): a few parameter ends, each
  exactly (a parameter ending exactly at the bucket size closes it), one less and one more; one element and
  the smallest parameter (buckets smaller than a parameter); the whole buffer and far more. Variants: TP2 at
  DP3 and TP1 at DP6 (buckets padded to lcm(dp, 128) = 384), tied embeddings at PP2 (the embedding's own
  bucket; the one before it ends at the embedding's aligned start), ``ddp_pad_buckets_for_high_nccl_busbw``
  (lcm(dp, 128, 2**16)); and at one bucket size, DP1 and DP2, tied at TP2 PP2, tied without overlap.
- A multi-bucket ``distrib_optim.pt`` checkpoint (the TP2 DP2 training golden, re-laid out for a small
  bucket size) is loaded by megatron-core's own ``load_parameter_state`` with that bucketing
  (``mcore_optimizer_step.py``): it must hold exactly what megatron-core loads from the one-bucket golden,
  and take the same step. Then TP2 -> TP1 -> TP2 is bit-exact, and the TP1 conversion is accepted too.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from support.mcore_step_check import BF16_ATOL, BF16_RTOL, assert_same_step, fixed_gradients, run_steps
from support.megatron_fixtures import assert_same_tree, load_for_test
from support.flat_relayout import relayout
from support.checkpoint_compare import read_common
from support.torch_dist_forms import FOR_MCORE_016_CLI
from pgconvert.model.grid import RankCoord, iter_ranks
from pgconvert.formats.megatron import config_from_args, layout_from_args
from pgconvert.optimizer.flat import FlatParam, bucket_divisor, bucket_ranges, flat_buffers
from pgconvert.optimizer.order import OptimizerRules, UnsupportedOptimizerError, named_parameters
from pgconvert.model.provider import OUTPUT_LAYER

pytest.importorskip("megatron.core", reason="megatron-core's own DDP is the reference")

GOLDENS = Path(__file__).parent / "data" / "megatron_lm"
# Megatron-LM's small training golden (hidden 16: its norms leave 48-element alignment gaps), TP2 DP2
DP_RESHARDABLE = GOLDENS / "train_tp2dp2_distopt_dp_reshardable_torch_dist"
LAYOUT_SCRIPT = Path(__file__).parent / "support" / "mcore_bucket_layout.py"
# elements: one to three parameters per bucket; at TP2 the output layer (512) and the final norm (16) fill
# the first, which then ends at an unaligned 528 (the coalesced buffer drops the 48-element gap after it)
BUCKET = 513
BUCKETING = {"overlap_grad_reduce": True, "ddp_bucket_size": BUCKET}


def _convert(src: Path, dst: Path, *flags: str) -> Any:
    from click.testing import CliRunner

    from pgconvert.cli import main

    return CliRunner().invoke(main, ["convert", str(src), str(dst), "-q", *flags], prog_name="pgconvert")


@pytest.fixture(scope="module")
def golden(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The small golden as per-rank files with distrib_optim.pt (one bucket: it ran without overlap),
    TP2, its args at DP2 (pgconvert's reading of the torch_dist golden, itself checked against megatron-core
    in test_optimizer_acceptance)."""
    root = tmp_path_factory.mktemp("golden") / "tp2"
    result = _convert(DP_RESHARDABLE, root, "--dst-format", "megatron", "--dst-tp", "2")
    assert result.exit_code == 0, result.output
    return root


def _rank0(root: Path) -> Path:
    return root / "iter_0000002" / "mp_rank_00" / "model_optim_rng.pt"


def _args(root: Path, overrides: dict[str, Any]) -> Any:
    args = copy.copy(load_for_test(_rank0(root))["args"])
    for key, value in overrides.items():
        setattr(args, key, value)
    return args


def _pgconvert_layout(args: Any) -> dict[tuple[int, int], list[tuple[dict[str, tuple[int, int, int]], list[int]]]]:
    """(tp, pp) -> per buffer: canonical name -> (bucket, start, end) inside the bucket; unpadded bucket sizes."""
    config = config_from_args(args, Path("args"), "local", None)
    layout = layout_from_args(args, Path("args"))
    rules = OptimizerRules.from_args(args, "args")
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


# The model/layout variants whose DDP buckets are sized from their own parameters (``_bucket_sizes``): the
# padding to a multiple of DP shows at DP 3 and 6 (lcm(dp, 128) = 384), at DP 1, 2 and 4 it is 128.
VARIANTS = {
    "tp2-dp3": dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=1, data_parallel_size=3),
    # tied embeddings at PP2: the first stage bucketed, its embedding alone (the bucket before it ends at the
    # embedding's aligned start); the last stage one bucket (DDP does not bucket later stages) but the
    # output weight's copy alone
    "tp1-pp2-dp3-tied": dict(tensor_model_parallel_size=1, pipeline_model_parallel_size=2, data_parallel_size=3,
                             untie_embeddings_and_output_weights=False),
    "tp1-dp6": dict(tensor_model_parallel_size=1, pipeline_model_parallel_size=1, data_parallel_size=6),
    # each bucket padded to lcm(dp, 128, 2**16) instead (the coalesced layout is the same)
    "tp2-dp3-busbw": dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=1, data_parallel_size=3,
                          ddp_pad_buckets_for_high_nccl_busbw=True),
}
# Cases at one bucket size each (world size 4: DP 1 and 2, and tied at TP2 PP2).
FIXED = {
    # the golden's own TP2, at DP2: one to three parameters per bucket
    "tp2-dp2": dict(BUCKETING, tensor_model_parallel_size=2, data_parallel_size=2),
    "tp1-pp2-dp2-tied": dict(BUCKETING, tensor_model_parallel_size=1, pipeline_model_parallel_size=2,
                             data_parallel_size=2, untie_embeddings_and_output_weights=False),
    # tied at PP2 without overlap_grad_reduce: only the shared embedding splits a buffer
    "tp2-pp2-dp1-tied-no-overlap": dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2,
                                        data_parallel_size=1, untie_embeddings_and_output_weights=False),
    # --ddp-num-buckets: Megatron-LM's get_model sizes the buckets from the rank's parameter count
    "tp2-dp2-num-buckets": dict(overlap_grad_reduce=True, ddp_num_buckets=3, tensor_model_parallel_size=2,
                                data_parallel_size=2),
    "tp1-pp2-dp2-tied-num-buckets": dict(overlap_grad_reduce=True, ddp_num_buckets=4, tensor_model_parallel_size=1,
                                         pipeline_model_parallel_size=2, data_parallel_size=2,
                                         untie_embeddings_and_output_weights=False),
}
# far more than any buffer: one bucket, closed by the remaining parameters, not by the size
HUGE = 10 ** 9


def _cumulative_ends(args: Any) -> list[int]:
    """The ends of the bucketed stage's (pp 0, tp 0) parameters in megatron-core's buffer order (the
    reverse of ``named_parameters()``, each start aligned to 64), as in one bucket: what bucket sizes cut."""
    config = config_from_args(args, Path("args"), "local", None)
    layout = layout_from_args(args, Path("args"))
    ends, cursor = [], 0
    for _, spec in reversed(named_parameters(config, layout, RankCoord(tp=0, pp=0), args.padded_vocab_size)):
        cursor = -(-cursor // 64) * 64 + spec.numel
        ends.append(cursor)
    return ends


def _bucket_sizes(ends: list[int]) -> list[int]:
    """Bucket sizes at a few parameter boundaries (the first parameter's end, the next, the middle one, the
    second last, the whole buffer), each exactly, one less and one more; one element (every bucket smaller
    than any parameter), the smallest parameter (a norm) and far more than the buffer."""
    boundaries = {ends[0], ends[1], ends[len(ends) // 2], ends[-2], ends[-1]}
    smallest = min(end - start for start, end in zip([0, *ends], ends) if end - start > 0)
    return sorted({size + delta for size in boundaries for delta in (-1, 0, 1)} | {1, smallest, HUGE})


def _layout_cases(golden: Path) -> dict[str, dict[str, Any]]:
    """Every case of the one megatron-core run: each variant at each of its derived bucket sizes, the fixed."""
    cases = dict(FIXED)
    for variant, overrides in VARIANTS.items():
        for size in _bucket_sizes(_cumulative_ends(_args(golden, overrides))):
            cases[f"{variant}-bucket{size}"] = dict(overrides, overlap_grad_reduce=True, ddp_bucket_size=size)
    return cases


Layout = dict[tuple[int, int], list[dict[str, Any]]]


def _read_mcore_layouts(out: Path) -> dict[str, Layout]:
    """Case name -> (tp, pp) -> megatron-core's report per buffer; every DP replica reports the same."""
    result: dict[str, Layout] = {}
    for path in sorted(out.glob("world*_rank*.pt")):
        for name, rank in torch.load(path, weights_only=True).items():
            previous = result.setdefault(name, {}).setdefault((rank["tp_rank"], rank["pp_rank"]), rank["buffers"])
            assert previous == rank["buffers"], f"{name}: DP replicas' layouts differ"
    return result


@pytest.fixture(scope="module")
def mcore_layouts(golden: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], dict[str, Layout]]:
    """(case name -> overrides, case name -> megatron-core's layout): one multi-process megatron-core run."""
    cases = _layout_cases(golden)
    out = tmp_path_factory.mktemp("mcore_layouts")
    done = subprocess.run([sys.executable, "-W", "ignore", str(LAYOUT_SCRIPT), str(golden / "iter_0000002"),
                           json.dumps(cases), str(out)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    layouts = _read_mcore_layouts(out)
    assert sorted(layouts) == sorted(cases)
    return cases, layouts


def _pgconvert_padded(args: Any) -> Layout:
    """pgconvert's layout in megatron-core's report form: the padded buffer (each bucket padded to
    ``bucket_divisor``), every parameter's ``(start, end, bucket)``, ``bucket_indices``, per-bucket and buffer
    ``numel_unpadded``, the buffer's padded ``numel``."""
    config = config_from_args(args, Path("args"), "local", None)
    layout = layout_from_args(args, Path("args"))
    rules = OptimizerRules.from_args(args, "args")
    dp = args.data_parallel_size
    divisor = bucket_divisor(dp, args)
    result: Layout = {}
    for coord in iter_ranks(layout):
        buffers = []
        for placed, numel in flat_buffers(config, layout, coord, rules, args.padded_vocab_size, args, dp):
            sizes = [end - start for start, end in bucket_ranges(placed, numel)]
            starts = [0]
            for size in sizes:
                starts.append(starts[-1] + -(-size // divisor) * divisor)
            buffers.append({
                "params": {_name(item): (starts[item.bucket] + item.start - item.bucket_start,
                                         starts[item.bucket] + item.end - item.bucket_start, item.bucket)
                           for item in placed},
                "bucket_indices": list(zip(starts, starts[1:])), "numel_unpadded": sizes,
                "buffer_numel": starts[-1], "buffer_numel_unpadded": numel})
        result[(coord.tp, coord.pp)] = buffers
    return result


@pytest.mark.parametrize("group", [*VARIANTS, *FIXED])
def test_every_parameters_bucket_and_range_are_megatron_cores(
        golden: Path, mcore_layouts: tuple[dict[str, Any], dict[str, Layout]], group: str) -> None:
    cases, layouts = mcore_layouts
    names = [name for name in cases if name == group or name.startswith(f"{group}-bucket")]
    differ = [name for name in names if _pgconvert_padded(_args(golden, cases[name])) != layouts[name]]
    assert differ == [], f"pgconvert's bucket layout is not megatron-core's in {differ}"
    exact, buckets = 0, 0
    for name in names:
        expected = layouts[name]
        size = cases[name].get("ddp_bucket_size") if cases[name].get("overlap_grad_reduce") else None
        exact += expected[(0, 0)][0]["numel_unpadded"][0] == size  # a parameter ends exactly at the bucket size
        buckets = max([buckets, *(len(buffer["numel_unpadded"]) for buffers in expected.values() for buffer in buffers)])
    # the cases are not degenerate: several buckets, and (derived sizes) parameters ending at the bucket size
    assert names and buckets >= (2 if group.endswith("no-overlap") else 3), (names, buckets)
    assert exact >= 3 or group in FIXED, (names, exact)


def test_a_bucketing_pgconvert_does_not_reproduce_is_refused_by_name(golden: Path) -> None:
    for buckets, size in ((0, None), (2, 5000), (1.5, None)):  # what Megatron-LM's get_model refuses
        args = _args(golden, dict(overlap_grad_reduce=True, ddp_num_buckets=buckets, ddp_bucket_size=size))
        with pytest.raises(UnsupportedOptimizerError, match=f"args.ddp_num_buckets={buckets} with ddp_bucket_size"):
            _pgconvert_layout(args)
    args = _args(golden, dict(overlap_grad_reduce=True, ddp_bucket_size=None, data_parallel_size=30,
                      context_parallel_size=2))
    with pytest.raises(UnsupportedOptimizerError, match="context_parallel_size=2.*0.16.1.*0.20.0"):
        _pgconvert_layout(args)


@pytest.fixture(scope="module")
def bucketed(golden: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("bucketed") / "tp2"
    relayout(golden, root, BUCKETING)
    return root


def _with(args: Any, **overrides: Any) -> Any:
    changed = copy.copy(args)
    for key, value in overrides.items():
        setattr(changed, key, value)
    return changed


def test_a_multi_bucket_checkpoint_round_trips_tp2_tp1_tp2_bit_exact(bucketed: Path, tmp_path: Path) -> None:
    one = _convert(bucketed, tmp_path / "tp1", "--dst-tp", "1")
    assert one.exit_code == 0, one.output
    back = _convert(tmp_path / "tp1", tmp_path / "back", "--dst-tp", "2")
    assert back.exit_code == 0, back.output
    (tp1,) = (tmp_path / "tp1" / "iter_0000002").glob("mp_rank_*/model_optim_rng.pt")
    assert len(_pgconvert_layout(load_for_test(tp1)["args"])[(0, 0)][0][1]) >= 5  # buckets at TP1 too
    args = load_for_test(_rank0(bucketed))["args"]
    ((_, sizes),) = _pgconvert_layout(args)[(0, 0)]
    ((_, one_bucket),) = _pgconvert_layout(_with(args, overlap_grad_reduce=False))[(0, 0)]
    (entry,) = torch.load(_rank0(bucketed).parent / "distrib_optim.pt", weights_only=True)[0].values()
    # the coalesced buffer drops the alignment gap after a bucket's last parameter (a 16-element norm)
    assert entry["param"].numel() == entry["numel_unpadded"] == sum(sizes) < sum(one_bucket)
    assert sizes[0] == 528 and len(one_bucket) == 1
    for rank in ("mp_rank_00", "mp_rank_01"):
        original = load_for_test(bucketed / "iter_0000002" / rank / "model_optim_rng.pt")
        again = load_for_test(tmp_path / "back" / "iter_0000002" / rank / "model_optim_rng.pt")
        for key in ("optimizer", "opt_param_scheduler", "num_floating_point_operations_so_far", "model", "args"):
            assert_same_tree(original[key], again[key], f"{rank}.{key}")
        assert_same_tree(torch.load(bucketed / "iter_0000002" / rank / "distrib_optim.pt", weights_only=True),
                     torch.load(tmp_path / "back" / "iter_0000002" / rank / "distrib_optim.pt", weights_only=True),
                     f"{rank}/distrib_optim.pt")


def test_megatron_core_loads_the_multi_bucket_state_and_its_conversion_as_the_golden(golden: Path, bucketed: Path,
                                                                                      tmp_path: Path) -> None:
    assert _convert(bucketed, tmp_path / "tp1", "--dst-tp", "1").exit_code == 0
    fixed_gradients(tmp_path / "tp1", tmp_path / "grads.pt", scale=3e-2)
    runs = [(bucketed / "iter_0000002", tmp_path / "out_bucketed", 2),
            (tmp_path / "tp1" / "iter_0000002", tmp_path / "out_tp1", 1),
            (golden / "iter_0000002", tmp_path / "out_golden", 2)]
    *targets, original = run_steps(tmp_path / "grads.pt", runs)
    assert [len(target) for target in targets] == [4, 1] and len(original) == 4
    args = load_for_test(_rank0(golden))["args"]
    for target in targets:  # megatron-core's DDP (bucket size BUCKET) loaded each with load_parameter_state
        assert_same_step(target, original, args, (BF16_RTOL, BF16_ATOL))


def test_the_dp_reshardable_form_stores_one_record_per_bucket_and_round_trips(bucketed: Path, golden: Path,
                                                                               tmp_path: Path) -> None:
    result = _convert(bucketed, tmp_path / "td", "--dst-format", "torch_dist", "--dst-tp", "1",
                      "--dst-optim-form", "dp_reshardable", *FOR_MCORE_016_CLI)  # megatron-core 0.16.1 steps it
    assert result.exit_code == 0, result.output
    back = _convert(tmp_path / "td", tmp_path / "back", "--dst-format", "megatron", "--dst-tp", "2")
    assert back.exit_code == 0, back.output
    common = read_common(tmp_path / "td" / "iter_0000002")
    ((_, sizes),) = _pgconvert_layout(common["args"])[(0, 0)]
    assert len(sizes) >= 5
    for rank in ("mp_rank_00", "mp_rank_01"):
        original = load_for_test(bucketed / "iter_0000002" / rank / "model_optim_rng.pt")
        again = load_for_test(tmp_path / "back" / "iter_0000002" / rank / "model_optim_rng.pt")
        for key in ("optimizer", "opt_param_scheduler", "num_floating_point_operations_so_far", "model"):
            assert_same_tree(original[key], again[key], f"{rank}.{key}")
        assert_same_tree(torch.load(bucketed / "iter_0000002" / rank / "distrib_optim.pt", weights_only=True),
                     torch.load(tmp_path / "back" / "iter_0000002" / rank / "distrib_optim.pt", weights_only=True),
                     f"{rank}/distrib_optim.pt")
    assert _convert(tmp_path / "td", tmp_path / "tp1", "--dst-format", "megatron").exit_code == 0
    fixed_gradients(tmp_path / "tp1", tmp_path / "grads.pt", scale=3e-2)  # TP1 names and shapes
    # megatron-core's dist_checkpointing.load of the bucketed records (per_bucket_numel_unpadded checked)
    target, original = run_steps(tmp_path / "grads.pt", [(tmp_path / "td" / "iter_0000002", tmp_path / "out_td", 2),
                                                    (golden / "iter_0000002", tmp_path / "out_golden", 2)])
    assert len(target) == 2 and len(original) == 4
    assert_same_step(target, original, load_for_test(_rank0(golden))["args"], (BF16_RTOL, BF16_ATOL))


TIED_SCRIPT = Path(__file__).parent / "support" / "mcore_tied_distopt.py"
BIG_GOLDEN = GOLDENS / "train_tp2dp2_distopt_bf16_torch"


def test_megatron_cores_own_tied_pp2_multi_bucket_state_round_trips_pp2_pp1_pp2_bit_exact(tmp_path: Path) -> None:
    # megatron-core 0.16.1 writes it (save_parameter_state): tied embeddings at PP2, bucket 5000 elements;
    # the first stage's word embedding and the last stage's output copy each in a bucket of their own
    overrides = dict(overlap_grad_reduce=True, ddp_bucket_size=5000, tensor_model_parallel_size=1,
                     pipeline_model_parallel_size=2, untie_embeddings_and_output_weights=False)
    done = subprocess.run([sys.executable, "-W", "ignore", str(TIED_SCRIPT), str(BIG_GOLDEN / "iter_0000002"),
                           json.dumps(overrides), str(tmp_path / "src")], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    src = tmp_path / "src" / "iter_0000002"
    args = load_for_test(src / "mp_rank_00_000" / "model_optim_rng.pt")["args"]
    layout = _pgconvert_layout(args)
    assert [len(layout[(0, pp)][0][1]) for pp in (0, 1)] == [5, 2]  # bucketed + embedding; one + output copy
    for pp in (0, 1):  # pgconvert's buffer sizes are megatron-core's (it wrote numel_unpadded)
        (entry,) = torch.load(src / f"mp_rank_00_{pp:03d}" / "distrib_optim.pt", weights_only=True)[0].values()
        assert entry["numel_unpadded"] == sum(layout[(0, pp)][0][1])
    one = _convert(tmp_path / "src", tmp_path / "pp1", "--dst-pp", "1")
    assert one.exit_code == 0, one.output  # reading checks every fp32 master rounds to its bf16 weight
    back = _convert(tmp_path / "pp1", tmp_path / "back", "--dst-pp", "2")
    assert back.exit_code == 0, back.output
    for rank in ("mp_rank_00_000", "mp_rank_00_001"):
        original = load_for_test(src / rank / "model_optim_rng.pt")
        again = load_for_test(tmp_path / "back" / "iter_0000002" / rank / "model_optim_rng.pt")
        for key in ("optimizer", "opt_param_scheduler", "num_floating_point_operations_so_far", "model"):
            assert_same_tree(original[key], again[key], f"{rank}.{key}")
        assert (again["args"].overlap_grad_reduce, again["args"].ddp_bucket_size) == (True, 5000)
        assert_same_tree(torch.load(src / rank / "distrib_optim.pt", weights_only=True),
                     torch.load(tmp_path / "back" / "iter_0000002" / rank / "distrib_optim.pt", weights_only=True),
                     f"{rank}/distrib_optim.pt")
