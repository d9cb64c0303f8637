"""Sharding rules: how one global tensor relates to its tensor-parallel pieces.

Each rule is a small value object with ``split(full, size) -> list``, ``merge(shards) -> full``,
``shard(full, size, rank)`` (one piece without building the others) and ``local_shape``.
Pieces returned by ``split``/``shard`` may be views of ``full``; callers that keep them clone.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


class ReplicaMismatchError(ValueError):
    """Two replicas of a replicated tensor differ; ``ranks`` are their indices in the shard list."""

    def __init__(self, first: int, second: int) -> None:
        super().__init__(f"replica {second} differs from replica {first}")
        self.ranks = (first, second)


class ShardRule:
    """Base of the rules; subclasses define how a tensor is cut along the TP group."""

    name: str = "rule"

    def local_shape(self, global_shape: Sequence[int], size: int) -> tuple[int, ...]:
        raise NotImplementedError

    def split(self, full: torch.Tensor, size: int) -> list[torch.Tensor]:
        return [self.shard(full, size, rank) for rank in range(size)]

    def shard(self, full: torch.Tensor, size: int, rank: int) -> torch.Tensor:
        raise NotImplementedError

    def merge(self, shards: Sequence[torch.Tensor]) -> torch.Tensor:
        raise NotImplementedError

    def divisor(self, size: int) -> tuple[int, int]:
        """(dim, count): the tensor's ``dim`` must be divisible by ``count`` for this size."""
        return (0, 1)


@dataclass(frozen=True)
class Replicated(ShardRule):
    """Every rank holds the whole tensor (norms, row-parallel biases, position embeddings).

    ::

        full ──► rank0: full, rank1: full, …      merge: check all equal, keep one
    """

    name = "replicated"

    def local_shape(self, global_shape: Sequence[int], size: int) -> tuple[int, ...]:
        return tuple(global_shape)

    def shard(self, full: torch.Tensor, size: int, rank: int) -> torch.Tensor:
        return full

    def merge(self, shards: Sequence[torch.Tensor]) -> torch.Tensor:
        first = shards[0]
        for index, other in enumerate(shards[1:], start=1):
            if other.shape != first.shape or not torch.equal(other, first):
                raise ReplicaMismatchError(0, index)
        return first


@dataclass(frozen=True)
class Chunked(ShardRule):
    """Contiguous equal chunks along ``dim``: column-parallel (dim 0) or row-parallel (dim 1).

    ::

        column (dim 0)            row (dim 1)
        ┌──────┐ rank0            ┌───┬───┐
        ├──────┤ rank1            │ 0 │ 1 │
        └──────┘                  └───┴───┘

    For the fused QKV weight the rows are ordered by query group, so chunk boundaries fall on group
    boundaries whenever ``num_query_groups % tp == 0``: the column rule is exact for it.
    """

    dim: int = 0
    name = "chunked"

    def divisor(self, size: int) -> tuple[int, int]:
        return (self.dim, size)

    def local_shape(self, global_shape: Sequence[int], size: int) -> tuple[int, ...]:
        shape = list(global_shape)
        shape[self.dim] //= size
        return tuple(shape)

    def shard(self, full: torch.Tensor, size: int, rank: int) -> torch.Tensor:
        step = full.shape[self.dim] // size
        return full.narrow(self.dim, rank * step, step)

    def merge(self, shards: Sequence[torch.Tensor]) -> torch.Tensor:
        if len(shards) == 1:
            return shards[0]
        return torch.cat(list(shards), dim=self.dim)


@dataclass(frozen=True)
class GatedChunked(ShardRule):
    """SwiGLU ``linear_fc1``: the full tensor is ``[gate; up]`` and rank r holds ``[gate_r; up_r]``.

    ::

        full            rank0        rank1
        ┌ gate0 ┐       ┌ gate0 ┐    ┌ gate1 ┐
        │ gate1 │  ──►  └ up0   ┘    └ up1   ┘
        │ up0   │
        └ up1   ┘

    Merging is therefore not a plain concat: chunk each rank's piece in two, concat the gates,
    concat the ups.
    """

    name = "gated"

    def divisor(self, size: int) -> tuple[int, int]:
        return (0, 2 * size)

    def local_shape(self, global_shape: Sequence[int], size: int) -> tuple[int, ...]:
        return (global_shape[0] // size, *global_shape[1:])

    def shard(self, full: torch.Tensor, size: int, rank: int) -> torch.Tensor:
        gate, up = full.chunk(2, dim=0)
        step = gate.shape[0] // size
        if size == 1:
            return full
        return torch.cat([gate.narrow(0, rank * step, step), up.narrow(0, rank * step, step)], dim=0)

    def merge(self, shards: Sequence[torch.Tensor]) -> torch.Tensor:
        if len(shards) == 1:
            return shards[0]
        halves = [shard.chunk(2, dim=0) for shard in shards]
        return torch.cat([half[0] for half in halves] + [half[1] for half in halves], dim=0)


REPLICATED = Replicated()
COLUMN = Chunked(dim=0)
ROW = Chunked(dim=1)
GATED = GatedChunked()


@dataclass(frozen=True)
class VocabParallel(Chunked):
    """Word embeddings and the output layer: column-parallel over the *padded* vocabulary.

    The padded row count depends on the layout (a multiple of ``make_vocab_size_divisible_by × tp``),
    so the table is fitted to the target's padded size before it is cut (see ``fit_vocab_rows``).
    """

    name = "vocab"


# Vocab-parallel tables are column-parallel over the padded table; padding is fitted by the provider.
VOCAB = VocabParallel(dim=0)


def fit_vocab_rows(table: torch.Tensor, padded_rows: int, true_rows: int | None) -> torch.Tensor:
    """Resize a vocab table to ``padded_rows``: keep every source row that fits, zero-fill the rest.

    Source padding rows are kept where the target has room for them, so a conversion between two
    layouts with the same padded size is bit-exact; real rows (``true_rows``) are never cut.
    """
    rows = table.shape[0]
    if rows == padded_rows:
        return table
    if true_rows is not None and padded_rows < true_rows:
        raise ValueError(f"padded size {padded_rows} is smaller than the true vocab {true_rows}")
    if rows > padded_rows:
        return table.narrow(0, 0, padded_rows)
    fitted = table.new_zeros((padded_rows, *table.shape[1:]))
    fitted[:rows] = table
    return fitted
