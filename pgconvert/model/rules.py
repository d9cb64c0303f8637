"""Sharding rules: how one global tensor relates to its tensor-parallel pieces.

Each rule is a small value object with ``split(full, size) -> list``, ``merge(shards) -> full``,
``shard(full, size, rank)`` (one piece without building the others) and ``local_shape``.
Pieces returned by ``split``/``shard`` may be views of ``full``; callers that keep them clone.

``piece_windows`` answers the readers' question "which global windows make up destination piece
``rank`` of ``size``" (contiguous rows, gated halves, vocab rows with zero fill), so a reader that
can read a window of the stored tensor cuts any piece without knowing the rule (``assemble``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import torch

from pgconvert.errors import CheckpointError
from pgconvert.io.reuse import joined, new_tensor
from pgconvert.io.torch_input import bitwise_equal

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


@dataclass(frozen=True)
class Window:
    """Rows ``[start, start + length)`` along ``dim`` of the global tensor; ``zeros``: rows past
    the stored table, filled with zeros rather than read."""

    dim: int
    start: int
    length: int
    zeros: bool = False

    def shape(self, global_shape: Sequence[int]) -> tuple[int, ...]:
        shape = list(global_shape)
        shape[self.dim] = self.length
        return tuple(shape)


def piece_targets(windows: Sequence[Window], global_shape: Sequence[int],
                  dtype: torch.dtype) -> tuple[torch.Tensor, list[tuple[Window, torch.Tensor]]]:
    """The piece made of ``windows`` joined along their dim, made once (``new_tensor``) with its zero windows
    filled, and the place in it of each window to be read: a reader reads each straight there (no join)."""
    shape = list(global_shape)
    shape[windows[0].dim] = sum(window.length for window in windows)
    piece = new_tensor(shape, dtype)
    return piece, window_places(piece, windows)


def window_places(piece: torch.Tensor, windows: Sequence[Window]) -> list[tuple[Window, torch.Tensor]]:
    """The place in ``piece`` (the windows joined along their dim) of each window to be read, its zero windows
    filled."""
    places, offset = [], 0
    for window in windows:
        place = piece.narrow(window.dim, offset, window.length)
        offset += window.length
        if window.zeros:
            place.zero_()
        else:
            places.append((window, place))
    return places


def assemble(windows: Sequence[Window], read_into: Callable[[Window, torch.Tensor], None],
             global_shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """The piece made of ``windows``: each read with ``read_into`` straight into its place (or zeros)."""
    piece, targets = piece_targets(windows, global_shape, dtype)
    for window, target in targets:
        read_into(window, target)
    return piece


def strided_in_whole(rule: ShardRule, global_shape: Sequence[int], size: int, rows: int | None = None,
                     true_rows: int | None = None) -> bool:
    """Whether a piece is strided in the whole tensor stored row-major: one of its windows cuts a dim past the
    first that has rows before it (a row-parallel weight's columns). Reading such a piece from a tensor stored
    whole reads the file span of every piece."""
    windows = rule.piece_windows(global_shape, size, 0, rows, true_rows)
    return any(not window.zeros and window.dim > 0 and window.length < global_shape[window.dim]
               and any(extent > 1 for extent in global_shape[:window.dim]) for window in windows)


def _whole(global_shape: Sequence[int], dim: int = 0) -> tuple[Window, ...]:
    return (Window(dim, 0, global_shape[dim]),) if global_shape else ()


class ShardRule:
    """Base of the rules; subclasses define how a tensor is cut along the TP group."""

    name: str = "rule"
    # Whether every rank holds the whole tensor, so its copies must be bit-identical.
    replicated: bool = False
    # Whether the tensor's rows are a vocabulary padded for the layout: a reader fits the stored
    # table to the destination's padded row count as it cuts it (``reshard_rows``).
    fits_rows: bool = False
    # How many row segments the global tensor is laid out in end to end, each cut over TP on its own
    # (a gated linear_fc1: its gate and up halves); formats that store each segment as a key ask it.
    row_segments: int = 1

    def piece_windows(self, global_shape: Sequence[int], size: int, rank: int, rows: int | None = None,
                      true_rows: int | None = None) -> tuple[Window, ...]:
        """The global windows that, joined in order, make piece ``rank`` of ``size``; empty for a
        0-dim tensor (the whole tensor). ``rows``/``true_rows`` matter only to vocab tables."""
        raise NotImplementedError

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
        merged = self.merge(shards)
        piece = self.shard(merged, size, rank)
        return _owned(piece) if shares_memory(piece, [merged, *shards]) else piece

    def reshard_rows(self, shards: Sequence[torch.Tensor], rows: int | None, true_rows: int | None, size: int,
                     rank: int) -> torch.Tensor:
        """``reshard`` of the tensor fitted to ``rows`` rows first; only a rule that ``fits_rows``
        uses ``rows`` (the others' shapes do not depend on the layout's padding)."""
        return self.reshard(shards, size, rank)


@dataclass(frozen=True)
class Replicated(ShardRule):
    """Every rank holds the whole tensor (norms, row-parallel biases, position embeddings).

    ::

        full ──► rank0: full, rank1: full, …      merge: check all equal, keep one
    """

    name = "replicated"
    replicated = True

    def piece_windows(self, global_shape: Sequence[int], size: int, rank: int, rows: int | None = None,
                      true_rows: int | None = None) -> tuple[Window, ...]:
        return _whole(global_shape)

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

    def piece_windows(self, global_shape: Sequence[int], size: int, rank: int, rows: int | None = None,
                      true_rows: int | None = None) -> tuple[Window, ...]:
        step = global_shape[self.dim] // size
        return (Window(self.dim, rank * step, step),)

    def shard(self, full: torch.Tensor, size: int, rank: int) -> torch.Tensor:
        return _cut(full, self.piece_windows(full.shape, size, rank))

    def merge(self, shards: Sequence[torch.Tensor]) -> torch.Tensor:
        if len(shards) == 1:
            return shards[0]
        return _cat(list(shards), self.dim)

    def reshard(self, shards: Sequence[torch.Tensor], size: int, rank: int) -> torch.Tensor:
        shape = list(shards[0].shape)
        shape[self.dim] *= len(shards)
        (window,) = self.piece_windows(shape, size, rank)
        return _concat(_rows_of(shards, window.dim, window.start, window.length), self.dim)


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
    row_segments = 2

    def local_shape(self, global_shape: Sequence[int], size: int) -> tuple[int, ...]:
        return (global_shape[0] // size, *global_shape[1:])

    def piece_windows(self, global_shape: Sequence[int], size: int, rank: int, rows: int | None = None,
                      true_rows: int | None = None) -> tuple[Window, ...]:
        """``[gate_r; up_r]``: rows ``r·step`` of the gate half and the same rows of the up half."""
        half = global_shape[0] // 2
        step = half // size
        return (Window(0, rank * step, step), Window(0, half + rank * step, step))

    def shard(self, full: torch.Tensor, size: int, rank: int) -> torch.Tensor:
        return _cut(full, self.piece_windows(full.shape, size, rank))

    def merge(self, shards: Sequence[torch.Tensor]) -> torch.Tensor:
        if len(shards) == 1:
            return shards[0]
        halves = [shard.chunk(2, dim=0) for shard in shards]
        return _cat([half[0] for half in halves] + [half[1] for half in halves], 0)

    def reshard(self, shards: Sequence[torch.Tensor], size: int, rank: int) -> torch.Tensor:
        # Source piece i is [gate_i; up_i]: the gate halves joined are the global gate, likewise up.
        half = shards[0].shape[0] // 2
        global_half = half * len(shards)
        halves = ([shard.narrow(0, 0, half) for shard in shards], [shard.narrow(0, half, half) for shard in shards])
        views: list[torch.Tensor] = []
        for window in self.piece_windows((2 * global_half, *shards[0].shape[1:]), size, rank):
            which = 1 if window.start >= global_half else 0
            views += _rows_of(halves[which], 0, window.start - which * global_half, window.length)
        return _concat(views, 0)


@dataclass(frozen=True)
class Segmented(ShardRule):
    """A tensor whose rows are named segments laid end to end, each split over TP on its own: rank r
    holds chunk r of every segment, in segment order (megatron-core's Mamba ``in_proj`` = ``[z; x; B;
    C; dt]`` and ``conv1d`` = ``[x; B; C]``, whose segments have different sizes). ``segments`` are the
    global row counts; ``names`` say what each segment is (for messages and docs only).

    ::

        full           rank0          rank1
        ┌ z0 ┐         ┌ z0 ┐         ┌ z1 ┐
        │ z1 │         │ x0 │         │ x1 │
        │ x0 │   ──►   └ B0 ┘         └ B1 ┘
        │ x1 │
        │ B0 │
        └ B1 ┘

    A gated ``linear_fc1`` is the two-segment case. Merging concatenates, segment by segment, every
    rank's chunk of it.
    """

    segments: tuple[int, ...] = ()
    names: tuple[str, ...] = ()
    name = "segmented"

    @property
    def row_segments(self) -> int:  # type: ignore[override]
        return len(self.segments)

    def __post_init__(self) -> None:
        if not self.segments or any(rows < 1 for rows in self.segments):
            raise ValueError(f"segmented rule: segment row counts must be positive, got {self.segments}")
        if self.names and len(self.names) != len(self.segments):
            raise ValueError(f"segmented rule: {len(self.names)} names for {len(self.segments)} segments")

    def _check(self, global_rows: int, size: int) -> None:
        if global_rows != sum(self.segments):
            raise ValueError(f"segmented rule: {global_rows} rows, but the segments {self.segments} "
                             f"add up to {sum(self.segments)}")
        bad = [self._label(index) for index, rows in enumerate(self.segments) if rows % size]
        if bad:
            raise ValueError(f"segmented rule: segments {bad} of {self.segments} rows do not divide by {size}")

    def _label(self, index: int) -> str:
        return self.names[index] if self.names else str(index)

    def local_shape(self, global_shape: Sequence[int], size: int) -> tuple[int, ...]:
        self._check(global_shape[0], size)
        return (global_shape[0] // size, *global_shape[1:])

    def piece_windows(self, global_shape: Sequence[int], size: int, rank: int, rows: int | None = None,
                      true_rows: int | None = None) -> tuple[Window, ...]:
        """Chunk ``rank`` of each segment, in segment order."""
        self._check(global_shape[0], size)
        windows = []
        start = 0
        for segment in self.segments:
            step = segment // size
            windows.append(Window(0, start + rank * step, step))
            start += segment
        return tuple(windows)

    def shard(self, full: torch.Tensor, size: int, rank: int) -> torch.Tensor:
        return _cut(full, self.piece_windows(full.shape, size, rank))

    def merge(self, shards: Sequence[torch.Tensor]) -> torch.Tensor:
        if len(shards) == 1:
            return shards[0]
        size = len(shards)
        self._check(shards[0].shape[0] * size, size)
        views: list[torch.Tensor] = []
        start = 0
        for segment in self.segments:
            local = segment // size
            views += [shard.narrow(0, start, local) for shard in shards]
            start += local
        return _cat(views, 0)


def _zeros(like: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """Zeros of ``like``'s dtype and device, but in memory for a piece a loader left in its file (a meta tensor): the
    installed join reads the pieces into place and copies these."""
    device = "cpu" if like.device.type == "meta" and _CONCAT.get() is not None else like.device
    return torch.zeros(shape, dtype=like.dtype, device=device)


def _cut(full: torch.Tensor, windows: Sequence[Window]) -> torch.Tensor:
    """The windows of ``full``: a view when they are one run of rows, else joined into a tensor of its own (in the
    memory lent to the record being produced; through the installed join, which reads the windows of a piece a loader
    left in its file)."""
    if len(windows) > 1 and all(a.dim == b.dim and a.start + a.length == b.start for a, b in zip(windows, windows[1:])):
        windows = [Window(windows[0].dim, windows[0].start, sum(w.length for w in windows))]
    views = [full.narrow(w.dim, w.start, w.length) for w in windows]
    if len(views) == 1:
        return views[0]
    return joined(views, windows[0].dim) if _CONCAT.get() is None else _cat(views, windows[0].dim)


def _rows_of(shards: Sequence[torch.Tensor], dim: int, start: int, length: int) -> list[torch.Tensor]:
    """Views of rows ``[start, start + length)`` along ``dim`` of the pieces joined in order."""
    views = []
    offset = 0
    for shard in shards:
        extent = shard.shape[dim]
        lo, hi = max(start, offset), min(start + length, offset + extent)
        if lo < hi:
            views.append(shard.narrow(dim, lo - offset, hi - lo))
        offset += extent
    return views


def _concat(views: list[torch.Tensor], dim: int) -> torch.Tensor:
    """The views joined into a tensor of its own (through the installed join, even for one view: a
    loader's join may read it from its file rather than copy it from a mapping)."""
    if len(views) == 1 and _CONCAT.get() is None:
        return _owned(views[0])
    return _cat(views, dim)


def shares_memory(tensor: torch.Tensor, others: Sequence[torch.Tensor]) -> bool:
    """Whether ``tensor`` is one of ``others`` or a view of one's memory: a piece a loader left in its file (a meta
    tensor), or a view of one in memory. A tensor a join made is neither."""
    if tensor.device.type == "meta":
        return True
    pointer = tensor.untyped_storage().data_ptr()
    return any(other.device.type != "meta" and other.untyped_storage().data_ptr() == pointer for other in others)


def _owned(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of ``tensor`` (in the memory lent to the record being produced, if it fits); a meta tensor
    (a loader's stand-in for pieces left in their files, which its join could not read into place) as it is, for
    the loader to read the pieces whole instead."""
    if tensor.device.type == "meta":
        return tensor
    return new_tensor(tensor.shape, tensor.dtype).copy_(tensor)


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
    fits_rows = True

    def piece_windows(self, global_shape: Sequence[int], size: int, rank: int, rows: int | None = None,
                      true_rows: int | None = None) -> tuple[Window, ...]:
        """Rows ``[rank·rows/size, (rank+1)·rows/size)`` of the table fitted to ``rows`` padded rows:
        the stored rows (``global_shape[0]``) that fall there, then a zero window for the rest."""
        rows = global_shape[0] if rows is None else rows
        if true_rows is not None and rows < true_rows:
            raise ValueError(f"padded size {rows} is smaller than the true vocab {true_rows}")
        step = rows // size
        start = rank * step
        stored = max(0, min(step, global_shape[0] - start))
        windows = [Window(0, start, stored)] if stored else []
        if stored < step:
            windows.append(Window(0, start + stored, step - stored, zeros=True))
        return tuple(windows)

    def reshard_rows(self, shards: Sequence[torch.Tensor], rows: int | None, true_rows: int | None, size: int,
                     rank: int) -> torch.Tensor:
        """``reshard`` of the table fitted to ``rows`` padded rows, in one copy: source rows that fit are
        kept (padding included, so same-size targets stay bit-exact), rows past the source are zeros."""
        if rows is None:
            return self.reshard(shards, size, rank)
        have = sum(shard.shape[0] for shard in shards)
        views: list[torch.Tensor] = []
        for window in self.piece_windows((have, *shards[0].shape[1:]), size, rank, rows, true_rows):
            if window.zeros:
                views.append(_zeros(shards[0], window.shape(shards[0].shape)))
            else:
                views += _rows_of(shards, 0, window.start, window.length)
        return _concat(views, 0)


# Vocab-parallel tables are column-parallel over the padded table; padding is fitted by the provider.
VOCAB = VocabParallel(dim=0)
