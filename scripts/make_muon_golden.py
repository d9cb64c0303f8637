"""Make the Muon golden with megatron-core 0.19.2's own classes (local script, not CI).

    /venv/with/megatron-core-0.19.2/bin/python scripts/make_muon_golden.py [check | load DIR TP]

Two forked gloo processes, TP2 on the CPU (``tests/support/mcore_cpu_shim``). Each builds megatron-core 0.19.2's
GPTModel (local spec, bf16 under ``Float16Module``; the dense golden's smaller model: 2 layers, hidden 16, 4 heads
in 2 query groups, SwiGLU, RMSNorm, untied) and ``get_megatron_optimizer`` with ``optimizer='muon'`` and no
distributed optimizer, what Megatron-LM's ``--optimizer muon`` builds: a ChainedOptimizer of a Muon optimizer
(``TensorParallelMuon``: every 2-dim weight but the word embedding and the output layer, one param group, a
``momentum_buffer`` per parameter) and an Adam one (the embedding and output layer, then the norms: two groups),
each a ``Float16OptimizerWithFloat16Params`` with fp32 masters. Two steps on gradients that are a fixed function
of each parameter's name, each followed by the learning-rate schedule's step, then the save Megatron-LM's
``save_checkpoint`` makes for torch_dist without the distributed optimizer: content metadata
``{singleton_local_shards: False, chained_optim_avoid_prefix: True}`` (no sharding type), so the records are
``optimizer.state.{fp32_param,momentum_buffer}.<model key>`` (Muon) and ``optimizer.state.{fp32_param,exp_avg,
exp_avg_sq}.<model key>`` (Adam) and the common state's ``optimizer`` ``{0: Muon's param groups, 1: Adam's with
state.common_step}``. Fresh ranks reload the save and must hold what the first ranks held, bit for bit; pgconvert's
``export-optimizer`` of it must equal every rank's state.

``check``: those comparisons against the committed golden (the two steps are deterministic).
``load DIR TP``: megatron-core 0.19.2 loads pgconvert's torch_dist output DIR at TP ``TP``, and what each rank's
optimizer holds must equal pgconvert's export of the golden.

The environment: megatron-core 0.19.2 and emerging-optimizers 0.3.0 declare Python >= 3.12, and the only CPU torch
2.13.0 here is a cp311 wheel. So: a copy of pgconvert's venv without its megatron-core, the 0.19.2 wheel's
``megatron/`` and dist-info copied into its site-packages (its one compiled module, the dataset helpers, is never
imported), ``pip install --no-deps --ignore-requires-python emerging_optimizers-0.3.0-py3-none-any.whl`` and
``absl-py``. Three import shims (``_shims``): ``typing.override`` (3.12), and stand-ins for the two modules that
``import triton`` unconditionally (emerging_optimizers' ``triton_kernels``, megatron-core's MoE ``paged_stash``);
none of them is reached by this run. The common state is the dense Megatron-LM golden's (scheduler, counters,
iteration 2), with ``args`` for this model, layout and optimizer as Megatron-LM 0.19.2's parser records them.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import types
import typing
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
TARGET = ROOT / "tests" / "data" / "megatron_lm" / "mcore019_tp2_muon_bf16_torch_dist"
ITERATION = "iter_0000002"
TP = 2
# Megatron-LM's _build_sharded_state_dict_metadata without the distributed optimizer.
METADATA = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}
# Megatron-LM 0.19.2's --optimizer muon arguments at their defaults (arguments.py), and what validate_args sets.
MUON_ARGS = {"optimizer": "muon", "muon_momentum": 0.9, "muon_split_qkv": True, "muon_nesterov": False,
             "muon_scale_mode": "spectral", "muon_fp32_matmul_prec": "medium", "muon_coefficient_type": "quintic",
             "muon_num_ns_steps": 5, "muon_tp_mode": "blockwise", "muon_extra_scale_factor": 1.0,
             "muon_scalar_optimizer": "adam", "use_distributed_optimizer": False,
             "use_layer_wise_distributed_optimizer": False}


def _shims() -> None:
    """What megatron-core 0.19.2 and emerging-optimizers need to import on Python 3.11 without triton."""
    from unittest import mock

    if not hasattr(typing, "override"):
        typing.override = lambda function: function  # type: ignore[attr-defined]
    kernels = types.ModuleType("emerging_optimizers.triton_kernels")
    kernels.HAS_TRITON_340 = False  # type: ignore[attr-defined]
    sys.modules["emerging_optimizers.triton_kernels"] = kernels
    stash = types.ModuleType("megatron.core.transformer.moe.ops.paged_stash")
    stash.GLOBAL_BLOCK_SIZE = 1024  # type: ignore[attr-defined]
    stash.paged_stash_copy_kernel = stash.paged_stash_pop_kernel = mock.MagicMock()  # type: ignore[attr-defined]
    sys.modules["megatron.core.transformer.moe.ops.paged_stash"] = stash


def _common_state(tp: int = TP) -> dict[str, Any]:
    import make_fs_model_space_golden as dense
    from support.megatron_fixtures import TinyModel, make_args

    model = TinyModel(num_layers=2, hidden_size=16, num_attention_heads=4, num_query_groups=2, kv_channels=4,
                      ffn_hidden_size=32, vocab_size=60, swiglu=True, normalization="RMSNorm", add_bias_linear=False,
                      add_qkv_bias=False, qk_layernorm=False, tied_embeddings=False, position_embedding_type="rope",
                      make_vocab_size_divisible_by=16, dtype=torch.bfloat16)
    common = dense._common_state()
    args = argparse.Namespace(**vars(common["args"]))
    vars(args).update({key: value for key, value in vars(make_args(model, tp, 1, None, None, 2)).items()
                       if key != "iteration"})
    vars(args).update(MUON_ARGS)
    args.data_parallel_size, args.world_size = 1, tp
    common["args"] = args
    common["content_metadata"] = dict(METADATA)
    return common


def _model(args: argparse.Namespace) -> Any:
    import dataclasses

    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.module import Float16Module
    from support.mcore_helpers import transformer_config_from_args

    config = dataclasses.replace(transformer_config_from_args(args), bf16=True, params_dtype=torch.bfloat16,
                                 perform_initialization=True)
    model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(normalization=args.normalization),
                     vocab_size=args.padded_vocab_size, max_sequence_length=args.max_position_embeddings,
                     share_embeddings_and_output_weights=False, position_embedding_type=args.position_embedding_type)
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                               overlap_param_gather=False, use_distributed_optimizer=False)
    return DistributedDataParallel(config, ddp_config, Float16Module(config, model))


def _optimizer(args: argparse.Namespace, ddp: Any) -> Any:
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    muon = {key: value for key, value in MUON_ARGS.items() if key.startswith("muon_")}
    return get_megatron_optimizer(OptimizerConfig(
        optimizer="muon", lr=args.lr, min_lr=args.min_lr, weight_decay=args.weight_decay, bf16=True,
        params_dtype=torch.bfloat16, use_distributed_optimizer=False, clip_grad=0.0, **muon), [ddp])


def state(optimizer: Any, names: dict[int, str]) -> dict[str, tuple[int, dict[str, torch.Tensor]]]:
    """Per canonical name: (0, its fp32 master as ``param`` and every tensor the inner optimizer keeps for it, a
    ``step`` as float32), over the chained optimizers."""
    held = {}
    for chained in optimizer.chained_optimizers:
        inner = chained.optimizer
        for models, mains in zip(chained.float16_groups, chained.fp32_from_float16_groups):
            for model, main in zip(models, mains):
                tensors = {key: torch.as_tensor(value, dtype=torch.float32).clone() if key == "step" else
                           value.clone() for key, value in inner.state[main].items()}
                held[names[id(model)]] = (0, {"param": main.detach().clone(), **tensors})
    return held


def _train(model: Any, optimizer: Any, names: dict[int, str], common: dict[str, Any]) -> None:
    """Two steps on gradients that depend only on the parameter's name and the step, each followed by the dense
    golden's learning-rate schedule's step (``make_fs_model_space_moe_golden._train``)."""
    import make_fs_model_space_moe_golden as moe

    moe._train(model, optimizer, names, common)


def _rank(rank: int, world: int, store: str, common: dict[str, Any], work: Path, mode: str,
          directory: Path | None = None) -> None:
    import make_fs_model_space_golden as dense
    from megatron.core import dist_checkpointing, parallel_state
    from support.megatron_fixtures import allowed_globals
    from support.mcore_optimizer_step import _gpt

    dense.start_rank(rank, world, store)
    args = common["args"]
    parallel_state.initialize_model_parallel(args.tensor_model_parallel_size, 1)
    torch.manual_seed(1234)
    ddp = _model(args)
    optimizer = _optimizer(args, ddp)
    model = _gpt(ddp)
    names = {id(param): name for name, param in model.named_parameters()}
    if mode == "save":
        _train(model, optimizer, names, common)
        dense._save(model, optimizer, common, work / "target" / ITERATION, dict(METADATA))
    else:  # as Megatron-LM's load_checkpoint: the sharded state dicts built with the checkpoint's content metadata
        iteration_dir = directory or work / "target" / ITERATION
        with torch.serialization.safe_globals(allowed_globals()):
            metadata = dist_checkpointing.load_content_metadata(str(iteration_dir))
        dense._load(model, optimizer, iteration_dir, dict(metadata))
    out = {"save": "reference", "reload": "reloaded", "load": "reference"}[mode]
    torch.save({"tp_rank": parallel_state.get_tensor_model_parallel_rank(), "state": state(optimizer, names),
                "weights": {names[id(p)]: p.detach().clone() for p in model.parameters()}}, work / f"{out}{rank}.pt")
    torch.distributed.destroy_process_group()


def _compare_reloaded(work: Path, world: int) -> None:
    for rank in range(world):
        reference = torch.load(work / f"reference{rank}.pt", weights_only=True)
        reloaded = torch.load(work / f"reloaded{rank}.pt", weights_only=True)
        assert reference["state"].keys() == reloaded["state"].keys()
        for name, (_, tensors) in reference["state"].items():
            again = reloaded["state"][name][1]
            assert tensors.keys() == again.keys(), name
            for key, tensor in tensors.items():
                assert torch.equal(tensor, again[key]), f"rank {rank}: {name}.{key} differs after the reload"
        for name, weight in reference["weights"].items():
            assert torch.equal(weight, reloaded["weights"][name]), f"rank {rank}: weight {name}"
    print(f"megatron-core reloads the saved Muon checkpoint: {world} ranks, every optimizer tensor and weight equal",
          flush=True)


def _compare_pgconvert(work: Path, world: int, args: Any) -> None:
    """pgconvert's export of the golden (per canonical parameter) against megatron-core's per-rank state."""
    import subprocess

    from support.mcore_optimizer_step import tp_piece

    out = work / "export"
    done = subprocess.run([sys.executable, "-m", "pgconvert", "export-optimizer", str(TARGET), str(out)],
                          capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    exported = {path.stem: torch.load(path, weights_only=True) for path in out.glob("*.pt")}
    for rank in range(world):
        reference = torch.load(work / f"reference{rank}.pt", weights_only=True)
        assert reference["state"].keys() == exported.keys()
        for name, (_, tensors) in reference["state"].items():
            assert tensors.keys() == exported[name].keys(), (name, sorted(tensors), sorted(exported[name]))
            for key, tensor in tensors.items():
                whole = exported[name][key]
                piece = whole if key == "step" else tp_piece(name, whole, args.tensor_model_parallel_size,
                                                            reference["tp_rank"], args.swiglu)
                assert torch.equal(piece, tensor), f"rank {rank}: {name}.{key}"
    print(f"pgconvert's export equals megatron-core's state: {len(exported)} parameters, {world} ranks", flush=True)


def main(argv: list[str]) -> None:
    import make_fs_model_space_golden as dense
    from support.gloo_ranks import run_ranks

    if argv[:1] == ["load"]:
        tp = int(argv[2])
        common = _common_state(tp)
        with tempfile.TemporaryDirectory() as tmp:
            run_ranks(_rank, tp, common, Path(tmp), "load", next(iter(sorted(Path(argv[1]).glob("iter_*")))))
            _compare_pgconvert(Path(tmp), tp, common["args"])
        return
    common = _common_state()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        (work / "target" / ITERATION).mkdir(parents=True)
        run_ranks(_rank, TP, common, work, "save", where="save")
        dense.place_save(work, TARGET, TARGET, "check" in argv)
        run_ranks(_rank, TP, common, work, "reload", where="reload")
        _compare_reloaded(work, TP)
        _compare_pgconvert(work, TP, common["args"])


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT / "scripts"))
    _shims()
    import make_fs_model_space_golden

    make_fs_model_space_golden.prepare_process()
    main(sys.argv[1:])
