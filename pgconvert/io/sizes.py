"""Element counts and byte sizes of tensors known by shape and dtype, without allocating them."""

from __future__ import annotations

import math

import torch


def numel(shape: tuple[int, ...]) -> int:
    return math.prod(shape)


def itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return numel(shape) * itemsize(dtype)
