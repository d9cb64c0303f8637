"""megatron-core's distributed optimizer flat buffers, per rank: where each parameter lies, the DDP buckets,
and the data-parallel shards a bucket is cut in.

``DistributedOptimizer`` keeps, per model chunk's DDP buffer, one flat fp32 tensor per field (the master
``param``, ``exp_avg``, ``exp_avg_sq``): the chunk's parameters in reverse ``named_parameters()`` order, each
start aligned to 64 elements, split in DDP buckets, each bucket padded to a multiple of the DP size. This
module derives that placement (``flat_buffers``), builds a buffer's tensors from per-parameter pieces when
they are written (``planned_buffers``), and cuts a bucket in its DP ranks' shards (``bucket_pieces``), for
every format that stores the flat buffers (``distrib_optim.pt``, torch_dist's ``dp_reshardable`` records).
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from pgconvert.io.torchzip import PlannedTensor
from pgconvert.model.config import ModelConfig
from pgconvert.model.grid import RankCoord
from pgconvert.model.layout import ParallelLayout
from pgconvert.io.limits import quote
from pgconvert.model.provider import OUTPUT_LAYER, WORD_EMBEDDINGS, TensorSpec
from pgconvert.optimizer.order import (MEGATRON_CORE_VERSIONS, OptimizerRules, OptimizerSlot,
                                       UnsupportedOptimizerError, named_parameters, optimizer_slots)

_VERSIONS = "megatron-core " + " / ".join(MEGATRON_CORE_VERSIONS)
# The fields of a flat buffer, each an fp32 tensor of the buffer's size.
FLAT_KEYS = ("param", "exp_avg", "exp_avg_sq")


@dataclass(frozen=True)
class FlatParam:
    """Where one parameter lies in a distributed optimizer's DP-gathered flat buffer (``distrib_optim.pt``):
    ``[start, end)`` in the coalesced buffer (every bucket's padding dropped); buckets: the DDP bucket that
    holds it and that bucket's start in the coalesced buffer (``start - bucket_start``: its offset in the
    bucket, i.e. in a dp_reshardable ``bucket_idx_<bucket>`` record). ``buffer``: the buffer's index
    among the rank's buffers (``distrib_optim.pt``'s key, dp_reshardable's ``gbuf_idx``), which skips a model
    chunk without parameters."""

    slot: OptimizerSlot
    start: int
    end: int
    bucket: int = 0
    bucket_start: int = 0
    buffer: int = 0


def bucket_ranges(placed: Sequence[FlatParam], numel: int) -> list[tuple[int, int]]:
    """Each bucket's ``[start, end)`` in the coalesced buffer of ``numel`` elements (every bucket holds a
    parameter, so each bucket's start is its first parameter's ``bucket_start``)."""
    starts = sorted({item.bucket: item.bucket_start for item in placed}.items())
    bounds = [start for _, start in starts] + [numel]
    return [(bounds[index], bounds[index + 1]) for index in range(len(starts))]


def _default_bucket_size(args: argparse.Namespace, dp: int) -> int:
    """DistributedDataParallel's default: ``max(40_000_000, 1_000_000 * dp)``: megatron-core 0.16.1 takes the
    data-parallel group without context parallelism, Megatron-LM d98e8a64 (0.20.0) the one with it."""
    cp = int(getattr(args, "context_parallel_size", None) or 1)
    size = max(40_000_000, 1_000_000 * dp)
    if cp > 1 and size != max(40_000_000, 1_000_000 * dp * cp):
        raise UnsupportedOptimizerError(
            f"args.ddp_bucket_size=None with data_parallel_size={dp} and context_parallel_size={cp}: the default "
            f"DDP bucket size is {size} in megatron-core 0.16.1 but {max(40_000_000, 1_000_000 * dp * cp)} in 0.20.0, "
            "and the checkpoint does not say which made it; pass --skip-optimizer")
    return size


def _bucket_size(args: argparse.Namespace | None, coord: RankCoord, chunk: int, dp: int,
                 rank_numel: int) -> int | None:
    """The DDP bucket size of model chunk ``chunk`` (None: one bucket). ``DistributedDataParallel.__init__``
    (megatron-core 0.16.1): None without ``overlap_grad_reduce`` and on pipeline stages after the first;
    Megatron-LM's ``get_model`` passes ``disable_bucketing`` for model chunks after the first and with
    ``overlap_param_gather_with_optimizer_step``; else ``ddp_bucket_size``, or with ``ddp_num_buckets`` the rank's
    parameter count (``rank_numel``: every model chunk's) over it (``get_model`` of the Megatron-LM that ships
    0.16.1, ``resolve_ddp_bucket_size`` in d98e8a64), or the default."""
    if args is None or not getattr(args, "overlap_grad_reduce", False):
        return None
    if coord.pp > 0 or chunk > 0 or getattr(args, "overlap_param_gather_with_optimizer_step", False):
        return None
    size = getattr(args, "ddp_bucket_size", None)
    buckets = getattr(args, "ddp_num_buckets", None)
    if buckets is not None:
        if size is not None or isinstance(buckets, bool) or not isinstance(buckets, int) or buckets < 1:
            raise UnsupportedOptimizerError(
                f"args.ddp_num_buckets={quote(buckets)} with ddp_bucket_size={quote(size)}: Megatron-LM takes a "
                "whole number of buckets >= 1 and no bucket size beside it")
        return rank_numel // buckets
    return int(size) if size is not None else _default_bucket_size(args, dp)


def _is_shared_embedding(config: ModelConfig, layout: ParallelLayout, spec: TensorSpec) -> bool:
    """megatron-core's ``shared_embedding`` flag (``LanguageModule.setup_embeddings_and_output_layer``): at
    pipeline size > 1 with tied embeddings (or multi-token prediction), the first stage's word embedding and
    the last stage's output weight (its copy), or with MTP the last stage's embedding copy; the distributed
    optimizer gives each its own bucket."""
    if layout.pp == 1 or not (config.tie_embeddings or config.mtp_num_layers):
        return False
    # With MTP the last stage's shared weight is its embedding copy (GPTModel.shared_embedding_or_output_weight:
    # pre_process or mtp_process), not its output layer.
    return spec.local_name == WORD_EMBEDDINGS or (spec.local_name == OUTPUT_LAYER and not config.mtp_num_layers)


def _place_chunk(slots: Sequence[OptimizerSlot], bucket_size: int | None,
                 shared: Callable[[OptimizerSlot], bool]) -> tuple[list[FlatParam], int]:
    """``_ParamAndGradBuffer.__init__`` for one buffer (megatron-core 0.16.1; ``_compute_per_buffer_param_layout``
    in 0.20.0): the parameters in reverse order, each starting at a multiple of 64; a bucket closes after
    the parameter that brings it to ``bucket_size`` elements, and before and after a shared embedding. Each
    bucket's end is padded (``lcm(dp, 128)``, a multiple of 64), so offsets inside a bucket do not depend on
    the DP size; the coalesced buffer drops that padding: ``(placed, unpadded size)``."""
    placed: list[FlatParam] = []
    offset, cursor, bucket, members = 0, 0, 0, 0
    for slot in reversed(slots):
        cursor = -(-cursor // 64) * 64
        own = shared(slot)
        if own and members:  # the bucket before ends at the (aligned) start of the shared embedding
            offset, cursor, bucket, members = offset + cursor, 0, bucket + 1, 0
        placed.append(FlatParam(slot, offset + cursor, offset + cursor + slot.spec.numel, bucket, offset))
        cursor += slot.spec.numel
        members += 1
        if own or (bucket_size is not None and cursor >= bucket_size):
            offset, cursor, bucket, members = offset + cursor, 0, bucket + 1, 0
    return placed, offset + cursor


def flat_buffers(config: ModelConfig, layout: ParallelLayout, coord: RankCoord, rules: OptimizerRules,
                 padded_vocab_size: int | None, args: argparse.Namespace | None = None,
                 dp: int = 1, optimizer: int = 0) -> list[tuple[list[FlatParam], int]]:
    """Per buffer (``distrib_optim.pt``'s buffer index, dp_reshardable's ``gbuf_idx``), its parameters' places
    in the coalesced buffer (``_place_chunk``; DDP buckets as ``_bucket_size`` sizes them) and the buffer's
    unpadded size. One buffer per model chunk that has parameters: megatron-core's DDP makes a buffer per
    dtype of a chunk's parameters, none for a chunk without (an empty virtual stage of a pipeline layout), and
    ``DistributedOptimizer`` numbers the buffers of all chunks in order (``itertools.chain`` of
    ``per_model_buffers``). ``optimizer``: the chained optimizer (``order.chain``), an expert one's the
    expert-parallel parameters' buffers (DDP's ``expert_parallel_buffers``)."""
    by_param = {(slot.chunk, slot.spec.local_name): slot
                for group in optimizer_slots(config, layout, coord, rules, padded_vocab_size) for slot in group}
    # The buffer follows the chunk's named_parameters() order (reversed), not the param groups'.
    named = [by_param[(chunk, spec.local_name)] for chunk, spec in
             named_parameters(config, layout, coord, padded_vocab_size)]
    rank_numel = sum(slot.spec.numel for slot in named)  # get_model's num_parameters, every chunk's
    buffers: list[tuple[list[FlatParam], int]] = []
    for chunk in range(layout.virtual_size):
        slots = [slot for slot in named if slot.chunk == chunk and slot.optimizer == optimizer]
        placed, numel = _place_chunk(slots, _bucket_size(args, coord, chunk, dp, rank_numel),
                                     lambda slot: _is_shared_embedding(config, layout, slot.spec))
        if placed:
            buffers.append(([replace(item, buffer=len(buffers)) for item in placed], numel))
    return buffers


def planned_buffers(placed: list[FlatParam], numel: int,
                    piece: Any) -> dict[str, PlannedTensor | int]:
    """One buffer's flat tensors, each built when written: zeros with every parameter's piece
    (``piece(slot, key)``) at its range; written part by part (the zero gaps and one parameter's piece at a
    time, never the whole buffer)."""
    def producer(key: str) -> Any:
        def produce() -> torch.Tensor:
            return torch.cat(list(parts(key)()))
        return produce

    def parts(key: str) -> Any:
        def produce_parts() -> Iterator[torch.Tensor]:
            cursor = 0
            for item in placed:
                if item.start > cursor:
                    yield torch.zeros(item.start - cursor, dtype=torch.float32)
                yield piece(item.slot, key).reshape(-1).to(torch.float32)
                cursor = item.end
            if numel > cursor:
                yield torch.zeros(numel - cursor, dtype=torch.float32)
        return produce_parts

    tensors: dict[str, PlannedTensor | int] = {
        key: PlannedTensor((numel,), torch.float32, producer(key), parts(key)) for key in FLAT_KEYS}
    tensors["numel_unpadded"] = numel
    return tensors


def bucket_divisor(dp: int, args: Any) -> int:
    """``pad_bucket_end``'s divisor (megatron/core/optimizer/param_layout.py, param_and_grad_buffer.py)."""
    if getattr(args, "ddp_pad_buckets_for_high_nccl_busbw", False):
        return math.lcm(dp, 128, 2 ** 16)
    return math.lcm(dp, 128)


def bucket_pieces(placed: list[FlatParam], numel: int, dp: int,
                  divisor: int) -> list[tuple[int, int, FlatParam | None]]:
    """``(start, end, parameter or None for a gap)`` of each stored chunk of one bucket: per DP rank's shard
    of the padded bucket, its parameters' parts and the gaps before them and before the shard's end, a gap
    only where it starts before ``numel`` (``sharded_param_state_dp_reshardable``)."""
    local = -(-numel // divisor) * divisor // dp
    pieces: list[tuple[int, int, FlatParam | None]] = []
    for rank in range(dp):
        low, high = rank * local, (rank + 1) * local
        inside = [(max(p.start, low), min(p.end, high), p) for p in placed if p.start < high and p.end > low]
        if not inside:
            raise UnsupportedOptimizerError(
                f"data-parallel rank {rank} of {dp} holds no parameter of a {numel}-element bucket: {_VERSIONS} "
                "cannot save that in the dp_reshardable form ('empty bucket encountered'); pass a smaller --dst-dp")
        cursor = low
        for start, end, param in [*inside, (high, high, None)]:
            if start != cursor and cursor < numel:
                pieces.append((cursor, start, None))
            if param is not None:
                pieces.append((start, end, param))
            cursor = end
    return pieces


def buffer_dtype_key(args: Any) -> tuple[torch.dtype, torch.dtype]:
    """A flat buffer's key: (model dtype, grad dtype), as the run's ``args`` say (Megatron-LM's defaults where they
    do not): DDP keys each buffer by its parameters' dtype and ``grad_reduce_in_fp32`` (Megatron-LM's
    ``accumulate_allreduce_grads_in_fp32``)."""
    param = torch.bfloat16 if getattr(args, "bf16", False) else \
        torch.float16 if getattr(args, "fp16", False) else torch.float32
    fp32_grads = getattr(args, "accumulate_allreduce_grads_in_fp32", False)
    return (param, torch.float32 if fp32_grads else param)
