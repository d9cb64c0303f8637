"""megatron-core's ``fully_sharded_model_space`` optimizer records, as torch_dist stores them, read.

``DistributedOptimizer.sharded_param_state_fs_model_space`` (megatron-core 0.15.0 and older) gives each
model parameter's ``fp32_param``, ``exp_avg`` and ``exp_avg_sq`` the model's ShardedTensor (key
``optimizer.state.<field>.<model key>``, same global shape and chunks) with the ``flattened_range`` this DP
rank owns of its chunk. megatron-core's torch_dist strategy cannot hand such a tensor to DCP as it is; it
stores it reformulated (``dist_checkpointing/strategies/torch.py``, ``sharded_tensor_to_torch_sharded_tensor``
and ``resharding.nd_flattened_tensor_reformulated_global_shape``): a model tensor of global shape
``[X, Y, Z]`` cut in chunks ``[x, y, z]`` (a stacked layer axis is a chunk axis of size 1) becomes a DCP
tensor of global shape ``[X // x, Y // y, Z // z, x * y * z]``: one leading index per chunk, and along
the last axis the chunk's elements in row-major order, each DP rank's ``[start, stop)`` of them written as
its own piece (``Shard`` at offset ``chunk index + (start,)``). A SwiGLU ``linear_fc1`` (a
``ShardedTensorFactory``) is two chunks per TP rank, gate then up: ``2 * TP`` along its rows, as the
model tensor's own chunks. So the stored tensor is the model tensor with its axes permuted; nothing of it
depends on the DP layout, and the chunk grid follows from the two global shapes.

megatron-core 0.16.1 and later refuse to save or load it (``ShardedTensor.flattened_range is not
supported``, ``dist_checkpointing/mapping.py``); Megatron-LM core_v0.12.x-core_v0.14.x wrote it by
default for the distributed optimizer (``--ckpt-fully-parallel-save`` is on by default), core_v0.15.x
with ``--dist-ckpt-save-pre-mcore-014`` (or torch < 2.6). Written by
``savers/torch_dist/optimizer_fs_model_space.py``.
"""

from __future__ import annotations

import math

import torch

from pgconvert.formats.torch_dist_optimizer import FS_MODEL_SPACE
from pgconvert.io.limits import quote
from pgconvert.optimizer.order import OptimizerLayoutError


def chunk_shape(stored: tuple[int, ...], global_shape: tuple[int, ...], where: str) -> tuple[int, ...]:
    """The model tensor's chunk shape that a reformulated record of shape ``stored`` was cut with, checked:
    ``stored`` is ``(*chunks per axis, elements per chunk)`` of a tensor of ``global_shape``."""
    if len(stored) != len(global_shape) + 1 or any(count < 1 or size % count for count, size
                                                     in zip(stored, global_shape)):
        raise OptimizerLayoutError(
            f"{where}: global shape {quote(list(stored))} is not a {FS_MODEL_SPACE} record of a tensor of shape "
            f"{list(global_shape)} (chunks per axis, then the elements of one chunk)")
    local = tuple(size // count for count, size in zip(stored, global_shape))
    if math.prod(local) != stored[-1]:
        raise OptimizerLayoutError(
            f"{where}: global shape {quote(list(stored))}: chunks of {list(local)} hold {math.prod(local)} elements, "
            f"not {stored[-1]}")
    return local


def record_box(offsets: tuple[int, ...], sizes: tuple[int, ...], local: tuple[int, ...],
               elements: int, where: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The box of the reformulated record that holds the box ``offsets``/``sizes`` of the model tensor
    (whole chunks only: a layer of a stacked key is one chunk along the layer axis)."""
    if any(offset % size or length % size for offset, length, size in zip(offsets, sizes, local)):
        raise OptimizerLayoutError(f"{where}: the box {list(offsets)} + {list(sizes)} does not consist of whole "
                                   f"chunks of {list(local)}")
    return (tuple(o // n for o, n in zip(offsets, local)) + (0,),
            tuple(s // n for s, n in zip(sizes, local)) + (elements,))


def unflatten(record: torch.Tensor, local: tuple[int, ...], sizes: tuple[int, ...]) -> torch.Tensor:
    """A box of the model tensor (``sizes``) from its reformulated record box (``(*chunk counts, elements)``)."""
    counts = record.shape[:-1]
    rank = len(local)
    split = record.reshape(*counts, *local)  # (chunk index..., element index within the chunk...)
    order = [axis for pair in zip(range(rank), range(rank, 2 * rank)) for axis in pair]
    return split.permute(order).reshape(sizes)


def flatten(tensor: torch.Tensor, local: tuple[int, ...]) -> torch.Tensor:
    """The inverse of ``unflatten``: a model tensor box as its record box."""
    counts = tuple(size // n for size, n in zip(tensor.shape, local))
    interleaved = tensor.reshape([value for pair in zip(counts, local) for value in pair])
    rank = len(local)
    order = [*range(0, 2 * rank, 2), *range(1, 2 * rank, 2)]
    return interleaved.permute(order).reshape(*counts, math.prod(local))
