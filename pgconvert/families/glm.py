"""GLM-4 (``Glm4ForCausalLM``), GLM-4.5-MoE (``Glm4MoeForCausalLM``) and GLM-5 (``GlmMoeDsaForCausalLM``).

GLM-4 has norms around both sublayers (HF's ``post_self_attn_layernorm`` and
``post_mlp_layernorm`` after them, ``post_attention_layernorm`` the pre-MLP norm as in Llama), q/k/v
biases, HF's own interleaved rotary over half of each head (``Family.hf_rotary_interleaved``) and a
fused ``gate_up_proj`` that is megatron-core's ``linear_fc1`` as it is.

GLM-4.5-MoE (transformers 5.24's ``models/glm4_moe``; megatron-core's ``TopKRouter`` /
``topk_routing_with_score_function`` in ``transformer/moe/moe_utils.py``) in Megatron terms:
Llama-style attention with q/k/v biases (``attention_bias``; o_proj has none) and optional per-head
qk-norm (``use_qk_norm``), RoPE on the first ``partial_rotary_factor`` of each head (rotate-half,
not interleaved: megatron-core's ``rotary_percent``); the first ``first_k_dense_replace`` layers
dense, the rest MoE with a shared expert of ``moe_intermediate_size × n_shared_experts`` and a
sigmoid router whose ``e_score_correction_bias`` only steers the choice (megatron-core's
``mlp.router.expert_bias``, ``moe_router_score_function=sigmoid``), the chosen weights renormalized
(megatron-core's sigmoid router always renormalizes for top-k > 1: ``norm_topk_prob`` is assumed
true) and scaled by ``routed_scaling_factor`` (``moe_router_topk_scaling_factor``). Its router
scores a group of experts as DeepSeek-V3's does (``pgconvert.families.deepseek.router_groups``);
its multi-token-prediction layers are ``pgconvert.families.mtp``'s.

GLM-5 (transformers' ``models/glm_moe_dsa``, zai-org/GLM-5) is built on DeepSeek-V3.2's classes
(``pgconvert.families.deepseek.DEEPSEEK_V32``: multi-latent attention with the sparse attention indexer, DeepSeek-V3's
router and shared experts, ``mlp_layer_types``) with its own defaults and an indexer that rotates its rotary dims as
interleaved pairs (megatron-core's ``dsa_indexer_rope_interleaved``, core_v0.19.0 on). Its cross-layer top-k sharing
(``indexer_types`` ``shared`` layers, which hold no indexer and reuse the previous layer's choice; megatron-core's
``dsa_indexer_topk_freq`` / ``dsa_indexer_skip_topk_offset``) is refused by name: every layer must be ``full``.
"""

from __future__ import annotations

from collections.abc import Mapping

from pgconvert.io.limits import quote
from pgconvert.model.config import ModelConfig
from pgconvert.families.deepseek import (
    DEEPSEEK_V32,
    EXPERT_BIAS_ROW,
    SHARED_EXPERTS_ROWS,
    deepseek_fields,
    dense_prefix_rule,
    indexer_fields,
    q_lora_rule,
    router_groups,
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
    partial_rope_rule,
    query_groups_field,
)
from pgconvert.families.mtp import MTP_ROWS
from pgconvert.families.olmo import PLAIN_SWIGLU
from pgconvert.families.qwen import QWEN_MOE_ROWS
from pgconvert.families.table import DROPPED, IDENTITY, QKV, ConfigField, ConfigRule, Family, TensorMapping, TensorTable

_L = "model.layers.{}."
_D = "decoder.layers.{}."
GLM4_TENSORS = TensorTable((
    TensorMapping("embedding.word_embeddings.weight", ("model.embed_tokens.weight",)),
    TensorMapping(_D + "input_layernorm.weight", (_L + "input_layernorm.weight",)),
    TensorMapping(_D + "self_attention.linear_qkv.weight", (
        _L + "self_attn.q_proj.weight", _L + "self_attn.k_proj.weight", _L + "self_attn.v_proj.weight"), QKV),
    TensorMapping(_D + "self_attention.linear_qkv.bias", (
        _L + "self_attn.q_proj.bias", _L + "self_attn.k_proj.bias", _L + "self_attn.v_proj.bias"), QKV),
    TensorMapping(_D + "self_attention.linear_proj.weight", (_L + "self_attn.o_proj.weight",)),
    TensorMapping(_D + "self_attention.linear_proj.post_layernorm.weight", (_L + "post_self_attn_layernorm.weight",)),
    TensorMapping(_D + "pre_mlp_layernorm.weight", (_L + "post_attention_layernorm.weight",)),
    # HF's fused [gate; up] is linear_fc1 row for row.
    TensorMapping(_D + "mlp.linear_fc1.weight", (_L + "mlp.gate_up_proj.weight",), IDENTITY),
    TensorMapping(_D + "mlp.linear_fc2.weight", (_L + "mlp.down_proj.weight",)),
    TensorMapping(_D + "mlp.linear_fc2.post_layernorm.weight", (_L + "post_mlp_layernorm.weight",)),
    TensorMapping("decoder.final_layernorm.weight", ("model.norm.weight",)),
    TensorMapping("output_layer.weight", ("lm_head.weight",)),
    TensorMapping(None, ("model.rotary_emb.inv_freq",), DROPPED),
))

# Glm4Config's and Glm4MoeConfig's default partial_rotary_factor.
GLM_PARTIAL_ROTARY = 0.5


GLM_ROPE_RULE = partial_rope_rule(GLM_PARTIAL_ROTARY, "GLM")


GLM4 = Family(
    architecture="Glm4ForCausalLM",
    model_type="glm4",
    hf_computes=frozenset({"rotary_percent"}),
    tensors=GLM4_TENSORS,
    fields=(
        # Glm4Config's 2 KV heads and head_dim 128 where config.json leaves them out.
        *decoder_fields(max_position_embeddings=131072, norm_epsilon=1.5625e-07, query_groups=query_groups_field(2),
                        head_dim=head_dim_field(128)),
        DENSE_FFN,
        # GLM-4's attention_bias biases q, k and v (not o_proj): Megatron's add_qkv_bias.
        ConfigField(("attention_bias",), "add_qkv_bias", bool, default=True),
    ),
    rules=(GLM_ROPE_RULE,),
    fixed={**PLAIN_SWIGLU, "num_experts": None, "qk_layernorm": False, "qk_layernorm_across_heads": False,
           "pre_layernorms": True, "post_self_attn_layernorm": True, "post_mlp_layernorm": True,
           "rotary_interleaved": True},
    hf_fixed={"hidden_act": "silu"},
    # Glm4Config's pad id 151329 is a padding_idx transformers refuses for a smaller vocab: a config
    # built from the model alone (token ids unknown) says none.
    hf_scratch={**ROPE_DEFAULT, "pad_token_id": None, "eos_token_id": None},
    hf_rotary_interleaved=True,
    hf_notes={"rotary percent": "rope_parameters.partial_rotary_factor (default 0.5)",
              "rotary interleaved": "always (HF's own rotary is interleaved: rows kept as they are)",
              "post-sublayer norms": "post_self_attn_layernorm, post_mlp_layernorm tensors (always)"},
)


# --- GLM-4.5-MoE -----------------------------------------------------------------------------------

# transformers' Glm4MoeConfig defaults.
GLM4_MOE_FIRST_DENSE = 1
GLM4_MOE_SHARED_EXPERTS = 1

GLM4_MOE_TENSORS = TensorTable((*EMBEDDING_ROWS, *ATTENTION_ROWS, *DENSE_MLP_ROWS, *QWEN_MOE_ROWS,
                                EXPERT_BIAS_ROW, *SHARED_EXPERTS_ROWS, *FINAL_ROWS, *MTP_ROWS))


def _count(value: object, key: str, low: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ValueError(f"{key}={quote(value)}: expected an integer >= {low}")
    return value


def _read_shared(present: Mapping[str, object], model: Mapping[str, object]) -> Mapping[str, object]:
    shared = _count(present.get("n_shared_experts", GLM4_MOE_SHARED_EXPERTS), "n_shared_experts", 1)
    expert = model["moe_ffn_hidden_size"]
    assert isinstance(expert, int)
    return {"moe_shared_expert_intermediate_size": shared * expert}


def _write_shared(config: ModelConfig) -> Mapping[str, object]:
    size = config.moe.moe_shared_expert_intermediate_size or 0
    return {"n_shared_experts": size // config.expert_ffn_size}


def _refuses_shared(config: ModelConfig) -> str | None:
    size = config.moe.moe_shared_expert_intermediate_size
    if size is None or size % config.expert_ffn_size:
        return (f"moe_shared_expert_intermediate_size={size} (needs a multiple of the experts' FFN size "
                f"{config.expert_ffn_size}: n_shared_experts)")
    return None


def _read_groups(present: Mapping[str, object], model: Mapping[str, object]) -> Mapping[str, object]:
    """``n_group``/``topk_group``: routing limited to the best ``topk_group`` of ``n_group`` expert
    groups. transformers' ``Glm4MoeTopkRouter`` scores a group by the sum of its top-2 biased scores,
    as DeepSeek-V3 does, so DeepSeek-V3's rule applies: megatron-core's ``group_limited_topk`` scores
    by its top ``topk // group_topk``, which agrees where that is 2 (any other setting is refused)."""
    groups = router_groups(present, model, per_group=2, defaults=(1, 1))
    return {"moe_router_num_groups": groups and groups[0], "moe_router_group_topk": groups and groups[1]}


def _write_groups(config: ModelConfig) -> Mapping[str, object]:
    return {"n_group": config.moe.moe_router_num_groups or 1, "topk_group": config.moe.moe_router_group_topk or 1}


def _refuses_groups(config: ModelConfig) -> str | None:
    chosen = config.moe.moe_router_group_topk
    if chosen and config.moe.moe_router_topk // chosen != 2:
        return (f"moe_router_group_topk={chosen} with moe_router_topk={config.moe.moe_router_topk} "
                "(Glm4Moe scores a group by its best 2 experts: needs topk // group_topk = 2)")
    return None


GLM4_MOE = Family(
    architecture="Glm4MoeForCausalLM",
    model_type="glm4_moe",
    # Router groups are scored as DeepSeek-V3's.
    hf_computes=frozenset({"rotary_percent", "moe_router_score_function",
                           "moe_router_topk_scaling_factor", "moe_router_num_groups"}),
    tensors=GLM4_MOE_TENSORS,
    fields=(
        # Glm4MoeConfig's 8 KV heads; it has no head_dim, which its attention takes as given.
        *decoder_fields(max_position_embeddings=131072, norm_epsilon=1e-5, query_groups=query_groups_field(8),
                        head_dim=head_dim_field(null_refused=HEAD_DIM_NULL)),
        DENSE_FFN,
        ConfigField(("moe_intermediate_size",), "moe_ffn_hidden_size", int, default=1408, written=expert_ffn_size),
        expert_count("n_routed_experts", 128, "num_local_experts"),
        ConfigField(("num_experts_per_tok",), "moe_router_topk", int, default=8),
        ConfigField(("routed_scaling_factor",), "moe_router_topk_scaling_factor", float, default=1.0),
        ConfigField(("use_qk_norm",), "qk_layernorm", bool, default=False),
        # q, k and v only: o_proj never has a bias.
        ConfigField(("attention_bias",), "add_qkv_bias", bool, default=False),
    ),
    rules=(
        dense_prefix_rule(default_dense=GLM4_MOE_FIRST_DENSE),
        ConfigRule(keys=("n_shared_experts",), model_fields=("moe_shared_expert_intermediate_size",),
                   read=_read_shared, write=_write_shared, refuses=_refuses_shared),
        ConfigRule(keys=("n_group", "topk_group"), model_fields=("moe_router_num_groups", "moe_router_group_topk"),
                   read=_read_groups, write=_write_groups, refuses=_refuses_groups),
        GLM_ROPE_RULE,
    ),
    fixed={
        **SWIGLU_RMS_ROPE,
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
    # Its MTP layers (layers num_hidden_layers + i, pgconvert.families.mtp), written from mtp_num_layers.
    hf_mtp_layers_key="num_nextn_predict_layers",
    hf_notes={
        "rotary percent": "rope_parameters.partial_rotary_factor (default 0.5; carried both ways)",
        "qk-norm": "use_qk_norm", "linear biases": "attention_bias (q/k/v only: add_qkv_bias)",
        "moe score function": "sigmoid (fixed)",
        "moe pre-softmax": ("norm_topk_prob (assumed true: megatron-core's sigmoid router renormalizes; "
                            "false: notice, --strict refuses)"),
        "moe expert bias": "always: mlp.gate.e_score_correction_bias (fp32)",
        "moe top-k scaling": "routed_scaling_factor",
    },
)


_FULL = "full"


def _indexer_types(present: Mapping[str, object], layers: int) -> object:
    """``indexer_types`` as GlmMoeDsaConfig resolves it: given, else from ``index_topk_pattern`` (F full, S shared),
    else every ``index_topk_freq``-th layer from ``index_skip_topk_offset`` on full (1 and 2: all full)."""
    if present.get("indexer_types") is not None:
        return present["indexer_types"]
    pattern = present.get("index_topk_pattern")
    if isinstance(pattern, str):
        return [{"F": _FULL, "S": "shared"}.get(symbol, symbol) for symbol in pattern]
    if pattern is not None:
        return pattern
    freq, offset = present.get("index_topk_freq", 1), present.get("index_skip_topk_offset", 2)
    if not isinstance(freq, int) or not isinstance(offset, int):
        raise ValueError(f"index_topk_freq={quote(freq)}, index_skip_topk_offset={quote(offset)}: expected integers")
    return [_FULL if max(layer - offset + 1, 0) % max(freq, 1) == 0 else "shared" for layer in range(layers)]


def _indexer_types_read(present: Mapping[str, object], model: Mapping[str, object]) -> Mapping[str, object]:
    layers = model["num_layers"]
    assert isinstance(layers, int)
    types = _indexer_types(present, layers)
    if not isinstance(types, list) or len(types) != layers or any(kind != _FULL for kind in types):
        raise ValueError(f"indexer_types={quote(types)}: GLM-5's cross-layer top-k sharing ('shared' layers reuse an "
                         f"earlier layer's choice and hold no indexer) is not converted; every one of the {layers} "
                         "layers must be 'full'")
    return {}


def _indexer_types_write(config: ModelConfig) -> Mapping[str, object]:
    return {"indexer_types": [_FULL] * config.num_layers}


# Every layer runs its own indexer; the keys GlmMoeDsaConfig derives indexer_types from are read as it does.
_FULL_INDEXERS = ConfigRule(keys=("indexer_types",), model_fields=(), read=_indexer_types_read,
                            write=_indexer_types_write,
                            legacy_keys=("index_topk_pattern", "index_topk_freq", "index_skip_topk_offset"))

GLM_MOE_DSA = DEEPSEEK_V32.derive(
    "GlmMoeDsaForCausalLM", "glm_moe_dsa",
    # GlmMoeDsaConfig's defaults (GLM-5).
    fields=(*deepseek_fields(experts=256, experts_alias="num_local_experts", topk=8, max_positions=202752,
                             query_groups=64, norm_epsilon=1e-5, head_dims=(192, 256)), *indexer_fields(heads=32)),
    rules=(q_lora_rule(default=2048), sigmoid_group_router(groups=(1, 1), scaling=2.5), _FULL_INDEXERS),
    # Its indexer rotates interleaved pairs (apply_rotary_pos_emb_interleave), as its multi-latent attention does.
    fixed={"dsa_indexer_rope_interleaved": True},
)
