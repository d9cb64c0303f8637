"""Fake process groups: every rank of a layout, played in one process.

A ``FakeProcessGroup`` answers ``rank()`` and ``size()`` like a torch.distributed group, but its
rank is a plain settable attribute and it never talks to anyone. A ``ProcessGroupCollection``
bundles the groups a model provider asks about. Nothing here reads or writes torch.distributed
state; the collection object is the only place a rank lives, and callers pass it explicitly.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pgconvert.model.layout import ParallelLayout


class FakeProcessGroup:
    """A process group of ``size`` ranks whose current rank is set by the caller."""

    def __init__(self, name: str, size: int, rank: int = 0) -> None:
        if size < 1:
            raise ValueError(f"FakeProcessGroup {name!r}: size={size} must be >= 1")
        self.name = name
        self._size = size
        self._rank = 0
        self.set_rank(rank)

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size

    def set_rank(self, rank: int) -> None:
        if not 0 <= rank < self._size:
            raise ValueError(f"FakeProcessGroup {self.name!r}: rank={rank} outside [0, {self._size})")
        self._rank = rank

    def __repr__(self) -> str:
        return f"FakeProcessGroup({self.name!r}, rank={self._rank}, size={self._size})"


@dataclass(frozen=True)
class RankCoord:
    """One rank of a layout: its tensor, pipeline and expert parallel ranks, and its expert tensor-parallel rank where
    the expert tensor-parallel size differs from the tensor-parallel size (None: the tensor-parallel rank, or 0)."""

    tp: int
    pp: int
    ep: int = 0
    etp: int | None = None


@dataclass
class ProcessGroupCollection:
    """The groups a rank belongs to, named as megatron-core's ProcessGroupCollection names them."""

    tp: FakeProcessGroup
    pp: FakeProcessGroup
    ep: FakeProcessGroup
    expt_tp: FakeProcessGroup
    dp: FakeProcessGroup
    cp: FakeProcessGroup
    # The layout the groups were built for; the provider reads stage boundaries from it.
    layout: ParallelLayout | None = None

    def set_ranks(self, tp: int | None = None, pp: int | None = None, ep: int | None = None,
                  expt_tp: int | None = None) -> None:
        """Move this collection to another rank of the grid; unset groups keep their rank."""
        if tp is not None:
            self.tp.set_rank(tp)
            # With no expert-TP rank of its own, expert TP follows dense TP where the sizes agree.
            if expt_tp is None and self.expt_tp.size() == self.tp.size():
                self.expt_tp.set_rank(tp)
        if expt_tp is not None:
            self.expt_tp.set_rank(expt_tp)
        if pp is not None:
            self.pp.set_rank(pp)
        if ep is not None:
            self.ep.set_rank(ep)

    def set_coord(self, coord: RankCoord) -> None:
        self.set_ranks(tp=coord.tp, pp=coord.pp, ep=coord.ep, expt_tp=coord.etp)

    @property
    def coord(self) -> RankCoord:
        return RankCoord(tp=self.tp.rank(), pp=self.pp.rank(), ep=self.ep.rank())

    def groups(self) -> dict[str, FakeProcessGroup]:
        return {
            field.name: getattr(self, field.name)
            for field in fields(self)
            if isinstance(getattr(self, field.name), FakeProcessGroup)
        }


def build_converter_process_groups(layout: ParallelLayout) -> ProcessGroupCollection:
    """A collection of fake groups sized for ``layout``, positioned at rank (0, 0, 0)."""
    return ProcessGroupCollection(
        tp=FakeProcessGroup("tp", layout.tp),
        pp=FakeProcessGroup("pp", layout.pp),
        ep=FakeProcessGroup("ep", layout.ep),
        expt_tp=FakeProcessGroup("expt_tp", layout.expert_tp_size),
        dp=FakeProcessGroup("dp", 1),
        cp=FakeProcessGroup("cp", 1),
        layout=layout,
    )


def iter_ranks(layout: ParallelLayout) -> Iterator[RankCoord]:
    """Every rank of ``layout`` in file order: pipeline stage, then expert rank, then tensor rank."""
    for pp_rank in range(layout.pp):
        for ep_rank in range(layout.ep):
            for tp_rank in range(layout.tp):
                yield RankCoord(tp=tp_rank, pp=pp_rank, ep=ep_rank)
