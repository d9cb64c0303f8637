"""Test-only comparison of two Megatron per-rank checkpoints, file by file and tensor by tensor."""

from __future__ import annotations

import hashlib
import io
import json
import pickle
import warnings
from pathlib import Path
from typing import Callable

import torch
import torch.distributed.checkpoint as dcp
from support.megatron_fixtures import allowed_globals, load_for_test, read_megatron_checkpoint_ranks
from torch.distributed.checkpoint import BytesStorageMetadata, FileSystemReader, TensorStorageMetadata

_LAYOUT_ARGS = (
    "tensor_model_parallel_size", "pipeline_model_parallel_size", "expert_model_parallel_size",
    "virtual_pipeline_model_parallel_size", "decoder_first_pipeline_num_layers",
    "decoder_last_pipeline_num_layers", "num_layers", "num_experts", "padded_vocab_size",
)


def assert_same_ranks(actual: Path, expected: Path) -> None:
    """Same (tp, pp, ep) files and chunks, same keys, every tensor ``torch.equal`` with the same dtype.

    Key order is not part of the format (load_state_dict matches by name), so keys compare as sets.
    """
    actual_args, actual_ranks = read_megatron_checkpoint_ranks(actual)
    expected_args, expected_ranks = read_megatron_checkpoint_ranks(expected)
    assert sorted(actual_ranks) == sorted(expected_ranks)
    for field in _LAYOUT_ARGS:
        assert getattr(actual_args, field, None) == getattr(expected_args, field, None), field
    for coord, expected_chunks in expected_ranks.items():
        actual_chunks = actual_ranks[coord]
        assert sorted(actual_chunks) == sorted(expected_chunks), coord
        for chunk, expected_model in expected_chunks.items():
            actual_model = actual_chunks[chunk]
            assert sorted(actual_model) == sorted(expected_model), (coord, chunk)
            for key, value in expected_model.items():
                if value is None:
                    assert actual_model[key] is None, (coord, chunk, key)
                    continue
                assert actual_model[key].dtype == value.dtype, (coord, chunk, key)
                assert torch.equal(actual_model[key], value), (coord, chunk, key)


# The dense-model tests' name for the same comparison.
assert_same_megatron_checkpoint = assert_same_ranks


def read_dcp(iteration_dir: Path) -> tuple[dcp.Metadata, dict[str, torch.Tensor]]:
    """Every tensor of a distributed checkpoint, whole, read by torch.distributed.checkpoint alone."""
    metadata = FileSystemReader(str(iteration_dir)).read_metadata()
    tensors = {key: torch.empty(tuple(md.size), dtype=md.properties.dtype)
               for key, md in metadata.state_dict_metadata.items() if isinstance(md, TensorStorageMetadata)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(tensors, storage_reader=FileSystemReader(str(iteration_dir)), no_dist=True)
    return metadata, tensors


def read_dcp_objects(iteration_dir: Path, keep: Callable[[str], bool]) -> dict[str, object]:
    """The bytes entries of a distributed checkpoint whose keys ``keep`` accepts, each the object torch's
    ``dcp.load`` unpickles."""
    metadata = FileSystemReader(str(iteration_dir)).read_metadata()
    objects: dict[str, object] = {key: None for key, md in metadata.state_dict_metadata.items()
                                  if isinstance(md, BytesStorageMetadata) and keep(key)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(objects, storage_reader=FileSystemReader(str(iteration_dir)), no_dist=True)
    return objects


def rewrite_dcp_metadata(iteration_dir: Path, change: Callable[[dcp.Metadata], None]) -> None:
    """A distributed checkpoint's ``.metadata`` read with torch's reader, changed in place by ``change``, written
    back (pickled as torch writes it): a stored index that disagrees with the data, for bad-input tests."""
    path = iteration_dir / ".metadata"
    metadata = FileSystemReader(str(iteration_dir)).read_metadata()
    change(metadata)
    path.write_bytes(pickle.dumps(metadata))


COMMON_STATE_KEY = "common_state/shard_0_1"  # megatron-core >= 0.19: ShardedObject("common_state", (1,), (0,))


def read_common(iteration_dir: Path) -> dict[str, object]:
    """A torch_dist checkpoint's common state as megatron-core 0.19's ``load_common_state_dict`` reads it:
    common.pt when there is one, else the ``common_state`` bytes entry (``torch.save([state])``) where torch's
    ``.metadata`` places it, loaded weights-only as ``load_for_test`` does."""
    if (iteration_dir / "common.pt").is_file():
        return load_for_test(iteration_dir / "common.pt")
    metadata = FileSystemReader(str(iteration_dir)).read_metadata()
    (info,) = [info for index, info in metadata.storage_data.items() if index.fqn == COMMON_STATE_KEY]
    with open(iteration_dir / info.relative_path, "rb") as handle:
        handle.seek(info.offset)
        data = io.BytesIO(handle.read(info.length))
    with torch.serialization.safe_globals(allowed_globals()):
        loaded = torch.load(data, map_location="cpu", weights_only=True)
    assert isinstance(loaded, list) and len(loaded) == 1, type(loaded)
    return loaded[0]


def integrity_manifest_of(directory: Path) -> str:
    """megatron-core's save_integrity_manifest, recomputed with hashlib from the files as they are: every file but
    the manifest, by name, indent=2."""
    files = {path.name: hashlib.sha256(path.read_bytes()).hexdigest() for path in sorted(directory.iterdir(), key=str)
             if path.is_file() and path.name != "integrity.json"}
    return json.dumps({"algorithm": "sha256", "files": files}, indent=2)
