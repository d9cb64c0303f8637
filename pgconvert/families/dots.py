"""dots.llm1 (``Dots1ForCausalLM``, rednote-hilab/dots.llm1.base and .inst): Qwen3's attention with DeepSeek-V3's MoE.

transformers' Dots1 attends as Qwen3 does (q/k RMSNorms per head, GQA, RoPE over the whole head, no biases) and
routes as DeepSeek-V3 does (``pgconvert.families.deepseek.sigmoid_group_router``: sigmoid scores steered by
``e_score_correction_bias``, groups scored by their best two, the chosen scores renormalized when
``norm_topk_prob`` and scaled by ``routed_scaling_factor``), with shared experts of ``n_shared_experts`` times
the experts' FFN size and the first ``first_k_dense_replace`` layers dense. Dots1Config's defaults differ from
the release: no renormalization (``norm_topk_prob`` false, which megatron-core's sigmoid router cannot compute,
so it is refused), no dense layer, 32 KV heads, and no default for the expert counts. Layers from
``max_window_layers`` on are windowed when ``sliding_window`` is set (the release: 62 of 62, none windowed),
unless ``layer_types`` says which.
"""

from __future__ import annotations

from collections.abc import Mapping

from pgconvert.families.deepseek import (
    EXPERT_BIAS_ROW,
    SHARED_EXPERTS_ROWS,
    dense_prefix_rule,
    shared_experts_rule,
    sigmoid_group_router,
)
from pgconvert.families.experts import expert_count, expert_ffn_size
from pgconvert.families.llama import (
    ATTENTION_ROWS,
    DENSE_FFN,
    DENSE_MLP_ROWS,
    EMBEDDING_ROWS,
    FINAL_ROWS,
    HEAD_DIM_NULL,
    ROPE_DEFAULT,
    ROPE_RULE,
    SWIGLU_RMS_ROPE,
    decoder_fields,
    head_dim_field,
    query_groups_field,
)
from pgconvert.families.qwen import QWEN_MOE_ROWS
from pgconvert.families.sliding_window import layer_types, layer_types_of, window_of, window_values_sized
from pgconvert.families.table import REQUIRED, ConfigField, ConfigRule, Family, TensorTable
from pgconvert.io.limits import quote
from pgconvert.model.config import ModelConfig

# Dots1Config's defaults.
DOTS_WINDOW = 4096
DOTS_MAX_WINDOW_LAYERS = 62
_TOPK_NULL = "transformers' router takes the top-k as given, and null is no count"


def _read_window(present: Mapping[str, object], model: Mapping[str, object]) -> Mapping[str, object]:
    """``sliding_window`` on the layers ``layer_types`` marks; without it, on the layers from
    ``max_window_layers`` on (none when the window is null), as Dots1Config fills ``layer_types`` in."""
    layers = model["num_layers"]
    assert isinstance(layers, int)
    window = window_of(present, DOTS_WINDOW)
    pattern = layer_types(present, layers)
    if pattern is None:
        first = present.get("max_window_layers", DOTS_MAX_WINDOW_LAYERS)
        if window is not None and (not isinstance(first, int) or isinstance(first, bool)):
            raise ValueError(f"max_window_layers={quote(first)}: Dots1Config compares each layer index with it; "
                             "expected an integer")
        pattern = tuple(int(window is not None and layer >= first) for layer in range(layers))  # type: ignore[operator]
    return window_values_sized(window, pattern)


def _write_window(config: ModelConfig) -> Mapping[str, object]:
    types = layer_types_of(config)
    leading_full = types.index("sliding_attention") if "sliding_attention" in types else config.num_layers
    return {"sliding_window": config.attention.sliding_window, "max_window_layers": leading_full,
            "layer_types": types}


DOTS1 = Family(
    architecture="Dots1ForCausalLM",
    model_type="dots1",
    hf_computes=frozenset({"moe_router_score_function", "moe_router_topk_scaling_factor", "moe_router_num_groups"}),
    tensors=TensorTable((*EMBEDDING_ROWS, *ATTENTION_ROWS, *DENSE_MLP_ROWS, *QWEN_MOE_ROWS, EXPERT_BIAS_ROW,
                         *SHARED_EXPERTS_ROWS, *FINAL_ROWS)),
    fields=(
        # Dots1Config has no head_dim; its attention takes getattr(config, "head_dim", hidden // heads).
        *decoder_fields(max_position_embeddings=2048, norm_epsilon=1e-6, query_groups=query_groups_field(32),
                        head_dim=head_dim_field(null_refused=HEAD_DIM_NULL)),
        DENSE_FFN,
        ConfigField(("moe_intermediate_size",), "moe_ffn_hidden_size", int, default=1408, written=expert_ffn_size),
        expert_count("n_routed_experts", REQUIRED, "num_local_experts"),
        ConfigField(("num_experts_per_tok",), "moe_router_topk", int, null_refused=_TOPK_NULL),
    ),
    rules=(
        ROPE_RULE,
        dense_prefix_rule(default_dense=0),
        shared_experts_rule(default=None),
        sigmoid_group_router(groups=(1, 1), scaling=1.0, norm_topk_default=False),
        ConfigRule(keys=("sliding_window", "max_window_layers", "layer_types"),
                   model_fields=("sliding_window", "window_layers"), read=_read_window, write=_write_window,
                   null_keys=("sliding_window", "max_window_layers")),
    ),
    fixed={
        **SWIGLU_RMS_ROPE,
        "qk_layernorm": True,
        "qk_layernorm_across_heads": False,
        "add_qkv_bias": False,
        "add_bias_linear": False,
        "moe_shared_expert_gate": False,
        "moe_router_enable_expert_bias": True,
        "moe_router_score_function": "sigmoid",
        "moe_router_pre_softmax": False,
    },
    # attention_bias biases q, k, v and o: Megatron has no o-bias without the MLP's.
    hf_fixed={"hidden_act": "silu", "attention_bias": False},
    hf_scratch=ROPE_DEFAULT,
    hf_notes={
        "sliding window": "sliding_window, max_window_layers, layer_types",
        "qk-norm": "always (per head)",
        "moe score function": "sigmoid (fixed)",
        "moe pre-softmax": "norm_topk_prob (must be true: megatron-core's sigmoid router renormalizes)",
        "moe expert bias": "always: mlp.gate.e_score_correction_bias (fp32)",
        "moe top-k scaling": "routed_scaling_factor",
        "moe router groups": "n_group, topk_group (group score: top-2 sum)",
    },
)
