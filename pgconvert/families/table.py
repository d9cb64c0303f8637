"""The table types of the model families: HF tensor names and config.json keys <-> canonical ones.

A family is one ``Family`` value: a ``TensorTable`` (HF name patterns <-> canonical name patterns,
each with the pure transform that relates them), the config.json fields it maps onto
``ModelConfig`` and, where a setting is not one key for one field (Qwen-MoE's sparse step and
dense-layer list against megatron-core's ``moe_layer_freq``), a ``ConfigRule`` of pure functions.
Both directions are derived from the same rows: the saver reads a row canonical -> HF, the loader
inverts the rows it expects for a config. A family that is another plus some changes is
``Family.derive(...)`` of it. Nothing here is specific to one family.

``{}`` in a pattern is a slot (a layer index, then a global expert index); a row's patterns are
checked when the table is built to have the same number of slots on both sides. A row with
``canonical=None`` names an HF tensor that is dropped on purpose (rotary ``inv_freq`` buffers).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import torch

from pgconvert.io.limits import quote
from pgconvert.io.reuse import joined, new_tensor
from pgconvert.model.config import ModelConfig
from pgconvert.model.rules import Window
from pgconvert.semantics import SEMANTICS
from pgconvert.semantics.carried import CarriedSetting

SLOT = "{}"
HYBRID_PATTERN = "hybrid_override_pattern"
# The layer structure of a family that neither reads nor fixes these settings: no layer pattern, no
# linear attention layers, no attention output gate, no sparse attention indexer, no vision part or multimodal RoPE.
STRUCTURE_UNLESS_READ: dict[str, object] = {HYBRID_PATTERN: None, "experimental_attention_variant": None,
                                            "attention_output_gate": False, "dsa_indexer_n_heads": None,
                                            "dsa_indexer_head_dim": None, "dsa_indexer_topk": None,
                                            "vision_config": None, "vision_token_ids": None, "mrope_section": None}
# Rows ``[start, stop)`` along a dim of one HF part of a canonical tensor: (part index, dim, start, stop).
PartReader = Callable[[int, int, int, int], torch.Tensor]
# The same rows read straight into a tensor holding their elements in row-major order (of any shape: the
# rows of one query group's heads in a fused QKV piece): (part index, dim, start, stop, destination).
PartInto = Callable[[int, int, int, int, torch.Tensor], None]


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

    def split_runs(self, full: torch.Tensor, config: ModelConfig) -> list[list[torch.Tensor]]:
        """``split`` with each part given as the runs of elements whose values, one run after the other in row-major
        order, are the part's: views of ``full`` where a part lies in it in several pieces (a writer writes them
        without making the part), else the part alone."""
        return [[part] for part in self.split(full, config)]

    # Whether the canonical tensor is nothing (its HF tensor is dropped on purpose).
    drops: bool = False
    # Whether its one HF part is the canonical tensor element for element (a reader may read any cut of it straight
    # from the part's bytes).
    stores_canonical: bool = False

    def changed_values(self, parts: Sequence[torch.Tensor], fused: torch.Tensor, config: ModelConfig) -> int:
        """How many values of ``parts`` the canonical tensor ``fused`` does not give back through ``split`` (0: the
        transform is exact, as every one but those that compute in the tensor's dtype are)."""
        return 0

    def reads_window(self, window: Window, shape: tuple[int, ...], config: ModelConfig) -> bool:
        """Whether ``read_window`` can read ``window`` of the canonical tensor from ranges of the HF
        parts; otherwise a reader fuses the whole tensor and cuts it."""
        return False

    def read_window(self, window: Window, shape: tuple[int, ...], config: ModelConfig,
                    read_part: PartReader) -> torch.Tensor:
        """``window`` of the canonical tensor of ``shape``, read as ranges of its HF parts."""
        raise NotImplementedError(f"{self.name} cannot read a window of its parts")

    def read_window_into(self, window: Window, shape: tuple[int, ...], config: ModelConfig, read_into: PartInto,
                         out: torch.Tensor) -> None:
        """``read_window`` into ``out`` (the window's place in the piece being made); a transform whose parts
        land in ``out`` unchanged reads them straight there, others read the window and copy it."""
        part_shapes = self.part_shapes(shape, config)

        def read(part: int, dim: int, start: int, stop: int) -> torch.Tensor:
            rows = list(part_shapes[part])
            rows[dim] = stop - start
            piece = torch.empty(rows, dtype=out.dtype)
            read_into(part, dim, start, stop, piece)
            return piece

        out.copy_(self.read_window(window, shape, config, read))

    def __repr__(self) -> str:
        return f"<transform {self.name}>"


class Identity(Transform):
    """One HF tensor is the canonical tensor."""

    name = "identity"
    parts = 1
    stores_canonical = True

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

    def read_window_into(self, window: Window, shape: tuple[int, ...], config: ModelConfig, read_into: PartInto,
                         out: torch.Tensor) -> None:
        read_into(0, window.dim, window.start, window.start + window.length, out)


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

    With the output gate (``attention_output_gate``: Qwen3-Next's ``q_proj`` holds each head's query rows
    then its gate rows, ``[q0 g0 q1 g1 …]``), a group's rows are its query heads, then their gate heads,
    then k and v (megatron-core's ``SelfAttention.get_query_key_value_tensors``)::

        q_proj  [q0 g0 q1 g1 | q2 g2 q3 g3]  ->  linear_qkv  [q0 q1 g0 g1 k0 v0 | q2 q3 g2 g3 k1 v1]
    """

    name = "fuse-qkv-by-group"
    parts = 3

    @staticmethod
    def _dims(config: ModelConfig) -> tuple[int, int, int]:
        """Query groups, a group's query rows (its gate rows with them) and a key (value) head's rows."""
        attention = config.attention
        groups = attention.query_groups
        gates = 2 if attention.attention_output_gate else 1
        return groups, attention.num_attention_heads // groups * attention.head_dim * gates, attention.head_dim

    @staticmethod
    def _gates_by_group(query: torch.Tensor, config: ModelConfig, to_megatron: bool) -> torch.Tensor:
        """The gated query rows: HF's ``[q0 g0 q1 g1]`` <-> a group's ``[q0 q1 g0 g1]``; ungated rows as given."""
        attention = config.attention
        if not attention.attention_output_gate:
            return query
        groups, rest = attention.query_groups, tuple(query.shape[1:])
        heads = (attention.num_attention_heads // groups, 2) if to_megatron else (2, attention.num_attention_heads // groups)
        by_head = query.reshape(groups, *heads, attention.head_dim, *rest)
        return by_head.transpose(1, 2).reshape(query.shape)

    def fuse(self, parts: Sequence[torch.Tensor], config: ModelConfig) -> torch.Tensor:
        query, key, value = parts
        query = self._gates_by_group(query, config, to_megatron=True)
        groups, q_rows, kv_rows = self._dims(config)
        rest = tuple(query.shape[1:])
        fused = joined([
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
            self._gates_by_group(query.reshape(groups * q_rows, *rest), config, to_megatron=False),
            key.reshape(groups * kv_rows, *rest),
            value.reshape(groups * kv_rows, *rest),
        ]

    def part_shapes(self, shape: tuple[int, ...], config: ModelConfig) -> list[tuple[int, ...]]:
        groups, q_rows, kv_rows = self._dims(config)
        rest = tuple(shape[1:])
        return [(groups * q_rows, *rest), (groups * kv_rows, *rest), (groups * kv_rows, *rest)]

    def split_runs(self, full: torch.Tensor, config: ModelConfig) -> list[list[torch.Tensor]]:
        """Each of q, k and v as its rows in each query group of ``full`` (gated queries, whose heads are
        reordered, and a strided ``full`` as ``split`` makes them)."""
        if config.attention.attention_output_gate or not full.is_contiguous():
            return super().split_runs(full, config)
        groups, q_rows, kv_rows = self._dims(config)
        by_group = full.view(groups, q_rows + 2 * kv_rows, *full.shape[1:])
        bounds = ((0, q_rows), (q_rows, kv_rows), (q_rows + kv_rows, kv_rows))
        return [[by_group[group].narrow(0, start, rows) for group in range(groups)] for start, rows in bounds]

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
        heads_per_group = config.attention.num_attention_heads // groups_total
        return self.fuse(parts, config.replace(num_query_groups=groups, num_attention_heads=groups * heads_per_group))

    def read_window_into(self, window: Window, shape: tuple[int, ...], config: ModelConfig, read_into: PartInto,
                         out: torch.Tensor) -> None:
        """Each group's q, k and v rows read straight into their rows of ``out`` (gated queries, whose heads are
        reordered, and a strided ``out`` are read and copied)."""
        if config.attention.attention_output_gate or not out.is_contiguous():
            super().read_window_into(window, shape, config, read_into, out)
            return
        _, q_rows, kv_rows = self._dims(config)
        group_rows = q_rows + 2 * kv_rows
        first, groups = window.start // group_rows, window.length // group_rows
        by_group = out.view(groups, group_rows, *shape[1:])
        offset = 0
        for index, step in enumerate((q_rows, kv_rows, kv_rows)):
            read_into(index, 0, first * step, (first + groups) * step, by_group.narrow(1, offset, step))
            offset += step


class ConcatenatedRows(Transform):
    """HF parts whose rows, one part after the other, are the canonical tensor; ``part_rows`` says how many
    each holds. A window of rows reads the rows of the parts it falls in, a window of columns those columns of
    every part."""

    def part_rows(self, shape: tuple[int, ...], config: ModelConfig) -> tuple[int, ...]:
        raise NotImplementedError

    def fuse(self, parts: Sequence[torch.Tensor], config: ModelConfig) -> torch.Tensor:
        return joined(list(parts), dim=0)

    def split(self, full: torch.Tensor, config: ModelConfig) -> list[torch.Tensor]:
        return list(full.split(list(self.part_rows(tuple(full.shape), config)), dim=0))

    def part_shapes(self, shape: tuple[int, ...], config: ModelConfig) -> list[tuple[int, ...]]:
        return [(rows, *shape[1:]) for rows in self.part_rows(shape, config)]

    def reads_window(self, window: Window, shape: tuple[int, ...], config: ModelConfig) -> bool:
        return True

    def read_window(self, window: Window, shape: tuple[int, ...], config: ModelConfig,
                    read_part: PartReader) -> torch.Tensor:
        if window.dim != 0:
            return joined([read_part(index, window.dim, window.start, window.start + window.length)
                           for index in range(self.parts)], dim=0)
        pieces, first = [], 0
        for index, rows in enumerate(self.part_rows(shape, config)):
            lo, hi = max(window.start, first), min(window.start + window.length, first + rows)
            if lo < hi:
                pieces.append(read_part(index, 0, lo - first, hi - first))
            first += rows
        return pieces[0] if len(pieces) == 1 else joined(pieces, dim=0)

    def read_window_into(self, window: Window, shape: tuple[int, ...], config: ModelConfig, read_into: PartInto,
                         out: torch.Tensor) -> None:
        """Each part's rows in the window (a window of columns: those columns of every part) read straight into
        their rows of ``out``."""
        first = 0
        for index, rows in enumerate(self.part_rows(shape, config)):
            if window.dim != 0:
                read_into(index, window.dim, window.start, window.start + window.length, out.narrow(0, first, rows))
            else:
                lo, hi = max(window.start, first), min(window.start + window.length, first + rows)
                if lo < hi:
                    read_into(index, 0, lo - first, hi - first, out.narrow(0, lo - window.start, hi - lo))
            first += rows


class FuseGateUp(ConcatenatedRows):
    """``gate_proj``, ``up_proj`` <-> the gated ``linear_fc1`` = ``[gate; up]`` (gate first)."""

    name = "fuse-gate-up"
    parts = 2

    def part_rows(self, shape: tuple[int, ...], config: ModelConfig) -> tuple[int, ...]:
        return (shape[0] // 2,) * 2


IDENTITY = Identity()
DROPPED = Dropped()
QKV = FuseQKVByGroup()
GATE_UP = FuseGateUp()


class FuseQKVFromConcat(Transform):
    """One HF ``qkv_proj`` = ``[all q; all k; all v]`` (Phi-3's) <-> megatron-core's ``linear_qkv``,
    whose rows are grouped per query group (``FuseQKVByGroup``): the one HF tensor is cut into q, k,
    v first."""

    name = "fuse-qkv-from-concat"
    parts = 1

    @staticmethod
    def _rows(config: ModelConfig) -> list[int]:
        attention = config.attention
        kv_rows = attention.query_groups * attention.head_dim
        return [attention.num_attention_heads * attention.head_dim, kv_rows, kv_rows]

    def fuse(self, parts: Sequence[torch.Tensor], config: ModelConfig) -> torch.Tensor:
        return QKV.fuse(list(parts[0].split(self._rows(config), dim=0)), config)

    def split(self, full: torch.Tensor, config: ModelConfig) -> list[torch.Tensor]:
        return [joined(QKV.split(full, config), dim=0)]

    def part_shapes(self, shape: tuple[int, ...], config: ModelConfig) -> list[tuple[int, ...]]:
        return [shape]


def _deinterleave(rows: torch.Tensor) -> torch.Tensor:
    return joined([rows[0::2], rows[1::2]], dim=0)


def _interleave(full: torch.Tensor) -> torch.Tensor:
    gate, up = full.chunk(2, dim=0)
    out = new_tensor(full.shape, full.dtype)
    out[0::2], out[1::2] = gate, up
    return out


class InterleavedGateUp(Transform):
    """One expert's ``gate_up_proj`` ([hidden, 2·I], columns gate/up alternating, GPT-OSS's) or its
    bias ([2·I]) <-> megatron-core's ``linear_fc1`` [gate; up] ([2·I, hidden] or [2·I])."""

    parts = 1

    def __init__(self, transposed: bool) -> None:
        self.transposed = transposed
        self.name = "interleaved-gate-up" + ("-transposed" if transposed else "")

    def fuse(self, parts: Sequence[torch.Tensor], config: ModelConfig) -> torch.Tensor:
        rows = parts[0].t() if self.transposed else parts[0]
        return _deinterleave(rows).contiguous()

    def split(self, full: torch.Tensor, config: ModelConfig) -> list[torch.Tensor]:
        rows = _interleave(full)
        return [rows.t().contiguous() if self.transposed else rows]

    def part_shapes(self, shape: tuple[int, ...], config: ModelConfig) -> list[tuple[int, ...]]:
        return [tuple(reversed(shape)) if self.transposed else shape]


class Transposed(Transform):
    """One HF tensor stored transposed (an expert's ``down_proj`` [I, hidden]) <-> megatron-core's
    (``linear_fc2`` [hidden, I])."""

    name = "transposed"
    parts = 1

    def fuse(self, parts: Sequence[torch.Tensor], config: ModelConfig) -> torch.Tensor:
        return parts[0].t().contiguous()

    def split(self, full: torch.Tensor, config: ModelConfig) -> list[torch.Tensor]:
        return [full.t().contiguous()]

    def part_shapes(self, shape: tuple[int, ...], config: ModelConfig) -> list[tuple[int, ...]]:
        return [tuple(reversed(shape))]


class LeadingUnitAxis(Transform):
    """One HF tensor holding the canonical tensor under a leading axis of one (ERNIE 4.5 MoE's
    ``e_score_correction_bias`` [1, experts], its one group of experts) <-> megatron-core's (``expert_bias``
    [experts]); the same values in the same order."""

    name = "leading unit axis"
    parts = 1

    def fuse(self, parts: Sequence[torch.Tensor], config: ModelConfig) -> torch.Tensor:
        return parts[0].reshape(parts[0].shape[1:])

    def split(self, full: torch.Tensor, config: ModelConfig) -> list[torch.Tensor]:
        return [full.reshape(1, *full.shape)]

    def part_shapes(self, shape: tuple[int, ...], config: ModelConfig) -> list[tuple[int, ...]]:
        return [(1, *shape)]


QKV_CONCAT = FuseQKVFromConcat()
INTERLEAVED_GATE_UP = InterleavedGateUp(transposed=False)
INTERLEAVED_GATE_UP_TRANSPOSED = InterleavedGateUp(transposed=True)
TRANSPOSED = Transposed()
LEADING_UNIT_AXIS = LeadingUnitAxis()


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
    # The HF tensors hold every routed expert of a layer stacked on dim 0 (GPT-OSS's
    # ``mlp.experts.gate_up_proj`` [E, ...]); the canonical pattern's last slot, the expert, indexes it.
    stacked: bool = False
    # The HF pattern is shared with other rows of this flag, for layers of other kinds: a hybrid model's
    # layers have one HF name for their pre-norm, which each layer kind calls by its own canonical name
    # (a config gives every layer one kind, so one of the rows applies to each layer).
    by_layer_kind: bool = False

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
        shared = {pattern for row in self.rows if row.by_layer_kind for pattern in row.hf}
        hf = [pattern for row in self.rows if not row.by_layer_kind for pattern in row.hf] + sorted(shared)
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
        """For a canonical tensor of a stacked row, its index on the HF tensors' dim 0; else None."""
        for pattern, row in self._canonical:
            match = pattern.fullmatch(canonical)
            if match:
                return int(match.groups()[-1]) if row.stacked else None
        return None

    def is_dropped(self, hf_name: str) -> bool:
        return any(pattern.fullmatch(hf_name) for pattern in self._dropped)


REQUIRED = object()

# The keys of a config.json that describe the file, not the model: never nested in a text config.
DOCUMENT_KEYS = ("architectures", "model_type", "transformers_version")


@dataclass(frozen=True)
class VisionLanguage:
    """How a vision-language architecture's config.json holds its language model, as transformers reads it:
    the text model's settings in the object ``text_config_key`` (``model_type`` ``text_model_type``), the
    ``top_level`` keys beside it (their top-level value wins: transformers' VL classes keep
    ``tie_word_embeddings`` and the dtype there), the vision part's keys at the top level. ``text`` is the
    language model's own family (Qwen2.5-VL's is Qwen2): ``--text-only`` writes it."""

    text: Family
    text_model_type: str
    text_config_key: str = "text_config"
    top_level: tuple[str, ...] = ("tie_word_embeddings", "dtype", "torch_dtype")
    # config.json's top-level keys the vision rule reads (the vision config, token ids); never nested.
    vision_keys: tuple[str, ...] = ()
    # What the text family's config.json states that the VL text config leaves to its class (Qwen3-VL-MoE's router
    # always renormalizes: the text family's ``norm_topk_prob: true``).
    text_settings: Mapping[str, Any] = field(default_factory=dict)
    # Other text model types the architecture's config class takes, refused: model_type -> why (Mistral 3's
    # ``ministral3``); any other than ``text_model_type`` is refused too.
    refused_text_models: Mapping[str, str] = field(default_factory=dict)

    def text_model_refusal(self, doc: Mapping[str, Any]) -> str | None:
        """Why config.json ``doc``'s text config is not this architecture's language model; None when it is."""
        nested = doc.get(self.text_config_key)
        given = nested.get("model_type") if isinstance(nested, dict) else None
        if given is None or given == self.text_model_type:
            return None
        why = self.refused_text_models.get(given, f"converted with {self.text_model_type!r} only")
        return f"{self.text_config_key}.model_type={given!r}: {why}"

    def flat(self, doc: Mapping[str, Any]) -> dict[str, Any]:
        """One flat view of ``doc``: the text config's keys over the top level's, ``top_level`` keys from the
        top; a config.json without a text config (transformers 4's) is read as it is."""
        nested = doc.get(self.text_config_key)
        if not isinstance(nested, dict):
            return {key: value for key, value in doc.items() if key != self.text_config_key}
        view = {key: value for key, value in doc.items() if key != self.text_config_key}
        view.update({key: value for key, value in nested.items() if key not in DOCUMENT_KEYS})
        view.update({key: doc[key] for key in self.top_level if key in doc})
        return view

    def text_doc(self, doc: Mapping[str, Any]) -> dict[str, Any]:
        """``doc`` as the text family's config.json: the flat view without the vision keys, the text family's
        architecture and model type, RoPE parameters without the multimodal sections."""
        view = {key: value for key, value in self.flat(doc).items() if key not in self.vision_keys}
        view.update(architectures=[self.text.architecture], model_type=self.text.model_type, **self.text_settings)
        for key in ("rope_parameters", "rope_scaling"):
            params = view.get(key)
            if isinstance(params, dict) and ("mrope_section" in params or params.get("type") == "mrope"):
                kept = {name: value for name, value in params.items()
                        if name not in ("mrope_section", "mrope_interleaved", "type")}
                view[key] = kept if key == "rope_parameters" or kept.get("rope_type", "default") != "default" else None
        return view

    def nested(self, doc: Mapping[str, Any]) -> dict[str, Any]:
        """``doc`` (a flat view) as transformers writes it: the text model's keys in the text config."""
        top = (*DOCUMENT_KEYS, *self.top_level, *self.vision_keys)
        text = {key: value for key, value in doc.items() if key not in top}
        return {**{key: value for key, value in doc.items() if key in top},
                self.text_config_key: {**text, "model_type": self.text_model_type}}


@dataclass(frozen=True)
class ConfigField:
    """One config.json value <-> one ``ModelConfig`` field.

    ``path`` is where transformers writes it today; ``legacy`` paths are older spellings that are
    read when ``path`` is absent and written too, so older transformers read the same value;
    ``aliases`` are other names its config class accepts (its ``attribute_map``), read last, never
    written.
    ``written`` gives the value to write where the field may be unset and mean another field's
    value (megatron-core's ``moe_ffn_hidden_size`` defaults to ``ffn_hidden_size``); by default the
    field itself.

    Absent and null read as transformers' config class resolves them (``tests/test_hf_config_defaults.py``
    checks every key against it): absent is the class ``default``; null is the default too where the
    class fills it in, None where it means the setting off or derived (``nullable``), and refused
    (``null_refused``: why) where transformers keeps the null and cannot build the model from it.
    """

    path: tuple[str, ...]
    model_field: str
    kind: type
    default: object = REQUIRED
    legacy: tuple[tuple[str, ...], ...] = ()
    written: Callable[[ModelConfig], object] | None = None
    aliases: tuple[tuple[str, ...], ...] = ()
    # A null means None (the setting off), not the default (Gemma 2's soft-capping defaults to on).
    nullable: bool = False
    # Why a null is refused: transformers keeps it and computes nothing from it (a RoPE base of None).
    null_refused: str | None = None

    @property
    def key(self) -> str:
        return ".".join(self.path)

    @property
    def spellings(self) -> tuple[tuple[str, ...], ...]:
        """Every path it is read from, in order."""
        return (self.path, *self.legacy, *self.aliases)

    def value_of(self, config: ModelConfig) -> object:
        """What config.json holds for ``config``."""
        return self.written(config) if self.written is not None else config.setting(self.model_field)


def _always_writable(config: ModelConfig) -> str | None:
    return None


def read_nothing(present: Mapping[str, object], model: Mapping[str, object]) -> Mapping[str, object]:
    """A ``ConfigRule.read`` for a rule that maps no key (it only refuses, or checks)."""
    return {}


def write_nothing(config: ModelConfig) -> Mapping[str, object]:
    """A ``ConfigRule.write`` for a rule that writes no key."""
    return {}


@dataclass(frozen=True)
class ConfigRule:
    """config.json keys <-> ``ModelConfig`` fields that do not map one to one, as three pure functions.

    ``read(present, model)`` gets the values of ``keys`` that config.json holds (a null counts as
    absent, but for ``null_keys``, whose null is given as None: where it means something else than
    the default, or is refused) and the ``ModelConfig`` values its ``ConfigField``s gave, and returns a
    value for each of ``model_fields``; a bad value raises ``ValueError`` naming the key. ``write(config)`` gives the
    values of ``keys`` for a model. ``refuses(config)`` says why a model cannot be written as the
    family (``field=value (needs …)``), None when it can.
    """

    keys: tuple[str, ...]
    model_fields: tuple[str, ...]
    read: Callable[[Mapping[str, object], Mapping[str, object]], Mapping[str, object]]
    write: Callable[[ModelConfig], Mapping[str, object]]
    refuses: Callable[[ModelConfig], str | None] = _always_writable
    null_keys: tuple[str, ...] = ()
    # Older spellings ``read`` also gets (transformers still reads them: Gemma 3's top-level
    # ``rope_local_base_freq``), never written.
    legacy_keys: tuple[str, ...] = ()
    # config.json must state these keys: the config class's default describes no model pgconvert converts
    # (dots.llm1's shared-expert count and renormalization); a model's family defaults state them as it has them.
    required: bool = False

    def present(self, doc: Mapping[str, Any]) -> dict[str, object]:
        """The values ``read`` gets from config.json ``doc``."""
        return {key: doc[key] for key in (*self.keys, *self.legacy_keys)
                if key in doc and (doc[key] is not None or key in self.null_keys)}


def false_only(key: str, why: str) -> ConfigRule:
    """A config.json switch the family converts only off (absent, null or false: transformers' model builds nothing
    from a null); true is refused, ``why``. Written false."""
    def read(present: Mapping[str, object], model: Mapping[str, object]) -> Mapping[str, object]:
        if present.get(key) not in (None, False):
            raise ValueError(f"{key}={quote(present.get(key))}: {why}")
        return {}

    def write(config: ModelConfig) -> Mapping[str, object]:
        return {key: False}

    return ConfigRule(keys=(key,), model_fields=(), read=read, write=write, null_keys=(key,))


_MODEL_FIELDS = frozenset(ModelConfig.setting_names())
_SEMANTIC_ROWS = frozenset(row.name for row in SEMANTICS)
# The mappings of a Family that derive merges; DROP as a value there removes the key.
_MERGED = ("hf_fixed", "hf_scratch", "hf_assumed", "hf_notes")


class _Drop:
    def __repr__(self) -> str:
        return "DROP"


DROP: Any = _Drop()


def _repeated(items: Sequence[str]) -> list[str]:
    return sorted({item for item in items if items.count(item) > 1})


@dataclass(frozen=True)
class MTPBlock:
    """An HF checkpoint's MTP module stored apart from the decoder, as Qwen3-Next's and Qwen3.5's releases store it
    (vLLM's ``Qwen3NextMultiTokenPredictor``; transformers builds none and skips ``mtp.*``): one set of the MTP
    layer's own tensors under fixed names (``own``: the rest of the table's name after ``model.layers.{N}.`` -> the
    stored name) and its decoder layer under ``layers`` + ``0.``. The table spells them as the layer index
    ``num_hidden_layers`` (``pgconvert.families.mtp.MTP_ROWS``); the own tensors have no index, so one MTP layer."""

    own: Mapping[str, str]
    layers: str
    # The config.json switch that gives the MTP module an embedding of its own (megatron-core's MTP layer embeds
    # with the model's, so true is refused); written false beside a non-zero count.
    own_embedding_key: str | None = None


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
    # HF's norms compute with 1 + w as megatron-core's zero-centred gamma does (Gemma): the
    # weights are the same numbers on both sides, not written as 1 + gamma.
    hf_norms_zero_centred: bool = False
    # HF's rotary is itself interleaved (GLM-4): q/k rows are not reordered to rotate-half.
    hf_rotary_interleaved: bool = False
    # Why stored HF tensors outside the table are refused, given them and config.json (None: the
    # generic message), e.g. multi-token-prediction layers a family does not convert.
    refuse_extra: Callable[[Sequence[str], Mapping[str, object]], str | None] | None = None
    # The computation-changing ModelConfig settings (field names) this HF architecture computes
    # beyond every family's, so pgconvert.formats.hf.hf_losses does not name them as lost (partial
    # rotary, a router's score function, scaling, groups or pre-softmax, a clamped GLU).
    hf_computes: frozenset[str] = frozenset()
    # HF rope_type values the family's rules carry: as they are in ModelConfig.carried.hf_rope_parameters (Phi-3's
    # longrope and su), or as the settings they compute (HunYuan's dynamic with alpha: a RoPE base; its rule refuses
    # the rest): pgconvert.semantics.rope.hf_unrepresentable does not name them.
    hf_rope_types_carried: tuple[str, ...] = ()
    # The config.json key counting multi-token-prediction layers (stored as layers
    # num_hidden_layers + i, pgconvert.families.mtp); None: the family has none.
    hf_mtp_layers_key: str | None = None
    # What an absent count means (its config class's default: DeepseekV3Config's and Glm4MoeConfig's 1; 0 where the
    # class has no such attribute, as DeepseekV32Config, GlmMoeDsaConfig and Qwen3NextConfig), and the other name
    # its class accepts for it (attribute_map; None: none).
    hf_mtp_layers_absent: int = 1
    hf_mtp_layers_alias: str | None = "num_mtp_layers"
    # Where the checkpoint stores its MTP module apart from the decoder (Qwen3-Next's ``mtp.*``) rather than as
    # layers num_hidden_layers + i: how the table's names for it are stored (pgconvert.families.mtp).
    hf_mtp_block: MTPBlock | None = None
    # Settings of this family that megatron-core does not compute, carried in Megatron args under
    # their own names (Granite's multipliers): read from and written to every Megatron checkpoint.
    megatron_carried: tuple[CarriedSetting, ...] = ()
    # How this family's config.json holds a setting of pgconvert.semantics.SEMANTICS (row name ->
    # text), where it differs from the row's own ``hf`` text: documentation, per family.
    hf_notes: Mapping[str, str] = field(default_factory=dict)
    # Module renames transformers makes when it loads this family's stored tensors (stored name part -> in
    # memory), so names given in memory's terms (a PEFT adapter's modules) find their tensors: Mixtral's
    # ``block_sparse_moe`` is ``mlp`` in memory.
    hf_loaded_modules: tuple[tuple[str, str], ...] = ()
    # Older prefixes of stored names the reader accepts too (stored -> the table's), which transformers still loads:
    # Gemma 3's released checkpoints hold the SigLIP tower under its wrapper's ``vision_tower.vision_model.``, which
    # transformers 5 writes as ``vision_tower.``. A saver writes the table's names.
    hf_stored_prefixes: tuple[tuple[str, str], ...] = ()
    # The Megatron-only settings of a model read from HF, where they differ from every family's
    # (pgconvert.formats.hf.LOADED_DEFAULTS: the local layer spec): the layer spec megatron-core ships for it.
    megatron_defaults: Mapping[str, object] = field(default_factory=dict)
    # A vision-language architecture: how its config.json nests the language model's, and that model's family.
    vision_language: VisionLanguage | None = None

    def __post_init__(self) -> None:
        mapped = {f.model_field for f in self.fields}
        ruled = [name for rule in self.rules for name in rule.model_fields]
        # A family that reads no layer pattern has attention and an MLP in every layer; one that reads no
        # linear attention or output gate has neither.
        unread = {name: value for name, value in STRUCTURE_UNLESS_READ.items()
                  if name not in mapped | set(ruled) | set(self.fixed)}
        if unread:
            object.__setattr__(self, "fixed", {**self.fixed, **unread})
        for name in ("fixed", *_MERGED):
            object.__setattr__(self, name, MappingProxyType(dict(getattr(self, name))))
        object.__setattr__(self, "hf_computes", frozenset(self.hf_computes))
        unknown = sorted((mapped | set(ruled) | set(self.fixed) | self.hf_computes) - _MODEL_FIELDS)
        if unknown:
            raise ValueError(f"family {self.architecture}: not ModelConfig fields: {unknown}")
        both = sorted((mapped | set(ruled)) & set(self.fixed))
        if both:
            raise ValueError(f"family {self.architecture}: fields both fixed and read from config.json: {both}")
        twice = sorted(set(_repeated(ruled)) | (set(ruled) & mapped))
        if twice:
            raise ValueError(f"family {self.architecture}: fields read by more than one rule or field: {twice}")
        keys = [f.key for f in self.fields] + [key for rule in self.rules for key in (*rule.keys, *rule.legacy_keys)]
        repeated = _repeated(keys + [*self.hf_fixed, *self.hf_assumed])
        if repeated:
            raise ValueError(f"family {self.architecture}: config.json keys mapped twice: {repeated}")
        rows = sorted(set(self.hf_notes) - _SEMANTIC_ROWS)
        if rows:
            raise ValueError(f"family {self.architecture}: hf_notes for settings SEMANTICS has no row for: {rows}")

    def derive(self, architecture: str, model_type: str, *, tensors: TensorTable | None = None,
               rows: Sequence[TensorMapping] = (), fields: Sequence[ConfigField] = (),
               rules: Sequence[ConfigRule] = (), fixed: Mapping[str, object] | None = None,
               **changes: Any) -> Family:
        """This family as ``architecture``, plus changes (as Megatron-Bridge's bridges override a
        base provider's config and transformers' conversion mappings reuse another model's):

        * ``tensors`` replaces the table; ``rows`` then replace the rows of the same canonical
          pattern (a dropped row: of the same HF pattern), in place, and the others are added;
        * ``fields`` replace those reading the same ``ModelConfig`` field (in place of the first),
          ``rules`` those reading any of the same fields; the others are added after the base's;
        * ``fixed`` values are merged into the base's, in place: a setting a new field or rule reads
          is no longer fixed (the new settings take the place of the first such one, else follow the
          base's), and the base's fields reading a setting fixed here, or read by a new rule, are
          dropped;
        * ``hf_fixed``, ``hf_scratch``, ``hf_assumed`` and ``hf_notes`` are merged into the base's
          (``DROP`` removes a key); any other attribute given replaces the base's.
        """
        fixed = dict(fixed or {})
        read_by_rules = {name for rule in rules for name in rule.model_fields}
        read = read_by_rules | {spec.model_field for spec in fields}
        merged_fixed = _merged_fixed(self.fixed, read, fixed)
        kept_fields = [spec for spec in self.fields if spec.model_field not in fixed.keys() | read_by_rules]
        for name in _MERGED:
            if name in changes:
                base = {**getattr(self, name), **changes[name]}
                changes[name] = {key: value for key, value in base.items() if value is not DROP}
        table = tensors or self.tensors
        return dataclasses.replace(
            self, architecture=architecture, model_type=model_type, fixed=merged_fixed,
            tensors=TensorTable(_replaced(table.rows, rows, _row_key)) if rows else table,
            fields=_replaced(kept_fields, fields, lambda spec: {spec.model_field}),
            rules=_replaced(self.rules, rules, lambda rule: set(rule.model_fields)), **changes)


def _merged_fixed(base: Mapping[str, object], read: set[str], changes: Mapping[str, object]) -> dict[str, object]:
    """``base`` with ``changes`` in place and without the settings now ``read``; the settings ``base``
    does not fix go where the first of those was (at the end when there is none)."""
    added = {name: value for name, value in changes.items() if name not in base or name in read}
    merged: dict[str, object] = {}
    for name, value in base.items():
        if name in read:
            merged.update(added)
            added = {}
        else:
            merged[name] = changes.get(name, value)
    merged.update(added)
    return merged


def _row_key(row: TensorMapping) -> set[str]:
    return {row.canonical} if row.canonical is not None else set(row.hf)


def _replaced(base: Sequence[Any], new: Sequence[Any], key: Callable[[Any], set[str]]) -> tuple[Any, ...]:
    """``base`` with each item of ``new`` in place of the first item whose key overlaps its own (the
    other overlapping ones dropped), or added at the end."""
    items: list[Any] = list(base)
    for item in new:
        overlapping = [index for index, old in enumerate(items) if key(old) & key(item)]
        if not overlapping:
            items.append(item)
            continue
        items[overlapping[0]] = item
        items = [old for index, old in enumerate(items) if index not in overlapping[1:]]
    return tuple(items)
