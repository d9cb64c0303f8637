"""One optimizer value planted (changed) in a checkpoint's files, found without pgconvert: a parameter's place in
a rank file's Adam state (the fp32 master that rounds to its model weight), in a flat buffer (``distrib_optim.pt``,
a torch_dist ``dp_reshardable`` bucket: the range whose masters round to the weight) or in a torch_dist record
(rewritten through torch's own ``torch.save``, ``.metadata`` pointed at the new bytes)."""

from __future__ import annotations

import dataclasses
import io
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import MetadataIndex

from support.optimizer_cli import rewrite_metadata, torch_metadata

Edit = Callable[[torch.Tensor], None]


def bump(tensor: torch.Tensor, index: tuple[int, ...], by: float = 0.5) -> None:
    """Element ``index`` of ``tensor`` changed by ``by`` (in place)."""
    tensor[index] += by


def nudge(tensor: torch.Tensor, index: tuple[int, ...]) -> None:
    """Element ``index`` of an fp32 ``tensor`` moved to the next float32 up: a master that still rounds to its
    bf16 weight (megatron-core's masters are checked to round to their weights)."""
    value = tensor[index].reshape(1)
    tensor[index] = torch.nextafter(value, value + 1.0)[0]


def master_position(state: dict[str, Any], model_key: str, inner: dict[str, Any] | None = None) -> int:
    """The Adam state position of the model tensor ``model_key`` in a Float16OptimizerWithFloat16Params rank file:
    the one fp32 master (``fp32_from_fp16_params``) that rounds to the stored weight."""
    optimizer = inner if inner is not None else state["optimizer"]
    weight = state["model"][model_key]
    found = [position for group, masters in zip(optimizer["optimizer"]["param_groups"],
                                                optimizer["fp32_from_fp16_params"])
             for position, master in zip(group["params"], masters)
             if master.shape == weight.shape and torch.equal(master.to(weight.dtype), weight)]
    assert len(found) == 1, f"{model_key}: {len(found)} masters round to it"
    return found[0]


def flat_start(flat_param: torch.Tensor, weight: torch.Tensor) -> int:
    """Where the fp32 masters of ``weight`` start in a flat ``param`` buffer: the one range that rounds to it."""
    target = weight.reshape(-1)
    candidates = (flat_param.to(weight.dtype) == target[0]).nonzero().flatten().tolist()
    found = [start for start in candidates if start + target.numel() <= flat_param.numel()
             and torch.equal(flat_param[start:start + target.numel()].to(weight.dtype), target)]
    assert len(found) == 1, f"{len(found)} ranges of the flat buffer round to the weight"
    return found[0]


def matching_position(state: dict[Any, Any], field: str, value: torch.Tensor) -> Any:
    """The position of a torch optimizer ``state`` whose ``field`` equals ``value`` (one, or the test fails)."""
    found = [position for position, entry in state.items()
             if isinstance(entry, dict) and field in entry and entry[field].shape == value.shape
             and torch.equal(entry[field], value)]
    assert len(found) == 1, f"{len(found)} state entries hold that {field}"
    return found[0]


def record_chunks(iteration_dir: Path, fqn: str) -> list[tuple[MetadataIndex, tuple[int, ...], tuple[int, ...]]]:
    """Each stored chunk of the torch_dist tensor ``fqn``: its index, offsets and sizes."""
    metadata = torch_metadata(iteration_dir)
    chunks = metadata.state_dict_metadata[fqn].chunks
    return [(MetadataIndex(fqn, tuple(chunk.offsets)), tuple(chunk.offsets), tuple(chunk.sizes)) for chunk in chunks]


def edit_record(iteration_dir: Path, fqn: str, index: tuple[int, ...], edit: Callable[[torch.Tensor, tuple[int, ...]],
                                                                                       None]) -> None:
    """Element ``index`` (global) of the torch_dist tensor ``fqn`` changed by ``edit(chunk, local index)`` in every
    stored chunk that holds it: the chunk's record read with ``torch.load``, changed, ``torch.save``d at the end of
    its data file, and ``.metadata`` pointed there."""
    metadata = torch_metadata(iteration_dir)
    moved = {}
    for key, offsets, sizes in record_chunks(iteration_dir, fqn):
        if not all(start <= at < start + size for at, start, size in zip(index, offsets, sizes)):
            continue
        info = metadata.storage_data[key]
        path = iteration_dir / info.relative_path
        with open(path, "rb") as handle:
            handle.seek(info.offset)
            chunk = torch.load(io.BytesIO(handle.read(info.length)), weights_only=True).clone()
        edit(chunk, tuple(at - start for at, start in zip(index, offsets)))
        moved[key] = _append(path, chunk, info)
    assert moved, f"{fqn}: no stored chunk holds {index}"

    def point(held: Any) -> None:
        held.storage_data.update(moved)

    rewrite_metadata(iteration_dir, point)


def _append(path: Path, value: Any, info: Any) -> Any:
    data = io.BytesIO()
    torch.save(value, data)
    offset = path.stat().st_size
    with open(path, "ab") as handle:
        handle.write(data.getvalue())
    return dataclasses.replace(info, offset=offset, length=len(data.getvalue()))
