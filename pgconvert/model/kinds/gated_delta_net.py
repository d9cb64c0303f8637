"""A gated delta net mixer (megatron-core's GatedDeltaNet in a TransformerLayer) with its input norm.

Facts from megatron-core 0.16.1 (``ssm/gated_delta_net.py``,
``models/gpt/experimental_attention_variant_module_specs.py``):

- The layer is a TransformerLayer whose ``self_attention`` is a GatedDeltaNet; the spec
  (``get_gated_delta_net_module_spec``, Transformer Engine only) fuses the input norm into ``in_proj``
  (TELayerNormColumnParallelLinear: ``self_attention.in_proj.layer_norm_weight``); canonically it is the
  layer's ``input_layernorm``, as in an attention layer.
- ``in_proj`` is column-parallel (``gather_output=False``) and its output rows are
  ``[query; key; value; z; beta; alpha]``: q and k ``linear_num_key_heads × linear_key_head_dim`` rows
  each, v and the output gate z ``linear_num_value_heads × linear_value_head_dim`` each, beta and alpha
  one per value head. The forward splits its local rows with the local sizes (``qk_dim // tp_size`` …),
  so each of the six is split over TP on its own and rank r holds ``[q_r; k_r; v_r; z_r; beta_r; alpha_r]``:
  the ``Segmented`` rule; rank r's key heads are the ones its value heads read (value heads
  ``linear_num_value_heads / linear_num_key_heads`` per key head, ``repeat_interleave``).
- ``conv1d`` is a depthwise ``nn.Conv1d`` over the local ``[q; k; v]`` channels (weight
  ``[channels, 1, linear_conv_kernel_dim]``, no bias: the spec passes no ``conv_bias``), segmented the same way.
- ``dt_bias`` and ``A_log`` hold the rank's value heads: column-parallel.
- ``out_norm`` is an RMSNorm over one value head (``linear_value_head_dim``), the same on every rank;
  ``out_proj`` is row-parallel. Neither projection has a bias (GatedDeltaNet's ``bias=False``).
- In a distributed checkpoint (``GatedDeltaNet.sharded_state_dict``'s ``_split_tensor_factory``) each
  segment of ``in_proj.weight`` is a key of its own (``.query`` … ``.alpha``) and so is each of
  ``conv1d.weight``'s (``.query``, ``.key``, ``.value``): ``dist_segments``.

Rows are in megatron-core's state-dict order: the mixer's own parameters (dt_bias, A_log), then its
submodules (in_proj with its fused norm, conv1d, out_norm, out_proj).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pgconvert.model.kinds.table import LayerKind, TEModule, TensorKind, hidden
from pgconvert.model.layers import GATED_DELTA_NET
from pgconvert.model.rules import COLUMN, REPLICATED, ROW, Segmented, ShardRule

if TYPE_CHECKING:
    from pgconvert.model.config import ModelConfig

GDN_MODULE = "self_attention."
TE_GDN_LINEARS = (GDN_MODULE + "in_proj", GDN_MODULE + "out_proj")
# The input norm's name under the Transformer Engine spec (fused into in_proj).
GDN_FUSED_NORM = GDN_MODULE + "in_proj.layer_norm_"
IN_PROJ_SEGMENTS = ("query", "key", "value", "z", "beta", "alpha")
CONV_SEGMENTS = ("query", "key", "value")


def in_proj_rows(config: ModelConfig) -> tuple[int, ...]:
    """The rows of ``in_proj``'s segments query, key, value, z, beta, alpha (global)."""
    linear = config.linear_attention
    heads = linear.linear_num_value_heads
    return (linear.key_dim, linear.key_dim, linear.value_dim, linear.value_dim, heads, heads)


def conv_rows(config: ModelConfig) -> tuple[int, ...]:
    """The channels of the convolution's segments query, key, value (global)."""
    linear = config.linear_attention
    return (linear.key_dim, linear.key_dim, linear.value_dim)


def in_proj_rule(config: ModelConfig) -> ShardRule:
    return Segmented(in_proj_rows(config), IN_PROJ_SEGMENTS)


def conv_rule(config: ModelConfig) -> ShardRule:
    return Segmented(conv_rows(config), CONV_SEGMENTS)


def _value_heads(config: ModelConfig) -> tuple[int, ...]:
    return (config.linear_attention.linear_num_value_heads,)


def _conv_weight(config: ModelConfig) -> tuple[int, ...]:
    return (config.linear_attention.conv_rows, 1, config.linear_attention.linear_conv_kernel_dim)


KIND = LayerKind(GATED_DELTA_NET, tensors=(
    TensorKind(GDN_MODULE + "dt_bias", _value_heads, COLUMN),
    TensorKind(GDN_MODULE + "A_log", _value_heads, COLUMN),
    TensorKind("input_layernorm.weight", hidden, REPLICATED, te_name=GDN_FUSED_NORM + "weight", norm_weight=True),
    TensorKind(GDN_MODULE + "in_proj.weight", lambda c: (sum(in_proj_rows(c)), c.hidden_size), in_proj_rule,
               dist_segments=IN_PROJ_SEGMENTS),
    TensorKind(GDN_MODULE + "conv1d.weight", _conv_weight, conv_rule, dist_segments=CONV_SEGMENTS),
    TensorKind(GDN_MODULE + "out_norm.weight", lambda c: (c.linear_attention.linear_value_head_dim,), REPLICATED,
               norm_weight=True),
    TensorKind(GDN_MODULE + "out_proj.weight", lambda c: (c.hidden_size, c.linear_attention.value_dim), ROW),
), te_modules=tuple(TEModule(name) for name in TE_GDN_LINEARS))
