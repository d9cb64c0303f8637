"""Multi-token-prediction (MTP) layers on the HF side: DeepSeek-V3's and GLM-4.5-MoE's.

HF keeps MTP layer ``i`` as decoder layer index ``num_hidden_layers + i``: the usual layer tensors
plus ``enorm``, ``hnorm``, ``eh_proj``, ``shared_head.norm`` and copies of the model's embedding
(``embed_tokens``) and output layer (``shared_head.head``). megatron-core's MTP layer
(``provider.MTP_PREFIX``) has no embedding or output layer of its own, so the copies are checked
against the model's on every read and written back from them (Megatron-Bridge's GLM-4.5 and
DeepSeek-V3 bridges map the same names and leave the copies out).

A family's table spells MTP rows with the HF layer index in the slot: ``table_name`` turns a
canonical ``mtp.layers.{i}.X`` into the name its row matches (``mtp.layers.{N+i}.X``, and
``decoder.layers.{N+i}.rest`` for the transformer layer, which the family's decoder rows map).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pgconvert.model.config import ModelConfig
from pgconvert.errors import CheckpointError, ConfigError
from pgconvert.families.table import Family, TensorMapping, TensorTable
from pgconvert.io.limits import quote
from pgconvert.model.provider import LAYER_PREFIX, MTP_PREFIX, OUTPUT_LAYER, WORD_EMBEDDINGS, mtp_layer

HF_LAYER = "model.layers.{}."
_HF_LAYER_INDEX = re.compile(re.escape(HF_LAYER).replace(r"\{\}", r"(\d+)"))
# The copies a stored MTP layer may hold: (its name relative to the MTP layer, what it copies).
_EMBED_COPY = "embed_tokens.weight"
_HEAD_COPY = "shared_head.head.weight"
MTP_ROWS: tuple[TensorMapping, ...] = (
    TensorMapping(MTP_PREFIX + "{}.enorm.weight", (HF_LAYER + "enorm.weight",)),
    TensorMapping(MTP_PREFIX + "{}.hnorm.weight", (HF_LAYER + "hnorm.weight",)),
    TensorMapping(MTP_PREFIX + "{}.eh_proj.weight", (HF_LAYER + "eh_proj.weight",)),
    TensorMapping(MTP_PREFIX + "{}.final_layernorm.weight", (HF_LAYER + "shared_head.norm.weight",)),
    TensorMapping(MTP_PREFIX + "{}." + _EMBED_COPY, (HF_LAYER + _EMBED_COPY,)),
    TensorMapping(MTP_PREFIX + "{}." + _HEAD_COPY, (HF_LAYER + _HEAD_COPY,)),
)


def table_name(canonical: str, config: ModelConfig) -> str:
    """The name a family's table row matches for ``canonical`` (itself unless an MTP tensor)."""
    if not canonical.startswith(MTP_PREFIX):
        return canonical
    layer = mtp_layer(canonical)
    index, _, rest = canonical[len(MTP_PREFIX):].partition(".")
    hf_index = config.num_layers + int(index)
    if layer is not None:
        return f"{LAYER_PREFIX}{hf_index}.{layer[1]}"
    return f"{MTP_PREFIX}{hf_index}.{rest}"


def copied_tensor(config: ModelConfig, copy: str) -> str:
    """The canonical tensor an MTP layer's HF copy holds (the output layer is the embedding when tied)."""
    if copy == _EMBED_COPY or config.tie_embeddings:
        return WORD_EMBEDDINGS
    return OUTPUT_LAYER


def copies(table: TensorTable, config: ModelConfig) -> list[tuple[str, str, TensorMapping]]:
    """(HF name, canonical tensor it copies, table row) of every MTP layer's embedding and head copy."""
    found = []
    for index in range(config.mtp_num_layers):
        for copy in (_EMBED_COPY, _HEAD_COPY):
            row = table.to_hf(f"{MTP_PREFIX}{config.num_layers + index}.{copy}")
            if row is not None:
                found.append((row[1][0], copied_tensor(config, copy), row[0]))
    return found


def copy_reason(hf_name: str, canonical: str) -> str:
    what = "embedding" if canonical == WORD_EMBEDDINGS else "output layer"
    return (f"multi-token prediction computes with the model's own {what} (megatron-core's MTP layer has none "
            f"of its own), so a copy that differs would be lost; {hf_name} cannot be converted")


# DeepseekV3Config's and Glm4MoeConfig's num_mtp_layers (their attribute_map's name for
# num_nextn_predict_layers, which config.json may also use) where config.json gives neither.
HF_MTP_LAYERS_DEFAULT = 1
HF_MTP_LAYERS_ALIAS = "num_mtp_layers"


def _declaration(key: str, doc: Mapping[str, Any]) -> tuple[str, object]:
    """How config.json declares the MTP layers (``key=value``, or the key absent) and the count (the
    default where absent)."""
    if key not in doc and HF_MTP_LAYERS_ALIAS in doc:
        key = HF_MTP_LAYERS_ALIAS
    if key not in doc:
        return f"{key} absent (transformers' default {HF_MTP_LAYERS_DEFAULT})", HF_MTP_LAYERS_DEFAULT
    return f"{key}={quote(doc[key])}", doc[key]


def _declared(family: Family, doc: Mapping[str, Any], path: Path) -> int | None:
    assert family.hf_mtp_layers_key is not None
    declared, value = _declaration(family.hf_mtp_layers_key, doc)
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
        raise CheckpointError(f"{path}: {declared}: expected an integer >= 0")
    return value


def resolve_hf_count(family: Family, doc: Mapping[str, Any], config: ModelConfig, stored: Mapping[str, object],
                     path: Path) -> tuple[ModelConfig, str | None]:
    """The model with the MTP layers the checkpoint stores, and a notice where config.json declares
    MTP layers of which no tensor is stored (transformers' configs declare one by default and its
    models build none): those are converted as none, and an hf target's config.json says so.

    The declared count must be the stored layers', compared without looping over it."""
    if family.hf_mtp_layers_key is None:
        return config, None
    key = family.hf_mtp_layers_key
    declared = _declared(family, doc, path)
    said = _declaration(key, doc)[0]
    layers = config.num_layers
    extra: dict[int, list[str]] = {}
    for name in stored:
        match = _HF_LAYER_INDEX.match(name)
        if match and int(match.group(1)) >= layers:
            extra.setdefault(int(match.group(1)), []).append(name)
    if not extra:
        if not declared:
            return config, None
        return config, (f"{path}: {said}, but no tensor of a multi-token prediction layer (layer "
                        f"num_hidden_layers + i = {layers}, …) is stored: converted without them, and an hf "
                        f"target's config.json declares {key}=0")
    count = declared or 0
    if count != len(extra) or any(not layers <= index < layers + count for index in extra):
        first = sorted(extra)[-1]
        shown = sorted(extra[first])[:3]
        raise CheckpointError(
            f"{path}: {said}, but the checkpoint stores multi-token prediction "
            f"layer tensors of layers {sorted(extra)} (num_hidden_layers={layers}; MTP layer i is layer "
            f"num_hidden_layers + i), e.g. {shown}")
    return config.replace(mtp_num_layers=declared), None


def declared_as_converted(family: Family, doc: dict[str, Any], config: ModelConfig) -> tuple[dict[str, Any], str | None]:
    """``doc`` (an hf target's config.json) declaring no more MTP layers than the model converted
    has, and a notice where it declared more."""
    key = family.hf_mtp_layers_key
    said, declared = _declaration(key, doc) if key is not None else ("", None)
    if key is None or not isinstance(declared, int) or declared <= config.mtp_num_layers:
        return doc, None
    written = {name: value for name, value in doc.items() if name != HF_MTP_LAYERS_ALIAS}
    return {**written, key: config.mtp_num_layers}, (
        f"config.json: {said} written as {config.mtp_num_layers}: the model converted has "
        f"{config.mtp_num_layers} multi-token prediction layers")


def check_hf_target(family: Family, doc: Mapping[str, Any] | None, config: ModelConfig, where: str) -> None:
    """An hf target's config.json must declare the MTP layers it is written with."""
    if not config.mtp_num_layers or doc is None:
        return
    key = family.hf_mtp_layers_key
    said, declared = _declaration(key, doc) if key is not None else ("num_nextn_predict_layers=None", None)
    if declared != config.mtp_num_layers:
        raise ConfigError(f"{where}: {said}, but the model has mtp_num_layers={config.mtp_num_layers} "
                          "multi-token prediction layers")

