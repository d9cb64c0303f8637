"""Facts of the Hugging Face safetensors format shared by its loader and saver.

Layout on disk (transformers' ``save_pretrained``)::

    DIR/config.json
    DIR/model.safetensors                          one file, or
    DIR/model.safetensors.index.json               {"metadata": {"total_size": N}, "weight_map": {name: file}}
    DIR/model-00001-of-00003.safetensors …
    DIR/tokenizer.json, tokenizer_config.json, … (side files: pgconvert.formats.hf_side)

The index is untrusted input: a shard name must be a plain ``*.safetensors`` file name inside
DIR, so a crafted index cannot make pgconvert read anything else.
"""

from __future__ import annotations

import copy
import functools
import logging
import math
import re
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import SafetensorError, safe_open

from pgconvert.model.config import DTYPES, ModelConfig
from pgconvert.errors import CheckpointError, ConfigError, PgconvertError
from pgconvert.families import FAMILIES, INFERENCE_ORDER, mtp, supported_architectures
from pgconvert.families.refused import REFUSED_ARCHITECTURES
from pgconvert.families.table import REQUIRED, SLOT, ConfigField, ConfigRule, Family, TensorTable
from pgconvert.io.limits import MAX_SAFETENSORS_HEADER_BYTES, over_limit, parse_json, quote, read_json
from pgconvert.model.declared import LIMITS_ONLY, StoredCounts, check_declared_counts
from pgconvert.model.provider import LAYER_PREFIX, MTP_PREFIX
from pgconvert.model.provider import canonical_shapes as provider_shapes
from pgconvert.semantics import FAMILY_SPECIFIC_SETTINGS
from pgconvert.semantics.rope import hf_unrepresentable
from pgconvert.formats.stream import TensorMeta
from pgconvert.io import sizes
from pgconvert.io.ranges import FileRegion

if TYPE_CHECKING:
    from pgconvert.formats.hf_quantized import QuantizedTensors

log = logging.getLogger(__name__)

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
SHARD_SUFFIX = ".safetensors"
# transformers' default max_shard_size="5GB" (decimal units).
DEFAULT_MAX_SHARD_SIZE = 5_000_000_000
# The HF-sourced model's Megatron-only settings: the local layer spec and Megatron's default padding.
LOADED_DEFAULTS: dict[str, object] = {name: getattr(ModelConfig, name)
                                      for name in ("transformer_impl", "make_vocab_size_divisible_by")}
# transformers 5 writes "dtype"; 4.x wrote "torch_dtype".
DTYPE_KEYS: tuple[str, ...] = ("dtype", "torch_dtype")

SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


def shard_file_name(index: int, count: int) -> str:
    """transformers' shard names: ``model-00001-of-00003.safetensors`` (1-based)."""
    return f"model-{index:05d}-of-{count:05d}{SHARD_SUFFIX}"


@dataclass(frozen=True)
class HFOrigin:
    """Where an HF source came from: the saver copies its config and tokenizer files."""

    directory: Path
    config_json: dict[str, Any]
    family: Family
    # The quantized tensors an hf target writes as stored (--keep-fp8); None: dequantized.
    quantized: QuantizedTensors | None = None


# --- config.json -----------------------------------------------------------------------------

def read_json_object(path: Path, error: type[PgconvertError] = CheckpointError) -> dict[str, Any]:
    if not path.is_file():
        raise error(f"{path}: missing")
    loaded = read_json(path, error)
    if not isinstance(loaded, dict):
        raise error(f"{path}: expected a JSON object at the top level, found {type(loaded).__name__}")
    return loaded


def family_of(doc: dict[str, Any], path: Path, error: type[PgconvertError] = CheckpointError) -> Family:
    """The family named by ``architectures[0]``."""
    architectures = doc.get("architectures")
    supported = ", ".join(supported_architectures())
    if not isinstance(architectures, list) or not architectures or not isinstance(architectures[0], str):
        raise error(f"{path}: architectures={quote(architectures)}: expected a list naming one of {supported}")
    family = FAMILIES.get(architectures[0])
    if family is None:
        reason = REFUSED_ARCHITECTURES.get(architectures[0], f"supported: {supported}")
        raise error(f"{path}: architectures[0]={quote(architectures[0])} is not supported; {reason}")
    return family


MISSING = object()  # what get_path returns for an absent key


def get_path(doc: dict[str, Any], path: tuple[str, ...]) -> object:
    node: object = doc
    for key in path:
        if not isinstance(node, dict) or key not in node:
            return MISSING
        node = node[key]
    return node


def set_path(doc: dict[str, Any], path: tuple[str, ...], value: object) -> None:
    node = doc
    for key in path[:-1]:
        node = node.setdefault(key, {})
    node[path[-1]] = value


def _read_field(doc: dict[str, Any], spec: ConfigField, path: Path, error: type[PgconvertError]) -> object:
    present = [(where, get_path(doc, where)) for where in spec.spellings if get_path(doc, where) is not MISSING]
    given = [value for _, value in present if value is not None]
    if spec.kind is int and any(value != given[0] for value in given):
        # transformers maps one spelling onto the other, and which one wins depends on its version.
        raise error(f"{path}: " + " and ".join(f"{'.'.join(where)}={quote(value)}" for where, value in present)
                    + f": two spellings of one setting ({spec.model_field}) that disagree")
    if present:
        where, value = present[0]
    else:
        if spec.default is REQUIRED:
            raise error(f"{path}: {spec.key} is missing")
        return spec.default
    if value is None and spec.null_refused is not None:
        raise error(f"{path}: {'.'.join(where)}=null: {spec.null_refused}; config.json must give a value")
    if value is None and spec.nullable:
        return None
    if value is None and spec.default is not REQUIRED:
        return spec.default
    key = ".".join(where)
    if spec.kind is bool:
        if not isinstance(value, bool):
            raise error(f"{path}: {key}={quote(value)}: expected true or false")
        return value
    if spec.kind is int:
        if not isinstance(value, int) or isinstance(value, bool):
            raise error(f"{path}: {key}={quote(value)}: expected an integer")
        return value
    if spec.kind is float:
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
            raise error(f"{path}: {key}={quote(value)}: expected a finite number")
        return float(value)
    raise AssertionError(f"config field kind {spec.kind!r}")


def model_config_from_hf(doc: dict[str, Any], path: Path, stored_dtype: torch.dtype | None = None,
                         error: type[PgconvertError] = CheckpointError,
                         stored: StoredCounts | None = None) -> tuple[Family, ModelConfig, list[str]]:
    """The family, the ModelConfig and notices (settings ModelConfig cannot carry) of a config.json.

    ``stored``, what the checkpoint stores (``stored_counts``), bounds the declared layer and expert
    counts before anything loops over them, the family's rules included (their per-layer lists)."""
    family = family_of(doc, path, error)
    if family.vision_language is not None:  # the language model's settings nested in its text config
        refusal = family.vision_language.text_model_refusal(doc)
        if refusal is not None:
            raise error(f"{path}: {refusal}")
        doc = family.vision_language.flat(doc)
    for key, expected in family.hf_fixed.items():
        value = doc.get(key, expected)
        if value != expected:
            raise error(
                f"{path}: {key}={quote(value)}: {family.architecture} is converted only with {key}={expected!r}"
            )
    values, read_from = _read_fields(doc, family, path, error)
    if stored is not None:
        check_declared_counts(values, stored, str(path), lambda setting: read_from.get(setting, setting), error)
    for rule in family.rules:
        present = rule.present(doc)
        try:
            ruled = dict(rule.read(present, dict(values)))
        except ValueError as exc:
            raise error(f"{path}: {exc}") from exc
        assert sorted(ruled) == sorted(rule.model_fields), (family.architecture, sorted(ruled))
        if stored is not None:  # a count a rule reads (Nemotron-H's layers, from their kinds' list)
            check_declared_counts(ruled, stored, str(path), lambda setting: _counted_by(rule, doc), error)
        values.update(ruled)
    values["params_dtype"] = _config_dtype(doc, stored_dtype)
    values.update({**LOADED_DEFAULTS, **family.megatron_defaults})
    try:
        config = ModelConfig.from_settings(values)
    except ConfigError as exc:
        raise error(f"{path}: {_named_as_written(exc, doc, family, read_from)}") from exc
    notices = [
        f"{path}: {key}={quote(doc[key])} has no Megatron setting: a megatron target is a model that behaves as "
        f"{key}={assumed!r} unless the Megatron run is set to match; an hf target keeps config.json"
        for key, assumed in family.hf_assumed.items()
        if key in doc and doc[key] != assumed
    ]
    notices += hf_unrepresentable(doc, path, family.hf_rope_types_carried)
    return family, config, notices


def _read_fields(doc: dict[str, Any], family: Family, path: Path,
                 error: type[PgconvertError]) -> tuple[dict[str, object], dict[str, str]]:
    """The ModelConfig values of the family's fixed values and fields, and the config.json key each
    field was read from (as written)."""
    values: dict[str, object] = dict(family.fixed)
    read_from: dict[str, str] = {}
    for spec in family.fields:
        value = _read_field(doc, spec, path, error)
        if spec.model_field in values and values[spec.model_field] != value:
            raise error(
                f"{path}: {read_from[spec.model_field]}={quote(values[spec.model_field])} and "
                f"{spec.key}={quote(value)}: Megatron has one setting ({spec.model_field}) for both; they must agree"
            )
        values[spec.model_field] = value
        read_from.setdefault(spec.model_field, _written_key(doc, spec))
    return values, read_from


def _written_key(doc: dict[str, Any], spec: ConfigField) -> str:
    """The spelling of ``spec`` that config.json holds (its own name where none is present)."""
    where = next((where for where in spec.spellings if get_path(doc, where) is not MISSING), spec.path)
    return ".".join(where)


def _counted_by(rule: ConfigRule, doc: dict[str, Any]) -> str:
    """How a message names a count a rule read: the length of the first of its keys config.json holds."""
    key = next((key for key in (*rule.keys, *rule.legacy_keys) if doc.get(key) is not None), rule.keys[0])
    return f"len({key})" if isinstance(doc.get(key), (list, str)) else key


def _named_as_written(exc: ConfigError, doc: dict[str, Any], family: Family, read_from: dict[str, str]) -> str:
    """A ModelConfig refusal told in config.json's words: the key the user wrote and its value, with
    Megatron's name for the setting beside it where the two differ."""
    keys = [read_from[exc.setting]] if exc.setting in read_from else [
        key for rule in family.rules if exc.setting in rule.model_fields for key in rule.keys if key in doc]
    if not keys or exc.constraint is None:
        return f"describes an impossible model: {exc}"
    written = ", ".join(_as_written(doc, key) for key in keys)
    megatron = "" if keys == [exc.setting] else f" (Megatron's {str(exc).removesuffix(': ' + exc.constraint)})"
    return f"{written}: {exc.constraint}{megatron}"


def described_by(doc: dict[str, Any], family: Family, settings: list[str], config: ModelConfig) -> str:
    """``key=value`` of the config.json keys that give ``settings`` (those the family fixes left out),
    as written; a key config.json leaves out is shown with the value its default gave."""
    parts: list[str] = []
    for setting in settings:
        if setting in family.fixed:
            continue
        fields = [spec for spec in family.fields if spec.model_field == setting]
        keys = ([_written_key(doc, fields[0])] if fields else
                [key for rule in family.rules if setting in rule.model_fields for key in rule.keys if key in doc])
        if setting == "mtp_num_layers" and family.hf_mtp_layers_key is not None:
            keys = [family.hf_mtp_layers_key]
        for key in keys:
            value = get_path(doc, tuple(key.split(".")))
            text = (f"{key}={quote(value)}" if value is not MISSING
                    else f"{key} absent ({quote(config.setting(setting))})")
            if text not in parts:
                parts.append(text)
    return ", ".join(parts)


def _as_written(doc: dict[str, Any], key: str) -> str:
    value = get_path(doc, tuple(key.split(".")))
    return f"{key} (absent)" if value is MISSING else f"{key}={quote(value)}"


def _config_dtype(doc: dict[str, Any], stored_dtype: torch.dtype | None) -> str:
    for key in DTYPE_KEYS:
        value = doc.get(key)
        if isinstance(value, str) and value in DTYPES:
            return value
    if stored_dtype is not None and sizes.dtype_name(stored_dtype) in DTYPES:
        return sizes.dtype_name(stored_dtype)
    return "float32"


def family_mismatches(family: Family, config: ModelConfig) -> list[str]:
    """Why ``config`` cannot be written as ``family`` (empty when it can)."""
    mismatches = [
        f"{name}={config.setting(name)!r} (needs {expected!r})"
        for name, expected in family.fixed.items()
        if config.setting(name) != expected
    ]
    refusals = (rule.refuses(config) for rule in family.rules)
    if config.mtp_num_layers and family.hf_mtp_layers_key is None:
        mismatches.append(f"mtp_num_layers={config.mtp_num_layers} (no multi-token prediction layers)")
    return mismatches + [refusal for refusal in refusals if refusal is not None]


def infer_family(config: ModelConfig) -> Family:
    """The family to write for a model that names none: the first in INFERENCE_ORDER that fits."""
    reasons = []
    for architecture in INFERENCE_ORDER:
        family = FAMILIES[architecture]
        # A family without a key for a setting the model has does not fit either.
        mismatches = family_mismatches(family, config) + unmapped_losses(architecture, config)
        if not mismatches:
            return family
        reasons.append(f"{architecture}: {', '.join(mismatches)}")
    raise ConfigError(
        "hf: the model fits none of the supported families "
        f"({', '.join(supported_architectures())}): " + "; ".join(reasons)
    )


def require_family_fits(family: Family, config: ModelConfig, where: str) -> None:
    mismatches = family_mismatches(family, config)
    if mismatches:
        raise ConfigError(f"{where}: the model cannot be written as {family.architecture}: {', '.join(mismatches)}")


def hf_config_from_model(family: Family, config: ModelConfig, dtype: torch.dtype) -> dict[str, Any]:
    """A config.json for ``config`` built from the family table alone."""
    doc: dict[str, Any] = {"architectures": [family.architecture], "model_type": family.model_type}
    doc.update(copy.deepcopy(dict(family.hf_scratch)))
    doc.update(copy.deepcopy(dict(family.hf_assumed)))
    doc.update(copy.deepcopy(dict(family.hf_fixed)))
    for spec in family.fields:
        value = spec.value_of(config)
        if value is None and not (spec.nullable and spec.default is not None):
            continue  # absent reads as None too
        for where in (spec.path, *spec.legacy):
            set_path(doc, where, value)
    for rule in family.rules:
        doc.update(copy.deepcopy(dict(rule.write(config))))
    doc.update(mtp.written_declaration(family, config))
    doc["dtype"] = sizes.dtype_name(dtype)
    return doc if family.vision_language is None else family.vision_language.nested(doc)


# --- what an HF family cannot express ------------------------------------------------------------

def _carried_fields(family: Family) -> set[str]:
    return ({spec.model_field for spec in family.fields} | set(family.fixed)
            | {name for rule in family.rules for name in rule.model_fields})


def unmapped_losses(architecture: str, config: ModelConfig) -> list[str]:
    """The settings of ``config`` only some families hold that ``architecture`` has no config.json key for."""
    family = FAMILIES.get(architecture)
    carried = _carried_fields(family) if family is not None else set()
    return [f"{name}={config.setting(name)!r}: {architecture} has no such setting"
            for name, default in FAMILY_SPECIFIC_SETTINGS.items()
            if name not in carried and config.setting(name) != default]


def hf_training_notes(architecture: str, config: ModelConfig) -> list[str]:
    """Training-only settings an HF ``architecture`` has no config.json key for: named, never refused.

    Dropout changes no output of the trained model (inference runs without it), so ``--strict``
    does not refuse it; every real Megatron-LM run records hidden_dropout (0.1 by default). A family
    that holds the setting (Seed-OSS's ``residual_dropout``) writes it, and nothing is named.
    """
    family = FAMILIES.get(architecture)
    if config.hidden_dropout != 0.0 and (family is None or "hidden_dropout" not in _carried_fields(family)):
        return [f"not carried (training only): hidden_dropout={config.hidden_dropout}: {architecture} has no "
                "hidden dropout; set it in your fine-tuning run"]
    return []


def hf_losses(architecture: str, config: ModelConfig) -> list[str]:
    """The settings of ``config`` an HF ``architecture`` written from it cannot express (beyond every
    family's, what its family computes is its ``hf_computes``)."""
    family = FAMILIES.get(architecture)
    computes = family.hf_computes if family is not None else frozenset()
    losses = []
    if config.positions.rotary_percent != 1.0 and "rotary_percent" not in computes:
        losses.append(f"rotary_percent={config.positions.rotary_percent} (partial rotary): {architecture} rotates the "
                      "whole head")
    for name, default in (("glu_linear_offset", 0.0), ("activation_func_clamp_value", None)):
        if config.setting(name) != default and name not in computes:
            losses.append(f"{name}={config.setting(name)}: {architecture} has no clamped GLU")
    if config.moe.num_experts is not None:
        losses += _router_losses(architecture, config, computes)
    return losses + unmapped_losses(architecture, config)


def _router_losses(architecture: str, config: ModelConfig, computes: frozenset[str]) -> list[str]:
    losses = []
    if config.moe.moe_router_score_function != "softmax" and "moe_router_score_function" not in computes:
        losses.append(f"moe_router_score_function={config.moe.moe_router_score_function!r}: {architecture} "
                      "routes with softmax")
    if (config.moe.moe_router_topk_scaling_factor not in (None, 1.0)
            and "moe_router_topk_scaling_factor" not in computes):
        losses.append(f"moe_router_topk_scaling_factor={config.moe.moe_router_topk_scaling_factor}: "
                      f"{architecture} does not scale routing weights")
    if config.moe.moe_router_num_groups is not None and "moe_router_num_groups" not in computes:
        losses.append(f"moe_router_num_groups={config.moe.moe_router_num_groups}, moe_router_group_topk="
                      f"{config.moe.moe_router_group_topk}: {architecture} does not route by expert groups")
    if config.moe.moe_router_pre_softmax and "moe_router_pre_softmax" not in computes:
        losses.append(f"moe_router_pre_softmax=True: {architecture} renormalizes the top-k weights")
    return losses


def config_disagreements(doc: dict[str, Any], path: Path, config: ModelConfig) -> tuple[Family, list[str]]:
    """The family a given config.json names and where it disagrees with ``config``."""
    family, described, _ = model_config_from_hf(doc, path, error=ConfigError, stored=LIMITS_ONLY)
    # Compared as config.json would hold them: a field the model leaves unset may mean a value.
    fields = {spec.model_field: spec for spec in family.fields}
    differences = [
        f"{name}: {fields[name].value_of(described)!r} in the file, {fields[name].value_of(config)!r} in the model"
        for name in sorted(fields)
        if fields[name].value_of(described) != fields[name].value_of(config)
    ]
    for rule in family.rules:
        in_file, in_model = rule.write(described), rule.write(config)
        # A key a rule writes for neither (Nemotron-H's MoE keys of a dense model) does not differ.
        differences += [
            f"{key}: {in_file.get(key)!r} in the file, {in_model.get(key)!r} in the model"
            for key in rule.keys
            if in_file.get(key) != in_model.get(key)
        ]
    return family, differences


def with_dtype(doc: dict[str, Any], dtype: torch.dtype) -> dict[str, Any]:
    """A copy of ``doc`` whose dtype entry says ``dtype`` (the tensors' dtype after any cast)."""
    updated = copy.deepcopy(doc)
    name = sizes.dtype_name(dtype)
    written = False
    for key in DTYPE_KEYS:
        if key in updated:
            updated[key] = name
            written = True
    if not written:
        updated["dtype"] = name
    return updated


# --- tensors ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class _LayerSlots:
    """How a family's HF names hold a layer index and an expert index (from its table's rows)."""

    layer: re.Pattern[str]  # the layer prefix, the index, the rest of the name
    experts: tuple[str, ...]  # text between the layer index and an expert index (".mlp.experts.")
    stacked: tuple[str, ...]  # the rest of a name whose tensor stacks every expert of the layer on dim 0
    mtp: tuple[str, ...]  # the rest of a name only a multi-token prediction layer holds (".eh_proj.weight")


def _layer_slots(table: TensorTable) -> list[_LayerSlots]:
    by_prefix: dict[str, tuple[set[str], set[str], set[str]]] = {}
    for row in table.rows:
        canonical = row.canonical
        if canonical is None or not canonical.startswith((LAYER_PREFIX + SLOT, MTP_PREFIX + SLOT)):
            continue
        for pattern in row.hf:
            prefix, _, rest = pattern.partition(SLOT)
            experts, stacked, mtp = by_prefix.setdefault(prefix, (set(), set(), set()))
            if row.stacked:
                stacked.add(rest)
            elif SLOT in rest:
                experts.add(rest.partition(SLOT)[0])
            elif canonical.startswith(MTP_PREFIX):
                mtp.add(rest)
    return [_LayerSlots(re.compile(re.escape(prefix) + r"(\d+)(\..*)", re.DOTALL), *map(tuple, parts))
            for prefix, parts in by_prefix.items()]


def stored_counts(table: TensorTable, stored: Mapping[str, TensorMeta], where: str) -> StoredCounts:
    """The decoder layers, the most routed experts in one layer and the multi-token prediction
    layers (HF numbers them after the decoder's; told apart by the tensors only they hold) an HF
    checkpoint stores, from its tensor names and shapes as ``table`` spells them."""
    slots = _layer_slots(table)
    layers: set[int] = set()
    mtp: set[int] = set()
    experts: dict[int, set[int]] = {}
    stacked: dict[int, int] = {}
    for name, meta in stored.items():
        for slot in slots:
            match = slot.layer.fullmatch(name)
            if match is None:
                continue
            layer, rest = int(match.group(1)), match.group(2)
            (mtp if rest in slot.mtp else layers).add(layer)
            if rest in slot.stacked and meta.shape:
                stacked[layer] = max(stacked.get(layer, 0), meta.shape[0])
            for infix in slot.experts:
                index = rest[len(infix):].partition(".")[0] if rest.startswith(infix) else ""
                if index.isdigit():
                    experts.setdefault(layer, set()).add(int(index))
    most = max([len(indices) for indices in experts.values()] + list(stacked.values()), default=0)
    return StoredCounts(where, len(layers - mtp), most, len(mtp))


def canonical_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Global shape of every canonical tensor, with the true vocab (an HF model has no padding)."""
    if config.vocab_size is None:
        raise ConfigError("vocab_size: unknown; the true vocab size is needed (pass --true-vocab-size)")
    return provider_shapes(config)


def validate_shard_name(name: object, index_path: Path) -> str:
    """A shard name from an index: a plain ``*.safetensors`` file name, nothing else."""
    problem = None
    if not isinstance(name, str) or not name:
        problem = "is not a file name"
    elif "\x00" in name:
        problem = "contains a NUL byte"
    elif name.startswith("/") or Path(name).is_absolute():
        problem = "is an absolute path"
    elif ".." in name:
        problem = "contains '..'"
    elif "/" in name or "\\" in name:
        problem = "contains a path separator"
    elif not name.endswith(SHARD_SUFFIX):
        problem = f"does not end in {SHARD_SUFFIX}"
    if problem is not None:
        raise CheckpointError(
            f"{index_path}: shard name {quote(name)} {problem}; shards must be plain *{SHARD_SUFFIX} "
            "file names inside the checkpoint directory"
        )
    assert isinstance(name, str)
    return name


def resolve_inside(directory: Path, name: str, referrer: Path) -> Path:
    """``directory / name`` if it resolves inside ``directory`` (a symlink may point elsewhere)."""
    root = directory.resolve()
    resolved = (directory / name).resolve()
    if resolved.parent != root and root not in resolved.parents:
        raise CheckpointError(
            f"{referrer}: {name!r} resolves to {resolved}, outside the checkpoint directory {root}; "
            "refusing to read it"
        )
    return resolved


def parse_index(index_path: Path) -> dict[str, str]:
    """tensor name -> shard file name, from an index that has been checked entry by entry."""
    doc = read_json_object(index_path)
    weight_map = doc.get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(f"{index_path}: weight_map is missing or empty")
    checked: dict[str, str] = {}
    for tensor, shard in weight_map.items():
        if not isinstance(tensor, str):
            raise CheckpointError(f"{index_path}: weight_map key {quote(tensor)} is not a tensor name")
        checked[tensor] = validate_shard_name(shard, index_path)
    metadata = doc.get("metadata", {})
    total = metadata.get("total_size") if isinstance(metadata, dict) else None
    if total is not None and (not isinstance(total, int) or isinstance(total, bool) or total < 0):
        raise CheckpointError(f"{index_path}: metadata.total_size={quote(total)}: expected a byte count")
    return checked


def check_header(path: Path) -> None:
    """A safetensors header read by pgconvert itself before the library parses it: bounded in size
    and depth, and each tensor named once (the library keeps the last of two same-named entries)."""
    try:
        with open(path, "rb") as handle:
            prefix = handle.read(8)
            if len(prefix) < 8:
                return  # the library names the file as not a safetensors file
            (length,) = struct.unpack("<Q", prefix)
            if length > MAX_SAFETENSORS_HEADER_BYTES:
                raise over_limit(path, "the safetensors header's size in bytes", length, "MAX_SAFETENSORS_HEADER_BYTES")
            header = handle.read(length)
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot be read: {exc.strerror or exc}") from exc
    if len(header) == length:
        try:
            parse_json(header, path)
        except CheckpointError as exc:
            detail = str(exc).removeprefix(f"{path}: ")
            raise CheckpointError(f"{path}: not a readable safetensors file (corrupt header?): {detail}") from None


def read_header(path: Path) -> dict[str, TensorMeta]:
    """Shape and dtype of every tensor in a safetensors file, from its header alone."""
    check_header(path)
    try:
        with safe_open(str(path), framework="pt") as handle:
            metas = {}
            for name in handle.keys():
                piece = handle.get_slice(name)
                dtype_name = piece.get_dtype()
                dtype = SAFETENSORS_DTYPES.get(dtype_name)
                if dtype is None:
                    raise CheckpointError(f"{path}: {name} has dtype {dtype_name}, which pgconvert does not convert")
                metas[name] = TensorMeta(tuple(piece.get_shape()), dtype)
    except SafetensorError as exc:
        raise CheckpointError(f"{path}: not a readable safetensors file (corrupt header?): {exc}") from exc
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot be read: {exc}") from exc
    return metas


def read_tensor(path: Path, name: str) -> torch.Tensor:
    """One tensor, read with ``preadv`` from the bytes its header entry names (nothing is mapped)."""
    return tensor_region(path, name).read()


def read_tensor_range(path: Path, name: str, dim: int, start: int, stop: int) -> torch.Tensor:
    """Indices ``[start, stop)`` of ``dim`` of one tensor, reading only those bytes."""
    return tensor_range_region(path, name, dim, start, stop).read()


def tensor_range_region(path: Path, name: str, dim: int, start: int, stop: int) -> FileRegion:
    """Where indices ``[start, stop)`` of ``dim`` of one tensor are in a safetensors file."""
    region = tensor_region(path, name)
    if not 0 <= start <= stop <= (region.shape[dim] if dim < len(region.shape) else -1):
        raise CheckpointError(f"{path}: cannot read indices [{start}, {stop}) of dim {dim} of {name} "
                              f"{list(region.shape)}")
    return region.narrow(dim, start, stop - start)


def tensor_region(path: Path, name: str) -> FileRegion:
    """Where one tensor's bytes are in a safetensors file (read from its header, cached)."""
    try:
        stat = path.stat()
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot be read: {exc.strerror or exc}") from exc
    region = data_regions(path, stat.st_size, stat.st_mtime_ns).get(name)
    if region is None:
        raise CheckpointError(f"{path}: cannot read {name}: the file's header has no such tensor")
    return region


@functools.lru_cache(maxsize=64)
def data_regions(path: Path, size: int, mtime_ns: int) -> dict[str, FileRegion]:
    """Where each tensor of a safetensors file is (``size`` and ``mtime_ns`` key the cache), from its
    header: every entry's dtype known, its byte count that of its shape, and its bytes inside the file."""
    check_header(path)
    with open(path, "rb") as handle:
        (length,) = struct.unpack("<Q", handle.read(8))
        doc = parse_json(handle.read(length), path)
    if not isinstance(doc, dict):
        raise CheckpointError(f"{path}: not a readable safetensors file (the header is not an object)")
    regions = {}
    for name, entry in doc.items():
        if name != "__metadata__":
            regions[name] = _entry_region(path, name, entry, 8 + length, size)
    return regions


def _entry_region(path: Path, name: str, entry: object, data_start: int, size: int) -> FileRegion:
    dtype_name = entry.get("dtype") if isinstance(entry, dict) else None
    dtype = SAFETENSORS_DTYPES.get(dtype_name) if isinstance(dtype_name, str) else None
    shape = entry.get("shape") if isinstance(entry, dict) else None
    offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
    if (dtype is None or not isinstance(shape, list) or not isinstance(offsets, list) or len(offsets) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in [*shape, *offsets])):
        raise CheckpointError(f"{path}: {name}'s header entry {quote(entry)} is not a dtype pgconvert converts, "
                              "a shape and two data offsets")
    begin, end = offsets
    if end - begin != sizes.nbytes(tuple(shape), dtype) or data_start + end > size:
        raise CheckpointError(f"{path}: {name}'s data offsets {offsets} do not hold its {dtype} {shape} inside "
                              f"the file's {size} bytes (truncated?)")
    return FileRegion.contiguous(path, data_start + begin, tuple(shape), dtype)
