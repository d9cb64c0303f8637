"""Run as a script: megatron-core loads, and saves again, a MoE torch_dist checkpoint's chained optimizer state.

    python tests/support/mcore_moe_fully_reshardable.py ITERATION_DIR OUT_DIR

One forked gloo process per rank of a TP x EP job (common.pt's args; dense data-parallel over the EP ranks).
Each builds the MoE fixture (``support.tiny_models.MOE`` in float32, as ``support.mcore_gpt_models.build_model`` configures
it, on real process groups), ``DistributedDataParallel`` and ``get_megatron_optimizer`` (the dense and expert
distributed optimizers chained), then does what Megatron-LM's ``load_checkpoint`` does for torch_dist:
``ChainedOptimizer.sharded_state_dict(model_sd, is_loading=True, metadata)`` with the checkpoint's content
metadata plus ``chained_optim_avoid_prefix`` (Megatron-LM's ``_build_sharded_state_dict_metadata``),
``dist_checkpointing.load`` and ``load_state_dict``. Written to OUT_DIR/rank{R}.json: the optimizer
ShardedTensors megatron-core declares (key, global shape) and the structure of its non-tensor part. Then the
same ``sharded_state_dict`` for saving, ``dist_checkpointing.save`` into OUT_DIR/saved: megatron-core's own
fully_reshardable records of the state it loaded, with the model it loaded and the args. With
``use_distributed_optimizer`` False in the args, the chained plain optimizers instead.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

if __name__ == "__main__":  # run as a script: `support` is found from tests/
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from support.gloo_ranks import run_ranks


def _model(args: Any) -> Any:
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    import support.mcore_helpers as mcore
    from support.tiny_models import MOE
    from support.megatron_fixtures import make_args

    m = dataclasses.replace(MOE, dtype=torch.float32)
    tp, ep = args.tensor_model_parallel_size, args.expert_model_parallel_size
    fixture_args = make_args(m, tp, 1, None, None, 100, ep=ep)
    fixture_args.moe_router_score_function = "sigmoid"  # the fixture's expert bias needs it (megatron-core checks)
    base = mcore.transformer_config_from_args(fixture_args)
    config = dataclasses.replace(
        base, num_moe_experts=m.num_experts, moe_ffn_hidden_size=m.expert_ffn_hidden_size,
        moe_layer_freq=list(m.moe_layer_freq), moe_shared_expert_intermediate_size=m.moe_shared_expert_intermediate_size,
        moe_shared_expert_gate=m.moe_shared_expert_gate, moe_router_enable_expert_bias=m.moe_router_enable_expert_bias,
        moe_router_score_function="sigmoid", moe_router_topk=2, expert_model_parallel_size=ep,
        expert_tensor_parallel_size=expert_tp(args), moe_token_dispatcher_type="allgather", add_bias_linear=False,
        perform_initialization=True)
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization=args.normalization)
    model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=args.padded_vocab_size,
                     max_sequence_length=args.max_position_embeddings, pre_process=True, post_process=True,
                     share_embeddings_and_output_weights=m.tied_embeddings,
                     position_embedding_type=m.position_embedding_type)
    distributed = bool(getattr(args, "use_distributed_optimizer", True))  # False: the plain optimizers
    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=distributed, overlap_grad_reduce=False,
                                               overlap_param_gather=False)
    return DistributedDataParallel(config, ddp_config, model)


def expert_tp(args: Any) -> int:
    """The checkpoint's expert tensor-parallel size (its tensor-parallel size where it records none)."""
    return getattr(args, "expert_tensor_parallel_size", None) or args.tensor_model_parallel_size


def _declared(sharded: Any) -> dict[str, list[int]]:
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories

    apply_factories(sharded)
    return {value.key: list(value.global_shape) for value in nested_values(sharded) if isinstance(value, ShardedTensor)}


def _structure(value: Any) -> Any:
    """The non-tensor part's shape: dict keys (as written, with their types), lists' lengths, leaves' types."""
    from megatron.core.dist_checkpointing.mapping import ShardedBase

    if isinstance(value, dict):
        kept = {key: _structure(item) for key, item in value.items() if not isinstance(item, ShardedBase)}
        return {f"{type(key).__name__}:{key}": item for key, item in kept.items() if item != {}}
    if isinstance(value, list):
        return [_structure(item) for item in value]
    return type(value).__name__


def _rank(rank: int, world: int, store: str, iteration_dir: Path, out_dir: Path) -> None:
    import support.mcore_cpu_shim as mcore_cpu_shim
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from support.megatron_fixtures import allowed_globals, load_for_test

    mcore_cpu_shim.install()
    args = load_for_test(iteration_dir / "common.pt")["args"]
    tp, ep = args.tensor_model_parallel_size, args.expert_model_parallel_size
    torch.distributed.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    parallel_state.initialize_model_parallel(tp, 1, expert_model_parallel_size=ep,
                                             expert_tensor_parallel_size=expert_tp(args))
    ddp = _model(args)
    distributed = bool(getattr(args, "use_distributed_optimizer", True))  # or the chained plain ones
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3, min_lr=1e-4, weight_decay=0.1,
                                                       use_distributed_optimizer=distributed), [ddp])
    for inner in optimizer.chained_optimizers:  # torch's Adam holds no state before a step (as mcore_dp_reshardable_load)
        for group in inner.optimizer.param_groups:
            for main in group["params"]:
                inner.optimizer.state[main] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(main),
                                               "exp_avg_sq": torch.zeros_like(main)}
    with torch.serialization.safe_globals(allowed_globals()):
        metadata = dict(dist_checkpointing.load_content_metadata(str(iteration_dir)) or {})
        metadata.update(chained_optim_avoid_prefix=True,
                        dp_cp_group=parallel_state.get_data_parallel_group(with_context_parallel=True))
        model_sd = ddp.module.sharded_state_dict(metadata=metadata)
        sharded = optimizer.sharded_state_dict(model_sd, is_loading=True, metadata=metadata)
        structure = _structure(sharded)
        loaded = dist_checkpointing.load({"optimizer": sharded, "model": ddp.module.sharded_state_dict(
            metadata=metadata)}, str(iteration_dir))
    ddp.module.load_state_dict(loaded["model"])  # FP32Optimizer's masters are the weights
    optimizer.load_state_dict(loaded["optimizer"])
    model_sd = ddp.module.sharded_state_dict(metadata=metadata)
    saving = optimizer.sharded_state_dict(model_sd, is_loading=False, metadata=metadata)
    declared = _declared(optimizer.sharded_state_dict(ddp.module.sharded_state_dict(metadata=metadata),
                                                      is_loading=True, metadata=metadata))
    from support.mcore_cpu_shim import allow_cpu_save

    allow_cpu_save()
    (out_dir / f"rank{rank}.json").write_text(json.dumps({"declared": declared, "structure": structure,
                                                          "chained": len(optimizer.chained_optimizers)}))
    common = {key: value for key, value in load_for_test(iteration_dir / "common.pt").items()
              if key in ("args", "iteration", "checkpoint_version")}  # a checkpoint pgconvert reads
    dist_checkpointing.save({"optimizer": saving, "model": model_sd, **common}, str(out_dir / "saved"))
    torch.distributed.destroy_process_group()


def run(iteration_dir: Path, out_dir: Path) -> None:
    from support.megatron_fixtures import load_for_test

    args = load_for_test(iteration_dir / "common.pt")["args"]
    world = args.tensor_model_parallel_size * args.expert_model_parallel_size
    (out_dir / "saved").mkdir(parents=True, exist_ok=True)
    run_ranks(_rank, world, iteration_dir, out_dir, where=str(iteration_dir))


if __name__ == "__main__":
    from support.gloo_ranks import prepare_forks

    prepare_forks()
    run(Path(sys.argv[1]), Path(sys.argv[2]))
