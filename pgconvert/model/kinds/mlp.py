"""The dense MLP (megatron-core's MLP) with its pre-MLP norm and the optional post-MLP norm."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pgconvert.model.kinds.table import (LayerKind, TEModule, TensorKind, fc1_rule, fused_norm_name, hidden,
                                         linear_bias, pre_mlp_norm, pre_mlp_norm_bias)
from pgconvert.model.layers import DENSE_MLP
from pgconvert.model.rules import REPLICATED, ROW

if TYPE_CHECKING:
    from pgconvert.model.config import ModelConfig

TE_DENSE_MLP_LINEARS = ("mlp.linear_fc1", "mlp.linear_fc2")


def _post_mlp_norm(config: ModelConfig) -> bool:
    return config.norms.post_mlp_layernorm


def _fc1_rows(c: ModelConfig) -> tuple[int, ...]:
    return (c.mlp.fc1_rows,)


KIND = LayerKind(DENSE_MLP, tensors=(
    TensorKind("pre_mlp_layernorm.weight", hidden, REPLICATED, pre_mlp_norm,
               te_name=fused_norm_name("pre_mlp_layernorm.weight"), norm_weight=True),
    TensorKind("pre_mlp_layernorm.bias", hidden, REPLICATED, pre_mlp_norm_bias,
               te_name=fused_norm_name("pre_mlp_layernorm.bias")),
    TensorKind("mlp.linear_fc1.weight", lambda c: (c.mlp.fc1_rows, c.hidden_size), fc1_rule),
    TensorKind("mlp.linear_fc1.bias", _fc1_rows, fc1_rule, linear_bias),
    TensorKind("mlp.linear_fc2.weight", lambda c: (c.hidden_size, c.mlp.ffn_hidden_size), ROW),
    TensorKind("mlp.linear_fc2.bias", hidden, REPLICATED, linear_bias),
    # The post-MLP norm, inside linear_fc2 as Megatron-Bridge's Gemma 2/3 specs place it.
    TensorKind("mlp.linear_fc2.post_layernorm.weight", hidden, REPLICATED, _post_mlp_norm, norm_weight=True),
), te_modules=tuple(TEModule(name) for name in TE_DENSE_MLP_LINEARS))
