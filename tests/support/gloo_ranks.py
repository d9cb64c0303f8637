"""Fork one process per rank for the megatron-core checks that run on gloo (test code only)."""

from __future__ import annotations

import importlib
import multiprocessing
import os
import tempfile
from collections.abc import Callable
from typing import Any


def run_ranks(target: Callable[..., None], world: int, *args: Any, where: str = "") -> None:
    """``target(rank, world, store_path, *args)`` in ``world`` forked processes sharing a file store;
    raises SystemExit naming ``where`` and the ranks that failed."""
    context = multiprocessing.get_context("fork")
    with tempfile.TemporaryDirectory() as tmp:
        ranks = [context.Process(target=target, args=(rank, world, f"{tmp}/store", *args)) for rank in range(world)]
        for process in ranks:
            process.start()
        for process in ranks:
            process.join()
    failed = [rank for rank, process in enumerate(ranks) if process.exitcode != 0]
    if failed:
        raise SystemExit(f"{where + ': ' if where else ''}ranks {failed} failed")


def prepare_forks() -> None:
    """The start of a gloo script run as a program: no CUDA device, one CUDA connection (megatron-core asks), and
    megatron-core's optimizer package imported once, before the forks (each rank then starts from it)."""
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    importlib.import_module("megatron.core.optimizer")
