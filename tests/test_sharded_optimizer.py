"""Sharded runs (``--shard-index``/``--num-shards``) carry the optimizer state: four processes, run one after
another, or two under torchrun, or ``--workers`` processes, write the single-process output byte for byte
(per-rank plain and distributed optimizer, dense and MoE at EP > 1; torch_dist in every form pgconvert writes, its
common state in common.pt or, with its integrity.json written last, in the store), a
rank's optimizer state is written by the process that writes its rank file, each process reads the optimizer
state its share needs once, a failed share leaves nothing complete-looking, and megatron-core loads the merged
output and steps as from the original checkpoint."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
from click.testing import CliRunner

from support.checkpoint_compare import integrity_manifest_of, read_common
from support.format_outputs import assert_same_bytes
from support.mcore_step_check import BF16_ATOL, BF16_RTOL, assert_same_step, fixed_gradients, run_steps, with_common_pt
from support.megatron_fixtures import load_for_test
from support.moe_optimizer_runs import generate
from support.torchrun import run_torchrun
from support.torch_dist_forms import FOR_MCORE_016_CLI

import pgconvert
from pgconvert.cli import main
from pgconvert.optimizer.carry import carry_share, sharded_optimizer
from pgconvert.optimizer.source import FIELDS
from pgconvert.run.convert import convert_request, plan
from pgconvert.run.sharded import shares

GOLDENS = Path(__file__).parent / "data" / "megatron_lm"
ITER = "iter_0000002"
SHARDS = 4
ORDER = (2, 0, 3, 1)  # the last to finish finalizes, whichever it is
RECORDS_SIZE = ("--max-shard-size", "20000")  # several optimizer records files (and model data files) to share out
TORCH_DIST = ("--dst-format", "torch_dist", "--dst-tp", "1", *RECORDS_SIZE)
# The cases without "store" in their name: the form megatron-core 0.16.1 (which steps them) reads.
LEGACY = (*TORCH_DIST, *FOR_MCORE_016_CLI)
# megatron-core 0.19's form (the default): the common state in the store (rewritten by the optimizer's finalizing
# step), and integrity.json after it (--digest sha256).
STORE = ("--dst-torch-dist-common", "store", "--digest", "sha256")
# What makes each destination a checkpoint to its readers.
COMPLETE_MARKERS = {"megatron": ("latest_checkpointed_iteration.txt",),
                    "torch_dist": ("latest_checkpointed_iteration.txt", f"{ITER}/metadata.json", f"{ITER}/.metadata")}


def _convert(src: Path, dst: Path, *flags: str) -> Path:
    result = CliRunner().invoke(main, ["-q", *flags, str(src), str(dst)])
    assert result.exit_code == 0, result.output
    return dst


def _shard(src: Path, dst: Path, index: int, *flags: str) -> Path:
    return _convert(src, dst, *flags, "--shard-index", str(index), "--num-shards", str(SHARDS))


def _sharded(src: Path, dst: Path, *flags: str) -> Path:
    for index in ORDER:
        assert not dst.exists()  # renamed into place by the last share only
        _shard(src, dst, index, *flags)
    return dst


@pytest.fixture(scope="module")
def moe_distributed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """megatron-core's own MoE distributed-optimizer checkpoint at TP2 EP2 (chained dense and expert optimizers)."""
    return generate(tmp_path_factory.mktemp("moe") / "dist", 2, 1, 2, "distributed")


# case -> (source, flags): four destination rank files each.
PER_RANK = {
    "distributed": (GOLDENS / "train_tp2dp2_distopt_bf16_torch", ("--dst-pp", "2")),
    "plain-bf16": (GOLDENS / "train_tp2dp2_bf16_torch", ("--dst-pp", "2")),
    "plain-fp32": (GOLDENS / "train_tp2pp2_torch", ()),  # FP32Optimizer: its masters are the weights
    # Megatron-LM's plain Muon optimizer (each rank file's optimizer the list of Muon's and Adam's)
    "plain-bf16-muon": (GOLDENS / "train_tp2dp2_muon_bf16_torch", ("--dst-pp", "2")),
    # Megatron-LM's plain Muon with MoE (Muon's dense and expert optimizers and Adam's), from EP2 to EP4
    "plain-bf16-muon-moe": (GOLDENS / "train_tp1ep2dp4_muon_moe_bf16_torch_dist",
                            ("--dst-format", "megatron", "--dst-tp", "1", "--dst-ep", "4")),
    "distributed-moe-ep": (None, ("--dst-tp", "1", "--dst-ep", "4")),
}
# case -> (source, flags): TP1 torch_dist in each form, its records over several files.
IN_TORCH_DIST = {
    "fully_reshardable": (GOLDENS / "train_tp2dp2_distopt_fully_reshardable_torch_dist", LEGACY),
    "dp_reshardable": (GOLDENS / "train_tp2dp2_distopt_dp_reshardable_torch_dist", LEGACY),
    "dp_reshardable-dp4": (GOLDENS / "train_tp2dp2_distopt_dp_reshardable_torch_dist", (*LEGACY, "--dst-dp", "4")),
    "plain": (GOLDENS / "train_tp2pp2_bf16_torch_dist", LEGACY),
    "fully_sharded_model_space": (GOLDENS / "mcore015_tp2dp2_distopt_fs_model_space_torch_dist", LEGACY),
    # megatron-core 0.19.2's plain Muon optimizer (chained Muon and Adam)
    "plain-muon": (GOLDENS / "mcore019_tp2_muon_bf16_torch_dist", LEGACY),
    # Megatron-LM's layer-wise Muon runs (Muon's records in model space, Adam's flat or fully reshardable)
    "layer-wise-dp_reshardable": (GOLDENS / "train_tp2dp2_muon_layer_wise_dp_reshardable_torch_dist",
                                  (*LEGACY, "--dst-dp", "2")),
    "layer-wise-fully_reshardable": (GOLDENS / "train_tp2dp2_muon_layer_wise_fully_reshardable_torch_dist", LEGACY),
    # the layer-wise optimizer with MoE (its dense and expert groups), from EP2 to EP4
    "layer-wise-moe-ep": (GOLDENS / "train_tp1ep2dp4_muon_layer_wise_moe_dp_reshardable_torch_dist",
                          (*LEGACY, "--dst-ep", "4", "--dst-dp", "4")),
    "plain-muon-moe-ep": (GOLDENS / "train_tp1ep2dp4_muon_moe_bf16_torch_dist", (*LEGACY, "--dst-ep", "1")),
    # megatron-core 0.15.0's chained dense and expert optimizers, resharded from EP2 to EP4
    "fully_sharded_model_space-moe-ep": (GOLDENS / "mcore015_tp1ep2dp4_moe_distopt_fs_model_space_torch_dist",
                                         (*LEGACY, "--dst-ep", "4")),
    "dp_reshardable-moe-ep": (None, ("--dst-format", "torch_dist", "--dst-optim-form", "dp_reshardable",
                                     *RECORDS_SIZE, *FOR_MCORE_016_CLI)),
    "fully_reshardable-store": (GOLDENS / "train_tp2dp2_distopt_fully_reshardable_torch_dist", (*TORCH_DIST, *STORE)),
    "dp_reshardable-dp4-store": (GOLDENS / "train_tp2dp2_distopt_dp_reshardable_torch_dist",
                                 (*TORCH_DIST, "--dst-dp", "4", *STORE)),
    "plain-store": (GOLDENS / "train_tp2pp2_bf16_torch_dist", (*TORCH_DIST, *STORE)),
    "fully_sharded_model_space-store": (GOLDENS / "mcore015_tp2dp2_distopt_fs_model_space_torch_dist",
                                        (*TORCH_DIST, *STORE)),
}


def _source(case: tuple[Path | None, tuple[str, ...]], moe: Path) -> tuple[Path, tuple[str, ...]]:
    src, flags = case
    return (src if src is not None else moe), flags


@pytest.fixture(scope="module")
def outputs(tmp_path_factory: pytest.TempPathFactory, moe_distributed: Path) -> dict[str, tuple[Path, Path, Path]]:
    """Per case: (source, single-process output, four-share output)."""
    root = tmp_path_factory.mktemp("sharded")
    made = {}
    for name, case in {**PER_RANK, **IN_TORCH_DIST}.items():
        src, flags = _source(case, moe_distributed)
        made[name] = (src, _convert(src, root / name / "single", *flags),
                      _sharded(src, root / name / "sharded", *flags))
    return made


@pytest.mark.parametrize("case", list(PER_RANK))
def test_four_shards_write_the_per_rank_single_process_output_with_its_optimizer_state(
        outputs: dict[str, tuple[Path, Path, Path]], case: str) -> None:
    _, single, sharded = outputs[case]

    assert_same_bytes(sharded, single)
    rank_files = sorted(single.rglob("model_optim_rng.pt"))
    assert len(rank_files) == SHARDS and all("optimizer" in load_for_test(path) for path in rank_files)
    assert len(list(single.rglob("distrib_optim.pt"))) == (0 if case.startswith("plain") else SHARDS)


@pytest.mark.parametrize("case", list(IN_TORCH_DIST))
def test_four_shards_write_the_torch_dist_single_process_output_with_its_optimizer_records(
        outputs: dict[str, tuple[Path, Path, Path]], case: str) -> None:
    src, single, sharded = outputs[case]

    assert_same_bytes(sharded, single)
    assert len(list((single / ITER).glob("__1_*.distcp"))) >= SHARDS  # the records are shared out
    assert (single / ITER / "common.pt").exists() == ("store" not in case)
    if "store" in case:  # written once, by the finalizing share, after the optimizer's common state and index
        assert (sharded / ITER / "integrity.json").read_text() == integrity_manifest_of(sharded / ITER)
    result = pgconvert.verify(src, sharded)
    assert result.equal and result.optimizer is not None, result.differences[:5]


@pytest.mark.parametrize("case", ["distributed", "dp_reshardable", "dp_reshardable-dp4-store"])
def test_a_two_process_torchrun_carries_the_optimizer_state_as_one_process(
        outputs: dict[str, tuple[Path, Path, Path]], case: str, tmp_path: Path) -> None:
    src, single, _ = outputs[case]
    flags = (PER_RANK.get(case) or IN_TORCH_DIST[case])[1]

    done = run_torchrun("-m", "pgconvert", "-q", *flags, str(src), str(tmp_path / "torchrun"))

    assert done.returncode == 0, done.stdout + done.stderr
    assert [done.stdout.count(f"shard {rank}/2: wrote") for rank in (0, 1)] == [1, 1]
    assert_same_bytes(tmp_path / "torchrun", single)


@pytest.mark.parametrize("case", ["distributed", "distributed-moe-ep", "dp_reshardable", "fully_reshardable-store"])
def test_workers_write_the_optimizer_state_in_their_processes_as_one_process_does(
        outputs: dict[str, tuple[Path, Path, Path]], case: str, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    from pgconvert.savers.megatron import MegatronSaver
    from pgconvert.savers.torch_dist import TorchDistSaver

    src, single, _ = outputs[case]
    flags = (PER_RANK.get(case) or IN_TORCH_DIST[case])[1]
    here: list[object] = []  # optimizer state written by this (the main) process, not by the pool's
    for saver in (MegatronSaver, TorchDistSaver):
        monkeypatch.setattr(saver, "save_optimizer", lambda self, *args, real=saver.save_optimizer, **kwargs: (
            here.append(args[0]) or real(self, *args, **kwargs)))

    _convert(src, tmp_path / "workers", *flags, "--workers", "2")

    assert here == []
    assert_same_bytes(tmp_path / "workers", single)


def test_a_shard_writes_the_optimizer_state_of_the_rank_files_it_writes(tmp_path: Path) -> None:
    src, flags = PER_RANK["distributed"]

    _shard(src, tmp_path / "dst", 1, *flags)

    staging, = tmp_path.glob(".dst*")
    model = {path.parent.name for path in staging.rglob("model_optim_rng.pt")}
    assert len(model) == 1 and {path.parent.name for path in staging.rglob("distrib_optim.pt")} == model
    assert all("optimizer" in load_for_test(path) for path in staging.rglob("model_optim_rng.pt"))


@pytest.mark.parametrize("case", ["fully_reshardable", "dp_reshardable", "distributed"])
def test_each_share_reads_the_optimizer_state_it_writes_once(tmp_path: Path, case: str) -> None:
    src, flags = {**PER_RANK, **IN_TORCH_DIST}[case]
    dst_format = "torch_dist" if case in IN_TORCH_DIST else "megatron"
    options = dict(dst_tp=1, max_shard_size=20000) if dst_format == "torch_dist" else dict(dst_pp=2)
    request = convert_request(src, tmp_path / "dst", dst_format=dst_format, **options)
    reads = []
    for index in range(SHARDS):
        conversion = plan(request)
        try:
            carried = sharded_optimizer(conversion)
            assert carried is not None
            share = shares(conversion, carried, SHARDS)[index]
            read: Counter[tuple[str, str, int]] = Counter()
            real = carried.optimizer.piece
            carried.optimizer.piece = lambda name, key, size, rank, *rest: (  # type: ignore[method-assign]
                read.update([(name, key, rank)]) or real(name, key, size, rank, *rest))
            staging = tmp_path / f"share{index}"
            written = conversion.saver.save(conversion.source, staging, conversion.save_options, lambda nbytes: None,
                                            only=set(share))
            carry_share(conversion, carried, staging, written.files, set(share))
        finally:
            conversion.source.close()
        reads.append(read)

    assert all(count == 1 for read in reads for count in read.values())  # once within a process
    assert all(read for read in reads)
    assert [piece for index, read in enumerate(reads) for other in reads[index + 1:] for piece in read
            if piece in other] == []  # and by one process only
    names = {name for read in reads for name, _, _ in read}
    assert len(names) == 15 and {key for read in reads for _, key, _ in read} == set(FIELDS)


@pytest.mark.parametrize("dst_format", ["megatron", "torch_dist"])
def test_a_failed_share_leaves_nothing_complete_looking_and_its_rerun_completes(
        outputs: dict[str, tuple[Path, Path, Path]], dst_format: str, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    import pgconvert.savers.megatron.optimizer as per_rank
    import pgconvert.savers.torch_dist.optimizer_records as records

    case = "distributed" if dst_format == "megatron" else "dp_reshardable"
    src, flags = PER_RANK.get(case) or IN_TORCH_DIST[case]
    dst = tmp_path / "dst"

    def full(*args: object, **kwargs: object) -> None:
        raise OSError(28, "No space left on device", "injected")

    with monkeypatch.context() as patched:
        patched.setattr(per_rank, "_write_distributed", full)  # distrib_optim.pt
        patched.setattr(records._RecordsWriter, "_write_file", full)  # torch_dist records files
        failed = CliRunner().invoke(main, [*flags, "--shard-index", "0", "--num-shards", str(SHARDS), str(src),
                                           str(dst)])
    assert failed.exit_code == 1 and "No space left on device" in failed.output
    for index in (1, 2, 3):
        _shard(src, dst, index, *flags)

    assert not dst.exists()
    staging, = tmp_path.glob(".dst*")
    assert [name for name in COMPLETE_MARKERS[dst_format] if (staging / name).exists()] == []

    _shard(src, dst, 0, *flags)

    assert_same_bytes(dst, outputs[case][1])


def test_megatron_core_steps_the_sharded_per_rank_output_as_the_original(
        outputs: dict[str, tuple[Path, Path, Path]], tmp_path: Path) -> None:
    """The four-share TP2 PP2 distributed-optimizer output, loaded by megatron-core 0.16.1's own
    ``load_parameter_state`` at TP2 PP2 DP1, and the Megatron-LM golden at its own TP2 DP2: the same state loaded,
    the same step on the same fixed gradients (``mcore_step_check``)."""
    pytest.importorskip("megatron.core", reason="megatron-core's own optimizer is the check")
    src, _, sharded = outputs["distributed"]
    pgconvert.convert(src, tmp_path / "model", dst_tp=1, skip_optimizer=True)
    fixed_gradients(tmp_path / "model", tmp_path / "grads.pt")

    target, original = run_steps(tmp_path / "grads.pt", [(sharded / ITER, tmp_path / "out_sharded", 1),
                                                         (src / ITER, tmp_path / "out_src", 2)])

    assert len(target) == SHARDS and len(original) == 4
    args = load_for_test(next((src / ITER).glob("mp_rank_*/model_optim_rng.pt")))["args"]
    assert_same_step(target, original, args, (BF16_RTOL, BF16_ATOL))


def test_megatron_core_steps_the_sharded_torch_dist_outputs_as_the_original(
        outputs: dict[str, tuple[Path, Path, Path]], tmp_path: Path) -> None:
    """The four-share TP1 torch_dist outputs (``fully_reshardable`` loaded at DP2, ``dp_reshardable`` at DP1) by
    megatron-core's own ``dist_checkpointing.load``, and the golden (both goldens hold the same state) at TP2 DP2."""
    pytest.importorskip("megatron.core", reason="megatron-core's own optimizer is the check")
    src = outputs["dp_reshardable"][0]
    pgconvert.convert(src, tmp_path / "model", dst_format="megatron", dst_tp=1, skip_optimizer=True)
    fixed_gradients(tmp_path / "model", tmp_path / "grads.pt", scale=3e-2)
    original_dir = with_common_pt(src / ITER, tmp_path / "src")

    *targets, original = run_steps(tmp_path / "grads.pt", [
        (outputs["fully_reshardable"][2] / ITER, tmp_path / "out_fully", 2),
        (outputs["dp_reshardable"][2] / ITER, tmp_path / "out_dp", 1),
        (original_dir, tmp_path / "out_src", 2)])

    assert [len(target) for target in targets] == [2, 1] and len(original) == 4
    args = read_common(original_dir)["args"]
    for target in targets:
        assert_same_step(target, original, args, (BF16_RTOL, BF16_ATOL))
