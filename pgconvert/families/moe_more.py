"""More MoE families as data: GLM-4.5-MoE (``Glm4MoeForCausalLM``) and GPT-OSS (``GptOssForCausalLM``).

Registered into ``pgconvert.families.FAMILIES`` by that module. Facts are from transformers 5.24's
``models/glm4_moe`` (modeling and configuration) and megatron-core's ``TopKRouter`` /
``topk_routing_with_score_function`` (``transformer/moe/moe_utils.py``).

GLM-4.5-MoE in Megatron terms: Llama-style attention with q/k/v biases (``attention_bias``; o_proj
has none) and optional per-head qk-norm (``use_qk_norm``), RoPE on the first
``partial_rotary_factor`` of each head (rotate-half, not interleaved: megatron-core's
``rotary_percent``); the first ``first_k_dense_replace`` layers dense, the rest MoE with a shared
expert of ``moe_intermediate_size × n_shared_experts`` and a sigmoid router whose
``e_score_correction_bias`` only steers the choice (megatron-core's ``mlp.router.expert_bias``,
``moe_router_score_function=sigmoid``), the chosen weights renormalized (megatron-core's sigmoid
router always renormalizes for top-k > 1: ``norm_topk_prob`` is assumed true) and scaled by
``routed_scaling_factor`` (``moe_router_topk_scaling_factor``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from pgconvert.model.config import ModelConfig
import torch

from pgconvert.families import (
    _ATTENTION_ROWS,
    _AUX_LOSS,
    _DENSE_FFN,
    _DENSE_MLP_ROWS,
    _EMBEDDING_ROWS,
    _FINAL_ROWS,
    _QWEN_MOE_ROWS,
    _ROPE_RULE,
    _SWIGLU_RMS_ROPE,
    IDENTITY,
    ConfigField,
    ConfigRule,
    Family,
    TensorMapping,
    TensorTable,
    Transform,
    _decoder_fields,
    _dense_layers,
    _every_layer_moe,
    _expert_ffn_size,
    _no_keys,
    _read_rope,
    _refuses_dense_layers,
    _write_rope,
)
from pgconvert.families.deepseek import EXPERT_BIAS_ROW, SHARED_EXPERTS_ROWS
from pgconvert.families.deepseek import _groups as _deepseek_groups
from pgconvert.io.limits import quote
from pgconvert.families.mtp import MTP_ROWS
from pgconvert.semantics import rope_parameters

# transformers' Glm4MoeConfig defaults.
GLM4_MOE_PARTIAL_ROTARY = 0.5
GLM4_MOE_FIRST_DENSE = 1
GLM4_MOE_SHARED_EXPERTS = 1

_GLM4_MOE_EXTRA_ROWS = (EXPERT_BIAS_ROW, *SHARED_EXPERTS_ROWS)
GLM4_MOE_TENSORS = TensorTable((*_EMBEDDING_ROWS, *_ATTENTION_ROWS, *_DENSE_MLP_ROWS, *_QWEN_MOE_ROWS,
                                *_GLM4_MOE_EXTRA_ROWS, *_FINAL_ROWS, *MTP_ROWS))


def _count(value: object, key: str, low: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ValueError(f"{key}={quote(value)}: expected an integer >= {low}")
    return value


def _read_partial_rope(present: Mapping[str, object], model: Mapping[str, object]) -> Mapping[str, object]:
    """GLM's RoPE: as every family's, but an absent ``partial_rotary_factor`` means 0.5
    (Glm4MoeConfig's default), not the whole head."""
    values = dict(_read_rope(present, model))
    in_params = rope_parameters(present).get("partial_rotary_factor") is not None
    if not in_params and present.get("partial_rotary_factor") is None:
        values["rotary_percent"] = GLM4_MOE_PARTIAL_ROTARY
    return values


def _write_partial_rope(config: ModelConfig) -> Mapping[str, object]:
    written = dict(_write_rope(config))
    params = dict(written["rope_parameters"])  # type: ignore[call-overload]
    params["partial_rotary_factor"] = config.rotary_percent
    written["rope_parameters"] = params
    return written


def _read_first_dense(present: Mapping[str, object], model: Mapping[str, object]) -> Mapping[str, object]:
    """Layer i is MoE iff i >= first_k_dense_replace (transformers' Glm4MoeDecoderLayer)."""
    first = _count(present.get("first_k_dense_replace", GLM4_MOE_FIRST_DENSE), "first_k_dense_replace", 0)
    layers = model["num_layers"]
    assert isinstance(layers, int)
    pattern = tuple(int(layer >= first) for layer in range(layers))
    return {"moe_layer_freq": 1 if all(pattern) else pattern}


def _write_first_dense(config: ModelConfig) -> Mapping[str, object]:
    return {"first_k_dense_replace": len(_dense_layers(config))}


def _refuses_dense_after_moe(config: ModelConfig) -> str | None:
    if config.num_experts is None:
        return "num_experts=None (needs routed experts)"
    dense = _dense_layers(config)
    if dense != list(range(len(dense))):
        return f"dense layers {dense} (needs the dense layers first: first_k_dense_replace)"
    return None


def _read_shared(present: Mapping[str, object], model: Mapping[str, object]) -> Mapping[str, object]:
    shared = _count(present.get("n_shared_experts", GLM4_MOE_SHARED_EXPERTS), "n_shared_experts", 1)
    expert = model["moe_ffn_hidden_size"]
    assert isinstance(expert, int)
    return {"moe_shared_expert_intermediate_size": shared * expert}


def _write_shared(config: ModelConfig) -> Mapping[str, object]:
    size = config.moe_shared_expert_intermediate_size or 0
    return {"n_shared_experts": size // config.expert_ffn_size}


def _refuses_shared(config: ModelConfig) -> str | None:
    size = config.moe_shared_expert_intermediate_size
    if size is None or size % config.expert_ffn_size:
        return (f"moe_shared_expert_intermediate_size={size} (needs a multiple of the experts' FFN size "
                f"{config.expert_ffn_size}: n_shared_experts)")
    return None


def _read_groups(present: Mapping[str, object], model: Mapping[str, object]) -> Mapping[str, object]:
    """``n_group``/``topk_group``: routing limited to the best ``topk_group`` of ``n_group`` expert
    groups. transformers' ``Glm4MoeTopkRouter`` scores a group by the sum of its top-2 biased scores,
    as DeepSeek-V3 does, so DeepSeek-V3's rule applies: megatron-core's ``group_limited_topk`` scores
    by its top ``topk // group_topk``, which agrees where that is 2 (any other setting is refused)."""
    groups = _deepseek_groups(present, model, per_group=2)
    return {"moe_router_num_groups": groups and groups[0], "moe_router_group_topk": groups and groups[1]}


def _write_groups(config: ModelConfig) -> Mapping[str, object]:
    return {"n_group": config.moe_router_num_groups or 1, "topk_group": config.moe_router_group_topk or 1}


def _refuses_groups(config: ModelConfig) -> str | None:
    chosen = config.moe_router_group_topk
    if chosen and config.moe_router_topk // chosen != 2:
        return (f"moe_router_group_topk={chosen} with moe_router_topk={config.moe_router_topk} "
                "(Glm4Moe scores a group by its best 2 experts: needs topk // group_topk = 2)")
    return None


GLM4_MOE = Family(
    architecture="Glm4MoeForCausalLM",
    model_type="glm4_moe",
    hf_computes=frozenset({"rotary_percent", "moe_router_score_function",  # fam17d
                           "moe_router_topk_scaling_factor", "moe_router_num_groups"}),  # mtp16: groups as V3
    tensors=GLM4_MOE_TENSORS,
    fields=(
        *_decoder_fields(max_position_embeddings=131072, norm_epsilon=1e-5),
        _DENSE_FFN,
        ConfigField(("moe_intermediate_size",), "moe_ffn_hidden_size", int, default=1408, written=_expert_ffn_size),
        ConfigField(("n_routed_experts",), "num_experts", int, default=128),
        ConfigField(("num_experts_per_tok",), "moe_router_topk", int, default=8),
        ConfigField(("routed_scaling_factor",), "moe_router_topk_scaling_factor", float, default=1.0),
        ConfigField(("use_qk_norm",), "qk_layernorm", bool, default=False),
        # q, k and v only: o_proj never has a bias.
        ConfigField(("attention_bias",), "add_qkv_bias", bool, default=False),
    ),
    rules=(
        ConfigRule(keys=("first_k_dense_replace",), model_fields=("moe_layer_freq",), read=_read_first_dense,
                   write=_write_first_dense, refuses=_refuses_dense_after_moe),
        ConfigRule(keys=("n_shared_experts",), model_fields=("moe_shared_expert_intermediate_size",),
                   read=_read_shared, write=_write_shared, refuses=_refuses_shared),
        ConfigRule(keys=("n_group", "topk_group"), model_fields=("moe_router_num_groups", "moe_router_group_topk"),
                   read=_read_groups, write=_write_groups, refuses=_refuses_groups),
        ConfigRule(keys=_ROPE_RULE.keys, model_fields=_ROPE_RULE.model_fields, read=_read_partial_rope,
                   write=_write_partial_rope),
    ),
    fixed={
        **_SWIGLU_RMS_ROPE,
        "add_bias_linear": False,
        "moe_shared_expert_gate": False,
        "moe_router_enable_expert_bias": True,
        "moe_router_score_function": "sigmoid",
        "moe_router_pre_softmax": False,
        "sliding_window": None,
        "window_layers": None,
    },
    hf_fixed={"hidden_act": "silu"},
    # megatron-core's sigmoid router renormalizes the top-k weights whenever top-k > 1.
    hf_assumed={"norm_topk_prob": True},
    # mtp: MTP layers (layers num_hidden_layers + i, pgconvert.families.mtp); written from mtp_num_layers.
    hf_mtp_layers_key="num_nextn_predict_layers",
)



# --- GPT-OSS ----------------------------------------------------------------------------------------
# transformers 5.24 models/gpt_oss: every layer MoE; q/k/v/o biases; per-head attention sinks; the
# router a biased linear whose top-k logits are softmaxed (megatron-core's default router); experts
# stacked per layer, gate_up_proj [E, hidden, 2·I] with gate and up interleaved column by column
# (gate = [..., ::2]), down_proj [E, I, hidden], each with a bias; the expert activation
# (clamp(up, ±limit) + 1) · g·σ(1.702·g), g = clamp(gate, max=limit). Megatron side as Megatron-Bridge
# writes it (src/megatron/bridge/models/gpt_oss/gpt_oss_bridge.py): add_bias_linear, softmax_type
# 'learnable' (self_attention.core_attention.softmax_offset), quick_gelu with
# activation_func_clamp_value = swiglu_limit and glu_linear_offset 1, window_size (W - 1, 0) on the
# sliding layers, linear_fc1 = [gate; up] (its _interleave), experts' fc2 transposed.
GPT_OSS_SWIGLU_ALPHA = 1.702  # megatron-core's quick_gelu constant
GPT_OSS_SWIGLU_LIMIT = 7.0
GPT_OSS_WINDOW = 128


def _deinterleave(rows: torch.Tensor) -> torch.Tensor:
    return torch.cat([rows[0::2], rows[1::2]], dim=0)


def _interleave(full: torch.Tensor) -> torch.Tensor:
    gate, up = full.chunk(2, dim=0)
    out = torch.empty_like(full)
    out[0::2], out[1::2] = gate, up
    return out


class InterleavedGateUp(Transform):
    """One expert's ``gate_up_proj`` ([hidden, 2·I], columns gate/up alternating) or its bias ([2·I])
    <-> megatron-core's ``linear_fc1`` [gate; up] ([2·I, hidden] or [2·I])."""

    parts = 1

    def __init__(self, transposed: bool) -> None:
        self.transposed = transposed
        self.name = "interleaved-gate-up" + ("-transposed" if transposed else "")

    def fuse(self, parts: Sequence[torch.Tensor], config: ModelConfig) -> torch.Tensor:
        rows = parts[0].t() if self.transposed else parts[0]
        return _deinterleave(rows).contiguous()

    def split(self, full: torch.Tensor, config: ModelConfig) -> list[torch.Tensor]:
        rows = _interleave(full)
        return [rows.t().contiguous() if self.transposed else rows]

    def part_shapes(self, shape: tuple[int, ...], config: ModelConfig) -> list[tuple[int, ...]]:
        return [tuple(reversed(shape)) if self.transposed else shape]


class Transposed(Transform):
    """One expert's ``down_proj`` [I, hidden] <-> megatron-core's ``linear_fc2`` [hidden, I]."""

    name = "transposed"
    parts = 1

    def fuse(self, parts: Sequence[torch.Tensor], config: ModelConfig) -> torch.Tensor:
        return parts[0].t().contiguous()

    def split(self, full: torch.Tensor, config: ModelConfig) -> list[torch.Tensor]:
        return [full.t().contiguous()]

    def part_shapes(self, shape: tuple[int, ...], config: ModelConfig) -> list[tuple[int, ...]]:
        return [tuple(reversed(shape))]


_EXPERT = "decoder.layers.{}.mlp.experts.local_experts.{}."
_GPT_OSS_ROWS = (
    TensorMapping("decoder.layers.{}.self_attention.core_attention.softmax_offset",
                  ("model.layers.{}.self_attn.sinks",)),
    TensorMapping("decoder.layers.{}.mlp.router.weight", ("model.layers.{}.mlp.router.weight",)),
    TensorMapping("decoder.layers.{}.mlp.router.bias", ("model.layers.{}.mlp.router.bias",)),
    TensorMapping(_EXPERT + "linear_fc1.weight", ("model.layers.{}.mlp.experts.gate_up_proj",),
                  InterleavedGateUp(transposed=True), stacked=True),
    TensorMapping(_EXPERT + "linear_fc1.bias", ("model.layers.{}.mlp.experts.gate_up_proj_bias",),
                  InterleavedGateUp(transposed=False), stacked=True),
    TensorMapping(_EXPERT + "linear_fc2.weight", ("model.layers.{}.mlp.experts.down_proj",), Transposed(),
                  stacked=True),
    TensorMapping(_EXPERT + "linear_fc2.bias", ("model.layers.{}.mlp.experts.down_proj_bias",), IDENTITY,
                  stacked=True),
)
GPT_OSS_TENSORS = TensorTable((*_EMBEDDING_ROWS, *_ATTENTION_ROWS, *_GPT_OSS_ROWS, *_FINAL_ROWS))


def _layer_types(present: Mapping[str, object], layers: int) -> tuple[int, ...]:
    """1 for a sliding layer; transformers' GptOssConfig default alternates, layer 0 sliding."""
    types = present.get("layer_types")
    if types is None:
        return tuple(int((layer + 1) % 2 == 1) for layer in range(layers))
    if (not isinstance(types, list) or len(types) != layers
            or not all(kind in ("sliding_attention", "full_attention") for kind in types)):
        raise ValueError(f"layer_types={quote(types)}: expected {layers} of 'sliding_attention'/'full_attention'")
    return tuple(int(kind == "sliding_attention") for kind in types)


def _read_layer_window(present: Mapping[str, object], model: Mapping[str, object]) -> Mapping[str, object]:
    layers = model["num_layers"]
    assert isinstance(layers, int)
    window = present.get("sliding_window", GPT_OSS_WINDOW)
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        raise ValueError(f"sliding_window={quote(window)}: expected a positive integer")
    pattern = _layer_types(present, layers)
    if not any(pattern):
        return {"sliding_window": None, "window_layers": None}
    return {"sliding_window": window, "window_layers": None if all(pattern) else pattern}


def _write_layer_window(config: ModelConfig) -> Mapping[str, object]:
    types = ["sliding_attention" if config.is_window_layer(layer) else "full_attention"
             for layer in range(config.num_layers)]
    return {"sliding_window": config.sliding_window or GPT_OSS_WINDOW, "layer_types": types}


GPT_OSS = Family(
    architecture="GptOssForCausalLM",
    model_type="gpt_oss",
    hf_computes=frozenset({"glu_linear_offset", "activation_func_clamp_value"}),  # fam17d
    tensors=GPT_OSS_TENSORS,
    fields=(
        *_decoder_fields(max_position_embeddings=131072, norm_epsilon=1e-5, rotary_base=150000.0),
        ConfigField(("intermediate_size",), "moe_ffn_hidden_size", int, default=2880, written=_expert_ffn_size),
        ConfigField(("num_local_experts",), "num_experts", int, default=128),
        ConfigField(("num_experts_per_tok",), "moe_router_topk", int, default=4),
        ConfigField(("swiglu_limit",), "activation_func_clamp_value", float, default=GPT_OSS_SWIGLU_LIMIT),
        _AUX_LOSS,
    ),
    rules=(
        ConfigRule(keys=(), model_fields=("ffn_hidden_size", "moe_layer_freq"), read=_every_layer_moe,
                   write=_no_keys, refuses=_refuses_dense_layers),
        ConfigRule(keys=("sliding_window", "layer_types"), model_fields=("sliding_window", "window_layers"),
                   read=_read_layer_window, write=_write_layer_window),
        _ROPE_RULE,
    ),
    fixed={
        **_SWIGLU_RMS_ROPE,
        "activation": "quick_gelu",
        "glu_linear_offset": 1.0,
        "softmax_type": "learnable",
        "add_bias_linear": True,
        "add_qkv_bias": False,
        "qk_layernorm": False,
        "moe_shared_expert_intermediate_size": None,
        "moe_router_enable_expert_bias": False,
        "moe_router_score_function": "softmax",
        "moe_router_pre_softmax": False,
    },
    # Every linear has a bias; the experts' sigmoid gain is quick_gelu's.
    hf_fixed={"attention_bias": True, "swiglu_alpha": GPT_OSS_SWIGLU_ALPHA},
    hf_scratch={"hidden_act": "silu"},
)

MORE_MOE_FAMILIES: tuple[Family, ...] = (GLM4_MOE, GPT_OSS)
