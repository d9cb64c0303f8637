"""optcli: the grad scaler through torch_dist, optimizer options checked before anything is written,
``--dry-run``'s optimizer lines, and one rule for optimizer state that is not carried.

fp16 state: megatron-core saves ``grad_scaler`` (``DynamicGradScaler.state_dict``: scale, growth_tracker,
hysteresis_tracker) beside the optimizer's param groups whenever the optimizer has a scaler. The goldens
were trained in bf16 (no scaler), so the fp16 sources here are those goldens with a dynamic scaler's state
added where megatron-core 0.16.1 puts it; the carrying code does not look at the model's dtype.
"""

from __future__ import annotations

import io
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner, Result
from torch.distributed.checkpoint.metadata import MetadataIndex

from cli_helpers import assert_clean_refusal
from megatron_fixtures import allowed_globals, assert_same_tree, load_for_test
from pgconvert.cli import main
from pgconvert.megatron_format import FRAMEWORK_PICKLE
from pgconvert.torch_dist_format import read_dcp_metadata

GOLDENS = Path(__file__).parent / "data" / "megatron_lm"
ITER = "iter_0000002"
DISTOPT = GOLDENS / "train_tp2dp2_distopt_bf16_torch"
FULLY = GOLDENS / "train_tp2dp2_distopt_fully_reshardable_torch_dist"
PLAIN_BF16 = GOLDENS / "train_tp2dp2_bf16_torch"
PLAIN_TD = GOLDENS / "train_tp2pp2_bf16_torch_dist"
NO_OPTIMIZER = GOLDENS / "convert_py_core_tp2"


def _scaler(scale: float = 4096.0, growth: int = 7, hysteresis: int = 1) -> dict[str, object]:
    return {"scale": torch.tensor(scale), "growth_tracker": growth, "hysteresis_tracker": hysteresis}


def _cli(*args: str | Path) -> Result:
    return CliRunner().invoke(main, [str(arg) for arg in args], prog_name="pgconvert")


def _converted(src: Path, dst: Path, *flags: str | Path) -> Path:
    result = _cli("convert", src, dst, "-q", *flags)
    assert result.exit_code == 0, result.output
    return dst


def _per_rank_fp16(tmp_path: Path, scaler: dict[str, object]) -> Path:
    """The per-rank distributed-optimizer golden with a dynamic grad scaler in every rank's optimizer entry."""
    src = tmp_path / "fp16"
    shutil.copytree(DISTOPT, src)
    for path in sorted((src / ITER).glob("mp_rank_*/model_optim_rng.pt")):
        state = load_for_test(path)
        state["optimizer"]["grad_scaler"] = scaler  # DistributedOptimizer.state_dict's place for it
        torch.save(state, path, pickle_module=FRAMEWORK_PICKLE)  # args' enum stand-ins
    return src


def _stored_object(iteration_dir: Path, key: str) -> object:
    """A ShardedObject's value read from the bytes ``.metadata`` points at (not through pgconvert's reader)."""
    metadata = read_dcp_metadata(iteration_dir / ".metadata")
    info = metadata.storage_data[MetadataIndex(key)]
    with open(iteration_dir / info.relative_path, "rb") as handle:
        handle.seek(info.offset)
        data = handle.read(info.length)
    (value,) = torch.load(io.BytesIO(data), weights_only=True)  # megatron-core stores [ShardedObject.data]
    return value


def _rank_scalers(root: Path) -> list[object]:
    return [load_for_test(path)["optimizer"].get("grad_scaler")
            for path in sorted((root / ITER).glob("mp_rank_*/model_optim_rng.pt"))]


def test_the_grad_scaler_goes_into_torch_dist_in_both_forms_and_back(tmp_path: Path) -> None:
    scaler = _scaler()
    src = _per_rank_fp16(tmp_path, scaler)
    fully = _converted(src, tmp_path / "fully", "--dst-format", "torch_dist", "--dst-tp", "1")
    # fully_reshardable: DistributedOptimizer.sharded_state_dict keeps it as common state (common.pt)
    common = load_for_test(fully / ITER / "common.pt")
    assert common["optimizer"]["param_state_sharding_type"] == "fully_reshardable"
    assert_same_tree(common["optimizer"]["grad_scaler"], scaler, "common.pt optimizer.grad_scaler")
    # dp_reshardable: a ShardedObject per model-parallel rank g = tp + tp_size * pp
    dp = _converted(fully, tmp_path / "dp", "--dst-format", "torch_dist", "--dst-tp", "2", "--dst-pp", "2",
                    "--dst-optim-form", "dp_reshardable")
    assert "grad_scaler" not in load_for_test(dp / ITER / "common.pt")["optimizer"]
    for group in range(4):
        stored = _stored_object(dp / ITER, f"optimizer.distributed.dp_group_idx_{group}.grad_scaler/shard_0_1")
        assert_same_tree(stored, scaler, f"dp_group_idx_{group}.grad_scaler")
    # read back from each torch_dist form into per-rank files (torch_dist -> per-rank) and torch_dist again
    for name, root in (("from_fully", fully), ("from_dp", dp)):
        back = _converted(root, tmp_path / name, "--dst-format", "megatron", "--dst-tp", "2", "--dst-pp", "1")
        scalers = _rank_scalers(back)
        assert len(scalers) == 2
        for rank, held in enumerate(scalers):
            assert_same_tree(held, scaler, f"{name} rank {rank} optimizer.grad_scaler")
    again = _converted(dp, tmp_path / "again", "--dst-format", "torch_dist", "--dst-optim-form", "fully_reshardable")
    assert_same_tree(load_for_test(again / ITER / "common.pt")["optimizer"]["grad_scaler"], scaler, "again")


def test_a_torch_dist_source_without_a_scaler_writes_none(tmp_path: Path) -> None:
    # bf16 (no scaler): nothing is invented on the way to per-rank files or to torch_dist
    back = _converted(FULLY, tmp_path / "rank", "--dst-format", "megatron", "--dst-tp", "1")
    assert _rank_scalers(back) == [None]
    td = _converted(FULLY, tmp_path / "td", "--dst-format", "torch_dist", "--dst-optim-form", "dp_reshardable")
    assert "optimizer.distributed.dp_group_idx_0.grad_scaler/shard_0_1" not in \
        read_dcp_metadata(td / ITER / ".metadata").state_dict_metadata


def test_megatron_cores_common_state_reader_finds_the_scaler_where_its_load_merges_it(tmp_path: Path) -> None:
    pytest.importorskip("megatron.core")
    from megatron.core import dist_checkpointing

    scaler = _scaler(512.0, 3, 2)
    td = _converted(_per_rank_fp16(tmp_path, scaler), tmp_path / "td", "--dst-format", "torch_dist")
    with torch.serialization.safe_globals(allowed_globals()):  # args' Namespace and Megatron's enums
        common = dist_checkpointing.load_common_state_dict(str(td / ITER))
    assert_same_tree(common["optimizer"]["grad_scaler"], scaler, "megatron-core's common state")
