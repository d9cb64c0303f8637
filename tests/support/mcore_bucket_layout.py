"""Run as a script: megatron-core's own DDP buckets, per parameter, for a list of run configurations.

    python tests/support/mcore_bucket_layout.py ITERATION_DIR CASES_JSON OUT_DIR

CASES_JSON: ``{case name: overrides}``. Each case's args are the checkpoint's at ITERATION_DIR
(``mcore_optimizer_step.checkpoint_args``) with its overrides set (sizes, ``overlap_grad_reduce``,
``ddp_bucket_size``, ``ddp_pad_buckets_for_high_nccl_busbw``, tying, ...). The cases are grouped by their
world size tp * pp * data_parallel_size; per world size one gloo process per rank (forked), and each rank
runs every case of its world: per (tp, pp) ``parallel_state.initialize_model_parallel(tp, pp)`` once, then
per case ``mcore_optimizer_step._build`` (megatron-core 0.16.1's GPTModel, local spec, for the rank's stage
wrapped in its ``DistributedDataParallel`` with the distributed optimizer's config and the case's bucketing,
as Megatron-LM's ``get_model`` does for model chunk 0; a fresh model each case), then
``destroy_model_parallel``.
Written to OUT_DIR/world{W}_rank{R}.pt: per case name the rank's coordinates and, per DDP buffer, every
parameter's ``(start, end, bucket)`` in the padded buffer by canonical name
(``_ParamAndGradBuffer.param_index_map``), each bucket's padded ``(start, end)`` (``bucket_indices``), each
bucket's ``numel_unpadded``, and the buffer's ``numel`` and ``numel_unpadded``.
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path
from typing import Any

if __name__ == "__main__":  # run as a script: `support` is found from tests/
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from support.gloo_ranks import prepare_forks, run_ranks


def _layout(ddp: Any, names: dict[int, str]) -> list[dict[str, Any]]:
    return [{"params": {names[id(param)]: tuple(int(v) for v in where)
                        for param, where in buffer.param_index_map.items()},
             "bucket_indices": [tuple(int(v) for v in pair) for pair in buffer.bucket_indices],
             "numel_unpadded": [int(bucket.numel_unpadded) for bucket in buffer.buckets],
             "buffer_numel": int(buffer.numel), "buffer_numel_unpadded": int(buffer.numel_unpadded)}
            for buffer in ddp.buffers]


def _case(args: Any) -> dict[str, Any]:
    """One case's layout on this rank; model parallelism already initialized at the case's tp and pp."""
    from megatron.core import parallel_state
    from support.mcore_optimizer_step import _build, _gpt, canonical

    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    ddp = _build(args, pp_rank)
    names = {id(param): canonical(name, pp_rank * (args.num_layers // args.pipeline_model_parallel_size))
             for name, param in _gpt(ddp).named_parameters()}
    return {"tp_rank": parallel_state.get_tensor_model_parallel_rank(), "pp_rank": pp_rank,
            "dp_rank": parallel_state.get_data_parallel_rank(), "buffers": _layout(ddp, names)}


def _grid(args: Any) -> tuple[int, int]:
    return args.tensor_model_parallel_size, args.pipeline_model_parallel_size


def _rank(rank: int, world: int, store: str, cases: dict[str, Any], out_dir: Path) -> None:
    import support.mcore_cpu_shim as mcore_cpu_shim
    from megatron.core import parallel_state

    mcore_cpu_shim.install()
    torch.distributed.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    result: dict[str, Any] = {}
    for grid in sorted({_grid(args) for args in cases.values()}):  # model parallelism set up once per grid
        parallel_state.initialize_model_parallel(*grid)
        result.update({name: _case(args) for name, args in cases.items() if _grid(args) == grid})
        parallel_state.destroy_model_parallel()
    torch.save(result, out_dir / f"world{world}_rank{rank}.pt")
    torch.distributed.destroy_process_group()


def main(iteration_dir: Path, cases: dict[str, dict[str, Any]], out_dir: Path) -> None:
    from support.mcore_optimizer_step import checkpoint_args

    base = checkpoint_args(iteration_dir)
    by_world: dict[int, dict[str, Any]] = {}
    for name, overrides in cases.items():
        args = copy.copy(base)
        for key, value in overrides.items():
            setattr(args, key, value)
        world = args.tensor_model_parallel_size * args.pipeline_model_parallel_size * args.data_parallel_size
        by_world.setdefault(world, {})[name] = args
    out_dir.mkdir(parents=True, exist_ok=True)
    for world, members in sorted(by_world.items()):
        run_ranks(_rank, world, members, out_dir, where=f"world size {world}")


if __name__ == "__main__":
    prepare_forks()
    main(Path(sys.argv[1]), json.loads(sys.argv[2]), Path(sys.argv[3]))
