"""``--dst-dp N`` (optmoe): the data-parallel size a Megatron per-rank destination is written for.

Megatron-LM's per-rank format (``ckpt_format=torch``) has no per-DP-rank optimizer files: with
``--use-distributed-optimizer`` each model-parallel rank directory holds one ``distrib_optim.pt``, which
``DistributedOptimizer.save_parameter_state`` writes on DP rank 0 after gathering every DP rank's shard
(``get_parameter_state_dp_zero``), and which DP rank 0 reads back and scatters to the N ranks of the
resuming job (``load_parameter_state_from_dp_zero``: each bucket's unpadded range cut from the
coalesced buffer and padded to the new DP multiple). Offsets inside a DDP bucket do not depend on DP
(buckets: only the default bucket size grows with DP beyond 40, and the writer sizes the target's
buckets at N), so the file is the same for any DP size and N changes only ``args``: ``data_parallel_size`` and
``world_size`` (tp * pp * cp * N). N must fit Megatron's expert grid: tp * cp * N a multiple of
expert_tp * ep.

dprw: a torch_dist destination takes N too: its args, and the DP shards its ``dp_reshardable`` records
are cut in (``optimizer_torch_dist_dp``).
"""

from __future__ import annotations

import argparse
import copy
from typing import Any

from pgconvert.errors import ValidationError
from pgconvert.model.layout import ParallelLayout


def check_dst_dp(dp: int, layout: ParallelLayout, args: argparse.Namespace | None, skip_optimizer: bool,
                 dst_format: str) -> None:
    """Refuse an N that Megatron's grid cannot run at ``layout``, or a conversion it does not apply to."""
    if dst_format not in ("megatron", "torch_dist"):  # dprw: torch_dist's dp_reshardable records are per DP shard
        raise ValidationError(f"--dst-dp {dp}: applies to a Megatron per-rank destination, not {dst_format} "
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
    """A copy of a rank file's ``args`` recording a job of ``dp`` data-parallel ranks at ``layout``."""
    if not isinstance(args, argparse.Namespace):
        return args
    updated = copy.copy(args)
    cp = int(getattr(args, "context_parallel_size", None) or 1)
    updated.data_parallel_size = dp
    updated.world_size = layout.tp * layout.pp * cp * dp
    return updated
