"""Memory lent to the tensor a writer is producing, reused from one record to the next.

A new tensor's pages are faulted in and zeroed by the kernel when first written; for a conversion that
reads every byte once, that costs about a quarter of a CPU-second per GiB. A writer that produces its
records one at a time (a rank file's tensors, a safetensors shard's, a ``.distcp`` file's) holds one
``ReusedMemory`` and produces each record inside ``memory.lending(nbytes)``: the first allocation made
for a result of exactly that many bytes through ``new_tensor`` (a join's result, a region read into
memory, a piece cut from a stored tensor) is placed in the lent block instead of new memory.

The block is lent again only when nothing else refers to it (its storage's use count), so a tensor
kept beyond its record (a stacked expert waiting for its last piece, a tensor cached for the next
chunk) is never overwritten: the next record then gets a new block.

A writer that writes each record from its own memory (``OutputFile.write_in_place``) while it produces the
next holds a ``ReusedMemory(blocks=2)``: the record being written keeps one block, the next is produced in
the other. It lends with the record's place in its file (``phase``): the tensor is placed so that its address
and its file offset agree modulo ``ALIGNMENT``, which ``O_DIRECT`` needs to write it without a copy.
"""

from __future__ import annotations

import ctypes
import functools
import mmap
from collections import deque
from collections.abc import Iterator, Sequence
from concurrent.futures import Future
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import torch

from pgconvert.io import sizes
from pgconvert.io.output import BLOCK as ALIGNMENT, settled

SMALLEST = 1 << 20  # bytes: smaller records are not lent memory
SHRINK = 8  # a record this many times smaller than the block has the block's unused pages handed back
MADV_DONTNEED = 4  # Linux's value (also the BSDs' and macOS's, where it only marks the pages)
# The memory lending to the record being produced: the memory, the record's size in bytes and the place modulo
# ``ALIGNMENT`` its bytes take in their file (None: anywhere); None once taken.
_LENT: ContextVar[tuple[ReusedMemory, int, int | None] | None] = ContextVar("pgconvert_lent", default=None)


def new_tensor(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialized contiguous tensor: in a block lent to the record being produced when it has
    the record's size (the lending is then taken), else in new memory."""
    lent = _LENT.get()
    nbytes = sizes.nbytes(tuple(shape), dtype)
    if lent is None or lent[1] != nbytes or nbytes == 0:
        return torch.empty(tuple(shape), dtype=dtype)
    _LENT.set(None)
    memory, _, phase = lent
    block = memory.free_block(nbytes + (0 if phase is None else ALIGNMENT))
    start = 0 if phase is None else (phase - block.data_ptr()) % ALIGNMENT
    itemsize = sizes.itemsize(dtype)
    if start % itemsize:  # a place no element can start at: anywhere (it is then written through a copy)
        start = 0
    return torch.empty(0, dtype=dtype).set_(block, start // itemsize, tuple(shape), sizes.contiguous_stride(shape))


@contextmanager
def nothing_lent() -> Iterator[None]:
    """Within the block, ``new_tensor`` makes nothing in lent memory: for work handed to other threads (their
    contexts are copies of this one), which must not take a lending meant for this thread's record."""
    token = _LENT.set(None)
    try:
        yield
    finally:
        _LENT.reset(token)


def joined(tensors: Sequence[torch.Tensor], dim: int = 0) -> torch.Tensor:
    """``torch.cat(tensors, dim)``, its result made by ``new_tensor``."""
    first = tensors[0]
    if first.dim() == 0 or any(tensor.dim() != first.dim() for tensor in tensors):
        return torch.cat(list(tensors), dim=dim)  # torch's own error, or its legacy empty-tensor rule
    axis = dim % first.dim()
    shape = list(first.shape)
    shape[axis] = sum(tensor.shape[axis] for tensor in tensors)
    dtype = functools.reduce(torch.promote_types, (tensor.dtype for tensor in tensors))
    return torch.cat(list(tensors), dim=axis, out=new_tensor(shape, dtype))


def _release_tail(block: torch.UntypedStorage, keep: int) -> None:
    """Hand the whole pages of ``block`` after its first ``keep`` bytes back to the kernel (``MADV_DONTNEED``:
    they read as zeros and cost nothing until written again); nothing where madvise is not available."""
    page = mmap.PAGESIZE
    start = -(-(block.data_ptr() + keep) // page) * page
    end = (block.data_ptr() + block.nbytes()) // page * page
    advise = getattr(_libc(), "madvise", None)  # None without a C library exposing madvise
    if end > start and advise is not None:
        advise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), MADV_DONTNEED)


@functools.cache
def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(None, use_errno=True)
    except (OSError, TypeError):  # no process-wide symbol lookup (Windows)
        return None


def _use_count(storage: torch.UntypedStorage) -> int:
    """How many references the storage has (tensors and views on it included); a torch without the
    counter answers "shared", so nothing is reused."""
    count = getattr(torch._C, "_storage_Use_Count", None)
    return 2 if count is None else int(count(storage._cdata))


@dataclass
class _Block:
    storage: torch.UntypedStorage
    resident: int  # bytes at its start that may be resident (the rest handed back)

    def free(self) -> bool:
        return _use_count(self.storage) == 1


class ReusedMemory:
    """``blocks`` blocks of memory (one by default), each as large as the largest record lent it so far, lent to
    each record in turn."""

    def __init__(self, blocks: int = 1) -> None:
        if blocks < 1:
            raise ValueError(f"a ReusedMemory needs at least one block, not {blocks}")
        self._most = blocks
        self._blocks: list[_Block] = []  # least recently lent first

    @property
    def last_block(self) -> torch.UntypedStorage | None:
        """The block lent last (None before the first)."""
        return self._blocks[-1].storage if self._blocks else None

    def free_block(self, nbytes: int) -> torch.UntypedStorage:
        """A block of at least ``nbytes`` that nothing refers to, else a new one (kept in place of the least recently
        lent block, a free one first). A record under an eighth of the block gets it with the pages past its end
        handed back (``_release_tail``), so one large record (an embedding) does not add its size to every later
        record's memory, while a layer's tensors (within a few times of each other) keep their pages: what is
        compared is the part of the block that may still be resident, not its size."""
        for block in self._blocks:
            if block.storage.nbytes() >= nbytes and block.free():
                if SHRINK * nbytes < block.resident:
                    _release_tail(block.storage, nbytes)
                    block.resident = nbytes
                else:
                    block.resident = max(block.resident, nbytes)
                self._blocks.remove(block)
                self._blocks.append(block)
                return block.storage
        if len(self._blocks) >= self._most:
            free = [block for block in self._blocks if block.free()]
            self._blocks.remove(free[0] if free else self._blocks[0])
        storage = torch.empty(nbytes, dtype=torch.uint8).untyped_storage()
        self._blocks.append(_Block(storage, nbytes))
        return storage

    @contextmanager
    def lending(self, nbytes: int, phase: int | None = None) -> Iterator[None]:
        """Within the block, the first ``new_tensor`` of ``nbytes`` bytes is made in this memory (records
        under ``SMALLEST`` bytes are left to the allocator, which reuses small blocks itself); with ``phase``, at an
        address equal to ``phase`` modulo ``ALIGNMENT`` (the record's offset in the file it is written to)."""
        token = _LENT.set((self, nbytes, None if phase is None else phase % ALIGNMENT) if nbytes >= SMALLEST else None)
        try:
            yield
        finally:
            _LENT.reset(token)


class RecordsInFlight:
    """A writer's records made in reused memory and written from it (``OutputFile.write_in_place``), ``records`` of
    them left being written while the next is produced: each record is produced inside ``lending``, which first waits
    for the writes of the records before those, and its writes are handed to ``add``."""

    def __init__(self, records: int) -> None:
        self._records = records
        self._memory = ReusedMemory(blocks=records + 1)
        self._writing: deque[list[Future[None]]] = deque()  # the writes of the records still using their memory

    @contextmanager
    def lending(self, nbytes: int, phase: int) -> Iterator[None]:
        """``ReusedMemory.lending`` of a block no record being written holds."""
        while len(self._writing) > self._records:
            settled(self._writing.popleft())  # its block is free for this record
        with self._memory.lending(nbytes, phase):
            yield

    def add(self, futures: list[Future[None]]) -> None:
        """The writes of the record just produced (none: it was staged, and holds no block)."""
        if futures:
            self._writing.append(futures)
