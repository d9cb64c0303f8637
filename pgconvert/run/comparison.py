"""What ``verify`` reports of a difference, and the blockwise value comparison it and the optimizer comparison
share."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

# Elements compared at a time, in float64: 32 MiB per operand.
COMPARE_BLOCK = 4 * 1024 * 1024

DifferenceKind = Literal["values", "shape", "dtype", "missing", "unreadable", "config", "inexact"]


@dataclass(frozen=True)
class TensorDifference:
    """One way the checkpoints differ; ``max_abs_diff``/``differing`` are set for value differences."""

    name: str
    kind: DifferenceKind
    message: str
    max_abs_diff: float | None = None
    differing: int | None = None
    numel: int | None = None


def compare_values(a: torch.Tensor, b: torch.Tensor, rtol: float, atol: float) -> tuple[int, float]:
    """(elements not within ``atol + rtol·|b|``, max abs difference) of two same-shape tensors.

    NaN equals NaN and an infinity equals itself, so a checkpoint compared with itself is equal.
    """
    flat_a, flat_b = a.reshape(-1), b.reshape(-1)
    differing = 0
    max_abs = 0.0
    for start in range(0, flat_a.numel(), COMPARE_BLOCK):
        block_a = flat_a[start:start + COMPARE_BLOCK].to(torch.float64)
        block_b = flat_b[start:start + COMPARE_BLOCK].to(torch.float64)
        same = (block_a == block_b) | (block_a.isnan() & block_b.isnan())
        if bool(same.all()):
            continue
        diff = (block_a - block_b).abs().masked_fill(same, 0.0).nan_to_num(nan=math.inf, posinf=math.inf)
        close = same | (diff <= atol + rtol * block_b.abs())
        differing += int((~close).sum())
        max_abs = max(max_abs, float(diff.max()))
    return differing, max_abs


def record_values(name: str, tensor_a: torch.Tensor, tensor_b: torch.Tensor, into: list[TensorDifference],
                  rtol: float, atol: float, where: str | None) -> None:
    """A ``values`` difference of two same-shape tensors appended to ``into`` where any element differs beyond
    ``atol + rtol·|b|`` (``where``: which part of the tensor was compared)."""
    differing, max_abs = compare_values(tensor_a, tensor_b, rtol, atol)
    if differing:
        into.append(TensorDifference(
            name, "values",
            f"{differing} of {tensor_a.numel()} elements differ{f' in the {where}' if where else ''}, "
            f"max abs diff {max_abs:.6g}",
            max_abs_diff=max_abs, differing=differing, numel=tensor_a.numel(),
        ))
