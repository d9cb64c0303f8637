"""Qwen3-Next (``Qwen3NextForCausalLM``): gated delta net and gated attention layers with a Qwen MoE.

transformers 5.x (``models/qwen3_next``) makes each layer ``linear_attention`` or ``full_attention`` as
``layer_types`` says (absent: ``full_attention_interval``, 4: every fourth layer full), megatron-core 0.16.1's
``experimental_attention_variant="gated_delta_net"`` with ``linear_attention_freq`` (an interval N means the
same layers; any other pattern is the 0/1 list; pgconvert.model.layers). Megatron names follow
Megatron-Bridge's ``src/megatron/bridge/models/qwen/qwen3_next_bridge.py``:

- ``linear_attn.in_proj_qkvz`` and ``in_proj_ba`` are grouped by key head (``[q_g; k_g; v_g; z_g]`` and
  ``[b_g; a_g]`` for key head g, v, z, b and a of the value heads that read it, ``fix_query_key_value_ordering``);
  megatron-core's ``self_attention.in_proj`` is ``[q; k; v; z; beta; alpha]``, each over every head
  (``GroupedQKVZBA``). ``conv1d`` is ``[q; k; v]`` on both sides; ``A_log``, ``dt_bias``, ``out_proj`` as they are.
- ``linear_attn.norm`` (Qwen3NextRMSNormGated) computes with its weight ``w``; megatron-core's ``out_norm``
  is a TENorm with the model's zero-centred gamma, computing with ``1 + w'``: ``w' = w - 1``
  (``PlainAsZeroCentred``; exact where ``w`` is in [0.5, 2], as for an initial 1). Every other norm is
  Qwen3NextRMSNorm, ``1 + w``: the same numbers as megatron-core's zero-centred ones
  (``hf_norms_zero_centred``).
- ``self_attn.q_proj`` holds each head's query then its gate (``attention_output_gate``: the fused
  ``linear_qkv`` groups a query group's heads, then their gates: ``FuseQKVByGroup``); q/k norms per head;
  partial rotary (``partial_rotary_factor`` 0.25 in ``rope_parameters``).
- MoE on the layers ``decoder_sparse_step`` and ``mlp_only_layers`` give (dense ``mlp`` on the others),
  softmax routing with ``norm_topk_prob`` (true by default here), and a shared expert behind a sigmoid
  gate (megatron-core's ``moe_shared_expert_gate``), as Qwen2-MoE.

The released checkpoints also store a multi-token-prediction layer (``mtp.*``, ``mtp_num_hidden_layers`` 1), which
transformers does not load: megatron-core's ``mtp.layers.0`` (``pgconvert.families.mtp``, ``MTP_BLOCK``), whose
transformer layer is the last decoder layer's kind (Megatron-LM's ``gpt_builder``), so that layer must be gated
attention, as Qwen's MTP layer is. ``mtp_use_dedicated_embeddings`` (an MTP embedding of its own) is refused.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from pgconvert.families.experts import AUX_LOSS, expert_count, expert_ffn_size
from pgconvert.families.llama import (ATTENTION_ROWS, DENSE_MLP_ROWS, EMBEDDING_ROWS, FINAL_ROWS, HEAD_DIM_NULL,
                                      HF_SILU, ROPE_DEFAULT, SWIGLU_RMS_ROPE, decoder_fields, head_dim_field,
                                      partial_rope_rule, query_groups_field)
from pgconvert.families.qwen import (NORM_TOPK_NOTE, PRE_SOFTMAX, QWEN_MOE_ROWS, SHARED_EXPERT_ROWS,
                                     SHARED_EXPERT_SPARSE_STEP, norm_topk_rule)
from pgconvert.families.sliding_window import period_of, periodic_layers
from pgconvert.families.mtp import HF_LAYER, MTP_ROWS
from pgconvert.families.table import (ConfigField, ConfigRule, Family, MTPBlock, TensorMapping, TensorTable, Transform,
                                      read_nothing, write_nothing)
from pgconvert.io.limits import quote
from pgconvert.io.reuse import joined
from pgconvert.model.config import ModelConfig
from pgconvert.model.layers import SELF_ATTENTION

HF_LINEAR_ATTN = "model.layers.{}.linear_attn."
GDN_PREFIX = "decoder.layers.{}.self_attention."
LINEAR, FULL = "linear_attention", "full_attention"
# Qwen3NextConfig's default interval (its __post_init__'s full_attention_interval).
FULL_ATTENTION_INTERVAL = 4


class GroupedQKVZBA(Transform):
    """``in_proj_qkvz`` and ``in_proj_ba`` (grouped by key head) <-> megatron-core's ``in_proj``
    ``[q; k; v; z; beta; alpha]``::

        in_proj_qkvz [q0 k0 v0 z0 | q1 k1 v1 z1]          in_proj [q0 q1 k0 k1 v0 v1 z0 z1 b0 b1 a0 a1]
        in_proj_ba   [b0 a0 | b1 a1]                  ->

    (each entry the rows of key head g: q and k one key head, v and z, b and a the value heads it serves).
    """

    name = "grouped-qkvz-ba"
    parts = 2

    @staticmethod
    def _group_rows(config: ModelConfig) -> tuple[int, tuple[int, ...], tuple[int, ...]]:
        """Key heads, a group's qkvz rows (q, k, v, z) and its ba rows (b, a)."""
        linear = config.linear_attention
        groups = linear.linear_num_key_heads
        per_group = linear.linear_num_value_heads // groups
        values = per_group * linear.linear_value_head_dim
        return groups, (linear.linear_key_head_dim,) * 2 + (values,) * 2, (per_group, per_group)

    def fuse(self, parts: Sequence[torch.Tensor], config: ModelConfig) -> torch.Tensor:
        groups, qkvz, ba = self._group_rows(config)
        segments = []
        for part, rows in zip(parts, (qkvz, ba)):
            rest = tuple(part.shape[1:])
            by_group = part.reshape(groups, sum(rows), *rest)
            segments += [piece.reshape(groups * piece.shape[1], *rest) for piece in by_group.split(rows, dim=1)]
        return joined(segments, dim=0)

    def split(self, full: torch.Tensor, config: ModelConfig) -> list[torch.Tensor]:
        groups, qkvz, ba = self._group_rows(config)
        rest = tuple(full.shape[1:])
        segments = full.split([groups * rows for rows in (*qkvz, *ba)], dim=0)
        parts = []
        for pieces in (segments[:4], segments[4:]):
            by_group = [piece.reshape(groups, -1, *rest) for piece in pieces]
            parts.append(torch.cat(by_group, dim=1).reshape(-1, *rest))
        return parts

    def part_shapes(self, shape: tuple[int, ...], config: ModelConfig) -> list[tuple[int, ...]]:
        groups, qkvz, ba = self._group_rows(config)
        return [(groups * sum(qkvz), *shape[1:]), (groups * sum(ba), *shape[1:])]


class PlainAsZeroCentred(Transform):
    """A norm weight HF computes with as it is <-> megatron-core's zero-centred gamma (``w - 1``), in float32
    rounded once to the tensor's dtype (exact for weights in [0.5, 2])."""

    name = "plain-as-zero-centred"
    parts = 1

    def fuse(self, parts: Sequence[torch.Tensor], config: ModelConfig) -> torch.Tensor:
        return (parts[0].to(torch.float32) - 1.0).to(parts[0].dtype)

    def split(self, full: torch.Tensor, config: ModelConfig) -> list[torch.Tensor]:
        return [(full.to(torch.float32) + 1.0).to(full.dtype)]

    def part_shapes(self, shape: tuple[int, ...], config: ModelConfig) -> list[tuple[int, ...]]:
        return [shape]

    def changed_values(self, parts: Sequence[torch.Tensor], fused: torch.Tensor, config: ModelConfig) -> int:
        """Weights outside [0.5, 2] may lose low bits to ``w - 1`` in their dtype (bf16: below 0.5)."""
        return int((self.split(fused, config)[0] != parts[0]).sum())


GROUPED_QKVZ_BA = GroupedQKVZBA()
PLAIN_AS_ZERO_CENTRED = PlainAsZeroCentred()

GDN_ROWS = (
    *(TensorMapping(GDN_PREFIX + name, (HF_LINEAR_ATTN + name,)) for name in ("dt_bias", "A_log", "conv1d.weight", "out_proj.weight")),
    TensorMapping(GDN_PREFIX + "in_proj.weight", (HF_LINEAR_ATTN + "in_proj_qkvz.weight", HF_LINEAR_ATTN + "in_proj_ba.weight"),
                  GROUPED_QKVZ_BA),
    TensorMapping(GDN_PREFIX + "out_norm.weight", (HF_LINEAR_ATTN + "norm.weight",), PLAIN_AS_ZERO_CENTRED),
)


def _pattern_of(present: Mapping[str, object], layers: int) -> tuple[int, ...]:
    """1 for each linear layer: ``layer_types``, else every ``full_attention_interval``-th layer full."""
    kinds = present.get("layer_types")
    if kinds is not None:
        if not isinstance(kinds, list) or len(kinds) != layers or set(kinds) - {LINEAR, FULL}:
            raise ValueError(f"layer_types={quote(kinds)}: expected {LINEAR!r} or {FULL!r} for each of the "
                             f"{layers} layers")
        return tuple(int(kind == LINEAR) for kind in kinds)
    interval = present.get("full_attention_interval", FULL_ATTENTION_INTERVAL)
    if not isinstance(interval, int) or isinstance(interval, bool) or interval < 1:
        raise ValueError(f"full_attention_interval={quote(interval)}: expected a positive integer")
    return periodic_layers(layers, interval)


def _read_layer_types(present: Mapping[str, object], model: Mapping[str, object]) -> Mapping[str, object]:
    """megatron-core's interval where the pattern is one (every N-th layer full), else the 0/1 list."""
    layers = model["num_layers"]
    assert isinstance(layers, int)
    pattern = _pattern_of(present, layers)
    return {"linear_attention_freq": period_of(pattern) or pattern}


def _write_layer_types(config: ModelConfig) -> Mapping[str, object]:
    return {"layer_types": [LINEAR if layer.mixer != SELF_ATTENTION else FULL for layer in config.layers]}


LAYER_TYPES_RULE = ConfigRule(keys=("layer_types",), model_fields=("linear_attention_freq",), read=_read_layer_types,
                              write=_write_layer_types, legacy_keys=("full_attention_interval",),
                              null_keys=("full_attention_interval",))

# Qwen3NextConfig computes partial rotary (its rope_parameters' partial_rotary_factor, 0.25 by default).
QWEN3_NEXT_PARTIAL_ROTARY = 0.25
PARTIAL_ROPE_RULE = partial_rope_rule(QWEN3_NEXT_PARTIAL_ROTARY, "Qwen3-Next")


# The released checkpoints' MTP module (Megatron-Bridge's qwen3_next bridge maps the same names): its own tensors
# by the rest of the table's name (pgconvert.families.mtp.MTP_ROWS), its layer under mtp.layers.0.
MTP_BLOCK = MTPBlock(own={"eh_proj.weight": "mtp.fc.weight", "enorm.weight": "mtp.pre_fc_norm_embedding.weight",
                          "hnorm.weight": "mtp.pre_fc_norm_hidden.weight", "shared_head.norm.weight": "mtp.norm.weight"},
                     layers="mtp.layers.", own_embedding_key="mtp_use_dedicated_embeddings")
MTP_OWN_ROWS = tuple(row for row in MTP_ROWS if row.hf[0].removeprefix(HF_LAYER) in MTP_BLOCK.own)


def _refuses_linear_mtp_layer(config: ModelConfig) -> str | None:
    """Megatron-LM builds the MTP layer as the last decoder layer; Qwen's MTP layer is gated attention."""
    if config.mtp_num_layers and config.layers[-1].mixer != SELF_ATTENTION:
        return (f"mtp_num_layers={config.mtp_num_layers} with a gated delta net as the last layer (megatron-core's MTP "
                "layer is built as the last decoder layer; Qwen's is gated attention)")
    return None


MTP_RULE = ConfigRule(keys=(), model_fields=(), read=read_nothing, write=write_nothing,
                      refuses=_refuses_linear_mtp_layer)


def linear_field(key: str, default: int) -> ConfigField:
    return ConfigField((key,), key, int, default=default)


QWEN3_NEXT = Family(
    architecture="Qwen3NextForCausalLM",
    model_type="qwen3_next",
    hf_computes=PRE_SOFTMAX | {"rotary_percent"},
    tensors=TensorTable((*EMBEDDING_ROWS, *ATTENTION_ROWS, *GDN_ROWS, *DENSE_MLP_ROWS, *QWEN_MOE_ROWS,
                         *SHARED_EXPERT_ROWS, *FINAL_ROWS, *MTP_OWN_ROWS)),
    fields=(
        *decoder_fields(max_position_embeddings=32768,
                        query_groups=query_groups_field(2, null_refused="transformers' attention divides the heads "
                                                                        "by num_key_value_heads as given"),
                        head_dim=head_dim_field(256, null_refused=HEAD_DIM_NULL)),
        ConfigField(("intermediate_size",), "ffn_hidden_size", int, default=5632),
        ConfigField(("moe_intermediate_size",), "moe_ffn_hidden_size", int, default=512, written=expert_ffn_size),
        expert_count("num_experts", 512),
        ConfigField(("num_experts_per_tok",), "moe_router_topk", int, default=10),
        ConfigField(("shared_expert_intermediate_size",), "moe_shared_expert_intermediate_size", int, default=512),
        AUX_LOSS,
        linear_field("linear_conv_kernel_dim", 4),
        linear_field("linear_key_head_dim", 128),
        linear_field("linear_value_head_dim", 128),
        linear_field("linear_num_key_heads", 16),
        linear_field("linear_num_value_heads", 32),
    ),
    rules=(SHARED_EXPERT_SPARSE_STEP, PARTIAL_ROPE_RULE, LAYER_TYPES_RULE, norm_topk_rule(True), MTP_RULE),
    fixed={**SWIGLU_RMS_ROPE, "qk_layernorm": True, "add_qkv_bias": False, "add_bias_linear": False,
           "moe_shared_expert_gate": True, "moe_router_enable_expert_bias": False, "sliding_window": None,
           "layernorm_zero_centered_gamma": True, "attention_output_gate": True,
           "experimental_attention_variant": "gated_delta_net"},
    hf_fixed={**HF_SILU, "attention_bias": False},
    hf_scratch=ROPE_DEFAULT,
    hf_norms_zero_centred=True,
    hf_mtp_layers_key="mtp_num_hidden_layers",
    hf_mtp_layers_absent=0,
    hf_mtp_layers_alias=None,
    hf_mtp_block=MTP_BLOCK,
    # megatron-core builds gated delta net layers with the Transformer Engine spec only (its grouped experts
    # too, as Megatron-Bridge's Qwen3-Next provider sets moe_grouped_gemm).
    megatron_defaults={"transformer_impl": "transformer_engine", "moe_grouped_gemm": True},
    hf_notes={"sliding window": "none", "rotary percent": "rope_parameters.partial_rotary_factor (default 0.25)", "qk-norm": "always", "moe pre-softmax": NORM_TOPK_NOTE,
              "zero-centred norm gamma": "always (Qwen3NextRMSNorm computes with 1 + w)"},
)
