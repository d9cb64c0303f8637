"""The model provider: which tensors, of which shapes, live on one rank.

``provide(config, groups)`` answers for the rank the collection is set to. Every tensor of a GPT
layer is a row of ``ATTENTION_TENSORS`` plus ``DENSE_MLP_TENSORS`` or (MoE layers) ``MOE_TENSORS`` and
``EXPERT_TENSORS`` per routed expert: canonical (global) name, the Transformer-Engine-spec local name
where it differs, global shape, TP rule and when it exists.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from pgconvert.io import sizes
from pgconvert.model.config import MTP_LAYER_MODULES, ModelConfig
from pgconvert.errors import LayoutError
from pgconvert.model.grid import ProcessGroupCollection
from pgconvert.model.layout import ParallelLayout
from pgconvert.model.rules import COLUMN, GATED, REPLICATED, ROW, VOCAB, ShardRule

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


def _pre_norm(config: ModelConfig) -> bool:
    return config.pre_layernorms


def _pre_norm_bias(config: ModelConfig) -> bool:
    return config.pre_layernorms and config.normalization == "LayerNorm"


def _post_attention_norm(config: ModelConfig) -> bool:
    return config.post_self_attn_layernorm


def _post_mlp_norm(config: ModelConfig) -> bool:
    return config.post_mlp_layernorm


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
    keep_dtype: bool = False
    # A norm's weight (gamma): megatron-core's --apply-layernorm-1p computes with 1 + gamma.
    norm_weight: bool = False
    # How the rows carry rotary dims: "head" (the dims of one head: q/k norms) or "qkv" (the fused
    # q, k and v heads of each query group); None: no rotary rows.
    rotary: str | None = None

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


def _q_norm_shape(c: ModelConfig) -> tuple[int, ...]:
    """Per head, or (f17b) over every query head, replicated in HF's head order as Megatron-Bridge's
    OLMoESelfAttention holds it (src/megatron/bridge/models/olmoe/olmoe_provider.py)."""
    return (c.num_attention_heads * c.head_dim,) if c.qk_layernorm_across_heads else (c.head_dim,)


def _k_norm_shape(c: ModelConfig) -> tuple[int, ...]:
    return (c.query_groups * c.head_dim,) if c.qk_layernorm_across_heads else (c.head_dim,)


def _fc1_shape(c: ModelConfig) -> tuple[int, ...]:
    return (c.fc1_rows, c.hidden_size)


def _shared_fc1_rule(config: ModelConfig) -> ShardRule:
    return GATED if config.gated_linear_unit else COLUMN


def _shared_experts(config: ModelConfig) -> bool:
    return config.moe_shared_expert_intermediate_size is not None


def _shared_gate(config: ModelConfig) -> bool:
    return _shared_experts(config) and config.moe_shared_expert_gate


def _expert_bias(config: ModelConfig) -> bool:
    return config.moe_router_enable_expert_bias


def _sinks(config: ModelConfig) -> bool:
    return config.softmax_type == "learnable"


def _expert_fc1_rows(c: ModelConfig) -> int:
    return c.expert_ffn_size * (2 if c.gated_linear_unit else 1)


def _shared_rows(c: ModelConfig) -> int:
    assert c.moe_shared_expert_intermediate_size is not None
    return c.moe_shared_expert_intermediate_size * (2 if c.gated_linear_unit else 1)


# The Transformer Engine spec fuses the input and pre-MLP norms into the following linear
# (TELayerNormColumnParallelLinear): (local-spec module prefix, the TE spec's fused prefix), relative
# to a layer. megatron-core's local spec keeps separate norms but saves them under the fused names in
# a torch_dist checkpoint (its sharded_state_dict_keys_map), MoE layers included; TE-spec MoE layers
# have no linear to fuse the pre-MLP norm into and keep ``pre_mlp_layernorm.*`` everywhere.
FUSED_NORM_NAMES: tuple[tuple[str, str], ...] = (
    ("input_layernorm.", "self_attention.linear_qkv.layer_norm_"),
    ("pre_mlp_layernorm.", "mlp.linear_fc1.layer_norm_"),
)


def fused_norm_name(rest: str) -> str | None:
    """A layer tensor's name (relative to its layer) under the TE spec's fused norm naming; None
    for a tensor that is not one of the fused norms."""
    for local, fused in FUSED_NORM_NAMES:
        if rest.startswith(local):
            return fused + rest[len(local):]
    return None


def layer_spec_of_key(key: str) -> str | None:
    """``"transformer_engine"`` for a layer key under a TE fused norm name, ``"local"`` for one under
    the input norm's separate name (present in every layer of the local spec), else None."""
    parsed = canonical_layer(key)
    if parsed is None:
        return None
    rest = parsed[1]
    if any(rest.startswith(fused) for _, fused in FUSED_NORM_NAMES):
        return "transformer_engine"
    return "local" if rest.startswith(FUSED_NORM_NAMES[0][0]) else None


# Per-layer tensors, names relative to ``decoder.layers.{L}.``; the TE spec's names of the fused
# norms come from ``FUSED_NORM_NAMES``.
ATTENTION_TENSORS: tuple[TensorKind, ...] = (
    TensorKind("input_layernorm.weight", _hidden, REPLICATED, _pre_norm,
               te_name=fused_norm_name("input_layernorm.weight"), norm_weight=True),
    TensorKind("input_layernorm.bias", _hidden, REPLICATED, _pre_norm_bias,
               te_name=fused_norm_name("input_layernorm.bias")),
    TensorKind("self_attention.linear_qkv.weight", lambda c: (c.qkv_rows, c.hidden_size), COLUMN, rotary="qkv"),
    TensorKind("self_attention.linear_qkv.bias", lambda c: (c.qkv_rows,), COLUMN, _qkv_bias, rotary="qkv"),
    TensorKind("self_attention.q_layernorm.weight", _q_norm_shape, REPLICATED, _qk_norm, norm_weight=True,
               rotary="head"),
    TensorKind("self_attention.q_layernorm.bias", _q_norm_shape, REPLICATED, _qk_norm_bias),
    TensorKind("self_attention.k_layernorm.weight", _k_norm_shape, REPLICATED, _qk_norm, norm_weight=True,
               rotary="head"),
    TensorKind("self_attention.k_layernorm.bias", _k_norm_shape, REPLICATED, _qk_norm_bias),
    TensorKind("self_attention.linear_proj.weight",
               lambda c: (c.hidden_size, c.num_attention_heads * c.head_dim), ROW),
    TensorKind("self_attention.linear_proj.bias", _hidden, REPLICATED, _bias),
    # f17b: Megatron-Bridge's post-attention norm, a TENorm inside its TERowParallelLinearLayerNorm
    # linear_proj (NVIDIA-NeMo/Megatron-Bridge src/megatron/bridge/models/gemma/gemma3_provider.py).
    TensorKind("self_attention.linear_proj.post_layernorm.weight", _hidden, REPLICATED, _post_attention_norm, norm_weight=True),
    # f17c: attention sinks, one logit per head, split over TP with the heads (megatron-core's
    # DotProductAttention.sharded_state_dict: {'softmax_offset': 0}).
    TensorKind("self_attention.core_attention.softmax_offset", lambda c: (c.num_attention_heads,), COLUMN,
               _sinks),
)


def _q_lora(config: ModelConfig) -> bool:
    return config.q_lora_rank is not None


def _no_q_lora(config: ModelConfig) -> bool:
    return config.q_lora_rank is None


def _down_proj_rule(config: ModelConfig) -> ShardRule:
    """megatron-core's MLA down projections: ``backend.linear()``, a ColumnParallelLinear in the local
    spec (output rows split, gathered in the forward) and TELinear ``parallel_mode='duplicated'``
    (every rank the whole weight) in the Transformer Engine spec."""
    return REPLICATED if config.transformer_impl == "transformer_engine" else COLUMN


def _q_rows(c: ModelConfig) -> int:
    return c.num_attention_heads * c.q_head_dim


# Multi-latent attention (megatron-core's MLASelfAttention). The input norm is its own module in both
# specs; the TE spec fuses the q/kv latent norms into the up projections (TELayerNormColumnParallelLinear).
MLA_ATTENTION_TENSORS: tuple[TensorKind, ...] = (
    TensorKind("input_layernorm.weight", _hidden, REPLICATED),
    TensorKind("self_attention.linear_q_proj.weight", lambda c: (_q_rows(c), c.hidden_size), COLUMN, _no_q_lora),
    TensorKind("self_attention.linear_q_down_proj.weight", lambda c: (c.q_lora_rank or 0, c.hidden_size),
               _down_proj_rule, _q_lora),
    TensorKind("self_attention.q_layernorm.weight", lambda c: (c.q_lora_rank or 0,), REPLICATED, _q_lora,
               te_name="self_attention.linear_q_up_proj.layer_norm_weight"),
    TensorKind("self_attention.linear_q_up_proj.weight", lambda c: (_q_rows(c), c.q_lora_rank or 0), COLUMN,
               _q_lora),
    TensorKind("self_attention.linear_kv_down_proj.weight",
               lambda c: (c.kv_lora_rank + c.qk_pos_emb_head_dim, c.hidden_size), _down_proj_rule),
    TensorKind("self_attention.kv_layernorm.weight", lambda c: (c.kv_lora_rank,), REPLICATED,
               te_name="self_attention.linear_kv_up_proj.layer_norm_weight"),
    TensorKind("self_attention.linear_kv_up_proj.weight",
               lambda c: (c.num_attention_heads * (c.qk_head_dim + c.v_head_dim), c.kv_lora_rank), COLUMN),
    TensorKind("self_attention.linear_proj.weight",
               lambda c: (c.hidden_size, c.num_attention_heads * c.v_head_dim), ROW),
)


def attention_tensors(config: ModelConfig) -> tuple[TensorKind, ...]:
    return MLA_ATTENTION_TENSORS if config.multi_latent_attention else ATTENTION_TENSORS


DENSE_MLP_TENSORS: tuple[TensorKind, ...] = (
    TensorKind("pre_mlp_layernorm.weight", _hidden, REPLICATED, _pre_norm,
               te_name=fused_norm_name("pre_mlp_layernorm.weight"), norm_weight=True),
    TensorKind("pre_mlp_layernorm.bias", _hidden, REPLICATED, _pre_norm_bias,
               te_name=fused_norm_name("pre_mlp_layernorm.bias")),
    TensorKind("mlp.linear_fc1.weight", _fc1_shape, _fc1_rule),
    TensorKind("mlp.linear_fc1.bias", lambda c: (c.fc1_rows,), _fc1_rule, _bias),
    TensorKind("mlp.linear_fc2.weight", lambda c: (c.hidden_size, c.ffn_hidden_size), ROW),
    TensorKind("mlp.linear_fc2.bias", _hidden, REPLICATED, _bias),
    # f17b: the post-MLP norm, inside linear_fc2 as Megatron-Bridge's Gemma 2/3 specs place it.
    TensorKind("mlp.linear_fc2.post_layernorm.weight", _hidden, REPLICATED, _post_mlp_norm, norm_weight=True),
)
# An MoE layer's pre-MLP norm is a separate module in both specs (nothing to fuse it into). The
# router and its expert bias stay in their own dtype (float32 in megatron-core) whatever --dtype says.
# An MoE layer's own tensors: those stored before its routed experts (norm, router), then after.
MOE_TENSORS_BEFORE_EXPERTS: tuple[TensorKind, ...] = (
    TensorKind("pre_mlp_layernorm.weight", _hidden, REPLICATED, norm_weight=True),
    TensorKind("pre_mlp_layernorm.bias", _hidden, REPLICATED, _layernorm),
    TensorKind("mlp.router.weight", lambda c: (c.num_experts or 0, c.hidden_size), REPLICATED, keep_dtype=True),
    # f17c: the router's bias (megatron-core's TopKRouter with add_bias_linear; GPT-OSS).
    TensorKind("mlp.router.bias", lambda c: (c.num_experts or 0,), REPLICATED, _bias),
    TensorKind("mlp.router.expert_bias", lambda c: (c.num_experts or 0,), REPLICATED, _expert_bias,
               keep_dtype=True),
)
MOE_TENSORS_AFTER_EXPERTS: tuple[TensorKind, ...] = (
    TensorKind("mlp.shared_experts.linear_fc1.weight", lambda c: (_shared_rows(c), c.hidden_size),
               _shared_fc1_rule, _shared_experts),
    TensorKind("mlp.shared_experts.linear_fc2.weight",
               lambda c: (c.hidden_size, c.moe_shared_expert_intermediate_size or 0), ROW, _shared_experts),
    TensorKind("mlp.shared_experts.gate_weight", lambda c: (1, c.hidden_size), REPLICATED, _shared_gate),
)
MOE_TENSORS = MOE_TENSORS_BEFORE_EXPERTS + MOE_TENSORS_AFTER_EXPERTS
# One routed expert, relative to ``mlp.experts.local_experts.{E}.`` (E global in canonical names).
EXPERT_TENSORS: tuple[TensorKind, ...] = (
    TensorKind("linear_fc1.weight",
               lambda c: (c.expert_ffn_size * (2 if c.gated_linear_unit else 1), c.hidden_size), _fc1_rule),
    # f17c: expert biases (add_bias_linear, GPT-OSS): fc1's split like its rows, fc2's whole on every rank.
    TensorKind("linear_fc1.bias", lambda c: (_expert_fc1_rows(c),), _fc1_rule, _bias),
    TensorKind("linear_fc2.weight", lambda c: (c.hidden_size, c.expert_ffn_size), ROW),
    TensorKind("linear_fc2.bias", _hidden, REPLICATED, _bias),
)
# Every routed expert's module lives under this, relative to a layer: ``local_experts.{E}.`` of
# SequentialMLP and the grouped-GEMM ``linear_fc1``/``linear_fc2`` of TEGroupedMLP alike.
EXPERTS_MODULE = "mlp.experts."
EXPERT_PREFIX = EXPERTS_MODULE + "local_experts."

WORD_EMBEDDINGS = "embedding.word_embeddings.weight"
POSITION_EMBEDDINGS = "embedding.position_embeddings.weight"
OUTPUT_LAYER = "output_layer.weight"
# Tables with one row per token: Megatron pads them to a multiple of make_vocab_size_divisible_by × tp.
VOCAB_TABLES: frozenset[str] = frozenset({WORD_EMBEDDINGS, OUTPUT_LAYER})
FINAL_NORM_WEIGHT = "decoder.final_layernorm.weight"
FINAL_NORM_BIAS = "decoder.final_layernorm.bias"


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
    """One tensor of one layer: its canonical name, table row, and routed-expert index if any."""

    canonical: str
    kind: TensorKind
    expert: int | None = None


def layer_tensors(config: ModelConfig, layer: int) -> list[LayerTensor]:
    """Canonical tensors of one layer with their table rows, in file order."""
    return _block_tensors(config, f"{LAYER_PREFIX}{layer}.", config.is_moe_layer(layer))


def _block_tensors(config: ModelConfig, prefix: str, moe: bool) -> list[LayerTensor]:
    """A transformer layer's tensors under ``prefix`` (a decoder layer or an MTP layer's)."""
    if not moe:
        return [LayerTensor(prefix + kind.canonical, kind) for kind in attention_tensors(config) + DENSE_MLP_TENSORS
                if kind.exists(config)]
    assert config.num_experts is not None
    before = [LayerTensor(prefix + kind.canonical, kind)
              for kind in attention_tensors(config) + MOE_TENSORS_BEFORE_EXPERTS if kind.exists(config)]
    experts = [
        LayerTensor(f"{prefix}{EXPERT_PREFIX}{expert}.{kind.canonical}", kind, expert)
        for expert in range(config.num_experts)
        for kind in EXPERT_TENSORS
        if kind.exists(config)
    ]
    after = [LayerTensor(prefix + kind.canonical, kind) for kind in MOE_TENSORS_AFTER_EXPERTS if kind.exists(config)]
    return before + experts + after


# mtp: megatron-core's MultiTokenPredictionLayer (transformer/multi_token_prediction.py, 0.16.1), all on
# the last pipeline stage (its last model chunk), numbered from 0: ``mtp.layers.{i}.`` enorm, hnorm
# (the norm of the next token's embedding and of the hidden state), eh_proj (a ColumnParallelLinear
# [hidden, 2·hidden], gather_output=False: rows split by TP, input cat(enorm(emb), hnorm(hidden))), its
# transformer_layer (the last decoder layer's spec: MLA, router, experts and EP as a decoder layer), and
# final_layernorm; it has no embedding or output layer of its own (it uses the model's).
MTP_PREFIX = "mtp.layers."
MTP_LAYER_MODULE = MTP_LAYER_MODULES[0] + "."  # megatron-core 0.16.1's, the canonical spelling (mlafix)
MTP_EH_PROJ = "eh_proj"
MTP_BEFORE_LAYER: tuple[TensorKind, ...] = (
    TensorKind("enorm.weight", _hidden, REPLICATED, norm_weight=True),
    TensorKind("enorm.bias", _hidden, REPLICATED, _layernorm),
    TensorKind("hnorm.weight", _hidden, REPLICATED, norm_weight=True),
    TensorKind("hnorm.bias", _hidden, REPLICATED, _layernorm),
    TensorKind(MTP_EH_PROJ + ".weight", lambda c: (c.hidden_size, 2 * c.hidden_size), COLUMN),
)
MTP_AFTER_LAYER: tuple[TensorKind, ...] = (
    TensorKind("final_layernorm.weight", _hidden, REPLICATED, norm_weight=True),
    TensorKind("final_layernorm.bias", _hidden, REPLICATED, _layernorm),
)


def mtp_layer_is_moe(config: ModelConfig) -> bool:
    """Megatron-LM builds the MTP layer with the last decoder layer's spec (gpt_builders)."""
    return config.is_moe_layer(config.num_layers - 1)


def mtp_layer_tensors(config: ModelConfig, index: int) -> list[LayerTensor]:
    """Canonical tensors of MTP layer ``index`` with their table rows, in file order."""
    prefix = f"{MTP_PREFIX}{index}."
    own = [LayerTensor(prefix + kind.canonical, kind) for kind in MTP_BEFORE_LAYER if kind.exists(config)]
    layer = _block_tensors(config, prefix + MTP_LAYER_MODULE, mtp_layer_is_moe(config))
    after = [LayerTensor(prefix + kind.canonical, kind) for kind in MTP_AFTER_LAYER if kind.exists(config)]
    return own + layer + after


def mtp_tensors(config: ModelConfig) -> list[LayerTensor]:
    """Every MTP layer's tensors, in file order."""
    return [tensor for index in range(config.mtp_num_layers) for tensor in mtp_layer_tensors(config, index)]


def canonical_names(config: ModelConfig) -> list[str]:
    """Every global tensor of the model, in layer order (the canonical stream's order)."""
    names = [WORD_EMBEDDINGS]
    if config.position_embedding_type == "learned_absolute":
        names.append(POSITION_EMBEDDINGS)
    for layer in range(config.num_layers):
        names.extend(tensor.canonical for tensor in layer_tensors(config, layer))
    names.append(FINAL_NORM_WEIGHT)
    if config.normalization == "LayerNorm":
        names.append(FINAL_NORM_BIAS)
    names.extend(tensor.canonical for tensor in mtp_tensors(config))  # mtp: GPTModel registers mtp here
    if not config.tie_embeddings:
        names.append(OUTPUT_LAYER)
    return names


def canonical_shapes(config: ModelConfig, vocab_rows: int | None = None) -> dict[str, tuple[int, ...]]:
    """Global shape of every canonical tensor, in stream order; vocab tables get ``vocab_rows``
    rows (by default the true vocab size)."""
    rows = vocab_rows if vocab_rows is not None else config.vocab_size
    if rows is None:
        raise LayoutError("vocab_size: unknown; the true vocab size is needed (pass --true-vocab-size)")
    hidden = config.hidden_size
    shapes: dict[str, tuple[int, ...]] = {
        WORD_EMBEDDINGS: (rows, hidden),
        OUTPUT_LAYER: (rows, hidden),
        FINAL_NORM_WEIGHT: (hidden,),
        FINAL_NORM_BIAS: (hidden,),
    }
    if config.max_position_embeddings is not None:
        shapes[POSITION_EMBEDDINGS] = (config.max_position_embeddings, hidden)
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
    if config.moe_grouped_gemm:
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
    # mtp: the MTP stage (the last) holds its own copy of the embedding (GPTModel: pre_process or mtp_process).
    if pre_process or (post_process and config.mtp_num_layers):
        _add_embeddings(config, specs, vocab_shape)
    _add_layers(config, specs, layers, groups.ep.size(), groups.ep.rank())
    if post_process:
        _add_final_norm(config, specs)
        _add_mtp(config, specs, groups.ep.size(), groups.ep.rank())
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
    if config.position_embedding_type == "learned_absolute":
        assert config.max_position_embeddings is not None
        add(POSITION_EMBEDDINGS, POSITION_EMBEDDINGS,
            (config.max_position_embeddings, config.hidden_size), REPLICATED)


def local_expert_count(config: ModelConfig, ep_size: int) -> int:
    """Routed experts per expert-parallel rank (EP rank r holds experts ``[r·n, (r+1)·n)``)."""
    return (config.num_experts or 0) // ep_size


def _add_layers(config: ModelConfig, add: _SpecAdder, layers: range, ep_size: int, ep_rank: int) -> None:
    """The tensors of ``layers``: dense ones, and the experts local to EP rank ``ep_rank``."""
    for local_index, layer in enumerate(layers):
        _add_block(config, add, layer_tensors(config, layer), f"{LAYER_PREFIX}{layer}.",
                   f"{LAYER_PREFIX}{local_index}.", _local_experts(config, ep_size, ep_rank))


def _local_experts(config: ModelConfig, ep_size: int, ep_rank: int) -> range:
    experts_per_rank = local_expert_count(config, ep_size)
    return range(ep_rank * experts_per_rank, (ep_rank + 1) * experts_per_rank)


def _add_block(config: ModelConfig, add: _SpecAdder, tensors: list[LayerTensor], prefix: str, local_prefix: str,
               local_experts: range) -> None:
    """One layer's tensors, renamed from the canonical ``prefix`` to the rank's ``local_prefix``."""
    for tensor in tensors:
        kind = tensor.kind
        rest = tensor.canonical[len(prefix):]
        if tensor.expert is None:
            local = local_prefix + rest[:len(rest) - len(kind.canonical)] + kind.local_name(config)
            add(local, tensor.canonical, kind.shape(config), kind.rule_for(config), kind.keep_dtype)
        elif tensor.expert in local_experts:
            head = rest[:rest.index(EXPERTS_MODULE)]
            local = _expert_local_name(config, local_prefix + head, tensor.expert - local_experts.start, kind)
            add(local, tensor.canonical, kind.shape(config), kind.rule_for(config), expert=True)


def _add_mtp(config: ModelConfig, add: _SpecAdder, ep_size: int, ep_rank: int) -> None:
    """mtp: the MTP layers (stage-local indices equal global ones: they all live on the last stage); the
    inner layer under the config's spelling (mlafix: ``mtp_layer_module``), canonically ``transformer_layer``."""
    experts = _local_experts(config, ep_size, ep_rank)
    for index in range(config.mtp_num_layers):
        prefix = f"{MTP_PREFIX}{index}."
        inner, local_inner = prefix + MTP_LAYER_MODULE, f"{prefix}{config.mtp_layer_module}."
        for tensor in mtp_layer_tensors(config, index):
            if tensor.canonical.startswith(inner):
                _add_block(config, add, [tensor], inner, local_inner, experts)
            else:
                _add_block(config, add, [tensor], prefix, prefix, experts)


def _add_final_norm(config: ModelConfig, add: _SpecAdder) -> None:
    """The last stage's final norm."""
    add(FINAL_NORM_WEIGHT, FINAL_NORM_WEIGHT, (config.hidden_size,), REPLICATED)
    if config.normalization == "LayerNorm":
        add(FINAL_NORM_BIAS, FINAL_NORM_BIAS, (config.hidden_size,), REPLICATED)


def _add_output(config: ModelConfig, add: _SpecAdder, vocab_shape: tuple[int, int], pre_process: bool) -> None:
    """The last stage's output layer."""
    if not config.tie_embeddings:
        add(OUTPUT_LAYER, OUTPUT_LAYER, vocab_shape, VOCAB)
    elif not pre_process:
        # megatron-core allocates its own output weight on the last stage and keeps it equal to
        # the first stage's embedding (the tied gradients are all-reduced between the two).
        add(OUTPUT_LAYER, WORD_EMBEDDINGS, vocab_shape, VOCAB)


# Modules of a layer whose Transformer Engine state dict carries an ``_extra_state`` entry (FP8
# metadata), in state-dict order; a TE-spec target made from a source without them gets empty (None)
# entries. megatron-core's torch_dist checkpoint saves none for the core attention
# (TEDotProductAttention.sharded_state_dict): see torch_dist_format.extra_state_keys.
EXTRA_STATE_SUFFIX = "._extra_state"
TE_CORE_ATTENTION = "self_attention.core_attention"
TE_ATTENTION_LINEARS = ("self_attention.linear_proj", "self_attention.linear_qkv")
# MLASelfAttention registers linear_proj (in MultiLatentAttention) before its projections.
TE_MLA_Q_LINEARS = ("self_attention.linear_q_down_proj", "self_attention.linear_q_up_proj")
TE_MLA_KV_LINEARS = ("self_attention.linear_kv_down_proj", "self_attention.linear_kv_up_proj")


def te_attention_linears(config: ModelConfig) -> tuple[str, ...]:
    """The attention modules of a TE-spec layer that carry ``_extra_state``, in registration order."""
    if not config.multi_latent_attention:
        return TE_ATTENTION_LINEARS
    q = TE_MLA_Q_LINEARS if config.q_lora_rank is not None else ("self_attention.linear_q_proj",)
    return ("self_attention.linear_proj", *q, *TE_MLA_KV_LINEARS)


TE_DENSE_MLP_LINEARS = ("mlp.linear_fc1", "mlp.linear_fc2")
TE_SHARED_EXPERT_LINEARS = ("mlp.shared_experts.linear_fc1", "mlp.shared_experts.linear_fc2")
TE_EXPERT_LINEARS = ("linear_fc1", "linear_fc2")


def te_extra_state_names(config: ModelConfig, layers: range, ep_size: int) -> list[str]:
    """``_extra_state`` keys (global layer, local expert index) a TE-spec model chunk holds at
    expert-parallel size ``ep_size``."""
    names = []
    for layer in layers:
        names += _te_layer_extra_state_names(config, f"{LAYER_PREFIX}{layer}.", config.is_moe_layer(layer), ep_size)
    return names


def te_mtp_extra_state_names(config: ModelConfig, ep_size: int) -> list[str]:
    """mtp: the ``_extra_state`` keys of a TE-spec model's MTP layers (eh_proj, a TEColumnParallelLinear,
    then its transformer layer's modules), on the last chunk only."""
    names = []
    for index in range(config.mtp_num_layers):
        prefix = f"{MTP_PREFIX}{index}."
        names.append(prefix + MTP_EH_PROJ + EXTRA_STATE_SUFFIX)
        names += _te_layer_extra_state_names(config, prefix + MTP_LAYER_MODULE, mtp_layer_is_moe(config), ep_size)
    return names


def _te_layer_extra_state_names(config: ModelConfig, prefix: str, moe: bool, ep_size: int) -> list[str]:
    modules = (TE_CORE_ATTENTION, *te_attention_linears(config))
    if not moe:
        return [prefix + module + EXTRA_STATE_SUFFIX for module in modules + TE_DENSE_MLP_LINEARS]
    names = [prefix + module + EXTRA_STATE_SUFFIX for module in modules]
    if config.moe_grouped_gemm:
        names += [f"{prefix}{EXPERTS_MODULE}{fc}{EXTRA_STATE_SUFFIX}" for fc in TE_EXPERT_LINEARS]
    else:
        names += [f"{prefix}{EXPERT_PREFIX}{j}.{fc}{EXTRA_STATE_SUFFIX}"
                  for j in range(local_expert_count(config, ep_size)) for fc in TE_EXPERT_LINEARS]
    if _shared_experts(config):
        names += [prefix + module + EXTRA_STATE_SUFFIX for module in TE_SHARED_EXPERT_LINEARS]
    return names


# GPTModel's top-level modules: every model key starts with one of them.
MODEL_MODULE_PREFIXES = ("embedding.", "decoder.", "output_layer.", "mtp.")
# Where a non-layer module lives: its entries go to the first or the last pipeline chunk.
_FIRST_CHUNK_PREFIXES = ("embedding.",)
_LAST_CHUNK_PREFIXES = ("output_layer.", "decoder.final_layernorm.", MTP_PREFIX)


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
    """mtp: ``mtp.layers.{i}.transformer_layer.rest`` (or mlafix: ``mtp_model_layer.rest``) → (i, rest);
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
