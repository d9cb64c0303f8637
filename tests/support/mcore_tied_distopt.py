"""Run as a script: a per-rank distributed-optimizer checkpoint that megatron-core 0.16.1 itself writes,
for tied embeddings at pipeline size 2 (the shared embedding's own DDP bucket) with bucketing.

    python tests/support/mcore_tied_distopt.py TEMPLATE_ITERATION_DIR OVERRIDES_JSON OUT_ROOT

One gloo process per rank (tp * pp, DP 1). Each builds GPTModel + ``DistributedDataParallel`` +
``get_megatron_optimizer`` from the template checkpoint's args with OVERRIDES_JSON set
(``mcore_optimizer_step._build`` / ``_optimizer``): megatron-core initialises the weights, and
``setup_embeddings_and_output_layer`` all-reduces the last stage's output copy of the tied embedding
with the first stage's word embedding. Two ``optimizer.step()`` calls on gradients that are a fixed
function of each parameter's value (so both copies of the embedding take the same steps), then what
Megatron-LM's ``save_checkpoint`` writes per rank: ``model_optim_rng.pt`` (the template's other entries,
the model's and optimizer's ``state_dict()``, these args, iteration 2) and
``optimizer.save_parameter_state`` into ``distrib_optim.pt`` (with ``use_distributed_optimizer``; a plain optimizer's
state is all in ``model_optim_rng.pt``).
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


def _rank(rank: int, world: int, store: str, args: Any, template: dict[str, Any], out_root: Path) -> None:
    import support.mcore_cpu_shim as mcore_cpu_shim
    from megatron.core import parallel_state
    from support.mcore_optimizer_step import _build, _gpt, _optimizer

    from pgconvert.formats.megatron import FRAMEWORK_PICKLE

    mcore_cpu_shim.install()
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    torch.distributed.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    parallel_state.initialize_model_parallel(tp, pp)
    tp_rank, pp_rank = parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_pipeline_model_parallel_rank()
    torch.manual_seed(1234 + tp_rank)
    ddp = _build(args, pp_rank)
    optimizer = _optimizer(args, ddp)
    model = _gpt(ddp)
    for _ in range(2):
        for param in model.parameters():
            param.main_grad.copy_(torch.cos(param.detach().float() * 7.0) * 0.01 + 0.001)
        optimizer.step()
    directory = out_root / "iter_0000002" / (f"mp_rank_{tp_rank:02d}" + (f"_{pp_rank:03d}" if pp > 1 else ""))
    directory.mkdir(parents=True, exist_ok=True)
    state = dict(template, args=args, iteration=2, model=model.state_dict(), optimizer=optimizer.state_dict())
    torch.save(state, directory / "model_optim_rng.pt", pickle_module=FRAMEWORK_PICKLE)  # args' enum stand-ins
    if args.use_distributed_optimizer:  # a plain optimizer's state is all in model_optim_rng.pt
        optimizer.save_parameter_state(str(directory / "distrib_optim.pt"))
    torch.distributed.destroy_process_group()


def main(template_dir: Path, overrides: dict[str, Any], out_root: Path) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from support.megatron_fixtures import load_for_test

    importlib.import_module("megatron.core.optimizer")  # imported once, before the forks
    template = load_for_test(next(iter(sorted(template_dir.glob("mp_rank_*/model_optim_rng.pt")))))
    args = template.pop("args")
    for key in ("model", "optimizer", "rng_state"):
        template.pop(key, None)
    for key, value in overrides.items():
        setattr(args, key, value)
    world = args.tensor_model_parallel_size * args.pipeline_model_parallel_size
    args.data_parallel_size, args.world_size = 1, world
    args.transformer_pipeline_model_parallel_size = args.pipeline_model_parallel_size
    args.expert_tensor_parallel_size = args.tensor_model_parallel_size
    out_root.mkdir(parents=True)
    (out_root / "latest_checkpointed_iteration.txt").write_text("2")
    run_ranks(_rank, world, args, template, out_root)


if __name__ == "__main__":
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    main(Path(sys.argv[1]), json.loads(sys.argv[2]), Path(sys.argv[3]))
