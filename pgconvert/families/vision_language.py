"""What the vision-language families share: the vision part's rows, its config.json rule and the multimodal
RoPE rule.

A VL family is its language model's family (``derive``d from it, its rows and rules unchanged) plus one
identity row per tensor of the vision part (``visual.<name>``, pgconvert.model.vision), and its config.json
nests the text model's settings in ``text_config`` (``VisionLanguage``). The stored names are the released
checkpoints' (``model.layers.{i}…``, ``model.embed_tokens``, ``model.norm``, ``lm_head``, ``visual.…``), which
transformers 5's ``save_pretrained`` writes too: it renames its in-memory ``model.language_model.*`` and
``model.visual.*`` back to them (its checkpoint conversion mapping) and reads them so.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence

from pgconvert.families.llama import ROPE_RULE
from pgconvert.families.table import ConfigRule, TensorMapping, TensorTable
from pgconvert.io.limits import quote
from pgconvert.model.config import ModelConfig
from pgconvert.model.vision import vision_config_text
from pgconvert.semantics.rope import rope_parameters

MROPE_SECTION = "mrope_section"


def language_model_rows(table: TensorTable, prefix: str = "model.", nested: str = "model.language_model.",
                        ) -> tuple[TensorMapping, ...]:
    """A text family's rows with the HF names under ``prefix`` moved under ``nested`` (transformers' own VL names,
    as Qwen3-VL stores them: ``model.language_model.layers.{i}…``; ``lm_head`` stays)."""
    def moved(pattern: str) -> str:
        return nested + pattern.removeprefix(prefix) if pattern.startswith(prefix) else pattern

    return tuple(dataclasses.replace(row, hf=tuple(map(moved, row.hf))) for row in table.rows)


def vision_rows(module: str, hf_prefix: str, patterns: Sequence[str]) -> tuple[TensorMapping, ...]:
    """One identity row per tensor of the vision part: Megatron-Bridge's ``<module><name>`` is the stored HF tensor
    ``<hf_prefix><name>`` (its ``ReplicatedMapping("visual.**")`` for Qwen2.5-VL: the same names)."""
    return tuple(TensorMapping(module + pattern, (hf_prefix + pattern,)) for pattern in patterns)


def vision_rule(tower: str, token_keys: tuple[str, ...], folded: Mapping[str, object] | None = None) -> ConfigRule:
    """``vision_config`` (required: transformers' default describes a full-size tower), of the family's ``tower``
    (its ``model_type``; absent, transformers' class sets it), and the top-level ``token_keys`` <->
    ``ModelConfig.vision``. ``folded``: top-level settings of the vision part (Mistral 3's projector), with their
    config class's defaults, held inside the vision config, where the tower's shapes are computed from it; written
    back at the top level."""
    folded = dict(folded or {})

    def read(present: Mapping[str, object], model: Mapping[str, object]) -> Mapping[str, object]:
        vision = present.get("vision_config")
        if not isinstance(vision, dict):
            raise ValueError(f"vision_config={quote(vision)}: expected the vision tower's config object")
        vision = {**vision, "model_type": vision.get("model_type", tower)}
        if vision["model_type"] != tower:
            raise ValueError(f"vision_config.model_type={quote(vision['model_type'])}: this architecture's vision "
                             f"tower is {tower!r}")
        vision.update({key: present.get(key, default) for key, default in folded.items()})
        ids = {key: present[key] for key in token_keys if key in present}
        return {"vision_config": vision_config_text(vision), "vision_token_ids": json.dumps(ids, sort_keys=True)}

    def write(config: ModelConfig) -> Mapping[str, object]:
        if config.vision.vision_config is None:
            return {}
        vision = json.loads(config.vision.vision_config)
        top = {key: vision.pop(key, default) for key, default in folded.items()}
        return {"vision_config": vision, **top, **json.loads(config.vision.vision_token_ids or "{}")}

    def refuses(config: ModelConfig) -> str | None:
        if config.vision.vision_config is None:
            return "vision_config=None (needs the vision tower's config: a text model)"
        given = json.loads(config.vision.vision_config).get("model_type")
        return None if given == tower else f"vision_config.model_type={given!r} (needs {tower!r})"

    return ConfigRule(keys=("vision_config", *token_keys, *folded), model_fields=("vision_config", "vision_token_ids"),
                      read=read, write=write, refuses=refuses, required=True)


def _read_mrope(present: Mapping[str, object], model: Mapping[str, object]) -> Mapping[str, object]:
    section = rope_parameters(present).get(MROPE_SECTION)
    if section is not None and (not isinstance(section, list) or not all(
            isinstance(value, int) and not isinstance(value, bool) and value > 0 for value in section)):
        raise ValueError(f"rope_parameters.mrope_section={quote(section)}: expected a list of positive integers")
    return {**ROPE_RULE.read(present, model), MROPE_SECTION: None if section is None else tuple(section),
            "position_embedding_type": "rope" if section is None else "mrope"}


def mrope_rule(written: Mapping[str, object]) -> ConfigRule:
    """RoPE as the text family reads it, and the multimodal sections (``rope_parameters.mrope_section``; transformers
    4.x: ``rope_scaling`` of type "mrope"), with them megatron-core's position_embedding_type 'mrope'; ``written``:
    what the family's config class writes beside the sections (Qwen2.5-VL ``type: mrope``, Qwen3-VL
    ``mrope_interleaved: true``: its rotary always interleaves them)."""

    def write(config: ModelConfig) -> Mapping[str, object]:
        rope = dict(ROPE_RULE.write(config))
        section = config.positions.mrope_section
        if section is not None:
            rope["rope_parameters"] = {**rope["rope_parameters"], **written,  # type: ignore[dict-item]
                                       MROPE_SECTION: list(section)}
        return rope

    return ConfigRule(keys=ROPE_RULE.keys, model_fields=(*ROPE_RULE.model_fields, MROPE_SECTION, "position_embedding_type"),
                      read=_read_mrope, write=write)
