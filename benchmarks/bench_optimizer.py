"""The optimizer-state cases of ``bench_convert.py``: a synthetic Megatron-LM run with the
distributed optimizer (bf16 weights, fp32 main params and Adam moments, grads reduced in fp32),
written by pgconvert's own writers in the layouts Megatron-LM writes.

- ``opt_tp2``: per-rank TP2 checkpoint written by the megatron saver with the optimizer state in its save
  options (``SaveOptions.optimizer``: each rank file's param groups and ``distrib_optim.pt`` beside it, as a
  per-rank conversion writes them), from seeded state: every fp32 master is its bf16 weight (as megatron-core keeps
  them), the moments are seeded draws;
- ``opt_td_dp``: the same converted by pgconvert to torch_dist at TP2 with ``--dst-optim-form
  dp_reshardable`` (Megatron-LM's default torch_dist form).
"""

from __future__ import annotations

import argparse
import math
import shutil
import subprocess
import sys
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from pgconvert.model.config import ModelConfig
from pgconvert.formats import OptimizerInModelFiles, OptimizerOptions, SaveOptions
from pgconvert.formats.megatron import iteration_dir_name
from pgconvert.model.grid import RankCoord
from pgconvert.model.layout import ParallelLayout
from pgconvert.optimizer.order import OptimizerRules, optimizer_slots
from pgconvert.optimizer.source import FORM_DISTRIBUTED
from pgconvert.formats.registry import get_saver

OPTIM_SCALE = 0.07  # 83 M parameters: 1.0 GB of fp32 optimizer state (param, exp_avg, exp_avg_sq)
ITERATION = 100
STEP = 100.0
OPTIM_CASES = (
    "opt TP2 -> TP1", "opt TP2 -> TP1 skip",
    "opt TP2 -> torch_dist", "opt TP2 -> torch_dist skip",
    "opt torch_dist(dp) -> TP1", "opt torch_dist(dp) -> TP1 skip",
)


@dataclass
class _First:
    path: Path
    extra: dict[str, Any] = field(default_factory=dict)


def _run_args() -> argparse.Namespace:
    """What the source's run recorded beyond the model (megatron-core's defaults for a bf16 run)."""
    return argparse.Namespace(use_distributed_optimizer=True, accumulate_allreduce_grads_in_fp32=True,
                              overlap_grad_reduce=False, optimizer="adam", lr=3e-4, min_lr=3e-5, weight_decay=0.1,
                              adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8, clip_grad=1.0)


class SeededOptimizer:
    """The distributed optimizer's state of a ``SeededSource`` model, made per piece when written."""

    form = FORM_DISTRIBUTED
    dtype_key = (torch.bfloat16, torch.float32)

    def __init__(self, model: Any, config: ModelConfig, args: argparse.Namespace, path: Path) -> None:
        self.model = model
        self.config = config
        self.rules = OptimizerRules()
        slots = optimizer_slots(config, ParallelLayout(tp=1), RankCoord(0, 0, 0), self.rules, model.vocab_rows)
        self._rules = {slot.spec.canonical: slot.spec.rule for group in slots for slot in group}
        groups = [dict(self._group(number), step=STEP) for number in range(2)]
        self.first = _First(path, {"args": args, "iteration": ITERATION,
                                   "distributed_entries": [{"optimizer": {"param_groups": groups}}]})

    @staticmethod
    def _group(number: int) -> dict[str, Any]:
        return {"lr": 3e-4, "min_lr": 3e-5, "max_lr": 3e-4, "weight_decay": 0.1 if number == 0 else 0.0,
                "wd_mult": 1.0 if number == 0 else 0.0, "lr_mult": 1.0, "is_expert_parallel": False,
                "is_decoupled_lr": False, "betas": (0.9, 0.95), "eps": 1e-8, "amsgrad": False}

    def param_group_settings(self, optimizer: int = 0, count: int | None = None,
                             member: Any = None) -> list[dict[str, Any]]:
        """A dense Adam run's two groups (``member``: a target's chained optimizer, the dense one here)."""
        settings = [self._group(number) for number in range(2)]
        return settings if count is None else settings[:count]

    def _whole(self, name: str, key: str) -> torch.Tensor:
        model = self.model.load(name)
        if key == "param":
            return model.float()
        generator = torch.Generator().manual_seed(zlib.crc32(f"{name}.{key}".encode()))
        draw = torch.randn(model.shape, generator=generator) * 1e-3
        return draw.square() if key == "exp_avg_sq" else draw

    def piece(self, name: str, key: str, size: int, rank: int, rows: int | None,
              target: Any = None) -> torch.Tensor:
        # the whole tensor is held here, so the target's rule (when given) cuts it directly
        rule = target or self._rules[name]
        whole = self._whole(name, key)
        if rule.fits_rows and rows is not None:
            return rule.reshard_rows([whole], rows, self.config.vocab_size, size, rank)
        return rule.reshard([whole], size, rank)


def optimizer_sources(workdir: Path, scale: float, make_config: Any, model_class: Any) -> tuple[Path, Path, int]:
    """The per-rank TP2 source and its torch_dist dp_reshardable copy (made once), and the largest fp32
    state tensor."""
    config = make_config(scale)
    per_rank, torch_dist = workdir / "opt_tp2", workdir / "opt_td_dp"
    model = model_class(config)
    largest = max(4 * math.prod(model.meta(name).shape) for name in model.names())
    if not per_rank.exists():
        _write_per_rank(config, model, per_rank)
    if not torch_dist.exists():
        subprocess.run([sys.executable, "-m", "pgconvert", "--quiet", "--dst-format", "torch_dist", "--dst-tp", "2",
                        "--dst-optim-form", "dp_reshardable", str(per_rank), str(torch_dist)], check=True,
                       stdout=subprocess.DEVNULL)
    return per_rank, torch_dist, largest


def _write_per_rank(config: ModelConfig, model: Any, path: Path) -> None:
    layout = ParallelLayout(tp=2)
    staging = path.with_name(path.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    model.iteration = ITERATION
    model.megatron_args = _run_args()
    optimizer = SeededOptimizer(model, config, model.megatron_args, staging / iteration_dir_name(ITERATION, False))
    carried = OptimizerInModelFiles(optimizer, FORM_DISTRIBUTED, OptimizerOptions())  # type: ignore[arg-type]
    get_saver("megatron").save(model, staging, SaveOptions(layout=layout, optimizer=carried), lambda nbytes: None)
    staging.rename(path)


def optimizer_plan(workdir: Path) -> list[tuple[str, list[str], Path, int]]:
    """(name, pgconvert args, destination, workers) of the optimizer cases."""
    per_rank, torch_dist = str(workdir / "opt_tp2"), str(workdir / "opt_td_dp")
    plan = [
        ("opt TP2 -> TP1", ["--dst-tp", "1", per_rank], workdir / "opt_tp1", 1),
        ("opt TP2 -> torch_dist", ["--dst-format", "torch_dist", "--dst-tp", "1",
                                   "--dst-optim-form", "fully_reshardable", per_rank], workdir / "opt_td_fr", 1),
        ("opt torch_dist(dp) -> TP1", ["--dst-format", "megatron", "--dst-tp", "1", torch_dist],
         workdir / "opt_td_tp1", 1),
    ]
    skipped = [(f"{name} skip", [*args[:-1], "--skip-optimizer", args[-1]], dst.with_name(dst.name + "_skip"), 1)
               for name, args, dst, _ in plan]
    for name, args, _, _ in skipped:
        if "--dst-optim-form" in args:  # refused with --skip-optimizer
            index = args.index("--dst-optim-form")
            del args[index:index + 2]
    return [case for pair in zip(plan, skipped) for case in pair]
