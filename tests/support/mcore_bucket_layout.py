"""Run as a script: megatron-core's own DDP buckets, per parameter, for a Megatron-LM run's args.

    python tests/support/mcore_bucket_layout.py ITERATION_DIR OVERRIDES_JSON OUT_DIR

The args are the checkpoint's at ITERATION_DIR (``mcore_optimizer_step.checkpoint_args``) with
OVERRIDES_JSON's fields set (sizes, ``overlap_grad_reduce``, ``ddp_bucket_size``, tying, ...). One gloo
process per rank of tp * pp * data_parallel_size (forked): ``parallel_state.initialize_model_parallel``,
then ``mcore_optimizer_step._build``: megatron-core 0.16.1's GPTModel (local spec) for the rank's stage
wrapped in its ``DistributedDataParallel`` with the distributed optimizer's config and the args' bucket
size, as Megatron-LM's ``get_model`` does for model chunk 0. Written to OUT_DIR/rank{R}.pt: the rank's
coordinates and, per DDP buffer, every parameter's ``(start, end, bucket)`` in the buffer by canonical
name (``_ParamAndGradBuffer.param_index_map``), each bucket's ``(start, end)`` (``bucket_indices``,
padded) and its ``numel_unpadded``.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
from pathlib import Path
from typing import Any

if __name__ == "__main__":  # run as a script: `support` is found from tests/
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from support.gloo_ranks import run_ranks


def _layout(ddp: Any, names: dict[int, str]) -> list[dict[str, Any]]:
    return [{"params": {names[id(param)]: tuple(int(v) for v in where)
                        for param, where in buffer.param_index_map.items()},
             "bucket_indices": [tuple(int(v) for v in pair) for pair in buffer.bucket_indices],
             "numel_unpadded": [int(bucket.numel_unpadded) for bucket in buffer.buckets]}
            for buffer in ddp.buffers]


def _rank(rank: int, world: int, store: str, args: Any, out_dir: Path) -> None:
    import support.mcore_cpu_shim as mcore_cpu_shim
    from megatron.core import parallel_state
    from support.mcore_optimizer_step import _build, _gpt, canonical

    mcore_cpu_shim.install()
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    torch.distributed.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    parallel_state.initialize_model_parallel(tp, pp)
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    ddp = _build(args, pp_rank)
    names = {id(param): canonical(name, pp_rank * (args.num_layers // pp))
             for name, param in _gpt(ddp).named_parameters()}
    result = {"tp_rank": parallel_state.get_tensor_model_parallel_rank(), "pp_rank": pp_rank,
              "dp_rank": parallel_state.get_data_parallel_rank(), "buffers": _layout(ddp, names)}
    torch.save(result, out_dir / f"rank{rank}.pt")
    torch.distributed.destroy_process_group()


def main(iteration_dir: Path, overrides: dict[str, Any], out_dir: Path) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from support.mcore_optimizer_step import checkpoint_args

    importlib.import_module("megatron.core.optimizer")  # imported once, before the forks

    args = checkpoint_args(iteration_dir)
    for key, value in overrides.items():
        setattr(args, key, value)
    world = args.tensor_model_parallel_size * args.pipeline_model_parallel_size * args.data_parallel_size
    out_dir.mkdir(parents=True, exist_ok=True)
    run_ranks(_rank, world, args, out_dir)


if __name__ == "__main__":
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    main(Path(sys.argv[1]), json.loads(sys.argv[2]), Path(sys.argv[3]))
