"""``--workers``: the files of one conversion written by a pool of processes, then finalized here.

Each worker process opens the conversion's plan once (the pool's initializer) and writes the files
it is given; the open source lives as long as the pool, which lives as long as the conversion. The
plan is opened by the function the caller passes (``convert`` passes its own ``plan``), so this
module does not import the orchestrator.
"""

from __future__ import annotations

import heapq
import logging
import multiprocessing
import multiprocessing.util
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from pathlib import Path
from typing import TYPE_CHECKING

from pgconvert.errors import ValidationError
from pgconvert.io.output import digests
from pgconvert.formats import PlannedFile, SaveResult

if TYPE_CHECKING:
    from pgconvert.run.convert import ConvertRequest, Plan

log = logging.getLogger(__name__)

PlanOpener = Callable[["ConvertRequest"], "Plan"]

# The plan this worker process writes from; set by ``_open_worker_plan`` (the pool's initializer),
# so only in pool processes, which end with the conversion.
_worker_plan: Plan | None = None


def balanced_shares(files: Sequence[PlannedFile], count: int) -> list[list[str]]:
    """Split files into ``count`` shares of nearly equal bytes (largest first onto the lightest).

    Deterministic: ties break by path and share index, so every process computes the same split.
    """
    shares: list[list[str]] = [[] for _ in range(count)]
    heap = [(0, index) for index in range(count)]
    for item in sorted(files, key=lambda f: (-f.nbytes, f.relpath)):
        total, index = heapq.heappop(heap)
        shares[index].append(item.relpath)
        heapq.heappush(heap, (total + item.nbytes, index))
    return shares


def require_partial(conversion: Plan) -> None:
    if not conversion.saver.supports_partial:
        raise ValidationError(
            f"the {conversion.dst_format} saver writes its files in one pass; --workers and sharded "
            "runs need a destination format that can be split (megatron, torch_dist, hf)"
        )


def _open_worker_plan(open_plan: PlanOpener, request: ConvertRequest) -> None:
    global _worker_plan
    _worker_plan = open_plan(request)
    # Pool processes run multiprocessing's finalizers when they exit: the source is closed then.
    multiprocessing.util.Finalize(None, _worker_plan.source.close, exitpriority=10)


def _write(conversion: Plan, staging: str, relpaths: Sequence[str]) -> tuple[list[PlannedFile], list[str]]:
    with digests(conversion.request.digest != "none"):
        result = conversion.saver.save(conversion.source, Path(staging), conversion.save_options,
                                       lambda nbytes: None, only=set(relpaths))
    return result.files, result.notices


def write_files(request: ConvertRequest, staging: str, relpaths: Sequence[str],
                open_plan: PlanOpener | None = None) -> tuple[list[PlannedFile], list[str]]:
    """Write ``relpaths`` of the planned destination into ``staging``.

    In a pool process, from the plan its initializer opened; elsewhere from a plan opened with
    ``open_plan`` for this call and closed before returning.
    """
    if _worker_plan is not None and _worker_plan.request == request:
        return _write(_worker_plan, staging, relpaths)
    if open_plan is None:
        raise ValueError("write_files outside a worker pool needs open_plan")
    conversion = open_plan(request)
    try:
        return _write(conversion, staging, relpaths)
    finally:
        conversion.source.close()


def save_with_workers(conversion: Plan, staging: Path, workers: int, max_memory: int | None,
                      progress: Callable[[int], None], open_plan: PlanOpener) -> SaveResult:
    """Write the planned files with a pool of ``workers`` processes, then finalize here.

    At most ``max_memory`` bytes of destination files are in flight at once, each file counted at its
    full size (a bound: a file is streamed, so a worker holds about its largest tensor and its write
    buffers); a single file larger than the budget runs alone. ``open_plan``
    (picklable) opens the conversion's plan in each worker process.
    """
    require_partial(conversion)
    budget = max_memory if max_memory is not None else float("inf")
    pending = deque(sorted(conversion.files, key=lambda f: (-f.nbytes, f.relpath)))
    if any(item.nbytes > budget for item in pending):
        log.warning("a destination file is larger than --max-memory; it is written alone")
    result = SaveResult()
    notices: set[str] = set()
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=workers, mp_context=context, initializer=_open_worker_plan,
                             initargs=(open_plan, conversion.request)) as pool:
        in_flight: dict[Future[tuple[list[PlannedFile], list[str]]], PlannedFile] = {}
        used = 0
        try:
            while pending or in_flight:
                while pending and len(in_flight) < workers and (not in_flight or used + pending[0].nbytes <= budget):
                    item = pending.popleft()
                    in_flight[pool.submit(write_files, conversion.request, str(staging), [item.relpath])] = item
                    used += item.nbytes
                done, _ = wait(in_flight, return_when=FIRST_COMPLETED)
                for future in done:
                    item = in_flight.pop(future)
                    used -= item.nbytes
                    files, file_notices = future.result()
                    result.files += files
                    notices.update(file_notices)
                    progress(item.nbytes)
        except BaseException:
            for future in in_flight:
                future.cancel()
            raise
    order = {item.relpath: index for index, item in enumerate(conversion.files)}
    result.files.sort(key=lambda f: order.get(f.relpath, len(order)))
    result.notices = sorted(notices)
    result.notices += conversion.saver.finalize(conversion.source, staging, conversion.save_options)
    return result
