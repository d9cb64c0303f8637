"""``--workers``: the files of one conversion written by a pool of processes, then finalized here.

Each worker process opens the conversion's plan once (the pool's initializer) and writes the files
it is given, with their optimizer state where the destination's saver writes it in shares (the same decision and
plan as a sharded run's, ``planned_units``); the open source lives as long as the pool, which lives as long as the
conversion. The plan is opened by the function the caller passes (``convert`` passes its own ``plan``), so this
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
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from pgconvert.errors import ValidationError
from pgconvert.io.output import digests
from pgconvert.formats import PlannedFile, SaveResult
from pgconvert.optimizer.carry import ShardedOptimizer, carry_share, sharded_optimizer
from pgconvert.run.manifest import writing_digest

if TYPE_CHECKING:
    from pgconvert.run.convert import ConvertRequest, Plan

log = logging.getLogger(__name__)

PlanOpener = Callable[["ConvertRequest"], "Plan"]

# The plan this worker process writes from, and the optimizer state it carries (None: none); set by
# ``_open_worker_plan`` (the pool's initializer), so only in pool processes, which end with the conversion.
_worker_plan: Plan | None = None
_worker_carried: ShardedOptimizer | None = None


@dataclass(frozen=True)
class Unit:
    """Files one process writes in one task: a group the saver writes together (``Plan.file_groups``; a TP group's
    rank files, which then share their reads) or a single file, weighing their bytes and those of the optimizer files
    written with them."""

    relpaths: tuple[str, ...]
    nbytes: int


def _unit_of(item: Unit | PlannedFile) -> Unit:
    return item if isinstance(item, Unit) else Unit((item.relpath,), item.nbytes)


def balanced_shares(items: Sequence[Unit | PlannedFile], count: int) -> list[list[str]]:
    """Split units (or files) into ``count`` shares of nearly equal bytes (largest first onto the lightest); a
    unit's files stay in one share.

    Deterministic: ties break by path and share index, so every process computes the same split.
    """
    shares: list[list[str]] = [[] for _ in range(count)]
    heap = [(0, index) for index in range(count)]
    for unit in sorted(map(_unit_of, items), key=lambda u: (-u.nbytes, u.relpaths)):
        total, index = heapq.heappop(heap)
        shares[index].extend(unit.relpaths)
        heapq.heappush(heap, (total + unit.nbytes, index))
    return shares


def _weighed_files(conversion: Plan, carried: ShardedOptimizer | None) -> list[PlannedFile]:
    """The model files (``Plan.files``), each weighing its bytes and those of the optimizer files written with it
    (``OptimizerFile.written_with``: a Megatron rank's optimizer entry and ``distrib_optim.pt`` go with its rank
    file), and the optimizer files of their own (torch_dist's records files)."""
    if carried is None:
        return list(conversion.files)
    added: dict[str, int] = {}
    alone = []
    for item in carried.files:
        if item.written_with is None:
            alone.append(PlannedFile(item.relpath, item.tensors, item.nbytes))
        else:
            added[item.written_with] = added.get(item.written_with, 0) + item.nbytes
    return [replace(item, nbytes=item.nbytes + added.get(item.relpath, 0)) for item in conversion.files] + alone


def planned_units(conversion: Plan, carried: ShardedOptimizer | None, count: int) -> list[Unit]:
    """What ``count`` processes share out, one plan for the model and its optimizer state: the saver's groups of
    files written together (``Plan.file_groups``) and every other file alone (``_weighed_files``). While there are
    fewer units than processes, the heaviest group is split in two, so that every process has work: its halves each
    share their reads still."""
    weighed = {item.relpath: item for item in _weighed_files(conversion, carried)}
    grouped = [tuple(path for path in group if path in weighed) for group in conversion.file_groups]
    grouped = [group for group in grouped if group]
    members = {path for group in grouped for path in group}
    units = [Unit(group, sum(weighed[path].nbytes for path in group)) for group in grouped]
    units += [Unit((path,), item.nbytes) for path, item in weighed.items() if path not in members]
    while len(units) < count and any(len(unit.relpaths) > 1 for unit in units):
        largest = max((unit for unit in units if len(unit.relpaths) > 1), key=lambda u: (u.nbytes, u.relpaths))
        units.remove(largest)
        half = (len(largest.relpaths) + 1) // 2
        for part in (largest.relpaths[:half], largest.relpaths[half:]):
            units.append(Unit(part, sum(weighed[path].nbytes for path in part)))
    return units


def carried_in_processes(conversion: Plan) -> ShardedOptimizer | None:
    """The optimizer state processes carry in shares (``carry.sharded_optimizer``), when the destination's saver
    writes it in shares (``Saver.optimizer_partial``); None otherwise, with no notice (the single-process step
    carries it then)."""
    return sharded_optimizer(conversion) if conversion.saver.optimizer_partial else None


def require_partial(conversion: Plan) -> None:
    if not conversion.saver.supports_partial:
        raise ValidationError(
            f"the {conversion.dst_format} saver writes its files in one pass; --workers and sharded "
            "runs need a destination format that can be split (megatron, torch_dist, hf)"
        )


def _open_worker_plan(open_plan: PlanOpener, request: ConvertRequest) -> None:
    global _worker_plan, _worker_carried
    _worker_plan = open_plan(request)
    _worker_carried = carried_in_processes(_worker_plan)
    # Pool processes run multiprocessing's finalizers when they exit: the source is closed then.
    multiprocessing.util.Finalize(None, _worker_plan.source.close, exitpriority=10)


def _write(conversion: Plan, carried: ShardedOptimizer | None, staging: str,
           relpaths: Sequence[str]) -> tuple[list[PlannedFile], list[str]]:
    """``relpaths``' model files, and the optimizer state that goes into or beside them or stands alone in them;
    the saver's notices and those the source gave while its tensors were read for them (a worker process's source
    is its own: what it names would be lost otherwise)."""
    named = len(conversion.source.notices)
    with digests(writing_digest(conversion)):
        result = conversion.saver.save(conversion.source, Path(staging), conversion.save_options,
                                       lambda nbytes: None, only=set(relpaths))
        if carried is not None:
            carry_share(conversion, carried, Path(staging), result.files, set(relpaths))
    return result.files, result.notices + conversion.source.notices[named:]


def write_files(request: ConvertRequest, staging: str, relpaths: Sequence[str],
                open_plan: PlanOpener | None = None) -> tuple[list[PlannedFile], list[str]]:
    """Write ``relpaths`` of the planned destination into ``staging``.

    In a pool process, from the plan its initializer opened; elsewhere from a plan opened with
    ``open_plan`` for this call and closed before returning.
    """
    if _worker_plan is not None and _worker_plan.request == request:
        return _write(_worker_plan, _worker_carried, staging, relpaths)
    if open_plan is None:
        raise ValueError("write_files outside a worker pool needs open_plan")
    conversion = open_plan(request)
    try:
        return _write(conversion, carried_in_processes(conversion), staging, relpaths)
    finally:
        conversion.source.close()


def save_with_workers(conversion: Plan, staging: Path, workers: int, max_memory: int | None,
                      progress: Callable[[int], None], open_plan: PlanOpener,
                      carried: ShardedOptimizer | None = None) -> SaveResult:
    """Write the planned files with a pool of ``workers`` processes, then finalize here; with ``carried``
    (``carried_in_processes``), each file's optimizer state too, and optimizer files of their own, in the same
    processes (``planned_units``); what they share is the caller's (``carry.finalize_carried``).

    At most ``max_memory`` bytes of destination files are in flight at once, each file counted at its
    full size with its optimizer state (a bound: a file is streamed, so a worker holds about its largest tensor
    and its write buffers); a single file larger than the budget runs alone. ``open_plan``
    (picklable) opens the conversion's plan in each worker process.
    """
    require_partial(conversion)
    budget = max_memory if max_memory is not None else float("inf")
    pending = deque(sorted(planned_units(conversion, carried, workers), key=lambda u: (-u.nbytes, u.relpaths)))
    if any(unit.nbytes > budget for unit in pending):
        log.warning("a destination file (or a group of files written together) is larger than --max-memory; it is "
                    "written alone")
    model_bytes = {item.relpath: item.nbytes for item in conversion.files}
    result = SaveResult()
    notices: set[str] = set()
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=workers, mp_context=context, initializer=_open_worker_plan,
                             initargs=(open_plan, conversion.request)) as pool:
        in_flight: dict[Future[tuple[list[PlannedFile], list[str]]], Unit] = {}
        used = 0
        try:
            while pending or in_flight:
                while pending and len(in_flight) < workers and (not in_flight or used + pending[0].nbytes <= budget):
                    unit = pending.popleft()
                    in_flight[pool.submit(write_files, conversion.request, str(staging), list(unit.relpaths))] = unit
                    used += unit.nbytes
                done, _ = wait(in_flight, return_when=FIRST_COMPLETED)
                for future in done:
                    unit = in_flight.pop(future)
                    used -= unit.nbytes
                    files, file_notices = future.result()
                    result.files += files
                    notices.update(file_notices)
                    progress(sum(model_bytes.get(path, 0) for path in unit.relpaths))  # the bar counts the model's
        except BaseException:
            for future in in_flight:
                future.cancel()
            raise
    order = {item.relpath: index for index, item in enumerate(conversion.files)}
    result.files.sort(key=lambda f: order.get(f.relpath, len(order)))
    result.notices = sorted(notices - set(conversion.source.notices))
    result.notices += conversion.saver.finalize(conversion.source, staging, conversion.save_options)
    return result
