"""A vision-language model in Megatron checkpoints: its ``args`` and how its rank files name the two parts.

Megatron-Bridge's VL model (``Qwen25VLModel``) holds the language model, a megatron-core GPTModel, under
``language_model.`` and the vision tower with its projector, transformers' module, under its own module
(``visual.``: ``pgconvert.model.vision``); its provider sets megatron-core's ``position_embedding_type='mrope'`` and
``mrope_section``, and keeps HF's ``vision_config`` object. A rank file written by pgconvert records them in
``args`` as megatron-core names them: ``position_embedding_type='mrope'``, ``mrope_section`` (a list), and
``vision_config`` as JSON text of HF's object (an HF config object does not pickle into ``args``), with
``vision_token_ids`` (JSON text: the image and video token ids of config.json, and Gemma 3's
``mm_tokens_per_image``).

Inside pgconvert the language model's tensors keep the GPT names (the text family's rules apply unchanged);
``language_model.`` is added and taken off at the rank file (``wrapped`` / ``unwrapped``).
"""

from __future__ import annotations

import argparse
from collections import OrderedDict
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pgconvert.errors import CheckpointError
from pgconvert.io.limits import quote
from pgconvert.model.config import ModelConfig, parse_json_object
from pgconvert.model.vision import LANGUAGE_MODEL_MODULE, VISION_MODULES, is_vision_tensor

MROPE = "mrope"
VISION_ARGS = ("vision_config", "vision_token_ids")


def vision_from_args(args: argparse.Namespace, path: Path) -> dict[str, Any]:
    """The vision settings and multimodal RoPE sections ``args`` record (None for a text model)."""
    values: dict[str, Any] = {}
    for name in VISION_ARGS:
        value = getattr(args, name, None)
        if value is not None and not isinstance(value, str):
            raise CheckpointError(f"{path}: args.{name}={quote(value)}: expected JSON text of an object")
        values[name] = value
    section = getattr(args, "mrope_section", None)
    if getattr(args, "position_embedding_type", None) == MROPE:
        if not isinstance(section, (list, tuple)) or not section:
            raise CheckpointError(f"{path}: args.position_embedding_type='mrope' with args.mrope_section="
                                  f"{quote(section)}: expected a list of rotary sections")
        values["mrope_section"] = tuple(section)
    return values


def vision_to_args(config: ModelConfig) -> dict[str, Any]:
    """The args of a VL model's vision part and multimodal RoPE; nothing for a text model."""
    values: dict[str, Any] = {}
    if config.positions.mrope_section is not None:  # with position_embedding_type='mrope' (the model args')
        values["mrope_section"] = list(config.positions.mrope_section)
    if config.vision.vision_config is not None:
        values.update(vision_config=config.vision.vision_config, vision_token_ids=config.vision.vision_token_ids)
    return values


def is_vision_language(args: argparse.Namespace) -> bool:
    """Whether ``args`` describe a VL model (its rank files wrap the language model)."""
    return getattr(args, "vision_config", None) is not None


def wrapped(model: Mapping[str, Any]) -> OrderedDict[str, Any]:
    """A VL rank file's model dict from the GPT-named one: the language model's keys under ``language_model.``,
    the vision part's as they are (first, as the provider lists them)."""
    return OrderedDict((key if is_vision_tensor(key) else LANGUAGE_MODEL_MODULE + key, value)
                       for key, value in model.items())


def unwrapped(model: Mapping[str, Any], path: Path) -> dict[str, Any]:
    """A VL rank file's model dict with the GPT names inside pgconvert; a key under neither module is an error."""
    stray = sorted(key for key in model if not key.startswith(LANGUAGE_MODEL_MODULE) and not is_vision_tensor(key))
    if stray:
        raise CheckpointError(f"{path}: args describe a vision-language model, whose keys are under "
                              f"{LANGUAGE_MODEL_MODULE!r} or a vision module {VISION_MODULES}; found {stray[:8]}")
    return {key.removeprefix(LANGUAGE_MODEL_MODULE): value for key, value in model.items()}


def token_ids(config: ModelConfig) -> dict[str, Any]:
    """The image and video token ids a VL config.json holds at its top level."""
    text = config.vision.vision_token_ids
    return {} if text is None else parse_json_object("vision_token_ids", text)
