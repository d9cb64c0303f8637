"""Test-only: one rank of a megatron-core job that saves or loads a hybrid (Mamba) model's torch_dist checkpoint.

Run inside ``support.mcore_torch_dist_job``'s child job (its gloo group, its CPU shims), with megatron-core 0.16.1's
own MambaModel built by ``support.mcore_mamba`` for the rank:

- ``hybrid_save``: each rank loads its rank file of a per-rank checkpoint (``source``, ``strict=True``) and
  ``dist_checkpointing.save`` writes the model's ``sharded_state_dict()`` with that file's args as the common state
  (the world is the layout's ranks: TP rank fastest, then EP, then PP; with EP the dense tensors are
  data-parallel over the expert ranks).
- ``hybrid_load``: for each case (``name``, ``ckpt``, ``tp``, ``pp``, optional ``ep``), each rank builds the case's
  rank ``rank % (tp·ep·pp)`` (the others are data-parallel replicas) from the checkpoint's own args, loads the model's
  ``sharded_state_dict()`` with ``strict="raise_all"`` (the checkpoint holds exactly the keys the model asks for),
  then ``load_state_dict(strict=True)``, and the first replica saves what the model holds as
  ``<name>_rank_<tp>_<pp>.pt`` (``<name>_rank_<tp>_<pp>_<ep>.pt`` with EP) in the job's ``out``.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch
from megatron.core import dist_checkpointing

import support.mcore_helpers as mcore
from support.mcore_gpt_models import CONTENT_METADATA
from support.mcore_mamba import build_mamba_model, mamba_sharded_state_dict

ITERATION = 100


def run_hybrid_rank(rank: int, world: int, spec: dict[str, Any]) -> None:
    if spec["action"] == "hybrid_save":
        _save(rank, spec)
        return
    for case in spec["cases"]:
        _load(rank, world, case, Path(spec["out"]))


def _save(rank: int, spec: dict[str, Any]) -> None:
    source = mcore.rank_files(Path(spec["source"]))[rank]
    model = build_mamba_model(source.args, source.layout)
    with mcore.fake_group_queries():
        model.load_state_dict(source.model, strict=True)
    sharded = mamba_sharded_state_dict(model, source.layout.ep, source.layout.ep_rank)
    state = {"args": source.args, "checkpoint_version": 3.0, "iteration": ITERATION, "model": sharded}
    dist_checkpointing.save(state, spec["ckpt"], content_metadata=dict(CONTENT_METADATA))


def _load(rank: int, world: int, case: dict[str, Any], out: Path) -> None:
    tp, pp, ep = case["tp"], case["pp"], case.get("ep", 1)
    ranks = tp * pp * ep
    tp_rank, ep_rank, pp_rank = rank % tp, (rank // tp) % ep, (rank % ranks) // (tp * ep)
    args = copy.copy(dist_checkpointing.load_common_state_dict(case["ckpt"])["args"])
    args.tensor_model_parallel_size, args.pipeline_model_parallel_size = tp, pp
    if getattr(args, "num_experts", None):
        args.expert_model_parallel_size, args.expert_tensor_parallel_size = ep, tp
    model = build_mamba_model(args, mcore.RankLayout(tp, pp, tp_rank, pp_rank, ep=ep, ep_rank=ep_rank))
    replicas = world // ranks
    sharded = mamba_sharded_state_dict(model, replicas * ep, (rank // ranks) * ep + ep_rank)
    loaded = dist_checkpointing.load({"model": sharded}, case["ckpt"], strict="raise_all")
    with mcore.fake_group_queries():
        model.load_state_dict(loaded["model"], strict=True)
    if rank < ranks:
        tensors = {name: value for name, value in model.state_dict().items() if not name.endswith("._extra_state")}
        suffix = f"_{ep_rank}" if "ep" in case else ""
        torch.save(tensors, out / f"{case['name']}_rank_{tp_rank}_{pp_rank}{suffix}.pt")
