"""A DCP store's save plan and ``.metadata``, as a single process writes them, without torch.distributed.checkpoint.

``import torch.distributed.checkpoint`` costs most of a second and tens of megabytes (its file system module pulls
DTensor, which pulls sympy), more than some conversions spend on their bytes. The writers (``dcp_writer``,
``pgconvert/formats/dcp_save.py``, the torch_dist optimizer records) need only a handful of its types, so they use
these: plain dataclasses with torch's fields, in torch's order, holding the same objects torch's own planner puts
there (``global_save_plan`` follows ``create_default_global_save_plan``). ``dump_metadata`` pickles them under
torch's own module and class names (``TORCH_NAMES``), so ``.metadata`` is the pickle torch's ``FileSystemWriter``
writes, byte for byte, and torch's readers unpickle torch's classes. pgconvert's own reader reads a ``.metadata``
into these types (``pgconvert.formats.torch_dist.read_dcp_metadata``), so the stores it reads (and the one it adds
the optimizer records' index to) never import torch.distributed.checkpoint either.
"""

from __future__ import annotations

import enum
import importlib
import io
import math
import pickle
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from pgconvert.errors import PgconvertError
from pgconvert.io.pickling import StandInPickler

_METADATA = "torch.distributed.checkpoint.metadata"
_PLANNER = "torch.distributed.checkpoint.planner"
# The version torch (2.4 to 2.13 at least) records in a store it writes: the format these types describe.
DCP_VERSION = "1.0.0"


class WriteItemType(enum.Enum):
    """What an item of a save plan is (torch's ``WriteItemType``, its values too: megatron-core <= 0.15 pickles the
    ranks' plans into ``.metadata``)."""

    TENSOR = 1
    SHARD = 2
    BYTE_IO = 3


class MemoryFormat(enum.Enum):
    """torch's ``_MEM_FORMAT_ENCODING``: how ``TensorProperties`` records a memory format."""

    TORCH_CONTIGUOUS_FORMAT = 0
    TORCH_CHANNELS_LAST = 1
    TORCH_PRESERVE_FORMAT = 2


# Each encoding's memory format, and back.
_MEMORY_FORMATS = {MemoryFormat.TORCH_CONTIGUOUS_FORMAT: torch.contiguous_format,
                   MemoryFormat.TORCH_CHANNELS_LAST: torch.channels_last,
                   MemoryFormat.TORCH_PRESERVE_FORMAT: torch.preserve_format}
_ENCODINGS = {memory_format: encoding for encoding, memory_format in _MEMORY_FORMATS.items()}


@dataclass
class ChunkStorageMetadata:
    offsets: torch.Size
    sizes: torch.Size


@dataclass
class TensorProperties:
    """A stored tensor's dtype and layout; pickled as torch's tuple (see ``__getstate__``)."""

    dtype: torch.dtype = field(default_factory=torch.get_default_dtype)
    layout: torch.layout = field(default=torch.strided)
    requires_grad: bool = False
    memory_format: torch.memory_format = field(default=torch.contiguous_format)
    pin_memory: bool = False

    def __getstate__(self) -> tuple[Any, ...]:
        return self.dtype, self.layout, self.requires_grad, _ENCODINGS[self.memory_format], self.pin_memory

    def __setstate__(self, state: tuple[Any, ...] | dict[str, Any]) -> None:
        if isinstance(state, dict):  # pickled by a torch before the tuple
            self.__dict__.update(state)
            return
        self.dtype, self.layout, self.requires_grad, encoding, self.pin_memory = state
        self.memory_format = _MEMORY_FORMATS[encoding]


@dataclass
class TensorStorageMetadata:
    properties: TensorProperties
    size: torch.Size
    chunks: list[ChunkStorageMetadata]


@dataclass
class BytesStorageMetadata:
    pass


@dataclass
class StorageMeta:
    checkpoint_id: str | None = None
    save_id: str | None = None
    load_id: str | None = None
    modules: list[str] = field(default_factory=list)


@dataclass
class Metadata:
    state_dict_metadata: dict[str, TensorStorageMetadata | BytesStorageMetadata]
    planner_data: Any = None
    storage_data: Any = None
    storage_meta: StorageMeta | None = None
    version: str | None = None


@dataclass(frozen=True, init=False)
class MetadataIndex:
    """A key of a store and, for a tensor, its chunk's offsets; ``index``: the chunk's position in the key's list,
    a hint that takes no part in equality (torch's own ``__init__``, hence the attributes' order)."""

    fqn: str
    offset: torch.Size | None = None
    index: int | None = field(hash=False, compare=False, default=None)

    def __init__(self, fqn: str, offset: Sequence[int] | None = None, index: int | None = None) -> None:
        object.__setattr__(self, "fqn", fqn)
        object.__setattr__(self, "index", index)
        if offset is not None:
            object.__setattr__(self, "offset", torch.Size(offset))


@dataclass
class StorageInfo:
    """Where one item lies: its data file (relative to the store), offset and length (torch's ``_StorageInfo``)."""

    relative_path: str
    offset: int
    length: int
    transform_descriptors: Sequence[str] | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {key: value for key, value in self.__dict__.items() if value is not None}


@dataclass
class TensorWriteData:
    chunk: ChunkStorageMetadata
    properties: TensorProperties
    size: torch.Size


@dataclass
class WriteItem:
    index: MetadataIndex
    type: WriteItemType
    tensor_data: TensorWriteData | None = None


@dataclass
class WriteResult:
    index: MetadataIndex
    size_in_bytes: int
    storage_data: StorageInfo


@dataclass
class SavePlan:
    items: list[WriteItem]
    storage_data: Any = None
    planner_data: Any = None


@dataclass
class StoragePrefix:
    """torch's ``_StoragePrefix``: the data files' name before their number, in the ranks' plans megatron-core <= 0.15
    keeps in ``.metadata``."""

    prefix: str


class SavePlanner:
    """A store's plan given up front (``create_local_plan``) and each item's data made when it is written
    (``resolve_data``: a tensor holding exactly the chunk, or the bytes entry's ``io.BytesIO``)."""

    def create_local_plan(self) -> SavePlan:
        raise NotImplementedError

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor | io.BytesIO:
        raise NotImplementedError


def tensor_item(key: str, offsets: Sequence[int], sizes: Sequence[int], global_shape: Sequence[int],
                dtype: torch.dtype) -> WriteItem:
    """The item of one chunk of ``key``, built as torch's planner builds it (each ``torch.Size`` its own object)."""
    chunk_offsets = torch.Size(offsets)
    return WriteItem(index=MetadataIndex(key, chunk_offsets), type=WriteItemType.SHARD,
                     tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(chunk_offsets, torch.Size(sizes)),
                                                 properties=TensorProperties(dtype=dtype),
                                                 size=torch.Size(global_shape)))


def bytes_item(key: str) -> WriteItem:
    return WriteItem(index=MetadataIndex(key), type=WriteItemType.BYTE_IO)


# Each type here as torch names it in a pickle.
TORCH_NAMES: dict[type, tuple[str, str]] = {
    ChunkStorageMetadata: (_METADATA, "ChunkStorageMetadata"),
    TensorProperties: (_METADATA, "TensorProperties"),
    TensorStorageMetadata: (_METADATA, "TensorStorageMetadata"),
    BytesStorageMetadata: (_METADATA, "BytesStorageMetadata"),
    StorageMeta: (_METADATA, "StorageMeta"),
    Metadata: (_METADATA, "Metadata"),
    MetadataIndex: (_METADATA, "MetadataIndex"),
    MemoryFormat: (_METADATA, "_MEM_FORMAT_ENCODING"),
    StorageInfo: ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    StoragePrefix: ("torch.distributed.checkpoint.filesystem", "_StoragePrefix"),
    WriteItemType: (_PLANNER, "WriteItemType"),
    WriteItem: (_PLANNER, "WriteItem"),
    TensorWriteData: (_PLANNER, "TensorWriteData"),
    SavePlan: (_PLANNER, "SavePlan"),
}


class MetadataPickler(StandInPickler):
    """Python's pickler, with each type of ``TORCH_NAMES`` written as torch's class it stands for, and a stand-in
    that says what it stands for (``pickled_as``) as that; torch's own objects as they are."""

    def stands_for(self, cls: type) -> tuple[str, str] | None:
        return TORCH_NAMES.get(cls) or getattr(cls, "pickled_as", None)


# Python's pickler takes about 0.11 ms per storage entry of a store; made torch's objects and pickled by C's, about
# half that, once torch's classes are imported, which costs most of a second: past this many entries, that is the
# cheaper way to the same bytes.
PURE_PYTHON_ENTRIES = 12_000


def dump_metadata(metadata: Metadata | Any) -> bytes:
    """``.metadata``'s bytes: ``pickle.dump`` of ``metadata`` at the default protocol, as torch's writer does. A store
    of more than ``PURE_PYTHON_ENTRIES`` entries is pickled by C's pickler as torch's own objects (``as_torch``), a
    smaller one by Python's under torch's names: the same bytes."""
    if type(metadata) is Metadata and len(metadata.storage_data or ()) > PURE_PYTHON_ENTRIES:
        return pickle.dumps(as_torch(metadata), protocol=pickle.DEFAULT_PROTOCOL)
    buffer = io.BytesIO()
    MetadataPickler(buffer, protocol=pickle.DEFAULT_PROTOCOL).dump(metadata)
    return buffer.getvalue()


def as_torch(value: Any, made: dict[int, Any] | None = None) -> Any:
    """``value`` with every instance of the types here (in lists, tuples and dicts too) made an instance of torch's
    class of that name, holding the same attribute values (imports torch.distributed.checkpoint). Each object is made
    once, so what ``value`` shares the result shares; anything else (strings, ``torch.Size``, torch's own objects) is
    kept as it is."""
    made = {} if made is None else made
    if id(value) in made:
        return made[id(value)]
    if type(value) in _TORCH_CLASSES or isinstance(value, (list, tuple, dict)):
        made[id(value)] = converted = _converted(value, made)
        return converted
    return value


def _converted(value: Any, made: dict[int, Any]) -> Any:
    if isinstance(value, list):
        return [as_torch(item, made) for item in value]
    if isinstance(value, tuple):  # a torch.Size is kept as it is
        return tuple(as_torch(item, made) for item in value) if type(value) is tuple else value
    if isinstance(value, dict):
        return {as_torch(key, made): as_torch(item, made) for key, item in value.items()}
    torch_class = _TORCH_CLASSES[type(value)]()
    if isinstance(value, enum.Enum):
        return torch_class(value.value)
    instance = torch_class.__new__(torch_class)
    instance.__dict__.update({name: as_torch(item, made) for name, item in value.__dict__.items()})
    return instance


def _torch_class(module: str, name: str) -> Callable[[], type]:
    return lambda: getattr(importlib.import_module(module), name)


# Each type here's torch class, imported when first asked for.
_TORCH_CLASSES: dict[type, Callable[[], type]] = {own: _torch_class(*named) for own, named in TORCH_NAMES.items()}


def global_save_plan(plan: SavePlan) -> tuple[list[WriteItem], Metadata]:
    """One process's plan as torch's ``DefaultSavePlanner`` makes it global: each tensor item's index given its
    chunk's position in its key's list, and the store's ``Metadata`` (the key's properties and global shape from its
    first chunk's item; ``planner_data``: the plan's). A key planned twice, or chunks that do not tile their
    tensor, are refused."""
    metadata: dict[str, TensorStorageMetadata | BytesStorageMetadata] = {}
    items = []
    for item in plan.items:
        if item.type == WriteItemType.BYTE_IO:
            if item.index.fqn in metadata:
                raise PgconvertError(f"the save plan holds {item.index.fqn!r} twice")
            metadata[item.index.fqn] = BytesStorageMetadata()
            items.append(item)
            continue
        assert item.tensor_data is not None
        stored = metadata.setdefault(item.index.fqn, TensorStorageMetadata(
            properties=item.tensor_data.properties, size=item.tensor_data.size, chunks=[]))
        if not isinstance(stored, TensorStorageMetadata):
            raise PgconvertError(f"the save plan holds {item.index.fqn!r} as bytes and as a tensor")
        index = MetadataIndex(item.index.fqn, item.index.offset, index=len(stored.chunks))
        items.append(WriteItem(index=index, type=item.type, tensor_data=item.tensor_data))
        stored.chunks.append(item.tensor_data.chunk)
    _check_tiling(metadata)
    planner_data = dict(plan.planner_data) if plan.planner_data is not None else None
    return items, Metadata(metadata, planner_data=planner_data)


def _check_tiling(metadata: dict[str, TensorStorageMetadata | BytesStorageMetadata]) -> None:
    """Every tensor's chunks lie inside it and their volumes add up to its own (torch validates its global plan)."""
    for key, stored in metadata.items():
        if not isinstance(stored, TensorStorageMetadata):
            continue
        for chunk in stored.chunks:
            if len(chunk.offsets) != len(stored.size) or any(
                    start < 0 or start + length > size
                    for start, length, size in zip(chunk.offsets, chunk.sizes, stored.size, strict=True)):
                raise PgconvertError(f"the save plan's chunk of {key!r} at {tuple(chunk.offsets)} with sizes "
                                     f"{tuple(chunk.sizes)} is not inside its shape {tuple(stored.size)}")
        volume = sum(math.prod(chunk.sizes) for chunk in stored.chunks)
        if volume != math.prod(stored.size):
            raise PgconvertError(f"the save plan's chunks of {key!r} hold {volume} elements; its shape "
                                 f"{tuple(stored.size)} has {math.prod(stored.size)}")
