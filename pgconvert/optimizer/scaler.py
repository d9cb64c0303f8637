"""The grad scaler's state carried with the optimizer (fp16 runs, or a constant ``--loss-scale``).

megatron-core 0.16.1 (optimizer/optimizer.py ``Float16OptimizerWithFloat16Params.state_dict``,
optimizer/distrib_optimizer.py ``DistributedOptimizer.state_dict``) puts ``grad_scaler`` beside
``optimizer`` whenever the optimizer has a scaler: ``DynamicGradScaler.state_dict`` =
``{scale, growth_tracker, hysteresis_tracker}``, ``ConstantGradScaler``'s ``{}``. Where it lies:

- per-rank ``model_optim_rng.pt``: ``optimizer.grad_scaler`` (a list entry each when chained);
- torch_dist, ``fully_reshardable``: ``DistributedOptimizer.sharded_state_dict`` keeps ``state_dict()``'s
  plain values, so ``dist_checkpointing`` saves them as common state: ``common.pt``'s
  ``optimizer.grad_scaler`` (``optimizer = {0: ..., 1: ...}`` chained);
- torch_dist, ``dp_reshardable``: each ``state_dict()`` value becomes the ShardedObject
  ``optimizer.distributed.dp_group_idx_<g>.grad_scaler`` (stored ``<key>/shard_0_1``) per model-parallel
  rank ``g`` (``chained_<i>.``-prefixed per chained optimizer, as every dp_reshardable object).

The formats' readers and writers put it there; this module keeps the format-neutral part: one scaler
per chained optimizer, and which one each of a target's optimizers gets. A target with fewer chained
optimizers than the source (expert parallel size > 1 -> 1) keeps the dense optimizer's scaler; when the expert optimizer's differs it cannot be carried: named, refused under --strict.
"""

from __future__ import annotations

from typing import Any

import torch

from pgconvert.io.limits import quote

GRAD_SCALER = "grad_scaler"


def held_scalers(entries: list[Any]) -> list[Any]:
    """Per chained optimizer entry, its ``grad_scaler`` (None: it has none)."""
    return [entry.get(GRAD_SCALER) if isinstance(entry, dict) else None for entry in entries]


def _same(first: Any, second: Any) -> bool:
    if isinstance(first, torch.Tensor) or isinstance(second, torch.Tensor):
        return isinstance(first, torch.Tensor) and isinstance(second, torch.Tensor) and torch.equal(first, second)
    if isinstance(first, dict) and isinstance(second, dict):
        return first.keys() == second.keys() and all(_same(first[key], second[key]) for key in first)
    return bool(first == second)


def target_scalers(source: Any, count: int) -> list[Any]:
    """The grad scaler of each of a target's ``count`` chained optimizers: the source's own at that index,
    else its dense (first) optimizer's."""
    held = list(getattr(source, "grad_scalers", None) or [None])
    return [held[min(index, len(held) - 1)] for index in range(count)]


def lost_scaler(source: Any, count: int) -> str | None:
    """Why part of the source's grad scaler state is not carried into ``count`` chained optimizers (None: all is)."""
    held = list(getattr(source, "grad_scalers", None) or [])
    kept = target_scalers(source, count)
    for index, scaler in enumerate(held[count:], start=count):
        if scaler is not None and not _same(scaler, kept[-1]):
            return (f"grad_scaler of chained optimizer {index} ({quote(_describe(scaler), 160)}) differs from "
                    f"optimizer {count - 1}'s ({quote(_describe(kept[-1]), 160)}), which the target's {count} "
                    "optimizer(s) keep; it is not carried")
    return None


def _describe(scaler: Any) -> Any:
    if isinstance(scaler, dict):
        return {key: value.tolist() if isinstance(value, torch.Tensor) else value for key, value in scaler.items()}
    return scaler


def set_scalers(entries: list[dict[str, Any]], scalers: list[Any]) -> None:
    """Each entry's ``grad_scaler`` := its target scaler (removed where there is none)."""
    for entry, scaler in zip(entries, scalers):
        if scaler is None:
            entry.pop(GRAD_SCALER, None)
        else:
            entry[GRAD_SCALER] = scaler
