"""Qwen3.5 text models (``Qwen3_5ForCausalLM``, ``Qwen3_5MoeForCausalLM``): Qwen3-Next's layers with the gated
delta net's input projections stored apart.

transformers 5.x (``models/qwen3_5``, ``models/qwen3_5_moe``) builds the same model as Qwen3-Next
(``pgconvert.families.qwen3_next``): gated delta net and gated-attention layers as ``layer_types`` says (absent:
every fourth layer full), q/k norms per head, partial rotary 0.25, Qwen3NextRMSNorm's zero-centred ``1 + w``
norms and the gated delta net's output norm computing with ``w`` as stored. What differs:

- ``linear_attn.in_proj_qkv`` (``[q; k; v]``, each over every head), ``in_proj_z``, ``in_proj_b`` and
  ``in_proj_a`` are four tensors whose rows, one after the other, are megatron-core's
  ``self_attention.in_proj`` ``[q; k; v; z; beta; alpha]`` (``QKVZBARows``); no regrouping by key head.
- Qwen3.5 (dense): an MLP in every layer, ``intermediate_size``.
- Qwen3.5-MoE: a MoE block in every layer (no ``decoder_sparse_step`` / ``mlp_only_layers``) whose router
  always renormalizes the top-k softmax weights (no ``norm_topk_prob``), with the shared expert behind its
  sigmoid gate; the config has no dense ``intermediate_size`` (megatron-core's ``ffn_hidden_size`` is set to
  the experts' size, which no layer uses).

The released checkpoints are the vision-language ``Qwen3_5ForConditionalGeneration`` (their language model under
``model.language_model.``) and store a multi-token-prediction layer (``mtp.*``), converted as Qwen3-Next's. ``rope_parameters``' ``mrope_section`` / ``mrope_interleaved`` (the vision model's 3-D positions) are
kept for the round trip: on text every position component is the same, which is plain RoPE.
"""

from __future__ import annotations

from pgconvert.families.experts import AUX_LOSS, EVERY_LAYER_MOE, expert_count, expert_ffn_size
from pgconvert.families.llama import (ATTENTION_ROWS, DENSE_MLP_ROWS, EMBEDDING_ROWS, FINAL_ROWS, HEAD_DIM_NULL,
                                      decoder_fields, head_dim_field, query_groups_field)
from pgconvert.families.qwen import QWEN_MOE_ROWS, SHARED_EXPERT_ROWS
from pgconvert.families.qwen3_next import (GDN_PREFIX, GDN_ROWS, HF_LINEAR_ATTN, LAYER_TYPES_RULE, MTP_OWN_ROWS,
                                           MTP_RULE, PARTIAL_ROPE_RULE, QWEN3_NEXT, linear_field)
from pgconvert.families.table import ConcatenatedRows, ConfigField, Family, TensorMapping, TensorTable
from pgconvert.model.config import ModelConfig


class QKVZBARows(ConcatenatedRows):
    """``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a`` <-> megatron-core's ``in_proj``
    ``[q; k; v; z; beta; alpha]``: the parts' rows one after the other."""

    name = "qkv-z-b-a-rows"
    parts = 4

    def part_rows(self, shape: tuple[int, ...], config: ModelConfig) -> tuple[int, ...]:
        linear = config.linear_attention
        keys = linear.linear_num_key_heads * linear.linear_key_head_dim
        values = linear.linear_num_value_heads * linear.linear_value_head_dim
        heads = linear.linear_num_value_heads
        return 2 * keys + values, values, heads, heads


QKVZBA_ROWS = QKVZBARows()
_IN_PROJ = tuple(HF_LINEAR_ATTN + f"in_proj_{part}.weight" for part in ("qkv", "z", "b", "a"))
GDN_SEPARATE_ROWS = (
    *(row for row in GDN_ROWS if row.canonical != GDN_PREFIX + "in_proj.weight"),
    TensorMapping(GDN_PREFIX + "in_proj.weight", _IN_PROJ, QKVZBA_ROWS),
)


def _decoder_fields(query_groups: int) -> tuple[ConfigField, ...]:
    """The config class's decoder and gated delta net fields (``query_groups``: its num_key_value_heads default)."""
    return (
        *decoder_fields(max_position_embeddings=32768,
                        query_groups=query_groups_field(query_groups,
                                                        null_refused="transformers' attention divides the heads "
                                                                     "by num_key_value_heads as given"),
                        head_dim=head_dim_field(256, null_refused=HEAD_DIM_NULL)),
        linear_field("linear_conv_kernel_dim", 4),
        linear_field("linear_key_head_dim", 128),
        linear_field("linear_value_head_dim", 128),
        linear_field("linear_num_key_heads", 16),
        linear_field("linear_num_value_heads", 32),
    )


QWEN3_5 = Family(
    architecture="Qwen3_5ForCausalLM",
    model_type="qwen3_5_text",
    hf_computes=frozenset({"rotary_percent"}),
    tensors=TensorTable((*EMBEDDING_ROWS, *ATTENTION_ROWS, *GDN_SEPARATE_ROWS, *DENSE_MLP_ROWS, *FINAL_ROWS,
                         *MTP_OWN_ROWS)),
    fields=(*_decoder_fields(4), ConfigField(("intermediate_size",), "ffn_hidden_size", int, default=12288)),
    rules=(PARTIAL_ROPE_RULE, LAYER_TYPES_RULE, MTP_RULE),
    fixed={**{key: value for key, value in QWEN3_NEXT.fixed.items() if not key.startswith("moe_")},
           "num_experts": None},
    hf_fixed=QWEN3_NEXT.hf_fixed,
    hf_scratch=QWEN3_NEXT.hf_scratch,
    hf_norms_zero_centred=True,
    hf_mtp_layers_key=QWEN3_NEXT.hf_mtp_layers_key,
    hf_mtp_layers_absent=QWEN3_NEXT.hf_mtp_layers_absent,
    hf_mtp_layers_alias=QWEN3_NEXT.hf_mtp_layers_alias,
    hf_mtp_block=QWEN3_NEXT.hf_mtp_block,
    megatron_defaults={"transformer_impl": "transformer_engine"},
    hf_notes={key: value for key, value in QWEN3_NEXT.hf_notes.items() if not key.startswith("moe")},
)


QWEN3_5_MOE = QWEN3_5.derive(
    "Qwen3_5MoeForCausalLM", "qwen3_5_moe_text",
    tensors=TensorTable((*EMBEDDING_ROWS, *ATTENTION_ROWS, *GDN_SEPARATE_ROWS, *QWEN_MOE_ROWS, *SHARED_EXPERT_ROWS,
                         *FINAL_ROWS, *MTP_OWN_ROWS)),
    fields=(*_decoder_fields(2),
            ConfigField(("moe_intermediate_size",), "moe_ffn_hidden_size", int, default=512,
                        written=expert_ffn_size),
            expert_count("num_experts", 256),
            ConfigField(("num_experts_per_tok",), "moe_router_topk", int, default=8),
            ConfigField(("shared_expert_intermediate_size",), "moe_shared_expert_intermediate_size", int,
                        default=512),
            AUX_LOSS),
    rules=(EVERY_LAYER_MOE,),
    fixed={**{key: value for key, value in QWEN3_NEXT.fixed.items() if key.startswith("moe_")},
           "moe_router_pre_softmax": False},
    megatron_defaults=QWEN3_NEXT.megatron_defaults,
    hf_notes={"moe pre-softmax": "never (the router renormalizes the top-k weights)"},
)
