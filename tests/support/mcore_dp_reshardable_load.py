"""Run as a script: megatron-core's DistributedOptimizer loads a torch_dist checkpoint's dp_reshardable state.

    python tests/support/mcore_dp_reshardable_load.py ITERATION_DIR OUT_DIR DP [grad-scaler]

One forked gloo process per rank of the checkpoint's TP x PP layout (common.pt's args) times DP. Each
builds GPTModel + DDP + ``get_megatron_optimizer`` as ``mcore_optimizer_step.py`` does, then loads as
Megatron-LM's ``load_checkpoint`` does for this form: ``DistributedOptimizer.sharded_state_dict(...,
is_loading=True, metadata={'distrib_optim_sharding_type': 'dp_reshardable'})``,
``dist_checkpointing.load`` and ``load_state_dict`` (which checks ``per_bucket_numel_unpadded`` against
its own buffers). Written to OUT_DIR/rank{R}.pt: what the optimizer then holds per canonical name
(``mcore_optimizer_step.optimizer_tensors``: this DP rank's slice of the flattened parameter, its offset).
``grad-scaler``: the optimizer gets megatron-core's DynamicGradScaler first, as for ``--fp16``, so
the load reads the ``grad_scaler`` ShardedObject; what the scaler then holds is written too.
"""

from __future__ import annotations

import argparse
import io
import sys
from pathlib import Path

if __name__ == "__main__":  # run as a script: `support` is found from tests/
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from support.gloo_ranks import run_ranks


def _rank(rank: int, world: int, store: str, iteration_dir: Path, out_dir: Path, scaler: bool = False) -> None:
    import support.mcore_cpu_shim as mcore_cpu_shim
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.optimizer.optimizer import ChainedOptimizer

    from support.mcore_optimizer_step import _build, _gpt, _optimizer, canonical, optimizer_tensors
    from support.megatron_fixtures import load_for_test

    mcore_cpu_shim.install()
    args = load_for_test(iteration_dir / "common.pt")["args"]
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    torch.distributed.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    parallel_state.initialize_model_parallel(tp, pp)
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    ddp = _build(args, pp_rank)
    optimizer = _optimizer(args, ddp)
    inner = optimizer.chained_optimizers[0] if isinstance(optimizer, ChainedOptimizer) else optimizer
    # torch's Adam has no state before its first step, and DistributedOptimizer.state_dict() (called by
    # sharded_state_dict) asserts one step count among the states: give each fp32 main param Adam's
    # initial state, as megatron-core's init_state_fn does for the Apex/TE Adam on GPUs.
    for group in inner.optimizer.param_groups:
        for main in group["params"]:
            inner.optimizer.state[main] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(main),
                                           "exp_avg_sq": torch.zeros_like(main)}
    # dist_checkpointing's load_common torch.loads common.pt (weights_only): Megatron-LM allowlists these
    # (after load_for_test, whose safe_globals context removes what it allowed on exit)
    # (and pgconvert's stand-ins for Megatron-LM d98e8a64's enums that 0.16.1 lacks, as load_for_test)
    from megatron.core.safe_globals import SAFE_GLOBALS
    from pgconvert.formats.megatron import SAFE_GLOBALS as PGCONVERT_SAFE_GLOBALS
    torch.serialization.add_safe_globals([argparse.Namespace, io.BytesIO, *PGCONVERT_SAFE_GLOBALS, *SAFE_GLOBALS])
    if scaler:  # the dynamic grad scaler get_megatron_optimizer builds for --fp16 (its state is loaded)
        from megatron.core.optimizer.grad_scaler import DynamicGradScaler
        inner.grad_scaler = DynamicGradScaler(initial_scale=1.0, min_scale=1.0, growth_factor=2.0,
                                              backoff_factor=0.5, growth_interval=1000, hysteresis=2)
    sharded = inner.sharded_state_dict({}, is_loading=True, metadata={"distrib_optim_sharding_type": "dp_reshardable"})
    # under "optimizer", as Megatron-LM's state dict holds it: the common state's entry joins it there
    inner.load_state_dict(dist_checkpointing.load({"optimizer": sharded}, str(iteration_dir))["optimizer"])
    names = {id(param): canonical(name, pp_rank * (args.num_layers // pp))
             for name, param in _gpt(ddp).named_parameters()}
    # The per-parameter Adam ``step`` is the stand-in's (a LocalNonpersistentObject of the bucket state, set
    # back by the load); the checkpoint's step is the loaded param groups' (the ``.optimizer`` object).
    steps = [group["step"] for group in inner.optimizer.param_groups]
    torch.save({"loaded": optimizer_tensors(optimizer, names), "group_steps": steps,
                "grad_scaler": inner.grad_scaler.state_dict() if scaler else None}, out_dir / f"rank{rank}.pt")
    torch.distributed.destroy_process_group()


def run(iteration_dir: Path, out_dir: Path, dp: int, scaler: bool = False) -> None:
    from support.megatron_fixtures import load_for_test

    args = load_for_test(iteration_dir / "common.pt")["args"]
    world = args.tensor_model_parallel_size * args.pipeline_model_parallel_size * dp
    out_dir.mkdir(parents=True, exist_ok=True)
    run_ranks(_rank, world, iteration_dir, out_dir, scaler, where=str(iteration_dir))


if __name__ == "__main__":
    from support.gloo_ranks import prepare_forks

    prepare_forks()
    run(Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]), sys.argv[4:] == ["grad-scaler"])
