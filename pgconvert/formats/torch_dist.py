"""Facts of Megatron's distributed checkpoint format (``torch_dist``) shared by its loader and saver.

Layout on disk (megatron/training/checkpointing.py, megatron/core/dist_checkpointing, 0.16.1)::

    ROOT/latest_checkpointed_iteration.txt        "1000" or "release"
    ROOT/iter_0001000/ or ROOT/release/
        metadata.json     {"sharded_backend": "torch_dist", "sharded_backend_version": 1,
                           "common_backend": "torch", "common_backend_version": 1}, written last
        common.pt         torch.save of what is not sharded: args, checkpoint_version, iteration and
                          content_metadata (the sharded_state_dict metadata the tensors were cut with)
        .metadata         torch.distributed.checkpoint's Metadata, a pickle: per key its global shape,
                          dtype and chunks; per chunk the file, byte offset and length
        __R_T.distcp      the chunks written by rank R, writer thread T (each a torch.save'd tensor)

The tensors are global: megatron-core's ``sharded_state_dict()`` names every tensor by a global key
and places each rank's piece at an offset, so the files carry no layout; the layout a checkpoint was
saved with lives only in ``common.pt``'s args. Keys, as megatron-core 0.16.1 builds them for
``GPTModel`` with ``singleton_local_shards=False`` (what Megatron-LM saves):

- ``embedding.word_embeddings.weight`` [padded vocab, hidden], ``embedding.position_embeddings.weight``,
  ``decoder.final_layernorm.weight``/``.bias``, ``output_layer.weight`` (absent with tied embeddings:
  the last stage's copy is saved as a non-main replica of the embedding).
- Layers: when all layers hold the same tensors, stacked along a leading layer axis
  (``decoder.layers.self_attention.linear_qkv.weight`` [num_layers, qkv rows, hidden]); with
  ``moe_layer_freq`` a list or > 1, one key per layer with its global index (``decoder.layers.3.…``).
- Norms under the Transformer-Engine spec's fused names in both specs (``provider.FUSED_NORM_NAMES``).
- Routed experts stacked along an expert axis after the layer axis:
  ``decoder.layers.mlp.experts.experts.linear_fc1.weight`` [num_layers, num_experts, rows, hidden]
  (SequentialMLP, TEGroupedMLP and the legacy GroupedMLP all save this naming).
- A SwiGLU ``linear_fc1`` is ``[gate; up]`` globally, the canonical layout: megatron-core saves each
  rank's gate and up halves as two chunks of the same key.
- Each linear's ``_extra_state`` is a bytes entry ``<key>._extra_state/shard_<offsets>_<shape>``
  holding ``torch.save([state])``: one per layer (and expert), replicated over TP, never per rank.
- A hybrid model (``MambaModel``): one key per layer (MambaStack.sharded_state_dict), the final norm
  ``decoder.final_norm.weight``, MambaMixer's ``in_proj.weight`` as one key per segment (``.z .x .B .C .dt``,
  each the segment's global rows) and ``conv1d.weight``/``.bias`` likewise (``.x .B .C``); MambaModel keeps
  ``output_layer._extra_state``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import math
import os
import pickle
import threading
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch

from pgconvert.io import dcp_plan, limits
from pgconvert.model.config import ModelConfig
from pgconvert.errors import CheckpointError, UnsafePickleError
from pgconvert.io.limits import over_limit, quote, read_json
from pgconvert.formats.megatron import resolve_megatron_iteration
from pgconvert.formats.dcp_layout import CHECKPOINT_CONFIG_FILE, GATED_HALVES
from pgconvert.formats.names import COMMON_IN_STORE, COMMON_LEGACY
from pgconvert.model.layers import LayerSpec
from pgconvert.model.vision import LANGUAGE_MODEL_MODULE, is_vision_tensor
from pgconvert.model.provider import (EXPERTS_MODULE, EXTRA_STATE_SUFFIX, FINAL_NORM_BIAS, FINAL_NORM_WEIGHT,
                                      LAYER_PREFIX, MODEL_MODULE_PREFIXES,
                                      MTP_EH_PROJ, MTP_LAYER_MODULE, MTP_PREFIX, LayerTensor, TensorKind,
                                      canonical_names, final_norm_local_name, fused_norm_name, layer_tensors,
                                      mtp_layer_tensors, te_sharded_modules)

COMMON_FILE = "common.pt"
# megatron-core 0.19.0 and later (``dist_checkpointing.save``) store the common state (args, iteration, optimizer
# param groups, ...) inside the checkpoint as the ShardedObject ``common_state`` (one bytes entry, the
# ``torch.save`` of a list of one dict) instead of common.pt; their ``load_common_state_dict`` reads common.pt when
# there is one, else that entry. megatron-core 0.18.x and older read common.pt only.
COMMON_STATE_KEY = "common_state/shard_0_1"
SHARDED_BACKEND = "torch_dist"
# megatron-core's CheckpointingConfig (dist_checkpointing/core.py) as save_config writes it: with the common
# backend up to 0.18.x (common.pt), without from 0.19.0 (the common state is in the store). Both read both.
CHECKPOINT_CONFIG: dict[str, Any] = {
    "sharded_backend": SHARDED_BACKEND,
    "sharded_backend_version": 1,
    "common_backend": "torch",
    "common_backend_version": 1,
}
CHECKPOINT_CONFIG_STORE: dict[str, Any] = {"sharded_backend": SHARDED_BACKEND, "sharded_backend_version": 1}
# What Megatron-LM (>= core 0.14) passes to sharded_state_dict and stores as common.pt's
# content_metadata; a loader rebuilds the model's sharded_state_dict with it.
CONTENT_METADATA: dict[str, Any] = {
    "distrib_optim_sharding_type": "dp_reshardable",
    "singleton_local_shards": False,
    "chained_optim_avoid_prefix": True,
}
# Entries of a training checkpoint that are not model weights: optimizer state (ShardedTensors and
# objects, ``chained_N.`` before chained_optim_avoid_prefix), RNG and rerun-machine state.
TRAINING_STATE_PREFIXES = ("optimizer.", "chained_", "rng_state", "rerun_state_machine_state")

EXPERTS_KEY = EXPERTS_MODULE + "experts."
OUTPUT_LAYER_MODULE = "output_layer"

# Modules whose ``_extra_state`` megatron-core saves, relative to a layer: the layer kinds' TE modules less the
# core attention (TEDotProductAttention.sharded_state_dict saves none; provider.te_sharded_modules); GPTModel
# drops ``output_layer._extra_state``, MambaModel keeps it.


@dataclass(frozen=True)
class DistSegment:
    """Rows ``[start, start + length)`` of a canonical tensor's first dimension, stored as a key of their own: the
    location's key followed by ``suffix``."""

    suffix: str
    start: int
    length: int


@dataclass(frozen=True)
class DistPiece:
    """One stored box of a requested box of a canonical tensor: at ``offsets`` (``sizes``) of ``key``, holding the
    request's rows ``[row, row + rows)`` of its first dimension."""

    key: str
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    row: int
    rows: int


@dataclass(frozen=True)
class DistLocation:
    """Where a canonical tensor lives: a global key and its index on the key's leading stacked axes.

    ``stack`` holds the sizes of those axes (layers, experts); the key's global shape is ``stack``
    followed by the canonical tensor's shape. With ``segments`` the tensor is stored as several keys, one
    per run of its rows (``key`` + the segment's suffix), each of global shape ``stack`` followed by the
    segment's rows and the tensor's other dimensions (megatron-core's MambaMixer ``in_proj``/``conv1d``).
    """

    key: str
    index: tuple[int, ...] = ()
    stack: tuple[int, ...] = ()
    segments: tuple[DistSegment, ...] = ()

    def __post_init__(self) -> None:
        if len(self.index) != len(self.stack) or not all(0 <= i < n for i, n in zip(self.index, self.stack)):
            raise ValueError(f"{self.key}: index {self.index} does not fit the stacked axes {self.stack}")
        ends = [0] + [segment.start + segment.length for segment in self.segments]
        if any(segment.start != end or segment.length < 1 for segment, end in zip(self.segments, ends)):
            raise ValueError(f"{self.key}: segments {self.segments} are not consecutive runs of rows from 0")

    def global_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The key's global shape (one key)."""
        assert not self.segments, f"{self.key} is stored as segments: ask for its key_shapes"
        return self.stack + tuple(shape)

    def key_shapes(self, shape: tuple[int, ...]) -> dict[str, tuple[int, ...]]:
        """Each key the tensor is stored in, with its global shape."""
        if not self.segments:
            return {self.key: self.global_shape(shape)}
        return {self.key + segment.suffix: self.stack + (segment.length, *shape[1:]) for segment in self.segments}

    def chunk(self, starts: tuple[int, ...], lengths: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(offsets, sizes) in the key's global tensor of a region of the canonical tensor (one key)."""
        assert not self.segments, f"{self.key} is stored as segments: ask for its pieces"
        return self.index + tuple(starts), (1,) * len(self.index) + tuple(lengths)

    def pieces(self, starts: tuple[int, ...], lengths: tuple[int, ...]) -> list[DistPiece]:
        """The stored boxes a box of the canonical tensor is made of, in row order."""
        if not self.segments:
            offsets, sizes = self.chunk(starts, lengths)
            return [DistPiece(self.key, offsets, sizes, 0, lengths[0] if lengths else 1)]
        low, high = starts[0], starts[0] + lengths[0]
        pieces = []
        for segment in self.segments:
            first, last = max(low, segment.start), min(high, segment.start + segment.length)
            if first < last:
                offsets = self.index + (first - segment.start, *starts[1:])
                sizes = (1,) * len(self.index) + (last - first, *lengths[1:])
                pieces.append(DistPiece(self.key + segment.suffix, offsets, sizes, first - low, last - first))
        return pieces


def stacked_layers(config: ModelConfig) -> bool:
    """megatron-core's rule (TransformerBlock.sharded_state_dict): layers share stacked keys unless
    they may differ, which it infers from ``moe_layer_freq`` or ``linear_attention_freq`` being a list or
    greater than 1. A hybrid decoder (MambaStack.sharded_state_dict) keys every layer by its global index."""
    linear = config.linear_attention.linear_attention_freq
    return (config.hybrid_override_pattern is None and not isinstance(config.moe.moe_layer_freq, tuple)
            and config.moe.moe_layer_freq == 1 and not isinstance(linear, tuple) and (linear or 1) == 1)


def _dist_layer_name(kind: TensorKind, config: ModelConfig) -> str:
    """A layer tensor's key relative to its layer: the TE spec saves its modules' own names; the
    local spec's ``sharded_state_dict_keys_map`` (gpt_layer_specs.get_gpt_layer_local_spec) renames
    its separate norms to the TE spec's fused names (``provider.FUSED_NORM_NAMES``), MoE layers
    included, so both specs' dense layers save identical keys."""
    if config.transformer_impl == "transformer_engine":
        return kind.local_name(config)
    return fused_norm_name(kind.canonical) or kind.canonical


def refuse_singleton(config: ModelConfig, where: str) -> None:
    """What ``singleton_local_shards`` naming is not read for: grouped-GEMM experts (TEGroupedMLP's and the legacy
    GroupedMLP's keys per local expert), hybrid models."""
    if config.moe.num_experts and config.moe.moe_grouped_gemm:
        raise CheckpointError(f"{where}: saved with singleton_local_shards=True and moe_grouped_gemm=True: pgconvert "
                              "reads that naming for SequentialMLP experts only")
    if config.hybrid_override_pattern is not None:
        raise CheckpointError(f"{where}: a hybrid model saved with singleton_local_shards=True: pgconvert reads "
                              "that naming for GPT models only")


def _dist_segments(kind: TensorKind, config: ModelConfig, shape: tuple[int, ...],
                   singleton: bool = False) -> tuple[DistSegment, ...]:
    """The keys a tensor of ``kind`` is stored as: one per window of its rule's single piece, named by the kind;
    with ``singleton`` (``singleton_local_shards``) a gated linear's two halves."""
    rule = kind.rule_for(config)
    names = tuple(f".{name}" for name in kind.dist_segments)
    if not names and singleton and rule.row_segments == len(GATED_HALVES):
        names = GATED_HALVES
    if not names:
        return ()
    windows = rule.piece_windows(shape, 1, 0)
    assert len(windows) == len(names) and all(window.dim == 0 for window in windows), kind.canonical
    return tuple(DistSegment(name, window.start, window.length) for name, window in zip(names, windows))


def tensor_locations(config: ModelConfig, singleton: bool = False) -> dict[str, DistLocation]:
    """Every canonical tensor's location, in stream order. ``singleton``: as megatron-core saves with the
    ``singleton_local_shards`` metadata (``refuse_singleton`` says what is read so): one key per layer and per
    expert, a gated linear_fc1's gate and up halves apart (``GATED_HALVES``)."""
    stacked = stacked_layers(config) and not singleton
    layers = config.num_layers
    locations: dict[str, DistLocation] = {}
    for layer in range(layers):
        prefix = f"{LAYER_PREFIX}{layer}."
        key_prefix = LAYER_PREFIX if stacked else prefix
        layer_axis = ((layer,), (layers,)) if stacked else ((), ())
        # mamba_stack_spec's MoE layer (a separate TENorm before the MoE) sets no keys map.
        keys_mapped = config.hybrid_override_pattern is None or not config.layers[layer].moe
        _locate_layer(config, layer_tensors(config, layer), prefix, key_prefix, layer_axis, locations, singleton,
                      keys_mapped)
    for index in range(config.mtp_num_layers):
        # MultiTokenPredictionBlock.sharded_state_dict: one key per MTP layer (no layer axis); its
        # transformer_layer saves as a decoder layer does (keys map, experts on an expert axis).
        prefix = f"{MTP_PREFIX}{index}."
        _locate_layer(config, mtp_layer_tensors(config, index), prefix, prefix, ((), ()), locations, singleton)
    for name in (FINAL_NORM_WEIGHT, FINAL_NORM_BIAS):  # MambaStack's final_norm
        locations[name] = DistLocation(final_norm_local_name(config, name))
    located = {name: locations.get(name, DistLocation(name)) for name in canonical_names(config)}
    if config.vision.vision_config is None:
        return located
    # A VL model's language model is Megatron-Bridge's module ``language_model`` (pgconvert.model.vision).
    return {name: location if is_vision_tensor(name)
            else dataclasses.replace(location, key=LANGUAGE_MODEL_MODULE + location.key)
            for name, location in located.items()}


def _locate_layer(config: ModelConfig, tensors: list[LayerTensor], prefix: str, key_prefix: str,
                  layer_axis: tuple[tuple[int, ...], tuple[int, ...]], locations: dict[str, DistLocation],
                  singleton: bool = False, keys_mapped: bool = True) -> None:
    """``keys_mapped``: the layer's local spec renames its separate norms to the TE spec's fused names."""
    experts = config.moe.num_experts or 0
    for tensor in tensors:
        rest = tensor.canonical[len(prefix):]
        head = rest[:len(rest) - len(tensor.kind.canonical)]
        segments = _dist_segments(tensor.kind, config, tensor.kind.shape(config), singleton)
        if tensor.expert is not None:
            head = rest[:rest.index(EXPERTS_MODULE)]
            if singleton:  # SequentialMLP: one key per global expert, ``experts.experts.<e>.``
                locations[tensor.canonical] = DistLocation(
                    f"{key_prefix}{head}{EXPERTS_KEY}{tensor.expert}.{tensor.kind.canonical}", *layer_axis, segments)
                continue
            locations[tensor.canonical] = DistLocation(
                key_prefix + head + EXPERTS_KEY + tensor.kind.canonical,
                layer_axis[0] + (tensor.expert,), layer_axis[1] + (experts,))
            continue
        # megatron-core's MLA layer specs set no sharded_state_dict_keys_map: a key is the
        # module's name in the spec (the TE spec's fused latent norms and dense pre-MLP norm included).
        name = (tensor.kind.local_name(config) if config.attention.multi_latent_attention or not keys_mapped
                else _dist_layer_name(tensor.kind, config))
        locations[tensor.canonical] = DistLocation(key_prefix + head + name, *layer_axis, segments)


def sharded_object_key(key: str, index: tuple[int, ...], stack: tuple[int, ...]) -> str:
    """megatron-core's ``ShardedObject.unique_key``; an object on no stacked axis is shard 0 of 1."""
    offsets, shape = (index, stack) if stack else ((0,), (1,))
    return f"{key}/shard_{'.'.join(map(str, offsets))}_{'.'.join(map(str, shape))}"


def extra_state_keys(config: ModelConfig) -> list[str]:
    """The ``_extra_state`` entries megatron-core's GPTModel (or MambaModel) saves for this model, in layer order."""
    stacked = stacked_layers(config)
    layers = config.num_layers
    keys = []
    for layer in range(layers):
        key_prefix = LAYER_PREFIX if stacked else f"{LAYER_PREFIX}{layer}."
        index, stack = ((layer,), (layers,)) if stacked else ((), ())
        keys += _layer_extra_state_keys(config, key_prefix, config.layers[layer], index, stack)
    for mtp, spec in enumerate(config.mtp_layers):  # eh_proj, then its transformer layer's modules
        prefix = f"{MTP_PREFIX}{mtp}."
        keys.append(sharded_object_key(prefix + MTP_EH_PROJ + EXTRA_STATE_SUFFIX, (), ()))
        keys += _layer_extra_state_keys(config, prefix + MTP_LAYER_MODULE, spec.inner, (), ())
    if config.hybrid_override_pattern is not None:
        # MambaModel has no sharded_state_dict of its own: it keeps the output layer's (empty) entry, which
        # GPTModel.sharded_state_dict drops.
        keys.append(sharded_object_key(OUTPUT_LAYER_MODULE + EXTRA_STATE_SUFFIX, (), ()))
    return keys


def _layer_extra_state_keys(config: ModelConfig, key_prefix: str, spec: LayerSpec, index: tuple[int, ...],
                            stack: tuple[int, ...]) -> list[str]:
    """A layer's modules (its kinds' ``te_modules``, every routed expert's after them)."""
    experts = config.moe.num_experts or 0
    modules, expert_modules = te_sharded_modules(config, spec)
    keys = [sharded_object_key(key_prefix + module + EXTRA_STATE_SUFFIX, index, stack) for module in modules]
    keys += [
        sharded_object_key(key_prefix + EXPERTS_KEY + module + EXTRA_STATE_SUFFIX, index + (expert,),
                           stack + (experts,))
        for expert in range(experts if expert_modules else 0)
        for module in expert_modules
    ]
    return keys


def is_extra_state(key: str) -> bool:
    head, sep, _ = key.partition("/shard_")
    return bool(sep) and head.endswith(EXTRA_STATE_SUFFIX) and head.startswith(MODEL_MODULE_PREFIXES)


def is_training_state(key: str) -> bool:
    return key.startswith(TRAINING_STATE_PREFIXES)


def empty_extra_state() -> io.BytesIO:
    """A bytes entry as megatron-core writes it for a module without state (the local spec's
    linears): the list of the rank's local objects for that key, here the one ``None``."""
    data = io.BytesIO()
    torch.save([None], data)
    data.seek(0)
    return data


# --------------------------------------------------------------------------- torch.distributed.checkpoint calls


class _QuietSingleProcess:
    """torch's single-process warning ignored while any thread is inside ``single_process_calls``.

    ``warnings.catch_warnings`` saves and restores the process's one filter list, so two threads
    (``--threads``) nesting it out of order would leave the filter in place or drop each other's;
    here the first thread in installs it and the last one out restores the filters.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._inside = 0
        self._saved: warnings.catch_warnings | None = None

    def __enter__(self) -> None:
        with self._lock:
            if self._inside == 0:
                self._saved = warnings.catch_warnings()
                self._saved.__enter__()
                warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
            self._inside += 1

    def __exit__(self, *exc_info: object) -> None:
        with self._lock:
            self._inside -= 1
            if self._inside == 0 and self._saved is not None:
                self._saved.__exit__(None, None, None)
                self._saved = None


_QUIET_SINGLE_PROCESS = _QuietSingleProcess()


@contextlib.contextmanager
def single_process_calls() -> Iterator[None]:
    """Around ``dcp.save``/``dcp.load`` with ``no_dist=True``: torch warns at every call that it
    assumes a single process, which is the point here; and whatever failed inside is re-raised as
    itself, not wrapped in torch's ``CheckpointException`` (a BaseException, so ``except Exception``
    would not even see it)."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        with _QUIET_SINGLE_PROCESS:
            yield
    except CheckpointException as exc:
        for failure in exc.failures.values():
            inner = failure[0] if isinstance(failure, tuple) else failure
            if isinstance(inner, BaseException):
                # Keep what inner itself was raised from (a full disk's OSError under torch's
                # RuntimeError); re-raising it here would otherwise replace that with exc.
                raise inner from (inner.__cause__ or inner.__context__)
        raise


# --------------------------------------------------------------------------- metadata.json


def read_checkpoint_config(path: Path) -> dict[str, Any]:
    """``metadata.json``, refused unless it names the torch_dist backend with a torch common part."""
    if not path.exists():
        raise CheckpointError(f"{path}: missing; not a Megatron distributed checkpoint")
    config = read_json(path)
    if not isinstance(config, dict):
        raise CheckpointError(f"{path}: expected a JSON object, found {type(config).__name__}")
    backend = config.get("sharded_backend")
    if backend != SHARDED_BACKEND:
        raise CheckpointError(
            f"{path}: sharded_backend={quote(backend)}: pgconvert reads Megatron distributed checkpoints "
            f"of the {SHARDED_BACKEND!r} backend only"
        )
    for field, expected in (("sharded_backend_version", 1), ("common_backend", "torch"), ("common_backend_version", 1)):
        if config.get(field, expected) != expected:
            raise CheckpointError(f"{path}: {field}={quote(config.get(field))}: only {expected!r} is supported")
    return config


def write_checkpoint_config(directory: Path, common: str = COMMON_LEGACY) -> Path:
    """``metadata.json`` as the megatron-core that keeps the common state where ``common`` says writes it."""
    path = directory / CHECKPOINT_CONFIG_FILE
    path.write_text(json.dumps(CHECKPOINT_CONFIG_STORE if common == COMMON_IN_STORE else CHECKPOINT_CONFIG))
    return path


# --------------------------------------------------------------------------- .metadata


# Every global the .metadata pickle of torch 2.13 / megatron-core 0.16.1 names (its SavePlans in megatron-core's
# ``all_local_plans`` included) besides torch's metadata classes, which are read as ``dcp_plan``'s own types;
# torch's FileSystemReader unpickles it unrestricted.
_DCP_METADATA_GLOBALS = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    # StorageMeta.checkpoint_id, when a writer was given a Path rather than a string.
    ("pathlib", "PosixPath"),
}


@dataclass
class _MCoreMetadata(dcp_plan.Metadata):
    """megatron-core <= 0.15's ``strategies.torch.MCoreMetadata``: torch's Metadata plus ``mcore_data``
    (per key ``nd_reformulated_orig_global_shape`` of its flattened_range tensors); rebuilt here inert."""

    pickled_as: ClassVar[tuple[str, str]] = ("megatron.core.dist_checkpointing.strategies.torch", "MCoreMetadata")
    mcore_data: dict[str, dict[str, Any]] | None = None


@dataclass
class _MCoreSavePlan(dcp_plan.SavePlan):
    """megatron-core <= 0.15's ``MCoreSavePlan`` (the rank plans kept in ``all_local_plans``)."""

    pickled_as: ClassVar[tuple[str, str]] = ("megatron.core.dist_checkpointing.strategies.torch", "MCoreSavePlan")
    mcore_data: dict[str, dict[str, Any]] | None = None


# The two classes megatron-core <= 0.15 pickles into .metadata, mapped to the stand-ins above.
_MCORE_METADATA_CLASSES = {stand_in.pickled_as: stand_in for stand_in in (_MCoreMetadata, _MCoreSavePlan)}
# torch's metadata and plan classes, read as ``dcp_plan``'s types of the same fields.
_DCP_CLASSES = {name: own for own, name in dcp_plan.TORCH_NAMES.items()}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        own = _DCP_CLASSES.get((module, name)) or _MCORE_METADATA_CLASSES.get((module, name))
        if own is not None:
            return own
        if (module, name) in _DCP_METADATA_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"GLOBAL {module}.{name} is not allowed")


def common_state_storage(metadata: dcp_plan.Metadata) -> tuple[Any, Any] | None:
    """The storage index and place (``relative_path``, offset, length) of ``metadata``'s ``common_state`` entry,
    where it has one."""
    for index, info in metadata.storage_data.items():
        if getattr(index, "fqn", None) == COMMON_STATE_KEY:
            return index, info
    return None


def read_dcp_metadata(path: Path) -> dcp_plan.Metadata:
    """torch.distributed.checkpoint's ``.metadata`` through an allowlist of its own classes, read as ``dcp_plan``'s
    types (``dcp_plan.dump_metadata`` writes them back as torch's; torch.distributed.checkpoint is not imported)."""
    try:
        with open(path, "rb") as handle:
            size = os.fstat(handle.fileno()).st_size
            if size > limits.MAX_PICKLE_BYTES:
                raise over_limit(path, "the metadata pickle's size in bytes", size, "MAX_PICKLE_BYTES")
            metadata = _MetadataUnpickler(handle).load()
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing; the distributed checkpoint has no tensor index") from None
    except pickle.UnpicklingError as exc:
        text = str(exc)
        if text.startswith("GLOBAL "):
            raise UnsafePickleError(
                f"{path}: refuses to unpickle global {text.split(' is not')[0].removeprefix('GLOBAL ')}: it is not on the allowlist of "
                "torch.distributed.checkpoint metadata classes (nothing from the file was executed)"
            ) from exc
        raise CheckpointError(f"{path}: truncated or corrupt checkpoint metadata ({quote(text, 200)})") from exc
    except CheckpointError:
        raise
    except Exception as exc:  # an allowlisted class called with hostile arguments raises anything
        raise CheckpointError(f"{path}: truncated or corrupt checkpoint metadata "
                              f"({type(exc).__name__}: {quote(str(exc), 200)})") from exc
    if not isinstance(metadata, dcp_plan.Metadata):
        raise CheckpointError(f"{path}: expected torch.distributed.checkpoint Metadata, found {type(metadata).__name__}")
    _check_metadata(metadata, path)
    return metadata


def _is_index(value: object, length: int | None = None) -> bool:
    """A shape or offset: a sequence of non-negative ints (of ``length`` entries when given)."""
    return (isinstance(value, (tuple, list)) and (length is None or len(value) == length)
            and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value))


def _check_metadata(metadata: dcp_plan.Metadata, path: Path) -> None:
    """The structure the reader relies on, checked once: every entry typed, every chunk inside its
    tensor, every storage entry a file name with an integer extent."""
    entries = metadata.state_dict_metadata
    if not isinstance(entries, dict):
        raise CheckpointError(f"{path}: state_dict_metadata is {type(entries).__name__}, expected a dict")
    for key, md in entries.items():
        where = f"{path}: entry {quote(key)}"
        if not isinstance(key, str):
            raise CheckpointError(f"{where}: not a key name")
        if isinstance(md, dcp_plan.BytesStorageMetadata):
            continue
        if not isinstance(md, dcp_plan.TensorStorageMetadata):
            raise CheckpointError(f"{where}: is a {type(md).__name__}, expected tensor or bytes metadata")
        if not isinstance(getattr(md.properties, "dtype", None), torch.dtype) or not _is_index(md.size):
            raise CheckpointError(f"{where}: malformed tensor metadata (dtype {quote(getattr(md.properties, 'dtype', None))}, "
                                  f"size {quote(md.size)})")
        if not isinstance(md.chunks, list):
            raise CheckpointError(f"{where}: chunks is {type(md.chunks).__name__}, expected a list")
        for chunk in md.chunks:
            offsets, sizes = getattr(chunk, "offsets", None), getattr(chunk, "sizes", None)
            if (not isinstance(chunk, dcp_plan.ChunkStorageMetadata) or not _is_index(offsets, len(md.size))
                    or not _is_index(sizes, len(md.size))
                    or any(o + n > total for o, n, total in zip(offsets, sizes, md.size))):
                raise CheckpointError(f"{where}: a chunk {quote(offsets)} + {quote(sizes)} does not lie inside "
                                      f"its tensor of size {list(md.size)}")
    _check_volumes(metadata, path)


def _check_volumes(metadata: dcp_plan.Metadata, path: Path) -> None:
    """Each key's stored bytes hold at least its chunks' values: sizes are bounded by the data."""
    storage = metadata.storage_data
    if not isinstance(storage, dict):
        raise CheckpointError(f"{path}: no storage index (storage_data is {type(storage).__name__})")
    for index, info in storage.items():
        fields = [getattr(info, name, None) for name in ("offset", "length")]
        if (not isinstance(getattr(index, "fqn", None), str) or not isinstance(getattr(info, "relative_path", None), str)
                or not _is_index(fields)):
            raise CheckpointError(f"{path}: a storage entry is malformed (file {quote(getattr(info, 'relative_path', None))}, "
                                  f"offset {quote(fields[0])}, length {quote(fields[1])}); expected a file name "
                                  "and non-negative integers")
    stored: dict[str, int] = {}
    for index, info in storage.items():
        stored[index.fqn] = stored.get(index.fqn, 0) + info.length
    for key, md in metadata.state_dict_metadata.items():
        if isinstance(md, dcp_plan.TensorStorageMetadata):
            needed = sum(math.prod(chunk.sizes) for chunk in md.chunks) * torch._utils._element_size(md.properties.dtype)
            if stored.get(key, 0) < needed:
                raise CheckpointError(f"{path}: entry {quote(key)}: its chunks hold {needed} bytes of values, but "
                                      f"its storage entries only {stored.get(key, 0)}")


# --------------------------------------------------------------------------- iteration directory


def is_iteration_dir(path: Path) -> bool:
    return (path / CHECKPOINT_CONFIG_FILE).is_file()


def resolve_iteration_dir(root: Path, iteration: int | None) -> tuple[Path, int | None, bool]:
    """The iteration directory to read, as Megatron-LM resolves it (``root`` itself when it holds
    ``metadata.json``)."""
    return resolve_megatron_iteration(root, iteration, is_iteration_dir)
