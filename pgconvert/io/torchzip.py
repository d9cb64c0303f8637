"""``torch.save``'s zip format, written as a stream: one tensor in memory at a time.

``torch.save`` pickles the whole object and then writes every storage it found, so every tensor
must exist at once: a rank file needs RAM about its own size. Here the object holds
``PlannedTensor`` placeholders (shape and dtype known up front); the pickle describes their
storages, and each placeholder is asked for its tensor only when its storage record is written,
then dropped. Real tensors in the object are written as ``torch.save`` would write them.

The bytes are those torch 2.13's writer (miniz, ``caffe2/serialize/inline_container.cc``) produces
for the same object: records ``archive/data.pkl``, ``.format_version``, ``.storage_alignment``,
``byteorder``, ``data/<key>``..., ``version``, ``.data/serialization_id``; each local header
carries torch's ``FB`` padding field so data starts on a 64-byte boundary; bit 3 (sizes in a data
descriptor after the data) and bit 11 (UTF-8 names) are set; zip64 extra fields for records at or
beyond 4 GiB or of 4 GiB and more; a zip64 end record always. Without ``crc32`` every CRC is 0, as
torch writes with ``compute_crc32`` off (torch's reader then does not check it). With it, the CRC-32 is
ISA-L's (``isal``, the ``fast`` extra: a fifth of zlib's CPU time) where installed, else zlib's: the same
values.
"""

from __future__ import annotations

import io
import pickle
import struct
import functools
import sys
import zlib
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, BinaryIO

import torch

from pgconvert.io import sizes
from pgconvert.io.reuse import RecordsInFlight, ReusedMemory

ALIGNMENT = 64
FORMAT_VERSION = b"1"
FILE_VERSION = b"3\n"
PICKLE_PROTOCOL = 2  # torch.serialization.DEFAULT_PROTOCOL
_U16 = 0xFFFF
_U32 = 0xFFFFFFFF
_U64 = (1 << 64) - 1
_DESCRIPTOR = b"PK\x07\x08"
CRC_SLICE = 1 << 20  # bytes a record's CRC-32 is taken over at a time before they are written (cache-sized)


@dataclass(frozen=True, eq=False)
class PlannedTensor:
    """A contiguous CPU tensor that ``produce`` makes when its record is written.

    ``parts``, when set, is used instead of ``produce``: the tensor's elements in order as
    consecutive 1-d tensors of its dtype, each written as it comes, so the record is never whole in
    memory (a flat buffer larger than any of its parameters).
    """

    shape: tuple[int, ...]
    dtype: torch.dtype
    produce: Callable[[], torch.Tensor]
    parts: Callable[[], Iterable[torch.Tensor]] | None = None

    @property
    def nbytes(self) -> int:
        return sizes.nbytes(self.shape, self.dtype)

    def contiguous_stride(self) -> tuple[int, ...]:
        return sizes.contiguous_stride(self.shape)


class TensorMismatchError(RuntimeError):
    """A planned tensor's producer returned another shape or dtype than planned (a bug)."""


def save_stream(obj: Any, handle: BinaryIO, crc32: bool = False, reuse_memory: bool = True,
                in_flight: int | None = None, from_memory: bool = False) -> list[Future[None]]:
    """Write ``obj`` as ``torch.save(obj, handle)`` would, producing planned tensors one by one.

    ``handle`` needs only ``write``. ``crc32`` computes the records' CRC32 (torch's default);
    without it they are 0, as with torch's ``compute_crc32`` off. ``reuse_memory``: each planned
    tensor is produced in memory lent from one record to the next (``pgconvert.io.reuse``); off for
    planned tensors that exist already. ``in_flight`` (a handle with ``write_in_place``, ``io.output.
    OutputFile``): each produced record is made at its place in the file and written from its own memory, that
    many records left being written while the next is produced (each holding a block of its own; 0: each record's
    write is waited for before the next is produced, in one block). None: every record is staged (``write``).
    ``from_memory`` (such a handle, ``reuse_memory`` off: planned tensors that exist already): each is written from
    its own memory where its place allows; the futures of those writes are returned, for the caller to wait on
    (``output.settled``) before that memory changes (otherwise none are).
    """
    pickled, storages = _pickle(obj)
    archive = _ZipStream(handle, crc32)
    in_place = reuse_memory and in_flight is not None and hasattr(handle, "write_in_place")
    memory = ReusedMemory() if reuse_memory and not in_place else None
    records = RecordsInFlight(in_flight) if in_place and in_flight is not None else None
    from_memory = from_memory and not reuse_memory and hasattr(handle, "write_in_place")
    writing: list[Future[None]] = []
    _preamble(archive, pickled)
    for key, item in storages:
        name = f"data/{key}"
        if isinstance(item, PlannedTensor) and item.parts is not None:
            archive.record_parts(name, item.nbytes, _part_bytes(item))
        elif records is not None and isinstance(item, PlannedTensor):
            with records.lending(item.nbytes, archive.data_offset(name, item.nbytes)):
                records.add(archive.record(name, _storage_bytes(item, None), in_place=True))
        else:
            writing += archive.record(name, _storage_bytes(item, memory),
                                      in_place=from_memory and isinstance(item, PlannedTensor))
    archive.record("version", FILE_VERSION)
    archive.record(".data/serialization_id", archive.serialization_id().encode())
    archive.finish()
    return writing


def _preamble(archive: _ZipStream, pickled: bytes) -> None:
    """The records before the storages: the pickle, the format version, the storage alignment, the byte order."""
    archive.record("data.pkl", pickled)
    archive.record(".format_version", FORMAT_VERSION)
    archive.record(".storage_alignment", str(ALIGNMENT).encode())
    archive.record("byteorder", sys.byteorder.encode())


class CountingSink:
    """A write-only handle that keeps nothing but the count of bytes written to it."""

    def __init__(self) -> None:
        self.offset = 0

    def write(self, data: bytes | memoryview) -> int:
        self.offset += len(data)
        return len(data)


def storage_data_offset(obj: Any) -> int | None:
    """Where the first storage's bytes start in the archive ``save_stream`` writes of ``obj`` (None: it holds none),
    known from the pickle and the records before them alone: a planned tensor's shape and dtype, not its values."""
    pickled, storages = _pickle(obj)
    if not storages:
        return None
    archive = _ZipStream(CountingSink(), crc32=False)  # type: ignore[arg-type]
    _preamble(archive, pickled)
    key, item = storages[0]
    size = item.nbytes if isinstance(item, PlannedTensor) else item.nbytes()
    return archive.data_offset(f"data/{key}", size)


class _PlannedStorage:
    def __init__(self, planned: PlannedTensor) -> None:
        self.planned = planned


_TENSOR_V3_DTYPES = torch.storage._new_dtypes()


class _Pickler(pickle._Pickler):  # type: ignore[name-defined,misc]
    """torch.save's pickler, with planned tensors reduced as torch reduces a contiguous tensor.

    The pure-Python pickler, so that a class carrying its own ``qualified_name`` (the inert
    stand-ins of framework classes, see ``megatron_format.OpaqueGlobal``) is written under the
    framework's name, which only the reader resolves.
    """

    def __init__(self, file: Any) -> None:
        super().__init__(file, protocol=PICKLE_PROTOCOL)
        self.keys: dict[tuple[str, int], str] = {}
        self.storages: list[tuple[str, torch.UntypedStorage | PlannedTensor]] = []
        self.dtypes: dict[int, torch.dtype] = {}
        self.planned: dict[int, _PlannedStorage] = {}

    def save_global(self, obj: Any, name: str | None = None) -> None:
        qualified = vars(obj).get("qualified_name") if isinstance(obj, type) else None
        if not isinstance(qualified, str):
            super().save_global(obj, name)
            return
        module, _, qualname = qualified.rpartition(".")
        self.write(pickle.GLOBAL + f"{module}\n{qualname}\n".encode("utf-8"))
        self.memoize(obj)

    def reducer_override(self, obj: Any) -> Any:
        if not isinstance(obj, PlannedTensor):
            return NotImplemented
        storage = self.planned.setdefault(id(obj), _PlannedStorage(obj))
        args: tuple[Any, ...] = (storage, 0, tuple(obj.shape), obj.contiguous_stride(), False, OrderedDict())
        if obj.dtype in _TENSOR_V3_DTYPES:
            return torch._utils._rebuild_tensor_v3, (*args, obj.dtype)
        return torch._utils._rebuild_tensor_v2, args

    def persistent_id(self, obj: Any) -> tuple[Any, ...] | None:
        if isinstance(obj, _PlannedStorage):
            planned = obj.planned
            key = self._key(("planned", id(obj)), planned)
            if planned.dtype in _TENSOR_V3_DTYPES:
                return ("storage", torch.UntypedStorage, key, "cpu", planned.nbytes)
            typed = torch.storage.TypedStorage(dtype=planned.dtype, device="cpu", _internal=True)
            numel = planned.nbytes // torch.empty((), dtype=planned.dtype).element_size()
            return ("storage", getattr(torch, typed._pickle_storage_type()), key, "cpu", numel)
        if isinstance(obj, torch.storage.TypedStorage):
            storage, dtype = obj._untyped_storage, obj.dtype
            storage_type, numel = getattr(torch, obj._pickle_storage_type()), obj._size()
        elif isinstance(obj, torch.UntypedStorage):
            storage, dtype = obj, torch.uint8
            storage_type, numel = torch.UntypedStorage, obj.nbytes()
        else:
            return None
        if storage.device.type != "cpu":
            raise ValueError(f"only CPU tensors can be saved here, not {storage.device}")
        if storage.data_ptr() != 0 and self.dtypes.setdefault(storage.data_ptr(), dtype) != dtype:
            raise RuntimeError("Cannot save multiple tensors or storages that view the same data as different types")
        return ("storage", storage_type, self._key(("storage", storage._cdata), storage), "cpu", numel)

    def _key(self, identity: tuple[str, int], item: torch.UntypedStorage | PlannedTensor) -> str:
        key = self.keys.get(identity)
        if key is None:
            key = self.keys[identity] = str(len(self.keys))
            self.storages.append((key, item))
        return key


def _pickle(obj: Any) -> tuple[bytes, list[tuple[str, torch.UntypedStorage | PlannedTensor]]]:
    buffer = io.BytesIO()
    pickler = _Pickler(buffer)
    pickler.dump(obj)
    return buffer.getvalue(), pickler.storages


def _storage_bytes(item: torch.UntypedStorage | PlannedTensor, memory: ReusedMemory | None) -> memoryview:
    """The bytes of a storage record; a planned tensor is produced (and checked) here, in ``memory``
    where its producer makes it through ``reuse.new_tensor`` (None: in whatever is lent around the call)."""
    if isinstance(item, torch.UntypedStorage):
        flat = torch.empty(0, dtype=torch.uint8).set_(item)
    else:
        with memory.lending(item.nbytes) if memory is not None else nullcontext():
            tensor = item.produce()
        if tuple(tensor.shape) != item.shape or tensor.dtype != item.dtype or tensor.device.type != "cpu":
            raise TensorMismatchError(f"planned {item.dtype} {item.shape} on cpu, produced {tensor.dtype} "
                                      f"{tuple(tensor.shape)} on {tensor.device}")
        flat = tensor.detach().resolve_conj().resolve_neg().contiguous().reshape(-1).view(torch.uint8)
    return memoryview(flat.numpy()).cast("B")


def _part_bytes(item: PlannedTensor) -> Iterator[memoryview]:
    """The bytes of a planned tensor's ``parts``, one part at a time (each checked)."""
    assert item.parts is not None
    for part in item.parts():
        if part.dtype != item.dtype or part.device.type != "cpu" or part.dim() != 1:
            raise TensorMismatchError(f"planned {item.dtype} {item.shape} on cpu in 1-d parts, produced a part "
                                      f"{part.dtype} {tuple(part.shape)} on {part.device}")
        yield memoryview(part.detach().contiguous().view(torch.uint8).numpy()).cast("B")


@functools.cache
def crc32_function() -> Callable[[Any, int], int]:
    """``zlib.crc32``, or ISA-L's CRC-32 of the same polynomial where the ``isal`` package is installed."""
    try:
        from isal.isal_zlib import crc32
    except ImportError:
        return zlib.crc32
    return crc32  # type: ignore[no-any-return]


@dataclass(frozen=True)
class _LocalHeader:
    """A record's local header: its bytes, the record's full name, its flags and whether it needs zip64 fields."""

    data: bytes
    name: bytes
    flags: int
    zip64: bool


class _ZipStream:
    """Zip records laid out as torch's miniz-based writer lays them out (see the module docstring)."""

    def __init__(self, handle: BinaryIO, crc32: bool) -> None:
        self.handle = handle
        self.crc32 = crc32
        self.offset = 0
        self.central: list[bytes] = []
        self.names: list[str] = []
        self.combined_crc = 0

    def _write(self, data: bytes | memoryview) -> None:
        self.handle.write(data)
        self.offset += len(data)

    def _write_summed(self, data: bytes | memoryview, crc: int) -> int:
        """Write ``data``, its CRC-32 (with ``crc32``) taken a slice at a time just before the slice is copied out, so
        the copy reads it from the cache; returns the CRC so far."""
        if not self.crc32:
            self._write(data)
            return 0
        view = memoryview(data).cast("B")
        for start in range(0, len(view), CRC_SLICE):
            piece = view[start:start + CRC_SLICE]
            crc = crc32_function()(piece, crc)
            self._write(piece)
        return crc

    def record(self, name: str, data: bytes | memoryview, in_place: bool = False) -> list[Future[None]]:
        """One record; ``in_place``: written from ``data``'s own memory where the handle can (``OutputFile.
        write_in_place``), the futures to wait for before that memory changes returned."""
        return self.record_parts(name, len(data), iter([data]), in_place)

    def _local_header(self, name: str, size: int) -> _LocalHeader:
        """A record's local header written here, its data starting on an ``ALIGNMENT`` boundary."""
        full = f"archive/{name}".encode()
        zip64 = size >= _U32 or self.offset >= _U32
        # The local header's zip64 field has a compressed size of 0 (not known before the data).
        local64 = _zip64_field(size, 0, self.offset) if zip64 else b""
        padding = -(self.offset + 30 + len(full) + 4 + len(local64)) % ALIGNMENT
        extra = local64 + struct.pack("<HH", 0x4246, padding) + b"Z" * padding
        # An empty record has no data descriptor (and so no bit 3).
        flags = 0x0808 if size else 0x0800
        header = struct.pack("<IHHHHHIIIHH", 0x04034B50, 0, flags, 0, 0, 0, 0, 0, 0, len(full), len(extra))
        return _LocalHeader(header + full + extra, full, flags, zip64)

    def data_offset(self, name: str, size: int) -> int:
        """Where the data of a record written next would start in the file."""
        return self.offset + len(self._local_header(name, size).data)

    def record_parts(self, name: str, size: int, parts: Iterator[bytes | memoryview],
                     in_place: bool = False) -> list[Future[None]]:
        """One record of ``size`` bytes, its data written part by part as ``parts`` yields them (``record``)."""
        header_offset = self.offset
        local = self._local_header(name, size)
        full, flags, zip64 = local.name, local.flags, local.zip64
        central64 = _zip64_field(size, size, header_offset) if zip64 else b""
        self._write(local.data)
        crc, head, written = 0, b"", 0
        writing: list[Future[None]] = []
        for data in parts:
            if not len(data):
                continue
            if len(head) < 8:
                head += bytes(data[:8 - len(head)])
            if in_place:
                crc = crc32_function()(data, crc) if self.crc32 else 0
                writing += self.handle.write_in_place(data)  # type: ignore[attr-defined]
                self.offset += len(data)
            else:
                crc = self._write_summed(data, crc)
            written += len(data)
        if written != size:
            raise TensorMismatchError(f"record {name}: planned {size} bytes, produced {written}")
        if size >= 8 and head[:4] == _DESCRIPTOR:
            # torch folds the CRC field of every written buffer that starts like a data descriptor
            # into the serialization id, and a record's data is one such buffer.
            self.combined_crc = _hash_combine(self.combined_crc, struct.unpack("<I", head[4:8])[0])
        if size:
            self._write(struct.pack("<IIQQ", 0x08074B50, crc, size, size) if zip64
                        else struct.pack("<IIII", 0x08074B50, crc, size, size))
            self.combined_crc = _hash_combine(self.combined_crc, crc)
        self.central.append(struct.pack("<IHHHHHHIIIHHHHHII", 0x02014B50, 0, 0, flags, 0, 0, 0, crc,
                                        min(size, _U32), min(size, _U32), len(full), len(central64), 0, 0, 0, 0,
                                        min(header_offset, _U32)) + full + central64)
        self.names.append(name)
        return writing

    def serialization_id(self) -> str:
        """torch's id: a combined hash of the record names, in its ``std::unordered_set`` order, and
        the combined CRC32s, each as 20 digits."""
        names_hash = 0
        for name in _unordered_set_order([name.encode() for name in self.names]):
            names_hash = _hash_combine(names_hash, _std_hash(name))
        return f"{names_hash:020d}{self.combined_crc:020d}"

    def finish(self) -> None:
        directory = b"".join(self.central)
        directory_offset = self.offset
        self._write(directory)
        end64_offset = self.offset
        count = len(self.central)
        self._write(struct.pack("<IQHHIIQQQQ", 0x06064B50, 44, 0x031E, 0x002D, 0, 0, count, count,
                                len(directory), directory_offset))
        self._write(struct.pack("<IIQI", 0x07064B50, 0, end64_offset, 1))
        self._write(struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, min(count, _U16), min(count, _U16),
                                min(len(directory), _U32), min(directory_offset, _U32), 0))


def _zip64_field(size: int, compressed: int, header_offset: int) -> bytes:
    """The zip64 extra field: sizes when the record is 4 GiB or more, the offset when it starts there."""
    fields = struct.pack("<QQ", size, compressed) if size >= _U32 else b""
    fields += struct.pack("<Q", header_offset) if header_offset >= _U32 else b""
    return struct.pack("<HH", 1, len(fields)) + fields


def _hash_combine(seed: int, value: int) -> int:
    """c10::hash_combine on 64-bit size_t."""
    return (seed ^ ((value + 0x9E3779B9 + (seed << 6) + (seed >> 2)) & _U64)) & _U64


_MUL = (0xC6A4A793 << 32) + 0x5BD1E995


def _shift_mix(value: int) -> int:
    return value ^ (value >> 47)


def _std_hash(data: bytes) -> int:
    """libstdc++'s ``std::hash<std::string>`` (``_Hash_bytes``, seed 0xc70f6907) on 64-bit."""
    aligned = len(data) & ~7
    value = (0xC70F6907 ^ (len(data) * _MUL)) & _U64
    for start in range(0, aligned, 8):
        word = int.from_bytes(data[start:start + 8], "little")
        value = ((value ^ ((_shift_mix(word * _MUL & _U64) * _MUL) & _U64)) * _MUL) & _U64
    if len(data) & 7:
        value = ((value ^ int.from_bytes(data[aligned:], "little")) * _MUL) & _U64
    return _shift_mix((_shift_mix(value) * _MUL) & _U64)


# Bucket counts a libstdc++ unordered_set passes through when filled one element at a time
# (_Prime_rehash_policy, max load factor 1: 13 at the first insert, then the prime of
# __prime_list at or above twice the count once it is exceeded).
_BUCKET_COUNTS = (13, 29, 59, 127, 257, 541, 1109, 2357, 5087, 10273, 20753, 42043, 85229, 172933,
                  351061, 712697, 1447153, 2938679, 5967347, 12117689, 24607243, 49969847)


def _unordered_set_order(names: list[bytes]) -> list[bytes]:
    """The iteration order of a libstdc++ ``std::unordered_set<std::string>`` after inserting
    ``names`` in this order: a singly linked list, each bucket a run in it, a new element put at
    the start of its bucket's run (or of the whole list for an empty bucket); a rehash relinks the
    elements in list order the same way."""
    hashes = [_std_hash(name) for name in names]
    head = -1
    following: dict[int, int | None] = {head: None}
    buckets: dict[int, int] = {}
    size = 0
    for index, code in enumerate(hashes):
        if index == 0 or index + 1 > _BUCKET_COUNTS[size]:
            size += index != 0
            buckets = _relink(following, hashes, _BUCKET_COUNTS[size])
        count = _BUCKET_COUNTS[size]
        bucket = code % count
        before = buckets.get(bucket)
        if before is None:
            following[index] = following[head]
            following[head] = index
            nxt = following[index]
            if nxt is not None:
                buckets[hashes[nxt] % count] = index
            buckets[bucket] = head
        else:
            following[index] = following[before]
            following[before] = index
    order = []
    node = following[head]
    while node is not None:
        order.append(names[node])
        node = following[node]
    return order


def _relink(following: dict[int, int | None], hashes: list[int], count: int) -> dict[int, int]:
    """libstdc++'s rehash of unique keys into ``count`` buckets; returns bucket -> node before it."""
    head = -1
    node = following[head]
    following[head] = None
    buckets: dict[int, int] = {}
    first_bucket = 0
    while node is not None:
        nxt = following[node]
        bucket = hashes[node] % count
        before = buckets.get(bucket)
        if before is None:
            following[node] = following[head]
            following[head] = node
            buckets[bucket] = head
            if following[node] is not None:
                buckets[first_bucket] = node
            first_bucket = bucket
        else:
            following[node] = following[before]
            following[before] = node
        node = nxt
    return buckets
