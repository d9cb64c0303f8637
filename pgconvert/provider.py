"""The model provider: which tensors, of which shapes, live on one rank.

``provide(config, groups)`` answers for the rank the collection is set to. Every tensor of a GPT
decoder is one row of ``LAYER_TENSORS`` or ``MODEL_TENSORS``: canonical (global) name pattern, the
Transformer-Engine-spec local name where it differs, global shape, TP rule and when it exists.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from pgconvert.config import ModelConfig
from pgconvert.errors import LayoutError
from pgconvert.grid import ProcessGroupCollection
from pgconvert.layout import ParallelLayout
from pgconvert.rules import COLUMN, GATED, REPLICATED, ROW, VOCAB, ShardRule

Shape = Callable[[ModelConfig], tuple[int, ...]]
Condition = Callable[[ModelConfig], bool]

LAYER_PREFIX = "decoder.layers."


def _always(config: ModelConfig) -> bool:
    return True


def _layernorm(config: ModelConfig) -> bool:
    return config.normalization == "LayerNorm"


def _qk_norm(config: ModelConfig) -> bool:
    return config.qk_layernorm


def _qk_norm_bias(config: ModelConfig) -> bool:
    return config.qk_layernorm and config.normalization == "LayerNorm"


def _bias(config: ModelConfig) -> bool:
    return config.add_bias_linear


def _qkv_bias(config: ModelConfig) -> bool:
    return config.has_qkv_bias


def _fc1_rule(config: ModelConfig) -> ShardRule:
    return GATED if config.gated_linear_unit else COLUMN


@dataclass(frozen=True)
class TensorKind:
    """One row of the tensor table."""

    canonical: str
    shape: Shape
    rule: ShardRule | Callable[[ModelConfig], ShardRule]
    exists: Condition = _always
    te_name: str | None = None

    def rule_for(self, config: ModelConfig) -> ShardRule:
        return self.rule if isinstance(self.rule, ShardRule) else self.rule(config)

    def local_name(self, config: ModelConfig) -> str:
        if config.transformer_impl == "transformer_engine" and self.te_name is not None:
            return self.te_name
        return self.canonical


def _hidden(c: ModelConfig) -> tuple[int, ...]:
    return (c.hidden_size,)


def _head_dim(c: ModelConfig) -> tuple[int, ...]:
    return (c.head_dim,)


# Per-layer tensors, names relative to ``decoder.layers.{L}.``; the TE spec fuses the input and
# pre-MLP norms into the following linear (``layer_norm_weight``), megatron-core's local spec keeps them.
LAYER_TENSORS: tuple[TensorKind, ...] = (
    TensorKind("input_layernorm.weight", _hidden, REPLICATED,
               te_name="self_attention.linear_qkv.layer_norm_weight"),
    TensorKind("input_layernorm.bias", _hidden, REPLICATED, _layernorm,
               te_name="self_attention.linear_qkv.layer_norm_bias"),
    TensorKind("self_attention.linear_qkv.weight", lambda c: (c.qkv_rows, c.hidden_size), COLUMN),
    TensorKind("self_attention.linear_qkv.bias", lambda c: (c.qkv_rows,), COLUMN, _qkv_bias),
    TensorKind("self_attention.q_layernorm.weight", _head_dim, REPLICATED, _qk_norm),
    TensorKind("self_attention.q_layernorm.bias", _head_dim, REPLICATED, _qk_norm_bias),
    TensorKind("self_attention.k_layernorm.weight", _head_dim, REPLICATED, _qk_norm),
    TensorKind("self_attention.k_layernorm.bias", _head_dim, REPLICATED, _qk_norm_bias),
    TensorKind("self_attention.linear_proj.weight",
               lambda c: (c.hidden_size, c.num_attention_heads * c.head_dim), ROW),
    TensorKind("self_attention.linear_proj.bias", _hidden, REPLICATED, _bias),
    TensorKind("pre_mlp_layernorm.weight", _hidden, REPLICATED,
               te_name="mlp.linear_fc1.layer_norm_weight"),
    TensorKind("pre_mlp_layernorm.bias", _hidden, REPLICATED, _layernorm,
               te_name="mlp.linear_fc1.layer_norm_bias"),
    TensorKind("mlp.linear_fc1.weight", lambda c: (c.fc1_rows, c.hidden_size), _fc1_rule),
    TensorKind("mlp.linear_fc1.bias", lambda c: (c.fc1_rows,), _fc1_rule, _bias),
    TensorKind("mlp.linear_fc2.weight", lambda c: (c.hidden_size, c.ffn_hidden_size), ROW),
    TensorKind("mlp.linear_fc2.bias", _hidden, REPLICATED, _bias),
)

WORD_EMBEDDINGS = "embedding.word_embeddings.weight"
POSITION_EMBEDDINGS = "embedding.position_embeddings.weight"
OUTPUT_LAYER = "output_layer.weight"
FINAL_NORM_WEIGHT = "decoder.final_layernorm.weight"
FINAL_NORM_BIAS = "decoder.final_layernorm.bias"


@dataclass(frozen=True)
class TensorSpec:
    """One tensor a rank holds: its name in the rank's file, the global tensor it is cut from, and how."""

    local_name: str
    canonical: str
    global_shape: tuple[int, ...]
    local_shape: tuple[int, ...]
    rule: ShardRule
    tp_rank: int
    tp_size: int

    @property
    def numel(self) -> int:
        count = 1
        for dim in self.local_shape:
            count *= dim
        return count


@dataclass
class ModelShard:
    """Everything one rank holds, in file order."""

    tp_rank: int
    pp_rank: int
    layers: range
    specs: list[TensorSpec] = field(default_factory=list)

    def by_local_name(self) -> dict[str, TensorSpec]:
        return {spec.local_name: spec for spec in self.specs}

    def bytes(self, itemsize: int) -> int:
        return sum(spec.numel for spec in self.specs) * itemsize


def global_layer_names(config: ModelConfig, layer: int) -> list[tuple[str, TensorKind]]:
    """Canonical names of one layer's tensors with their table rows, in file order."""
    return [
        (f"{LAYER_PREFIX}{layer}.{kind.canonical}", kind)
        for kind in LAYER_TENSORS
        if kind.exists(config)
    ]


def canonical_names(config: ModelConfig) -> list[str]:
    """Every global tensor of the model, in layer order (the canonical stream's order)."""
    names = [WORD_EMBEDDINGS]
    if config.position_embedding_type == "learned_absolute":
        names.append(POSITION_EMBEDDINGS)
    for layer in range(config.num_layers):
        names.extend(name for name, _ in global_layer_names(config, layer))
    names.append(FINAL_NORM_WEIGHT)
    if config.normalization == "LayerNorm":
        names.append(FINAL_NORM_BIAS)
    if not config.tie_embeddings:
        names.append(OUTPUT_LAYER)
    return names


def provide(
    config: ModelConfig,
    groups: ProcessGroupCollection,
    padded_vocab_size: int | None = None,
) -> ModelShard:
    """Every tensor held by the rank ``groups`` is set to.

    ``padded_vocab_size`` is the global row count of the vocab tables at this layout; by default
    Megatron's padding of ``config.vocab_size``.
    """
    layout = groups.layout or ParallelLayout(tp=groups.tp.size(), pp=groups.pp.size())
    tp_size, tp_rank = groups.tp.size(), groups.tp.rank()
    pp_size, pp_rank = groups.pp.size(), groups.pp.rank()
    if padded_vocab_size is None:
        if config.vocab_size is None:
            raise LayoutError("vocab_size: unknown, and no padded vocab size was given")
        padded_vocab_size = layout.padded_vocab_size(config.vocab_size, config.make_vocab_size_divisible_by)
    if padded_vocab_size % tp_size:
        raise LayoutError(f"tp={tp_size}: padded vocab size {padded_vocab_size} is not divisible by {tp_size}")
    layers = layout.stage_layers(config.num_layers)[pp_rank]
    shard = ModelShard(tp_rank=tp_rank, pp_rank=pp_rank, layers=layers)

    def add(local_name: str, canonical: str, global_shape: tuple[int, ...], rule: ShardRule) -> None:
        shard.specs.append(TensorSpec(
            local_name=local_name,
            canonical=canonical,
            global_shape=global_shape,
            local_shape=rule.local_shape(global_shape, tp_size),
            rule=rule,
            tp_rank=tp_rank,
            tp_size=tp_size,
        ))

    vocab_shape = (padded_vocab_size, config.hidden_size)
    if pp_rank == 0:
        add(WORD_EMBEDDINGS, WORD_EMBEDDINGS, vocab_shape, VOCAB)
        if config.position_embedding_type == "learned_absolute":
            assert config.max_position_embeddings is not None
            add(POSITION_EMBEDDINGS, POSITION_EMBEDDINGS,
                (config.max_position_embeddings, config.hidden_size), REPLICATED)
    for local_index, layer in enumerate(layers):
        for canonical, kind in global_layer_names(config, layer):
            local = f"{LAYER_PREFIX}{local_index}.{kind.local_name(config)}"
            add(local, canonical, kind.shape(config), kind.rule_for(config))
    if pp_rank == pp_size - 1:
        add(FINAL_NORM_WEIGHT, FINAL_NORM_WEIGHT, (config.hidden_size,), REPLICATED)
        if config.normalization == "LayerNorm":
            add(FINAL_NORM_BIAS, FINAL_NORM_BIAS, (config.hidden_size,), REPLICATED)
        if not config.tie_embeddings:
            add(OUTPUT_LAYER, OUTPUT_LAYER, vocab_shape, VOCAB)
        elif pp_size > 1:
            # megatron-core allocates its own output weight on the last stage and keeps it equal to
            # the first stage's embedding (the tied gradients are all-reduced between the two).
            add(OUTPUT_LAYER, WORD_EMBEDDINGS, vocab_shape, VOCAB)
    return shard


def canonical_layer(name: str) -> tuple[int, str] | None:
    """``decoder.layers.{L}.rest`` → (L, rest); None for non-layer names."""
    if not name.startswith(LAYER_PREFIX):
        return None
    index, _, rest = name[len(LAYER_PREFIX):].partition(".")
    if not index.isdigit() or not rest:
        return None
    return int(index), rest


def dtype_itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def target_vocab_rows(config: ModelConfig, source_rows: int, layout: ParallelLayout,
                      flag_prefix: str = "dst") -> int:
    """Padded vocab rows at ``layout``: Megatron's padding of the true vocab when it is known.

    Without a true vocab size the source's padded table is all we have; it can only be kept as is,
    so a target whose padding multiple does not divide it is refused rather than guessed.
    """
    multiple = config.make_vocab_size_divisible_by
    if config.vocab_size is not None:
        return layout.padded_vocab_size(config.vocab_size, multiple)
    rows = layout.padded_vocab_size(source_rows, multiple)
    if rows != source_rows:
        flag = f"--{flag_prefix}-tp {layout.tp}" if flag_prefix else f"tp={layout.tp}"
        raise LayoutError(
            f"{flag}: the source's padded vocab ({source_rows} rows) is not a multiple of "
            f"make_vocab_size_divisible_by × tp = {multiple * layout.tp}, and the true vocab size is "
            "unknown; pass --true-vocab-size"
        )
    return rows
