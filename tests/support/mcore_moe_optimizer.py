"""Run as a script: a tiny MoE training checkpoint whose optimizer state megatron-core itself laid out.

argv: ROOT TP PP EP FORM (``fp32``/``bf16``: the plain optimizer; ``distributed``: ``distrib_optim.pt``). Beside
ROOT, ``ROOT.positions.json``: megatron-core's parameter name at every position, per rank file.

The model weights are the MoE fixture's (``support.tiny_models.MOE`` in float32: sequential experts, shared
experts with a gate, router expert bias, MoE layer frequency [1, 0, 1, 1]) written per rank by
``megatron_fixtures``. Then, per rank, megatron-core 0.16.1 builds its own GPTModel (local spec, fake
process groups, ``support.mcore_gpt_models.build_model``) and loads them, and its ``_get_param_groups``
groups the parameters (a one-process gloo world, since it all-gathers the group keys). As
``get_megatron_optimizer`` does, the groups with ``is_expert_parallel`` form a second optimizer (a list of
two state dicts, ``ChainedOptimizer.state_dict``). Each optimizer is torch's AdamW, what
megatron-core's FP32Optimizer wraps without Apex or Transformer Engine; it takes two steps on
gradients that are a fixed function of each parameter's value (so the replicas of a parameter on
several ranks stay equal).

``distributed``: each chunk's parameters are placed by megatron-core's own ``_ParamAndGradBuffer``
(distributed-optimizer padding, one bucket; dense and expert-parallel parameters in separate buffers
as DDP allocates them), and the state is written as ``get_parameter_state_dp_zero`` coalesces it: a
list ``[dense, expert]`` where megatron-core chains two, with None for the dense state on
expert-parallel ranks other than 0 (``ChainedOptimizer.save_parameter_state``: not its DP rank 0).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any

if __name__ == "__main__":  # run as a script: `support` is found from tests/
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch


def _grads(model: torch.nn.Module) -> None:
    for param in model.parameters():
        param.grad = torch.cos(param.detach() * 7.0) * 0.01 + 0.001


def param_and_grad_buffer(model: torch.nn.Module, expert: bool, group: Any) -> tuple[Any, list[Any]] | None:
    """megatron-core's ``_ParamAndGradBuffer`` (distributed optimizer, no bucket size) over the dense (or
    expert-parallel) parameters of ``model``, and those parameters; None where there are none."""
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.distributed.param_and_grad_buffer import _ParamAndGradBuffer
    from megatron.core.process_groups_config import ProcessGroupCollection

    params = [p for p in model.parameters() if (not getattr(p, "allreduce", True)) == expert]
    if not params:
        return None
    collection = ProcessGroupCollection()
    collection.tp, collection.dp_cp = group, group
    names = {p: n for n, p in model.named_parameters()}
    buffer = _ParamAndGradBuffer(DistributedDataParallelConfig(use_distributed_optimizer=True), torch.float32,
                                 torch.float32, params, group, None, names, 1.0, list(range(len(params))), False,
                                 collection)
    return buffer, params


def _buffer_ranges(model: torch.nn.Module, expert: bool, group: Any) -> list[dict[str, Any]]:
    """megatron-core's ``_ParamAndGradBuffer`` for the dense (or expert-parallel) parameters: per
    parameter its (start, end) in the buffer, and the unpadded size."""
    made = param_and_grad_buffer(model, expert, group)
    if made is None:
        return []
    buffer, params = made
    assert len(buffer.buckets) == 1
    return [{"numel": buffer.numel_unpadded,
             "ranges": {p: buffer.param_index_map[p][:2] for p in params}}]


def _flat_state(optimizer: torch.optim.Optimizer, ranges: list[dict[str, Any]]) -> dict[Any, Any]:
    content: dict[Any, Any] = {"buckets_coalesced": True}
    for index, buffer in enumerate(ranges):
        tensors = {key: torch.zeros(buffer["numel"]) for key in ("param", "exp_avg", "exp_avg_sq")}
        for param, (start, end) in buffer["ranges"].items():
            tensors["param"][start:end] = param.detach().reshape(-1)
            for key in ("exp_avg", "exp_avg_sq"):
                tensors[key][start:end] = optimizer.state[param][key].reshape(-1)
        content[index] = {(torch.float32, torch.float32): dict(tensors, numel_unpadded=buffer["numel"])}
    return content


def _float16_entry(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """``Float16OptimizerWithFloat16Params.state_dict`` (bf16: no grad scaler): the fp32 masters the
    optimizer stepped, per group in params order; the model keeps their bf16 rounding."""
    masters = [[p.detach().clone() for p in group["params"]] for group in optimizer.param_groups]
    return {"optimizer": optimizer.state_dict(), "fp32_from_fp16_params": masters}


def _distributed_entry(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """``DistributedOptimizer.state_dict``: the param groups without params, with the step."""
    inner = optimizer.state_dict()
    step = {float(s["step"]) for s in inner["state"].values()}.pop()
    groups = [dict({k: v for k, v in g.items() if k != "params"}, step=step) for g in inner["param_groups"]]
    return {"optimizer": {"param_groups": groups}, "param_state_sharding_type": "dp_reshardable"}


def two_steps(model: torch.nn.Module, config: Any) -> tuple[list[list[list[str]]], list[torch.optim.Optimizer]]:
    """megatron-core's ``_get_param_groups`` of ``model`` under ``config`` split into the dense and the
    expert-parallel optimizer (``get_megatron_optimizer``'s chain), each torch's AdamW, and two steps on ``_grads``:
    the parameter names per optimizer, group and position, and the optimizers."""
    from megatron.core.optimizer import _get_param_groups

    groups = _get_param_groups([model], config, None)
    chained = [[g for g in groups if not g["is_expert_parallel"]], [g for g in groups if g["is_expert_parallel"]]]
    chained = [groups for groups in chained if groups]
    names = {id(p): n for n, p in model.named_parameters()}
    positions = [[[names[id(p)] for p in g["params"]] for g in groups] for groups in chained]
    optimizers = [torch.optim.AdamW(g, lr=1e-3, weight_decay=0.1) for g in chained]
    for _ in range(2):
        _grads(model)
        for optimizer in optimizers:
            optimizer.step()
    return positions, optimizers


def _train_rank(path: Path, coords: tuple[int, int, int], sizes: tuple[int, int, int], form: str,
                group: Any) -> list[list[list[str]]]:
    """Train one rank and rewrite its files; returns megatron-core's parameter names per optimizer, group
    and position."""
    import support.mcore_helpers as mcore
    from megatron.core.optimizer import OptimizerConfig
    from support.megatron_fixtures import load_for_test
    from support.mcore_gpt_models import build_model, match_fixture_dtypes

    from support.tiny_models import MOE

    payload = load_for_test(path)
    model = build_model(dataclasses.replace(MOE, dtype=torch.float32), *sizes, *coords)
    match_fixture_dtypes(model, payload["model"])
    with mcore.fake_group_queries():
        model.load_state_dict(payload["model"], strict=True)
    positions, optimizers = two_steps(model, OptimizerConfig(optimizer="adam", lr=1e-3, min_lr=1e-4, weight_decay=0.1))
    payload["model"] = {k: v for k, v in model.state_dict().items() if k in payload["model"]}
    payload["iteration"] = 2
    payload["args"].use_distributed_optimizer = form == "distributed"
    if form == "fp32":
        states = [optimizer.state_dict() for optimizer in optimizers]
    elif form == "bf16":
        states = [_float16_entry(optimizer) for optimizer in optimizers]
        parameters = {name for name, _ in model.named_parameters()}
        payload["model"] = {k: v.to(torch.bfloat16) if k in parameters else v for k, v in payload["model"].items()}
    else:
        states = [_distributed_entry(optimizer) for optimizer in optimizers]
        flats = [_flat_state(optimizer, _buffer_ranges(model, index == 1, group))
                 for index, optimizer in enumerate(optimizers)]
        if len(flats) > 1 and coords[2] > 0:
            flats[0] = None
        torch.save(flats[0] if len(flats) == 1 else flats, path.parent / "distrib_optim.pt")
    payload["optimizer"] = states[0] if len(states) == 1 else states
    torch.save(payload, path)
    return positions


def main(root: Path, tp: int, pp: int, ep: int, form: str) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    warnings.simplefilter("ignore")
    from support.tiny_models import MOE
    from support.megatron_fixtures import make_full_model, write_megatron_checkpoint

    from pgconvert.formats.megatron import rank_dir_name

    # One intra-op thread, so every rank's step is computed the same way whatever the machine's load: under
    # a loaded CI run this script twice gave the dense parameters' copies on two EP ranks (which megatron-core
    # keeps equal) different values; the cause was not isolated, and work split over threads is the one
    # input that differs between two ranks' identical steps.
    torch.set_num_threads(1)
    model = dataclasses.replace(MOE, dtype=torch.float32)
    write_megatron_checkpoint(root, model, make_full_model(model, seed=5), tp, pp, ep=ep, iteration=2)
    torch.cuda.current_device = lambda: torch.device("cpu")  # type: ignore[assignment]
    with tempfile.TemporaryDirectory() as tmp:
        torch.distributed.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=0, world_size=1)
        try:
            group = torch.distributed.new_group([0], backend="gloo")
            positions = {}
            for tp_rank, pp_rank, ep_rank in itertools.product(range(tp), range(pp), range(ep)):
                name = rank_dir_name(tp_rank, pp_rank, ep_rank, pp, ep)
                positions[name] = _train_rank(root / "iter_0000002" / name / "model_optim_rng.pt",
                                              (tp_rank, pp_rank, ep_rank), (tp, pp, ep), form, group)
        finally:
            torch.distributed.destroy_process_group()
    # Beside the checkpoint: megatron-core's parameter names per rank, optimizer, group and position.
    (root.parent / f"{root.name}.positions.json").write_text(json.dumps(positions))


if __name__ == "__main__":
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    main(Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
