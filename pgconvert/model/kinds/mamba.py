"""A Mamba-2 mixer layer (megatron-core's MambaLayer around its MambaMixer) with its input norm.

Facts from megatron-core 0.16.1 (``ssm/mamba_layer.py``, ``ssm/mamba_mixer.py``,
``models/mamba/mamba_layer_specs.py``):

- ``in_proj`` is a ColumnParallelLinear (``gather_output=False``) whose output rows are
  ``[z; x; B; C; dt]``: z and x ``nheads × headdim`` rows each, B and C ``ngroups × d_state`` each,
  dt ``nheads``. Each of the five is split over TP on its own (the mixer splits its local rows with
  the local sizes: ``d_inner_local_tp``, ``ngroups_local_tp * d_state``, ``nheads_local_tp``), so a
  rank holds ``[z_r; x_r; B_r; C_r; dt_r]``: the ``Segmented`` rule.
- ``conv1d`` is a depthwise ``nn.Conv1d`` over the local ``[x; B; C]`` channels (weight
  ``[channels, 1, d_conv]``, bias ``[channels]``), segmented the same way.
- ``A_log``, ``D`` (``D_has_hdim=False``: one per head) and ``dt_bias`` hold the rank's heads:
  column-parallel over heads.
- ``norm`` is the gated RMSNorm over ``d_inner`` with ``group_size = d_inner / ngroups``: the rank's
  ``d_inner / tp`` rows are whole groups (tp divides ngroups), column-parallel.
- ``out_proj`` is a RowParallelLinear: split by columns.
- In a distributed checkpoint (``MambaMixer.sharded_state_dict``'s ``_split_tensor_factory``) each segment of
  ``in_proj.weight`` is a key of its own, ``in_proj.weight.z`` … ``.dt`` of the segment's global rows, and so are
  ``conv1d.weight``'s and ``conv1d.bias``'s (``.x``, ``.B``, ``.C``): ``dist_segments``.
- The layer's input norm: the TE spec (the only Mamba spec megatron-core ships) fuses it into
  ``in_proj`` (TELayerNormColumnParallelLinear, ``mixer.in_proj.layer_norm_weight``); canonically it
  is the layer's ``norm`` (MambaLayer's own norm submodule).

Rows are in megatron-core's state-dict order: the mixer's own parameters (dt_bias, A_log, D), then
its submodules (in_proj with its fused norm, conv1d, norm, out_proj).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pgconvert.model.kinds.table import LayerKind, TEModule, TensorKind, fused_norm_name, hidden
from pgconvert.model.layers import MAMBA
from pgconvert.model.rules import COLUMN, REPLICATED, ROW, Segmented, ShardRule

if TYPE_CHECKING:
    from pgconvert.model.config import ModelConfig

TE_MAMBA_LINEARS = ("mixer.in_proj", "mixer.out_proj")
IN_PROJ_SEGMENTS = ("z", "x", "B", "C", "dt")
CONV_SEGMENTS = ("x", "B", "C")
# MambaMixer's convolution width (its ``d_conv`` argument, 4; no TransformerConfig field).
MAMBA_CONV_WIDTH = 4


def in_proj_rows(config: ModelConfig) -> tuple[int, ...]:
    """The rows of ``in_proj``'s segments z, x, B, C, dt (global)."""
    mamba = config.mamba
    return (mamba.d_inner, mamba.d_inner, mamba.group_state_rows, mamba.group_state_rows, mamba.num_heads)


def conv_rows(config: ModelConfig) -> tuple[int, ...]:
    """The channels of the convolution's segments x, B, C (global)."""
    mamba = config.mamba
    return (mamba.d_inner, mamba.group_state_rows, mamba.group_state_rows)


def in_proj_rule(config: ModelConfig) -> ShardRule:
    return Segmented(in_proj_rows(config), IN_PROJ_SEGMENTS)


def conv_rule(config: ModelConfig) -> ShardRule:
    return Segmented(conv_rows(config), CONV_SEGMENTS)


def _heads(config: ModelConfig) -> tuple[int, ...]:
    return (config.mamba.num_heads,)


def _conv_weight(config: ModelConfig) -> tuple[int, ...]:
    return (config.mamba.conv_rows, 1, MAMBA_CONV_WIDTH)


KIND = LayerKind(MAMBA, tensors=(
    TensorKind("mixer.dt_bias", _heads, COLUMN),
    TensorKind("mixer.A_log", _heads, COLUMN),
    TensorKind("mixer.D", _heads, COLUMN),
    TensorKind("norm.weight", hidden, REPLICATED, te_name=fused_norm_name("norm.weight"), norm_weight=True),
    TensorKind("mixer.in_proj.weight", lambda c: (sum(in_proj_rows(c)), c.hidden_size), in_proj_rule,
               dist_segments=IN_PROJ_SEGMENTS),
    TensorKind("mixer.conv1d.weight", _conv_weight, conv_rule, dist_segments=CONV_SEGMENTS),
    TensorKind("mixer.conv1d.bias", lambda c: (c.mamba.conv_rows,), conv_rule, dist_segments=CONV_SEGMENTS),
    TensorKind("mixer.norm.weight", lambda c: (c.mamba.d_inner,), COLUMN),
    TensorKind("mixer.out_proj.weight", lambda c: (c.hidden_size, c.mamba.d_inner), ROW),
), te_modules=tuple(TEModule(name) for name in TE_MAMBA_LINEARS))
