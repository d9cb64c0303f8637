"""The NaN/Inf check on bits (``formats.stream.all_finite``) against torch.isfinite, dtype by dtype."""

from __future__ import annotations

import pytest
import torch

from pgconvert.formats import stream
from pgconvert.formats.stream import FINITE_CHECK_CHUNK, all_finite, nonfinite_text

FLOATS = [torch.float64, torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2]
SPECIAL = [float("nan"), float("inf"), float("-inf"), -float("nan")]


def _every_pattern(dtype: torch.dtype) -> torch.Tensor:
    """Every bit pattern of a 1- or 2-byte float (both signs, subnormals, the largest finite, NaN, Inf)."""
    width = torch.finfo(dtype).bits
    codes = torch.arange(1 << width, dtype=torch.int32)
    return codes.to(torch.uint8 if width == 8 else torch.int16).view(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2])
def test_every_bit_pattern_is_judged_as_isfinite_judges_it(dtype: torch.dtype) -> None:
    patterns = _every_pattern(dtype)
    expected = torch.isfinite(patterns.float())
    judged = torch.tensor([all_finite(patterns[index:index + 1]) for index in range(patterns.numel())])
    assert torch.equal(judged, expected)
    assert all_finite(patterns[expected]) and not all_finite(patterns)


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("value", SPECIAL)
@pytest.mark.parametrize("where", [0, FINITE_CHECK_CHUNK - 1, FINITE_CHECK_CHUNK, 2 * FINITE_CHECK_CHUNK + 6])
def test_one_planted_value_is_found_in_any_chunk(dtype: torch.dtype, value: float, where: int) -> None:
    span = torch.linspace(-1.0, 1.0, 2 * FINITE_CHECK_CHUNK + 7, dtype=torch.float64)
    values = (span * torch.finfo(dtype).max).to(dtype)  # from the lowest to the largest finite value
    assert all_finite(values)
    if dtype == torch.float8_e4m3fn and value in (float("inf"), float("-inf")):
        value = float("nan")  # e4m3fn has no Inf: the conversion saturates, so plant its NaN
    values[where] = value
    assert not all_finite(values)
    assert nonfinite_text(values) == f"1 of {values.numel()} values are NaN or Inf " + (
        "(1 NaN)" if value != value else "(1 Inf)")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_strided_view_is_checked_on_its_own_elements(dtype: torch.dtype) -> None:
    grid = torch.zeros(64, 80, dtype=dtype)
    grid[3, 70] = float("inf")  # outside the view below
    assert all_finite(grid[:, :64]) and not all_finite(grid)
    grid[5, 1] = float("nan")
    assert not all_finite(grid[:, :64].t())


def test_a_float_type_without_bit_rules_is_widened(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(stream, "_NONFINITE_BITS", {})
    values = torch.ones(FINITE_CHECK_CHUNK + 3, dtype=torch.bfloat16)
    assert all_finite(values)
    values[-1] = float("-inf")
    assert not all_finite(values)
