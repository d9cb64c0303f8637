"""File digests as the manifest records them: ``<algorithm>:<hex>``, the algorithm named in the value.

``xxh3-128`` (the default, ``--digest``): XXH3's 128-bit hash, about 0.05 CPU-seconds per GiB, which finds any
corruption, truncation or change of a file but is not made to resist someone forging a file on purpose.
``sha256``: a cryptographic digest at about 0.6 CPU-seconds per GiB, and what megatron-core's
``integrity.json`` records (a torch_dist output in megatron-core 0.19's form gets it for its files anyway).
A manifest from before digests named their algorithm records a bare ``sha256`` field; it reads as ``sha256:…``.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Protocol

from pgconvert.errors import CheckpointError
from pgconvert.io.limits import quote

DEFAULT_ALGORITHM = "xxh3-128"
ALGORITHMS = ("xxh3-128", "sha256")
_HEX_DIGITS = {"xxh3-128": 32, "sha256": 64}
# Large enough that hashing runs at disk speed, small enough to stay out of the memory budget.
READ_BYTES = 8 * 1024 * 1024


class Hasher(Protocol):
    def update(self, data: bytes | memoryview, /) -> None: ...

    def hexdigest(self) -> str: ...


def new_hasher(algorithm: str) -> Hasher:
    """A fresh hasher of ``algorithm`` (one of ``ALGORITHMS``); its ``update`` releases the GIL."""
    if algorithm == "sha256":
        return hashlib.sha256()
    if algorithm == "xxh3-128":
        import xxhash

        hasher: Hasher = xxhash.xxh3_128()
        return hasher
    raise ValueError(f"unknown digest algorithm {algorithm!r} (known: {', '.join(ALGORITHMS)})")


def labelled(algorithm: str, hexdigest: str) -> str:
    """The digest as the manifest records it."""
    return f"{algorithm}:{hexdigest}"


def algorithm_of(digest: str, where: Path | str) -> str:
    """The algorithm a recorded digest names; a value that is not ``<known algorithm>:<hex of its length>`` is a
    ``CheckpointError`` naming ``where``."""
    algorithm, _, hexdigest = digest.partition(":")
    if algorithm not in _HEX_DIGITS:
        raise CheckpointError(f"{where}: digest {quote(digest)}: the algorithm must be one of "
                              f"{', '.join(ALGORITHMS)}, as '<algorithm>:<hex digits>'")
    if len(hexdigest) != _HEX_DIGITS[algorithm] or hexdigest.strip("0123456789abcdef"):
        raise CheckpointError(f"{where}: digest {quote(digest)}: a {algorithm} digest is "
                              f"{_HEX_DIGITS[algorithm]} lowercase hex digits")
    return algorithm


def hex_of(digest: str, algorithm: str) -> str | None:
    """The hex digits of a labelled digest when ``algorithm`` made it, else None."""
    named, _, hexdigest = digest.partition(":")
    return hexdigest if named == algorithm else None


def file_hexdigest(path: Path, algorithm: str, block: int = READ_BYTES) -> tuple[str, int]:
    """``algorithm``'s hex digest and the size of ``path`` in one streaming pass, ``block`` bytes in memory."""
    hasher = new_hasher(algorithm)
    size = 0
    with open(path, "rb") as handle:
        while chunk := handle.read(block):
            hasher.update(chunk)
            size += len(chunk)
    return hasher.hexdigest(), size


def file_digest(path: Path, algorithm: str) -> tuple[str, int]:
    """The labelled digest and size of ``path`` in one streaming pass (constant memory, any file size)."""
    hexdigest, size = file_hexdigest(path, algorithm)
    return labelled(algorithm, hexdigest), size
