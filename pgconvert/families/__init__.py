"""Model families as data: Hugging Face tensor names and config.json keys <-> canonical ones.

A family is one ``Family`` value: a ``TensorTable`` (HF name patterns <-> canonical name patterns,
each with the pure transform that relates them), the config.json fields it maps onto
``ModelConfig`` and, where a setting is not one key for one field (Qwen-MoE's sparse step and
dense-layer list against megatron-core's ``moe_layer_freq``), a ``ConfigRule`` of pure functions.
Both directions are derived from the same rows: the saver reads a row canonical -> HF, the loader
inverts the rows it expects for a config. Adding a family is a new ``Family`` value (plus a fixture
and a test), never a branch in a loader or saver.

``{}`` in a pattern is a slot (a layer index, then a global expert index); a row's patterns are
checked when the table is built to have the same number of slots on both sides. A row with
``canonical=None`` names an HF tensor that is dropped on purpose (rotary ``inv_freq`` buffers).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

import torch

from pgconvert.semantics import yarn
from pgconvert.model.config import POSTNORM_OFF, ModelConfig
from pgconvert.io.limits import quote
from pgconvert.model.rules import Window
from pgconvert.semantics import MEGATRON_LLAMA3, rope_parameters, rope_type_of

SLOT = "{}"
# Rows ``[start, stop)`` along a dim of one HF part of a canonical tensor: (part index, dim, start, stop).
PartReader = Callable[[int, int, int, int], torch.Tensor]


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

    # Whether the canonical tensor is nothing (its HF tensor is dropped on purpose).
    drops: bool = False

    def reads_window(self, window: Window, shape: tuple[int, ...], config: ModelConfig) -> bool:
        """Whether ``read_window`` can read ``window`` of the canonical tensor from ranges of the HF
        parts; otherwise a reader fuses the whole tensor and cuts it."""
        return False

    def read_window(self, window: Window, shape: tuple[int, ...], config: ModelConfig,
                    read_part: PartReader) -> torch.Tensor:
        """``window`` of the canonical tensor of ``shape``, read as ranges of its HF parts."""
        raise NotImplementedError(f"{self.name} cannot read a window of its parts")

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

    def reads_window(self, window: Window, shape: tuple[int, ...], config: ModelConfig) -> bool:
        return True

    def read_window(self, window: Window, shape: tuple[int, ...], config: ModelConfig,
                    read_part: PartReader) -> torch.Tensor:
        return read_part(0, window.dim, window.start, window.start + window.length)


class Dropped(Transform):
    """An HF tensor that has no canonical counterpart on purpose (a recomputed buffer)."""

    name = "dropped"
    parts = 1
    drops = True


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

    def reads_window(self, window: Window, shape: tuple[int, ...], config: ModelConfig) -> bool:
        """Rows on query-group boundaries: the q, k and v rows of those groups."""
        _, q_rows, kv_rows = self._dims(config)
        group_rows = q_rows + 2 * kv_rows
        return window.dim == 0 and window.start % group_rows == 0 and window.length % group_rows == 0

    def read_window(self, window: Window, shape: tuple[int, ...], config: ModelConfig,
                    read_part: PartReader) -> torch.Tensor:
        groups_total, q_rows, kv_rows = self._dims(config)
        group_rows = q_rows + 2 * kv_rows
        first, groups = window.start // group_rows, window.length // group_rows
        parts = [read_part(index, 0, first * step, (first + groups) * step)
                 for index, step in enumerate((q_rows, kv_rows, kv_rows))]
        heads_per_group = config.num_attention_heads // groups_total
        return self.fuse(parts, config.replace(num_query_groups=groups, num_attention_heads=groups * heads_per_group))


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

    def reads_window(self, window: Window, shape: tuple[int, ...], config: ModelConfig) -> bool:
        return True

    def read_window(self, window: Window, shape: tuple[int, ...], config: ModelConfig,
                    read_part: PartReader) -> torch.Tensor:
        """Rows of ``[gate; up]`` from the parts they fall in; columns from both parts."""
        if window.dim != 0:
            return torch.cat([read_part(index, window.dim, window.start, window.start + window.length)
                              for index in range(self.parts)], dim=0)
        part_rows = shape[0] // self.parts
        pieces = []
        for index in range(self.parts):
            lo = max(window.start, index * part_rows)
            hi = min(window.start + window.length, (index + 1) * part_rows)
            if lo < hi:
                pieces.append(read_part(index, 0, lo - index * part_rows, hi - index * part_rows))
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=0)


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
    # f17c: the HF tensors hold every routed expert of a layer stacked on dim 0 (GPT-OSS's
    # ``mlp.experts.gate_up_proj`` [E, ...]); the canonical pattern's last slot, the expert, indexes it.
    stacked: bool = False

    def __post_init__(self) -> None:
        if len(self.hf) != self.transform.parts:
            raise ValueError(
                f"mapping {self.canonical!r}: transform {self.transform.name} takes "
                f"{self.transform.parts} HF tensors, {len(self.hf)} given ({list(self.hf)})"
            )
        if (self.canonical is None) != self.transform.drops:
            raise ValueError(f"mapping {self.hf}: canonical=None and the dropped transform go together")
        slots = {pattern.count(SLOT) + int(self.stacked) for pattern in self.hf}
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
                return row, tuple(_fill(hf, slots[:hf.count(SLOT)]) for hf in row.hf)
        return None

    def stack_index(self, canonical: str) -> int | None:
        """f17c: for a canonical tensor of a stacked row, its index on the HF tensors' dim 0; else None."""
        for pattern, row in self._canonical:
            match = pattern.fullmatch(canonical)
            if match:
                return int(match.groups()[-1]) if row.stacked else None
        return None

    def is_dropped(self, hf_name: str) -> bool:
        return any(pattern.fullmatch(hf_name) for pattern in self._dropped)


REQUIRED = object()


@dataclass(frozen=True)
class ConfigField:
    """One config.json value <-> one ``ModelConfig`` field.

    ``path`` is where transformers writes it today; ``legacy`` paths are older spellings that are
    read when ``path`` is absent and written too, so older transformers read the same value.
    ``written`` gives the value to write where the field may be unset and mean another field's
    value (megatron-core's ``moe_ffn_hidden_size`` defaults to ``ffn_hidden_size``); by default the
    field itself.
    """

    path: tuple[str, ...]
    model_field: str
    kind: type
    default: object = REQUIRED
    legacy: tuple[tuple[str, ...], ...] = ()
    written: Callable[[ModelConfig], object] | None = None
    # f17b: a null means None (the setting off), not the default (Gemma 2's soft-capping defaults to on).
    nullable: bool = False

    @property
    def key(self) -> str:
        return ".".join(self.path)

    def value_of(self, config: ModelConfig) -> object:
        """What config.json holds for ``config``."""
        return self.written(config) if self.written is not None else getattr(config, self.model_field)


def _always_writable(config: ModelConfig) -> str | None:
    return None


@dataclass(frozen=True)
class ConfigRule:
    """config.json keys <-> ``ModelConfig`` fields that do not map one to one, as three pure functions.

    ``read(present, model)`` gets the values of ``keys`` that config.json holds (a null counts as
    absent) and the ``ModelConfig`` values its ``ConfigField``s gave, and returns a value for each of
    ``model_fields``; a bad value raises ``ValueError`` naming the key. ``write(config)`` gives the
    values of ``keys`` for a model. ``refuses(config)`` says why a model cannot be written as the
    family (``field=value (needs …)``), None when it can.
    """

    keys: tuple[str, ...]
    model_fields: tuple[str, ...]
    read: Callable[[Mapping[str, object], Mapping[str, object]], Mapping[str, object]]
    write: Callable[[ModelConfig], Mapping[str, object]]
    refuses: Callable[[ModelConfig], str | None] = _always_writable


_MODEL_FIELDS = frozenset(ModelConfig.setting_names())


def _repeated(items: Sequence[str]) -> list[str]:
    return sorted({item for item in items if items.count(item) > 1})


@dataclass(frozen=True)
class Family:
    """One HF architecture.

    ``fixed`` are the ``ModelConfig`` values every model of the family has (a config that differs
    cannot be written as this family); ``rules`` map what ``fields`` cannot map one to one;
    ``hf_fixed`` are the config.json values the table assumes (a source that differs is refused, a
    target gets them written); ``hf_assumed`` are config.json settings Megatron has no field for,
    with the value a Megatron model behaves as (a source that differs converts with a notice, a
    config.json built from a ``ModelConfig`` gets them); ``hf_scratch`` are extra keys written when
    config.json is built from a ``ModelConfig`` alone.
    """

    architecture: str
    model_type: str
    tensors: TensorTable
    fields: tuple[ConfigField, ...]
    fixed: Mapping[str, object]
    hf_fixed: Mapping[str, object] = field(default_factory=dict)
    hf_scratch: Mapping[str, object] = field(default_factory=dict)
    rules: tuple[ConfigRule, ...] = ()
    hf_assumed: Mapping[str, object] = field(default_factory=dict)
    # f17b: HF's norms compute with 1 + w as megatron-core's zero-centred gamma does (Gemma): the
    # weights are the same numbers on both sides, not written as 1 + gamma.
    hf_norms_zero_centred: bool = False
    # f17b: HF's rotary is itself interleaved (GLM-4): q/k rows are not reordered to rotate-half.
    hf_rotary_interleaved: bool = False
    # f17c: why stored HF tensors outside the table are refused, given them and config.json (None: the
    # generic message), e.g. multi-token-prediction layers a family does not convert.
    refuse_extra: Callable[[Sequence[str], Mapping[str, object]], str | None] | None = None
    # fam17d: the computation-changing ModelConfig settings (field names) this HF architecture
    # computes beyond every family's, so semantics.hf_losses does not name them as lost (partial
    # rotary, a router's score function, scaling, groups or pre-softmax, a clamped GLU).
    hf_computes: frozenset[str] = frozenset()
    # fam17d: HF rope_type values carried as they are in ModelConfig.hf_rope_parameters (Phi-3's
    # longrope and su): semantics.hf_unrepresentable does not name them.
    hf_rope_types_carried: tuple[str, ...] = ()
    # mtp: the config.json key counting multi-token-prediction layers (stored as layers
    # num_hidden_layers + i, pgconvert.families.mtp); None: the family has none.
    hf_mtp_layers_key: str | None = None

    def __post_init__(self) -> None:
        for name in ("fixed", "hf_fixed", "hf_scratch", "hf_assumed"):
            object.__setattr__(self, name, MappingProxyType(dict(getattr(self, name))))
        object.__setattr__(self, "hf_computes", frozenset(self.hf_computes))
        mapped = {f.model_field for f in self.fields}
        ruled = [name for rule in self.rules for name in rule.model_fields]
        unknown = sorted((mapped | set(ruled) | set(self.fixed) | self.hf_computes) - _MODEL_FIELDS)
        if unknown:
            raise ValueError(f"family {self.architecture}: not ModelConfig fields: {unknown}")
        both = sorted((mapped | set(ruled)) & set(self.fixed))
        if both:
            raise ValueError(f"family {self.architecture}: fields both fixed and read from config.json: {both}")
        twice = sorted(set(_repeated(ruled)) | (set(ruled) & mapped))
        if twice:
            raise ValueError(f"family {self.architecture}: fields read by more than one rule or field: {twice}")
        keys = [f.key for f in self.fields] + [key for rule in self.rules for key in rule.keys]
        repeated = _repeated(keys + [*self.hf_fixed, *self.hf_assumed])
        if repeated:
            raise ValueError(f"family {self.architecture}: config.json keys mapped twice: {repeated}")


# Every family here names its attention tensors the way transformers' LlamaForCausalLM does; which
# rows a model uses follows from its ModelConfig (biases, qk-norm, tied output, which layers are
# MoE) through canonical_names.
_EMBEDDING_ROWS = (
    TensorMapping("embedding.word_embeddings.weight", ("model.embed_tokens.weight",)),
)
_ATTENTION_ROWS = (
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
    # Dense and MoE layers alike: megatron-core's pre-MLP norm is HF's post-attention norm.
    TensorMapping("decoder.layers.{}.pre_mlp_layernorm.weight",
                  ("model.layers.{}.post_attention_layernorm.weight",)),
)
_DENSE_MLP_ROWS = (
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
)
_FINAL_ROWS = (
    TensorMapping("decoder.final_layernorm.weight", ("model.norm.weight",)),
    TensorMapping("output_layer.weight", ("lm_head.weight",)),
    # Rotary frequencies are recomputed from the config; old transformers versions saved them.
    TensorMapping(None, ("model.layers.{}.self_attn.rotary_emb.inv_freq",), DROPPED),
    TensorMapping(None, ("model.rotary_emb.inv_freq",), DROPPED),
)
# Routed experts: the second slot is the expert's global index. transformers 5 fuses the experts
# of a layer in memory (gate_up_proj) but save_pretrained writes, and from_pretrained reads, one
# tensor per expert and projection, as below.
_MIXTRAL_MOE_ROWS = (
    TensorMapping("decoder.layers.{}.mlp.router.weight", ("model.layers.{}.block_sparse_moe.gate.weight",)),
    TensorMapping("decoder.layers.{}.mlp.experts.local_experts.{}.linear_fc1.weight", (
        "model.layers.{}.block_sparse_moe.experts.{}.w1.weight",
        "model.layers.{}.block_sparse_moe.experts.{}.w3.weight",
    ), GATE_UP),
    TensorMapping("decoder.layers.{}.mlp.experts.local_experts.{}.linear_fc2.weight",
                  ("model.layers.{}.block_sparse_moe.experts.{}.w2.weight",)),
)
_QWEN_MOE_ROWS = (
    TensorMapping("decoder.layers.{}.mlp.router.weight", ("model.layers.{}.mlp.gate.weight",)),
    TensorMapping("decoder.layers.{}.mlp.experts.local_experts.{}.linear_fc1.weight", (
        "model.layers.{}.mlp.experts.{}.gate_proj.weight",
        "model.layers.{}.mlp.experts.{}.up_proj.weight",
    ), GATE_UP),
    TensorMapping("decoder.layers.{}.mlp.experts.local_experts.{}.linear_fc2.weight",
                  ("model.layers.{}.mlp.experts.{}.down_proj.weight",)),
)

DECODER_TENSORS = TensorTable((*_EMBEDDING_ROWS, *_ATTENTION_ROWS, *_DENSE_MLP_ROWS, *_FINAL_ROWS))
MIXTRAL_TENSORS = TensorTable((*_EMBEDDING_ROWS, *_ATTENTION_ROWS, *_MIXTRAL_MOE_ROWS, *_FINAL_ROWS))
QWEN3_MOE_TENSORS = TensorTable((*_EMBEDDING_ROWS, *_ATTENTION_ROWS, *_DENSE_MLP_ROWS, *_QWEN_MOE_ROWS,
                                 *_FINAL_ROWS))


def _decoder_fields(max_position_embeddings: int, norm_epsilon: float = 1e-6,
                    rotary_base: float = 10000.0) -> tuple[ConfigField, ...]:
    """The config.json fields of a Llama-style decoder but its FFN size; defaults are transformers'
    class defaults."""
    return (
        ConfigField(("hidden_size",), "hidden_size", int),
        ConfigField(("num_hidden_layers",), "num_layers", int),
        ConfigField(("num_attention_heads",), "num_attention_heads", int),
        ConfigField(("num_key_value_heads",), "num_query_groups", int, default=None),
        ConfigField(("head_dim",), "kv_channels", int, default=None),
        ConfigField(("rms_norm_eps",), "norm_epsilon", float, default=norm_epsilon),
        # transformers 5 keeps the base under rope_parameters; 4.x had a top-level rope_theta.
        ConfigField(("rope_parameters", "rope_theta"), "rotary_base", float, default=rotary_base,
                    legacy=(("rope_theta",),)),
        ConfigField(("max_position_embeddings",), "max_position_embeddings", int,
                    default=max_position_embeddings),
        ConfigField(("vocab_size",), "vocab_size", int),
        ConfigField(("tie_word_embeddings",), "tie_embeddings", bool, default=False),
        ConfigField(("attention_dropout",), "attention_dropout", float, default=0.0),
    )


_DENSE_FFN = ConfigField(("intermediate_size",), "ffn_hidden_size", int)


def _expert_ffn_size(config: ModelConfig) -> int:
    return config.expert_ffn_size


def _moe_layer_freq_text(config: ModelConfig) -> str:
    freq = config.moe_layer_freq
    return repr(list(freq) if isinstance(freq, tuple) else freq)


def _dense_layers(config: ModelConfig) -> list[int]:
    return [layer for layer in range(config.num_layers) if not config.is_moe_layer(layer)]


def _every_layer_moe(present: Mapping[str, object], model: Mapping[str, object]) -> Mapping[str, object]:
    # Every Mixtral layer is MoE and intermediate_size is the experts' FFN; Megatron still wants a
    # dense FFN size, and the experts' is the one Mixtral checkpoints converted by Megatron carry.
    return {"ffn_hidden_size": model["moe_ffn_hidden_size"], "moe_layer_freq": 1}


def _no_keys(config: ModelConfig) -> Mapping[str, object]:
    return {}


def _refuses_dense_layers(config: ModelConfig) -> str | None:
    if config.num_experts is None:
        return "num_experts=None (needs routed experts)"
    dense = _dense_layers(config)
    if dense:
        return f"moe_layer_freq={_moe_layer_freq_text(config)} (needs every layer MoE; dense layers: {dense})"
    return None


def _layers_from_sparse_step(present: Mapping[str, object], model: Mapping[str, object]) -> Mapping[str, object]:
    """transformers' Qwen-MoE rule: layer i is MoE iff i is not in mlp_only_layers and
    (i + 1) % decoder_sparse_step == 0; megatron-core's int moe_layer_freq k means i % k == 0, so
    anything but "every layer" becomes a 0/1 pattern."""
    step = present.get("decoder_sparse_step", 1)
    if not isinstance(step, int) or isinstance(step, bool) or step < 1:
        raise ValueError(f"decoder_sparse_step={quote(step)}: expected a positive integer")
    dense = present.get("mlp_only_layers", [])
    if not isinstance(dense, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in dense):
        raise ValueError(f"mlp_only_layers={quote(dense)}: expected a list of layer indices")
    layers = model["num_layers"]
    assert isinstance(layers, int)
    dense_set = set(dense)
    pattern = tuple(int(layer not in dense_set and (layer + 1) % step == 0) for layer in range(layers))
    return {"moe_layer_freq": 1 if all(pattern) else pattern}


def _sparse_step_from_layers(config: ModelConfig) -> Mapping[str, object]:
    return {"decoder_sparse_step": 1, "mlp_only_layers": _dense_layers(config)}


def _refuses_dense_model(config: ModelConfig) -> str | None:
    return None if config.num_experts is not None else "num_experts=None (needs routed experts)"


# --- the semantic settings of pgconvert.semantics that are not one key for one field -----------

def _unit_number(value: object, key: str, low_open: bool = True) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 < value <= (1 if low_open else math.inf):
        raise ValueError(f"{key}={quote(value)}: expected a number in {'(0, 1]' if low_open else '(0, inf)'}")
    return float(value)


def _read_rope(present: Mapping[str, object], model: Mapping[str, object]) -> Mapping[str, object]:
    """RoPE scaling and partial rotary from ``rope_parameters`` (4.x: ``rope_scaling``); a type
    Megatron cannot compute reads as plain RoPE (``semantics.hf_unrepresentable`` names it)."""
    params = rope_parameters(present)
    partial = params.get("partial_rotary_factor", present.get("partial_rotary_factor"))
    rotary_percent = 1.0 if partial is None else _unit_number(partial, "partial_rotary_factor")
    rope_type = rope_type_of(params)
    if rope_type == "yarn":
        return {**yarn.YARN_DEFAULTS, **yarn.read_hf(params, model), "rotary_percent": rotary_percent}
    if rope_type in ("llama3", "linear"):
        factor = _unit_number(params.get("factor"), "rope_parameters.factor", low_open=False)
        return {**yarn.YARN_DEFAULTS, "rope_scaling": rope_type, "rope_scaling_factor": factor,
                "rotary_percent": rotary_percent}
    return {**yarn.YARN_DEFAULTS, "rope_scaling": None, "rope_scaling_factor": 1.0, "rotary_percent": rotary_percent}


def _write_rope(config: ModelConfig) -> Mapping[str, object]:
    params: dict[str, object] = {"rope_type": config.rope_scaling or "default", "rope_theta": config.rotary_base}
    if config.rope_scaling is not None:
        params["factor"] = config.rope_scaling_factor
    if config.rope_scaling == "llama3":
        params.update(MEGATRON_LLAMA3)
    if config.rope_scaling == "yarn":
        params.update(yarn.write_hf(config))
    # transformers 4.x reads the scaling from rope_scaling (5 prefers it too, so the two agree).
    legacy = {key: value for key, value in params.items() if key != "rope_theta"} if config.rope_scaling else None
    # Partial rotary is not written: no family here computes it (semantics.hf_losses names it).
    return {"rope_parameters": params, "rope_scaling": legacy, "partial_rotary_factor": None}


_ROPE_RULE = ConfigRule(keys=("rope_parameters", "rope_scaling", "partial_rotary_factor"),
                        model_fields=("rope_scaling", "rope_scaling_factor", "rotary_percent", *yarn.YARN_FIELDS),
                        read=_read_rope, write=_write_rope)


def _window(value: object, key: str) -> int | None:
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{key}={quote(value)}: expected a positive integer or null")
    return value


def _read_every_layer_window(present: Mapping[str, object], model: Mapping[str, object]) -> Mapping[str, object]:
    """Mistral, Mixtral: ``sliding_window`` applies to every layer (null: none)."""
    return {"sliding_window": _window(present.get("sliding_window"), "sliding_window"), "window_layers": None}


def _write_every_layer_window(config: ModelConfig) -> Mapping[str, object]:
    return {"sliding_window": config.sliding_window}


def _refuses_partial_window(config: ModelConfig) -> str | None:
    if config.window_layers is not None:
        return f"window_layers={list(config.window_layers)} (needs every layer windowed or none)"
    return None


# transformers' Qwen2Config/Qwen3Config default.
QWEN_MAX_WINDOW_LAYERS = 28


def _read_qwen_window(present: Mapping[str, object], model: Mapping[str, object]) -> Mapping[str, object]:
    """Qwen2, Qwen3: ``use_sliding_window`` turns ``sliding_window`` on for the layers ``layer_types``
    marks ``sliding_attention`` (default: those from ``max_window_layers`` on), as transformers reads it."""
    use = present.get("use_sliding_window", False)
    if not isinstance(use, bool):
        raise ValueError(f"use_sliding_window={quote(use)}: expected true or false")
    window = _window(present.get("sliding_window"), "sliding_window") if use else None
    layers = model["num_layers"]
    assert isinstance(layers, int)
    types = present.get("layer_types")
    if types is not None:
        if (not isinstance(types, list) or len(types) != layers
                or not all(kind in ("sliding_attention", "full_attention") for kind in types)):
            raise ValueError(f"layer_types={quote(types)}: expected {layers} of 'sliding_attention'/'full_attention'")
        pattern = tuple(int(kind == "sliding_attention") for kind in types)
    else:
        first = present.get("max_window_layers", QWEN_MAX_WINDOW_LAYERS)
        if not isinstance(first, int) or isinstance(first, bool) or first < 0:
            raise ValueError(f"max_window_layers={quote(first)}: expected a layer count")
        pattern = tuple(int(layer >= first) for layer in range(layers))
    if window is None or not any(pattern):
        return {"sliding_window": None, "window_layers": None}
    return {"sliding_window": window, "window_layers": None if all(pattern) else pattern}


def _write_qwen_window(config: ModelConfig) -> Mapping[str, object]:
    pattern = [int(config.is_window_layer(layer)) for layer in range(config.num_layers)]
    # Without a window, max_window_layers means nothing: transformers' default is written.
    leading_full = pattern.index(1) if 1 in pattern else QWEN_MAX_WINDOW_LAYERS
    return {
        "use_sliding_window": config.sliding_window is not None,
        "sliding_window": config.sliding_window,
        "max_window_layers": leading_full,
        "layer_types": ["sliding_attention" if windowed else "full_attention" for windowed in pattern],
    }


def _read_all_or_none_window(present: Mapping[str, object], model: Mapping[str, object]) -> Mapping[str, object]:
    """Qwen3-MoE: ``use_sliding_window`` windows every layer."""
    use = present.get("use_sliding_window", False)
    if not isinstance(use, bool):
        raise ValueError(f"use_sliding_window={quote(use)}: expected true or false")
    window = _window(present.get("sliding_window"), "sliding_window") if use else None
    return {"sliding_window": window, "window_layers": None}


def _write_all_or_none_window(config: ModelConfig) -> Mapping[str, object]:
    return {"use_sliding_window": config.sliding_window is not None, "sliding_window": config.sliding_window}


_EVERY_LAYER_WINDOW = ConfigRule(keys=("sliding_window",), model_fields=("sliding_window", "window_layers"),
                                 read=_read_every_layer_window, write=_write_every_layer_window,
                                 refuses=_refuses_partial_window)
_QWEN_WINDOW = ConfigRule(keys=("use_sliding_window", "sliding_window", "max_window_layers", "layer_types"),
                          model_fields=("sliding_window", "window_layers"),
                          read=_read_qwen_window, write=_write_qwen_window)
_QWEN_MOE_WINDOW = ConfigRule(keys=("use_sliding_window", "sliding_window"),
                              model_fields=("sliding_window", "window_layers"),
                              read=_read_all_or_none_window, write=_write_all_or_none_window,
                              refuses=_refuses_partial_window)


def _read_norm_topk(present: Mapping[str, object], model: Mapping[str, object]) -> Mapping[str, object]:
    """Qwen3-MoE renormalizes the top-k softmax weights (norm_topk_prob, transformers' default false)
    as megatron-core's default router does; without it, softmax over all experts first
    (megatron-core's moe_router_pre_softmax)."""
    value = present.get("norm_topk_prob", False)
    if not isinstance(value, bool):
        raise ValueError(f"norm_topk_prob={quote(value)}: expected true or false")
    return {"moe_router_pre_softmax": not value}


def _write_norm_topk(config: ModelConfig) -> Mapping[str, object]:
    return {"norm_topk_prob": not config.moe_router_pre_softmax}


_NORM_TOPK_RULE = ConfigRule(keys=("norm_topk_prob",), model_fields=("moe_router_pre_softmax",),
                             read=_read_norm_topk, write=_write_norm_topk)
_AUX_LOSS = ConfigField(("router_aux_loss_coef",), "moe_aux_loss_coeff", float, default=0.001)


# What every family below is, in Megatron terms: SwiGLU MLP, RMSNorm, RoPE; the dense ones have no
# experts, the MoE ones routed experts only (no shared experts, no router expert bias).
_SWIGLU_RMS_ROPE: dict[str, object] = {
    **POSTNORM_OFF,  # f17b: norms before the sublayers only, nothing Gemma-specific
    "gated_linear_unit": True,
    "activation": "silu",
    "normalization": "RMSNorm",
    "position_embedding_type": "rope",
    "multi_latent_attention": False,  # ds16: written as DeepSeek (pgconvert.families.deepseek)
}
_DENSE: dict[str, object] = {**_SWIGLU_RMS_ROPE, "num_experts": None}
_ROUTED_EXPERTS_ONLY: dict[str, object] = {
    **_SWIGLU_RMS_ROPE,
    "moe_shared_expert_intermediate_size": None,
    "moe_router_enable_expert_bias": False,
}
_HF_SILU: dict[str, object] = {"hidden_act": "silu"}
_ROPE_DEFAULT: dict[str, object] = {"rope_parameters": {"rope_type": "default"}}

LLAMA = Family(
    architecture="LlamaForCausalLM",
    model_type="llama",
    tensors=DECODER_TENSORS,
    fields=(
        *_decoder_fields(max_position_embeddings=2048),
        _DENSE_FFN,
        # Llama's attention_bias covers q, k, v and o; mlp_bias covers gate, up and down. Megatron
        # has one switch for all linears, so a model is representable only when the two agree.
        ConfigField(("attention_bias",), "add_bias_linear", bool, default=False),
        ConfigField(("mlp_bias",), "add_bias_linear", bool, default=False),
    ),
    rules=(_ROPE_RULE,),
    # A windowed model is written as Mistral.
    fixed={**_DENSE, "qk_layernorm": False, "add_qkv_bias": False, "sliding_window": None},
    hf_fixed=_HF_SILU,
    hf_scratch=_ROPE_DEFAULT,
)

MISTRAL = Family(
    architecture="MistralForCausalLM",
    model_type="mistral",
    tensors=DECODER_TENSORS,
    fields=(*_decoder_fields(max_position_embeddings=131072), _DENSE_FFN),
    rules=(_ROPE_RULE, _EVERY_LAYER_WINDOW),
    fixed={**_DENSE, "qk_layernorm": False, "add_qkv_bias": False, "add_bias_linear": False},
    hf_fixed=_HF_SILU,
    hf_scratch=_ROPE_DEFAULT,
)

QWEN2 = Family(
    architecture="Qwen2ForCausalLM",
    model_type="qwen2",
    tensors=DECODER_TENSORS,
    fields=(*_decoder_fields(max_position_embeddings=32768), _DENSE_FFN),
    rules=(_ROPE_RULE, _QWEN_WINDOW),
    # Qwen2 always has q/k/v biases and nothing else.
    fixed={**_DENSE, "qk_layernorm": False, "add_qkv_bias": True, "add_bias_linear": False},
    hf_fixed=_HF_SILU,
    hf_scratch=_ROPE_DEFAULT,
)

QWEN3 = Family(
    architecture="Qwen3ForCausalLM",
    model_type="qwen3",
    tensors=DECODER_TENSORS,
    fields=(*_decoder_fields(max_position_embeddings=32768), _DENSE_FFN),
    rules=(_ROPE_RULE, _QWEN_WINDOW),
    fixed={**_DENSE, "qk_layernorm": True, "add_qkv_bias": False, "add_bias_linear": False},
    # attention_bias=True would bias q, k, v and o but not the MLP: no Megatron equivalent.
    hf_fixed={**_HF_SILU, "attention_bias": False},
    hf_scratch=_ROPE_DEFAULT,
)

MIXTRAL = Family(
    architecture="MixtralForCausalLM",
    model_type="mixtral",
    tensors=MIXTRAL_TENSORS,
    fields=(
        *_decoder_fields(max_position_embeddings=131072, norm_epsilon=1e-5, rotary_base=1e6),
        ConfigField(("intermediate_size",), "moe_ffn_hidden_size", int, written=_expert_ffn_size),
        ConfigField(("num_local_experts",), "num_experts", int, default=8),
        ConfigField(("num_experts_per_tok",), "moe_router_topk", int, default=2),
        _AUX_LOSS,
    ),
    rules=(ConfigRule(keys=(), model_fields=("ffn_hidden_size", "moe_layer_freq"), read=_every_layer_moe,
                      write=_no_keys, refuses=_refuses_dense_layers), _ROPE_RULE, _EVERY_LAYER_WINDOW),
    fixed={**_ROUTED_EXPERTS_ONLY, "qk_layernorm": False, "add_qkv_bias": False, "add_bias_linear": False},
    hf_fixed=_HF_SILU,
    hf_scratch=_ROPE_DEFAULT,
)

# fam17d: norm_topk_prob false softmaxes over all experts first (megatron-core's moe_router_pre_softmax).
_PRE_SOFTMAX = frozenset({"moe_router_pre_softmax"})

QWEN3_MOE = Family(
    architecture="Qwen3MoeForCausalLM",
    model_type="qwen3_moe",
    hf_computes=_PRE_SOFTMAX,  # fam17d
    tensors=QWEN3_MOE_TENSORS,
    fields=(
        *_decoder_fields(max_position_embeddings=32768),
        _DENSE_FFN,
        ConfigField(("moe_intermediate_size",), "moe_ffn_hidden_size", int, default=768, written=_expert_ffn_size),
        # transformers 5 writes num_experts as num_local_experts (its attribute_map); 4.x as num_experts.
        ConfigField(("num_local_experts",), "num_experts", int, default=128, legacy=(("num_experts",),)),
        ConfigField(("num_experts_per_tok",), "moe_router_topk", int, default=8),
        _AUX_LOSS,
    ),
    rules=(ConfigRule(keys=("decoder_sparse_step", "mlp_only_layers"), model_fields=("moe_layer_freq",),
                      read=_layers_from_sparse_step, write=_sparse_step_from_layers,
                      refuses=_refuses_dense_model), _ROPE_RULE, _QWEN_MOE_WINDOW, _NORM_TOPK_RULE),
    fixed={**_ROUTED_EXPERTS_ONLY, "qk_layernorm": True, "add_qkv_bias": False, "add_bias_linear": False},
    hf_fixed={**_HF_SILU, "attention_bias": False},
    hf_scratch=_ROPE_DEFAULT,
)

FAMILIES: dict[str, Family] = {
    family.architecture: family for family in (LLAMA, MISTRAL, QWEN2, QWEN3, MIXTRAL, QWEN3_MOE)
}
from pgconvert.families.postnorm import POSTNORM_FAMILIES, POSTNORM_INFERENCE_ORDER  # noqa: E402  (f17b)

FAMILIES.update((family.architecture, family) for family in POSTNORM_FAMILIES)  # f17b

# The family written for a source that carries no HF architecture (a Megatron checkpoint): the
# first whose fixed values and rules the model satisfies. Mistral is Llama's tensors and config
# with a sliding window on every layer, so a windowed Llama-like model is written as Mistral. Dense
# families need num_experts=None and the MoE ones routed experts, so at most one kind fits.
INFERENCE_ORDER: tuple[str, ...] = (
    "DeepseekV3ForCausalLM", "DeepseekV2ForCausalLM",  # ds16: only multi-latent attention models fit these
    "Qwen3ForCausalLM", "Qwen2ForCausalLM", "LlamaForCausalLM", "MistralForCausalLM", "Qwen3MoeForCausalLM",
    "MixtralForCausalLM", *POSTNORM_INFERENCE_ORDER,
)

# f17c: GLM-4.5-MoE (pgconvert.families.moe_more), registered here.
from pgconvert.families.moe_more import MORE_MOE_FAMILIES  # noqa: E402

FAMILIES.update({family.architecture: family for family in MORE_MOE_FAMILIES})
INFERENCE_ORDER += tuple(family.architecture for family in MORE_MOE_FAMILIES)


# ds16: DeepSeek-V2/V3 (multi-latent attention), in their own module.
from pgconvert.families.deepseek import DEEPSEEK_FAMILIES  # noqa: E402

FAMILIES.update({family.architecture: family for family in DEEPSEEK_FAMILIES})


def supported_architectures() -> list[str]:
    return sorted(FAMILIES)


# f17a: Qwen2-MoE, Granite, SmolLM3, Ministral, Phi-3: pgconvert/families/more.py adds itself to
# FAMILIES and INFERENCE_ORDER (imported last, whichever of the two modules is imported first).
import pgconvert.families.more as _f17a  # noqa: E402

del _f17a
