"""The grad scaler through torch_dist, optimizer options checked before anything is written,
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

from support.cli_helpers import assert_clean_refusal
from support.megatron_fixtures import allowed_globals, assert_same_tree, load_for_test
from support.moe_optimizer_runs import generate
from support.torch_dist_forms import FOR_MCORE_016_CLI
from support.checkpoint_compare import read_common
from support.optimizer_cli import torch_metadata
from pgconvert.cli import main
from pgconvert.formats.megatron import FRAMEWORK_PICKLE
from pgconvert.formats.torch_dist import read_dcp_metadata

GOLDENS = Path(__file__).parent / "data" / "megatron_lm"
ITER = "iter_0000002"
DISTOPT = GOLDENS / "train_tp2dp2_distopt_bf16_torch"
FULLY = GOLDENS / "train_tp2dp2_distopt_fully_reshardable_torch_dist"
PLAIN_BF16 = GOLDENS / "train_tp2dp2_bf16_torch"
PLAIN_TD = GOLDENS / "train_tp2pp2_bf16_torch_dist"
NO_OPTIMIZER = GOLDENS / "convert_py_core_tp2"


def _scaler(scale: float = 4096.0, growth: int = 7, hysteresis: int = 1) -> dict[str, object]:
    return {"scale": torch.tensor([scale]), "growth_tracker": growth, "hysteresis_tracker": hysteresis}


def _cli(*args: str | Path) -> Result:
    return CliRunner().invoke(main, [str(arg) for arg in args], prog_name="pgconvert")


def _converted(src: Path, dst: Path, *flags: str | Path) -> Path:
    result = _cli("convert", src, dst, "-q", *flags, *FOR_MCORE_016_CLI)
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
    metadata = torch_metadata(iteration_dir)
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
    common = read_common(fully / ITER)
    assert common["optimizer"]["param_state_sharding_type"] == "fully_reshardable"
    assert_same_tree(common["optimizer"]["grad_scaler"], scaler, "common.pt optimizer.grad_scaler")
    # dp_reshardable: a ShardedObject per model-parallel rank g = tp + tp_size * pp
    dp = _converted(fully, tmp_path / "dp", "--dst-format", "torch_dist", "--dst-tp", "2", "--dst-pp", "2",
                    "--dst-optim-form", "dp_reshardable")
    assert "grad_scaler" not in read_common(dp / ITER)["optimizer"]
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
    assert_same_tree(read_common(again / ITER)["optimizer"]["grad_scaler"], scaler, "again")


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


def _moe(tmp_path: Path, form: str, scalers: list[dict[str, object]]) -> Path:
    """megatron-core's chained (dense, expert) optimizers of the MoE fixture at TP2 EP2, each with a scaler."""
    pytest.importorskip("megatron.core", reason="megatron-core lays out the chained optimizers")

    src = generate(tmp_path / f"moe_{form}", 2, 1, 2, form)
    for path in sorted((src / ITER).glob("mp_rank_*/model_optim_rng.pt")):
        state = load_for_test(path)
        for entry, scaler in zip(state["optimizer"], scalers):
            entry["grad_scaler"] = scaler
        torch.save(state, path, pickle_module=FRAMEWORK_PICKLE)
    return src


def test_chained_optimizers_keep_their_own_scalers_through_torch_dist(tmp_path: Path) -> None:
    dense, expert = _scaler(1024.0, 5, 2), _scaler(2048.0, 6, 1)
    src = _moe(tmp_path, "distributed", [dense, expert])
    td = _converted(src, tmp_path / "td", "--dst-format", "torch_dist")
    common = read_common(td / ITER)["optimizer"]
    assert sorted(common) == [0, 1]
    assert_same_tree(common[0]["grad_scaler"], dense, "dense")
    assert_same_tree(common[1]["grad_scaler"], expert, "expert")
    back = _converted(td, tmp_path / "back", "--dst-format", "megatron")
    for path in sorted((back / ITER).glob("mp_rank_*/model_optim_rng.pt")):
        entries = load_for_test(path)["optimizer"]
        assert_same_tree([entry["grad_scaler"] for entry in entries], [dense, expert], str(path))


def test_an_expert_scaler_that_one_optimizer_cannot_hold_is_named_and_refused_under_strict(tmp_path: Path) -> None:
    import pgconvert

    dense, expert = _scaler(1024.0, 5, 2), _scaler(2048.0, 6, 1)
    src = _moe(tmp_path, "bf16", [dense, expert])
    # expert parallel size 1: one optimizer, one scaler; the dense one's is kept, the expert one's named
    report = pgconvert.convert(src, tmp_path / "ep1", dst_ep=1)
    assert any("grad_scaler of chained optimizer 1" in note and "2048.0" in note and "not carried" in note
               for note in report.notices), report.notices
    assert_same_tree(_rank_scalers(tmp_path / "ep1"), [dense, dense], "ep1")
    result = _cli("convert", src, tmp_path / "strict", "--dst-ep", "1", "--strict")
    assert_clean_refusal(result, 2, "grad_scaler of chained optimizer 1", "not carried")
    assert not (tmp_path / "strict").exists()


BAD_OPTIONS = [  # (source, CLI flags, the same as ConvertRequest fields, what the error says)
    (DISTOPT, ("--dst-format", "megatron", "--dst-optim-form", "dp_reshardable"),
     {"dst_format": "megatron", "dst_optim_form": "dp_reshardable"},
     "--dst-optim-form dp_reshardable: applies to a torch_dist destination, not megatron"),
    (FULLY, ("--dst-format", "torch_dist", "--dst-optim-form", "dp_reshardable", "--skip-optimizer"),
     {"dst_format": "torch_dist", "dst_optim_form": "dp_reshardable", "skip_optimizer": True},
     "drop --skip-optimizer or --dst-optim-form"),
    (DISTOPT, ("--dst-dp", "4", "--skip-optimizer"), {"dst_dp": 4, "skip_optimizer": True},
     "--dst-dp 4: sizes the carried optimizer state"),
    (DISTOPT, ("--dst-dp", "2", "--dst-format", "hf"), {"dst_dp": 2, "dst_format": "hf"},
     "--dst-dp 2: applies to a Megatron per-rank destination, not hf"),
    (NO_OPTIMIZER, ("--dst-dp", "2"), {"dst_dp": 2}, "--dst-dp 2: the source holds no Megatron optimizer state"),
]


@pytest.mark.parametrize("src, flags, options, fragment", BAD_OPTIONS)
def test_bad_optimizer_options_are_refused_before_anything_is_written(
        tmp_path: Path, src: Path, flags: tuple[str, ...], options: dict[str, object], fragment: str) -> None:
    import re

    import pgconvert
    from pgconvert.errors import ValidationError

    dst = tmp_path / "new_parent" / "dst"
    assert_clean_refusal(_cli("convert", src, dst, "-q", *flags), 2, fragment)
    assert not (tmp_path / "new_parent").exists()  # staging (the old place of these checks) creates DST's parent
    with pytest.raises(ValidationError, match=re.escape(fragment)):  # refused by plan(), before any saver runs
        pgconvert.plan(pgconvert.ConvertRequest(src=src, dst=dst, **options))  # type: ignore[arg-type]


def _dry_run(src: Path, dst: Path, *flags: str) -> dict[str, tuple[str, int, int]]:
    """``--dry-run``'s optimizer lines, by destination file: (what, tensors, bytes); nothing is written."""
    result = _cli("convert", src, dst, "--dry-run", *flags)
    assert result.exit_code == 0, result.output
    assert not dst.exists()
    planned = {}
    for line in result.output.splitlines():
        if line.startswith("  ") and "  + " in line:
            relpath, rest = line.strip().split("  + ")
            what, tensors, nbytes = rest.rsplit("  ", 2)
            planned[relpath] = (what, int(tensors.split()[0]), int(nbytes.split()[0]))
    total = [line for line in result.output.splitlines() if line.startswith("optimizer: ") and "files" in line]
    assert total == [f"optimizer: {len(planned)} files, {sum(p[1] for p in planned.values())} tensors, "
                     f"{sum(p[2] for p in planned.values())} bytes"], result.output
    return planned


def _tensors(tree: object) -> list[torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, dict):
        return [t for key in tree for t in _tensors(tree[key]) if key != "param_groups"]
    if isinstance(tree, (list, tuple)):
        return [t for item in tree for t in _tensors(item)]
    return []


def _count(tensors: list[torch.Tensor]) -> tuple[int, int]:
    return len(tensors), sum(t.numel() * t.element_size() for t in tensors)


# 15 parameters, each its state: Adam's moments and step, and a float16 run's fp32 master beside; a plain Muon run's
# 8 Muon parameters a momentum buffer and a master each, its 7 Adam ones four tensors.
@pytest.mark.parametrize("src, form, count", [(GOLDENS / "train_tp2pp2_torch", "fp32", 3 * 15),
                                              (PLAIN_BF16, "float16", 4 * 15),
                                              (GOLDENS / "train_tp2dp2_muon_bf16_torch", "float16", 2 * 8 + 4 * 7)])
def test_dry_run_shows_each_rank_files_plain_optimizer_entry_as_written(tmp_path: Path, src: Path, form: str,
                                                                        count: int) -> None:
    planned = _dry_run(src, tmp_path / "dst", "--dst-tp", "1", "--dst-pp", "1")
    assert list(planned) == [f"{ITER}/mp_rank_00/model_optim_rng.pt"]
    (what, tensors, nbytes), = planned.values()
    assert what == f"optimizer entry ({form})" and tensors == count
    written = _converted(src, tmp_path / "dst", "--dst-tp", "1", "--dst-pp", "1")
    entry = load_for_test(written / ITER / "mp_rank_00" / "model_optim_rng.pt")["optimizer"]
    assert _count(_tensors(entry)) == (tensors, nbytes)


def test_dry_run_shows_each_ranks_distrib_optim_file_as_written(tmp_path: Path) -> None:
    planned = _dry_run(DISTOPT, tmp_path / "dst", "--dst-dp", "4")
    assert sorted(planned) == [f"{ITER}/mp_rank_0{tp}/distrib_optim.pt" for tp in range(2)]
    written = _converted(DISTOPT, tmp_path / "dst", "--dst-dp", "4")
    for relpath, (what, tensors, nbytes) in planned.items():
        assert what == "flat buffers (distributed)"
        assert _count(_tensors(torch.load(written / relpath, weights_only=True))) == (tensors, nbytes), relpath


@pytest.mark.parametrize("form", ["fully_reshardable", "dp_reshardable"])
def test_dry_run_shows_the_torch_dist_records_as_written(tmp_path: Path, form: str) -> None:
    import pgconvert

    flags = ("--dst-format", "torch_dist", "--dst-tp", "1", "--dst-optim-form", form)
    planned = _dry_run(DISTOPT, tmp_path / "dst", *flags)
    assert list(planned) == [f"{ITER}/__1_0.distcp"]
    (what, tensors, nbytes), = planned.values()
    assert what.startswith(f"optimizer records (distributed, {form}")
    report = pgconvert.convert(DISTOPT, tmp_path / "dst", dst_format="torch_dist", dst_tp=1, dst_optim_form=form)
    (records,) = [item for item in report.files if item.relpath == f"{ITER}/__1_0.distcp"]
    assert (records.tensors, records.nbytes) == (tensors, nbytes)
    metadata = read_dcp_metadata(tmp_path / "dst" / ITER / ".metadata")
    stored = [index for index, info in metadata.storage_data.items() if info.relative_path == "__1_0.distcp"]
    assert len(stored) == tensors


def test_dry_run_names_optimizer_state_that_is_not_carried_and_strict_refuses_it(tmp_path: Path) -> None:
    # the plain optimizer goes into torch_dist in its own plain form only, not a distributed one
    flags = ("--dry-run", "--dst-format", "torch_dist", "--dst-optim-form", "dp_reshardable")
    result = _cli("convert", PLAIN_BF16, tmp_path / "dst", *flags)
    assert result.exit_code == 0, result.output
    assert "optimizer: guess: optimizer state not carried" in result.output
    strict = _cli("convert", PLAIN_BF16, tmp_path / "dst", *flags, "--strict")
    assert_clean_refusal(strict, 2, "float16 (non-distributed) optimizer")
    plain = _cli("convert", PLAIN_BF16, tmp_path / "dst", "--dry-run", "--dst-format", "torch_dist", "--strict")
    assert plain.exit_code == 0 and "optimizer records (float16, plain;" in plain.output, plain.output
    # no optimizer state, or --skip-optimizer: no optimizer lines
    for src, flags in ((NO_OPTIMIZER, ()), (DISTOPT, ("--skip-optimizer",))):
        result = _cli("convert", src, tmp_path / "dst", "--dry-run", *flags)
        assert result.exit_code == 0 and "optimizer" not in result.output, result.output


@pytest.mark.parametrize("src, dst_format, fragment", [  # a plain optimizer into a distributed form
    (PLAIN_BF16, "torch_dist", "float16 (non-distributed) optimizer's state is written into torch_dist in its own"),
    (PLAIN_TD, "torch_dist", "float16 (non-distributed) optimizer's state is written into torch_dist in its own"),
])
def test_optimizer_state_not_carried_is_a_notice_and_refused_under_strict_in_every_direction(
        tmp_path: Path, src: Path, dst_format: str, fragment: str) -> None:
    import pgconvert

    report = pgconvert.convert(src, tmp_path / "lenient", dst_format=dst_format, dst_optim_form="fully_reshardable")
    assert any(note.startswith("guess: optimizer state not carried") and fragment in note
               for note in report.notices), report.notices
    result = _cli("convert", src, tmp_path / "strict", "-q", "--dst-format", dst_format, "--strict",
                  "--dst-optim-form", "fully_reshardable")
    assert_clean_refusal(result, 2, "--strict: refusing to guess: optimizer state not carried", fragment)
    assert not (tmp_path / "strict").exists()


def test_a_sharded_run_into_a_saver_that_writes_optimizer_state_in_one_pass_names_it_and_strict_refuses_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from pgconvert.savers.megatron import MegatronSaver

    # as a plugin saver that declares no shares and writes the state after its model files
    monkeypatch.setattr(MegatronSaver, "optimizer_partial", False)
    monkeypatch.setattr(MegatronSaver, "optimizer_in_model_files", False)
    flags = ("--dst-tp", "1", "--shard-index", "0", "--num-shards", "1")
    result = _cli("convert", DISTOPT, tmp_path / "lenient", *flags)
    assert result.exit_code == 0, result.output
    assert "note: guess: optimizer state not carried: the megatron saver writes optimizer state in one pass, so a " \
           "sharded run" in result.output
    assert list((tmp_path / "lenient").rglob("distrib_optim.pt")) == []
    strict = _cli("convert", DISTOPT, tmp_path / "strict", *flags, "--strict")
    assert_clean_refusal(strict, 2, "--strict: refusing to guess: optimizer state not carried: the megatron saver")
    assert not (tmp_path / "strict").exists()
    assert _cli("convert", DISTOPT, tmp_path / "model", *flags, "--skip-optimizer", "--strict").exit_code == 0


def test_megatron_cores_distributed_optimizer_loads_the_dp_reshardable_scaler(tmp_path: Path) -> None:
    """megatron-core 0.16.1's DistributedOptimizer with a DynamicGradScaler (gloo, CPU) loads the written
    dp_reshardable checkpoint as Megatron-LM's load_checkpoint does: the ShardedObject is where it reads it."""
    import subprocess
    import sys

    pytest.importorskip("megatron.core", reason="megatron-core's own load is the check")
    scaler = _scaler(8192.0, 11, 1)
    td = _converted(_per_rank_fp16(tmp_path, scaler), tmp_path / "td", "--dst-format", "torch_dist", "--dst-tp", "1",
                    "--dst-optim-form", "dp_reshardable")
    script = Path(__file__).parent / "support" / "mcore_dp_reshardable_load.py"
    subprocess.run([sys.executable, str(script), str(td / ITER), str(tmp_path / "out"), "1", "grad-scaler"],
                   check=True, timeout=600)
    loaded = torch.load(tmp_path / "out" / "rank0.pt", weights_only=True)
    assert_same_tree(loaded["grad_scaler"], scaler, "megatron-core's DynamicGradScaler after the load")
    assert loaded["group_steps"] == [2.0, 2.0]
