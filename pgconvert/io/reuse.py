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
"""

from __future__ import annotations

import ctypes
import functools
import mmap
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar

import torch

from pgconvert.io import sizes

SMALLEST = 1 << 20  # bytes: smaller records are not lent memory
SHRINK = 8  # a record this many times smaller than the block has the block's unused pages handed back
MADV_DONTNEED = 4  # Linux's value (also the BSDs' and macOS's, where it only marks the pages)
# The memory lending to the record being produced, with the record's size in bytes; None once taken.
_LENT: ContextVar[tuple[ReusedMemory, int] | None] = ContextVar("pgconvert_lent", default=None)


def new_tensor(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialized contiguous tensor: in the block lent to the record being produced when it has
    the record's size (the block is then taken), else in new memory."""
    lent = _LENT.get()
    nbytes = sizes.nbytes(tuple(shape), dtype)
    if lent is None or lent[1] != nbytes or nbytes == 0:
        return torch.empty(tuple(shape), dtype=dtype)
    _LENT.set(None)
    block = lent[0].free_block(nbytes)
    return torch.empty(0, dtype=dtype).set_(block, 0, tuple(shape), sizes.contiguous_stride(shape))


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


class ReusedMemory:
    """One block of memory, as large as the largest record so far, lent to each record in turn."""

    def __init__(self) -> None:
        self._block: torch.UntypedStorage | None = None
        self._resident = 0  # bytes at the block's start that may be resident (the rest handed back)

    def free_block(self, nbytes: int) -> torch.UntypedStorage:
        """The block, unless it is smaller than ``nbytes`` or still in use: then a new one (kept). A
        record under an eighth of the block gets it with the pages past its end handed back
        (``_release_tail``), so one large record (an embedding) does not add its size to every later
        record's memory, while a layer's tensors (within a few times of each other) keep their pages:
        what is compared is the part of the block that may still be resident, not its size."""
        block = self._block
        if block is None or block.nbytes() < nbytes or _use_count(block) > 1:
            block = torch.empty(nbytes, dtype=torch.uint8).untyped_storage()
            self._block = block
            self._resident = nbytes
        elif SHRINK * nbytes < self._resident:
            _release_tail(block, nbytes)
            self._resident = nbytes
        else:
            self._resident = max(self._resident, nbytes)
        return block

    @contextmanager
    def lending(self, nbytes: int) -> Iterator[None]:
        """Within the block, the first ``new_tensor`` of ``nbytes`` bytes is made in this memory (records
        under ``SMALLEST`` bytes are left to the allocator, which reuses small blocks itself)."""
        token = _LENT.set((self, nbytes) if nbytes >= SMALLEST else None)
        try:
            yield
        finally:
            _LENT.reset(token)
