"""One conversion spread over processes (``--workers``) and hosts (torchrun, Slurm arrays).

The plan is computed from the source's metadata alone, so every process computes the same one and
takes a deterministic share of the destination files, balanced by bytes. The conversion itself
still runs on fake process groups in each process; torch.distributed is used, when launched by
torchrun, only for its key-value store (``torch.distributed.rendezvous``), never for a process
group. Output is complete or absent: shares are written into one staging directory that is
renamed into place only after every share is done. Optimizer state goes with the files of one plan (``shares``):
a Megatron rank's optimizer state is written by the process that writes its rank file, torch_dist's records files
are shared out beside the model's data files, and the finalizing process writes what they have in common.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import astuple, dataclass
from datetime import timedelta
from pathlib import Path
from typing import Protocol

from pgconvert.io.output import digests
from pgconvert.run.convert import ConvertRequest, Plan, plan, promote
from pgconvert.run.manifest import hashing, writing_digest
from pgconvert.run.destination import SHARED_STAGING_MARKER, sibling
from pgconvert.errors import ConversionError, ValidationError
from pgconvert.formats import SaveResult
from pgconvert.run.workers import balanced_shares, planned_units, require_partial
from pgconvert.optimizer.carry import (ShardedOptimizer, carry_share, finalize_carried, replace_saver_notice,
                                       sharded_optimizer)

log = logging.getLogger(__name__)

SHARD_MARKERS = ".pgconvert-shards"


class Coordinator(Protocol):
    """How the processes of a sharded run learn that every share is written (or one failed)."""

    def shard_done(self, index: int) -> bool:
        """Record share ``index`` as written; True for the one process that must finalize."""

    def shard_failed(self, index: int, message: str) -> None: ...

    def wait_finalized(self) -> None:
        """Block until the finalizing process is done; raise if the run failed."""

    def finalized(self, ok: bool, message: str = "") -> None: ...


class FileCoordinator:
    """Coordination through marker files in the shared staging directory (Slurm arrays, scripts).

    The last share to finish finalizes; shares never wait for each other, and a share that never
    runs (a killed task) simply means the output is never renamed into place.
    """

    def __init__(self, staging: Path, count: int) -> None:
        self.markers = staging / SHARD_MARKERS
        self.markers.mkdir(parents=True, exist_ok=True)
        self.count = count

    def _mark(self, name: str, text: str) -> None:
        temporary = self.markers / f".{name}.tmp"
        temporary.write_text(text)
        os.replace(temporary, self.markers / name)

    def shard_done(self, index: int) -> bool:
        import fcntl

        # A share re-run after a failure clears its own failure: a Slurm array can re-run one task.
        (self.markers / f"failed-{index}").unlink(missing_ok=True)
        self._mark(f"done-{index}", str(os.getpid()))
        with open(self.markers / "lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if any(self.markers.glob("failed-*")) or (self.markers / "finalizing").exists():
                return False
            if all((self.markers / f"done-{i}").exists() for i in range(self.count)):
                self._mark("finalizing", str(os.getpid()))
                return True
        return False

    def shard_failed(self, index: int, message: str) -> None:
        self._mark(f"failed-{index}", message)

    def wait_finalized(self) -> None:
        return

    def finalized(self, ok: bool, message: str = "") -> None:
        return


class StoreCoordinator:
    """Coordination through torch.distributed's key-value store (torchrun); rank 0 finalizes.

    Only the store is used (``torch.distributed.rendezvous("env://")``): no process group is
    created and torch.distributed's global state is untouched.
    """

    def __init__(self, run_id: str, rank: int, world_size: int, timeout: timedelta) -> None:
        import torch.distributed as dist

        store, _, _ = next(dist.rendezvous("env://", rank, world_size, timeout=timeout))
        self.store = dist.PrefixStore(f"pgconvert/{run_id}/", store)
        self.rank = rank
        self.world_size = world_size
        self.timeout = timeout

    def shard_done(self, index: int) -> bool:
        self.store.add("done", 1)
        if self.rank != 0:
            return False
        deadline = time.monotonic() + self.timeout.total_seconds()
        while True:
            if self.store.check(["failed"]):
                raise ConversionError(f"another process failed: {self.store.get('failed').decode()}")
            if self.store.add("done", 0) >= self.world_size:
                return True
            if time.monotonic() > deadline:
                raise ConversionError(f"timed out waiting for the other {self.world_size - 1} processes")
            time.sleep(0.05)

    def shard_failed(self, index: int, message: str) -> None:
        self.store.set("failed", f"rank {index}: {message}")

    def wait_finalized(self) -> None:
        if self.rank == 0:
            return
        deadline = time.monotonic() + self.timeout.total_seconds()
        while not self.store.check(["finalized"]):
            if self.store.check(["failed"]):
                raise ConversionError(f"the conversion failed: {self.store.get('failed').decode()}")
            if time.monotonic() > deadline:
                raise ConversionError("timed out waiting for rank 0 to finalize the output")
            time.sleep(0.05)
        status = self.store.get("finalized").decode()
        if status != "ok":
            raise ConversionError(f"rank 0 could not finalize the output: {status}")

    def finalized(self, ok: bool, message: str = "") -> None:
        self.store.set("finalized", "ok" if ok else (message or "failed"))


def run_id(request: ConvertRequest, count: int) -> str:
    """The same id in every process of one sharded run (it names the shared staging directory)."""
    text = json.dumps([str(field) for field in astuple(request)] + [count])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class ShardedResult:
    conversion: Plan
    result: SaveResult
    finalized: bool


def shares(conversion: Plan, carried: ShardedOptimizer | None, count: int) -> list[list[str]]:
    """The destination's paths each of ``count`` processes writes: ``workers.planned_units`` (the model files and
    their optimizer state, and optimizer files of their own; a TP group's rank files together where they share
    reads), balanced by bytes."""
    return balanced_shares(planned_units(conversion, carried, count), count)


def _write_share(conversion: Plan, carried: ShardedOptimizer | None, staging: Path, share: set[str]) -> SaveResult:
    """This process's model files and the optimizer state that goes into or beside them, or stands alone in it."""
    with digests(writing_digest(conversion)):
        result = conversion.saver.save(conversion.source, staging, conversion.save_options, lambda nbytes: None,
                                       only=share)
        if carried is not None:
            carry_share(conversion, carried, staging, result.files, share)
    return result


def run_shard(request: ConvertRequest, index: int, count: int, coordinator_kind: str = "files",
              timeout: timedelta = timedelta(hours=12),
              finish: Callable[[Plan, Path, SaveResult], None] | None = None) -> ShardedResult:
    """Write share ``index`` of ``count`` into the shared staging directory; finalize if last.

    ``finish`` (manifest writing) runs in the finalizing process just before the rename.
    """
    if not 0 <= index < count:
        raise ValidationError(f"--shard-index {index}: must be in [0, {count}) for --num-shards {count}")
    conversion = plan(request)
    require_partial(conversion)
    try:
        carried = sharded_optimizer(conversion)  # every process decides alike, before anything is written
    except BaseException:
        conversion.source.close()
        raise
    dst = request.dst.absolute()
    staging = sibling(dst, f"{SHARED_STAGING_MARKER}{run_id(request, count)}")
    staging.mkdir(parents=True, exist_ok=True)
    coordinator: Coordinator
    if coordinator_kind == "store":
        coordinator = StoreCoordinator(run_id(request, count), index, count, timeout)
    else:
        coordinator = FileCoordinator(staging, count)
    try:
        result = _write_share(conversion, carried, staging, set(shares(conversion, carried, count)[index]))
    except BaseException as exc:
        coordinator.shard_failed(index, f"{type(exc).__name__}: {exc}")
        conversion.source.close()
        raise
    must_finalize = coordinator.shard_done(index)
    if not must_finalize:
        conversion.source.close()
        coordinator.wait_finalized()
        return ShardedResult(conversion, result, finalized=False)
    try:
        shutil.rmtree(staging / SHARD_MARKERS, ignore_errors=True)
        result.notices += conversion.saver.finalize(conversion.source, staging, conversion.save_options)
        if carried is not None:
            result.notices = replace_saver_notice(result.notices,
                                                  finalize_carried(conversion, carried, staging, result.files))
        conversion.saver.seal(conversion.source, staging, conversion.save_options, result.files)
        if finish is not None:
            finish(conversion, staging, result)
        promote(staging, dst, request.overwrite)
    except BaseException as exc:
        coordinator.finalized(False, f"{type(exc).__name__}: {exc}")
        raise
    finally:
        conversion.source.close()
    coordinator.finalized(True)
    return ShardedResult(conversion, result, finalized=True)


def convert_shard(request: ConvertRequest, index: int, count: int, coordinator_kind: str = "files") -> ShardedResult:
    """One process's part of a sharded conversion, with the manifest written by the finalizer."""
    from pgconvert.run.manifest import Manifest, record_files, write_manifest

    def finish(conversion: Plan, staging: Path, result: SaveResult) -> None:
        write_manifest(staging, Manifest.for_conversion(conversion, record_files(staging, result.files,
                                                                                 hashing(request))))

    try:
        return run_shard(request, index, count, coordinator_kind, finish=finish)
    except OSError as exc:
        where = f" ({exc.filename})" if exc.filename else ""
        raise ConversionError(f"writing DST {request.dst} failed: {exc.strerror or exc}{where}") from exc


def launcher_shard() -> tuple[int, int] | None:
    """(rank, world size) when started by torchrun or another launcher that sets RANK/WORLD_SIZE."""
    rank, world = os.environ.get("RANK"), os.environ.get("WORLD_SIZE")
    if rank is None or world is None or int(world) <= 1:
        return None
    return int(rank), int(world)
