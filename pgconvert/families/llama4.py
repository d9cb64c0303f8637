"""Llama 4's text model (``Llama4ForCausalLM``: the language model of Llama-4-Scout-17B-16E and Maverick).

transformers 5.24's ``models/llama4`` in Megatron terms (megatron-core 0.16.1, Megatron-Bridge's
``Llama4ModelProvider`` and ``get_llama4_layer_spec``):

* attention as Llama's, without biases; its rotary turns pairs of neighbouring channels over the whole head
  (``view_as_complex``): megatron-core's ``rotary_interleaved``, rows kept in HF's order;
* ``use_qk_norm``: q and k RMS-normalized per head without a weight after the rotary, on the RoPE layers only
  (megatron-core's ``qk_l2_norm``; the norm over a head commutes with the rotary, which turns pairs);
* ``no_rope_layers`` (1: the layer has RoPE; empty or absent: every ``no_rope_layer_interval``-th layer without)
  is the complement of megatron-core's ``no_rope_freq``;
* the MoE layers (``moe_layers``, else every ``interleave_moe_layer_step``-th) hold a router whose top-1 logit's
  sigmoid scales the chosen expert's *input* (``moe_router_score_function`` sigmoid, ``moe_apply_probs_on_input``),
  routed experts stored stacked and transposed (``gate_up_proj`` ``[E, hidden, 2·I]`` = each ``linear_fc1``
  ``[gate; up]`` transposed, ``down_proj`` ``[E, I, hidden]``) and an ungated shared expert of the experts' size
  (``intermediate_size``); the other layers a dense MLP of ``intermediate_size_mlp``;
* chunked attention (``attention_chunk_size``, on the RoPE layers) and the NoPE layers' attention temperature
  (``attn_temperature_tuning``, ``floor_scale``, ``attn_scale``) have no megatron-core setting: carried in args
  under transformers' names (``pgconvert.semantics.carried``).
"""

from __future__ import annotations

from collections.abc import Mapping

from pgconvert.io.limits import quote
from pgconvert.model.config import ModelConfig
from pgconvert.families.experts import AUX_LOSS, expert_count, expert_ffn_size, refuses_dense_model
from pgconvert.families.llama import (
    ATTENTION_ROWS,
    EMBEDDING_ROWS,
    FINAL_ROWS,
    ROPE_RULE,
    SWIGLU_RMS_ROPE,
    decoder_fields,
    head_dim_field,
    query_groups_field,
)
from pgconvert.families.sliding_window import period_of, periodic_layers
from pgconvert.families.smollm import NOPE_INTERVAL, rope_flags
from pgconvert.families.table import (
    GATE_UP,
    TRANSPOSED,
    ConfigField,
    ConfigRule,
    Family,
    TensorMapping,
    TensorTable,
)
from pgconvert.semantics.arg_values import number, positive_int
from pgconvert.semantics.carried import CarriedSetting, read_flag

# Llama4TextConfig's defaults (Llama-4-Scout-17B-16E's sizes).
LLAMA4_CHUNK = 8192
LLAMA4_FLOOR_SCALE = 8192
LLAMA4_ATTN_SCALE = 0.1

_FF = "model.layers.{}.feed_forward."
_EXPERT = "decoder.layers.{}.mlp.experts.local_experts.{}."
LLAMA4_TENSORS = TensorTable((
    *EMBEDDING_ROWS,
    *ATTENTION_ROWS,
    TensorMapping("decoder.layers.{}.mlp.linear_fc1.weight", (_FF + "gate_proj.weight", _FF + "up_proj.weight"),
                  GATE_UP),
    TensorMapping("decoder.layers.{}.mlp.linear_fc2.weight", (_FF + "down_proj.weight",)),
    TensorMapping("decoder.layers.{}.mlp.router.weight", (_FF + "router.weight",)),
    # Stacked per layer and stored as x @ W: each expert's [hidden, 2·I] is linear_fc1 [gate; up] transposed.
    TensorMapping(_EXPERT + "linear_fc1.weight", (_FF + "experts.gate_up_proj",), TRANSPOSED, stacked=True),
    TensorMapping(_EXPERT + "linear_fc2.weight", (_FF + "experts.down_proj",), TRANSPOSED, stacked=True),
    TensorMapping("decoder.layers.{}.mlp.shared_experts.linear_fc1.weight", (
        _FF + "shared_expert.gate_proj.weight", _FF + "shared_expert.up_proj.weight"), GATE_UP),
    TensorMapping("decoder.layers.{}.mlp.shared_experts.linear_fc2.weight", (_FF + "shared_expert.down_proj.weight",)),
    *FINAL_ROWS,
))


def _layer_count(model: Mapping[str, object]) -> int:
    layers = model["num_layers"]
    assert isinstance(layers, int)
    return layers


def _index_list(value: object, key: str, layers: int) -> list[int]:
    if (not isinstance(value, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in value)
            or any(not 0 <= i < layers for i in value)):
        raise ValueError(f"{key}={quote(value)}: expected a list of layer indices below {layers}")
    return value


def _read_moe_layers(present: Mapping[str, object], model: Mapping[str, object]) -> Mapping[str, object]:
    """``moe_layers``, else every ``interleave_moe_layer_step``-th layer (1-based), as Llama4TextConfig fills it;
    they declare the shared expert too."""
    layers = _layer_count(model)
    chosen = present.get("moe_layers")
    if chosen is None:
        step = present.get("interleave_moe_layer_step", 1)
        if not isinstance(step, int) or isinstance(step, bool) or step < 1:
            raise ValueError(f"interleave_moe_layer_step={quote(step)}: expected a positive integer")
        chosen = [layer for layer, dense in enumerate(periodic_layers(layers, step)) if not dense]
    moe = set(_index_list(chosen, "moe_layers", layers))
    pattern = tuple(int(layer in moe) for layer in range(layers))
    # Each MoE layer's shared_expert is Llama4TextMLP(config): the experts' intermediate_size.
    return {"moe_layer_freq": 1 if all(pattern) else pattern,
            "moe_shared_expert_intermediate_size": model["moe_ffn_hidden_size"]}


def _write_moe_layers(config: ModelConfig) -> Mapping[str, object]:
    """The MoE layers, and the step that gives them where one does (MoE every step-th layer: its dense layers are
    ``periodic_layers``)."""
    dense = tuple(int(not layer.moe) for layer in config.layers)
    return {"moe_layers": [layer for layer, flag in enumerate(dense) if not flag],
            "interleave_moe_layer_step": period_of(dense) or 1}


def _layer_types(rope: tuple[int, ...], chunk: int | None) -> list[str]:
    """Llama4TextConfig's ``layer_types``: chunked attention on the RoPE layers where there is a chunk size."""
    return ["chunked_attention" if flag and chunk is not None else "full_attention" for flag in rope]


def _read_positions(present: Mapping[str, object], model: Mapping[str, object]) -> Mapping[str, object]:
    """The NoPE layers and the chunked attention; ``layer_types``, where given, must be what the two make (the
    attention of each layer type is transformers' mask of that name, which megatron-core's args cannot place)."""
    layers = _layer_count(model)
    # Llama4TextConfig fills an empty no_rope_layers as an absent one.
    rope = rope_flags({**present, "no_rope_layers": present.get("no_rope_layers") or None}, layers)
    chunk = present.get("attention_chunk_size", LLAMA4_CHUNK)
    if chunk is not None and (not isinstance(chunk, int) or isinstance(chunk, bool) or chunk < 1):
        raise ValueError(f"attention_chunk_size={quote(chunk)}: expected a positive integer or null")
    types = present.get("layer_types")
    if types is not None and types != _layer_types(rope, chunk):
        raise ValueError(f"layer_types={quote(types)} with attention_chunk_size={quote(chunk)}: Llama 4 chunks the "
                         "attention of exactly the RoPE layers (no_rope_layers) when attention_chunk_size is set; "
                         f"expected {_layer_types(rope, chunk)}")
    no_rope = tuple(1 - flag for flag in rope)
    return {"no_rope_layers": no_rope if any(no_rope) else None, "attention_chunk_size": chunk}


def _write_positions(config: ModelConfig) -> Mapping[str, object]:
    no_rope = config.positions.no_rope_layers or (0,) * config.num_layers
    rope = tuple(1 - flag for flag in no_rope)
    chunk = config.carried.attention_chunk_size
    return {"no_rope_layers": list(rope), "no_rope_layer_interval": period_of(rope) or NOPE_INTERVAL,
            "attention_chunk_size": chunk, "layer_types": _layer_types(rope, chunk)}


def _read_temperature(present: Mapping[str, object], model: Mapping[str, object]) -> Mapping[str, object]:
    """``attn_temperature_tuning``: a switch (the Scout release writes 4, which the transformers 4.x that released it
    read as true: ``if self.attn_temperature_tuning``; transformers 5.24's config class refuses an integer)."""
    value = present.get("attn_temperature_tuning", True)
    if isinstance(value, bool):
        return {"attn_temperature_tuning": value}
    if isinstance(value, int) and value >= 0:
        return {"attn_temperature_tuning": value != 0}
    raise ValueError(f"attn_temperature_tuning={quote(value)}: expected true or false")


def _write_temperature(config: ModelConfig) -> Mapping[str, object]:
    return {"attn_temperature_tuning": config.carried.attn_temperature_tuning}


def _refuses_moe_layers(config: ModelConfig) -> str | None:
    dense = refuses_dense_model(config)
    if dense is not None:
        return dense
    shared = config.moe.moe_shared_expert_intermediate_size
    if shared != config.expert_ffn_size:
        return (f"moe_shared_expert_intermediate_size={shared} (needs one shared expert of the experts' FFN size "
                f"{config.expert_ffn_size})")
    return None


LLAMA4_CARRIED = (
    CarriedSetting("attention_chunk_size", None, positive_int),
    CarriedSetting("attn_temperature_tuning", False, read_flag),
    CarriedSetting("floor_scale", LLAMA4_FLOOR_SCALE, positive_int),
    CarriedSetting("attn_scale", LLAMA4_ATTN_SCALE, number),
)

LLAMA4 = Family(
    architecture="Llama4ForCausalLM",
    model_type="llama4_text",
    hf_computes=frozenset({"moe_router_score_function"}),
    tensors=LLAMA4_TENSORS,
    fields=(
        # Llama4TextConfig's 8 KV heads and head_dim 128 (a null: hidden_size / heads, its __post_init__).
        *decoder_fields(max_position_embeddings=4096 * 32, norm_epsilon=1e-5, rotary_base=500000.0,
                        query_groups=query_groups_field(8), head_dim=head_dim_field(128, nullable=True)),
        ConfigField(("intermediate_size_mlp",), "ffn_hidden_size", int, default=16384),
        ConfigField(("intermediate_size",), "moe_ffn_hidden_size", int, default=8192, written=expert_ffn_size),
        expert_count("num_local_experts", 16),
        ConfigField(("use_qk_norm",), "qk_l2_norm", bool, default=True),
        ConfigField(("floor_scale",), "floor_scale", int, default=LLAMA4_FLOOR_SCALE),
        ConfigField(("attn_scale",), "attn_scale", float, default=LLAMA4_ATTN_SCALE),
        AUX_LOSS,
    ),
    rules=(
        ConfigRule(keys=("moe_layers", "interleave_moe_layer_step"),
                   model_fields=("moe_layer_freq", "moe_shared_expert_intermediate_size"),
                   read=_read_moe_layers, write=_write_moe_layers, refuses=_refuses_moe_layers),
        ConfigRule(keys=("no_rope_layers", "no_rope_layer_interval", "attention_chunk_size", "layer_types"),
                   model_fields=("no_rope_layers", "attention_chunk_size"), read=_read_positions,
                   write=_write_positions, null_keys=("attention_chunk_size",)),
        ConfigRule(keys=("attn_temperature_tuning",), model_fields=("attn_temperature_tuning",),
                   read=_read_temperature, write=_write_temperature),
        ROPE_RULE,
    ),
    fixed={
        **SWIGLU_RMS_ROPE,
        "add_bias_linear": False,
        "add_qkv_bias": False,
        "qk_layernorm": False,
        "rotary_interleaved": True,
        "moe_shared_expert_gate": False,
        "moe_router_enable_expert_bias": False,
        "moe_router_score_function": "sigmoid",
        "moe_router_pre_softmax": False,
        "moe_apply_probs_on_input": True,
        "moe_router_topk": 1,
        "sliding_window": None,
        "window_layers": None,
    },
    # attention_bias biases q, k, v and o, which Megatron cannot without biasing the experts too; the router score
    # scales the expert's input only with one expert per token (megatron-core's experts assert it), and
    # transformers applies each chosen logit's sigmoid as it is where megatron-core renormalizes top-k > 1.
    hf_fixed={"hidden_act": "silu", "attention_bias": False, "num_experts_per_tok": 1},
    hf_rotary_interleaved=True,
    megatron_carried=LLAMA4_CARRIED,
    hf_notes={
        "rotary interleaved": "always (HF's own rotary turns neighbouring pairs: rows kept as they are)",
        "qk L2 norm": "use_qk_norm (the RoPE layers only)",
        "moe probs on input": "always (the router score scales the expert's input)",
        "moe score function": "sigmoid of the top-1 logit (fixed)",
        "NoPE layers": "no_rope_layers (1: RoPE), no_rope_layer_interval",
        "chunked attention and attention temperature": ("attention_chunk_size (the RoPE layers: layer_types), "
                                                        "attn_temperature_tuning, floor_scale, attn_scale"),
        "linear biases": "none (attention_bias true: refused)",
    },
)
