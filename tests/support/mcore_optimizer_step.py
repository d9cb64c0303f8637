"""Run as a script: megatron-core's own model and optimizer take one step from a per-rank checkpoint.

    python tests/support/mcore_optimizer_step.py GRADS.pt ITERATION_DIR OUT_DIR DP [ITERATION_DIR OUT_DIR DP ...]

For each run: one gloo process per rank of the checkpoint's TP x PP layout times DP (forked from this process, so
megatron-core is imported once). Each rank does what Megatron-LM's ``setup_model_and_optimizer`` +
``load_checkpoint`` do, with megatron-core 0.16.1's own classes:

1. ``parallel_state.initialize_model_parallel(tp, pp)``; ``GPTModel`` (local spec) for its stage;
   ``DistributedDataParallel`` around it (grad buffers, ``main_grad``; bucketed and DP-padded for the
   distributed optimizer); ``get_megatron_optimizer`` with an ``OptimizerConfig`` filled from the rank
   file's ``args`` field by field, as Megatron-LM's ``get_megatron_optimizer_config`` does;
2. ``load_state_dict(rank["model"], strict=True)``, ``optimizer.load_state_dict(rank["optimizer"])``
   and, for the distributed optimizer, ``optimizer.load_parameter_state(distrib_optim.pt)``; or, for a
   torch_dist ITERATION_DIR (``.metadata``; args from its ``common.pt``), ``dist_checkpointing.load`` of
   the model's and the optimizer's sharded state dicts as Megatron-LM's ``load_checkpoint`` does
   (``_load_torch_dist``);
3. ``main_grad`` of every parameter := its TP piece (``tp_piece``) of the full gradient in GRADS.pt
   (canonical TP1 names), then ``optimizer.step()`` (grad-norm clipping over the model-parallel or
   distributed-optimizer group included).

Written to OUT_DIR/rank{R}.pt: the grad norm ``step()`` reports; per canonical name the updated model
weight; and, before and after the step, what the optimizer holds for it: the fp32 main param,
``exp_avg`` and ``exp_avg_sq`` (whole, or, for the distributed optimizer, this DP rank's slice of the
flattened parameter with its offset).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import os
import sys
from pathlib import Path
from typing import Any

if __name__ == "__main__":  # run as a script: `support` is found from tests/
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from support.gloo_ranks import run_ranks

ROW_PARALLEL = ("self_attention.linear_proj.weight", "mlp.linear_fc2.weight")
COLUMN_PARALLEL = ("word_embeddings.weight", "output_layer.weight", "self_attention.linear_qkv.weight")
GATED = "mlp.linear_fc1.weight"


def tp_piece(name: str, full: torch.Tensor, tp: int, tp_rank: int, swiglu: bool) -> torch.Tensor:
    """TP rank ``tp_rank``'s piece of parameter ``name`` (Megatron's rules for this dense GPT)."""
    if tp == 1:
        return full
    if name.endswith(ROW_PARALLEL):
        return full.chunk(tp, dim=1)[tp_rank]
    if name.endswith(COLUMN_PARALLEL) or (name.endswith(GATED) and not swiglu):
        return full.chunk(tp, dim=0)[tp_rank]
    if name.endswith(GATED):  # [gate; up], each split over the TP ranks
        return torch.cat([half.chunk(tp, dim=0)[tp_rank] for half in full.chunk(2, dim=0)])
    if full.dim() == 1:  # norms: replicated
        return full
    raise ValueError(f"no TP rule for {name}")


def canonical(local: str, layer_offset: int) -> str:
    parts = local.split(".")
    if parts[:2] == ["decoder", "layers"]:
        parts[2] = str(int(parts[2]) + layer_offset)
    return ".".join(parts)


def _build(args: argparse.Namespace, pp_rank: int) -> Any:
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.module import Float16Module
    from support.mcore_helpers import transformer_config_from_args

    # perform_initialization: with use_cpu_initialization, only the initializing path marks the weights
    # ``tensor_model_parallel`` (tensor_parallel/layers.py); unmarked, TP rank 1's pieces count as
    # duplicates in the grad norm. The values are overwritten by the checkpoint.
    config = dataclasses.replace(transformer_config_from_args(args), bf16=args.bf16, fp16=args.fp16,
                                 perform_initialization=True)
    model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(normalization=args.normalization),
                     vocab_size=args.padded_vocab_size, max_sequence_length=args.max_position_embeddings,
                     pre_process=pp_rank == 0, post_process=pp_rank == args.pipeline_model_parallel_size - 1,
                     share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
                     position_embedding_type=args.position_embedding_type, rotary_base=args.rotary_base)
    if args.bf16 or args.fp16:  # as Megatron-LM's get_model: every parameter (the norms too) in 16 bits
        model = Float16Module(config, model)
    # The run's DDP bucketing (Megatron-LM's get_megatron_ddp_config: overlap_grad_reduce,
    # ddp_bucket_size, ddp_pad_buckets_for_high_nccl_busbw); the goldens ran without overlap (one bucket).
    # --ddp-num-buckets: get_model's bucket size, the rank's parameter count over it (resolve_ddp_bucket_size).
    bucket_size = getattr(args, "ddp_bucket_size", None)
    if getattr(args, "ddp_num_buckets", None) is not None:
        bucket_size = sum(param.nelement() for param in model.parameters()) // args.ddp_num_buckets
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=args.accumulate_allreduce_grads_in_fp32,
        overlap_grad_reduce=bool(getattr(args, "overlap_grad_reduce", False)), overlap_param_gather=False,
        use_distributed_optimizer=args.use_distributed_optimizer, bucket_size=bucket_size,
        pad_buckets_for_high_nccl_busbw=bool(getattr(args, "ddp_pad_buckets_for_high_nccl_busbw", False)))
    return DistributedDataParallel(config, ddp_config, model)


def _optimizer(args: argparse.Namespace, ddp: Any) -> Any:
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    fields = {field.name: getattr(args, field.name) for field in dataclasses.fields(OptimizerConfig)
              if hasattr(args, field.name) and field.name != "timers"}
    return get_megatron_optimizer(OptimizerConfig(**fields), [ddp])


def _main_params(optimizer: Any) -> dict[int, tuple[int, torch.Tensor, Any]]:
    """id(model param) -> (offset in the flattened param, its fp32 main param or slice, the inner optimizer)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    from megatron.core.optimizer.optimizer import ChainedOptimizer, Float16OptimizerWithFloat16Params

    if isinstance(optimizer, ChainedOptimizer):  # get_megatron_optimizer's: the dense one (and a MoE's expert one)
        return {key: value for chained in optimizer.chained_optimizers for key, value in _main_params(chained).items()}
    inner = optimizer.optimizer
    if isinstance(optimizer, DistributedOptimizer):
        pairs = zip(optimizer.model_float16_groups + optimizer.model_fp32_groups,
                    optimizer.shard_fp32_from_float16_groups + optimizer.shard_fp32_groups)
        return {id(param): (optimizer._get_model_param_range_map(param)["param"].start, main, inner)
                for model_group, main_group in pairs for param, main in zip(model_group, main_group)}
    if isinstance(optimizer, Float16OptimizerWithFloat16Params):
        return {id(param): (0, main, inner) for model_group, main_group
                in zip(optimizer.float16_groups, optimizer.fp32_from_float16_groups)
                for param, main in zip(model_group, main_group)}
    return {id(param): (0, param, inner) for group in inner.param_groups for param in group["params"]}


def optimizer_tensors(optimizer: Any, names: dict[int, str]) -> dict[str, tuple[int, dict[str, torch.Tensor]]]:
    """Per canonical name: (offset, {"param": fp32 main, "exp_avg", "exp_avg_sq", "step"}) as the optimizer
    holds them (torch's Adam keeps a ``step`` per parameter)."""
    result = {}
    for key, (offset, main, inner) in _main_params(optimizer).items():
        state = inner.state[main]
        result[names[key]] = (offset, {"param": main.detach().clone(), "exp_avg": state["exp_avg"].clone(),
                                       "exp_avg_sq": state["exp_avg_sq"].clone(),
                                       "step": torch.as_tensor(state["step"], dtype=torch.float32).clone()})
    return result


def _gpt(ddp: Any) -> Any:
    from megatron.core.models.gpt import GPTModel

    inner = ddp.module
    return inner if isinstance(inner, GPTModel) else inner.module


def checkpoint_args(iteration_dir: Path) -> Any:
    """The ``args`` a checkpoint records: a torch_dist checkpoint's common state (``common.pt``, or in megatron-core
    0.19's form the store's ``common_state`` entry: ``read_common``), or its first rank file's."""
    from support.checkpoint_compare import read_common
    from support.megatron_fixtures import load_for_test

    if (iteration_dir / ".metadata").is_file():
        return read_common(iteration_dir)["args"]
    return load_for_test(next(iter(sorted(iteration_dir.glob("mp_rank_*/model_optim_rng.pt")))))["args"]


def state_loading() -> Any:
    """How the distributed optimizer's state is loaded: under ``torch.no_grad()``. A float32 run's main params are
    views of the model's leaf parameters, and megatron-core's per-rank and dp_reshardable loaders
    (``load_parameter_state_from_dp_zero`` and ``_from_dp_reshardable``, 0.16.1 and Megatron-LM main) copy into them
    without the ``torch.no_grad()`` its fully_reshardable and model-space loaders have: they raise "a view of a leaf
    Variable that requires grad is being used in an in-place operation". A bf16 run's main params are fp32 copies,
    which loading alike under no_grad leaves as they are."""
    return torch.no_grad()


def _load_per_rank(model: Any, optimizer: Any, iteration_dir: Path, args: Any, tp_rank: int, pp_rank: int) -> None:
    from support.megatron_fixtures import load_for_test

    pp = args.pipeline_model_parallel_size
    path = iteration_dir / (f"mp_rank_{tp_rank:02d}" + (f"_{pp_rank:03d}" if pp > 1 else "")) / "model_optim_rng.pt"
    state = load_for_test(path)
    model.load_state_dict(state["model"], strict=True)
    optimizer.load_state_dict(state["optimizer"])
    if args.use_distributed_optimizer:
        with state_loading():
            optimizer.load_parameter_state(str(path.parent / "distrib_optim.pt"))


def _load_torch_dist(model: Any, optimizer: Any, iteration_dir: Path) -> None:
    """What Megatron-LM's ``load_checkpoint`` does for a torch_dist checkpoint: the sharded-state-dict
    metadata the checkpoint records (``distrib_optim_sharding_type`` included) plus the DP group; the
    model's ``sharded_state_dict`` and the optimizer's ``sharded_state_dict(..., is_loading=True)``;
    ``dist_checkpointing.load``; then the model's ``load_state_dict`` and the optimizer's, which
    scatters the loaded parameter state (``load_parameter_state_from_<sharding type>``)."""
    from megatron.core import dist_checkpointing, parallel_state
    from support.megatron_fixtures import allowed_globals

    with torch.serialization.safe_globals(allowed_globals()):  # common.pt is read weights-only, args included
        metadata = dict(dist_checkpointing.load_content_metadata(str(iteration_dir)) or {})
        metadata["dp_cp_group"] = parallel_state.get_data_parallel_group(with_context_parallel=True)
        sharded = {"model": model.sharded_state_dict(metadata=metadata)}
        sharded["optimizer"] = optimizer.sharded_state_dict(sharded, is_loading=True, metadata=metadata)
        loaded = dist_checkpointing.load(sharded, str(iteration_dir))
    model.load_state_dict(loaded["model"], strict=True)
    with state_loading():
        optimizer.load_state_dict(loaded["optimizer"])


def _rank(rank: int, world: int, store: str, iteration_dir: Path, grads_path: Path, out_dir: Path) -> None:
    import support.mcore_cpu_shim as mcore_cpu_shim
    from megatron.core import parallel_state

    mcore_cpu_shim.install()
    args = checkpoint_args(iteration_dir)
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    torch.distributed.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    parallel_state.initialize_model_parallel(tp, pp)
    tp_rank, pp_rank = parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_pipeline_model_parallel_rank()
    ddp = _build(args, pp_rank)
    optimizer = _optimizer(args, ddp)
    model = _gpt(ddp)
    if (iteration_dir / ".metadata").is_file():
        _load_torch_dist(model, optimizer, iteration_dir)
    else:
        _load_per_rank(model, optimizer, iteration_dir, args, tp_rank, pp_rank)
    grads = torch.load(grads_path, weights_only=True)
    names = {id(param): canonical(name, pp_rank * (args.num_layers // pp))
             for name, param in model.named_parameters()}
    before = optimizer_tensors(optimizer, names)
    for param in model.parameters():
        param.main_grad.copy_(tp_piece(names[id(param)], grads[names[id(param)]], tp, tp_rank, args.swiglu))
    _, grad_norm, _ = optimizer.step()
    result = {"tp_rank": tp_rank, "grad_norm": float(grad_norm), "before": before,
              "after": optimizer_tensors(optimizer, names),
              "weights": {names[id(p)]: p.detach().clone() for p in model.parameters()}}
    torch.save(result, out_dir / f"rank{rank}.pt")
    torch.distributed.destroy_process_group()


def run(iteration_dir: Path, grads_path: Path, out_dir: Path, dp: int) -> None:
    """Every rank of the checkpoint at ``iteration_dir`` times ``dp``, each in a forked gloo process."""
    args = checkpoint_args(iteration_dir)
    world = args.tensor_model_parallel_size * args.pipeline_model_parallel_size * dp
    out_dir.mkdir(parents=True, exist_ok=True)
    run_ranks(_rank, world, iteration_dir, grads_path, out_dir, where=str(iteration_dir))


def main(argv: list[str]) -> None:
    """argv: GRADS.pt, then (ITERATION_DIR, OUT_DIR, DP) per run."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    importlib.import_module("megatron.core.optimizer")  # imported once, before the forks
    for start in range(1, len(argv), 3):
        run(Path(argv[start]), Path(argv[0]), Path(argv[start + 1]), int(argv[start + 2]))


if __name__ == "__main__":
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    main(sys.argv[1:])
