"""The rules for a destination directory: its hidden siblings, symlinks, and killed ``--overwrite`` runs.

A conversion into DST works through hidden siblings of DST: a lock file, a staging directory
(``.pgconvert-partial-``) and, while ``--overwrite`` swaps the new output in, the previous output
(``.pgconvert-old-``). Their names must fit the file system's NAME_MAX even when DST's own name
nearly fills it, so a long name is shortened with a hash of the whole.

Rules:

- DST may not be a symbolic link (to a directory, a file, or nothing): it is refused up front
  (exit 2). Links among DST's parent directories are followed.
- ``--overwrite`` swaps the complete new output (its staging directory) with DST in one step
  (``renameat2`` with ``RENAME_EXCHANGE``), so DST always names one complete output, the old or the
  new; the old one, now under the staging name, is deleted. A run killed before the deletion ends
  leaves it as a ``.pgconvert-partial-*`` sibling, which the next run for DST removes.
- Where the system cannot swap in one step, ``--overwrite`` renames the previous output to
  ``.DST.pgconvert-old-*``, the new one to DST, then deletes the old one, and warns that DST was
  briefly absent. A run killed between the two renames leaves no DST; the next run for DST (under
  its lock) renames the previous output back. A ``.pgconvert-old-*`` beside an existing DST is the
  leftover of a killed deletion and is removed.
"""

from __future__ import annotations

import glob
import hashlib
import logging
import os
import shutil
import uuid
from pathlib import Path

from pgconvert.errors import DestinationError
from pgconvert.io.durable import fsync_dir
from pgconvert.io.exchange import exchange
from pgconvert.io.limits import quote

log = logging.getLogger(__name__)

# The longest file name most file systems accept (bytes).
NAME_MAX = 255
# Room left after the stem for the longest suffix pgconvert appends (".pgconvert-partial-shared-"
# and a 16-digit id is 42 bytes).
SUFFIX_ROOM = 48
RETIRED_MARKER = ".pgconvert-old-"
LOCK_SUFFIX = ".pgconvert.lock"
PARTIAL_MARKER = ".pgconvert-partial-"
# The staging directory the shares of one sharded run write together (without DST's lock).
SHARED_STAGING_MARKER = f"{PARTIAL_MARKER}shared-"


def sibling_stem(dst: Path) -> str:
    """``"." + dst.name``, or a hash-shortened form when a suffix would push it past NAME_MAX."""
    stem = f".{dst.name}"
    if len(os.fsencode(stem)) + SUFFIX_ROOM <= NAME_MAX:
        return stem
    digest = hashlib.sha256(os.fsencode(dst.name)).hexdigest()[:16]
    keep = os.fsencode(dst.name)[: NAME_MAX - SUFFIX_ROOM - len(digest) - 2]
    return f".{keep.decode('utf-8', 'ignore')}~{digest}"


def sibling(dst: Path, suffix: str) -> Path:
    """The hidden sibling of ``dst`` with ``suffix`` (the lock, a staging or retired directory)."""
    return dst.parent / f"{sibling_stem(dst)}{suffix}"


def siblings(dst: Path, marker: str) -> list[Path]:
    """Existing hidden siblings of ``dst`` whose names continue with ``marker``."""
    return sorted(dst.parent.glob(f"{glob.escape(sibling_stem(dst))}{glob.escape(marker)}*"))


def refuse_unusable_name(dst: Path) -> None:
    """A DST that is a symbolic link, or has a component longer than NAME_MAX, is refused."""
    for part in dst.parts:
        if len(os.fsencode(part)) > NAME_MAX:
            raise DestinationError(f"DST {quote(str(dst), 300)}: the name {quote(part, 40)} is "
                                   f"{len(os.fsencode(part))} bytes, more than the file system's {NAME_MAX}")
    if dst.is_symlink():
        target = os.readlink(dst)
        state = "" if dst.exists() else ", which does not exist"
        raise DestinationError(
            f"DST {dst} is a symbolic link (to {quote(target, 200)}{state}); pgconvert does not write "
            "through a link: give the directory it points to, or remove the link")


def retire(dst: Path) -> Path:
    """Rename the existing output ``dst`` aside (the first rename of ``--overwrite``)."""
    retired = sibling(dst, f"{RETIRED_MARKER}{uuid.uuid4().hex[:12]}")
    dst.rename(retired)
    return retired


def discard(retired: Path, dst: Path) -> None:
    """Delete a retired output: renamed to a partial name first, so a killed deletion never
    leaves a half-deleted directory that looks like a previous output."""
    trash = sibling(dst, f"{PARTIAL_MARKER}{uuid.uuid4().hex[:12]}")
    retired.rename(trash)
    shutil.rmtree(trash)


def recover_retired(dst: Path) -> None:
    """Finish what a killed ``--overwrite`` left (the caller holds DST's lock): restore the previous
    output when DST is missing, otherwise remove the retired copies."""
    retired = siblings(dst, RETIRED_MARKER)
    if not retired:
        return
    if not dst.exists() and not dst.is_symlink():
        newest = max(retired, key=lambda path: path.stat().st_mtime)
        log.warning("restoring %s from %s, left by an --overwrite run killed between its renames", dst, newest)
        newest.rename(dst)
        retired.remove(newest)
    for stale in retired:
        log.warning("removing %s, the previous output left by an interrupted --overwrite", stale)
        discard(stale, dst)


def replace_output(staging: Path, dst: Path) -> None:
    """Make the complete ``staging`` directory DST in place of the existing output, which is deleted."""
    if exchange(staging, dst):
        log.info("replaced %s in one step (renameat2 RENAME_EXCHANGE)", dst)
        fsync_dir(dst.parent)
        shutil.rmtree(staging)  # the staging name, a partial's, now holds the previous output
        return
    log.warning("replacing %s with two renames: this system cannot swap directories in one step, so DST is "
                "absent between them (a run killed there is restored by the next run for DST)", dst)
    retired = retire(dst)
    staging.rename(dst)
    fsync_dir(dst.parent)
    discard(retired, dst)
