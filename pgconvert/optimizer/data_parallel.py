"""The data-parallel sizes of megatron-core's optimizer state: the source's, the one ``--dst-dp N`` writes
a destination for, and each chained optimizer's.

Megatron-LM's per-rank format (``ckpt_format=torch``) has no per-DP-rank optimizer files: with
``--use-distributed-optimizer`` each model-parallel rank directory holds one ``distrib_optim.pt``, which
``DistributedOptimizer.save_parameter_state`` writes on DP rank 0 after gathering every DP rank's shard
(``get_parameter_state_dp_zero``), and which DP rank 0 reads back and scatters to the N ranks of the
resuming job (``load_parameter_state_from_dp_zero``: each bucket's unpadded range cut from the
coalesced buffer and padded to the new DP multiple). Offsets inside a DDP bucket do not depend on DP
(buckets: only the default bucket size grows with DP beyond 40, and the writer sizes the target's
buckets at N), so the file is the same for any DP size and N changes only ``args``: ``data_parallel_size`` and
``world_size`` (tp * pp * cp * N). N must fit Megatron's expert grid: tp * cp * N a multiple of
expert_tp * ep. A torch_dist destination takes N too: its args, and the DP shards its ``dp_reshardable``
records are cut in.
"""

from __future__ import annotations

import argparse
import copy
from typing import TYPE_CHECKING, Any

from pgconvert.errors import ValidationError
from pgconvert.formats.megatron_args import megatron_data_parallel_size
from pgconvert.model.config import ModelConfig
from pgconvert.model.grid import RankCoord
from pgconvert.model.layout import ParallelLayout
from pgconvert.optimizer.order import OptimizerRules, UnsupportedOptimizerError, chain

if TYPE_CHECKING:
    from pgconvert.formats import Saver


def dp_size(args: argparse.Namespace | None) -> int:
    """The data-parallel size a checkpoint's ``args`` record, else what Megatron-LM derives from its
    ``world_size`` (1 when they do not say)."""
    return megatron_data_parallel_size(args)


def check_dst_dp(dp: int, layout: ParallelLayout, args: argparse.Namespace | None, skip_optimizer: bool,
                 saver: Saver) -> None:
    """Refuse an N that Megatron's grid cannot run at ``layout``, or a conversion it does not apply to (a
    destination that writes no optimizer state)."""
    if not saver.writes_optimizer:
        raise ValidationError(f"--dst-dp {dp}: applies to a Megatron per-rank destination, not {saver.name} "
                              "(torch_dist too: the data-parallel size its dp_reshardable records are cut for)")
    if skip_optimizer:
        raise ValidationError(f"--dst-dp {dp}: sizes the carried optimizer state; drop --skip-optimizer or --dst-dp")
    if dp < 1:
        raise ValidationError(f"--dst-dp {dp}: must be at least 1")
    cp = int(getattr(args, "context_parallel_size", None) or 1)
    expert_ranks = layout.expert_tp_size * layout.ep
    if (layout.tp * cp * dp) % expert_ranks:
        raise ValidationError(
            f"--dst-dp {dp}: tp*cp*dp = {layout.tp}*{cp}*{dp} is not a multiple of expert_tp*ep = "
            f"{layout.expert_tp_size}*{layout.ep} (Megatron's expert-parallel grid divides the same ranks)")


def with_dst_dp(args: Any, layout: ParallelLayout, dp: int) -> Any:
    """A copy of a checkpoint's ``args`` recording a job of ``dp`` data-parallel ranks at ``layout``."""
    if not isinstance(args, argparse.Namespace):
        return args
    updated = copy.copy(args)
    cp = int(getattr(args, "context_parallel_size", None) or 1)
    updated.data_parallel_size = dp
    updated.world_size = layout.tp * layout.pp * cp * dp
    return updated


def optimizer_ranks(config: ModelConfig, layout: ParallelLayout, optimizer: int,
                    rules: OptimizerRules = OptimizerRules()) -> list[RankCoord]:
    """The ranks whose state chained optimizer ``optimizer`` keeps apart, in megatron-core's model-parallel order:
    dense, one per TP x PP (its parameters are the same on every EP rank); expert, one per expert TP x EP x PP (with an
    expert tensor-parallel size other than TP, each named by its ``etp`` rank). ``rules``: which is the expert one."""
    if not chain(config, layout, rules)[optimizer].expert:
        return [RankCoord(tp=tp, pp=pp) for pp in range(layout.pp) for tp in range(layout.tp)]
    if layout.expert_tp_size == layout.tp:
        return [RankCoord(tp=tp, pp=pp, ep=ep) for pp in range(layout.pp) for ep in range(layout.ep)
                for tp in range(layout.tp)]
    return [RankCoord(tp=0, pp=pp, ep=ep, etp=etp) for pp in range(layout.pp) for ep in range(layout.ep)
            for etp in range(layout.expert_tp_size)]


def optimizer_dp(config: ModelConfig, layout: ParallelLayout, dp: int, args: Any, optimizer: int, where: str,
                 rules: OptimizerRules = OptimizerRules()) -> int:
    """The data-parallel size that chained optimizer ``optimizer``'s buckets are padded and split by: ``dp * cp``
    (dense: megatron-core's ``intra_dp_cp`` group, which holds the context-parallel ranks too), or the expert
    data-parallel size ``tp * cp * dp / (expert_tp * ep)`` (``rules``: which is the expert one)."""
    cp = int(getattr(args, "context_parallel_size", None) or 1)
    if not chain(config, layout, rules)[optimizer].expert:
        return dp * cp
    ranks = layout.tp * cp * dp
    if ranks % (layout.expert_tp_size * layout.ep):
        raise UnsupportedOptimizerError(
            f"{where}: tp*cp*dp = {layout.tp}*{cp}*{dp} is not a multiple of expert_tp*ep = "
            f"{layout.expert_tp_size}*{layout.ep}: no expert data-parallel size")
    return ranks // (layout.expert_tp_size * layout.ep)
