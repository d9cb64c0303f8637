"""The common state of a torch_dist destination (args, iteration, content_metadata, the optimizer's param groups),
in either place megatron-core keeps it (``pgconvert.formats.names.COMMON_PLACES``).

- ``store`` (megatron-core >= 0.19.0, ``dist_checkpointing.save``): the bytes entry ``common_state/shard_0_1`` of
  the DCP store, ``torch.save([common])``. pgconvert writes it to a data file of its own, ``__0_<n>.distcp`` after the
  model's ``n`` data files, written when the checkpoint is finalized: the model's data files never depend on it,
  so a run split over processes writes them unchanged. ``.metadata`` records its file, offset 0 and length.
- ``legacy`` (megatron-core <= 0.18): ``common.pt``, ``torch.save(common)``.

The optimizer's writers read it back and rewrite it (``rewrite_common``) wherever it is; the file holding it is
``common_relpath``.
"""

from __future__ import annotations

import dataclasses
import io
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from pgconvert.errors import CheckpointError
from pgconvert.formats.megatron import FRAMEWORK_PICKLE, SAFE_GLOBALS, safe_torch_load
from pgconvert.formats.dcp_layout import DCP_METADATA_FILE
from pgconvert.formats.torch_dist import COMMON_FILE, COMMON_STATE_KEY, common_state_storage, read_dcp_metadata
from pgconvert.io.dcp_plan import Metadata, MetadataIndex, StorageInfo, dump_metadata
from pgconvert.io.durable import replace_durably


def common_bytes(common: dict[str, Any]) -> bytes:
    """The ``common_state`` entry as megatron-core's ``_mcore_to_torch_sharded_object`` stores it: the
    ``torch.save`` of the list of the one rank's object."""
    buffer = io.BytesIO()
    torch.save([common], buffer, pickle_module=FRAMEWORK_PICKLE)
    return bytes(buffer.getbuffer())


def _stored_entry(iteration_dir: Path) -> tuple[Metadata, MetadataIndex, StorageInfo]:
    """``.metadata``, and the storage index and place of its common_state entry."""
    metadata = read_dcp_metadata(iteration_dir / DCP_METADATA_FILE)
    stored = common_state_storage(metadata)
    if stored is not None:
        return metadata, *stored
    raise CheckpointError(f"{iteration_dir}: neither {COMMON_FILE} nor a {COMMON_STATE_KEY} entry in "
                          f"{DCP_METADATA_FILE}")


def common_relpath(iteration_dir: Path) -> str:
    """The name (in the iteration directory) of the file that holds the common state."""
    if (iteration_dir / COMMON_FILE).is_file():
        return COMMON_FILE
    return str(_stored_entry(iteration_dir)[2].relative_path)


def read_written_common(iteration_dir: Path) -> dict[str, Any]:
    """The common state this saver wrote, from common.pt or from the store."""
    if (iteration_dir / COMMON_FILE).is_file():
        return dict(safe_torch_load(iteration_dir / COMMON_FILE))
    _, _, info = _stored_entry(iteration_dir)
    with open(iteration_dir / info.relative_path, "rb") as handle:
        handle.seek(info.offset)
        data = handle.read(info.length)
    with torch.serialization.safe_globals(SAFE_GLOBALS):
        loaded = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    if not (isinstance(loaded, list) and len(loaded) == 1 and isinstance(loaded[0], dict)):
        raise CheckpointError(f"{iteration_dir / info.relative_path}: {COMMON_STATE_KEY} is not a list of one dict")
    return dict(loaded[0])


def rewrite_common(iteration_dir: Path, update: Callable[[dict[str, Any]], None]) -> None:
    """The common state read, changed by ``update`` and written back durably where it was (in the store: its data
    file rewritten and its length in ``.metadata`` updated)."""
    common = read_written_common(iteration_dir)
    update(common)
    if (iteration_dir / COMMON_FILE).is_file():
        buffer = io.BytesIO()
        torch.save(common, buffer, pickle_module=FRAMEWORK_PICKLE)
        replace_durably(iteration_dir / COMMON_FILE, buffer.getbuffer())
        return
    metadata, index, info = _stored_entry(iteration_dir)
    data = common_bytes(common)
    replace_durably(iteration_dir / info.relative_path, data)
    metadata.storage_data[index] = dataclasses.replace(info, offset=0, length=len(data))
    replace_durably(iteration_dir / DCP_METADATA_FILE, dump_metadata(metadata))
