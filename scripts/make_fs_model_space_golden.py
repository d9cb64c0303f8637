"""Make the ``fully_sharded_model_space`` golden with megatron-core 0.15.0's own classes (local script, not CI).

    /venv/with/megatron-core-0.15.0/bin/python scripts/make_fs_model_space_golden.py [check]

megatron-core 0.16.1 and later refuse this form (``ShardedTensor.flattened_range is not supported``);
0.15.0 still saves and loads it. Four forked gloo processes (TP2 DP2 on the CPU, ``tests/support/mcore_cpu_shim``)
each build GPTModel + DDP + DistributedOptimizer for the model of the Megatron-LM golden
``train_tp2dp2_distopt_fully_reshardable_torch_dist`` and load that golden with megatron-core 0.15.0's own
``dist_checkpointing.load`` (a temporary copy with the checkpoint's common state as ``common.pt``, which
0.15.0 reads). They then save it as Megatron-LM core_v0.15.0's ``save_checkpoint`` does with
``--dist-ckpt-save-pre-mcore-014`` (``ckpt_fully_parallel_save`` is on by default), which is what
``_build_sharded_state_dict_metadata`` turns into ``distrib_optim_sharding_type='fully_sharded_model_space'``
(core_v0.13.1 / core_v0.14.0 write that form without the flag): ``generate_state_dict``'s entries, the
model's and the optimizer's ``sharded_state_dict``, ``dist_checkpointing.save`` with the fully parallel
save strategy over the DP group and ``content_metadata``. Last, fresh ranks load the new checkpoint
with 0.15.0 and compare what their optimizer holds with what it held after the first load
(``torch.equal`` per parameter slice).

``load DIR DP``: megatron-core 0.15.0 loads the fully_sharded_model_space torch_dist checkpoint DIR (e.g.
pgconvert's ``convert GOLDEN DIR --dst-format torch_dist --dst-tp 1``; one pipeline stage) on its TP times DP
ranks, and what each rank's optimizer then holds must equal pgconvert's export of the golden.

``check``: only the last step, plus pgconvert's reading of the golden against those slices (both also
run after a save).

Made with: megatron-core 0.15.0 (the cp311 wheel, installed with ``pip install --no-deps`` into a copy of
pgconvert's venv), psutil 7.2.2 (its async writer asks for it), Python 3.11.7, torch 2.13.0+cpu, numpy
2.4.6. CPU shims beyond ``tests/support/mcore_cpu_shim``: ``numpy.product = numpy.prod`` (0.15.0's flattened-range
checks call ``np.product``, gone in numpy 2) and ``torch.cuda.synchronize`` a no-op (the writer's preload).
Arguments newer than 0.15.0 that its TransformerConfig lacks are dropped from ``args``, and pgconvert's
stand-ins of Megatron enums become 0.15.0's classes. The common state is Megatron-LM core_v0.15.0's
``generate_state_dict`` entries, taken from the source golden (Megatron-LM d98e8a64): args, checkpoint_version,
iteration, opt_param_scheduler, rerun_state_machine, num_floating_point_operations_so_far (no RNG: the
source was saved with --no-save-rng). In this layout no parameter straddles the DP boundary, so each
chunk of a record is written whole by one DP rank.

Other megatron-core versions (same venv copy, ``pip install --no-deps`` of the wheel): with ``SOURCE`` set to
pgconvert's TP1 ``fully_sharded_model_space`` output of the golden and ``TARGET`` to a scratch directory,
megatron-core 0.14.0 and 0.13.1 each load it, save the form themselves on the CPU (TP1 DP2), reload their save
bit for bit, and pgconvert reads their save as their optimizers hold it; ``load DIR 2`` passes with both (0.14.0
needs the ``ProcessGroupCollection`` stand-in below for tests/support/mcore_helpers' import). Their ``.metadata`` is
torch's Metadata with a ``mcore_data`` attribute; 0.15.0 pickles its ``MCoreMetadata`` subclass, which 0.14.0
cannot unpickle (so 0.14.0 cannot load 0.15.0's save, but loads pgconvert's). With ``DP = 4`` and that
source, 0.15.0's save at TP1 DP4 splits two records' chunks between DP ranks (pieces at element 160 of a
512-element chunk); pgconvert's export of it equals every rank's state (the split case the golden lacks; not
committed: tests/data has no room).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
GOLDENS = ROOT / "tests" / "data" / "megatron_lm"
SOURCE = GOLDENS / "train_tp2dp2_distopt_fully_reshardable_torch_dist"
TARGET = GOLDENS / "mcore015_tp2dp2_distopt_fs_model_space_torch_dist"
ITERATION = "iter_0000002"
# Megatron-LM core_v0.15.0 _build_sharded_state_dict_metadata with --dist-ckpt-save-pre-mcore-014
METADATA = {"distrib_optim_sharding_type": "fully_sharded_model_space", "singleton_local_shards": False,
            "chained_optim_avoid_prefix": True}
DP = 2


def _real(value: Any) -> Any:
    """A pgconvert stand-in of a Megatron class in ``args`` as this megatron-core's own class (None when
    it has none: 0.15.0 predates that argument)."""
    from pgconvert.formats.megatron import OpaqueGlobal

    if not isinstance(value, OpaqueGlobal):
        return value
    module, _, name = value.qualified_name.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name)(*value.args)
    except (ImportError, AttributeError):
        return None


def _known_args(args: argparse.Namespace) -> argparse.Namespace:
    """``args`` without the arguments newer than this megatron-core that tests/support/mcore_helpers would hand its
    TransformerConfig."""
    from megatron.core.transformer import TransformerConfig
    from support.mcore_helpers import COPIED_CONFIG_FIELDS

    known = {field.name for field in dataclasses.fields(TransformerConfig)}
    for name in COPIED_CONFIG_FIELDS:
        if name not in known and hasattr(args, name):
            delattr(args, name)
    return args


def _common_state() -> dict[str, Any]:
    """The source's common state (read by pgconvert), with args as Megatron-LM core_v0.15.0 would hold them
    for this save."""
    from pgconvert.formats import LoadOptions
    from pgconvert.formats.registry import get_loader

    source = get_loader("torch_dist").open(SOURCE, LoadOptions())
    common = dict(source.common_state)
    source.close()
    args = _known_args(argparse.Namespace(**{key: _real(value) for key, value in vars(common["args"]).items()
                                             if _real(value) is not None or value is None}))
    args.dist_ckpt_optim_fully_reshardable = False
    args.dist_ckpt_save_pre_mcore_014 = True
    args.ckpt_fully_parallel_save = True
    common["args"] = args
    if "rerun_state_machine" in common:  # not in a checkpoint pgconvert wrote
        common["rerun_state_machine"] = {key: _real(value) for key, value in common["rerun_state_machine"].items()}
    return common


def _load(model: Any, optimizer: Any, iteration_dir: Path, metadata: dict[str, Any]) -> None:
    """Megatron-LM's ``load_checkpoint`` for torch_dist: sharded state dicts, ``dist_checkpointing.load``,
    ``load_state_dict``."""
    from megatron.core import dist_checkpointing, parallel_state
    from support.megatron_fixtures import allowed_globals

    metadata = dict(metadata, dp_cp_group=parallel_state.get_data_parallel_group(with_context_parallel=True))
    with torch.serialization.safe_globals(allowed_globals()):
        sharded = {"model": model.sharded_state_dict(metadata=metadata)}
        sharded["optimizer"] = optimizer.sharded_state_dict(sharded, is_loading=True, metadata=metadata)
        loaded = dist_checkpointing.load(sharded, str(iteration_dir))
    model.load_state_dict(loaded["model"], strict=True)
    optimizer.load_state_dict(loaded["optimizer"])


def _save(model: Any, optimizer: Any, common: dict[str, Any], iteration_dir: Path,
          metadata: dict[str, Any] = METADATA) -> None:
    """Megatron-LM core_v0.15.0's ``generate_state_dict`` + ``dist_checkpointing.save`` (fully parallel save), with
    its content ``metadata`` (another release's: what that release's ``_build_sharded_state_dict_metadata`` gives)."""
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy
    from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper

    state = {key: common[key] for key in ("args", "checkpoint_version", "iteration")}
    state["model"] = model.sharded_state_dict(metadata=dict(metadata))
    state["optimizer"] = optimizer.sharded_state_dict(state, metadata=dict(metadata))
    state["opt_param_scheduler"] = common["opt_param_scheduler"]
    state.update({key: common[key] for key in ("rerun_state_machine", "num_floating_point_operations_so_far")
                  if key in common})
    strategy = FullyParallelSaveStrategyWrapper(get_default_save_sharded_strategy("torch_dist"),
                                                parallel_state.get_data_parallel_group(with_context_parallel=True))
    dist_checkpointing.save(state, str(iteration_dir), strategy, content_metadata=dict(metadata))


def start_rank(rank: int, world: int, store: str) -> None:
    """A forked rank's start: the CPU shims, no device to wait for, its gloo process group."""
    import support.mcore_cpu_shim as mcore_cpu_shim

    mcore_cpu_shim.install()
    torch.cuda.synchronize = lambda *_: None  # dist_checkpointing's save waits for the device before writing
    torch.distributed.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)


def _rank(rank: int, world: int, store: str, common: dict[str, Any], work: Path, mode: str,
          directory: Path | None = None) -> None:
    from megatron.core import parallel_state

    from support.mcore_optimizer_step import _build, _gpt, _optimizer, canonical, optimizer_tensors

    start_rank(rank, world, store)
    args = common["args"]
    parallel_state.initialize_model_parallel(args.tensor_model_parallel_size, args.pipeline_model_parallel_size)
    ddp = _build(args, 0)
    optimizer = _optimizer(args, ddp)
    model = _gpt(ddp)
    names = {id(param): canonical(name, 0) for name, param in model.named_parameters()}
    if mode == "load":  # another fully_sharded_model_space checkpoint (pgconvert's output)
        _load(model, optimizer, directory, dict(METADATA))
        torch.save({"tp_rank": parallel_state.get_tensor_model_parallel_rank(),
                    "state": optimizer_tensors(optimizer, names)}, work / f"reference{rank}.pt")
    elif mode == "save":
        _load(model, optimizer, work / "source" / ITERATION, dict(common["content_metadata"]))
        torch.save({"tp_rank": parallel_state.get_tensor_model_parallel_rank(),
                    "state": optimizer_tensors(optimizer, names),
                    "weights": {names[id(p)]: p.detach().clone() for p in model.parameters()}},
                   work / f"reference{rank}.pt")
        _save(model, optimizer, common, work / "target" / ITERATION)
    else:
        _load(model, optimizer, work / "target" / ITERATION, dict(METADATA))
        torch.save({"state": optimizer_tensors(optimizer, names),
                    "weights": {names[id(p)]: p.detach().clone() for p in model.parameters()}},
                   work / f"reloaded{rank}.pt")
    torch.distributed.destroy_process_group()


def _source_copy(common: dict[str, Any], work: Path) -> None:
    """The source golden with its common state as ``common.pt`` (megatron-core 0.15.0 reads that file)."""
    shutil.copytree(SOURCE / ITERATION, work / "source" / ITERATION)
    torch.save(common, work / "source" / ITERATION / "common.pt")


def _compare_reloaded(work: Path, world: int) -> None:
    for rank in range(world):
        reference = torch.load(work / f"reference{rank}.pt", weights_only=True)
        reloaded = torch.load(work / f"reloaded{rank}.pt", weights_only=True)
        for name, (offset, tensors) in reference["state"].items():
            again_offset, again = reloaded["state"][name]
            assert offset == again_offset, name
            for key in ("param", "exp_avg", "exp_avg_sq", "step"):
                assert torch.equal(tensors[key], again[key]), f"rank {rank}: {name}.{key} differs after the reload"
        for name, weight in reference["weights"].items():
            assert torch.equal(weight, reloaded["weights"][name]), f"rank {rank}: weight {name}"
    print(f"megatron-core reloads the saved fully_sharded_model_space checkpoint: {world} ranks, every "
          "optimizer slice and weight equal", flush=True)


def _compare_pgconvert(work: Path, world: int, args: Any = None) -> None:
    """pgconvert's export of the golden (per canonical parameter) against megatron-core's per-rank slices."""
    from support.mcore_optimizer_step import tp_piece

    out = work / "export"
    done = subprocess.run([sys.executable, "-m", "pgconvert", "export-optimizer", str(TARGET), str(out)],
                          capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    exported = {path.stem: torch.load(path, weights_only=True) for path in out.glob("*.pt")}
    args = args or _common_state()["args"]
    for rank in range(world):
        reference = torch.load(work / f"reference{rank}.pt", weights_only=True)
        for name, (offset, tensors) in reference["state"].items():
            for key in ("param", "exp_avg", "exp_avg_sq"):
                piece = tp_piece(name, exported[name][key], args.tensor_model_parallel_size, reference["tp_rank"],
                                 args.swiglu).reshape(-1)
                held = tensors[key].reshape(-1)  # a distributed optimizer's shard, or a plain one's whole master
                assert torch.equal(piece[offset:offset + held.numel()], held), f"{name}.{key}"
            assert torch.equal(exported[name]["step"], tensors["step"]), name
    print(f"pgconvert's export equals megatron-core's state: {len(exported)} parameters, {world} ranks", flush=True)


def place_save(work: Path, target: Path, golden: Path, check: bool) -> None:
    """After the saving ranks: with ``check`` the committed ``golden`` takes the place of their save under
    ``work/target`` (what the reload and comparisons then read); else their save becomes ``target``, a checkpoint
    root."""
    if check:
        shutil.rmtree(work / "target")
        shutil.copytree(golden, work / "target")
        return
    shutil.rmtree(target, ignore_errors=True)
    shutil.copytree(work / "target", target)
    (target / "latest_checkpointed_iteration.txt").write_text(str(int(ITERATION.split("_")[1])))


def _load_other(directory: Path, dp: int) -> None:
    """``load DIR DP``: megatron-core 0.15.0 loads DIR; its state is compared with the golden's export."""
    from support.gloo_ranks import run_ranks
    from support.megatron_fixtures import load_for_test

    iteration_dir = next(iter(sorted(directory.glob("iter_*"))))
    common = dict(load_for_test(iteration_dir / "common.pt"))
    args = common["args"] = _known_args(common["args"])
    world = args.tensor_model_parallel_size * args.pipeline_model_parallel_size * dp
    with tempfile.TemporaryDirectory() as tmp:
        run_ranks(_rank, world, common, Path(tmp), "load", iteration_dir, where=f"load {directory}")
        _compare_pgconvert(Path(tmp), world, args)


def main(argv: list[str]) -> None:
    from support.gloo_ranks import run_ranks

    if argv[:1] == ["load"]:
        _load_other(Path(argv[1]), int(argv[2]))
        return
    common = _common_state()
    world = common["args"].tensor_model_parallel_size * common["args"].pipeline_model_parallel_size * DP
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        _source_copy(common, work)
        (work / "target" / ITERATION).mkdir(parents=True)
        run_ranks(_rank, world, common, work, "save", where="save")  # with check: the source's state, as loaded
        place_save(work, TARGET, TARGET, "check" in argv)
        run_ranks(_rank, world, common, work, "reload", where="reload")
        _compare_reloaded(work, world)
        _compare_pgconvert(work, world)


def prepare_process() -> None:
    """The script's process before its forks: no CUDA device, tests/ importable, the shims older megatron-core
    releases need here, megatron-core's optimizer package imported once."""
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.path[:0] = [str(ROOT / "tests"), str(ROOT)]
    import numpy
    if not hasattr(numpy, "product"):  # megatron-core 0.15.0's flattened-range checks call np.product (numpy < 2)
        numpy.product = numpy.prod
    import megatron.core.process_groups_config as groups_config
    if not hasattr(groups_config, "ProcessGroupCollection"):  # tests/support/mcore_helpers imports it; 0.14.0 lacks it
        groups_config.ProcessGroupCollection = object
    importlib.import_module("megatron.core.optimizer")  # imported once, before the forks


if __name__ == "__main__":
    prepare_process()
    main(sys.argv[1:])
