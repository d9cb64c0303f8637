"""Sharding rules: how one global tensor relates to its tensor-parallel pieces.

Each rule is a small value object with ``split(full, size) -> list``, ``merge(shards) -> full``,
``shard(full, size, rank)`` (one piece without building the others) and ``local_shape``.
Pieces returned by ``split``/``shard`` may be views of ``full``; callers that keep them clone.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import torch

from pgconvert.errors import CheckpointError

Concat = Callable[[list[torch.Tensor], int], torch.Tensor]
# How merges and reshards join pieces: torch.cat, unless a loader whose pieces are file mappings
# installs one that hands back each piece's pages once copied (``concatenating_with``).
_CONCAT: ContextVar[Concat | None] = ContextVar("pgconvert_concat", default=None)


@contextmanager
def concatenating_with(concat: Concat) -> Iterator[None]:
    """Within the block, rules join pieces with ``concat`` (same result as ``torch.cat``)."""
    token = _CONCAT.set(concat)
    try:
        yield
    finally:
        _CONCAT.reset(token)


def _cat(views: list[torch.Tensor], dim: int) -> torch.Tensor:
    concat = _CONCAT.get()
    return torch.cat(views, dim=dim) if concat is None else concat(views, dim)



class ReplicaMismatchError(CheckpointError):
    """Two replicas of a replicated tensor differ; ``ranks`` are their indices in the shard list,
    ``name`` the tensor and ``files`` where the two replicas come from (when the caller knows)."""

    def __init__(self, first: int, second: int, name: str | None = None, files: tuple[str, str] | None = None) -> None:
        where = f" ({files[0]} and {files[1]})" if files else ""
        subject = f"{name}: replicated tensor differs between ranks" if name else f"replica {second} differs from replica {first}"
        super().__init__(f"{subject}{where}")
        self.ranks = (first, second)
        self.name = name
        self.files = files


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bytes: unlike ``torch.equal``, an identical NaN is equal to itself
    (and -0.0 differs from 0.0), which is what "the same replica" means."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(_bytes_of(a), _bytes_of(b))


def _bytes_of(tensor: torch.Tensor) -> torch.Tensor:
    flat = tensor.reshape(-1).contiguous()
    return flat.view(torch.uint8) if flat.numel() else flat.to(torch.uint8)


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

    def reshard(self, shards: Sequence[torch.Tensor], size: int, rank: int) -> torch.Tensor:
        """Piece ``rank`` of ``size`` cut straight from the pieces of another split, in one copy.

        Equal to ``shard(merge(shards), size, rank)`` but never builds the full tensor; the result
        always owns its memory.
        """
        return _owned(self.shard(self.merge(shards), size, rank))


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

    def reshard(self, shards: Sequence[torch.Tensor], size: int, rank: int) -> torch.Tensor:
        return _owned(self.merge(shards))

    def merge(self, shards: Sequence[torch.Tensor]) -> torch.Tensor:
        first = shards[0]
        for index, other in enumerate(shards[1:], start=1):
            if not bitwise_equal(other, first):
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
        return _cat(list(shards), self.dim)

    def reshard(self, shards: Sequence[torch.Tensor], size: int, rank: int) -> torch.Tensor:
        return _concat(_window(shards, self.dim, 0, shards[0].shape[self.dim], size, rank), self.dim)


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
        return _cat([half[0] for half in halves] + [half[1] for half in halves], 0)

    def reshard(self, shards: Sequence[torch.Tensor], size: int, rank: int) -> torch.Tensor:
        half = shards[0].shape[0] // 2
        gates = _window(shards, 0, 0, half, size, rank)
        ups = _window(shards, 0, half, half, size, rank)
        return _concat(gates + ups, 0)


def _window(shards: Sequence[torch.Tensor], dim: int, offset: int, length: int, size: int,
            rank: int) -> list[torch.Tensor]:
    """Views of the rows a destination piece needs, taken from each source piece.

    Each source piece contributes its rows ``[offset, offset + length)`` along ``dim``; concatenated
    over the source pieces they form the global tensor, of which destination ``rank`` of ``size``
    takes an equal contiguous slice.
    """
    total = length * len(shards)
    step = total // size
    start, end = rank * step, (rank + 1) * step
    views = []
    for index, shard in enumerate(shards):
        lo, hi = max(start, index * length), min(end, (index + 1) * length)
        if lo < hi:
            views.append(shard.narrow(dim, offset + lo - index * length, hi - lo))
    return views


def _concat(views: list[torch.Tensor], dim: int) -> torch.Tensor:
    if len(views) == 1:
        return _owned(views[0])
    return _cat(views, dim)


def _owned(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.clone(memory_format=torch.contiguous_format)


REPLICATED = Replicated()
COLUMN = Chunked(dim=0)
ROW = Chunked(dim=1)
GATED = GatedChunked()


@dataclass(frozen=True)
class VocabParallel(Chunked):
    """Word embeddings and the output layer: column-parallel over the *padded* vocabulary.

    The padded row count depends on the layout (a multiple of ``make_vocab_size_divisible_by × tp``),
    so the table is fitted to the target's padded size as it is cut (``reshard_rows``).
    """

    name = "vocab"

    def reshard_rows(self, shards: Sequence[torch.Tensor], rows: int, true_rows: int | None, size: int,
                     rank: int) -> torch.Tensor:
        """``reshard`` of the table fitted to ``rows`` padded rows, in one copy: source rows that fit are
        kept (padding included, so same-size targets stay bit-exact), rows past the source are zeros.

        Destination piece ``rank`` takes global rows ``[rank·rows/size, (rank+1)·rows/size)`` from
        the source pieces; rows past the source table are zeros.
        """
        have = sum(shard.shape[0] for shard in shards)
        if true_rows is not None and rows < true_rows:
            raise ValueError(f"padded size {rows} is smaller than the true vocab {true_rows}")
        step = rows // size
        start, end = rank * step, (rank + 1) * step
        views: list[torch.Tensor] = []
        offset = 0
        for shard in shards:
            lo, hi = max(start, offset), min(end, offset + shard.shape[0])
            if lo < hi:
                views.append(shard.narrow(0, lo - offset, hi - lo))
            offset += shard.shape[0]
        covered = max(0, min(end, have) - start)
        if covered < step:
            views.append(shards[0].new_zeros((step - covered, *shards[0].shape[1:])))
        return _concat(views, 0)


# Vocab-parallel tables are column-parallel over the padded table; padding is fitted by the provider.
VOCAB = VocabParallel(dim=0)
