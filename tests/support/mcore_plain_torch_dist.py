"""Run as a script: megatron-core's plain optimizer takes two AdamW steps and saves itself in torch_dist.

    python tests/support/mcore_plain_torch_dist.py ARGS_ITERATION_DIR ROOT DTYPE

DTYPE ``bf16`` (Float16OptimizerWithFloat16Params) or ``fp32`` (FP32Optimizer). The run's args are those of the
per-rank Megatron-LM golden at ARGS_ITERATION_DIR (a dense GPT at TP2), with DP1, the dtype, no distributed
optimizer and ``--ckpt-format torch_dist``. One forked gloo process per TP rank builds, with megatron-core 0.16.1's
own classes (``mcore_optimizer_step._build`` / ``_optimizer``: GPTModel + DDP + ``get_megatron_optimizer``), a
freshly initialized model (the same seed on every rank), sets each parameter's ``main_grad`` to a fixed function
of its canonical name, TP piece and the step, and calls ``optimizer.step()`` twice. Then, as Megatron-LM's
``save_checkpoint`` does for torch_dist: the model's ``sharded_state_dict`` and the optimizer's
``sharded_state_dict(model_sd, metadata)`` with Megatron-LM's content metadata (``chained_optim_avoid_prefix``),
``args``, ``iteration`` and the counters as common state, ``dist_checkpointing.save`` into ROOT/iter_0000002.
Written beside it, ROOT.held/rank{R}.pt: what the optimizer holds per canonical name (``optimizer_tensors``: the
fp32 master, ``exp_avg``, ``exp_avg_sq``, ``step``) and the weights, as ``mcore_optimizer_step`` writes them.
"""

from __future__ import annotations

import argparse
import copy
import sys
import zlib
from pathlib import Path
from typing import Any

if __name__ == "__main__":  # run as a script: `support` is found from tests/
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

ITERATION = 2
METADATA = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}  # Megatron-LM, no distrib. optim.


def run_args(args_dir: Path, dtype: str) -> Any:
    from support.mcore_optimizer_step import checkpoint_args

    # the golden's args less the values whose classes are test stand-ins (Megatron-LM's enums: not picklable here)
    args = argparse.Namespace(**{key: copy.deepcopy(value) for key, value in vars(checkpoint_args(args_dir)).items()
                                 if type(value).__module__ in ("builtins", "torch")})
    args.bf16, args.fp16 = dtype == "bf16", False
    args.params_dtype = torch.bfloat16 if dtype == "bf16" else torch.float32
    args.use_distributed_optimizer = False
    args.data_parallel_size, args.world_size = 1, args.tensor_model_parallel_size
    args.ckpt_format, args.iteration = "torch_dist", ITERATION
    return args


def _gradient(name: str, param: torch.Tensor, tp_rank: int, step: int) -> torch.Tensor:
    """A fixed gradient: replicated (1-D) parameters get the same on every TP rank, as their replicas must."""
    seed = zlib.crc32(name.encode()) + 1000 * step + (100 * tp_rank if param.dim() > 1 else 0)
    return torch.randn(param.shape, generator=torch.Generator().manual_seed(seed)) * 1e-2


def _rank(rank: int, world: int, store: str, args: Any, root: Path) -> None:
    import support.mcore_cpu_shim as mcore_cpu_shim
    from megatron.core import dist_checkpointing, parallel_state
    from support.mcore_optimizer_step import _build, _gpt, _optimizer, canonical, optimizer_tensors

    mcore_cpu_shim.install()
    torch.distributed.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    parallel_state.initialize_model_parallel(args.tensor_model_parallel_size, 1)
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    torch.manual_seed(1234)
    ddp = _build(args, 0)
    optimizer = _optimizer(args, ddp)
    model = _gpt(ddp)
    names = {id(param): canonical(name, 0) for name, param in model.named_parameters()}
    for step in range(2):
        for param in model.parameters():
            param.main_grad.copy_(_gradient(names[id(param)], param, tp_rank, step))
        optimizer.step()
    sharded: dict[str, Any] = {"model": model.sharded_state_dict(metadata=dict(METADATA))}
    sharded["optimizer"] = optimizer.sharded_state_dict(sharded, metadata=dict(METADATA))
    sharded.update(args=args, checkpoint_version=3.0, iteration=ITERATION, num_floating_point_operations_so_far=0)
    iteration_dir = root / f"iter_{ITERATION:07d}"
    iteration_dir.mkdir(parents=True, exist_ok=True)
    from support.mcore_cpu_shim import allow_cpu_save

    allow_cpu_save()
    dist_checkpointing.save(sharded, str(iteration_dir), content_metadata=dict(METADATA))
    if rank == 0:
        (root / "latest_checkpointed_iteration.txt").write_text(str(ITERATION))
    held = optimizer_tensors(optimizer, names)
    torch.save({"tp_rank": tp_rank, "before": held, "after": held,
                "weights": {names[id(p)]: p.detach().clone() for p in model.parameters()}},
               root.with_suffix(".held") / f"rank{rank}.pt")
    torch.distributed.destroy_process_group()


def main(argv: list[str]) -> None:
    from support.gloo_ranks import run_ranks

    args_dir, root, dtype = Path(argv[0]), Path(argv[1]), argv[2]
    args = run_args(args_dir, dtype)
    root.with_suffix(".held").mkdir(parents=True)
    run_ranks(_rank, args.tensor_model_parallel_size, args, root, where=str(root))


if __name__ == "__main__":
    from support.gloo_ranks import prepare_forks

    prepare_forks()
    main(sys.argv[1:])
