"""``--text-only``: a vision-language source seen as its language model alone.

``LanguageModelSource`` wraps any format's source of a VL model: its config is the language model's (no vision
part, no multimodal RoPE sections: a text-only input gives the three position ids the same values, which
computes plain RoPE), its tensors are every canonical tensor but the vision part's, an HF origin's config.json
is the text model's as the VL family nests it (``VisionLanguage.text_doc``: written as the text family, Qwen2's
for Qwen2.5-VL), and Megatron args lose the vision settings. What is left out is named in one notice:
the vision tower's and projector's tensors, the processor files, and the optimizer state (which holds the vision
part's parameters too); a carried VL config.json stays, read by an hf target as its text model's.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

import torch

from pgconvert.errors import ValidationError
from pgconvert.formats.hf import HFOrigin
from pgconvert.formats.hf_side import PROCESSOR_FILES, SideFiles
from pgconvert.formats.stream import CanonicalSource, ExtraState, TensorMeta
from pgconvert.formats.vision_args import MROPE, VISION_ARGS
from pgconvert.model.config import ModelConfig
from pgconvert.model.rules import ShardRule
from pgconvert.model.vision import is_vision_tensor, tower_tensors

TEXT_ONLY_REFUSAL = "--text-only: the optimizer state holds the vision part's parameters as well; not carried"


def text_config(config: ModelConfig) -> ModelConfig:
    """The language model of a VL model's config."""
    rotary = "rope" if config.positions.position_embedding_type == MROPE else config.positions.position_embedding_type
    return config.replace(vision_config=None, vision_token_ids=None, mrope_section=None, position_embedding_type=rotary)


class LanguageModelSource(CanonicalSource):
    """A VL source's language model (see the module docstring); reads go to the wrapped source."""

    def __init__(self, inner: CanonicalSource) -> None:
        config = inner.config
        if config.vision.vision_config is None:
            raise ValidationError(f"--text-only: {inner.describe()} is a text model (it has no vision part)")
        super().__init__(text_config(config), inner.vocab_rows, inner.iteration, inner.release)
        self.inner = inner
        self.format_name = inner.format_name
        self.layout = inner.layout
        self.notices = inner.notices
        self.unrepresentable = inner.unrepresentable
        self.megatron_args = _text_args(inner.megatron_args)
        self.hf_origin = _text_origin(inner.hf_origin)
        self.side_files, dropped = _text_side_files(inner.side_files)
        self.notices.append(_left_out(config, dropped))

    def names(self) -> list[str]:
        return [name for name in self.inner.names() if not is_vision_tensor(name)]

    def meta(self, name: str) -> TensorMeta:
        return self.inner.meta(name)

    # The wrapped source's reads as they are: this source's ``load`` / ``load_shard`` add a merged adapter and check
    # the values, once.
    def _load(self, name: str) -> torch.Tensor:
        return self.inner._load(name)

    def _load_shard(self, name: str, rule: ShardRule, size: int, rank: int, rows: int | None) -> torch.Tensor:
        return self.inner._load_shard(name, rule, size, rank, rows)

    def describe(self) -> str:
        return f"{self.inner.describe()} (its language model)"

    def stored_names(self, name: str) -> list[str]:
        return self.inner.stored_names(name)

    def inexact(self, name: str) -> str | None:
        return self.inner.inexact(name)

    def extra_states(self) -> dict[str, ExtraState]:
        return self.inner.extra_states()

    def integrity_problems(self) -> tuple[bool, list[str]]:
        return self.inner.integrity_problems()

    def has_integrity_manifest(self) -> bool:
        return self.inner.has_integrity_manifest()

    def holds_training_state(self) -> bool:
        return self.inner.holds_training_state()

    def holds_optimizer(self) -> bool:
        return self.inner.holds_optimizer()

    def optimizer_refusal(self) -> str | None:
        return TEXT_ONLY_REFUSAL if self.inner.holds_optimizer() else None

    def close(self) -> None:
        self.inner.close()


def _left_out(config: ModelConfig, files: list[str]) -> str:
    """The notice naming what ``--text-only`` leaves out of a VL model."""
    tensors = tower_tensors(config.vision.vision_config, config.hidden_size)
    parts = {part: [tensor.name for tensor in tensors if tensor.part == part] for part in ("tower", "projector")}
    named = {part: f"{len(names)} tensors: {names[0]} … {names[-1]}" if len(names) > 2 else ", ".join(names)
             for part, names in parts.items()}
    section = config.positions.mrope_section
    rope = "" if section is None else \
        f", multimodal RoPE (mrope_section={list(section)}: a text input computes plain RoPE)"
    return (f"--text-only: left out the vision tower ({named['tower']}), the projector ({named['projector']})"
            + rope + (f" and the files {', '.join(files)}" if files else ""))


def _text_args(args: argparse.Namespace | None) -> argparse.Namespace | None:
    """Megatron args without the vision settings and multimodal RoPE."""
    if args is None:
        return None
    values: dict[str, Any] = {key: value for key, value in vars(args).items()
                              if key not in (*VISION_ARGS, "mrope_section")}
    if values.get("position_embedding_type") == MROPE:
        values["position_embedding_type"] = "rope"
    return argparse.Namespace(**values)


def _text_origin(origin: HFOrigin | None) -> HFOrigin | None:
    """An HF origin as its text model: the text family and the text config.json."""
    if origin is None or origin.family.vision_language is None:
        return origin
    nesting = origin.family.vision_language
    return dataclasses.replace(origin, config_json=nesting.text_doc(origin.config_json), family=nesting.text)


def _text_side_files(side_files: SideFiles | None) -> tuple[SideFiles | None, list[str]]:
    """The side files without the processor's; the names left out. A carried VL config.json stays: an hf target
    reads it as its text model's (``hf_side.carried_config``)."""
    if side_files is None:
        return None, []
    return side_files.without(PROCESSOR_FILES), sorted(name for name in side_files.names() if name in PROCESSOR_FILES)
