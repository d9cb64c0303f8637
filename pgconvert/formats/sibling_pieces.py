"""The TP pieces of one tensor produced from one read of it, for the files of a TP group written in lockstep.

A row-parallel weight's piece is strided in a tensor stored whole (an HF weight, a Megatron piece cut for more
ranks): reading it reads the file span of every piece, so writing TP8 rank files one after another reads such a
tensor eight times. The saver instead writes the files of ranks that hold the same tensors in the same order
(a TP group) at once, one thread each, and those threads share a ``SiblingPieces``: the first to need such a tensor
reads it whole (``CanonicalSource.load_base``, into memory the group reuses), and each cuts its own piece
from it on its own thread (``piece_of``, into the memory its writer lends). The whole tensor is dropped once every
sibling has cut its piece; a sibling that needs the next shared tensor first waits for that, so the group holds
at most one whole tensor beside its pieces. Tensors whose pieces read apart without overlap (``shares_piece_reads``
false) are read by each sibling as before.

Every sibling takes the same shared tensors in the same order (they hold the same specs), so a waiting sibling
always waits for siblings that can go on; a sibling that fails ends the wait of the others (``fail``), as does a
failure elsewhere in the pools around them (``io.threads.check_running``).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from pgconvert.formats.stream import CanonicalSource
from pgconvert.io.reuse import ReusedMemory
from pgconvert.io.sizes import itemsize, numel
from pgconvert.io.threads import Stopped, check_running
from pgconvert.model.rules import ShardRule

# How long a waiting sibling sleeps before it looks again whether a pool around it is stopping.
_POLL_SECONDS = 0.2


@dataclass(frozen=True)
class _Shared:
    """The tensor and cut the group is serving now."""

    name: str
    rule: ShardRule
    size: int
    rows: int | None


class SiblingPieces:
    """Pieces of the tensors the ``siblings`` writers of one TP group share, each tensor read once."""

    def __init__(self, source: CanonicalSource, siblings: int) -> None:
        self._source = source
        self._siblings = siblings
        self._memory = ReusedMemory()
        self._changed = threading.Condition()
        self._serving: _Shared | None = None
        self._whole: torch.Tensor | None = None  # None while the reader reads it
        self._taken: set[int] = set()
        self._failed = False

    def piece(self, sibling: int, name: str, rule: ShardRule, size: int, rank: int,
              rows: int | None) -> torch.Tensor:
        """Piece ``rank`` of ``size``, as ``load_shard`` gives it, for sibling ``sibling`` (0 to ``siblings - 1``;
        two siblings may take the same piece: expert TP narrower than TP), cut from the tensor read once."""
        wanted = _Shared(name, rule, size, rows)
        whole = self._whole_when_served(wanted, sibling)
        try:
            return self._source.piece_of(name, whole, rule, size, rank, rows)
        finally:
            del whole
            self._taken_by(sibling)

    def fail(self) -> None:
        """A sibling failed: the others stop waiting for it."""
        with self._changed:
            self._failed = True
            self._changed.notify_all()

    def _whole_when_served(self, wanted: _Shared, sibling: int) -> torch.Tensor:
        with self._changed:
            while True:
                if self._failed:
                    raise Stopped
                if self._serving is None:
                    self._serving, self._whole, self._taken = wanted, None, set()
                    break
                if self._serving == wanted and sibling not in self._taken and self._whole is not None:
                    return self._whole
                self._changed.wait(_POLL_SECONDS)
                check_running()
        return self._read(wanted)

    def _read(self, wanted: _Shared) -> torch.Tensor:
        """This sibling reads the tensor for all (outside the lock, so the others only wait for it)."""
        meta = self._source.meta(wanted.name)
        try:
            with self._memory.lending(numel(meta.shape) * itemsize(meta.dtype)):
                whole = self._source.load_base(wanted.name)
        except BaseException:
            self.fail()
            raise
        with self._changed:
            self._whole = whole
            self._changed.notify_all()
        return whole

    def _taken_by(self, sibling: int) -> None:
        with self._changed:
            self._taken.add(sibling)
            if len(self._taken) == self._siblings:
                self._serving, self._whole, self._taken = None, None, set()
                self._changed.notify_all()
