"""The TP pieces of one tensor read together, for the files of a TP group written in lockstep.

A row-parallel weight's piece is strided in a tensor stored whole (an HF weight, a Megatron piece cut for more
ranks): reading it reads the file span of every piece, so writing TP8 rank files one after another reads such a
tensor eight times. The saver instead writes the files of ranks that hold the same tensors in the same order
(a TP group) at once, one thread each, and those threads share a ``SiblingPieces``. When a sibling reaches such
a tensor it makes its piece (in the memory its writer lends) and waits; the last sibling to arrive fills every
piece in one read (``CanonicalSource.read_pieces``: an HF tensor one pass over its bytes through a small scratch
buffer, each slab's columns copied to every piece while they are in cache; other sources from the whole tensor,
in memory the group reuses) and wakes the others. Tensors whose pieces read apart without overlap
(``shares_piece_reads`` false) are read by each sibling as before.

Every sibling takes the same shared tensors in the same order (they hold the same specs), so each wait ends once
the slowest sibling arrives; a sibling that fails ends the others' wait (``fail``), as does a failure elsewhere in
the pools around them (``io.threads.check_running``).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch

from pgconvert.formats.stream import CanonicalSource
from pgconvert.io.reuse import ReusedMemory, new_tensor
from pgconvert.io.sizes import itemsize, numel
from pgconvert.io.threads import Stopped, check_running
from pgconvert.model.rules import ShardRule

# How long a waiting sibling sleeps before it looks again whether a pool around it is stopping.
_POLL_SECONDS = 0.2


@dataclass(frozen=True)
class _Shared:
    """A tensor and cut the siblings share."""

    name: str
    rule: ShardRule
    size: int
    rows: int | None


@dataclass
class _Round:
    """The siblings' pieces of one shared tensor, gathered until the last arrives."""

    shared: _Shared
    pieces: dict[int, tuple[int, torch.Tensor]] = field(default_factory=dict)  # by sibling: (rank, piece)
    done: bool = False


class SiblingPieces:
    """Pieces of the tensors the ``siblings`` writers of one TP group share, each tensor read once."""

    def __init__(self, source: CanonicalSource, siblings: int, shared: frozenset[tuple[str, int]]) -> None:
        self._source = source
        self._siblings = siblings
        self._shared = shared  # (canonical name, cut size) of each tensor the siblings share
        self._memory = ReusedMemory()  # the whole tensor, for sources that read one
        self._changed = threading.Condition()
        self._gathering: _Round | None = None
        self._failed = False

    def shares(self, name: str, size: int) -> bool:
        """Whether the siblings take ``name`` cut in ``size`` pieces from here (``CanonicalSource.shares_piece_reads``,
        asked once for the group when it was made)."""
        return (name, size) in self._shared

    def piece(self, sibling: int, name: str, rule: ShardRule, size: int, rank: int, rows: int | None,
              shape: tuple[int, ...]) -> torch.Tensor:
        """Piece ``rank`` of ``size`` (of ``shape``), as ``load_shard`` gives it, for sibling ``sibling`` (0 to
        ``siblings - 1``; two siblings may take the same piece: expert TP narrower than TP), read with its
        siblings' pieces."""
        piece = new_tensor(shape, self._source.meta(name).dtype)  # in the memory this sibling's writer lends
        joined = self._join(_Shared(name, rule, size, rows), sibling, rank, piece)
        if len(joined.pieces) == self._siblings:  # the last to arrive reads them all
            self._read(joined)
        else:
            self._wait(joined)
        return piece

    def fail(self) -> None:
        """A sibling failed: the others stop waiting for it."""
        with self._changed:
            self._failed = True
            self._changed.notify_all()

    def _join(self, shared: _Shared, sibling: int, rank: int, piece: torch.Tensor) -> _Round:
        with self._changed:
            while True:
                self._check()
                gathering = self._gathering
                if gathering is None:
                    gathering = self._gathering = _Round(shared)
                if gathering.shared == shared and sibling not in gathering.pieces:
                    gathering.pieces[sibling] = (rank, piece)
                    if len(gathering.pieces) == self._siblings:
                        self._gathering = None  # the next shared tensor gathers anew
                    return gathering
                self._changed.wait(_POLL_SECONDS)  # another tensor is gathering: the siblings behind finish it

    def _read(self, joined: _Round) -> None:
        shared, meta = joined.shared, self._source.meta(joined.shared.name)
        by_rank: dict[int, torch.Tensor] = {}
        for rank, piece in joined.pieces.values():
            by_rank.setdefault(rank, piece)
        try:
            with self._memory.lending(numel(meta.shape) * itemsize(meta.dtype)):
                self._source.read_pieces(shared.name, shared.rule, shared.size, by_rank, shared.rows)
            for rank, piece in joined.pieces.values():  # a piece two siblings take, read once
                if piece is not by_rank[rank]:
                    piece.copy_(by_rank[rank])
        except BaseException:
            self.fail()
            raise
        with self._changed:
            joined.done = True
            self._changed.notify_all()

    def _wait(self, joined: _Round) -> None:
        with self._changed:
            while not joined.done:
                self._check()
                self._changed.wait(_POLL_SECONDS)

    def _check(self) -> None:
        if self._failed:
            raise Stopped
        check_running()
