"""Model families as data: Hugging Face tensor names and config.json keys <-> canonical ones.

A family is one ``Family`` value: a ``TensorTable`` (HF name patterns <-> canonical name patterns,
each with the pure transform that relates them) and the config.json fields it maps onto
``ModelConfig``. Both directions are derived from the same rows: the saver reads a row
canonical -> HF, the loader inverts the rows it expects for a config. Adding a family is a new
``Family`` value (plus a fixture and a test), never a branch in a loader or saver.

``{}`` in a pattern is a slot (a layer or expert index); a row's patterns are checked when the
table is built to have the same number of slots on both sides. A row with ``canonical=None``
names an HF tensor that is dropped on purpose (rotary ``inv_freq`` buffers).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

import torch

from pgconvert.config import ModelConfig

SLOT = "{}"


class Transform:
    """How ``parts`` HF tensors become one canonical tensor (``fuse``) and back (``split``)."""

    name: str = "?"
    parts: int = 1

    def fuse(self, parts: Sequence[torch.Tensor], config: ModelConfig) -> torch.Tensor:
        raise NotImplementedError

    def split(self, full: torch.Tensor, config: ModelConfig) -> list[torch.Tensor]:
        raise NotImplementedError

    def part_shapes(self, shape: tuple[int, ...], config: ModelConfig) -> list[tuple[int, ...]]:
        """Shapes of the HF tensors of a canonical tensor of ``shape``."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<transform {self.name}>"


class Identity(Transform):
    """One HF tensor is the canonical tensor."""

    name = "identity"
    parts = 1

    def fuse(self, parts: Sequence[torch.Tensor], config: ModelConfig) -> torch.Tensor:
        return parts[0]

    def split(self, full: torch.Tensor, config: ModelConfig) -> list[torch.Tensor]:
        return [full]

    def part_shapes(self, shape: tuple[int, ...], config: ModelConfig) -> list[tuple[int, ...]]:
        return [shape]


class Dropped(Transform):
    """An HF tensor that has no canonical counterpart on purpose (a recomputed buffer)."""

    name = "dropped"
    parts = 1


class FuseQKVByGroup(Transform):
    """``q_proj``, ``k_proj``, ``v_proj`` (weight or bias) <-> megatron-core's ``linear_qkv``.

    megatron-core orders the fused rows by query group, so that a column-parallel split falls on
    group boundaries::

        q_proj  [q0 q1 | q2 q3]      linear_qkv  [q0 q1 k0 v0 | q2 q3 k1 v1]
        k_proj  [k0    | k1   ]  ->               group 0       group 1
        v_proj  [v0    | v1   ]

    (each entry is one head of ``kv_channels`` rows; here 4 query heads in 2 groups).
    """

    name = "fuse-qkv-by-group"
    parts = 3

    @staticmethod
    def _dims(config: ModelConfig) -> tuple[int, int, int]:
        groups = config.query_groups
        return groups, config.num_attention_heads // groups * config.head_dim, config.head_dim

    def fuse(self, parts: Sequence[torch.Tensor], config: ModelConfig) -> torch.Tensor:
        query, key, value = parts
        groups, q_rows, kv_rows = self._dims(config)
        rest = tuple(query.shape[1:])
        fused = torch.cat([
            query.reshape(groups, q_rows, *rest),
            key.reshape(groups, kv_rows, *rest),
            value.reshape(groups, kv_rows, *rest),
        ], dim=1)
        return fused.reshape(groups * (q_rows + 2 * kv_rows), *rest)

    def split(self, full: torch.Tensor, config: ModelConfig) -> list[torch.Tensor]:
        groups, q_rows, kv_rows = self._dims(config)
        rest = tuple(full.shape[1:])
        by_group = full.reshape(groups, q_rows + 2 * kv_rows, *rest)
        query = by_group.narrow(1, 0, q_rows)
        key = by_group.narrow(1, q_rows, kv_rows)
        value = by_group.narrow(1, q_rows + kv_rows, kv_rows)
        return [
            query.reshape(groups * q_rows, *rest),
            key.reshape(groups * kv_rows, *rest),
            value.reshape(groups * kv_rows, *rest),
        ]

    def part_shapes(self, shape: tuple[int, ...], config: ModelConfig) -> list[tuple[int, ...]]:
        groups, q_rows, kv_rows = self._dims(config)
        rest = tuple(shape[1:])
        return [(groups * q_rows, *rest), (groups * kv_rows, *rest), (groups * kv_rows, *rest)]


class FuseGateUp(Transform):
    """``gate_proj``, ``up_proj`` <-> the gated ``linear_fc1`` = ``[gate; up]`` (gate first)."""

    name = "fuse-gate-up"
    parts = 2

    def fuse(self, parts: Sequence[torch.Tensor], config: ModelConfig) -> torch.Tensor:
        return torch.cat(list(parts), dim=0)

    def split(self, full: torch.Tensor, config: ModelConfig) -> list[torch.Tensor]:
        gate, up = full.chunk(2, dim=0)
        return [gate, up]

    def part_shapes(self, shape: tuple[int, ...], config: ModelConfig) -> list[tuple[int, ...]]:
        return [(shape[0] // 2, *shape[1:])] * 2


IDENTITY = Identity()
DROPPED = Dropped()
QKV = FuseQKVByGroup()
GATE_UP = FuseGateUp()


def _slot_pattern(pattern: str) -> re.Pattern[str]:
    return re.compile(re.escape(pattern).replace(re.escape(SLOT), r"(\d+)"))


def _fill(pattern: str, slots: Sequence[str]) -> str:
    pieces = pattern.split(SLOT)
    return "".join(piece + slot for piece, slot in zip(pieces, [*slots, ""], strict=True))


@dataclass(frozen=True)
class TensorMapping:
    """One row: a canonical name pattern (``None``: dropped on purpose), its HF name patterns, how."""

    canonical: str | None
    hf: tuple[str, ...]
    transform: Transform = IDENTITY

    def __post_init__(self) -> None:
        if len(self.hf) != self.transform.parts:
            raise ValueError(
                f"mapping {self.canonical!r}: transform {self.transform.name} takes "
                f"{self.transform.parts} HF tensors, {len(self.hf)} given ({list(self.hf)})"
            )
        if (self.canonical is None) != (self.transform is DROPPED):
            raise ValueError(f"mapping {self.hf}: canonical=None and the dropped transform go together")
        slots = {pattern.count(SLOT) for pattern in self.hf}
        if self.canonical is not None:
            slots.add(self.canonical.count(SLOT))
        if len(slots) != 1:
            raise ValueError(
                f"mapping {self.canonical!r} <-> {list(self.hf)}: the patterns have different "
                f"numbers of {SLOT} slots"
            )


@dataclass(frozen=True)
class TensorTable:
    """The rows of one family; patterns on either side must be unique."""

    rows: tuple[TensorMapping, ...]
    _canonical: tuple[tuple[re.Pattern[str], TensorMapping], ...] = field(init=False, repr=False)
    _dropped: tuple[re.Pattern[str], ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        canonical = [row.canonical for row in self.rows if row.canonical is not None]
        hf = [pattern for row in self.rows for pattern in row.hf]
        for side, patterns in (("canonical", canonical), ("hf", hf)):
            repeated = sorted({p for p in patterns if patterns.count(p) > 1})
            if repeated:
                raise ValueError(f"tensor table: {side} patterns appear more than once: {repeated}")
        object.__setattr__(self, "_canonical", tuple(
            (_slot_pattern(row.canonical), row) for row in self.rows if row.canonical is not None
        ))
        object.__setattr__(self, "_dropped", tuple(
            _slot_pattern(row.hf[0]) for row in self.rows if row.canonical is None
        ))

    def to_hf(self, canonical: str) -> tuple[TensorMapping, tuple[str, ...]] | None:
        """The row filling ``canonical`` and its HF names; None when no row does."""
        for pattern, row in self._canonical:
            match = pattern.fullmatch(canonical)
            if match:
                slots = match.groups()
                return row, tuple(_fill(hf, slots) for hf in row.hf)
        return None

    def is_dropped(self, hf_name: str) -> bool:
        return any(pattern.fullmatch(hf_name) for pattern in self._dropped)


REQUIRED = object()


@dataclass(frozen=True)
class ConfigField:
    """One config.json value <-> one ``ModelConfig`` field.

    ``path`` is where transformers writes it today; ``legacy`` paths are older spellings that are
    read when ``path`` is absent and written too, so older transformers read the same value.
    """

    path: tuple[str, ...]
    model_field: str
    kind: type
    default: object = REQUIRED
    legacy: tuple[tuple[str, ...], ...] = ()

    @property
    def key(self) -> str:
        return ".".join(self.path)


_MODEL_FIELDS = frozenset(f.name for f in dataclasses.fields(ModelConfig))


@dataclass(frozen=True)
class Family:
    """One HF architecture.

    ``fixed`` are the ``ModelConfig`` values every model of the family has (a config that differs
    cannot be written as this family); ``hf_fixed`` are the config.json values the table assumes
    (a source that differs is refused, a target gets them written); ``hf_scratch`` are extra keys
    written when config.json is built from a ``ModelConfig`` alone.
    """

    architecture: str
    model_type: str
    tensors: TensorTable
    fields: tuple[ConfigField, ...]
    fixed: Mapping[str, object]
    hf_fixed: Mapping[str, object] = field(default_factory=dict)
    hf_scratch: Mapping[str, object] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "fixed", MappingProxyType(dict(self.fixed)))
        object.__setattr__(self, "hf_fixed", MappingProxyType(dict(self.hf_fixed)))
        object.__setattr__(self, "hf_scratch", MappingProxyType(dict(self.hf_scratch)))
        mapped = {f.model_field for f in self.fields}
        unknown = sorted((mapped | set(self.fixed)) - _MODEL_FIELDS)
        if unknown:
            raise ValueError(f"family {self.architecture}: not ModelConfig fields: {unknown}")
        both = sorted(mapped & set(self.fixed))
        if both:
            raise ValueError(f"family {self.architecture}: fields both fixed and read from config.json: {both}")
        keys = [f.key for f in self.fields]
        repeated = sorted({k for k in keys if keys.count(k) > 1} | (set(keys) & set(self.hf_fixed)))
        if repeated:
            raise ValueError(f"family {self.architecture}: config.json keys mapped twice: {repeated}")


# Every family here names its tensors the way transformers' LlamaForCausalLM does; which rows a
# model uses follows from its ModelConfig (biases, qk-norm, tied output) through canonical_names.
DECODER_TENSORS = TensorTable((
    TensorMapping("embedding.word_embeddings.weight", ("model.embed_tokens.weight",)),
    TensorMapping("decoder.layers.{}.input_layernorm.weight", ("model.layers.{}.input_layernorm.weight",)),
    TensorMapping("decoder.layers.{}.self_attention.linear_qkv.weight", (
        "model.layers.{}.self_attn.q_proj.weight",
        "model.layers.{}.self_attn.k_proj.weight",
        "model.layers.{}.self_attn.v_proj.weight",
    ), QKV),
    TensorMapping("decoder.layers.{}.self_attention.linear_qkv.bias", (
        "model.layers.{}.self_attn.q_proj.bias",
        "model.layers.{}.self_attn.k_proj.bias",
        "model.layers.{}.self_attn.v_proj.bias",
    ), QKV),
    TensorMapping("decoder.layers.{}.self_attention.q_layernorm.weight", ("model.layers.{}.self_attn.q_norm.weight",)),
    TensorMapping("decoder.layers.{}.self_attention.k_layernorm.weight", ("model.layers.{}.self_attn.k_norm.weight",)),
    TensorMapping("decoder.layers.{}.self_attention.linear_proj.weight", ("model.layers.{}.self_attn.o_proj.weight",)),
    TensorMapping("decoder.layers.{}.self_attention.linear_proj.bias", ("model.layers.{}.self_attn.o_proj.bias",)),
    TensorMapping("decoder.layers.{}.pre_mlp_layernorm.weight",
                  ("model.layers.{}.post_attention_layernorm.weight",)),
    TensorMapping("decoder.layers.{}.mlp.linear_fc1.weight", (
        "model.layers.{}.mlp.gate_proj.weight",
        "model.layers.{}.mlp.up_proj.weight",
    ), GATE_UP),
    TensorMapping("decoder.layers.{}.mlp.linear_fc1.bias", (
        "model.layers.{}.mlp.gate_proj.bias",
        "model.layers.{}.mlp.up_proj.bias",
    ), GATE_UP),
    TensorMapping("decoder.layers.{}.mlp.linear_fc2.weight", ("model.layers.{}.mlp.down_proj.weight",)),
    TensorMapping("decoder.layers.{}.mlp.linear_fc2.bias", ("model.layers.{}.mlp.down_proj.bias",)),
    TensorMapping("decoder.final_layernorm.weight", ("model.norm.weight",)),
    TensorMapping("output_layer.weight", ("lm_head.weight",)),
    # Rotary frequencies are recomputed from the config; old transformers versions saved them.
    TensorMapping(None, ("model.layers.{}.self_attn.rotary_emb.inv_freq",), DROPPED),
    TensorMapping(None, ("model.rotary_emb.inv_freq",), DROPPED),
))


def _decoder_fields(max_position_embeddings: int) -> tuple[ConfigField, ...]:
    """The config.json fields of a Llama-style decoder; defaults are transformers' class defaults."""
    return (
        ConfigField(("hidden_size",), "hidden_size", int),
        ConfigField(("intermediate_size",), "ffn_hidden_size", int),
        ConfigField(("num_hidden_layers",), "num_layers", int),
        ConfigField(("num_attention_heads",), "num_attention_heads", int),
        ConfigField(("num_key_value_heads",), "num_query_groups", int, default=None),
        ConfigField(("head_dim",), "kv_channels", int, default=None),
        ConfigField(("rms_norm_eps",), "norm_epsilon", float, default=1e-6),
        # transformers 5 keeps the base under rope_parameters; 4.x had a top-level rope_theta.
        ConfigField(("rope_parameters", "rope_theta"), "rotary_base", float, default=10000.0,
                    legacy=(("rope_theta",),)),
        ConfigField(("max_position_embeddings",), "max_position_embeddings", int,
                    default=max_position_embeddings),
        ConfigField(("vocab_size",), "vocab_size", int),
        ConfigField(("tie_word_embeddings",), "tie_embeddings", bool, default=False),
    )


# What every family below is, in Megatron terms: dense (no experts), SwiGLU MLP, RMSNorm, RoPE.
_SWIGLU_RMS_ROPE: dict[str, object] = {
    "num_experts": None,
    "gated_linear_unit": True,
    "activation": "silu",
    "normalization": "RMSNorm",
    "position_embedding_type": "rope",
}
_HF_SILU: dict[str, object] = {"hidden_act": "silu"}
_ROPE_DEFAULT: dict[str, object] = {"rope_parameters": {"rope_type": "default"}}

LLAMA = Family(
    architecture="LlamaForCausalLM",
    model_type="llama",
    tensors=DECODER_TENSORS,
    fields=(
        *_decoder_fields(max_position_embeddings=2048),
        # Llama's attention_bias covers q, k, v and o; mlp_bias covers gate, up and down. Megatron
        # has one switch for all linears, so a model is representable only when the two agree.
        ConfigField(("attention_bias",), "add_bias_linear", bool, default=False),
        ConfigField(("mlp_bias",), "add_bias_linear", bool, default=False),
    ),
    fixed={**_SWIGLU_RMS_ROPE, "qk_layernorm": False, "add_qkv_bias": False},
    hf_fixed=_HF_SILU,
    hf_scratch=_ROPE_DEFAULT,
)

MISTRAL = Family(
    architecture="MistralForCausalLM",
    model_type="mistral",
    tensors=DECODER_TENSORS,
    fields=_decoder_fields(max_position_embeddings=131072),
    fixed={**_SWIGLU_RMS_ROPE, "qk_layernorm": False, "add_qkv_bias": False, "add_bias_linear": False},
    hf_fixed=_HF_SILU,
    hf_scratch=_ROPE_DEFAULT,
)

QWEN2 = Family(
    architecture="Qwen2ForCausalLM",
    model_type="qwen2",
    tensors=DECODER_TENSORS,
    fields=_decoder_fields(max_position_embeddings=32768),
    # Qwen2 always has q/k/v biases and nothing else.
    fixed={**_SWIGLU_RMS_ROPE, "qk_layernorm": False, "add_qkv_bias": True, "add_bias_linear": False},
    hf_fixed=_HF_SILU,
    hf_scratch={**_ROPE_DEFAULT, "use_sliding_window": False},
)

QWEN3 = Family(
    architecture="Qwen3ForCausalLM",
    model_type="qwen3",
    tensors=DECODER_TENSORS,
    fields=_decoder_fields(max_position_embeddings=32768),
    fixed={**_SWIGLU_RMS_ROPE, "qk_layernorm": True, "add_qkv_bias": False, "add_bias_linear": False},
    # attention_bias=True would bias q, k, v and o but not the MLP: no Megatron equivalent.
    hf_fixed={**_HF_SILU, "attention_bias": False},
    hf_scratch={**_ROPE_DEFAULT, "use_sliding_window": False},
)

# Mixture-of-experts families (Mixtral, Qwen3-MoE) go here as further Family values: expert rows
# use two slots, e.g. "decoder.layers.{}.mlp.experts.local_experts.{}.linear_fc2.weight".
FAMILIES: dict[str, Family] = {family.architecture: family for family in (LLAMA, MISTRAL, QWEN2, QWEN3)}

# The family written for a source that carries no HF architecture (a Megatron checkpoint): the
# first whose fixed values the model has. Mistral is Llama's tensors and config with a sliding
# window that a Megatron model does not describe, so it is never guessed.
INFERENCE_ORDER: tuple[str, ...] = ("Qwen3ForCausalLM", "Qwen2ForCausalLM", "LlamaForCausalLM")


def supported_architectures() -> list[str]:
    return sorted(FAMILIES)
