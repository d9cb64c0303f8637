"""Qwen: Qwen2 and Qwen3 (dense), Qwen3-MoE and Qwen2-MoE.

Qwen2 is Llama with q/k/v biases, Qwen3 Llama with per-head q/k norms; their window is
``use_sliding_window`` on the layers ``layer_types`` marks (by default those from
``max_window_layers`` on). The MoE families route with a softmax over every expert
(``norm_topk_prob``: whether the top-k weights are renormalized) and make a layer MoE by
``decoder_sparse_step`` and ``mlp_only_layers``; Qwen2-MoE adds a shared expert behind a sigmoid
gate (megatron-core's ``SharedExpertMLP`` with ``moe_shared_expert_gate``).
"""

from __future__ import annotations

from collections.abc import Mapping

from pgconvert.io.limits import quote
from pgconvert.model.config import ModelConfig
from pgconvert.families.experts import (
    AUX_LOSS,
    ROUTED_EXPERTS_ONLY,
    dense_layers,
    expert_count,
    expert_ffn_size,
    refuses_dense_model,
)
from pgconvert.families.llama import (
    ATTENTION_ROWS,
    DENSE_FFN,
    DENSE_MLP_ROWS,
    EMBEDDING_ROWS,
    FINAL_ROWS,
    HF_SILU,
    LLAMA,
    HEAD_DIM_NULL,
    ROPE_DEFAULT,
    ROPE_RULE,
    decoder_fields,
    head_dim_field,
    max_positions,
    query_groups_field,
)
from pgconvert.families.sliding_window import (
    layer_types,
    layer_types_of,
    refuses_partial_window,
    window_of,
    window_values_sized,
)
from pgconvert.families.table import DROP, GATE_UP, ConfigField, ConfigRule, Family, TensorMapping, TensorTable

# transformers' Qwen2Config/Qwen3Config defaults.
QWEN_MAX_WINDOW_LAYERS = 28
QWEN_WINDOW = 4096
_WINDOW_NOTE = "use_sliding_window, sliding_window, max_window_layers, layer_types"


def _use_sliding_window(present: Mapping[str, object]) -> int | None:
    """``sliding_window`` (absent: 4096, null: none) when ``use_sliding_window`` is true, else None."""
    use = present.get("use_sliding_window", False)
    if not isinstance(use, bool):
        raise ValueError(f"use_sliding_window={quote(use)}: expected true or false")
    return window_of(present, QWEN_WINDOW) if use else None


def _max_window_layers(present: Mapping[str, object]) -> int:
    first = present.get("max_window_layers", QWEN_MAX_WINDOW_LAYERS)
    if not isinstance(first, int) or isinstance(first, bool) or first < 0:
        raise ValueError(f"max_window_layers={quote(first)}: expected a layer count")
    return first


def _read_qwen_window(present: Mapping[str, object], model: Mapping[str, object]) -> Mapping[str, object]:
    """Qwen2, Qwen3: ``use_sliding_window`` turns ``sliding_window`` on for the layers ``layer_types``
    marks ``sliding_attention`` (default: those from ``max_window_layers`` on), as transformers reads it."""
    window = _use_sliding_window(present)
    layers = model["num_layers"]
    assert isinstance(layers, int)
    pattern = layer_types(present, layers)
    if pattern is None:
        first = _max_window_layers(present)
        pattern = tuple(int(window is not None and layer >= first) for layer in range(layers))
    return window_values_sized(window, pattern)


def _write_qwen_window(config: ModelConfig) -> Mapping[str, object]:
    pattern = [int(config.layers[layer].window) for layer in range(config.num_layers)]
    # Without a window, max_window_layers means nothing: transformers' default is written.
    leading_full = pattern.index(1) if 1 in pattern else QWEN_MAX_WINDOW_LAYERS
    return {
        "use_sliding_window": config.attention.sliding_window is not None,
        "sliding_window": config.attention.sliding_window,
        "max_window_layers": leading_full,
        "layer_types": layer_types_of(config),
    }


_QWEN_WINDOW = ConfigRule(keys=("use_sliding_window", "sliding_window", "max_window_layers", "layer_types"),
                          model_fields=("sliding_window", "window_layers"),
                          read=_read_qwen_window, write=_write_qwen_window, null_keys=("sliding_window",))

QWEN2 = LLAMA.derive(
    "Qwen2ForCausalLM", "qwen2",
    # Qwen2Config's 32 KV heads where config.json leaves them out; its attention takes head_dim as given.
    fields=(query_groups_field(32), head_dim_field(null_refused=HEAD_DIM_NULL), max_positions(32768)),
    rules=(_QWEN_WINDOW,),
    # Qwen2 always has q/k/v biases and nothing else.
    fixed={"add_qkv_bias": True, "add_bias_linear": False},
    hf_notes={"sliding window": _WINDOW_NOTE, "linear biases": "q/k/v biases (fixed)"},
)

QWEN3 = QWEN2.derive(
    "Qwen3ForCausalLM", "qwen3",
    # Qwen3Config's head_dim 128, whatever hidden_size / num_attention_heads is.
    fields=(head_dim_field(128),),
    fixed={"qk_layernorm": True, "add_qkv_bias": False},
    # attention_bias=True would bias q, k, v and o but not the MLP: no Megatron equivalent.
    hf_fixed={"attention_bias": False},
    hf_notes={"linear biases": DROP, "qk-norm": "always"},
)


# --- MoE -------------------------------------------------------------------------------------------

QWEN_MOE_ROWS = (
    TensorMapping("decoder.layers.{}.mlp.router.weight", ("model.layers.{}.mlp.gate.weight",)),
    TensorMapping("decoder.layers.{}.mlp.experts.local_experts.{}.linear_fc1.weight", (
        "model.layers.{}.mlp.experts.{}.gate_proj.weight",
        "model.layers.{}.mlp.experts.{}.up_proj.weight",
    ), GATE_UP),
    TensorMapping("decoder.layers.{}.mlp.experts.local_experts.{}.linear_fc2.weight",
                  ("model.layers.{}.mlp.experts.{}.down_proj.weight",)),
)
QWEN3_MOE_TENSORS = TensorTable((*EMBEDDING_ROWS, *ATTENTION_ROWS, *DENSE_MLP_ROWS, *QWEN_MOE_ROWS, *FINAL_ROWS))


def _layers_from_sparse_step(present: Mapping[str, object], model: Mapping[str, object]) -> Mapping[str, object]:
    """transformers' Qwen-MoE rule: layer i is MoE iff i is not in mlp_only_layers and
    (i + 1) % decoder_sparse_step == 0; megatron-core's int moe_layer_freq k means i % k == 0, so
    anything but "every layer" becomes a 0/1 pattern."""
    step = present.get("decoder_sparse_step", 1)
    if not isinstance(step, int) or isinstance(step, bool) or step < 1:
        raise ValueError(f"decoder_sparse_step={quote(step)}: expected a positive integer")
    dense = present.get("mlp_only_layers", [])
    if not isinstance(dense, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in dense):
        raise ValueError(f"mlp_only_layers={quote(dense)}: expected a list of layer indices")
    layers = model["num_layers"]
    assert isinstance(layers, int)
    dense_set = set(dense)
    pattern = tuple(int(layer not in dense_set and (layer + 1) % step == 0) for layer in range(layers))
    return {"moe_layer_freq": 1 if all(pattern) else pattern}


def _sparse_step_from_layers(config: ModelConfig) -> Mapping[str, object]:
    return {"decoder_sparse_step": 1, "mlp_only_layers": dense_layers(config)}


SPARSE_STEP = ConfigRule(keys=("decoder_sparse_step", "mlp_only_layers"), model_fields=("moe_layer_freq",),
                          read=_layers_from_sparse_step, write=_sparse_step_from_layers, refuses=refuses_dense_model)


def norm_topk_rule(default: bool) -> ConfigRule:
    """The top-k softmax weights renormalized (``norm_topk_prob``, absent: the config class's ``default``) as
    megatron-core's default router does; without it, softmax over all experts first (megatron-core's
    moe_router_pre_softmax)."""

    def read(present: Mapping[str, object], model: Mapping[str, object]) -> Mapping[str, object]:
        value = present.get("norm_topk_prob", default)
        if not isinstance(value, bool):
            raise ValueError(f"norm_topk_prob={quote(value)}: expected true or false")
        return {"moe_router_pre_softmax": not value}

    return ConfigRule(keys=("norm_topk_prob",), model_fields=("moe_router_pre_softmax",), read=read,
                      write=_write_norm_topk)


def _write_norm_topk(config: ModelConfig) -> Mapping[str, object]:
    return {"norm_topk_prob": not config.moe.moe_router_pre_softmax}


# transformers' Qwen3MoeConfig and Qwen2MoeConfig: norm_topk_prob false by default.
NORM_TOPK_RULE = norm_topk_rule(False)
# norm_topk_prob false softmaxes over all experts first (megatron-core's moe_router_pre_softmax).
PRE_SOFTMAX = frozenset({"moe_router_pre_softmax"})
NORM_TOPK_NOTE = "norm_topk_prob = not pre_softmax"


def _read_all_or_none_window(present: Mapping[str, object], model: Mapping[str, object]) -> Mapping[str, object]:
    """Qwen3-MoE: ``use_sliding_window`` windows every layer."""
    return {"sliding_window": _use_sliding_window(present), "window_layers": None}


def _write_all_or_none_window(config: ModelConfig) -> Mapping[str, object]:
    window = config.attention.sliding_window
    return {"use_sliding_window": window is not None, "sliding_window": window}


_QWEN3_MOE_WINDOW = ConfigRule(keys=("use_sliding_window", "sliding_window"),
                               model_fields=("sliding_window", "window_layers"),
                               read=_read_all_or_none_window, write=_write_all_or_none_window,
                               refuses=refuses_partial_window, null_keys=("sliding_window",))

# Built from Qwen3's pieces, not derived from it: derive would add the sparse-step rule after the
# window rule, and so reorder the reasons a model does not fit.
QWEN3_MOE = Family(
    architecture="Qwen3MoeForCausalLM",
    model_type="qwen3_moe",
    hf_computes=PRE_SOFTMAX,
    tensors=QWEN3_MOE_TENSORS,
    fields=(
        *decoder_fields(max_position_embeddings=32768, query_groups=query_groups_field(4),
                        head_dim=head_dim_field(null_refused=HEAD_DIM_NULL)),
        DENSE_FFN,
        ConfigField(("moe_intermediate_size",), "moe_ffn_hidden_size", int, default=768, written=expert_ffn_size),
        # transformers 5 writes num_experts as num_local_experts (its attribute_map); 4.x as num_experts.
        expert_count("num_local_experts", 128, legacy="num_experts"),
        ConfigField(("num_experts_per_tok",), "moe_router_topk", int, default=8),
        AUX_LOSS,
    ),
    rules=(SPARSE_STEP, ROPE_RULE, _QWEN3_MOE_WINDOW, NORM_TOPK_RULE),
    fixed={**ROUTED_EXPERTS_ONLY, "qk_layernorm": True, "add_qkv_bias": False, "add_bias_linear": False},
    hf_fixed={**HF_SILU, "attention_bias": False},
    hf_scratch=ROPE_DEFAULT,
    hf_notes={"sliding window": "use_sliding_window, sliding_window", "qk-norm": "always",
              "moe pre-softmax": NORM_TOPK_NOTE},
)


def _qwen2_moe_default_pattern(present: Mapping[str, object], layers: int, use: bool) -> tuple[int, ...]:
    """transformers' Qwen2MoeConfig without layer_types: with ``use_sliding_window``, the odd 1-based
    layers below max_window_layers (whatever ``sliding_window`` is)."""
    first = _max_window_layers(present)
    return tuple(int(use and (layer + 1) % 2 == 1 and layer < first) for layer in range(layers))


def _read_qwen2_moe_window(present: Mapping[str, object], model: Mapping[str, object]) -> Mapping[str, object]:
    """Qwen2-MoE: ``use_sliding_window`` turns ``sliding_window`` on for the layers ``layer_types``
    marks (transformers' default pattern when it is absent)."""
    use = present.get("use_sliding_window", False)
    if not isinstance(use, bool):
        raise ValueError(f"use_sliding_window={quote(use)}: expected true or false")
    layers = model["num_layers"]
    assert isinstance(layers, int)
    window = window_of(present, QWEN_WINDOW) if use else None
    pattern = layer_types(present, layers)
    if pattern is None:
        pattern = _qwen2_moe_default_pattern(present, layers, use)
    return window_values_sized(window, pattern)


def _write_qwen2_moe_window(config: ModelConfig) -> Mapping[str, object]:
    window = config.attention.sliding_window
    # layer_types says which layers: max_window_layers is only its default, written as transformers'.
    return {"use_sliding_window": window is not None, "sliding_window": window,
            "max_window_layers": QWEN_MAX_WINDOW_LAYERS, "layer_types": layer_types_of(config)}


def refuses_dense_or_no_shared_expert(config: ModelConfig) -> str | None:
    moe = config.moe
    if moe.num_experts is not None and moe.moe_shared_expert_intermediate_size is None:
        return "moe_shared_expert_intermediate_size=None (needs a gated shared expert)"
    return refuses_dense_model(config)


# Qwen2-MoE's and Qwen3-Next's MoE layers by decoder_sparse_step, with a gated shared expert.
SHARED_EXPERT_SPARSE_STEP = ConfigRule(keys=SPARSE_STEP.keys, model_fields=SPARSE_STEP.model_fields,
                                       read=_layers_from_sparse_step, write=_sparse_step_from_layers,
                                       refuses=refuses_dense_or_no_shared_expert)


# transformers' Qwen2MoeSparseMoeBlock: shared_expert (an MLP) scaled by sigmoid(shared_expert_gate(x)),
# which is megatron-core's SharedExpertMLP with moe_shared_expert_gate (gate_weight [1, hidden]).
SHARED_EXPERT_ROWS = (
    TensorMapping("decoder.layers.{}.mlp.shared_experts.linear_fc1.weight", (
        "model.layers.{}.mlp.shared_expert.gate_proj.weight",
        "model.layers.{}.mlp.shared_expert.up_proj.weight",
    ), GATE_UP),
    TensorMapping("decoder.layers.{}.mlp.shared_experts.linear_fc2.weight",
                  ("model.layers.{}.mlp.shared_expert.down_proj.weight",)),
    TensorMapping("decoder.layers.{}.mlp.shared_experts.gate_weight", ("model.layers.{}.mlp.shared_expert_gate.weight",)),
)

# Qwen3-MoE with a gated shared expert, q/k/v biases and no qk-norm.
QWEN2_MOE = QWEN3_MOE.derive(
    "Qwen2MoeForCausalLM", "qwen2_moe",
    tensors=TensorTable((*EMBEDDING_ROWS, *ATTENTION_ROWS, *DENSE_MLP_ROWS, *QWEN_MOE_ROWS,
                         *SHARED_EXPERT_ROWS, *FINAL_ROWS)),
    fields=(
        # Qwen2MoeConfig's 16 KV heads; it keeps a null, which its attention cannot divide by.
        query_groups_field(16, null_refused="transformers' attention divides the heads by num_key_value_heads as "
                                            "given, and null is no count"),
        ConfigField(("moe_intermediate_size",), "moe_ffn_hidden_size", int, default=1408, written=expert_ffn_size),
        expert_count("num_experts", 60),
        ConfigField(("num_experts_per_tok",), "moe_router_topk", int, default=4),
        ConfigField(("shared_expert_intermediate_size",), "moe_shared_expert_intermediate_size", int, default=5632),
        # q, k and v biases only (o_proj and the MLPs have none): megatron-core's add_qkv_bias.
        ConfigField(("qkv_bias",), "add_qkv_bias", bool, default=True),
    ),
    rules=(SHARED_EXPERT_SPARSE_STEP,
           ConfigRule(keys=("use_sliding_window", "sliding_window", "max_window_layers", "layer_types"),
                      model_fields=("sliding_window", "window_layers"),
                      read=_read_qwen2_moe_window, write=_write_qwen2_moe_window, null_keys=("sliding_window",))),
    fixed={"moe_shared_expert_gate": True, "qk_layernorm": False},
    hf_fixed={"attention_bias": DROP},
    hf_notes={"sliding window": "use_sliding_window, sliding_window, layer_types", "qk-norm": DROP},
)
