"""Element counts and byte sizes of tensors known by shape and dtype, without allocating them."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch


def numel(shape: tuple[int, ...]) -> int:
    return math.prod(shape)


def itemsize(dtype: torch.dtype) -> int:
    """Bytes per element of ``dtype`` (``dtype.itemsize``: no tensor is made)."""
    return dtype.itemsize


def dtype_name(dtype: torch.dtype) -> str:
    """``dtype`` as messages and configs name it: ``bfloat16``, ``float32``."""
    return str(dtype).removeprefix("torch.")


def nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return numel(shape) * itemsize(dtype)


def contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    """The strides, in elements, of a row-major tensor of ``shape`` (as ``torch.empty(shape).stride()``)."""
    stride, step = [], 1
    for size in reversed(shape):
        stride.append(step)
        step *= max(size, 1)
    return tuple(reversed(stride))
