"""Independent output files produced on a small pool of threads (``--threads``).

Most of the time of writing a destination file goes to system calls (``preadv``, ``pwrite``, ``fsync``)
and torch kernels (a join, a cast, a finiteness scan), all of which release the GIL, so two files produced
at once on two threads use two cores. ``run_each`` runs one task per file:

- each task runs in a copy of the submitting thread's context (``contextvars.copy_context``), taken
  when it is submitted: threads do not inherit context variables, and ``io.output.digests``, the joins
  a loader installs (``rules.concatenating_with``) and the memory lent to a record (``io.reuse``) are
  context variables; each task mutates its own copy, never its neighbour's;
- the first task to fail stops the others: tasks not started are cancelled, and one in progress
  stops at its next write (``OutputFile.write`` calls ``check_running``), so the error the caller sees
  is the failed file's and nothing waits for a file that will be thrown away.

With one thread (or one task) the tasks run here, one after another, exactly as without a pool.
"""

from __future__ import annotations

import contextvars
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from typing import TypeVar

T = TypeVar("T")

# The events that tell the task this context runs to stop: its pool's (set when another task of the pool
# failed), and those of the pools around it when the task runs a pool of its own (sibling files in lockstep).
_STOP: contextvars.ContextVar[tuple[threading.Event, ...]] = contextvars.ContextVar("pgconvert_stop", default=())


class Stopped(Exception):
    """Raised in a task whose pool is stopping because another task failed; never reaches the caller."""


def check_running() -> None:
    """Raise ``Stopped`` when another file of this pool, or of a pool around it, failed (a no-op outside a
    pool)."""
    if any(stop.is_set() for stop in _STOP.get()):
        raise Stopped


def _run_task(stop: threading.Event, failures: list[BaseException], task: Callable[[], T]) -> T:
    _STOP.set((*_STOP.get(), stop))  # the context copied at submission holds the enclosing pools' events
    check_running()
    try:
        return task()
    except Stopped:
        raise
    except BaseException as error:
        failures.append(error)  # before the event, so the first failure is first in the list
        stop.set()
        raise


def serialized(callback: Callable[[int], None]) -> Callable[[int], None]:
    """``callback`` called by one thread at a time (a progress bar updated from every file's thread)."""
    lock = threading.Lock()

    def call(value: int) -> None:
        with lock:
            callback(value)

    return call


def run_each(tasks: Sequence[Callable[[], T]], threads: int) -> list[T]:
    """Each task's result, in the tasks' order, running up to ``threads`` of them at once.

    The first task's exception to be raised (a ``Stopped`` never) is raised here once every started
    task has ended; a ``KeyboardInterrupt`` here stops the tasks the same way.
    """
    if threads <= 1 or len(tasks) <= 1:
        return [task() for task in tasks]
    stop = threading.Event()
    failures: list[BaseException] = []
    with ThreadPoolExecutor(min(threads, len(tasks)), thread_name_prefix="pgconvert-file") as pool:
        # One copy per task, taken here in the submitting thread: a context runs in one thread at a time.
        futures: list[Future[T]] = [pool.submit(contextvars.copy_context().run, _run_task, stop, failures, task)
                                    for task in tasks]
        try:
            wait(futures, return_when=FIRST_EXCEPTION)
        finally:
            if not all(future.done() for future in futures):
                stop.set()
                for future in futures:
                    future.cancel()
    if failures:
        raise failures[0]
    return [future.result() for future in futures]


# Threads one computation is spread over (``spread``): the calling thread and helpers, at most this many in all.
SPREAD_THREADS = min(4, os.cpu_count() or 1)
_helpers: ThreadPoolExecutor | None = None
_helpers_lock = threading.Lock()


def spread(work: Callable[[int, int], None], threads: int | None = None) -> None:
    """Call ``work(index, count)`` for each index below ``count`` (``SPREAD_THREADS`` unless given) at once: index 0
    on this thread, the others on a pool of helper threads made on first use. For work whose kernels release the
    GIL (numpy, reads) and run on their calling thread, where torch's intra-op pool would spin between many small
    kernels. Returns once every call has returned; raises the first exception any of them raised."""
    count = max(1, SPREAD_THREADS if threads is None else threads)
    if count == 1:
        work(0, 1)
        return
    pool = _helper_pool()
    futures = [pool.submit(contextvars.copy_context().run, work, index, count) for index in range(1, count)]
    try:
        work(0, count)
    finally:
        wait(futures)  # helpers may still be writing into what the caller owns
    for future in futures:
        future.result()


def _helper_pool() -> ThreadPoolExecutor:
    """The helper threads of ``spread`` (``SPREAD_THREADS`` - 1 of them; more calls than that wait their turn)."""
    global _helpers
    with _helpers_lock:
        if _helpers is None:
            _helpers = ThreadPoolExecutor(max(1, SPREAD_THREADS - 1), thread_name_prefix="pgconvert-spread")
        return _helpers
