"""megatron-core's integrity manifest of a torch_dist checkpoint (``integrity.json``): written and checked.

megatron-core 0.17.1 and later (``dist_checkpointing/validation.py``: ``save_integrity_manifest``,
``verify_integrity_manifest``; Megatron-LM ``--verify-integrity``) write, after ``metadata.json``, a JSON file
in the iteration directory::

    {
      "algorithm": "sha256",
      "files": {
        ".metadata": "<sha256 hex>",
        "__0_0.distcp": "...",
        ...
      }
    }

(``json.dump(..., indent=2)``, no trailing newline): the SHA-256 of every regular file of the directory but
the manifest itself, sorted by name. ``dist_checkpointing.save(verify_integrity=True)`` writes it;
``dist_checkpointing.load(verify_integrity=True)`` re-hashes every listed file and refuses a mismatch or a
missing file (files not listed are not looked at), and refuses a checkpoint without the manifest.

pgconvert writes it for a torch_dist output in megatron-core 0.19's form (``--dst-torch-dist-common store``,
so a Megatron-LM run with ``--verify-integrity`` loads it), from the digests computed while the files were
written where it has them, and checks it whenever it reads a torch_dist checkpoint that has one: a mismatch
is an ``IntegrityError`` naming the file and both digests. Reading re-hashes the small files and requires the
data files to be there (``INTEGRITY_CHECKS``); ``--verify-integrity`` and ``verify`` re-hash the data files too,
which costs what hashing costs (about 0.6 CPU-seconds per GiB), as megatron-core's own load does only when asked.
Files are hashed several at once (``HASH_THREADS``: the hasher and file reads release the GIL), so the check runs
at the disk's speed on a machine with the cores.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from pgconvert.errors import CheckpointError, IntegrityError
from pgconvert.io.digest import file_hexdigest
from pgconvert.io.durable import fsync_file
from pgconvert.io.limits import quote, read_json

INTEGRITY_FILE = "integrity.json"
INTEGRITY_ALGORITHM = "sha256"
DATA_SUFFIX = ".distcp"  # the store's data files: all but a few KiB to MiB of a checkpoint's bytes
# How much of a source's manifest is checked when it is read (``LoadOptions.verify_integrity``): every listed file
# re-hashed (``--verify-integrity``, as Megatron-LM's flag of that name), the data files only found and the rest
# re-hashed (the default: a changed .metadata or common state is caught, a changed tensor byte is not), or nothing
# (a ``--workers`` pool's processes, whose source the planning process checked).
INTEGRITY_CHECKS = ("full", "metadata", "off")
_READ_BYTES = 1 << 20  # megatron-core's _READ_CHUNK_SIZE
_DIGEST = re.compile(r"[0-9a-f]{64}")
# Files hashed at once: one 1 MiB block each in memory.
HASH_THREADS = min(8, os.cpu_count() or 1)


def file_sha256(path: Path) -> str:
    """The SHA-256 hex digest of ``path``, read in 1 MiB blocks."""
    return file_hexdigest(path, INTEGRITY_ALGORITHM, _READ_BYTES)[0]


def files_sha256(paths: Iterable[Path]) -> dict[Path, str]:
    """``file_sha256`` of each of ``paths``, up to ``HASH_THREADS`` files at a time."""
    paths = list(paths)
    if len(paths) < 2 or HASH_THREADS < 2:
        return {path: file_sha256(path) for path in paths}
    with ThreadPoolExecutor(max_workers=min(HASH_THREADS, len(paths)), thread_name_prefix="sha256") as pool:
        return dict(zip(paths, pool.map(file_sha256, paths)))


def manifest_text(directory: Path, known: Mapping[str, tuple[str, int]] | None = None) -> str:
    """The manifest of ``directory`` as megatron-core writes it. ``known``: name -> (sha256, size) of files
    whose digest was computed while they were written; one whose size on disk differs is hashed again."""
    files: dict[str, str | None] = {}
    for path in sorted(directory.iterdir(), key=str):
        if not path.is_file() or path.name == INTEGRITY_FILE:
            continue
        digest, size = (known or {}).get(path.name, (None, None))
        files[path.name] = digest if digest is not None and size == path.stat().st_size else None
    hashed = files_sha256(directory / name for name, digest in files.items() if digest is None)
    done = {name: digest or hashed[directory / name] for name, digest in files.items()}
    return json.dumps({"algorithm": INTEGRITY_ALGORITHM, "files": done}, indent=2)


def write_integrity_manifest(directory: Path, known: Mapping[str, tuple[str, int]] | None = None) -> Path:
    """``integrity.json`` of ``directory``, written last (after every other file of it is final)."""
    path = directory / INTEGRITY_FILE
    path.write_text(manifest_text(directory, known), encoding="utf-8")
    fsync_file(path)
    return path


def _read_manifest(path: Path) -> dict[str, str]:
    """The manifest's ``files``, each a plain file name with a lowercase SHA-256 hex digest."""
    doc = read_json(path)
    if not isinstance(doc, dict) or not isinstance(doc.get("files"), dict):
        raise CheckpointError(f"{path}: expected a JSON object with a 'files' object (megatron-core's integrity "
                              "manifest)")
    algorithm = doc.get("algorithm", INTEGRITY_ALGORITHM)
    if algorithm != INTEGRITY_ALGORITHM:
        raise CheckpointError(f"{path}: algorithm={quote(algorithm)}: only {INTEGRITY_ALGORITHM!r} is supported "
                              "(as by megatron-core)")
    files: dict[str, str] = doc["files"]
    for name, digest in files.items():
        if name in ("", ".", "..") or "/" in name or os.sep in name:
            raise CheckpointError(f"{path}: file name {quote(name)}: the manifest lists files of its own directory")
        if not isinstance(digest, str) or not _DIGEST.fullmatch(digest):
            raise CheckpointError(f"{path}: {quote(name)}: digest {quote(digest)} is not a SHA-256 hex digest")
    return files


def integrity_problems(directory: Path, data_files: bool = True) -> tuple[bool, list[str]]:
    """Whether ``directory`` has a manifest, and each listed file that is missing or whose SHA-256 differs
    (file, expected and actual digest); ``data_files`` False: the ``.distcp`` data files are only required to be
    there, the others (``.metadata``, ``metadata.json``, ``common.pt``: a few KiB to MiB) re-hashed."""
    path = directory / INTEGRITY_FILE
    if not path.is_file():
        return False, []
    listed = _read_manifest(path)
    present = [directory / name for name in listed
               if not (directory / name).is_symlink() and (directory / name).is_file()]
    actual = files_sha256(target for target in present if data_files or target.suffix != DATA_SUFFIX)
    problems = []
    for name, expected in listed.items():
        target = directory / name
        if target not in present:
            problems.append(f"{target}: listed in {INTEGRITY_FILE} (sha256 {expected}) but missing (or not a regular "
                            "file)")
        elif target in actual and actual[target] != expected:
            problems.append(f"{target}: sha256 {actual[target]}, but {INTEGRITY_FILE} records {expected}")
    return True, problems


def check_integrity(directory: Path, data_files: bool = True) -> bool:
    """Raise an ``IntegrityError`` naming every listed file that does not match ``integrity.json`` (its data
    files re-hashed only with ``data_files``); whether the directory has the manifest at all."""
    present, problems = integrity_problems(directory, data_files)
    if problems:
        raise IntegrityError(f"{directory / INTEGRITY_FILE}: integrity check failed for {len(problems)} file(s): "
                             + "; ".join(problems))
    return present
