"""A DCP store of global tensors written by one process with no process group: what the torch_dist and fsdp_dtensor
savers share.

Both savers plan their chunks from the source's metadata alone (``StoredChunk``: a key, its chunk's offsets and
sizes, and which rows of which canonical tensor it holds), cut them into data files of at most ``--max-shard-size``
bytes (``data_files``) and write them as ``dcp.save(no_dist=True)`` would, with ``StreamingPlanner`` (each chunk's
data produced when the writer asks for it, one canonical tensor in memory at a time) and the streaming writer
(``pgconvert/io/dcp_writer.py``, which needs no torch.distributed.checkpoint), which can write some of the data
files and plan the others' offsets, so ``.metadata`` is written from the plan (``write_store``). The formats differ
in the keys, the chunks, and the bytes entries (``objects``: key -> the entry's bytes) beside the tensors.
"""

from __future__ import annotations

import errno
import io
from collections.abc import Callable, Collection, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from pgconvert.formats.contract import PlannedFile, Progress, SaveOptions
from pgconvert.formats.stream import CanonicalSource
from pgconvert.io import sizes
from pgconvert.io.dcp_plan import SavePlan, SavePlanner, WriteItem, WriteItemType, bytes_item, tensor_item
from pgconvert.io.dcp_writer import DEFAULT_MAX_DATA_FILE_SIZE, ItemKey, StreamingWriter, WrittenFiles, split_by_size
from pgconvert.io.limits import quote
from pgconvert.model.config import ModelConfig
from pgconvert.model.provider import VOCAB_TABLES, layer_kinds
from pgconvert.model.rules import VOCAB, ShardRule


def data_file_name(number: int) -> str:
    """torch.distributed.checkpoint's name of a single process's data file ``number``."""
    return f"__0_{number}.distcp"


@dataclass(frozen=True)
class StoredChunk:
    """One stored chunk: rows ``[row_start, row_start + rows)`` (all rows when None) of a canonical
    tensor, at ``offsets`` of key ``key`` whose global shape is ``global_shape``; ``field``: which of the tensor's
    optimizer state it holds (``exp_avg``, ``exp_avg_sq``, ``step``; None: the tensor itself)."""

    canonical: str
    key: str
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    global_shape: tuple[int, ...]
    dtype: torch.dtype
    row_start: int | None = None
    rows: int | None = None
    field: str | None = None

    @property
    def nbytes(self) -> int:
        return sizes.nbytes(self.sizes, self.dtype)

    def write_item(self) -> WriteItem:
        return tensor_item(self.key, self.offsets, self.sizes, self.global_shape, self.dtype)


def layer_rules(config: ModelConfig) -> dict[str, ShardRule]:
    """Each layer tensor's TP rule (the others are whole tensors in one chunk)."""
    return {name: kind.rule_for(config) for name, kind in layer_kinds(config).items()}  # MTP layers too


def row_runs(rule: ShardRule | None, shape: tuple[int, ...]) -> list[tuple[int | None, int | None]]:
    """The row runs megatron-core stores a tensor in at TP1: the windows of the rule's one piece
    (the gate and up halves of a SwiGLU fc1); ``(None, None)``: the whole tensor in one chunk."""
    windows = rule.piece_windows(shape, 1, 0) if rule is not None else ()
    if len(windows) < 2:
        return [(None, None)]
    assert all(window.dim == 0 and not window.zeros for window in windows)
    return [(window.start, window.length) for window in windows]


# A canonical tensor's optimizer state field, whole (at the target's padded vocab rows): ``(name, field)`` -> tensor.
StateReader = Callable[[str, str], torch.Tensor]


class StreamingPlanner(SavePlanner):
    """A save plan given up front; each chunk's data is produced when the writer asks for it (a chunk of optimizer
    state from ``state``), each bytes entry is ``objects``' bytes. ``planner_data``: the flattened keys' paths
    ``.metadata`` records (None: none)."""

    def __init__(self, chunks: list[StoredChunk], objects: Mapping[str, bytes], source: CanonicalSource,
                 vocab_rows: int, progress: Progress,
                 planner_data: Mapping[str, tuple[str, ...]] | None = None, state: StateReader | None = None) -> None:
        self._planner_data = dict(planner_data) if planner_data is not None else None
        self._objects = objects
        self._chunks = {(chunk.key, chunk.offsets): chunk for chunk in chunks}
        self._items = [chunk.write_item() for chunk in chunks] + [bytes_item(key) for key in objects]
        self._source = source
        self._vocab_rows = vocab_rows
        self._progress = progress
        self._state = state
        # The gate and up chunks of a SwiGLU fc1 are consecutive: the second reuses the first's load.
        self._last: tuple[tuple[str, str | None], torch.Tensor] | None = None

    def create_local_plan(self) -> SavePlan:
        return SavePlan(self._items, planner_data=self._planner_data)

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor | io.BytesIO:
        if write_item.type == WriteItemType.BYTE_IO:
            return io.BytesIO(self._objects[write_item.index.fqn])
        chunk = self._chunks[(write_item.index.fqn, tuple(write_item.index.offset))]
        full = self._canonical(chunk.canonical, chunk.field)
        if chunk.row_start is not None:
            assert chunk.rows is not None
            full = full.narrow(0, chunk.row_start, chunk.rows)
        data = full.to(chunk.dtype).reshape(chunk.sizes)
        self._progress(chunk.nbytes)
        return data

    def made_for(self, write_item: WriteItem) -> tuple[int, int] | None:
        """The bytes of the tensor ``resolve_data`` makes for a chunk (its canonical tensor, or that tensor's state
        field) and where the chunk's bytes start in it; None when it makes none (the chunk is a window of the tensor
        made for the chunk before). The writer lends memory of that size around ``resolve_data``, placed by the
        chunk's offset in its file (``dcp_writer``); a chunk converted to another dtype is a copy made apart, and the
        lent memory holds the tensor it was converted from."""
        chunk = self._chunks[(write_item.index.fqn, tuple(write_item.index.offset))]
        if self._last is not None and self._last[0] == (chunk.canonical, chunk.field):
            return None
        meta = self._source.meta(chunk.canonical)
        dtype = meta.dtype if chunk.field is None else chunk.dtype  # a state field is read in its stored dtype
        if not meta.shape:
            return sizes.nbytes((), dtype), 0
        rows = self._vocab_rows if chunk.canonical in VOCAB_TABLES else meta.shape[0]  # state fields too
        row_bytes = sizes.nbytes(tuple(meta.shape[1:]), dtype)
        return rows * row_bytes, (chunk.row_start or 0) * row_bytes

    def _canonical(self, name: str, field: str | None) -> torch.Tensor:
        """The whole canonical tensor (or its state field), made in the memory the writer lends around the call."""
        if self._last is not None and self._last[0] == (name, field):
            return self._last[1]
        self._last = None
        if field is not None:
            assert self._state is not None, f"{name}.{field}: a chunk of optimizer state with no state to read"
            tensor = self._state(name, field)
        elif name in VOCAB_TABLES:
            tensor = self._source.load_shard(name, VOCAB, 1, 0, rows=self._vocab_rows)
        else:
            tensor = self._source.load(name)
        self._last = ((name, field), tensor)
        return tensor


def data_files(chunks: list[StoredChunk], options: SaveOptions) -> list[list[StoredChunk]]:
    """The chunks of each data file, in stream order: a new file when the next canonical tensor's chunks would
    take the file past ``max_shard_size`` bytes of values (a tensor larger than that has a file of its own)."""
    return split_by_size(chunks, lambda chunk: chunk.canonical, lambda chunk: chunk.nbytes,
                         options.max_shard_size or DEFAULT_MAX_DATA_FILE_SIZE)


def file_numbers(files: list[list[StoredChunk]]) -> dict[ItemKey, int]:
    """Each chunk's data file, as the streaming writer takes it (a bytes entry not named goes to the first)."""
    return {(chunk.key, chunk.offsets): number for number, file in enumerate(files) for chunk in file}


def write_data_files(out_dir: Path, directory: str, chunks: list[StoredChunk], files: list[list[StoredChunk]],
                     objects: Mapping[str, bytes], source: CanonicalSource, rows: int, progress: Progress,
                     only: Collection[str] | None) -> WrittenFiles:
    """The model's data files ``files`` of the store in ``out_dir / directory`` (those ``only`` names, as relative
    paths; None: all), ``objects`` in the first; returns each written file's digest and size (no ``.metadata``)."""
    writes = [number for number in range(len(files))
              if only is None or f"{directory}/{data_file_name(number)}" in only]
    if not writes:
        return {}
    (out_dir / directory).mkdir(parents=True, exist_ok=True)
    planner = StreamingPlanner(chunks, objects, source, rows, progress)
    return write_store(out_dir / directory, planner, file_numbers(files), writes, False,
                       out_dir / directory / data_file_name(writes[0])).written


def planned_data_files(directory: str, files: list[list[StoredChunk]], written: WrittenFiles,
                       first_entries: int = 0) -> list[PlannedFile]:
    """The model's data files as planned (each one's digest and size where ``written`` names it); the first also
    holds ``first_entries`` bytes entries."""
    planned = []
    for number, chunks in enumerate(files):
        digest, size = written.get(data_file_name(number), (None, None))
        planned.append(PlannedFile(f"{directory}/{data_file_name(number)}", len(chunks) + (first_entries if number == 0
                                   else 0), sum(chunk.nbytes for chunk in chunks), digest=digest, size=size))
    return planned


def write_store(directory: Path, planner: StreamingPlanner, numbers: dict[ItemKey, int],
                writes: Collection[int] | None, index: bool, first_path: Path) -> StreamingWriter:
    """The data files numbered ``writes`` (None: all) of a planned store, and with ``index`` its ``.metadata``;
    a failed write is an OSError naming ``first_path``. Returns the writer (the written files' digests)."""
    writer = StreamingWriter(directory, numbers, writes, index=index)
    with os_errors_of_torch(first_path):
        writer.save(planner)
    return writer


@contextmanager
def os_errors_of_torch(path: Path) -> Iterator[None]:
    """torch's zip writer turns a failed write (a full disk) into ``RuntimeError: unexpected pos``;
    the ``OSError`` it swallowed is still in the exception's chain: raise that one instead."""
    try:
        yield
    except RuntimeError as exc:
        cause: BaseException | None = exc
        seen = set()
        while cause is not None and id(cause) not in seen and not isinstance(cause, OSError):
            seen.add(id(cause))
            cause = cause.__cause__ or cause.__context__
        if isinstance(cause, OSError):
            raise OSError(cause.errno, cause.strerror, cause.filename or str(path)) from exc
        if "unexpected pos" in str(exc) or "failed writing" in str(exc):
            raise OSError(errno.EIO, f"torch could not write the file ({quote(str(exc), 200)})", str(path)) from exc
        raise

