"""Swapping two paths in one step: Linux ``renameat2(..., RENAME_EXCHANGE)``.

After a successful exchange each path names what the other named before, and no observer ever sees
either path missing. Where the C library, the kernel or the file system cannot do it (another
platform, glibc before 2.28, a file system without the flag), :func:`exchange` says so and changes
nothing, so the caller can fall back to two renames.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import logging
import os
import sys
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

AT_FDCWD = -100
RENAME_EXCHANGE = 2
# What renameat2 answers when the kernel or the file system has no exchange (nothing was renamed).
UNSUPPORTED_ERRNOS = frozenset({errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP})


@functools.cache
def _renameat2() -> Any | None:
    """The C library's ``renameat2``, or None where there is none."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        function = libc.renameat2
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    function.restype = ctypes.c_int
    return function


def exchange(first: Path, second: Path) -> bool:
    """Swap ``first`` and ``second`` (both must exist) in one step.

    Returns False, having changed nothing, where this system cannot swap in one step; any other
    failure is an ``OSError`` naming both paths.
    """
    function = _renameat2()
    if function is None:
        return False
    if function(AT_FDCWD, os.fsencode(first), AT_FDCWD, os.fsencode(second), RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in UNSUPPORTED_ERRNOS:
        log.debug("renameat2(RENAME_EXCHANGE) of %s and %s: %s", first, second, os.strerror(code))
        return False
    raise OSError(code, os.strerror(code), str(first), None, str(second))
