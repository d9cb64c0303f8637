"""The distributed optimizer's state written into a torch_dist destination, in the ``fully_reshardable``
form (layout-independent: the same records at any TP/PP/DP; the layout is only in ``args``), and what every
form's writer shares: the records file beside the model's, merged into ``.metadata``, and the common state rewritten
(``common_state.rewrite_common``: common.pt or the store's entry).

``DistributedOptimizer.sharded_param_state_fully_reshardable`` (megatron-core 0.16.1 / 0.20.0) saves
``optimizer.state.{param,exp_avg,exp_avg_sq}.<model key>``: fp32, each with its model tensor's global
shape and chunks; the common state holds ``optimizer = {optimizer: {param_groups}, param_state_sharding_type:
'fully_reshardable'}`` and ``content_metadata['distrib_optim_sharding_type']``. Run after the torch_dist
saver: the records go to data files of their own (``__1_0.distcp``, ``__1_1.distcp``, ... of at most
``--max-shard-size`` bytes of values, a canonical tensor's records in one file) written by the saver's streaming
writer (one record at a time, each produced when written), and are added to ``.metadata`` and the common state. A
sharded run's processes each write their share of the records files (``RecordsShare``); the finalizing one writes
the index and the common state from the plan, the same bytes.
"""

from __future__ import annotations

import dataclasses
import io
import itertools
from collections import Counter
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pgconvert.formats import PlannedFile
from pgconvert.formats.dcp_layout import DCP_METADATA_FILE
from pgconvert.formats.torch_dist import read_dcp_metadata
from pgconvert.formats.torch_dist_optimizer import (FULLY_RESHARDABLE, RECORDS_PREFIX, chained_entries, common_entry,
                                                    records_file, state_key)
from pgconvert.io.dcp_plan import Metadata, SavePlan, SavePlanner, WriteItem, WriteResult, dump_metadata
from pgconvert.io.dcp_writer import ItemKey, StreamingWriter, WrittenFiles, split_by_size
from pgconvert.optimizer.order import ChainMember
from pgconvert.optimizer.scaler import set_scalers, target_scalers
from pgconvert.optimizer.source import CARRIED_KEYS, FIELDS, OptimizerSource
from pgconvert.io.durable import replace_durably
from pgconvert.savers.torch_dist.common_state import rewrite_common


class OptimizerPlanner(SavePlanner):
    """The optimizer records' plan; each chunk's data is cut from its parameter's state when written."""

    def __init__(self, chunks: list[tuple[str, Any]], optimizer: Any, rows: int, fits_rows: set[str]) -> None:
        self._chunks = {(chunk.key, chunk.offsets): (field, chunk) for field, chunk in chunks}
        self._items = [chunk.write_item() for _, chunk in chunks]
        self._optimizer = optimizer
        self._rows = rows
        self._fits_rows = fits_rows
        self._last: tuple[tuple[str, str], torch.Tensor] | None = None

    def create_local_plan(self) -> SavePlan:
        return SavePlan(self._items)

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor | io.BytesIO:
        field, chunk = self._chunks[(write_item.index.fqn, tuple(write_item.index.offset))]
        whole = self._whole(chunk.canonical, field)
        if chunk.row_start is not None:
            whole = whole.narrow(0, chunk.row_start, chunk.rows)
        return whole.to(torch.float32).reshape(chunk.sizes)

    def _whole(self, name: str, field: str) -> torch.Tensor:
        """The whole tensor (TP1, the target's padded vocab rows); the gate and up chunks share one read."""
        if self._last is None or self._last[0] != (name, field):
            self._last = None
            rows = self._rows if name in self._fits_rows else None
            self._last = ((name, field), self._optimizer.piece(name, field, 1, 0, rows))
        return self._last[1]


def _merge_metadata(iteration_dir: Path, added: Metadata) -> None:
    """Add the records indexed by ``added`` (stored in the records files) to the checkpoint's ``.metadata``."""
    path = iteration_dir / DCP_METADATA_FILE
    metadata = read_dcp_metadata(path)
    metadata.state_dict_metadata.update(added.state_dict_metadata)
    metadata.storage_data.update(added.storage_data)
    replace_durably(path, dump_metadata(metadata))


@dataclass(frozen=True)
class RecordsShare:
    """What one process writes of the optimizer records: the records files (``records_file`` names) of ``writes``
    (None: all) and, when ``shared``, what they have in common (their index merged into ``.metadata``, and
    the common state); each records file holds at most ``limit`` bytes of values (``--max-shard-size``)."""

    limit: int
    writes: Collection[str] | None = None
    shared: bool = True


class _RecordsWriter(StreamingWriter):
    """The records files ``__1_<n>.distcp`` written straight into the iteration directory, and their index kept in
    memory (``metadata``) for ``.metadata``: a sharded run's processes write their files into one directory, and
    the finalizing one indexes them all from the plan."""

    def __init__(self, directory: Path, files: Mapping[ItemKey, int], writes: Collection[int]) -> None:
        super().__init__(directory, files, writes, index=True, prefix=RECORDS_PREFIX)
        self.metadata: Metadata | None = None

    def finish(self, metadata: Metadata, results: list[WriteResult]) -> None:
        metadata.storage_data = {result.index: result.storage_data for result in results}
        self.metadata = metadata


def numbered(files: list[list[Any]], key: Callable[[Any], ItemKey]) -> dict[ItemKey, int]:
    """Each item's records file, from ``split_by_size``'s files."""
    return {key(item): number for number, items in enumerate(files) for item in items}


def chunk_numbers(chunks: list[tuple[str, Any]], limit: int) -> dict[ItemKey, int]:
    """The records file of each (field, chunk): a canonical tensor's records in one file, as the model's chunks."""
    files = split_by_size(chunks, lambda pair: pair[1].canonical, lambda pair: pair[1].nbytes, limit)
    return numbered(files, lambda pair: (pair[1].key, tuple(pair[1].offsets)))


def records_files(directory: str, sizes: Mapping[ItemKey, int], numbers: Mapping[ItemKey, int], objects: int = 0,
                  written: WrittenFiles | None = None) -> list[PlannedFile]:
    """Each records file (``directory``: the iteration's), its records (the first: and the ``objects``) and bytes
    of values (``sizes`` per record); with ``written``, the files it names alone, with their digest and size."""
    tensors: Counter[int] = Counter(numbers[key] for key in sizes)
    nbytes: Counter[int] = Counter()
    for key, size in sizes.items():
        nbytes[numbers[key]] += size
    files = []
    for number in sorted(set(numbers.values()) | {0}):
        name = records_file(number)
        if written is not None and name not in written:
            continue
        digest, size = (written or {}).get(name, (None, None))
        files.append(PlannedFile(f"{directory}/{name}", tensors[number] + (objects if number == 0 else 0),
                                 nbytes[number], digest=digest, size=size))
    return files


def carry_counters(optimizer: OptimizerSource, common: dict[str, Any]) -> None:
    """The carried counters of the source's first rank (scheduler, floating-point operations) into ``common``."""
    for key in CARRIED_KEYS:
        if key in optimizer.first.extra:
            common[key] = optimizer.first.extra[key]


def _add_common(optimizer: OptimizerSource, iteration_dir: Path,
                target: list[tuple[ChainMember, int]] | None = None) -> None:
    """``target``: the target's chained optimizers and their group counts (None: the source's first)."""
    step = optimizer.group_step()
    held = [optimizer.param_group_settings(count=count, member=member) for member, count in target] if target \
        else [optimizer.param_group_settings(0)]
    groups = [[dict(settings, step=step) for settings in own] for own in held]

    def update(common: dict[str, Any]) -> None:
        common["optimizer"] = common_entry(groups)
        set_scalers(chained_entries(common["optimizer"]), target_scalers(optimizer, len(groups)))
        carry_counters(optimizer, common)
        common["content_metadata"] = dict(common.get("content_metadata") or {},
                                          distrib_optim_sharding_type=FULLY_RESHARDABLE,
                                          distrib_optim_fully_reshardable_mem_efficient=False)

    rewrite_common(iteration_dir, update)


def per_field(model_chunks: list[Any], names: set[str],
              fields: Sequence[str] | Callable[[str], Sequence[str]]) -> list[tuple[str, Any]]:
    """(field, model chunk) of every chunk of the tensors ``names``, a tensor's chunks field by field (the gate and up
    halves of a SwiGLU fc1 one after the other), so that each field of a parameter is cut from the source once;
    ``fields``: the same for every tensor, or each tensor's (a Muon run's: ``OptimizerSource.fields``)."""
    pairs: list[tuple[str, Any]] = []
    held = (chunk for chunk in model_chunks if chunk.canonical in names)
    for name, run in itertools.groupby(held, key=lambda chunk: chunk.canonical):
        members = list(run)
        pairs += [(field, chunk) for field in (fields(name) if callable(fields) else fields) for chunk in members]
    return pairs


def optimizer_chunks(optimizer: OptimizerSource, model_chunks: list[Any]) -> list[tuple[str, Any]]:
    """The fully_reshardable records, (field, chunk) per model chunk and field (``per_field``), fp32."""
    # parameters only (megatron-core's buffers' param_index_map): not a router's expert_bias buffer
    return [(field, dataclasses.replace(chunk, key=state_key(field, chunk.key), dtype=torch.float32))
            for field, chunk in per_field(model_chunks, set(optimizer.names()), FIELDS)]


def write_records(iteration_dir: Path, planner: Any, numbers: Mapping[ItemKey, int], share: RecordsShare,
                  merge: Callable[[Path, Metadata], None] = _merge_metadata) -> WrittenFiles:
    """Save what ``planner`` plans (it brings its own items; no state dict) into the records files beside the model's
    (``numbers``: each record's file; the objects go to the first), those ``share.writes`` names, then, when
    ``share.shared``, ``merge`` the index of every one (planned, for those another process writes) into the
    checkpoint's ``.metadata``. Returns the files written: name -> (digest, size)."""
    every = sorted(set(numbers.values()) | {0})
    writes = every if share.writes is None else [number for number in every if records_file(number) in share.writes]
    writer = _RecordsWriter(iteration_dir, numbers, writes)
    writer.save(planner)
    if share.shared:
        assert writer.metadata is not None
        merge(iteration_dir, writer.metadata)
    return writer.written


def write_chunk_records(optimizer: OptimizerSource, chunks: list[tuple[str, Any]], rows: int, fits_rows: set[str],
                        iteration_dir: Path, share: RecordsShare,
                        merge: Callable[[Path, Metadata], None] = _merge_metadata) -> list[PlannedFile]:
    """The records ``chunks`` ((field, chunk) pairs) written to the records files (``share``) and added to
    ``.metadata``, each chunk cut from ``optimizer``'s field when written (the model-space forms and the plain form);
    returns the files written."""
    numbers = chunk_numbers(chunks, share.limit)
    written = write_records(iteration_dir, OptimizerPlanner(chunks, optimizer, rows, fits_rows), numbers, share, merge)
    sizes = {(chunk.key, tuple(chunk.offsets)): chunk.nbytes for _, chunk in chunks}
    return records_files(iteration_dir.name, sizes, numbers, written=written)


def write_fully_reshardable(optimizer: OptimizerSource, model_chunks: list[Any], rows: int, fits_rows: set[str],
                            iteration_dir: Path, share: RecordsShare,
                            target: list[tuple[ChainMember, int]] | None = None) -> list[PlannedFile]:
    """Write the optimizer records beside the model's (``model_chunks``: the torch_dist saver's chunks, expert
    ones included; ``share``: which); ``target``: the target's chained optimizers and their group counts. Returns
    the files added."""
    added = write_chunk_records(optimizer, optimizer_chunks(optimizer, model_chunks), rows, fits_rows, iteration_dir,
                                share)
    if share.shared:
        _add_common(optimizer, iteration_dir, target)
    return added
