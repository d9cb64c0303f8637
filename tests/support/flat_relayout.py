"""A per-rank distributed-optimizer checkpoint moved to the flat-buffer layout other run settings give (DDP buckets),
parameter by parameter, for tests of settings no golden was trained with."""

from __future__ import annotations

import copy
import shutil
from pathlib import Path
from typing import Any

import torch

from support.megatron_fixtures import load_for_test
from pgconvert.formats.megatron import config_from_args, layout_from_args
from pgconvert.model.grid import iter_ranks
from pgconvert.optimizer.flat import flat_buffers
from pgconvert.optimizer.order import OptimizerRules
from pgconvert.savers.megatron import save_durably


def relayout(src: Path, dst: Path, overrides: dict[str, Any]) -> None:
    """``src`` (a per-rank distributed-optimizer checkpoint) with ``overrides`` in every rank's args and
    each ``distrib_optim.pt`` moved, parameter by parameter, to the flat layout those args give."""
    shutil.copytree(src, dst)
    for path in sorted((dst / "iter_0000002").glob("mp_rank_*/model_optim_rng.pt")):
        state = dict(load_for_test(path))
        old = state["args"]
        new = copy.copy(old)
        for key, value in overrides.items():
            setattr(new, key, value)
        config, layout = config_from_args(old, path, "local", None), layout_from_args(old, path)
        coord = next(c for c in iter_ranks(layout) if path.parent.name == f"mp_rank_{c.tp:02d}")
        rules = OptimizerRules.from_args(old, str(path))
        before, after = (flat_buffers(config, layout, coord, rules, old.padded_vocab_size, args, old.data_parallel_size)
                         for args in (old, new))
        flat = torch.load(path.parent / "distrib_optim.pt", weights_only=True)
        for index, ((old_placed, _), (new_placed, numel)) in enumerate(zip(before, after)):
            ((dtype, tensors),) = flat[index].items()
            moved: dict[str, Any] = {key: torch.zeros(numel) for key in ("param", "exp_avg", "exp_avg_sq")}
            ranges = {item.slot.position: (item.start, item.end) for item in old_placed}
            for item in new_placed:
                start, end = ranges[item.slot.position]
                for key in moved:
                    moved[key][item.start:item.end] = tensors[key][start:end]
            flat[index] = {dtype: dict(moved, numel_unpadded=numel)}
        torch.save(flat, path.parent / "distrib_optim.pt")
        state["args"] = new
        save_durably(state, path)
