"""A MoE model's chained (dense + expert) distributed optimizer through torch_dist in the dp_reshardable
form, proved against megatron-core 0.16.1 itself (``mcore_moe_dp_reshardable.py``: four gloo processes on the CPU,
TP1 x EP2 x DP4, so the dense optimizer is sharded over 4 DP ranks and the expert one over an expert
data-parallel size of 2, its records per EP rank: ``chained_1.optimizer.distributed.dp_group_idx_<ep>``).

The source is a TP2 x EP2 run laid out by megatron-core's optimizers (``mcore_moe_optimizer.py``). pgconvert writes
it as TP1 x EP2 x DP4 dp_reshardable; megatron-core loads that with ``dist_checkpointing.load`` and saves its own
dp_reshardable checkpoint from what it loaded; pgconvert reads megatron-core's and converts it on.
"""

from __future__ import annotations

import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner, Result

from support.cli_helpers import assert_clean_refusal
from support.dp_records import FIELDS, assert_records_equal, optimizer_entries
from support.megatron_fixtures import load_for_test
from support.moe_optimizer_runs import ITER, assert_optimizer_files_equal, generate
from support.torch_dist_forms import FOR_MCORE_016_CLI
from support.checkpoint_compare import read_common
from support.optimizer_cli import torch_metadata
from pgconvert.cli import main


pytest.importorskip("megatron.core", reason="megatron-core lays out, loads and saves the reference state")


DP4 = ("--dst-tp", "1", "--dst-ep", "2", "--dst-dp", "4")


def _cli(*args: str | Path) -> Result:
    return CliRunner().invoke(main, [str(arg) for arg in args], prog_name="pgconvert")


def _convert(src: Path, dst: Path, *flags: str) -> None:
    result = _cli("convert", src, dst, "-q", "--strict", *flags, *FOR_MCORE_016_CLI)
    assert result.exit_code == 0, result.output


def _export(src: Path, out: Path) -> dict[str, dict[str, torch.Tensor]]:
    result = _cli("export-optimizer", src, out)
    assert result.exit_code == 0, result.output
    return {path.stem: torch.load(path, weights_only=True) for path in sorted(out.glob("*.pt"))}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The source (per-rank TP2 x EP2), pgconvert's dp_reshardable TP1 x EP2 x DP4 of it, and megatron-core's
    load (rank reports) and own save of that."""
    root = tmp_path_factory.mktemp("moe_dp_reshardable")
    source = generate(root / "dist", 2, 1, 2, "distributed")
    _convert(source, root / "ours", "--dst-format", "torch_dist", *DP4, "--dst-optim-form", "dp_reshardable")
    script = Path(__file__).parent / "support" / "mcore_moe_dp_reshardable.py"
    done = subprocess.run([sys.executable, "-W", "ignore", str(script), str(root / "ours" / ITER), str(root / "mc")],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (root / "saved").mkdir()  # megatron-core's save as a checkpoint root, as Megatron-LM lays it out
    shutil.move(root / "mc" / "saved", root / "saved" / ITER)
    (root / "saved" / "latest_checkpointed_iteration.txt").write_text("2")
    return {"source": source, "ours": root / "ours", "mc": root / "mc", "saved": root / "saved"}


def _assert_records_equal(reference: Path, written: Path) -> None:
    """``dp_records.assert_records_equal``: dense (chained_0) at one model-parallel rank, expert (chained_1) at two
    (one per EP rank): 3 buffers x 3 fields."""
    assert len(assert_records_equal(reference, written, ITER, zero_gaps=False)) == 9


def test_pgconverts_records_are_the_ones_megatron_core_declares_and_saves(runs: dict[str, Path]) -> None:
    declared: dict[str, object] = {}
    for rank in range(4):
        report = torch.load(runs["mc"] / f"rank{rank}.pt", weights_only=True)
        # expert data-parallel size tp*dp/(tp*ep) = 2; the expert optimizer's data_parallel_group_idx is the EP rank
        assert report["groups"] == {"dense": rank, "expert_dp": rank // 2, "expert_dp_size": 2, "idx": [0, rank % 2]}
        assert report["steps"] == [[2.0, 2.0], [2.0]]  # the param groups' step, from the chained .optimizer objects
        declared.update(report["declared"])
    stored = optimizer_entries(runs["ours"] / ITER)
    # ShardedTensors by key and global shape; ShardedObjects stored as <key>/shard_0_1
    assert {key: list(md.size) if hasattr(md, "chunks") else None for key, md in stored.items()} == \
        {(key + "/shard_0_1" if shape is None else key): shape for key, shape in declared.items()}
    _assert_records_equal(runs["saved"], runs["ours"])
    for checkpoint in ("ours", "saved"):
        common = read_common(runs[checkpoint] / ITER)
        assert common["optimizer"] == {index: {"param_state_sharding_type": "dp_reshardable"} for index in (0, 1)}


def test_megatron_core_holds_the_sources_state_per_parameter(runs: dict[str, Path], tmp_path: Path) -> None:
    reference = _export(runs["source"], tmp_path / "reference")
    covered: dict[str, int] = {}
    for rank in range(4):
        held = torch.load(runs["mc"] / f"rank{rank}.pt", weights_only=True)["held"]
        assert len(held) == 2 and all(held)  # dense, then expert
        for optimizer, own in enumerate(held):
            for name, (offset, tensors) in own.items():
                assert (".local_experts." in name) == (optimizer == 1), name
                for key in FIELDS:
                    whole = reference[name][key].reshape(-1)
                    assert torch.equal(tensors[key], whole[offset:offset + tensors[key].numel()]), f"{name}.{key}"
                covered[name] = covered.get(name, 0) + tensors["param"].numel()
    # every element once: a dense parameter over 4 DP ranks, an expert over its EP rank's 2 expert DP ranks
    assert covered == {name: tensors["param"].numel() for name, tensors in reference.items()}


def test_megatron_cores_own_save_is_read_and_converted_bit_exactly(runs: dict[str, Path], tmp_path: Path) -> None:
    exported = _export(runs["saved"], tmp_path / "export")
    reference = _export(runs["source"], tmp_path / "reference")
    assert set(exported) == set(reference)
    for name, tensors in reference.items():
        for key in (*FIELDS, "step"):
            assert torch.equal(exported[name][key], tensors[key]), f"{name}.{key}"
    # megatron-core's EP2 save -> TP2 x EP1 dp_reshardable (one optimizer) -> TP1 x EP2 x DP4: its records again
    _convert(runs["saved"], tmp_path / "ep1", "--dst-format", "torch_dist", "--dst-tp", "2", "--dst-ep", "1",
             "--dst-dp", "2")
    common = read_common(tmp_path / "ep1" / ITER)
    assert common["optimizer"] == {"param_state_sharding_type": "dp_reshardable"}
    assert not [key for key in optimizer_entries(tmp_path / "ep1" / ITER) if key.startswith("chained_")]
    _convert(tmp_path / "ep1", tmp_path / "back", "--dst-format", "torch_dist", *DP4)
    _assert_records_equal(runs["saved"], tmp_path / "back")
    # and into the per-rank form of the source's layout: its distrib_optim.pt files, bit for bit
    _convert(runs["saved"], tmp_path / "per_rank", "--dst-format", "megatron", "--dst-tp", "2", "--dst-ep", "2")
    assert_optimizer_files_equal(runs["source"], tmp_path / "per_rank")


def _damaged(runs: dict[str, Path], tmp_path: Path) -> Path:
    shutil.copytree(runs["ours"], tmp_path / "bad")
    return tmp_path / "bad"


def _edit_metadata(checkpoint: Path, edit) -> None:  # type: ignore[no-untyped-def]
    path = checkpoint / ITER / ".metadata"
    metadata = torch_metadata(path.parent)  # torch's classes, pickled back as torch would
    edit(metadata.state_dict_metadata)
    path.write_bytes(pickle.dumps(metadata))


EXPERT = "chained_1.optimizer.distributed.dp_group_idx_1.gbuf_idx_0.dtype_(torch.float32, torch.float32).bucket_idx_0"


def test_a_missing_chained_record_is_a_named_error(runs: dict[str, Path], tmp_path: Path) -> None:
    bad = _damaged(runs, tmp_path)
    _edit_metadata(bad, lambda entries: entries.pop(f"{EXPERT}.exp_avg"))
    result = _cli("convert", bad, tmp_path / "out", "--dst-format", "megatron")
    assert_clean_refusal(result, 1, str(bad), f"no optimizer record '{EXPERT}.exp_avg'", "dp_reshardable form",
                         "--skip-optimizer")
    assert not (tmp_path / "out").exists()


def test_a_wrong_size_expert_bucket_is_a_named_error(runs: dict[str, Path], tmp_path: Path) -> None:
    bad = _damaged(runs, tmp_path)

    def grow(entries: dict) -> None:
        entries[f"{EXPERT}.param"].size = torch.Size([entries[f"{EXPERT}.param"].size[0] + 64])
    _edit_metadata(bad, grow)
    result = _cli("convert", bad, tmp_path / "out", "--dst-format", "megatron")
    assert_clean_refusal(result, 1, f"'{EXPERT}.param' has global shape [147520]", "gives [147456]")
    assert not (tmp_path / "out").exists()


def test_a_mismatched_number_of_chained_optimizers_is_a_named_error(runs: dict[str, Path], tmp_path: Path) -> None:
    bad = _damaged(runs, tmp_path)
    path = bad / ITER / "common.pt"
    common = load_for_test(path)
    common["optimizer"] = {0: common["optimizer"][0]}  # the dense optimizer alone, at EP 2
    torch.save(common, path, pickle_module=pickle)
    result = _cli("convert", bad, tmp_path / "out", "--dst-format", "megatron")
    assert_clean_refusal(result, 1, "common state", "optimizer holds 1 optimizer(s)", "chains 2")
    # and the expert optimizer's param groups object missing
    common["optimizer"] = read_common(runs["ours"] / ITER)["optimizer"]
    torch.save(common, path, pickle_module=pickle)
    key = "chained_1.optimizer.distributed.dp_group_idx_0.optimizer/shard_0_1"
    _edit_metadata(bad, lambda entries: entries.pop(key))
    result = _cli("convert", bad, tmp_path / "out", "--dst-format", "megatron")
    assert_clean_refusal(result, 1, str(bad), f"no stored object ['{key}']")
    assert not (tmp_path / "out").exists()


ETP1 = ("--dst-tp", "2", "--dst-expert-tp", "1", "--dst-ep", "2", "--dst-dp", "2")


def test_an_expert_tensor_parallel_size_other_than_tp_is_carried_in_dp_reshardable(runs: dict[str, Path],
                                                                                    tmp_path: Path) -> None:
    """TP2 with expert TP1, EP2, DP2 (4 gloo ranks; expert data-parallel size 2 * 2 / (1 * 2) = 2): megatron-core
    declares pgconvert's records, holds the source's state for every whole expert it loads from them, and its own
    save of what it loaded goes back to the source's per-rank files (expert TP = TP) bit for bit."""
    _convert(runs["source"], tmp_path / "ours", "--dst-format", "torch_dist", *ETP1, "--dst-optim-form",
             "dp_reshardable")
    script = Path(__file__).parent / "support" / "mcore_moe_dp_reshardable.py"
    done = subprocess.run([sys.executable, "-W", "ignore", str(script), str(tmp_path / "ours" / ITER),
                           str(tmp_path / "mc")], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    reference = _export(runs["source"], tmp_path / "reference")
    declared: dict[str, object] = {}
    experts = 0
    for rank in range(4):
        report = torch.load(tmp_path / "mc" / f"rank{rank}.pt", weights_only=True)
        # the expert optimizer's data_parallel_group_idx: the rank in expert tp-ep-pp, here the EP rank
        assert report["groups"]["expert_dp_size"] == 2 and report["groups"]["idx"][1] == rank % 2
        declared.update(report["declared"])
        for name, (offset, tensors) in report["held"][1].items():
            for key in FIELDS:
                whole = reference[name][key].reshape(-1)
                assert torch.equal(tensors[key], whole[offset:offset + tensors[key].numel()]), f"{name}.{key}"
            experts += tensors["param"].numel()
    assert experts == sum(tensors["param"].numel() for name, tensors in reference.items() if ".local_experts." in name)
    stored = optimizer_entries(tmp_path / "ours" / ITER)
    assert {key: list(md.size) if hasattr(md, "chunks") else None for key, md in stored.items()} == \
        {(key + "/shard_0_1" if shape is None else key): shape for key, shape in declared.items()}
    (tmp_path / "saved").mkdir()
    shutil.move(tmp_path / "mc" / "saved", tmp_path / "saved" / ITER)
    (tmp_path / "saved" / "latest_checkpointed_iteration.txt").write_text("2")
    assert assert_records_equal(tmp_path / "saved", tmp_path / "ours", ITER, zero_gaps=False)
    _convert(tmp_path / "saved", tmp_path / "per_rank", "--dst-format", "megatron", "--dst-tp", "2", "--dst-ep", "2")
    assert_optimizer_files_equal(runs["source"], tmp_path / "per_rank")


def test_record_prefixes_are_the_ranks_in_megatron_cores_model_parallel_groups() -> None:
    # The data_parallel_group_idx of each chained optimizer (get_megatron_optimizer: the rank in mp_group, tp-pp,
    # and in expt_tp_pp_group, tp-ep-pp) at TP2 x EP2 x PP2 x DP4 (expert DP 2), from megatron-core's RankGenerator
    # as initialize_model_parallel builds both grids
    from megatron.core.parallel_state import RankGenerator

    from pgconvert.model.config import ModelConfig
    from pgconvert.model.grid import RankCoord
    from pgconvert.model.layout import ParallelLayout
    from pgconvert.formats.torch_dist_optimizer import record_prefix
    from pgconvert.optimizer.data_parallel import optimizer_dp

    order = "tp-cp-ep-dp-pp"
    dense = RankGenerator(tp=2, ep=1, dp=4, pp=2, cp=1, order=order, rank_offset=0)
    expert = RankGenerator(tp=2, ep=2, dp=2, pp=2, cp=1, order=order, rank_offset=0)
    config = ModelConfig(num_layers=4, hidden_size=64, num_attention_heads=8, ffn_hidden_size=128, num_experts=8)
    layout = ParallelLayout(tp=2, pp=2, ep=2)
    assert optimizer_dp(config, layout, 4, None, 1, "here") == 2

    def index(groups: list[list[int]], rank: int) -> int:
        return next(group.index(rank) for group in groups if rank in group)

    for rank in range(16):
        coord = RankCoord(tp=rank % 2, pp=rank // 8, ep=index(expert.get_ranks("ep"), rank))
        assert record_prefix(config, layout, coord, 0) == \
            f"chained_0.optimizer.distributed.dp_group_idx_{index(dense.get_ranks('tp-pp'), rank)}"
        assert record_prefix(config, layout, coord, 1) == \
            f"chained_1.optimizer.distributed.dp_group_idx_{index(expert.get_ranks('tp-ep-pp'), rank)}"
    # expert TP 1 at TP 2: the expert grid is expert tp 1 x ep 2 x expert dp 4 x pp 2
    expert = RankGenerator(tp=1, ep=2, dp=4, pp=2, cp=1, order=order, rank_offset=0)
    layout = ParallelLayout(tp=2, pp=2, ep=2, expert_tp=1)
    assert optimizer_dp(config, layout, 4, None, 1, "here") == 4
    for rank in range(16):
        coord = RankCoord(tp=0, pp=rank // 8, ep=index(expert.get_ranks("ep"), rank), etp=0)
        assert record_prefix(config, layout, coord, 1) == \
            f"chained_1.optimizer.distributed.dp_group_idx_{index(expert.get_ranks('tp-ep-pp'), rank)}"
