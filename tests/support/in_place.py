"""Counting the bytes ``OutputFile.write_in_place`` writes from their own memory (not staged)."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future

import pytest

from pgconvert.io import output


def count_in_place(monkeypatch: pytest.MonkeyPatch) -> Callable[[], int]:
    """From now on, count the bytes of each ``write_in_place`` call that went in place; returns the counter."""
    placed = 0
    real = output.OutputFile.write_in_place

    def counted(self: output.OutputFile, data: memoryview) -> list[Future[None]]:
        nonlocal placed
        futures = real(self, data)
        placed += memoryview(data).nbytes if futures else 0
        return futures

    monkeypatch.setattr(output.OutputFile, "write_in_place", counted)
    return lambda: placed
