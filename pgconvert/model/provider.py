"""The model provider: which tensors, of which shapes, live on one rank.

``provide(config, groups)`` answers for the rank the collection is set to. A model is its layers'
specs (``config.layers``, ``config.mtp_layers``: pgconvert.model.layers), each made of layer kinds;
every tensor of a layer is a row of its kinds' tables (pgconvert.model.kinds): canonical (global)
name, the Transformer-Engine-spec local name where it differs, global shape, TP rule and when it
exists. Everything here derives from those tables; it knows no kind by name.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

from pgconvert.errors import LayoutError
from pgconvert.io import sizes
from pgconvert.model.config import MTP_LAYER_MODULES, ModelConfig
from pgconvert.model.grid import ProcessGroupCollection
from pgconvert.model.kinds import LAYER_KINDS
# Besides the provider's own names, other modules import from here the kinds' names of tensors and
# modules (EXPERTS_MODULE, MTP_LAYER_MODULE, fused_norm_name …), TensorKind and REPLICATED.
from pgconvert.model.kinds.mtp import MTP_EH_PROJ, MTP_LAYER_MODULE
from pgconvert.model.kinds.table import (EXPERT_PREFIX, EXPERTS_MODULE, FUSED_NORM_NAMES, InnerLayer, LayerKind,
                                         RoutedExperts, TEModule, TensorKind, TensorRow, TERow, fused_norm_name)
from pgconvert.model.layers import LayerSpec, MTPLayerSpec
from pgconvert.model.layout import ParallelLayout
from pgconvert.model.rules import REPLICATED, VOCAB, ShardRule
from pgconvert.model.vision import VISION_MODULES, VisionTensor, is_vision_tensor, tower_tensors

LAYER_PREFIX = "decoder.layers."
MTP_PREFIX = "mtp.layers."
WORD_EMBEDDINGS = "embedding.word_embeddings.weight"
POSITION_EMBEDDINGS = "embedding.position_embeddings.weight"
OUTPUT_LAYER = "output_layer.weight"
# Tables with one row per token: Megatron pads them to a multiple of make_vocab_size_divisible_by × tp.
VOCAB_TABLES: frozenset[str] = frozenset({WORD_EMBEDDINGS, OUTPUT_LAYER})
FINAL_NORM_WEIGHT = "decoder.final_layernorm.weight"
FINAL_NORM_BIAS = "decoder.final_layernorm.bias"
# A hybrid model's decoder (megatron-core's MambaStack) names its final norm ``final_norm``; canonically
# it is the GPT decoder's ``final_layernorm``.
HYBRID_FINAL_NORM = "decoder.final_norm."
# The local spec's separate input norms, one in every layer of their kind (attention, Mamba): a key
# under one of them is a local-spec key.
_LOCAL_INPUT_NORMS = ("input_layernorm.", "norm.")
EXTRA_STATE_SUFFIX = "._extra_state"


def layer_spec_of_key(key: str) -> str | None:
    """``"transformer_engine"`` for a layer key under a TE fused norm name, ``"local"`` for one under
    the input norm's separate name (present in every layer of the local spec), else None."""
    parsed = canonical_layer(key)
    if parsed is None:
        return None
    rest = parsed[1]
    if any(rest.startswith(fused) for _, fused in FUSED_NORM_NAMES):
        return "transformer_engine"
    return "local" if rest.startswith(_LOCAL_INPUT_NORMS) else None


@dataclass(frozen=True)
class TensorSpec:
    """One tensor a rank holds: its name in the rank's file, the global tensor it is cut from, and how.

    ``tp_size``/``tp_rank`` are those of the group the rule cuts along: the expert-TP group for
    routed experts, the TP group otherwise.
    """

    local_name: str
    canonical: str
    global_shape: tuple[int, ...]
    local_shape: tuple[int, ...]
    rule: ShardRule
    tp_rank: int
    tp_size: int
    keep_dtype: bool = False

    @property
    def numel(self) -> int:
        return sizes.numel(self.local_shape)


@dataclass
class ModelShard:
    """Everything one rank (one model chunk of it, with a virtual pipeline) holds, in file order."""

    tp_rank: int
    pp_rank: int
    layers: range
    ep_rank: int = 0
    chunk: int | None = None
    specs: list[TensorSpec] = field(default_factory=list)

    def by_local_name(self) -> dict[str, TensorSpec]:
        return {spec.local_name: spec for spec in self.specs}


@dataclass(frozen=True)
class LayerTensor:
    """One tensor of one layer: its canonical name, table row, and routed-expert index if any.

    ``local_path`` is how a rank file spells the module path from the layer to the row's table
    (``""``, or an MTP layer's inner layer as ``ModelConfig.mtp_layer_module`` names it).
    """

    canonical: str
    kind: TensorKind
    expert: int | None = None
    local_path: str = ""


def _kinds(spec: LayerSpec | MTPLayerSpec) -> list[LayerKind]:
    return [LAYER_KINDS[name] for name in spec.kinds]


def spec_tensors(config: ModelConfig, spec: LayerSpec | MTPLayerSpec, prefix: str,
                 local_path: str = "") -> list[LayerTensor]:
    """The tensors of a layer of spec ``spec`` under ``prefix``, with their table rows, in file order."""
    return [tensor for kind in _kinds(spec) for row in kind.tensors
            for tensor in _row_tensors(config, spec, row, prefix, local_path)]


def _row_tensors(config: ModelConfig, spec: LayerSpec | MTPLayerSpec, row: TensorRow, prefix: str,
                 local_path: str) -> list[LayerTensor]:
    """The tensors of one table row: a tensor, every routed expert's, or an inner layer's."""
    if isinstance(row, RoutedExperts):
        return [LayerTensor(f"{prefix}{EXPERT_PREFIX}{expert}.{kind.canonical}", kind, expert, local_path)
                for expert in range(config.moe.num_experts or 0) for kind in row.rows
                if isinstance(kind, TensorKind) and kind.exists(config)]
    if isinstance(row, InnerLayer):
        assert isinstance(spec, MTPLayerSpec)
        return spec_tensors(config, spec.inner, prefix + row.module, local_path + row.local_module(config))
    return [LayerTensor(prefix + row.canonical, row, None, local_path)] if row.exists(config) else []


def layer_tensors(config: ModelConfig, layer: int) -> list[LayerTensor]:
    """Canonical tensors of one decoder layer with their table rows, in file order."""
    return spec_tensors(config, config.layers[layer], f"{LAYER_PREFIX}{layer}.")


def attention_tensors(config: ModelConfig) -> tuple[TensorRow, ...]:
    """The attention kind's table (every decoder layer's: one mixer kind per model today)."""
    mixer = config.layers[0].mixer
    return LAYER_KINDS[mixer].tensors if mixer is not None else ()


def mtp_layer_tensors(config: ModelConfig, index: int) -> list[LayerTensor]:
    """Canonical tensors of MTP layer ``index`` with their table rows, in file order."""
    return spec_tensors(config, config.mtp_layers[index], f"{MTP_PREFIX}{index}.")


def mtp_tensors(config: ModelConfig) -> list[LayerTensor]:
    """Every MTP layer's tensors, in file order."""
    return [tensor for index in range(config.mtp_num_layers) for tensor in mtp_layer_tensors(config, index)]


def _vision_tensors(config: ModelConfig) -> tuple[VisionTensor, ...]:
    """A VL model's vision part (none for a text model)."""
    return tower_tensors(config.vision.vision_config, config.hidden_size)


def canonical_names(config: ModelConfig) -> list[str]:
    """Every global tensor of the model, in layer order (the canonical stream's order): a VL model's vision
    part first (Megatron-Bridge registers it before the language model)."""
    names = [tensor.name for tensor in _vision_tensors(config)]
    names.append(WORD_EMBEDDINGS)
    if config.positions.position_embedding_type == "learned_absolute":
        names.append(POSITION_EMBEDDINGS)
    for layer in range(config.num_layers):
        names.extend(tensor.canonical for tensor in layer_tensors(config, layer))
    names.append(FINAL_NORM_WEIGHT)
    if config.has_norm_bias:
        names.append(FINAL_NORM_BIAS)
    names.extend(tensor.canonical for tensor in mtp_tensors(config))  # GPTModel registers mtp here
    if not config.tie_embeddings:
        names.append(OUTPUT_LAYER)
    return names


def _vocab_shape(config: ModelConfig) -> tuple[int, ...]:
    assert config.vocab_size is not None
    return (config.vocab_size, config.hidden_size)


def _position_shape(config: ModelConfig) -> tuple[int, ...]:
    assert config.positions.max_position_embeddings is not None
    return (config.positions.max_position_embeddings, config.hidden_size)


# How the tensors outside the layers get their global shape from a config (vocab tables: the true vocab).
_NON_LAYER_SHAPES: dict[str, Callable[[ModelConfig], tuple[int, ...]]] = {
    WORD_EMBEDDINGS: _vocab_shape,
    OUTPUT_LAYER: _vocab_shape,
    FINAL_NORM_WEIGHT: lambda config: (config.hidden_size,),
    FINAL_NORM_BIAS: lambda config: (config.hidden_size,),
    POSITION_EMBEDDINGS: _position_shape,
}


def shape_function(config: ModelConfig, name: str) -> Callable[[ModelConfig], tuple[int, ...]]:
    """How canonical tensor ``name`` of ``config`` gets its global shape from a config (what
    ``canonical_shapes`` computes for it, vocab tables with the true vocab)."""
    if name in _NON_LAYER_SHAPES:
        return _NON_LAYER_SHAPES[name]
    if is_vision_tensor(name):
        return lambda config: next(tensor.shape for tensor in _vision_tensors(config)
                                   if tensor.name == name)
    parsed = canonical_layer(name)
    tensors = layer_tensors(config, parsed[0]) if parsed is not None else mtp_tensors(config)
    kind = next(tensor.kind for tensor in tensors if tensor.canonical == name)
    return kind.shape


def canonical_shapes(config: ModelConfig, vocab_rows: int | None = None) -> dict[str, tuple[int, ...]]:
    """Global shape of every canonical tensor, in stream order; vocab tables get ``vocab_rows``
    rows (by default the true vocab size)."""
    rows = vocab_rows if vocab_rows is not None else config.vocab_size
    if rows is None:
        raise LayoutError("vocab_size: unknown; the true vocab size is needed (pass --true-vocab-size)")
    shapes: dict[str, tuple[int, ...]] = {name: (rows, config.hidden_size) for name in VOCAB_TABLES}
    shapes.update({tensor.name: tensor.shape for tensor in _vision_tensors(config)})
    shapes[FINAL_NORM_WEIGHT] = shapes[FINAL_NORM_BIAS] = _NON_LAYER_SHAPES[FINAL_NORM_WEIGHT](config)
    if config.positions.max_position_embeddings is not None:
        shapes[POSITION_EMBEDDINGS] = _position_shape(config)
    for layer in range(config.num_layers):
        for tensor in layer_tensors(config, layer):
            shapes[tensor.canonical] = tensor.kind.shape(config)
    for tensor in mtp_tensors(config):
        shapes[tensor.canonical] = tensor.kind.shape(config)
    return {name: shapes[name] for name in canonical_names(config)}


def keep_dtype_names(config: ModelConfig) -> set[str]:
    """Canonical tensors whose dtype is never changed by ``--dtype`` (router weights, expert bias)."""
    return {name for name, kind in layer_kinds(config).items() if kind.keep_dtype}


def layer_kinds(config: ModelConfig) -> dict[str, TensorKind]:
    """Every layer tensor's table row, by canonical name."""
    kinds = {tensor.canonical: tensor.kind for layer in range(config.num_layers)
             for tensor in layer_tensors(config, layer)}
    return kinds | {tensor.canonical: tensor.kind for tensor in mtp_tensors(config)}


def norm_weight_names(config: ModelConfig) -> set[str]:
    """Canonical norm weights (gamma) of the model: the layers' norms and the final norm."""
    return {name for name, kind in layer_kinds(config).items() if kind.norm_weight} | {FINAL_NORM_WEIGHT}


def _expert_local_name(config: ModelConfig, layer_prefix: str, local_expert: int, kind: TensorKind) -> str:
    if config.moe.moe_grouped_gemm:
        # TEGroupedMLP registers one parameter per local expert: ``linear_fc1.weight0``, ….
        module, _, param = kind.canonical.rpartition(".")
        return f"{layer_prefix}{EXPERTS_MODULE}{module}.{param}{local_expert}"
    return f"{layer_prefix}{EXPERT_PREFIX}{local_expert}.{kind.canonical}"


def provide(
    config: ModelConfig,
    groups: ProcessGroupCollection,
    padded_vocab_size: int | None = None,
    chunk: int | None = None,
) -> ModelShard:
    """Every tensor held by the rank ``groups`` is set to (by model chunk ``chunk`` with a virtual pipeline).

    ``padded_vocab_size`` is the global row count of the vocab tables at this layout; by default
    Megatron's padding of ``config.vocab_size``.
    """
    layout = groups.layout or ParallelLayout(tp=groups.tp.size(), pp=groups.pp.size(), ep=groups.ep.size())
    pp_size, pp_rank = groups.pp.size(), groups.pp.rank()
    chunks = layout.virtual_size
    chunk_index = _chunk_index(chunks, chunk)
    padded_vocab_size = _padded_rows(config, layout, padded_vocab_size, groups.tp.size())
    layers = layout.chunk_layers(config.num_layers, pp_rank, chunk_index)
    shard = ModelShard(tp_rank=groups.tp.rank(), pp_rank=pp_rank, layers=layers, ep_rank=groups.ep.rank(),
                       chunk=chunk)
    pre_process = pp_rank == 0 and chunk_index == 0
    post_process = pp_rank == pp_size - 1 and chunk_index == chunks - 1
    specs = _SpecAdder(shard, groups)
    vocab_shape = (padded_vocab_size, config.hidden_size)
    experts = _local_experts(config, groups.ep.size(), groups.ep.rank())
    if pre_process:  # a VL model's vision part (whole on every TP rank where Megatron-Bridge replicates it)
        for tensor in _vision_tensors(config):
            specs(tensor.name, tensor.name, tensor.shape, tensor.rule or REPLICATED)
    # The MTP stage (the last) holds its own copy of the embedding (GPTModel: pre_process or mtp_process).
    if pre_process or (post_process and config.mtp_num_layers):
        _add_embeddings(config, specs, vocab_shape)
    for local_index, layer in enumerate(layers):
        _add_layer(config, specs, config.layers[layer], f"{LAYER_PREFIX}{layer}.", f"{LAYER_PREFIX}{local_index}.",
                   experts)
    if post_process:
        _add_final_norm(config, specs)
        # MTP layers: stage-local indices equal global ones (they all live on the last stage).
        for index, spec in enumerate(config.mtp_layers):
            _add_layer(config, specs, spec, f"{MTP_PREFIX}{index}.", f"{MTP_PREFIX}{index}.", experts)
        _add_output(config, specs, vocab_shape, pre_process)
    return shard


def _chunk_index(chunks: int, chunk: int | None) -> int:
    """The model chunk asked for; ``None`` only where the layout has one chunk per stage."""
    if chunk is not None:
        return chunk
    if chunks != 1:
        raise LayoutError(f"provide: the layout has {chunks} model chunks per stage; pass chunk=")
    return 0


def _padded_rows(config: ModelConfig, layout: ParallelLayout, padded_vocab_size: int | None,
                 tp_size: int) -> int:
    """The vocab tables' global row count: the one given, else Megatron's padding of the vocab."""
    if padded_vocab_size is None:
        if config.vocab_size is None:
            raise LayoutError("vocab_size: unknown, and no padded vocab size was given")
        padded_vocab_size = layout.padded_vocab_size(config.vocab_size, config.make_vocab_size_divisible_by)
    if padded_vocab_size % tp_size:
        raise LayoutError(f"tp={tp_size}: padded vocab size {padded_vocab_size} is not divisible by {tp_size}")
    return padded_vocab_size


class _SpecAdder:
    """Appends the ``TensorSpec`` of a tensor to a shard, cut for the rank's TP (or expert TP) group."""

    def __init__(self, shard: ModelShard, groups: ProcessGroupCollection) -> None:
        self.shard = shard
        self.tp = (groups.tp.size(), groups.tp.rank())
        self.expert_tp = (groups.expt_tp.size(), groups.expt_tp.rank())

    def __call__(self, local_name: str, canonical: str, global_shape: tuple[int, ...], rule: ShardRule,
                 keep_dtype: bool = False, expert: bool = False) -> None:
        size, rank = self.expert_tp if expert else self.tp
        self.shard.specs.append(TensorSpec(
            local_name=local_name,
            canonical=canonical,
            global_shape=global_shape,
            local_shape=rule.local_shape(global_shape, size),
            rule=rule,
            tp_rank=rank,
            tp_size=size,
            keep_dtype=keep_dtype,
        ))


def _add_embeddings(config: ModelConfig, add: _SpecAdder, vocab_shape: tuple[int, int]) -> None:
    """The first stage's embeddings."""
    add(WORD_EMBEDDINGS, WORD_EMBEDDINGS, vocab_shape, VOCAB)
    positions = config.positions
    if positions.position_embedding_type == "learned_absolute":
        assert positions.max_position_embeddings is not None
        add(POSITION_EMBEDDINGS, POSITION_EMBEDDINGS, (positions.max_position_embeddings, config.hidden_size),
            REPLICATED)


def local_expert_count(config: ModelConfig, ep_size: int) -> int:
    """Routed experts per expert-parallel rank (EP rank r holds experts ``[r·n, (r+1)·n)``)."""
    return (config.moe.num_experts or 0) // ep_size


def _local_experts(config: ModelConfig, ep_size: int, ep_rank: int) -> range:
    experts_per_rank = local_expert_count(config, ep_size)
    return range(ep_rank * experts_per_rank, (ep_rank + 1) * experts_per_rank)


def _add_layer(config: ModelConfig, add: _SpecAdder, spec: LayerSpec | MTPLayerSpec, prefix: str, local_prefix: str,
               local_experts: range) -> None:
    """One layer's tensors, renamed from the canonical ``prefix`` to the rank's ``local_prefix``: the
    dense ones, and the routed experts in ``local_experts`` (numbered from 0 in the rank's file)."""
    for tensor in spec_tensors(config, spec, prefix):
        kind = tensor.kind
        if tensor.expert is None:
            add(local_prefix + tensor.local_path + kind.local_name(config), tensor.canonical, kind.shape(config),
                kind.rule_for(config), kind.keep_dtype)
        elif tensor.expert in local_experts:
            local = _expert_local_name(config, local_prefix + tensor.local_path, tensor.expert - local_experts.start,
                                       kind)
            add(local, tensor.canonical, kind.shape(config), kind.rule_for(config), expert=True)


def final_norm_local_name(config: ModelConfig, canonical: str) -> str:
    """How a rank file names the final norm's ``canonical`` tensor (a hybrid decoder's ``final_norm``)."""
    if config.hybrid_override_pattern is None:
        return canonical
    return HYBRID_FINAL_NORM + canonical.rpartition(".")[2]


def _add_final_norm(config: ModelConfig, add: _SpecAdder) -> None:
    """The last stage's final norm."""
    add(final_norm_local_name(config, FINAL_NORM_WEIGHT), FINAL_NORM_WEIGHT, (config.hidden_size,), REPLICATED)
    if config.has_norm_bias:
        add(final_norm_local_name(config, FINAL_NORM_BIAS), FINAL_NORM_BIAS, (config.hidden_size,), REPLICATED)


def _add_output(config: ModelConfig, add: _SpecAdder, vocab_shape: tuple[int, int], pre_process: bool) -> None:
    """The last stage's output layer."""
    if not config.tie_embeddings:
        add(OUTPUT_LAYER, OUTPUT_LAYER, vocab_shape, VOCAB)
    elif not pre_process:
        # megatron-core allocates its own output weight on the last stage and keeps it equal to
        # the first stage's embedding (the tied gradients are all-reduced between the two).
        add(OUTPUT_LAYER, WORD_EMBEDDINGS, vocab_shape, VOCAB)


# Transformer Engine ``_extra_state`` entries: every kind lists its modules (``LayerKind.te_modules``);
# a TE-spec target made from a source without them gets empty (None) entries.
def te_sharded_modules(config: ModelConfig, spec: LayerSpec) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The modules of a layer of spec ``spec`` whose ``_extra_state`` megatron-core's sharded state dict saves, in
    registration order: the layer's own (its kinds' in order), and each routed expert's (relative to the experts)."""
    own: list[str] = []
    experts: list[str] = []
    for kind in _kinds(spec):
        for row in kind.te_modules:
            if isinstance(row, RoutedExperts):
                experts += [module.name for module in row.rows if isinstance(module, TEModule)]
            elif isinstance(row, TEModule) and row.sharded and row.exists(config):
                own.append(row.name)
    return tuple(own), tuple(experts)


def te_extra_state_names(config: ModelConfig, layers: range, ep_size: int) -> list[str]:
    """``_extra_state`` keys (global layer, local expert index) of a TE-spec model's ``layers`` and of its MTP layers
    (which only the last chunk holds: a caller placing them keeps them there) at expert-parallel size ``ep_size``."""
    names = []
    for layer in layers:
        names += _te_names(config, config.layers[layer], f"{LAYER_PREFIX}{layer}.", ep_size)
    for index, spec in enumerate(config.mtp_layers):
        names += _te_names(config, spec, f"{MTP_PREFIX}{index}.", ep_size)
    return names


def _te_names(config: ModelConfig, spec: LayerSpec | MTPLayerSpec, prefix: str, ep_size: int) -> list[str]:
    return [name for kind in _kinds(spec) for row in kind.te_modules
            for name in _te_row_names(config, spec, row, prefix, ep_size)]


def _te_row_names(config: ModelConfig, spec: LayerSpec | MTPLayerSpec, row: TERow, prefix: str,
                  ep_size: int) -> list[str]:
    """The ``_extra_state`` keys of one TE table row: a module, the routed experts' (one module per
    linear with grouped GEMM, else one per local expert), or an inner layer's."""
    if isinstance(row, RoutedExperts):
        linears = [module.name for module in row.rows if isinstance(module, TEModule)]
        if config.moe.moe_grouped_gemm:
            return [f"{prefix}{EXPERTS_MODULE}{linear}{EXTRA_STATE_SUFFIX}" for linear in linears]
        return [f"{prefix}{EXPERT_PREFIX}{j}.{linear}{EXTRA_STATE_SUFFIX}"
                for j in range(local_expert_count(config, ep_size)) for linear in linears]
    if isinstance(row, InnerLayer):
        assert isinstance(spec, MTPLayerSpec)
        return _te_names(config, spec.inner, prefix + row.module, ep_size)
    return [prefix + row.name + EXTRA_STATE_SUFFIX] if row.exists(config) else []


# GPTModel's top-level modules: every model key starts with one of them.
MODEL_MODULE_PREFIXES = ("embedding.", "decoder.", "output_layer.", "mtp.", *VISION_MODULES)
# Where a non-layer module lives: its entries go to the first or the last pipeline chunk.
_FIRST_CHUNK_PREFIXES = ("embedding.", *VISION_MODULES)
_LAST_CHUNK_PREFIXES = ("output_layer.", "decoder.final_layernorm.", HYBRID_FINAL_NORM, MTP_PREFIX)


def non_layer_chunk(name: str) -> str | None:
    """``"first"`` or ``"last"``: the chunk that owns a non-layer entry; None for an unknown module."""
    if name.startswith(_FIRST_CHUNK_PREFIXES):
        return "first"
    if name.startswith(_LAST_CHUNK_PREFIXES):
        return "last"
    return None


def is_routed_expert(name: str) -> bool:
    """Whether a layer name (canonical or rank-local, a weight or an ``_extra_state``) belongs to a
    routed expert (named by a local expert index in a rank file, so its meaning changes with EP)."""
    parsed = canonical_layer(name) or mtp_layer(name)
    return parsed is not None and parsed[1].startswith(EXPERTS_MODULE)


def mtp_layer(name: str) -> tuple[int, str] | None:
    """``mtp.layers.{i}.transformer_layer.rest`` (or ``mtp_model_layer.rest``) → (i, rest);
    None for other names."""
    if not name.startswith(MTP_PREFIX):
        return None
    index, _, rest = name[len(MTP_PREFIX):].partition(".")
    module = next((f"{m}." for m in MTP_LAYER_MODULES if rest.startswith(f"{m}.")), None)
    if not index.isdigit() or module is None:
        return None
    return int(index), rest[len(module):]


def canonical_layer(name: str) -> tuple[int, str] | None:
    """``decoder.layers.{L}.rest`` → (L, rest); None for non-layer names."""
    if not name.startswith(LAYER_PREFIX):
        return None
    index, _, rest = name[len(LAYER_PREFIX):].partition(".")
    if not index.isdigit() or not rest:
        return None
    return int(index), rest


# TEGroupedMLP's per-expert parameter (``linear_fc1.weight{j}``); Megatron-FSDP's store splits a gated one into
# ``weight{j}_w`` and ``weight{j}_v``.
GROUPED_EXPERT_RE = re.compile(r"\.mlp\.experts\.linear_fc[12]\.weight(\d+)(?:_w|_v)?$")


def expert_of_key(key: str) -> tuple[str, int] | None:
    """(the layer's key prefix, the expert index) of a routed expert's key: ``….mlp.experts.local_experts.{j}.…``
    (SequentialMLP) or ``….mlp.experts.linear_fc1.weight{j}`` (TEGroupedMLP); None for other keys. The index is
    the rank's own in a Megatron rank file, the global one in a store that holds every expert."""
    layer, found, rest = key.partition("." + EXPERT_PREFIX)
    if found:
        index = rest.partition(".")[0]
        return (layer, int(index)) if index.isdigit() else None
    grouped = GROUPED_EXPERT_RE.search(key)
    return (key[:grouped.start()], int(grouped.group(1))) if grouped is not None else None


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
