"""MiniMax-M2 (``MiniMaxM2ForCausalLM``: MiniMaxAI/MiniMax-M2 and MiniMax-M2.1).

transformers 5.24's ``models/minimax_m2`` in megatron-core terms: Llama-style attention without
biases whose q and k are RMS-normed over the whole projection before the heads are split
(``q_norm`` of ``heads × head_dim``, ``k_norm`` of ``kv heads × head_dim``: megatron-core's
``qk_layernorm`` with pgconvert's ``qk_layernorm_across_heads``, as OLMo 2 / OLMoE), rotate-half RoPE
on the first ``rotary_dim`` of each head (``rotary_percent``); every layer a mixture of experts
with Mixtral's tensor names (``block_sparse_moe``: ``gate``, experts' ``w1``/``w3``/``w2``; transformers
fuses them in memory only) and no shared expert, routed by a sigmoid whose
``e_score_correction_bias`` only steers the top-k choice (megatron-core's ``mlp.router.expert_bias``,
``moe_router_score_function=sigmoid``), the chosen sigmoid scores renormalized to sum to one and
not scaled (megatron-core's ``topk_routing_with_score_function`` renormalizes for top-k > 1 only,
so top-1 routing is refused).

The partial rotary: ``rope_parameters.partial_rotary_factor``, else a top-level
``partial_rotary_factor``, else the release's ``rotary_dim`` / ``head_dim`` (``MiniMaxM2Config.
convert_rope_params_to_dict``); absent, the whole head rotates.

The release's config.json also holds keys MiniMaxM2Config does not read, whose model transformers
builds regardless: ``use_qk_norm`` (true), ``qk_norm_type`` (``per_layer``: over the projection,
not per head), ``scoring_func`` (``sigmoid``), ``use_routing_bias`` (true),
``shared_intermediate_size`` (0: no shared expert) and ``attn_type_list`` (1 = full softmax
attention in every layer; MiniMax-Text-01's 0 is lightning attention). A value that would describe
another computation is refused, naming the key. ``use_mtp``, ``num_mtp_modules`` and
``mtp_transformer_layers`` describe multi-token-prediction modules transformers does not build and
the release publishes no weights for; they change no logit of the model and are kept as they are.
"""

from __future__ import annotations

from collections.abc import Mapping

from pgconvert.io.limits import quote
from pgconvert.model.config import ModelConfig
from pgconvert.families.experts import AUX_LOSS, EVERY_LAYER_MOE, expert_count, expert_ffn_size
from pgconvert.families.llama import (
    ATTENTION_ROWS,
    EMBEDDING_ROWS,
    FINAL_ROWS,
    HEAD_DIM_NULL,
    ROPE_DEFAULT,
    ROPE_RULE,
    SWIGLU_RMS_ROPE,
    decoder_fields,
    head_dim_field,
    query_groups_field,
    read_rope,
    write_partial_rope,
)
from pgconvert.families.mixtral import MIXTRAL_MOE_ROWS
from pgconvert.families.table import ConfigField, ConfigRule, Family, TensorMapping, TensorTable, write_nothing
from pgconvert.semantics.rope import rope_parameters

# The router's correction bias sits beside the router (transformers' conversion mapping renames it
# to ``mlp.e_score_correction_bias`` in memory and back on save).
_EXPERT_BIAS_ROW = TensorMapping("decoder.layers.{}.mlp.router.expert_bias",
                                 ("model.layers.{}.block_sparse_moe.e_score_correction_bias",))
MINIMAX_M2_TENSORS = TensorTable((*EMBEDDING_ROWS, *ATTENTION_ROWS, MIXTRAL_MOE_ROWS[0], _EXPERT_BIAS_ROW,
                                  *MIXTRAL_MOE_ROWS[1:], *FINAL_ROWS))

# The keys MiniMaxM2Config ignores, as the release sets them: transformers' model computes these.
_RELEASE_KEYS: dict[str, object] = {"use_qk_norm": True, "qk_norm_type": "per_layer", "scoring_func": "sigmoid",
                                    "use_routing_bias": True, "shared_intermediate_size": 0}


def _rotary_dim(value: object, head_dim: object) -> float:
    assert isinstance(head_dim, int)
    if not isinstance(value, int) or isinstance(value, bool) or not 0 < value <= head_dim or value % 2:
        raise ValueError(f"rotary_dim={quote(value)}: expected an even integer in [2, head_dim={head_dim}]")
    return value / head_dim


def _read_rope(present: Mapping[str, object], model: Mapping[str, object]) -> Mapping[str, object]:
    """As Llama's, but with no partial_rotary_factor in rope_parameters or at the top level (a
    top-level null included: MiniMaxM2Config's ``kwargs.setdefault`` keeps it), ``rotary_dim`` /
    ``head_dim``."""
    if ("partial_rotary_factor" not in rope_parameters(present) and "partial_rotary_factor" not in present
            and "rotary_dim" in present):
        present = {**present, "partial_rotary_factor": _rotary_dim(present["rotary_dim"], model["kv_channels"])}
    return read_rope(present, model)


def _write_rope(config: ModelConfig) -> Mapping[str, object]:
    """The partial rotary in rope_parameters, and as the release's ``rotary_dim`` where it is whole."""
    rotary = config.attention.head_dim * config.positions.rotary_percent
    return {**write_partial_rope(config), "rotary_dim": int(rotary) if rotary.is_integer() else None}


_ROPE_RULE = ConfigRule(keys=(*ROPE_RULE.keys, "rotary_dim"), model_fields=ROPE_RULE.model_fields, read=_read_rope,
                        write=_write_rope, null_keys=("partial_rotary_factor",))


def _read_attention_types(present: Mapping[str, object], model: Mapping[str, object]) -> Mapping[str, object]:
    """``attn_type_list``: 1 (softmax attention) for every layer; MiniMaxM2Config ignores the key and
    builds softmax attention everywhere, so any other entry describes a model it does not compute."""
    types = present.get("attn_type_list")
    if types is not None and (not isinstance(types, list) or any(kind != 1 or isinstance(kind, bool)
                                                                 for kind in types)):
        raise ValueError(f"attn_type_list={quote(types)}: MiniMaxM2ForCausalLM computes softmax attention (1) in "
                         "every layer; lightning attention (0) has no transformers or Megatron equivalent here")
    return {}


def _write_attention_types(config: ModelConfig) -> Mapping[str, object]:
    return {"attn_type_list": [1] * config.num_layers}


def _read_top_k(present: Mapping[str, object], model: Mapping[str, object]) -> Mapping[str, object]:
    if model["moe_router_topk"] == 1:
        raise ValueError("num_experts_per_tok=1: transformers renormalizes the one chosen sigmoid score to 1, "
                         "megatron-core keeps the score (it renormalizes for top-k > 1 only); no megatron-core "
                         "equivalent")
    return {}


def _refuses_top_one(config: ModelConfig) -> str | None:
    if config.moe.moe_router_topk == 1:
        return "moe_router_topk=1 (MiniMaxM2 renormalizes the chosen sigmoid scores: needs top-k > 1)"
    return None


MINIMAX_M2 = Family(
    architecture="MiniMaxM2ForCausalLM",
    model_type="minimax_m2",
    hf_computes=frozenset({"rotary_percent", "moe_router_score_function"}),
    tensors=MINIMAX_M2_TENSORS,
    fields=(
        # MiniMaxM2Config's defaults (the release's values); it takes head_dim as given.
        *decoder_fields(max_position_embeddings=196608, norm_epsilon=1e-6, rotary_base=5e6,
                        query_groups=query_groups_field(8), head_dim=head_dim_field(128, null_refused=HEAD_DIM_NULL)),
        ConfigField(("intermediate_size",), "moe_ffn_hidden_size", int, written=expert_ffn_size),
        expert_count("num_local_experts", 256, "num_experts"),
        ConfigField(("num_experts_per_tok",), "moe_router_topk", int, default=8),
        AUX_LOSS,
    ),
    rules=(
        EVERY_LAYER_MOE,
        _ROPE_RULE,
        ConfigRule(keys=("attn_type_list",), model_fields=(), read=_read_attention_types,
                   write=_write_attention_types),
        ConfigRule(keys=(), model_fields=(), read=_read_top_k, write=write_nothing, refuses=_refuses_top_one),
    ),
    fixed={
        **SWIGLU_RMS_ROPE,
        "qk_layernorm": True,
        "qk_layernorm_across_heads": True,
        "add_qkv_bias": False,
        "add_bias_linear": False,
        "moe_shared_expert_intermediate_size": None,
        "moe_shared_expert_gate": False,
        "moe_router_enable_expert_bias": True,
        "moe_router_score_function": "sigmoid",
        "moe_router_pre_softmax": False,
        "moe_router_topk_scaling_factor": None,
        "moe_router_num_groups": None,
        "moe_router_group_topk": None,
        "rotary_interleaved": False,
        "sliding_window": None,
        "window_layers": None,
    },
    hf_fixed={"hidden_act": "silu", **_RELEASE_KEYS},
    hf_scratch=ROPE_DEFAULT,
    hf_notes={
        "rotary percent": "rope_parameters.partial_rotary_factor, else rotary_dim / head_dim (written as both)",
        "qk-norm": "always, over the whole projection (use_qk_norm=true, qk_norm_type=per_layer)",
        "moe score function": "sigmoid (fixed; scoring_func)",
        "moe pre-softmax": "never (the chosen sigmoid scores renormalized; top-1 refused)",
        "moe expert bias": "always: block_sparse_moe.e_score_correction_bias (use_routing_bias=true)",
        "moe top-k scaling": "none",
        "sliding window": "none",
    },
)
