"""What a checkpoint declares (config.json, Megatron args) against what it stores.

config.json and Megatron args declare how many decoder layers, routed experts and multi-token
prediction layers a model has, and every name list, layer spec and rank plan is built by looping
over those counts. A declared count is believed only up to what the checkpoint stores, counted by
its loader from the tensor index (names and shapes, read before any tensor data): ``StoredCounts``
is that count and ``check_declared_counts`` the one check, which every loader runs before anything
loops over a count (convert, ``--dry-run``, inspect and verify all open sources through a loader).

``shape_settings`` names the settings an expected shape is computed from, so that a stored shape
that contradicts the declared sizes (hidden size, heads, FFN, vocabulary) is refused naming them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from pgconvert.errors import CheckpointError, PgconvertError
from pgconvert.io.limits import MAX_EXPERTS, MAX_LAYERS, MAX_ROUTED_EXPERTS, over_limit
from pgconvert.model.config import GROUPS, SETTING_GROUPS, ModelConfig
from pgconvert.model.provider import (FINAL_NORM_BIAS, MTP_PREFIX, OUTPUT_LAYER, POSITION_EMBEDDINGS, canonical_layer,
                                      layer_tensors, mtp_tensors)


@dataclass(frozen=True)
class StoredCounts:
    """What a checkpoint stores, counted from its tensor index: decoder layers, the most routed
    experts one layer holds, and multi-token prediction layers. ``where`` names what stores them
    (a file or a folder)."""

    where: str
    layers: int
    experts: int
    mtp_layers: int


# The declared counts, each with the StoredCounts field that bounds it, what that counts, and its limit.
_COUNTS: dict[str, tuple[str, str, str]] = {
    "num_layers": ("layers", "decoder layer(s)", "MAX_LAYERS"),
    "num_experts": ("experts", "routed expert(s) in a layer at most", "MAX_EXPERTS"),
    "mtp_num_layers": ("mtp_layers", "multi-token prediction layer(s)", "MAX_LAYERS"),
}
_LIMITS = {"MAX_LAYERS": MAX_LAYERS, "MAX_EXPERTS": MAX_EXPERTS}


def _count(value: object) -> int | None:
    """A declared count to bound; None for anything else (ModelConfig refuses what no model has)."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def check_declared_counts(settings: Mapping[str, object], stored: StoredCounts, declared_in: str,
                          named: Callable[[str], str], error: type[PgconvertError] = CheckpointError) -> None:
    """Refuse a declared count beyond what is stored, or beyond pgconvert's limits.

    ``settings`` are ModelConfig settings by name (those of ``num_layers``, ``num_experts`` and
    ``mtp_num_layers`` it holds are checked); ``declared_in`` is the file that declares them and
    ``named(setting)`` the name its user wrote (``num_hidden_layers``, ``args.num_layers``).
    """
    for setting, (field, what, limit) in _COUNTS.items():
        value = _count(settings.get(setting))
        if value is None:
            continue
        found = getattr(stored, field)
        if value > found:
            raise error(f"{declared_in}: {named(setting)}={value}, but the checkpoint stores {found} {what} "
                        f"({stored.where})")
        if value > _LIMITS[limit]:
            raise error(str(over_limit(declared_in, named(setting), value, limit)))
    layers, experts = _count(settings.get("num_layers")), _count(settings.get("num_experts"))
    if layers is not None and experts is not None and layers * experts > MAX_ROUTED_EXPERTS:
        raise error(str(over_limit(declared_in, f"{named('num_layers')} × {named('num_experts')}",
                                   layers * experts, "MAX_ROUTED_EXPERTS")))


# No bound but pgconvert's limits: for a description compared with a model, not read for one (a
# carried or given config.json: its counts are differences from the model's, named as such).
LIMITS_ONLY = StoredCounts("pgconvert's limits", MAX_LAYERS, MAX_EXPERTS, MAX_LAYERS)


class _Reading:
    """A ModelConfig (or one of its sub-configs) that records every setting read through it,
    including those its properties and methods read."""

    def __init__(self, target: object, seen: list[str]) -> None:
        object.__setattr__(self, "_target", target)
        object.__setattr__(self, "_seen", seen)

    def __getattr__(self, name: str) -> Any:
        target, seen = self._target, self._seen
        declared = getattr(type(target), name, None)
        if isinstance(declared, property) and declared.fget is not None:
            return declared.fget(self)
        if callable(declared) and not isinstance(declared, (type, cached_property)):
            return declared.__get__(self)
        group = _derived_group(name) if isinstance(target, ModelConfig) else None
        if group is not None:
            return getattr(getattr(self, group), name)
        value = getattr(target, name)
        if name in GROUPS:
            return _Reading(value, seen)
        if name in SETTING_GROUPS and name not in seen:
            seen.append(name)
        return value


def _derived_group(name: str) -> str | None:
    """The sub-config of a value derived within it that ModelConfig also answers (``head_dim``)."""
    if name in SETTING_GROUPS or name in GROUPS:
        return None
    return next((group for group, kind in GROUPS.items() if isinstance(getattr(kind, name, None), property)), None)


def shape_settings(shape: Callable[[Any], object], config: ModelConfig) -> list[str]:
    """The settings (ModelConfig names, in the order read) ``shape(config)`` is computed from."""
    seen: list[str] = []
    shape(_Reading(config, seen))
    return seen


# The settings that declare a tensor outside the layers (the rest every model has).
_NON_LAYER_DECLARED = {OUTPUT_LAYER: "tie_embeddings", POSITION_EMBEDDINGS: "position_embedding_type",
                       FINAL_NORM_BIAS: "normalization"}


def declaring_settings(config: ModelConfig, missing: Iterable[str], expected: Iterable[str] | None = None) -> list[str]:
    """The settings that declare the canonical tensors ``missing``, which the checkpoint (or one of
    its files, expected to hold ``expected``: by default every tensor) lacks: the layer count for a
    layer none of whose expected tensors is stored, the expert count for a routed expert's, the MTP
    layer count for an MTP layer's, which layers are MoE for an MLP's, what a tensor's existence
    depends on (qk-norm, biases, shared experts, a query LoRA), and untied embeddings for the output
    layer."""
    names = set(missing)
    wanted = set(expected) if expected is not None else None
    layers = sorted({parsed[0] for parsed in map(canonical_layer, names) if parsed is not None})
    settings = [_NON_LAYER_DECLARED[name] for name in sorted(names) if name in _NON_LAYER_DECLARED]
    for layer in layers:
        held = {tensor.canonical for tensor in layer_tensors(config, layer)}
        if held & (wanted if wanted is not None else held) <= names:
            settings.append("num_layers")
            break
    tensors = [tensor for layer in layers for tensor in layer_tensors(config, layer)]
    if any(name.startswith(MTP_PREFIX) for name in names):
        tensors += mtp_tensors(config)
    for tensor in tensors:
        if tensor.canonical not in names:
            continue
        found = shape_settings(tensor.kind.exists, config)
        if tensor.canonical.startswith(MTP_PREFIX):
            found.append("mtp_num_layers")
        if tensor.expert is not None:
            found.append("num_experts")
        if config.moe.num_experts is not None and ".mlp." in tensor.canonical:
            found.append("moe_layer_freq")
        settings += [setting for setting in found if setting not in settings]
    return settings


def named_values(config: ModelConfig, settings: Iterable[str], named: Callable[[str], str]) -> str:
    """``name=value`` of ``settings`` as ``named`` spells them (``args.num_layers=4``); the vocab size
    is left out (vocab tables hold padded rows, named on their own)."""
    return ", ".join(f"{named(setting)}={config.setting(setting)!r}" for setting in settings if setting != "vocab_size")
