"""Keeping resident memory bounded while reading memory-mapped checkpoints.

``torch.load(mmap=True)`` maps each file privately; every page a conversion touches then stays
resident (and counts in RSS) until the mapping goes away, so reading a whole checkpoint would pin
all of it. Once a piece has been copied out, its pages can be handed back with
``madvise(MADV_DONTNEED)``: for a private file mapping that was never written this is purely a hint,
and a later access reads the same bytes from the file again.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import sys
from collections.abc import Iterable

import torch

log = logging.getLogger(__name__)

_MADV_DONTNEED = 4
_libc: ctypes.CDLL | None = None
if sys.platform.startswith("linux"):
    try:
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    except (OSError, AttributeError):  # no libc symbol: releasing pages is an optimisation only
        _libc = None


def release_mapped_pages(tensors: Iterable[torch.Tensor]) -> None:
    """Drop the resident pages behind tensors that live in a private, read-only-used file mapping.

    Never call this on tensors in anonymous memory (it would zero them) or on mapped tensors that
    were written to (the writes would be lost): only on tensors from ``torch.load(mmap=True)``.
    """
    if _libc is None:
        return
    page = mmap.PAGESIZE
    for tensor in tensors:
        storage = tensor.untyped_storage()
        start = storage.data_ptr() // page * page
        end = -(-(storage.data_ptr() + storage.nbytes()) // page) * page
        if end > start and _libc.madvise(start, end - start, _MADV_DONTNEED) != 0:
            log.debug("madvise failed (errno %d); pages stay resident", ctypes.get_errno())
