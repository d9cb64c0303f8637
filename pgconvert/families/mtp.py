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

Qwen3-Next's and Qwen3.5's checkpoints store the MTP module apart (``Family.hf_mtp_block``): ``mtp.fc``
(``eh_proj``, input ``[embedding; hidden]`` as megatron-core's), ``mtp.pre_fc_norm_embedding`` (``enorm``),
``mtp.pre_fc_norm_hidden`` (``hnorm``), ``mtp.norm`` (``final_layernorm``) and the layer ``mtp.layers.0.*``
(Megatron-Bridge's qwen3_next bridge maps the same); ``to_hf`` gives the stored names, and their count key
(``mtp_num_hidden_layers``) is absent where there is none.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pgconvert.model.config import ModelConfig
from pgconvert.errors import CheckpointError, ConfigError
from pgconvert.families.table import Family, MTPBlock, TensorMapping, TensorTable
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


def to_hf(family: Family, canonical: str, config: ModelConfig) -> tuple[TensorMapping, tuple[str, ...]] | None:
    """The table row of ``canonical`` and the HF names it is stored under."""
    found = family.tensors.to_hf(table_name(canonical, config))
    block = family.hf_mtp_block
    if found is None or block is None or not canonical.startswith(MTP_PREFIX):
        return found
    row, names = found
    index = int(canonical[len(MTP_PREFIX):].partition(".")[0])
    return row, tuple(_block_name(block, name, config.num_layers + index, index) for name in names)


def _block_name(block: MTPBlock, name: str, hf_index: int, index: int) -> str:
    prefix = HF_LAYER.format(hf_index)
    assert name.startswith(prefix), (name, prefix)
    rest = name[len(prefix):]
    return block.own.get(rest, f"{block.layers}{index}.{rest}")


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


def _declaration(family: Family, doc: Mapping[str, Any]) -> tuple[str, object]:
    """How config.json declares the MTP layers (``key=value``, or the key absent) and the count (the family's
    config class's default where absent: ``Family.hf_mtp_layers_absent``)."""
    key = family.hf_mtp_layers_key
    assert key is not None
    alias = family.hf_mtp_layers_alias
    if key not in doc and alias is not None and alias in doc:
        key = alias
    if key not in doc:
        absent = family.hf_mtp_layers_absent
        return (f"{key} absent (transformers' default {absent})" if absent else f"{key} absent"), absent
    return f"{key}={quote(doc[key])}", doc[key]


def _declared(family: Family, doc: Mapping[str, Any], path: Path) -> int | None:
    declared, value = _declaration(family, doc)
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
        raise CheckpointError(f"{path}: {declared}: expected an integer >= 0")
    block = family.hf_mtp_block
    if block is not None and block.own_embedding_key is not None and doc.get(block.own_embedding_key):
        raise CheckpointError(
            f"{path}: {block.own_embedding_key}={quote(doc[block.own_embedding_key])}: an embedding of the MTP "
            "module's own, which megatron-core's MTP layer (it embeds with the model's) has no tensor for")
    if block is not None and value is not None and value > 1:
        raise CheckpointError(
            f"{path}: {declared}: {family.architecture}'s MTP module shares one fc and its norms among its layers "
            "(one layer per prediction step), which megatron-core's MTP layers (each with its own eh_proj and norms) "
            "do not; only one is converted")
    return value


def _stored_layers(family: Family, stored: Mapping[str, object], layers: int) -> dict[int, list[str]]:
    """The stored tensors of each MTP layer, by the index the checkpoint numbers it with (a decoder layer index
    ``num_hidden_layers + i``, or ``i`` in a separate MTP module)."""
    found: dict[int, list[str]] = {}
    block = family.hf_mtp_block
    for name in stored:
        if block is not None:
            match = re.match(re.escape(block.layers) + r"(\d+)\.", name)
            if match or name in block.own.values():
                found.setdefault(int(match.group(1)) if match else 0, []).append(name)
            continue
        match = _HF_LAYER_INDEX.match(name)
        if match and int(match.group(1)) >= layers:
            found.setdefault(int(match.group(1)), []).append(name)
    return found


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
    said = _declaration(family, doc)[0]
    layers = config.num_layers
    extra = _stored_layers(family, stored, layers)
    first, where = ((0, f"MTP layer i is {family.hf_mtp_block.layers}i") if family.hf_mtp_block is not None
                    else (layers, f"num_hidden_layers={layers}; MTP layer i is layer num_hidden_layers + i"))
    if not extra:
        if not declared:
            return config, None
        return config, (f"{path}: {said}, but no tensor of a multi-token prediction layer ({where}) is stored: "
                        f"converted without them, and an hf target's config.json declares {key}=0")
    count = declared or 0
    if count != len(extra) or any(not first <= index < first + count for index in extra):
        last = sorted(extra)[-1]
        shown = sorted(extra[last])[:3]
        raise CheckpointError(
            f"{path}: {said}, but the checkpoint stores multi-token prediction "
            f"layer tensors of layers {sorted(extra)} ({where}), e.g. {shown}")
    return config.replace(mtp_num_layers=declared), None


def declared_as_converted(family: Family, doc: dict[str, Any], config: ModelConfig) -> tuple[dict[str, Any], str | None]:
    """``doc`` (an hf target's config.json) declaring no more MTP layers than the model converted
    has, and a notice where it declared more."""
    key = family.hf_mtp_layers_key
    said, declared = _declaration(family, doc) if key is not None else ("", None)
    if key is None or not isinstance(declared, int) or declared <= config.mtp_num_layers:
        return doc, None
    written = {name: value for name, value in doc.items() if name != family.hf_mtp_layers_alias}
    return {**written, key: config.mtp_num_layers}, (
        f"config.json: {said} written as {config.mtp_num_layers}: the model converted has "
        f"{config.mtp_num_layers} multi-token prediction layers")


def written_declaration(family: Family, config: ModelConfig) -> dict[str, object]:
    """The config.json keys that declare ``config``'s MTP layers for ``family`` (built from the model alone): the
    count (only where there is one if its absence means none) and a separate MTP module's embedding switch."""
    key, block = family.hf_mtp_layers_key, family.hf_mtp_block
    if key is None or (not family.hf_mtp_layers_absent and not config.mtp_num_layers):
        return {}
    if block is None or block.own_embedding_key is None:
        return {key: config.mtp_num_layers}
    return {key: config.mtp_num_layers, block.own_embedding_key: False}


def check_hf_target(family: Family, doc: Mapping[str, Any] | None, config: ModelConfig, where: str) -> None:
    """An hf target's config.json must declare the MTP layers it is written with."""
    if not config.mtp_num_layers or doc is None:
        return
    key = family.hf_mtp_layers_key
    said, declared = _declaration(family, doc) if key is not None else ("num_nextn_predict_layers=None", None)
    if declared != config.mtp_num_layers:
        raise ConfigError(f"{where}: {said}, but the model has mtp_num_layers={config.mtp_num_layers} "
                          "multi-token prediction layers")

