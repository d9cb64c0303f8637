"""Which parameter each position of a Megatron optimizer's state is, per rank, played on the fake grid.

megatron-core's plain (non-distributed) optimizer is a ``torch.optim`` optimizer over the param
groups of ``megatron/core/optimizer/__init__.py::_get_param_groups``: it walks every model chunk of
the rank in order, and each chunk's ``named_parameters()`` (module registration order), and puts each
trainable parameter in the group of its overrides key; the keys are sorted with ``None`` first. With
the standard overrides (``get_standard_config_overrides``: ``wd_mult=0.0`` for 1-dim parameters and
names ending in ``.bias``; with ``apply_wd_to_qk_layernorm`` the q/k layernorms keep weight decay)
a dense model has two groups on every rank (the keys are all-gathered, so a rank without a no-decay
parameter still has the empty group): group 0 weight decay, group 1 no weight decay (``decoupled_lr``
adds one between them, below).
``optimizer.state`` is indexed by the position in the concatenation of the groups' ``params``.

Reproduced for megatron-core 0.16.1 (pip) and 0.20.0 (Megatron-LM ``d98e8a64``), which build the
groups the same way, for GPT models with megatron-core's local spec and its Transformer Engine
spec, whose parameters are the same modules' but for the fused norms (``linear_qkv.layer_norm_weight``
registered before ``linear_qkv.weight``; TE's own parameter order, read from its source, since TE is
not installed here). Refused, naming the field: grouped-GEMM experts other than TEGroupedMLP's (below),
any parameter name whose place is not known, and any state whose group sizes or tensor shapes do not match.

``decoupled_lr`` (and ``decoupled_min_lr``): the standard overrides add ``{"max_lr": decoupled_lr[, "min_lr":
decoupled_min_lr]}`` for the parameters flagged ``is_embedding_or_output_parameter``
(``LanguageModule.setup_embeddings_and_output_layer``: the word embedding where ``pre_process``, the first
stage's first model chunk; ``output_layer.weight`` where it exists, so not a last stage's MTP copy of the
embedding). Keys sort ``None`` first, then as tuples, and ``("max_lr", …)`` sorts before ``("wd_mult", 0.0)``: the
dense optimizer's groups are weight decay, decoupled LR, no weight decay, the middle one empty on ranks without
those parameters (the keys are all-gathered). Both flagged parameters are 2-dim, so no parameter combines the two
overrides. The group keeps ``is_decoupled_lr`` False in 0.16.1 (the override only sets ``max_lr``/``min_lr``).

Grouped-GEMM experts: with the Transformer Engine spec, ``--moe-grouped-gemm`` builds TEGroupedMLP
(megatron/core/transformer/moe/experts.py, 0.16.1 and 0.20.0), which registers ``linear_fc1`` then
``linear_fc2``, each a TEColumnParallelGroupedLinear / TERowParallelGroupedLinear (extensions/
transformer_engine.py) over ``te.pytorch.GroupedLinear``. GroupedLinear.__init__ registers, per local expert
``i`` in one loop, ``weight{i}`` then (``bias=add_bias_linear``) ``bias{i}``
(transformer_engine/pytorch/module/grouped_linear.py: v2.9 lines 646-678, v2.18 lines 1450-1482, d0067d0 lines
1738-1770, the same loop since v1.9); ``reset_parameters`` re-sets each name in place, which keeps the order.
So a MoE layer's experts are ``linear_fc1.weight0, bias0, weight1, …`` then ``linear_fc2.…``, where
SequentialMLP has ``local_experts.0.linear_fc1.weight, …, local_experts.1.…``. Their ``allreduce`` is
SequentialMLP's: ``not (is_expert and expert_model_parallel_size > 1)`` (TEGroupedLinear.__init__, 0.16.1;
0.20.0's ``_set_expert_parameter_attributes`` and ColumnParallelLinear alike add ``expert_tensor_parallel_size
!= tensor_model_parallel_size``), so they form the expert-parallel optimizer and DDP buffers at EP > 1; the
buffers follow this ``named_parameters()`` order as for every module (``flat.flat_buffers``). Their torch_dist keys
are SequentialMLP's (TEGroupedLinear._sharded_state_dict_grouped: ``experts.linear_fc1.weight`` on the global
expert axis), so the model-space optimizer records are too. Refused by name: the local spec with grouped GEMM
(0.16.1 builds the legacy GroupedMLP, one ``weight1``/``weight2`` for all local experts, whose model keys
pgconvert does not read either; 0.20.0's local spec builds SequentialMLP instead),
``moe_use_legacy_grouped_gemm`` (GroupedMLP with the TE spec) and 0.20.0's ``moe_single_grouped_weight`` /
``moe_single_grouped_bias`` (one GroupedTensor parameter for all local experts).

Multi-latent attention and multi-token prediction, same order in 0.16.1 and 0.20.0: MLASelfAttention
registers linear_proj (MultiLatentAttention), then linear_q_proj (``q_lora_rank`` None) or
linear_q_down_proj and linear_q_up_proj, linear_kv_down_proj, linear_kv_up_proj, then q_layernorm (with
q-LoRA) and kv_layernorm; the TE spec fuses the latent norms into the up projections
(``layer_norm_weight`` before ``weight``). GPTModel registers ``mtp`` after the decoder and before
output_layer, on the last stage only (with its embedding copy, the stage's ``shared_embedding`` at
PP > 1); each MTP layer registers enorm, hnorm, eh_proj, its transformer layer (ordered as a decoder
layer; its routed experts expert-parallel), final_layernorm. Weight decay: the latent norms are 1-dim;
with ``apply_wd_to_qk_layernorm`` a name containing ``q_layernorm.`` or ``k_layernorm.`` keeps it: the
local spec's ``q_layernorm`` does, ``kv_layernorm`` and the TE spec's fused ``layer_norm_weight`` do not.
Checked against megatron-core 0.16.1's own GPTModel (MLA local spec, MoE, MTP) on every rank of TP2·EP2,
PP2 and TP2·PP2 (``tests/test_optimizer_mla.py``).

Muon (Megatron-LM's ``--optimizer muon`` without the distributed optimizer; megatron-core 0.19.2's
``_get_megatron_emerging_optimizer``): a default override sends every parameter that is not 2-dim, or is flagged
``is_embedding_or_output_parameter``, to the scalar optimizer (Adam); the groups are bucketed by optimizer, Muon's
(no override: its key sorts first) one group, then Adam's weight-decay group (the embedding and output layer; with
``decoupled_lr`` their ``max_lr``/``min_lr`` group, whose key also sorts before the norms') and its no-weight-decay
group, each in ``named_parameters()`` order, and ``get_megatron_optimizer`` chains the two. Muon keeps an fp32 master
and a ``momentum_buffer`` per parameter and no step. With experts at expert parallel size > 1 the groups are bucketed
by ``(optimizer, is_expert_parallel)`` too: Muon's dense and expert optimizers, then Adam's dense one and, where the
experts have biases, its expert one (``chain``). With ``--use-distributed-optimizer`` (``layer_wise``) the two are
megatron-core's layer-wise optimizer and a distributed Adam; the layer-wise optimizer is not split by
``is_expert_parallel``, so at expert parallel > 1 the experts are its second param group. Muon's scalar optimizer
may be Lion (``--muon-scalar-optimizer lion``: an ``exp_avg`` per parameter, no step), and Megatron-LM d98e8a64
builds ``--optimizer lion`` as it builds Muon, Lion for the 2-dim weights chained with Adam: both are emerging
optimizers here (``EMERGING``, ``OptimizerRules.emerging``). Refused by name: another scalar optimizer, the
layer-wise optimizer with Lion as Muon's scalar one, its legacy layout and float32 runs
(``_refuse_emerging_variants``). Checked against megatron-core 0.19.2's own TP2 save and Megatron-LM d98e8a64's own
saves, per-rank with and without ``--decoupled-lr``, MoE at EP2, and layer-wise in torch_dist, dense and MoE at EP2,
and its Lion saves (``tests/test_optimizer_muon.py``, ``tests/test_optimizer_muon_moe.py``,
``tests/test_optimizer_layer_wise.py``, ``tests/test_optimizer_lion.py``).

Mixture of experts: a routed expert's linears are ``allreduce=False`` only when
``expert_model_parallel_size > 1`` (``ColumnParallelLinear``/``RowParallelLinear``: ``not (is_expert
and expert_parallel)``), and ``get_megatron_optimizer`` then builds a ``ChainedOptimizer`` of two: the
dense groups (``is_expert_parallel=False``) over every chunk, then the expert groups over the same
chunks (their own ``expert_parallel_buffers`` in DDP). At EP 1 the experts are ordinary dense
parameters in the one optimizer. The router's ``expert_bias`` is a buffer, not a parameter.
"""

from __future__ import annotations

import argparse
import contextlib
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from pgconvert.model.config import MTP_LAYER_MODULES, ModelConfig
from pgconvert.errors import CheckpointError, ValidationError
from pgconvert.model.grid import RankCoord, build_converter_process_groups
from pgconvert.model.layout import ParallelLayout
from pgconvert.io.limits import quote
from pgconvert.model.provider import (EXPERT_PREFIX, EXPERTS_MODULE, FINAL_NORM_BIAS, FINAL_NORM_WEIGHT,
                                HYBRID_FINAL_NORM, LAYER_PREFIX,
                                MTP_PREFIX, OUTPUT_LAYER, POSITION_EMBEDDINGS, WORD_EMBEDDINGS,
                                TensorSpec, provide)

MEGATRON_CORE_VERSIONS = ("0.16.1", "0.20.0")
_VERSIONS = "megatron-core " + " / ".join(MEGATRON_CORE_VERSIONS)

# Module registration order of a local-spec TransformerLayer: input_layernorm, self_attention
# (Attention.__init__ builds linear_proj, SelfAttention.__init__ then linear_qkv, q_layernorm,
# k_layernorm), pre_mlp_layernorm, mlp (linear_fc1, linear_fc2); each module's weight before its bias.
_LOCAL_LAYER_ORDER = (
    "input_layernorm.weight", "input_layernorm.bias",
    # Sparse attention's core attention (DSAttention, built before linear_proj) holds the indexer: DSAIndexer registers
    # linear_wq_b, linear_wk, k_norm, linear_weights_proj (0.16.1 and core_v0.19.0's AbsorbedMLASelfAttention alike).
    "self_attention.core_attention.indexer.linear_wq_b.weight", "self_attention.core_attention.indexer.linear_wk.weight",
    "self_attention.core_attention.indexer.k_norm.weight", "self_attention.core_attention.indexer.k_norm.bias",
    "self_attention.core_attention.indexer.linear_weights_proj.weight",
    "self_attention.linear_proj.weight", "self_attention.linear_proj.bias",
    # The Transformer Engine spec fuses the input and pre-MLP norms into linear_qkv / linear_fc1
    # (TELayerNormColumnParallelLinear = te.pytorch.LayerNormLinear, whose __init__ registers
    # layer_norm_weight, layer_norm_bias, then weight, bias: TransformerEngine v2.0 to d0067d0).
    "self_attention.linear_qkv.layer_norm_weight", "self_attention.linear_qkv.layer_norm_bias",
    "self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias",
    # MLASelfAttention (after MultiLatentAttention's linear_proj) registers linear_q_proj (q_lora_rank
    # None) or linear_q_down_proj, linear_q_up_proj; then linear_kv_down_proj, linear_kv_up_proj; then
    # q_layernorm (q_lora_rank set) and kv_layernorm (0.16.1 and d98e8a64). The TE spec fuses the latent
    # norms into the up projections (layer_norm_weight before weight) and leaves IdentityOp norms.
    "self_attention.linear_q_proj.weight", "self_attention.linear_q_down_proj.weight",
    "self_attention.linear_q_up_proj.layer_norm_weight", "self_attention.linear_q_up_proj.weight",
    "self_attention.linear_kv_down_proj.weight",
    "self_attention.linear_kv_up_proj.layer_norm_weight", "self_attention.linear_kv_up_proj.weight",
    "self_attention.q_layernorm.weight", "self_attention.q_layernorm.bias",
    "self_attention.k_layernorm.weight", "self_attention.k_layernorm.bias",
    "self_attention.kv_layernorm.weight", "self_attention.kv_layernorm.bias",
    # GatedDeltaNet (ssm/gated_delta_net.py, 0.16.1) builds in_proj, conv1d, then its own dt_bias and A_log, then
    # out_norm and out_proj; named_parameters() yields the module's own parameters before its children's.
    "self_attention.dt_bias", "self_attention.A_log",
    "self_attention.in_proj.layer_norm_weight", "self_attention.in_proj.weight", "self_attention.in_proj.bias",
    "self_attention.conv1d.weight", "self_attention.conv1d.bias",
    "self_attention.out_norm.weight", "self_attention.out_proj.weight", "self_attention.out_proj.bias",
    # MambaLayer (ssm/mamba_layer.py, 0.16.1) registers its mixer, then its norm (the local spec's input norm; TE's
    # is fused into in_proj); MambaMixer builds in_proj, conv1d, its own dt_bias, A_log and D, its gated norm and
    # out_proj, and named_parameters() yields its own parameters first.
    "mixer.dt_bias", "mixer.A_log", "mixer.D",
    "mixer.in_proj.layer_norm_weight", "mixer.in_proj.weight", "mixer.in_proj.bias",
    "mixer.conv1d.weight", "mixer.conv1d.bias", "mixer.norm.weight", "mixer.out_proj.weight", "mixer.out_proj.bias",
    "norm.weight", "norm.bias",
    "pre_mlp_layernorm.weight", "pre_mlp_layernorm.bias",
    "mlp.linear_fc1.layer_norm_weight", "mlp.linear_fc1.layer_norm_bias",
    "mlp.linear_fc1.weight", "mlp.linear_fc1.bias",
    "mlp.linear_fc2.weight", "mlp.linear_fc2.bias",
    # MoELayer registers router, experts (SequentialMLP.local_experts), then shared_experts;
    # named_parameters() yields a module's own parameters before its children's, so SharedExpertMLP's
    # gate_weight (set after MLP.__init__ built linear_fc1/linear_fc2) comes first.
    "mlp.router.weight", "mlp.router.bias", "mlp.experts.",
    "mlp.shared_experts.gate_weight", "mlp.shared_experts.linear_fc1.weight", "mlp.shared_experts.linear_fc2.weight",
)
# One SequentialMLP expert (an MLP): linear_fc1 then linear_fc2, each weight before its bias.
_EXPERT_ORDER = ("linear_fc1.weight", "linear_fc1.bias", "linear_fc2.weight", "linear_fc2.bias")
# TEGroupedMLP: linear_fc1 then linear_fc2 (GroupedLinear), each ``weight{i}`` then ``bias{i}`` per local
# expert i (one registration loop in te.pytorch.GroupedLinear.__init__).
_GROUPED_LINEARS = ("linear_fc1", "linear_fc2")
_GROUPED_PARAMS = ("weight", "bias")
_GROUPED_NAME = re.compile(r"(linear_fc[12])\.(weight|bias)(0|[1-9][0-9]*)")
# Registered buffers the provider lists among a layer's tensors: not optimizer parameters.
_BUFFERS = ("mlp.router.expert_bias",)
# GPTModel: embedding (word, then position), decoder (layers, then final_layernorm), mtp, output_layer.
_BEFORE_LAYERS = (WORD_EMBEDDINGS, POSITION_EMBEDDINGS)
# A hybrid model's MambaStack: its layers, then final_norm (MambaModel: embedding, decoder, output_layer).
_AFTER_LAYERS = (FINAL_NORM_WEIGHT, FINAL_NORM_BIAS, HYBRID_FINAL_NORM + "weight", HYBRID_FINAL_NORM + "bias",
                 MTP_PREFIX, OUTPUT_LAYER)
# A MultiTokenPredictionLayer registers enorm, hnorm, eh_proj, transformer_layer (a decoder layer's
# modules; ``mtp_model_layer`` in d98e8a64, same place), final_layernorm (0.16.1 and d98e8a64).
_MTP_BEFORE_LAYER = ("enorm.weight", "enorm.bias", "hnorm.weight", "hnorm.bias", "eh_proj.weight")
_MTP_AFTER_LAYER = ("final_layernorm.weight", "final_layernorm.bias")


class OptimizerLayoutError(CheckpointError):
    """An optimizer state whose layout pgconvert does not reproduce, or that does not match the model."""


class UnsupportedOptimizerError(ValidationError):
    """A model or run setting whose optimizer layout pgconvert does not reproduce."""


# The per-parameter state fields: the fp32 master and Adam's moments, or Muon's momentum buffer.
ADAM_FIELDS = ("param", "exp_avg", "exp_avg_sq")
MUON_FIELDS = ("param", "momentum_buffer")
LION_FIELDS = ("param", "exp_avg")  # emerging_optimizers' Lion: one moment, no step
ADAM, MUON, LION = "adam", "muon", "lion"
# Megatron-LM's emerging optimizers (``--optimizer``) that pgconvert maps: each keeps the 2-dim weights but the word
# embedding and output layer, chained with a scalar optimizer for the rest (megatron-core's
# ``_get_megatron_emerging_optimizer``).
EMERGING = (MUON, LION)


@dataclass(frozen=True)
class ChainMember:
    """One optimizer megatron-core chains: the torch optimizer it wraps (``kind``) and whether it holds the
    expert-parallel parameters."""

    kind: str = ADAM
    expert: bool = False

    @property
    def fields(self) -> tuple[str, ...]:
        """Its per-parameter state: the fp32 master and Muon's momentum buffer, Lion's moment or Adam's moments."""
        return {MUON: MUON_FIELDS, LION: LION_FIELDS}.get(self.kind, ADAM_FIELDS)

    @property
    def state_fields(self) -> tuple[str, ...]:
        """The fields its torch optimizer keeps per parameter in ``state`` (the master aside, which megatron-core's
        wrapper keeps)."""
        return tuple(name for name in self.fields if name != "param")

    @property
    def stepped(self) -> bool:
        """Whether it counts steps (Adam; Muon and Lion keep none)."""
        return self.kind == ADAM


@dataclass(frozen=True)
class OptimizerSlot:
    """One parameter of a rank's optimizer: its group, its position in ``optimizer.state``, the model
    chunk it belongs to and the tensor it is (``spec``: canonical name, rule, local shape)."""

    group: int
    position: int
    chunk: int
    spec: TensorSpec
    # The index in megatron-core's ChainedOptimizer (``chain``: which optimizer that is).
    optimizer: int = 0
    member: ChainMember = ChainMember()


@dataclass(frozen=True)
class OptimizerRules:
    """The run settings that decide the param groups (read from the checkpoint's ``args``)."""

    apply_wd_to_qk_layernorm: bool = False
    # ``decoupled_lr``: the embedding and output parameters' own group (its ``max_lr``), None without one.
    decoupled_lr: float | None = None
    # ``decoupled_min_lr``: that group's ``min_lr`` (None: the run's ``min_lr``).
    decoupled_min_lr: float | None = None
    # ``args.optimizer``: Adam, or an emerging optimizer (``EMERGING``: Muon, Lion) chained with ``scalar``: the
    # emerging one for the 2-dim weights, the scalar one for the rest.
    kind: str = ADAM
    # The optimizer of an emerging run's other parameters (the embedding, output layer and norms): Adam, or with
    # Muon ``muon_scalar_optimizer`` (Adam or Lion).
    scalar: str = ADAM
    # ``use_layer_wise_distributed_optimizer`` (an emerging optimizer with ``--use-distributed-optimizer``): the
    # layer-wise optimizer over the emerging optimizer's parameters (each a whole tensor, its state in model space),
    # chained with a distributed Adam over a DDP buffer of the rest.
    layer_wise: bool = False

    @classmethod
    def from_args(cls, args: argparse.Namespace | None, where: str) -> OptimizerRules:
        if args is None:
            return cls()
        _refuse_grouped_variants(args, where)
        decoupled = [_learning_rate(args, name, where) for name in ("decoupled_lr", "decoupled_min_lr")]
        if decoupled[0] is None and decoupled[1] is not None:
            decoupled[1] = None  # megatron-core reads decoupled_min_lr only with decoupled_lr
        kind = getattr(args, "optimizer", None) or ADAM
        scalar = (getattr(args, "muon_scalar_optimizer", None) or ADAM) if kind == MUON else ADAM
        if kind in EMERGING:
            _refuse_emerging_variants(args, kind, scalar, where)
        return cls(apply_wd_to_qk_layernorm=bool(getattr(args, "apply_wd_to_qk_layernorm", False)),
                   decoupled_lr=decoupled[0], decoupled_min_lr=decoupled[1], kind=kind, scalar=scalar,
                   layer_wise=kind in EMERGING and bool(getattr(args, "use_layer_wise_distributed_optimizer", False)))

    @property
    def emerging(self) -> bool:
        """Whether the run's optimizer is an emerging one (``EMERGING``), chained with its scalar optimizer."""
        return self.kind in EMERGING

    @property
    def stored_kind(self) -> str:
        """The kind of state the run saved, as ``optimizer_kinds`` name it (``layer_wise_kind``)."""
        return layer_wise_kind(self.kind) if self.layer_wise else self.kind


def layer_wise_kind(kind: str) -> str:
    """How a format's reader and writer name, in ``optimizer_kinds`` (beside ``args.optimizer`` values), an emerging
    optimizer's state under the layer-wise distributed optimizer."""
    return f"{kind} layer-wise"


def _refuse_emerging_variants(args: argparse.Namespace, kind: str, scalar: str, where: str) -> None:
    """The emerging runs whose optimizer layout is not mapped, refused by name: Muon with a scalar optimizer other than
    Adam and Lion; the layer-wise distributed optimizer with Lion as Muon's scalar optimizer, with its legacy layout
    (``--no-use-layer-wise-param-layout``: every parameter in the layer-wise optimizer's buffer) or in a float32
    run."""
    layer_wise = bool(getattr(args, "use_layer_wise_distributed_optimizer", False))  # float32: torch's own optimizers
    refused = {"muon_scalar_optimizer": scalar not in (ADAM, LION) or (layer_wise and scalar != ADAM),
               "use_layer_wise_param_layout": layer_wise and getattr(args, "use_layer_wise_param_layout", None) in (
                   False, 0),  # absent or None: Megatron-LM's default, the precomputed layout
               "bf16": layer_wise and not getattr(args, "bf16", False)}
    for name, held in refused.items():
        if held:
            raise UnsupportedOptimizerError(
                f"{where}: args.optimizer={quote(kind)} with args.{name}={quote(getattr(args, name, None))}: pgconvert "
                "maps megatron-core's Muon and Lion optimizers (the emerging one for the 2-dim weights, Adam, or with "
                "Muon Lion, for the embedding, output layer and norms): the plain ones, and the layer-wise distributed "
                "ones of a bf16 run with Adam and its default param layout; pass --skip-optimizer")


def layer_wise_target_refusal(rules: OptimizerRules, config: ModelConfig, layout: ParallelLayout) -> str | None:
    """Why a layer-wise run's state cannot be written at ``layout`` (None: it can): the experts' biases at expert
    parallel > 1 would be a scalar optimizer's expert-parallel group, which megatron-core (Megatron-LM d98e8a64)
    asserts the layer-wise path does not support; at expert parallel size 1 they are dense parameters."""
    if rules.layer_wise and config.moe.num_experts and config.add_bias_linear and layout.ep > 1:
        return (f"the layer-wise distributed optimizer with the experts' biases at expert parallel size {layout.ep}: "
                "megatron-core builds it only at expert parallel size 1 (non-emerging expert-parallel param groups "
                "are not supported on the layer-wise path)")
    return None


def _learning_rate(args: argparse.Namespace, name: str, where: str) -> float | None:
    """``args.<name>``: None, or a finite learning rate >= 0."""
    value = getattr(args, name, None)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < float("inf"):
        raise UnsupportedOptimizerError(f"{where}: args.{name}={quote(value)}: not a learning rate (a finite number "
                                        ">= 0, or None)")
    return float(value)


# Run settings that replace TEGroupedMLP's per-expert weight{i}/bias{i} parameters: the legacy GroupedMLP
# (TE spec, megatron-core 0.16.1's transformer_engine_spec_provider), or one GroupedTensor per linear (0.20.0).
_GROUPED_VARIANTS = {
    "moe_use_legacy_grouped_gemm": "the legacy GroupedMLP (one weight1/weight2 for all local experts)",
    "moe_single_grouped_weight": "one GroupedTensor weight per grouped linear for all local experts",
    "moe_single_grouped_bias": "one GroupedTensor bias per grouped linear for all local experts",
}


def _refuse_grouped_variants(args: argparse.Namespace, where: str) -> None:
    if not (getattr(args, "num_experts", None) and getattr(args, "moe_grouped_gemm", False)):
        return
    for name, what in _GROUPED_VARIANTS.items():
        if getattr(args, name, False):
            raise UnsupportedOptimizerError(
                f"{where}: args.{name}={quote(getattr(args, name))} with moe_grouped_gemm: the experts are {what}, "
                f"not TEGroupedMLP's weight{{i}}/bias{{i}} per local expert; pgconvert does not map that "
                f"optimizer layout ({_VERSIONS}); pass --skip-optimizer")


def check_supported(config: ModelConfig, where: str) -> None:
    """Refuse models whose optimizer layout is not reproduced, naming the field."""
    if config.vision.vision_config is not None:
        raise UnsupportedOptimizerError(
            f"{where}: vision_config is set: the parameter order of a vision-language model (Megatron-Bridge's "
            f"VL model: the vision part, then the language model) is not mapped; pass --skip-optimizer")
    if config.moe.num_experts and config.moe.moe_grouped_gemm and config.transformer_impl != "transformer_engine":
        # TEGroupedMLP (the Transformer Engine spec) is mapped; the local spec's grouped GEMM is not.
        raise UnsupportedOptimizerError(
            f"{where}: moe_grouped_gemm=True with transformer_impl={quote(config.transformer_impl)}: megatron-core "
            f"0.16.1's local spec builds the legacy GroupedMLP (one weight1/weight2 for all local experts), whose "
            f"optimizer layout pgconvert does not map (0.20.0's local spec builds SequentialMLP instead); only "
            f"TEGroupedMLP (transformer_impl=transformer_engine) and SequentialMLP experts are ({_VERSIONS}); "
            f"pass --skip-optimizer")


def _expert_order(rest: str) -> tuple[int, int, int] | None:
    """The place of a routed expert's parameter (``rest``: relative to its layer) inside the experts module:
    SequentialMLP (expert, then its MLP's order) or TEGroupedMLP (linear, then expert, weight before bias);
    None for any other name."""
    if rest.startswith(EXPERT_PREFIX):
        expert, _, inner = rest[len(EXPERT_PREFIX):].partition(".")
        if expert.isdigit() and inner in _EXPERT_ORDER:
            return (int(expert), _EXPERT_ORDER.index(inner), 0)
        return None
    grouped = _GROUPED_NAME.fullmatch(rest[len(EXPERTS_MODULE):]) if rest.startswith(EXPERTS_MODULE) else None
    if grouped is None:
        return None
    module, kind, expert = grouped.groups()
    return (_GROUPED_LINEARS.index(module), int(expert), _GROUPED_PARAMS.index(kind))


def _mtp_order_key(spec: TensorSpec) -> tuple[int, ...]:
    """``mtp.layers.{i}.rest`` after the decoder's final norm, before the output layer."""
    index, _, rest = spec.local_name[len(MTP_PREFIX):].partition(".")
    where = (2, 0, _AFTER_LAYERS.index(MTP_PREFIX), int(index) if index.isdigit() else -1)
    if rest in _MTP_BEFORE_LAYER:
        return (*where, 0, _MTP_BEFORE_LAYER.index(rest))
    if rest in _MTP_AFTER_LAYER:
        return (*where, 2, _MTP_AFTER_LAYER.index(rest))
    # its transformer layer, as decoder layer 0; Megatron-LM d98e8a64's mtp_model_layer sits at the same place
    module = next((f"{m}." for m in MTP_LAYER_MODULES if rest.startswith(f"{m}.")), None)
    if index.isdigit() and module is not None:
        layer = replace(spec, local_name=f"{LAYER_PREFIX}0.{rest[len(module):]}")
        with contextlib.suppress(UnsupportedOptimizerError):  # refused below, under its own name
            return (*where, 1, *_order_key(layer))
    raise UnsupportedOptimizerError(f"parameter {quote(spec.local_name)}: its place in megatron-core's module order "
                                    f"is not known to pgconvert ({_VERSIONS})")


def _order_key(spec: TensorSpec) -> tuple[int, ...]:
    name = spec.local_name
    if name.startswith(MTP_PREFIX):
        return _mtp_order_key(spec)
    if name in _BEFORE_LAYERS:
        return (0, 0, _BEFORE_LAYERS.index(name), 0, 0, 0)
    if name in _AFTER_LAYERS:
        return (2, 0, _AFTER_LAYERS.index(name), 0, 0, 0)
    index, _, rest = name[len(LAYER_PREFIX):].partition(".")
    expert = _expert_order(rest) if name.startswith(LAYER_PREFIX) else None
    if expert is not None:
        return (1, int(index), _LOCAL_LAYER_ORDER.index(EXPERTS_MODULE), *expert)
    if not name.startswith(LAYER_PREFIX) or rest not in _LOCAL_LAYER_ORDER:
        raise UnsupportedOptimizerError(f"parameter {quote(name)}: its place in megatron-core's module order "
                                        f"is not known to pgconvert ({_VERSIONS})")
    return (1, int(index), _LOCAL_LAYER_ORDER.index(rest), 0, 0, 0)


def _is_buffer(spec: TensorSpec) -> bool:
    return any(spec.local_name.endswith("." + name) for name in _BUFFERS)


def is_expert_parallel(spec: TensorSpec, layout: ParallelLayout) -> bool:
    """megatron-core's ``not param.allreduce``: a routed expert's parameter at expert parallel size > 1."""
    return layout.ep > 1 and f".{EXPERTS_MODULE}" in spec.local_name


def _is_embedding_or_output(spec: TensorSpec, coord: RankCoord, chunk: int) -> bool:
    """megatron-core's ``is_embedding_or_output_parameter``: the word embedding of the first stage's first chunk
    (``pre_process``), or an output layer's weight."""
    return spec.local_name == OUTPUT_LAYER or (spec.local_name == WORD_EMBEDDINGS and coord.pp == 0 and chunk == 0)


def _dense_group(spec: TensorSpec, rules: OptimizerRules, coord: RankCoord, chunk: int) -> int:
    """The dense optimizer's group: 0 weight decay; with decoupled_lr 1 the embedding/output parameters; then
    no weight decay."""
    decoupled = rules.decoupled_lr is not None
    if decoupled and _is_embedding_or_output(spec, coord, chunk):
        return 1
    return (1 + decoupled) if _no_weight_decay(spec, rules) else 0


def _place(spec: TensorSpec, rules: OptimizerRules, layout: ParallelLayout, coord: RankCoord,
           chunk: int, members: Sequence[ChainMember]) -> tuple[int, int]:
    """(chained optimizer, param group) of a parameter, ``members`` the chain. An emerging run's (megatron-core
    0.19.2's ``_is_nonlinear_or_embedding``): a 2-dim weight other than the word embedding and output layer is the
    emerging optimizer's (its one group; the layer-wise optimizer's: its dense group or its expert one), the rest its
    scalar optimizer's, by weight decay (an expert-parallel scalar optimizer's only group: the experts' biases)."""
    expert_parallel = is_expert_parallel(spec, layout)
    expert = expert_parallel and not rules.layer_wise  # the layer-wise optimizer keeps experts, in a group of their own
    if rules.emerging:
        if len(spec.local_shape) == 2 and not _is_embedding_or_output(spec, coord, chunk):
            return members.index(ChainMember(rules.kind, expert)), int(expert_parallel and rules.layer_wise)
        index = members.index(ChainMember(rules.scalar, expert))
        return index, 0 if expert else (1 if _no_weight_decay(spec, rules) else 0)
    if expert:
        return 1, 1 if _no_weight_decay(spec, rules) else 0
    return 0, _dense_group(spec, rules, coord, chunk)


def _no_weight_decay(spec: TensorSpec, rules: OptimizerRules) -> bool:
    one_dim = len(spec.local_shape) == 1 or spec.local_name.endswith(".bias")
    if rules.apply_wd_to_qk_layernorm:
        return one_dim and not ("q_layernorm." in spec.local_name or "k_layernorm." in spec.local_name)
    return one_dim


def named_parameters(config: ModelConfig, layout: ParallelLayout, coord: RankCoord,
                     padded_vocab_size: int | None = None) -> list[tuple[int, TensorSpec]]:
    """(model chunk, spec) of every trainable parameter of rank ``coord``, in megatron-core's order."""
    groups = build_converter_process_groups(layout)
    groups.set_coord(coord)
    ordered: list[tuple[int, TensorSpec]] = []
    for chunk in range(layout.virtual_size):
        shard = provide(config, groups, padded_vocab_size, chunk)
        ordered += [(chunk, spec) for spec in sorted((s for s in shard.specs if not _is_buffer(s)), key=_order_key)]
    return ordered


def chain(config: ModelConfig, layout: ParallelLayout,
          rules: OptimizerRules = OptimizerRules()) -> tuple[ChainMember, ...]:
    """The optimizers megatron-core chains, in order: Adam's dense one, and its expert one at expert parallel > 1.
    An emerging run's (``_get_megatron_emerging_optimizer``: the groups bucketed by ``(optimizer,
    is_expert_parallel)`` in sorted-group order): the emerging optimizer's dense one, its expert one at expert
    parallel > 1, its scalar optimizer's (Adam, or Lion for Muon) dense one, and an expert one where the experts have
    biases; with the layer-wise optimizer, the emerging one's (experts included) and Adam's."""
    experts = bool(config.moe.num_experts) and layout.ep > 1
    if not rules.emerging:
        return (ChainMember(ADAM, False), ChainMember(ADAM, True)) if experts else (ChainMember(ADAM, False),)
    experts = experts and not rules.layer_wise
    return (ChainMember(rules.kind, False), *((ChainMember(rules.kind, True),) if experts else ()),
            ChainMember(rules.scalar, False),
            *((ChainMember(rules.scalar, True),) if experts and config.add_bias_linear else ()))


def _is_emerging(rules: OptimizerRules, member: ChainMember) -> bool:
    """Whether ``member`` is an emerging run's emerging optimizer (not its scalar one)."""
    return rules.emerging and member.kind == rules.kind


def optimizer_count(config: ModelConfig, layout: ParallelLayout, rules: OptimizerRules = OptimizerRules()) -> int:
    """How many optimizers megatron-core chains (``chain``)."""
    return len(chain(config, layout, rules))


def _group_count(config: ModelConfig, layout: ParallelLayout, member: ChainMember, rules: OptimizerRules) -> int:
    """Groups per chained optimizer: keys are all-gathered over the world, so a group exists on every rank once any
    rank has a member. Dense: weight decay, the embedding/output parameters with decoupled_lr, and no weight
    decay (norms). Experts: no weight decay only with their biases (``add_bias_linear``). An emerging run: the
    emerging optimizer's one group (dense and expert alike; the layer-wise optimizer's: its dense one, then its
    experts' at expert parallel > 1, where they are ``is_expert_parallel``), then the scalar optimizer's weight decay
    (the embedding and output layer) and no weight decay (an expert one's: the experts' biases alone)."""
    if _is_emerging(rules, member) and rules.layer_wise:
        return 2 if config.moe.num_experts and layout.ep > 1 else 1
    if rules.emerging:
        return 1 if _is_emerging(rules, member) or member.expert else 2
    if not member.expert:
        return 3 if rules.decoupled_lr is not None else 2
    return 2 if config.add_bias_linear else 1


def group_counts(config: ModelConfig, layout: ParallelLayout, rules: OptimizerRules = OptimizerRules()) -> list[int]:
    """The param groups megatron-core builds for each chained optimizer (``chain``)."""
    return [_group_count(config, layout, member, rules) for member in chain(config, layout, rules)]


def group_overrides(rules: OptimizerRules, member: ChainMember) -> list[dict[str, float]]:
    """Per param group of the chained optimizer ``member``: the override fields megatron-core sets on it
    (``wd_mult`` 0 for no weight decay; ``max_lr``/``min_lr`` for decoupled_lr), ``wd_mult`` 1.0 otherwise."""
    decayed, undecayed = {"wd_mult": 1.0}, {"wd_mult": 0.0}
    if _is_emerging(rules, member):
        return [decayed, decayed] if rules.layer_wise else [decayed]  # the layer-wise one's: dense, then experts
    if rules.emerging and member.expert:
        return [undecayed]
    if member.expert or rules.decoupled_lr is None:
        return [decayed, undecayed]
    decoupled = {"wd_mult": 1.0, "max_lr": rules.decoupled_lr}
    if rules.decoupled_min_lr is not None:
        decoupled["min_lr"] = rules.decoupled_min_lr
    if rules.emerging:  # the scalar one's: the embedding and output layer (their own learning rate), then the norms
        return [decoupled, undecayed]
    return [decayed, decoupled, undecayed]


def group_experts(rules: OptimizerRules, member: ChainMember) -> list[bool]:
    """Per param group of ``member`` (as ``group_overrides``): its ``is_expert_parallel``. The layer-wise
    optimizer's second group is its experts'; every other optimizer's groups are all expert or all dense."""
    if _is_emerging(rules, member) and rules.layer_wise:
        return [False, True]
    return [member.expert] * len(group_overrides(rules, member))


def chained_slots(config: ModelConfig, layout: ParallelLayout, coord: RankCoord,
                  rules: OptimizerRules = OptimizerRules(),
                  padded_vocab_size: int | None = None) -> list[list[list[OptimizerSlot]]]:
    """Per chained optimizer (``chain``), its param groups (weight decay, then no weight
    decay), each a list of slots in ``params`` order; positions count across one optimizer's groups as its
    ``state`` does."""
    check_supported(config, f"layout {layout.describe()}")
    optimizers = chain(config, layout, rules)
    members: list[list[list[tuple[int, TensorSpec]]]] = [
        [[] for _ in range(_group_count(config, layout, member, rules))] for member in optimizers]
    for chunk, spec in named_parameters(config, layout, coord, padded_vocab_size):
        optimizer, group = _place(spec, rules, layout, coord, chunk, optimizers)
        members[optimizer][group].append((chunk, spec))
    chained: list[list[list[OptimizerSlot]]] = []
    for optimizer, groups in enumerate(members):
        position, built = 0, []
        for index, group in enumerate(groups):
            built.append([OptimizerSlot(index, position + i, chunk, spec, optimizer, optimizers[optimizer])
                          for i, (chunk, spec) in enumerate(group)])
            position += len(group)
        chained.append(built)
    return chained


def optimizer_slots(config: ModelConfig, layout: ParallelLayout, coord: RankCoord,
                    rules: OptimizerRules = OptimizerRules(),
                    padded_vocab_size: int | None = None) -> list[list[OptimizerSlot]]:
    """The param groups of rank ``coord``'s optimizers, the chained optimizers' groups one after another
    (each slot names its ``optimizer``; positions count within it)."""
    return [group for groups in chained_slots(config, layout, coord, rules, padded_vocab_size) for group in groups]


def grouped_expert_note(slots: Sequence[OptimizerSlot]) -> str:
    """For a count mismatch, how many of ``slots`` are TEGroupedMLP expert parameters ("" if none)."""
    layers: set[tuple[int, str]] = set()
    experts: set[int] = set()
    count = 0
    for slot in slots:
        head, _, rest = slot.spec.local_name.rpartition(EXPERTS_MODULE)
        match = _GROUPED_NAME.fullmatch(rest) if head else None
        if match is not None:
            layers.add((slot.chunk, head))
            experts.add(int(match.group(3)))
            count += 1
    if not count:
        return ""
    return (f"; {count} of them are grouped-GEMM expert parameters (TEGroupedMLP: linear_fc1 and linear_fc2 "
            f"weight{{i}}/bias{{i}} for each of {len(experts)} local experts in {len(layers)} MoE layer(s); another "
            "count means other experts per rank, or the legacy GroupedMLP's weight1/weight2)")


def check_param_groups(slots: Sequence[Sequence[OptimizerSlot]], param_groups: Any, where: str,
                       rules: OptimizerRules = OptimizerRules(), member: ChainMember = ChainMember()) -> None:
    """The stored ``param_groups`` of the chained optimizer ``member`` have the groups, sizes, positions and
    overrides (weight-decay multiplier, decoupled learning rates) that ``slots`` and ``rules`` derive; refuse
    (naming the field) otherwise."""
    if not isinstance(param_groups, list) or len(param_groups) != len(slots):
        count = len(param_groups) if isinstance(param_groups, list) else quote(type(param_groups).__name__)
        raise OptimizerLayoutError(
            f"{where}: optimizer.param_groups holds {count} groups; {_VERSIONS} builds {len(slots)} for this "
            "model (weight decay, [decoupled_lr,] no weight decay)")
    overrides, experts = group_overrides(rules, member), group_experts(rules, member)
    for index, (group, members) in enumerate(zip(param_groups, slots)):
        if not isinstance(group, dict):
            raise OptimizerLayoutError(f"{where}: optimizer.param_groups[{index}] is not a dict")
        expected = [slot.position for slot in members]
        params = group.get("params")
        if not isinstance(params, list) or any(type(position) is not int for position in params) \
                or params != expected:
            raise OptimizerLayoutError(
                f"{where}: optimizer.param_groups[{index}].params = {quote(group.get('params'), 120)}, but the "
                f"model's parameter count gives {quote(expected, 120)} ({_VERSIONS} group order)"
                f"{grouped_expert_note(members)}")
        _check_group_overrides(group, index, overrides[index], experts[index], where)


def _check_group_overrides(group: dict[Any, Any], index: int, overrides: dict[str, float], expert: bool,
                           where: str) -> None:
    """One stored group's ``is_expert_parallel`` and override fields, as megatron-core sets them."""
    wrong = [name for name, value in overrides.items() if not _same_number(group.get(name, 1.0 if name == "wd_mult"
                                                                                     else None), value)]
    flag = group.get("is_expert_parallel", False)
    if wrong or not isinstance(flag, int) or bool(flag) != expert:
        held = ", ".join(f"{name}={quote(group.get(name))}" for name in (*overrides, "is_expert_parallel"))
        wanted = ", ".join(f"{name}={value}" for name, value in (*overrides.items(), ("is_expert_parallel", expert)))
        raise OptimizerLayoutError(f"{where}: optimizer.param_groups[{index}]: {held}: not the group {_VERSIONS} "
                                   f"builds there ({wanted}; the run's args decide decoupled_lr)")


def _same_number(held: Any, value: float) -> bool:
    return isinstance(held, (int, float)) and not isinstance(held, bool) and held == value


def check_state_shapes(slots: Sequence[Sequence[OptimizerSlot]], state: Mapping[Any, Any], where: str,
                       fields: Sequence[str] = ADAM_FIELDS[1:]) -> None:
    """Every state tensor (``fields``, ``OptimizerRules.state_fields``: Adam's ``exp_avg`` and ``exp_avg_sq``, or
    Muon's ``momentum_buffer``) has the local shape of the parameter its position maps to, and every position has
    state (a checkpoint saved after at least one step)."""
    flat = [slot for members in slots for slot in members]
    if not isinstance(state, Mapping) or set(state) != {slot.position for slot in flat}:
        keys = sorted(state, key=str) if isinstance(state, Mapping) else type(state).__name__
        raise OptimizerLayoutError(
            f"{where}: optimizer.state has positions {quote(keys, 120)}, but the model has {len(flat)} "
            f"trainable parameters on this rank ({_VERSIONS}){grouped_expert_note(flat)}")
    for slot in flat:
        entry = state[slot.position]
        for key in fields:
            value = entry.get(key) if isinstance(entry, Mapping) else None
            if not isinstance(value, torch.Tensor) or tuple(value.shape) != tuple(slot.spec.local_shape):
                shape = tuple(value.shape) if isinstance(value, torch.Tensor) else quote(type(value).__name__)
                raise OptimizerLayoutError(
                    f"{where}: optimizer.state[{slot.position}].{key} has shape {shape}, but position "
                    f"{slot.position} is {slot.spec.local_name} of shape {tuple(slot.spec.local_shape)}")
