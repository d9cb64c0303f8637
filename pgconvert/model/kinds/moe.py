"""A mixture-of-experts MLP (megatron-core's MoELayer): its norm, the router, the routed experts
and the shared experts.

The pre-MLP norm is a separate module in both specs (nothing to fuse it into). The router and its
expert bias stay in their own dtype (float32 in megatron-core) whatever --dtype says.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pgconvert.model.kinds.table import (LayerKind, RoutedExperts, TEModule, TensorKind, fc1_rule, hidden,
                                         layernorm, linear_bias)
from pgconvert.model.layers import MOE
from pgconvert.model.rules import REPLICATED, ROW

if TYPE_CHECKING:
    from pgconvert.model.config import ModelConfig

TE_SHARED_EXPERT_LINEARS = ("mlp.shared_experts.linear_fc1", "mlp.shared_experts.linear_fc2")
# One routed expert's linears, relative to its module (``local_experts.{j}.``, or the one grouped module).
TE_EXPERT_LINEARS = ("linear_fc1", "linear_fc2")


def _shared_experts(config: ModelConfig) -> bool:
    return config.moe.moe_shared_expert_intermediate_size is not None


def _shared_gate(config: ModelConfig) -> bool:
    return _shared_experts(config) and config.moe.moe_shared_expert_gate


def _expert_bias(config: ModelConfig) -> bool:
    return config.moe.moe_router_enable_expert_bias


def _experts(c: ModelConfig) -> int:
    return c.moe.num_experts or 0


def _expert_fc1_rows(c: ModelConfig) -> int:
    return c.expert_ffn_size * (2 if c.mlp.gated_linear_unit else 1)


def _shared_size(c: ModelConfig) -> int:
    return c.moe.moe_shared_expert_intermediate_size or 0


def _shared_fc1_rows(c: ModelConfig) -> int:
    return _shared_size(c) * (2 if c.mlp.gated_linear_unit else 1)


# One routed expert, relative to ``mlp.experts.local_experts.{E}.``.
EXPERT_TENSORS: tuple[TensorKind, ...] = (
    TensorKind("linear_fc1.weight", lambda c: (_expert_fc1_rows(c), c.hidden_size), fc1_rule),
    # Expert biases (add_bias_linear, GPT-OSS): fc1's split like its rows, fc2's whole on every rank.
    TensorKind("linear_fc1.bias", lambda c: (_expert_fc1_rows(c),), fc1_rule, linear_bias),
    TensorKind("linear_fc2.weight", lambda c: (c.hidden_size, c.expert_ffn_size), ROW),
    TensorKind("linear_fc2.bias", hidden, REPLICATED, linear_bias),
)

KIND = LayerKind(MOE, tensors=(
    TensorKind("pre_mlp_layernorm.weight", hidden, REPLICATED, norm_weight=True),
    TensorKind("pre_mlp_layernorm.bias", hidden, REPLICATED, layernorm),
    # The router's weight is in the run's dtype (megatron-core's TopKRouter casts it to params_dtype, Float16Module
    # casts the whole model); its expert bias is a buffer megatron-core keeps in float32 whatever the run's dtype.
    TensorKind("mlp.router.weight", lambda c: (_experts(c), c.hidden_size), REPLICATED),
    # The router's bias (megatron-core's TopKRouter with add_bias_linear; GPT-OSS).
    TensorKind("mlp.router.bias", lambda c: (_experts(c),), REPLICATED, linear_bias),
    TensorKind("mlp.router.expert_bias", lambda c: (_experts(c),), REPLICATED, _expert_bias, keep_dtype=True),
    RoutedExperts(EXPERT_TENSORS),
    TensorKind("mlp.shared_experts.linear_fc1.weight", lambda c: (_shared_fc1_rows(c), c.hidden_size),
               fc1_rule, _shared_experts),
    TensorKind("mlp.shared_experts.linear_fc2.weight", lambda c: (c.hidden_size, _shared_size(c)), ROW,
               _shared_experts),
    TensorKind("mlp.shared_experts.gate_weight", lambda c: (1, c.hidden_size), REPLICATED, _shared_gate),
), te_modules=(
    RoutedExperts(tuple(TEModule(name) for name in TE_EXPERT_LINEARS)),
    *(TEModule(name, _shared_experts) for name in TE_SHARED_EXPERT_LINEARS),
))
