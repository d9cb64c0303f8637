"""HunYuan (``HunYuanDenseV1ForCausalLM``, tencent/Hunyuan-7B-Instruct; ``HunYuanMoEV1ForCausalLM``,
tencent/Hunyuan-A13B-Instruct), as transformers 5.24's ``models/hunyuan_v1_dense`` / ``hunyuan_v1_moe`` compute them.

Llama's decoder with per-head q/k RMSNorms (``self_attn.query_layernorm`` / ``key_layernorm``, always built) applied
*after* RoPE: megatron-core's ``q_layernorm`` / ``k_layernorm`` are the same tensors, but megatron-core applies them
before the rotary (``transformer/attention.py``), which computes the same only where each rotated pair's two norm
weights are equal. The order is carried (``qk_layernorm_after_rope``, ``pgconvert.semantics.carried``): a Megatron
output says megatron-core computes it otherwise, and ``--strict`` refuses one.

RoPE: the releases' ``rope_scaling`` ``{"type": "dynamic", "alpha": …}`` is transformers' ``ntk_alpha``: a fixed base
``rope_theta * alpha ** (head_dim / (head_dim - 2))`` (the sequence length plays no part), megatron-core's
``rotary_base`` computed the same way; ``dynamic`` without an ``alpha`` (transformers' dynamic NTK scaling, which grows
the base past ``max_position_embeddings``) has no megatron-core equivalent: refused. ``head_dim`` must be given (the
attention takes it as given).

MoE: every layer a softmax router over ``num_experts`` (``mlp.gate.wg``), the top ``moe_topk`` renormalized
(megatron-core's softmax router without pre-softmax), the experts and one shared MLP (``mlp.shared_mlp``, no gate)
all ``intermediate_size`` wide. The releases' per-layer lists (``moe_topk``, ``moe_intermediate_size``,
``num_shared_expert``) and Tencent's switches (``use_qk_norm``, ``use_cla``, ``use_mixed_mlp_moe``) are read no
further than transformers reads them; a value under which the release's own code computes something transformers'
does not (different sizes per layer, cross-layer attention, no shared MLP, no q/k norms) is refused, named.
"""

from __future__ import annotations

from collections.abc import Mapping

from pgconvert.families.experts import dense_layers, expert_count, refuses_dense_model
from pgconvert.families.llama import (
    ATTENTION_ROWS,
    DENSE_MLP_ROWS,
    EMBEDDING_ROWS,
    FINAL_ROWS,
    LLAMA,
    ROPE_RULE,
    read_whole_head_rope,
    write_rope,
)
from pgconvert.families.qwen import QWEN_MOE_ROWS
from pgconvert.families.table import (
    GATE_UP,
    ConfigField,
    ConfigRule,
    TensorMapping,
    TensorTable,
    false_only,
    write_nothing,
)
from pgconvert.io.limits import quote
from pgconvert.model.config import ModelConfig
from pgconvert.semantics import yarn
from pgconvert.semantics.carried import CarriedSetting, read_flag
from pgconvert.semantics.rope import rope_parameters, rope_type_of

_L = "model.layers.{}."
_D = "decoder.layers.{}."
_QK_NORM_ROWS = (
    TensorMapping(_D + "self_attention.q_layernorm.weight", (_L + "self_attn.query_layernorm.weight",)),
    TensorMapping(_D + "self_attention.k_layernorm.weight", (_L + "self_attn.key_layernorm.weight",)),
)
_MOE_ROWS = (
    TensorMapping(_D + "mlp.router.weight", (_L + "mlp.gate.wg.weight",)),
    *QWEN_MOE_ROWS[1:],
    TensorMapping(_D + "mlp.shared_experts.linear_fc1.weight",
                  (_L + "mlp.shared_mlp.gate_proj.weight", _L + "mlp.shared_mlp.up_proj.weight"), GATE_UP),
    TensorMapping(_D + "mlp.shared_experts.linear_fc2.weight", (_L + "mlp.shared_mlp.down_proj.weight",)),
)
_ATTENTION_ROWS = tuple(row for row in ATTENTION_ROWS if row.canonical not in {r.canonical for r in _QK_NORM_ROWS})
HUNYUAN_DENSE_TENSORS = TensorTable((*EMBEDDING_ROWS, *_ATTENTION_ROWS, *_QK_NORM_ROWS, *DENSE_MLP_ROWS, *FINAL_ROWS))
HUNYUAN_MOE_TENSORS = TensorTable((*EMBEDDING_ROWS, *_ATTENTION_ROWS, *_QK_NORM_ROWS, *_MOE_ROWS, *FINAL_ROWS))

# HunYuan*V1Config's RoPE base where config.json gives none (transformers' default_theta).
_ROPE_BASE = 10000.0
# HunYuan*V1Config's intermediate_size where config.json gives none.
_INTERMEDIATE_SIZE = 11008
_QK_AFTER_ROPE = CarriedSetting("qk_layernorm_after_rope", False, read_flag)


def _number(value: object, key: str) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
        raise ValueError(f"{key}={quote(value)}: expected a positive number")
    return float(value)


def _read_rope(present: Mapping[str, object], model: Mapping[str, object]) -> Mapping[str, object]:
    """``rope_theta`` and the RoPE scaling (``rope_parameters``; 4.x: ``rope_scaling`` and a top-level
    ``rope_theta``): NTK-alpha becomes the base it computes; the others as every family whose attention rotates the
    whole head reads them (``read_whole_head_rope``; NTK-alpha rotates the whole head too, whatever
    ``partial_rotary_factor`` says)."""
    params = rope_parameters(present)
    theta = _number(params.get("rope_theta", present.get("rope_theta", _ROPE_BASE)), "rope_theta")
    if rope_type_of(params) != "dynamic":
        return {**read_whole_head_rope(present, model), "rotary_base": theta}
    alpha = params.get("alpha")
    if not alpha:
        raise ValueError(f"rope_parameters type 'dynamic' without alpha (alpha={quote(alpha)}): transformers' dynamic "
                         "NTK scaling grows the RoPE base with the sequence length; megatron-core has no such RoPE")
    head_dim = model["kv_channels"]
    assert isinstance(head_dim, int)
    if head_dim <= 2:
        raise ValueError(f"head_dim={head_dim} with NTK-alpha RoPE: its base divides by head_dim - 2")
    # transformers' HunYuan*RotaryEmbedding.compute_ntk_alpha_rope_parameters, in the same float arithmetic.
    base = theta * _number(alpha, "rope_parameters.alpha") ** (head_dim / (head_dim - 2))
    return {**yarn.YARN_DEFAULTS, "rope_scaling": None, "rope_scaling_factor": 1.0, "rotary_percent": 1.0,
            "rotary_base": base}


def _write_rope(config: ModelConfig) -> Mapping[str, object]:
    """The base megatron-core computes with, as plain RoPE (``rope_theta``; 4.x's top-level key too)."""
    return {**write_rope(config), "rope_theta": config.positions.rotary_base}


# A null top-level rope_theta is refused (transformers' rotary takes it as given).
_ROPE_RULE = ConfigRule(keys=(*ROPE_RULE.keys, "rope_theta"), model_fields=(*ROPE_RULE.model_fields, "rotary_base"),
                        read=_read_rope, write=_write_rope, null_keys=(*ROPE_RULE.null_keys, "rope_theta"))


def _check_switches(present: Mapping[str, object], model: Mapping[str, object]) -> Mapping[str, object]:
    """Tencent's switches transformers' model does not read: refused where the release's own code would compute
    otherwise than transformers' (which always builds q/k norms and never shares K/V across layers)."""
    if present.get("use_qk_norm", True) is not True:
        raise ValueError(f"use_qk_norm={quote(present.get('use_qk_norm'))}: transformers' HunYuan always applies its "
                         "q/k norms (query_layernorm, key_layernorm)")
    if present.get("use_cla", False) not in (False, None):
        raise ValueError(f"use_cla={quote(present.get('use_cla'))}: cross-layer K/V sharing, which transformers' "
                         "HunYuan does not compute")
    return {}


_SWITCHES = ConfigRule(keys=("use_qk_norm", "use_cla"), model_fields=(), read=_check_switches, write=write_nothing)

HUNYUAN_DENSE = LLAMA.derive(
    "HunYuanDenseV1ForCausalLM", "hunyuan_v1_dense",
    tensors=HUNYUAN_DENSE_TENSORS,
    # HunYuanDenseV1Config's head_dim is None unless given, which its attention takes as given: required.
    fields=(ConfigField(("head_dim",), "kv_channels", int),
            ConfigField(("rms_norm_eps",), "norm_epsilon", float, default=1e-5),
            ConfigField(("intermediate_size",), "ffn_hidden_size", int, default=_INTERMEDIATE_SIZE)),
    rules=(_ROPE_RULE,
           false_only("attention_bias", "q/k/v and o biases without MLP biases; megatron-core's add_bias_linear "
                                          "biases the MLPs too"),
           _SWITCHES),
    fixed={"qk_layernorm": True, "qk_layernorm_after_rope": True, "add_bias_linear": False},
    megatron_carried=(_QK_AFTER_ROPE,),
    hf_rope_types_carried=("dynamic",),
    hf_notes={"linear biases": "attention_bias (false only)", "qk-norm": "always (query_layernorm, key_layernorm)",
              "qk-norm after RoPE": "always (megatron-core applies them before: carried, notice)",
              "rope theta": ("rope_theta; rope_parameters type 'dynamic' with alpha: "
                             "rope_theta * alpha ** (head_dim / (head_dim - 2))")},
)


def _counts(value: object, key: str, layers: int) -> set[int]:
    """The values of a count config.json gives once or per layer (a list of one per layer)."""
    if isinstance(value, list) and len(value) == layers:
        values = value
    elif isinstance(value, list) or value is None:
        raise ValueError(f"{key}={quote(value)}: expected an integer or one per layer ({layers})")
    else:
        values = [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
        raise ValueError(f"{key}={quote(value)}: expected non-negative integers")
    return set(values)


def _read_topk(present: Mapping[str, object], model: Mapping[str, object]) -> Mapping[str, object]:
    """``moe_topk`` (its ``attribute_map`` alias ``num_experts_per_tok``): one for every layer, or one per layer
    that are all the same (megatron-core has one top-k); absent: the class's 1; null is refused (the router takes
    ``moe_topk[layer]`` of it)."""
    # transformers sets moe_topk from its alias after moe_topk itself: the alias wins where both are given.
    key = next((key for key in ("num_experts_per_tok", "moe_topk") if key in present), "moe_topk")
    value = present.get(key, 1)
    layers = model["num_layers"]
    assert isinstance(layers, int)
    found = _counts(value, key, layers)
    if len(found) != 1 or 0 in found:
        raise ValueError(f"{key}={quote(value)}: megatron-core routes every layer to the same number (>= 1) of "
                         "experts")
    return {"moe_router_topk": found.pop()}


def _write_topk(config: ModelConfig) -> Mapping[str, object]:
    return {"moe_topk": config.moe.moe_router_topk}


def _read_experts(present: Mapping[str, object], model: Mapping[str, object]) -> Mapping[str, object]:
    """transformers' HunYuanMoEV1Moe: every layer MoE, its experts and one shared MLP ``intermediate_size`` wide
    (``moe_intermediate_size`` and ``num_shared_expert``, per layer in the releases, must say the same;
    ``use_mixed_mlp_moe`` false, no shared MLP, is refused)."""
    ffn, layers = present.get("intermediate_size", _INTERMEDIATE_SIZE), model["num_layers"]
    if not isinstance(ffn, int) or isinstance(ffn, bool) or ffn < 1:
        raise ValueError(f"intermediate_size={quote(ffn)}: expected a positive integer")
    assert isinstance(layers, int)
    if "moe_intermediate_size" in present and _counts(present["moe_intermediate_size"], "moe_intermediate_size",
                                                      layers) != {ffn}:
        raise ValueError(f"moe_intermediate_size={quote(present['moe_intermediate_size'])}: transformers' HunYuan "
                         f"builds every expert intermediate_size={ffn} wide")
    if "num_shared_expert" in present and _counts(present["num_shared_expert"], "num_shared_expert", layers) != {1}:
        raise ValueError(f"num_shared_expert={quote(present['num_shared_expert'])}: transformers' HunYuan builds one "
                         "shared MLP per layer")
    if present.get("use_mixed_mlp_moe", True) is not True:
        raise ValueError(f"use_mixed_mlp_moe={quote(present.get('use_mixed_mlp_moe'))}: transformers' HunYuan always "
                         "adds its shared MLP")
    return {"ffn_hidden_size": ffn, "moe_ffn_hidden_size": ffn, "moe_shared_expert_intermediate_size": ffn,
            "moe_layer_freq": 1}


def _write_experts(config: ModelConfig) -> Mapping[str, object]:
    return {"intermediate_size": config.ffn_hidden_size}


def _refuses_experts(config: ModelConfig) -> str | None:
    moe, no_experts = config.moe, refuses_dense_model(config)
    if no_experts is not None:
        return no_experts
    if config.expert_ffn_size != config.ffn_hidden_size or moe.moe_shared_expert_intermediate_size != config.ffn_hidden_size:
        return (f"moe_ffn_hidden_size={config.expert_ffn_size}, moe_shared_expert_intermediate_size="
                f"{moe.moe_shared_expert_intermediate_size} (HunYuan's experts and shared MLP are ffn_hidden_size="
                f"{config.ffn_hidden_size} wide)")
    dense = dense_layers(config)
    return f"moe_layer_freq={moe.moe_layer_freq!r} (needs every layer MoE; dense layers: {dense})" if dense else None


HUNYUAN_MOE = HUNYUAN_DENSE.derive(
    "HunYuanMoEV1ForCausalLM", "hunyuan_v1_moe",
    tensors=HUNYUAN_MOE_TENSORS,
    fields=(expert_count("num_experts", 1, "num_local_experts"),),
    rules=(ConfigRule(keys=("moe_topk",), model_fields=("moe_router_topk",), read=_read_topk, write=_write_topk,
                      null_keys=("moe_topk", "num_experts_per_tok"), legacy_keys=("num_experts_per_tok",)),
           # intermediate_size sizes the experts and the shared MLP too: read here, with them.
           ConfigRule(keys=("intermediate_size", "moe_intermediate_size", "num_shared_expert", "use_mixed_mlp_moe"),
                      model_fields=("ffn_hidden_size", "moe_ffn_hidden_size", "moe_shared_expert_intermediate_size",
                                    "moe_layer_freq"),
                      read=_read_experts, write=_write_experts, refuses=_refuses_experts)),
    fixed={"moe_shared_expert_gate": False, "moe_router_score_function": "softmax", "moe_router_pre_softmax": False,
           "moe_router_enable_expert_bias": False},
    hf_notes={"moe top-k": "moe_topk (one, or the same per layer)"},
)
