"""The bytes ``torch.save`` writes, with its CRC setting chosen: the reference for pgconvert's streaming writer."""

from __future__ import annotations

import io
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.utils.serialization


@contextmanager
def torch_crc32(enabled: bool) -> Iterator[None]:
    """torch.save's own (process-wide) CRC setting, for the reference files only."""
    config = torch.utils.serialization.config.save
    previous = config.compute_crc32
    config.compute_crc32 = enabled
    try:
        yield
    finally:
        config.compute_crc32 = previous


def torch_save_bytes(obj: Any, crc32: bool) -> bytes:
    buffer = io.BytesIO()
    with torch_crc32(crc32):
        torch.save(obj, buffer)
    return buffer.getvalue()
