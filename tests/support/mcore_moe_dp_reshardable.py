"""Run as a script: megatron-core loads, and saves again, a MoE torch_dist checkpoint's chained optimizer state in
the dp_reshardable form.

    python tests/support/mcore_moe_dp_reshardable.py ITERATION_DIR OUT_DIR

One forked gloo process per rank of a TP x DP job (common.pt's args: tensor, expert parallel and data-parallel
sizes; expert data-parallel size tp * dp / (tp * ep)). Each builds the MoE fixture, ``DistributedDataParallel`` and
``get_megatron_optimizer`` (dense and expert distributed optimizers chained) as ``mcore_moe_fully_reshardable``
does, then what Megatron-LM's ``load_checkpoint`` does for torch_dist: the model's and
``ChainedOptimizer.sharded_state_dict(model_sd, is_loading=True, metadata)`` with the checkpoint's content metadata
(``distrib_optim_sharding_type='dp_reshardable'``) plus ``chained_optim_avoid_prefix`` (Megatron-LM's
``_build_sharded_state_dict_metadata``), ``dist_checkpointing.load``, the model's ``load_state_dict`` and the
optimizer's. Written to OUT_DIR/rank{R}.pt: what each chained optimizer then holds per canonical parameter
(this DP rank's slice of the flattened parameter and its offset), and the ShardedObject / ShardedTensor keys it
declared. Then the model and ``sharded_state_dict(is_loading=False)`` saved with ``dist_checkpointing.save`` into
OUT_DIR/saved (with the checkpoint's args and iteration): megatron-core's own dp_reshardable MoE checkpoint.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

if __name__ == "__main__":  # run as a script: `support` is found from tests/
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from support.gloo_ranks import run_ranks


def _canonical(name: str, ep_rank: int, local_experts: int) -> str:
    """megatron-core's local parameter name with the global expert index (``local_experts.<k>``)."""
    return re.sub(r"local_experts\.(\d+)\.", lambda m: f"local_experts.{ep_rank * local_experts + int(m.group(1))}.",
                  name)


def _held(optimizer: Any, names: dict[int, str]) -> list[dict[str, tuple[int, dict[str, torch.Tensor]]]]:
    """Per chained DistributedOptimizer, per canonical name: (offset in the flattened parameter, its fp32 main
    shard, exp_avg, exp_avg_sq) as the optimizer holds them."""
    held = []
    for inner in optimizer.chained_optimizers:
        pairs = zip(inner.model_float16_groups + inner.model_fp32_groups,
                    inner.shard_fp32_from_float16_groups + inner.shard_fp32_groups)
        own = {}
        for model_group, main_group in pairs:
            for param, main in zip(model_group, main_group):
                state = inner.optimizer.state[main]
                own[names[id(param)]] = (inner._get_model_param_range_map(param)["param"].start, {
                    "param": main.detach().clone(), "exp_avg": state["exp_avg"].clone(),
                    "exp_avg_sq": state["exp_avg_sq"].clone()})
        held.append(own)
    return held


def _declared(sharded: Any) -> dict[str, Any]:
    """The keys megatron-core declares: ShardedTensors (key: global shape), ShardedObjects (key: None)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

    return {value.key: list(value.global_shape) if isinstance(value, ShardedTensor) else None
            for value in nested_values(sharded) if isinstance(value, (ShardedTensor, ShardedObject))}


def _rank(rank: int, world: int, store: str, iteration_dir: Path, out_dir: Path) -> None:
    import support.mcore_cpu_shim as mcore_cpu_shim
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from support.megatron_fixtures import allowed_globals, load_for_test
    from support.mcore_moe_fully_reshardable import _model, expert_tp

    mcore_cpu_shim.install()
    common = load_for_test(iteration_dir / "common.pt")
    args = common["args"]
    tp, ep = args.tensor_model_parallel_size, args.expert_model_parallel_size
    torch.distributed.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    parallel_state.initialize_model_parallel(tp, 1, expert_model_parallel_size=ep,
                                             expert_tensor_parallel_size=expert_tp(args))
    ddp = _model(args)
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3, min_lr=1e-4, weight_decay=0.1,
                                                       use_distributed_optimizer=True), [ddp])
    for inner in optimizer.chained_optimizers:  # torch's Adam holds no state before a step (as mcore_dp_reshardable_load)
        for group in inner.optimizer.param_groups:
            for main in group["params"]:
                inner.optimizer.state[main] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(main),
                                               "exp_avg_sq": torch.zeros_like(main)}
    with torch.serialization.safe_globals(allowed_globals()):
        content = dict(dist_checkpointing.load_content_metadata(str(iteration_dir)) or {})
        metadata = dict(content, chained_optim_avoid_prefix=True,
                        dp_cp_group=parallel_state.get_data_parallel_group(with_context_parallel=True))
        model_sd = ddp.module.sharded_state_dict(metadata=metadata)
        sharded = optimizer.sharded_state_dict(model_sd, is_loading=True, metadata=metadata)
        declared = _declared(sharded)
        loaded = dist_checkpointing.load({"model": model_sd, "optimizer": sharded}, str(iteration_dir))
    ddp.module.load_state_dict(loaded["model"], strict=False)
    # an fp32 model's main params are views of its parameters (shard_fp32_groups), which
    # _set_main_param_and_optimizer_states copies into: under no_grad, as autograd refuses that otherwise
    with torch.no_grad():
        optimizer.load_state_dict(loaded["optimizer"])
    local = args.num_experts // ep
    names = {id(param): _canonical(name, parallel_state.get_expert_model_parallel_rank(), local)
             for name, param in ddp.module.named_parameters()}
    steps = [[group["step"] for group in inner.optimizer.param_groups] for inner in optimizer.chained_optimizers]
    groups = {"dense": parallel_state.get_data_parallel_rank(),
              "expert_dp": parallel_state.get_expert_data_parallel_rank(),
              "expert_dp_size": parallel_state.get_expert_data_parallel_world_size(),
              "idx": [inner.data_parallel_group_idx for inner in optimizer.chained_optimizers]}
    torch.save({"held": _held(optimizer, names), "declared": declared, "steps": steps, "groups": groups},
               out_dir / f"rank{rank}.pt")
    saving = optimizer.sharded_state_dict(ddp.module.sharded_state_dict(metadata=metadata), is_loading=False,
                                          metadata=metadata)
    from support.mcore_cpu_shim import allow_cpu_save

    allow_cpu_save()
    state = {"model": ddp.module.sharded_state_dict(metadata=metadata), "optimizer": saving,
             **{key: common[key] for key in ("args", "checkpoint_version", "iteration") if key in common}}
    dist_checkpointing.save(state, str(out_dir / "saved"), content_metadata=content)
    torch.distributed.destroy_process_group()


def run(iteration_dir: Path, out_dir: Path) -> None:
    from support.megatron_fixtures import load_for_test

    args = load_for_test(iteration_dir / "common.pt")["args"]
    world = args.tensor_model_parallel_size * args.data_parallel_size
    (out_dir / "saved").mkdir(parents=True, exist_ok=True)
    run_ranks(_rank, world, iteration_dir, out_dir, where=str(iteration_dir))


if __name__ == "__main__":
    from support.gloo_ranks import prepare_forks

    prepare_forks()
    run(Path(sys.argv[1]), Path(sys.argv[2]))
