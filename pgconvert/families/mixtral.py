"""Mixtral (``MixtralForCausalLM``): Mistral's decoder with every MLP a mixture of experts.

transformers 5 fuses the experts of a layer in memory (``gate_up_proj``), but ``save_pretrained``
writes, and ``from_pretrained`` reads, one tensor per expert and projection (``block_sparse_moe``'s
``w1``/``w3``/``w2``), as below; ``intermediate_size`` is the experts' FFN.
"""

from __future__ import annotations

from pgconvert.families.experts import AUX_LOSS, EVERY_LAYER_MOE, ROUTED_EXPERTS_ONLY, expert_count, expert_ffn_size
from pgconvert.families.llama import (
    ATTENTION_ROWS,
    EMBEDDING_ROWS,
    FINAL_ROWS,
    HF_SILU,
    ROPE_DEFAULT,
    ROPE_RULE,
    decoder_fields,
    query_groups_field,
)
from pgconvert.families.sliding_window import EVERY_LAYER_WINDOW
from pgconvert.families.table import GATE_UP, ConfigField, Family, TensorMapping, TensorTable

# Routed experts: the second slot is the expert's global index.
MIXTRAL_MOE_ROWS = (
    TensorMapping("decoder.layers.{}.mlp.router.weight", ("model.layers.{}.block_sparse_moe.gate.weight",)),
    TensorMapping("decoder.layers.{}.mlp.experts.local_experts.{}.linear_fc1.weight", (
        "model.layers.{}.block_sparse_moe.experts.{}.w1.weight",
        "model.layers.{}.block_sparse_moe.experts.{}.w3.weight",
    ), GATE_UP),
    TensorMapping("decoder.layers.{}.mlp.experts.local_experts.{}.linear_fc2.weight",
                  ("model.layers.{}.block_sparse_moe.experts.{}.w2.weight",)),
)
MIXTRAL_TENSORS = TensorTable((*EMBEDDING_ROWS, *ATTENTION_ROWS, *MIXTRAL_MOE_ROWS, *FINAL_ROWS))

# Built from Mistral's pieces, not derived from it: derive would add the every-layer-MoE rule after
# the window rule, and so reorder the reasons a model does not fit.
MIXTRAL = Family(
    architecture="MixtralForCausalLM",
    model_type="mixtral",
    tensors=MIXTRAL_TENSORS,
    fields=(
        *decoder_fields(max_position_embeddings=131072, norm_epsilon=1e-5, rotary_base=1e6,
                        query_groups=query_groups_field(8)),
        ConfigField(("intermediate_size",), "moe_ffn_hidden_size", int, written=expert_ffn_size),
        expert_count("num_local_experts", 8, "num_experts"),
        ConfigField(("num_experts_per_tok",), "moe_router_topk", int, default=2),
        AUX_LOSS,
    ),
    rules=(EVERY_LAYER_MOE, ROPE_RULE, EVERY_LAYER_WINDOW),
    fixed={**ROUTED_EXPERTS_ONLY, "qk_layernorm": False, "add_qkv_bias": False, "add_bias_linear": False},
    hf_fixed=HF_SILU,
    hf_scratch=ROPE_DEFAULT,
    hf_notes={"sliding window": "sliding_window"},
    hf_loaded_modules=(("block_sparse_moe", "mlp"),),
)
