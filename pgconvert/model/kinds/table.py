"""What a layer kind's table is made of.

A kind's ``tensors`` table lists, in the order megatron-core's state dict holds them, its
``TensorKind`` rows (names relative to the layer), a ``RoutedExperts`` block (rows repeated for every
routed expert) and, for a layer that wraps another, an ``InnerLayer``. Its ``te_modules`` table lists
the modules whose Transformer Engine state dict carries an ``_extra_state`` entry (FP8 metadata), in
registration order, with the same two blocks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Union

from pgconvert.model.rules import COLUMN, GATED, ShardRule

if TYPE_CHECKING:
    from pgconvert.model.config import ModelConfig

Shape = Callable[["ModelConfig"], tuple[int, ...]]
Condition = Callable[["ModelConfig"], bool]

# Every routed expert's module lives under this, relative to a layer: ``local_experts.{E}.`` of
# SequentialMLP and the grouped-GEMM ``linear_fc1``/``linear_fc2`` of TEGroupedMLP alike.
EXPERTS_MODULE = "mlp.experts."
EXPERT_PREFIX = EXPERTS_MODULE + "local_experts."


def always(config: ModelConfig) -> bool:
    return True


@dataclass(frozen=True)
class TensorKind:
    """One row of a kind's table: one tensor of the layer."""

    canonical: str
    shape: Shape
    rule: ShardRule | Callable[[ModelConfig], ShardRule]
    exists: Condition = always
    te_name: str | None = None
    # When the Transformer Engine spec holds the tensor under ``te_name`` (a norm fused into the next linear);
    # otherwise it keeps the canonical name there too.
    te_fused: Condition = always
    keep_dtype: bool = False
    # A norm's weight (gamma): megatron-core's --apply-layernorm-1p computes with 1 + gamma.
    norm_weight: bool = False
    # How the rows carry rotary dims: "head" (the dims of one head: q/k norms) or "qkv" (the fused
    # q, k and v heads of each query group); None: no rotary rows.
    rotary: str | None = None
    # Names of the segments megatron-core's sharded state dict (torch_dist) stores as keys of their own, the
    # tensor's key followed by ``.<name>``, each the rows of one window of the rule's single piece (MambaMixer's
    # ``in_proj`` and ``conv1d``); empty: one key holds the tensor.
    dist_segments: tuple[str, ...] = ()

    def rule_for(self, config: ModelConfig) -> ShardRule:
        return self.rule if isinstance(self.rule, ShardRule) else self.rule(config)

    def local_name(self, config: ModelConfig) -> str:
        if config.transformer_impl == "transformer_engine" and self.te_name is not None and self.te_fused(config):
            return self.te_name
        return self.canonical


@dataclass(frozen=True)
class TEModule:
    """A module that carries a Transformer Engine ``_extra_state`` entry."""

    name: str
    exists: Condition = always
    # Whether megatron-core's sharded state dict (torch_dist) saves the entry:
    # TEDotProductAttention.sharded_state_dict saves none for the core attention.
    sharded: bool = True


@dataclass(frozen=True)
class RoutedExperts:
    """Rows repeated for every routed expert, relative to ``mlp.experts.local_experts.{E}.`` (E global
    in canonical names, local to the expert-parallel rank in rank files)."""

    rows: tuple[TensorKind, ...] | tuple[TEModule, ...]


@dataclass(frozen=True)
class InnerLayer:
    """A whole decoder layer held under ``module`` (canonical spelling); rank files spell the module
    ``local_module(config)``."""

    module: str
    local_module: Callable[[ModelConfig], str]


TensorRow = Union[TensorKind, RoutedExperts, InnerLayer]
TERow = Union[TEModule, RoutedExperts, InnerLayer]


@dataclass(frozen=True)
class LayerKind:
    """One kind of sublayer: its tensors and its Transformer Engine modules, each in file order."""

    name: str
    tensors: tuple[TensorRow, ...]
    te_modules: tuple[TERow, ...] = ()


# The Transformer Engine spec fuses the input and pre-MLP norms into the following linear
# (TELayerNormColumnParallelLinear): (local-spec module prefix, the TE spec's fused prefix), relative
# to a layer. megatron-core's local spec keeps separate norms but saves them under the fused names in
# a torch_dist checkpoint (its sharded_state_dict_keys_map), MoE layers included; TE-spec MoE layers
# have no linear to fuse the pre-MLP norm into and keep ``pre_mlp_layernorm.*`` everywhere.
FUSED_NORM_NAMES: tuple[tuple[str, str], ...] = (
    ("input_layernorm.", "self_attention.linear_qkv.layer_norm_"),
    ("pre_mlp_layernorm.", "mlp.linear_fc1.layer_norm_"),
    ("norm.", "mixer.in_proj.layer_norm_"),  # a Mamba layer's input norm (pgconvert.model.kinds.mamba)
    # A gated delta net layer's input norm (pgconvert.model.kinds.gated_delta_net, whose row names it:
    # fused_norm_name takes the first pair of a local prefix, the attention layer's).
    ("input_layernorm.", "self_attention.in_proj.layer_norm_"),
)


def fused_norm_name(rest: str) -> str | None:
    """A layer tensor's name (relative to its layer) under the TE spec's fused norm naming; None
    for a tensor that is not one of the fused norms."""
    for local, fused in FUSED_NORM_NAMES:
        if rest.startswith(local):
            return fused + rest[len(local):]
    return None


# Shapes, conditions and rules several kinds share.
def hidden(config: ModelConfig) -> tuple[int, ...]:
    return (config.hidden_size,)


def layernorm(config: ModelConfig) -> bool:
    """LayerNorm (not RMSNorm) with a bias: norms have a bias."""
    return config.has_norm_bias


def linear_bias(config: ModelConfig) -> bool:
    return config.add_bias_linear


def pre_norm(config: ModelConfig) -> bool:
    return config.norms.pre_layernorms


def pre_norm_bias(config: ModelConfig) -> bool:
    return config.norms.pre_layernorms and layernorm(config)


def pre_mlp_norm(config: ModelConfig) -> bool:
    """The MLP's own pre-norm: none where it reads the attention's input norm (a parallel layer's shared norm)."""
    return pre_norm(config) and not config.carried.shared_input_layernorm


def pre_mlp_norm_bias(config: ModelConfig) -> bool:
    return pre_mlp_norm(config) and layernorm(config)


def fc1_rule(config: ModelConfig) -> ShardRule:
    """A gated fc1 holds ``[gate; up]``, each split by TP; a plain one is split by rows."""
    return GATED if config.mlp.gated_linear_unit else COLUMN
