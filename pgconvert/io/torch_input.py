"""Checks of a ``torch.save`` file before ``torch.load`` touches it.

``torch.load`` trusts a file's structure: it inflates a compressed record whole (an 11 MB file can
inflate to gigabytes), and with ``mmap=True`` it maps each tensor's bytes from where its record
starts for as many bytes as the pickle says, so a record cut short silently yields the bytes of the
records after it. This module reads the structure first, without reading any tensor data:

- zip files (``torch.save`` since torch 1.6): every record must be stored (not compressed) and lie
  inside the file; the pickle and the small records must be within their limits; and the pickle is
  unpickled once with storages on the meta device, to learn how many bytes each tensor record must
  hold, which is then checked against the record's length.
- legacy files (``_use_new_zipfile_serialization=False``, old Megatron checkpoints): a stream of
  pickles followed by each storage's element count and bytes; the counts are checked against the
  pickle and the file's length, so torch allocates no more than the file holds.
"""

from __future__ import annotations

import io
import pickle
import struct
import zipfile
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import torch

from pgconvert.errors import CheckpointError
from pgconvert.io import limits, sizes
from pgconvert.io.limits import over_limit, quote
from pgconvert.io.ranges import FileHandles, FileRegion, concat_reading, read_region
from pgconvert.io.reuse import new_tensor

_LOCAL_HEADER = struct.Struct("<4s22xHH")
SLAB_BYTES = 16 << 20  # bytes of each of two tensors left in their files read at a time to compare them
_LEGACY_MAGIC = 0x1950A86A20F9469CFC6C


_REAL_STORAGE_BYTES = 1 << 16


class _Needs:
    """The bytes each storage key's tensors need, collected by a meta-device persistent_load."""

    def __init__(self, path: Path | str, legacy: bool) -> None:
        self.path = path
        self.legacy = legacy
        self.bytes: dict[str, int] = {}
        self.elements: dict[str, tuple[int, int]] = {}
        # Reads a small record's bytes by storage key (None when it is missing or short).
        self.read_small: Callable[[str, int], bytes | None] | None = None
        # The file offset of a record's data by storage key (None when it has no record).
        self.record_offset: Callable[[str], int | None] | None = None

    def __call__(self, saved_id: Any) -> Any:
        if not isinstance(saved_id, tuple) or len(saved_id) != (6 if self.legacy else 5):
            raise CheckpointError(f"{self.path}: a tensor's storage reference {quote(saved_id)} is malformed")
        storage_type, key, _location, numel = saved_id[1:5]
        dtype = torch.uint8 if storage_type is torch.UntypedStorage else getattr(storage_type, "dtype", None)
        if not isinstance(dtype, torch.dtype) or not isinstance(numel, int) or numel < 0 or not isinstance(key, str):
            raise CheckpointError(f"{self.path}: a tensor's storage reference {quote(saved_id)} is malformed")
        itemsize = torch._utils._element_size(dtype)
        nbytes = numel * itemsize
        self.bytes[key] = max(self.bytes.get(key, 0), nbytes)
        self.elements.setdefault(key, (numel, itemsize))
        # Small storages hold their real bytes so that objects rebuilt from them, such as a
        # torch.Generator from Megatron's RNG state, unpickle; large ones stay on the meta device.
        data = self.read_small(key, nbytes) if self.read_small and nbytes <= _REAL_STORAGE_BYTES else None
        if data == b"":
            storage = torch.UntypedStorage(0)
        elif data is not None:
            storage = torch.frombuffer(bytearray(data), dtype=torch.uint8).untyped_storage()
        else:
            storage = torch.UntypedStorage(nbytes, device="meta")
            # Where the bytes are, as torch.load(map_location="meta") records it (see ``stored_offset``), and in
            # which file (``stored_region``).
            storage._checkpoint_offset = self.record_offset(key) if self.record_offset else None
            storage._checkpoint_path = self.path
        return torch.storage.TypedStorage(wrap_storage=storage, dtype=dtype, _internal=True)


def _unpickle_for_needs(handle: BinaryIO, needs: _Needs) -> Any:
    from torch import _weights_only_unpickler

    unpickler = _weights_only_unpickler.Unpickler(handle, encoding="utf-8")
    unpickler.persistent_load = needs  # type: ignore[attr-defined]
    return unpickler.load()


def _zip_records(path: Path | str, handle: BinaryIO, size: int) -> dict[str, tuple[int, int]]:
    """name -> (data offset, length) of every record, each checked to be stored and inside the file."""
    try:
        infos = zipfile.ZipFile(handle).infolist()
    except (zipfile.BadZipFile, ValueError, OSError, EOFError) as exc:
        raise CheckpointError(f"{path}: truncated or corrupt torch checkpoint ({quote(str(exc), 200)})") from exc
    records = {}
    for info in infos:
        name = quote(info.filename)
        if info.compress_type != zipfile.ZIP_STORED:
            raise CheckpointError(f"{path}: record {name} is compressed; torch writes stored records and "
                                  "inflates a compressed one whole, so pgconvert refuses it")
        handle.seek(info.header_offset)
        header = handle.read(_LOCAL_HEADER.size)
        if len(header) < _LOCAL_HEADER.size or header[:4] != b"PK\x03\x04":
            raise CheckpointError(f"{path}: truncated or corrupt torch checkpoint (record {name} has no header)")
        _, name_length, extra_length = _LOCAL_HEADER.unpack(header)
        start = info.header_offset + _LOCAL_HEADER.size + name_length + extra_length
        if info.compress_size != info.file_size or start + info.file_size > size:
            raise CheckpointError(f"{path}: truncated or corrupt torch checkpoint (record {name} of "
                                  f"{info.file_size} bytes does not fit in the file's {size} bytes)")
        records[info.filename] = (start, info.file_size)
    return records


def _check_zip(path: Path | str, handle: BinaryIO, size: int) -> Any:
    records = _zip_records(path, handle, size)
    pickles = [name for name in records if name.endswith("/data.pkl") and name.count("/") == 1]
    if len(pickles) != 1:
        raise CheckpointError(f"{path}: truncated or corrupt torch checkpoint (no single data.pkl record)")
    prefix = pickles[0][: -len("data.pkl")]
    for name, (_, length) in records.items():
        if name == pickles[0]:
            if length > limits.MAX_PICKLE_BYTES:
                raise over_limit(path, "the data.pkl record's size in bytes", length, "MAX_PICKLE_BYTES")
        elif not name.startswith(prefix + "data/") and length > limits.MAX_SMALL_RECORD_BYTES:
            raise over_limit(path, f"record {quote(name)}'s size in bytes", length, "MAX_SMALL_RECORD_BYTES")
    start, length = records[pickles[0]]
    handle.seek(start)
    pickled = handle.read(length)
    needs = _Needs(path, legacy=False)

    def read_small(key: str, nbytes: int) -> bytes | None:
        record = records.get(f"{prefix}data/{key}")
        if record is None or record[1] < nbytes:
            return None
        handle.seek(record[0])
        return handle.read(nbytes)

    def record_offset(key: str) -> int | None:
        record = records.get(f"{prefix}data/{key}")
        return None if record is None else record[0]

    needs.read_small = read_small
    needs.record_offset = record_offset
    structure = _unpickle_for_needs(io.BytesIO(pickled), needs)
    for key, needed in sorted(needs.bytes.items()):
        record = records.get(f"{prefix}data/{key}")
        if record is None:
            raise CheckpointError(f"{path}: truncated or corrupt torch checkpoint (no record data/{quote(key)} "
                                  f"for a tensor of {needed} bytes)")
        if record[1] < needed:
            raise CheckpointError(f"{path}: truncated or corrupt torch checkpoint (record data/{quote(key)} "
                                  f"holds {record[1]} bytes, its tensors need {needed})")
    return structure


def _check_legacy(path: Path | str, handle: BinaryIO, size: int) -> None:
    needs = _Needs(path, legacy=True)
    try:
        magic = _unpickle_for_needs(handle, needs)
    except pickle.UnpicklingError:
        magic = None
    if magic != _LEGACY_MAGIC:
        raise CheckpointError(f"{path}: truncated or corrupt torch checkpoint (neither a zip file nor a "
                              "legacy torch.save file)")
    for _ in range(3):  # protocol version, system info, the object itself
        _unpickle_for_needs(handle, needs)
    if handle.tell() > limits.MAX_PICKLE_BYTES:
        raise over_limit(path, "the legacy file's pickled part in bytes", handle.tell(), "MAX_PICKLE_BYTES")
    keys = _unpickle_for_needs(handle, needs)
    if not isinstance(keys, list) or sorted(map(str, keys)) != sorted(needs.elements):
        raise CheckpointError(f"{path}: truncated or corrupt legacy torch checkpoint (storage keys do not "
                              "match the tensors)")
    offset = handle.tell()
    for key in keys:
        numel, itemsize = needs.elements[key]
        handle.seek(offset)
        stored = handle.read(8)
        if len(stored) < 8 or struct.unpack("<q", stored)[0] != numel or offset + 8 + numel * itemsize > size:
            raise CheckpointError(f"{path}: truncated or corrupt legacy torch checkpoint (storage "
                                  f"{quote(key)} does not hold the {numel * itemsize} bytes its tensors need)")
        offset += 8 + numel * itemsize


def check_torch_file(path: Path) -> bool:
    """Check a ``torch.save`` file's structure against the limits; True for a zip file (mmap-able),
    False for a legacy one. Raises CheckpointError naming the file and the problem."""
    return read_torch_structure(path).is_zip


@dataclass(frozen=True)
class TorchStructure:
    """What checking a ``torch.save`` file learned: whether it is a zip file (mmap-able) and, for one,
    its object unpickled with the large tensors on the meta device, each storage carrying the file offset
    of its bytes (``stored_offset``)."""

    is_zip: bool
    meta: Any = None


def read_torch_structure(path: Path) -> TorchStructure:
    """``check_torch_file``, keeping what the check unpickled."""
    with open(path, "rb") as handle:
        return _structure(handle, path)


def check_torch_stream(handle: BinaryIO, path: Path | str) -> bool:
    """``check_torch_file`` of an open file or buffer (left at its start); ``path`` names it in errors."""
    return _structure(handle, path).is_zip


def _structure(handle: BinaryIO, path: Path | str) -> TorchStructure:
    size = handle.seek(0, io.SEEK_END)
    handle.seek(0)
    is_zip = zipfile.is_zipfile(handle)
    handle.seek(0)
    meta = None
    with _meta_unpickling(path):
        if is_zip:
            meta = _check_zip(path, handle, size)
        else:
            _check_legacy(path, handle, size)
    handle.seek(0)
    return TorchStructure(is_zip, meta)


def stored_offset(meta: Any) -> int | None:
    """The file offset of a meta tensor's first element (from ``TorchStructure.meta``); None for a tensor
    whose bytes were read into memory during the check (small storages) or that has no record."""
    if not isinstance(meta, torch.Tensor) or meta.device.type != "meta":
        return None
    offset = getattr(meta.untyped_storage(), "_checkpoint_offset", None)
    return None if offset is None else offset + meta.storage_offset() * meta.element_size()


def stored_region(meta: Any) -> FileRegion | None:
    """The file region of a meta tensor from ``TorchStructure.meta`` of a file, or of any view of one (a
    parameter's slice of a flat buffer): its bytes, read with ``io.ranges.read_region``. None as for
    ``stored_offset``."""
    offset = stored_offset(meta)
    path = getattr(meta.untyped_storage(), "_checkpoint_path", None) if offset is not None else None
    if path is None:
        return None
    return FileRegion(Path(path), offset, tuple(meta.shape), tuple(meta.stride()), meta.dtype)


def meta_at(region: FileRegion) -> torch.Tensor:
    """A meta tensor left at ``region`` of its file (``stored_region`` gives the region back): read with
    ``StoredTensors``, straight into its place where a join needs it."""
    nbytes = region.span() * sizes.itemsize(region.dtype) if all(region.shape) else 0
    storage = torch.UntypedStorage(nbytes, device="meta")
    storage._checkpoint_offset = region.offset  # type: ignore[attr-defined]
    storage._checkpoint_path = region.path  # type: ignore[attr-defined]
    return torch.empty(0, dtype=region.dtype, device="meta").set_(storage, 0, region.shape, region.stride)


class StoredTensors:
    """Reads of the tensors a structure check left in their files (``stored_region``): whole into memory
    (``read``), or joined by ``io.ranges.concat_reading`` with each view read straight into its place
    (``concat``, a ``rules.concatenating_with`` join). Tensors already in memory (small ones) pass as they are."""

    def __init__(self, handles: FileHandles | None = None) -> None:
        self.handles = FileHandles() if handles is None else handles

    def locate(self, view: torch.Tensor) -> tuple[int, FileRegion] | None:
        """The open file and region holding ``view`` (None for a tensor in memory)."""
        if view.device.type != "meta":
            return None
        region = stored_region(view)
        if region is None:
            raise ValueError(f"a meta tensor {view.dtype} {list(view.shape)} that no file holds")
        return self.handles.fd(region.path), region

    def read(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor``'s values in memory: one left in its file read into a tensor of its own."""
        found = self.locate(tensor)
        if found is None:
            return tensor
        out = new_tensor(tuple(tensor.shape), tensor.dtype)
        read_region(found[0], found[1], out)
        return out

    def concat(self, views: list[torch.Tensor], dim: int) -> torch.Tensor:
        """``torch.cat(views, dim)``, those left in their files read into their place in the result."""
        return concat_reading(views, dim, self.locate)

    def close(self) -> None:
        self.handles.close()


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bytes: unlike ``torch.equal``, an identical NaN is equal to itself
    (and -0.0 differs from 0.0), which is what "the same replica" means."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(_bytes_of(a), _bytes_of(b))


def _bytes_of(tensor: torch.Tensor) -> torch.Tensor:
    flat = tensor.reshape(-1).contiguous()
    return flat.view(torch.uint8) if flat.numel() else flat.to(torch.uint8)


def stored_differing(reference: torch.Tensor, others: Sequence[torch.Tensor], stored: StoredTensors) -> int | None:
    """The index of one of ``others`` that is not ``bitwise_equal`` to ``reference`` (None: every one is): of those
    whose dtype or shape differs, else of those that differ in the earliest slab, the lowest. Any of them may be left
    in its file (read with ``stored``); they are compared ``SLAB_BYTES`` of rows at a time, each slab of the reference
    read once for all of them, so comparing copies of a large table holds two slabs and reads each copy once."""
    unlike = (index for index, other in enumerate(others)
              if other.dtype != reference.dtype or other.shape != reference.shape)
    found = next(unlike, None)
    if found is not None:
        return found
    if reference.dim() == 0 or reference.numel() == 0:
        whole = stored.read(reference)
        return next((index for index, other in enumerate(others) if not bitwise_equal(whole, stored.read(other))), None)
    step = max(1, SLAB_BYTES // (reference[0].numel() * reference.element_size()))
    for start in range(0, reference.shape[0], step):
        length = min(step, reference.shape[0] - start)
        slab = stored.read(reference.narrow(0, start, length))
        for index, other in enumerate(others):
            if not bitwise_equal(slab, stored.read(other.narrow(0, start, length))):
                return index
    return None


@contextmanager
def _meta_unpickling(path: Path | str) -> Iterator[None]:
    """Failures of the structural unpickling, as torch.load would report them, name the file."""
    try:
        yield
    except CheckpointError:
        raise
    except pickle.UnpicklingError:
        raise  # reported by the caller (an unsafe global names the global)
    except (EOFError, RuntimeError, ValueError, TypeError, IndexError, KeyError, AttributeError,
            struct.error, OverflowError, RecursionError) as exc:
        raise CheckpointError(f"{path}: truncated or corrupt torch checkpoint "
                              f"({type(exc).__name__}: {quote(str(exc), 200)})") from exc



def mappable(path: Path) -> bool:
    """Whether torch.load maps the file's tensors (a zip file) rather than reading them into memory."""
    return zipfile.is_zipfile(path)
